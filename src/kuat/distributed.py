"""Rank and world size: the one place kuat resolves them, and who reads what.

**Who reads what.** ``kuat.DataLoader`` never shards by itself, as torch's DataLoader: without
a sampler every rank reads every sample, and a sampler a framework injects (Lightning's and
Fabric's ``DistributedSampler``, Accelerate's ``BatchSamplerShard``) or the user passes decides
the share. kuat's own sharding is asked for explicitly, as a :class:`Sharding`:

* ``rank=``/``world_size=``: this process reads share ``rank`` of ``world_size``;
* ``mesh=`` (a ``torch.distributed.device_mesh.DeviceMesh``), with ``dp_dims=`` or the
  dimensions named like data parallelism (:data:`DP_DIM_NAMES`): the share is the row-major
  flattening of this rank's coordinate over those dimensions (:func:`mesh_share`); ranks that
  differ only along the other dimensions (tensor, pipeline, context parallel) are replicas and
  read identical batches;
* ``shard=True``: the share of the global rank, by the rule below (what kuat did by default
  before: torchrun without a framework).

The global rank (``shard=True``, the samplers that shard like ``DistributedSampler`` such as
``kuat.text.TokenBudgetBatchSampler`` without ``rank=``), in order:

1. an explicit ``rank=``/``world_size=`` pair given to the consumer (checked by
   :func:`check_explicit`);
2. ``torch.distributed`` when it is available and its default process group is initialised
   (``get_rank()``, ``get_world_size()``);
3. the ``RANK``/``WORLD_SIZE`` environment variables, when both are set (torchrun, Lightning's
   and Accelerate's launchers set them before ``init_process_group``), with one warning per
   process when ``WORLD_SIZE > 1`` (the process group is not up yet);
4. otherwise rank 0 of 1.

Resolution is cheap (a few microseconds) and is done again whenever a consumer needs it (each
epoch start), so an object built before ``init_process_group`` reads the group's answer
later. Thread-safe.
"""

from __future__ import annotations

import logging
import os

__all__ = ["DP_DIM_NAMES", "Sharding", "check_explicit", "from_environment", "mesh_dp_dims",
           "mesh_share", "resolve", "sharding", "torch_group"]

log = logging.getLogger("kuat.distributed")

_warned_env = False  # the RANK/WORLD_SIZE warning, once per process


def check_explicit(rank, world_size) -> tuple[int | None, int | None]:
    """Validate an explicit ``rank``/``world_size`` pair: both ints, or both ``None``.

    Returns:
        ``(rank, world_size)`` as Python ints, or ``(None, None)``.

    Raises:
        ValueError: only one of them given, ``world_size < 1`` or ``rank`` outside
            ``[0, world_size)``.
        TypeError: a value that is not an int (``bool`` included).
    """
    import numpy as np

    if (rank is None) != (world_size is None):
        raise ValueError(f"give both rank and world_size or neither, got {rank=} {world_size=}")
    if rank is None:
        return None, None
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} should be an int or None, got {name}={value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank should be in [0, world_size), got {rank=} {world_size=}")
    return int(rank), int(world_size)


def resolve(rank: int | None = None, world_size: int | None = None, *,
            warn: bool = False) -> tuple[int, int]:
    """``(rank, world_size)`` by the module's rule; an explicit pair wins.

    Args:
        rank, world_size: the consumer's explicit values (already checked), or ``None``.
        warn: log the one-per-process warning when the answer comes from the environment.

    Raises:
        ValueError: ``RANK``/``WORLD_SIZE`` are set but are not ints, or out of range.
    """
    if rank is not None and world_size is not None:
        return rank, world_size
    import torch

    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return from_environment(warn)


def from_environment(warn: bool = False) -> tuple[int, int]:
    """``(rank, world_size)`` from ``RANK``/``WORLD_SIZE``; ``(0, 1)`` when either is unset.

    Raises:
        ValueError: the variables are not ints, or ``RANK`` is outside ``[0, WORLD_SIZE)``.
    """
    global _warned_env
    rank, world_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world_size is None:
        return 0, 1
    try:
        rank, world_size = int(rank), int(world_size)
    except ValueError as e:
        raise ValueError(f"RANK={rank!r} and WORLD_SIZE={world_size!r} should be ints") from e
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"environment RANK={rank} should be in [0, WORLD_SIZE={world_size})")
    if warn and world_size > 1 and not _warned_env:
        _warned_env = True
        log.warning("kuat.DataLoader: torch.distributed is not initialised; reading rank %d of "
                    "%d from the RANK/WORLD_SIZE environment variables", rank, world_size)
    return rank, world_size


def torch_group() -> tuple[int, int]:
    """``(rank, world_size)`` of torch's default process group, ``(0, 1)`` when none is
    initialised: the rule torch's DataLoader applies to an ``IterDataPipe``'s
    ``sharding_filter`` (``torch.utils.data.dataloader._get_distributed_settings``)."""
    import torch

    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# Dimension names taken as data parallel when mesh= is given without dp_dims= (torchtitan's
# dp_replicate/dp_shard, the flattened "dp", DDP/FSDP/HSDP names, JAX-style "batch").
DP_DIM_NAMES = ("dp", "dp_replicate", "dp_shard", "data_parallel", "batch", "ddp", "fsdp", "hsdp")


def mesh_share(mesh, dp_dims=None) -> tuple[int, int]:
    """This process's data-parallel ``(rank, size)`` on a ``DeviceMesh``.

    Args:
        mesh: a ``torch.distributed.device_mesh.DeviceMesh`` this process belongs to.
        dp_dims: the data-parallel dimensions, by name or index, in any order (a str or int for
            one); ``None``: every dimension whose name is in :data:`DP_DIM_NAMES`.

    Returns:
        ``(rank, size)``: ``size`` is the product of the data-parallel dimensions' sizes and
        ``rank`` the row-major flattening of this process's coordinate over them, taken in the
        mesh's own dimension order (so ``("dp_replicate", "dp_shard")`` flattens as
        torchtitan's ``dp`` mesh does). Every other dimension replicates.

    Raises:
        ValueError: no dimension is data parallel (naming the mesh's dimensions), a name or
            index in ``dp_dims`` is not in the mesh, a dimension is given twice, or this process
            is not part of ``mesh``.
        TypeError: ``mesh`` is not a ``DeviceMesh``.
    """
    coordinate = getattr(mesh, "get_coordinate", None)
    if not callable(coordinate) or not hasattr(mesh, "mesh"):
        raise TypeError(f"mesh should be a torch.distributed.device_mesh.DeviceMesh, got "
                        f"{type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    shape = tuple(mesh.mesh.shape)
    dims = _dp_dim_indices(names, shape, dp_dims)
    coord = coordinate()
    if coord is None:
        raise ValueError(f"this process (global rank {_global_rank()}) is not part of the "
                         f"DeviceMesh {names or shape} given as mesh=")
    rank, size = 0, 1
    for d in dims:  # row-major over the data-parallel dimensions, in mesh order
        rank, size = rank * shape[d] + int(coord[d]), size * shape[d]
    return rank, size


def mesh_dp_dims(mesh, dp_dims=None) -> list[int]:
    """The indices of ``mesh``'s data-parallel dimensions, ascending (as :func:`mesh_share`
    reads ``dp_dims``); every other dimension replicates. Raises as :func:`mesh_share`."""
    return _dp_dim_indices(tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.shape), dp_dims)


def _dp_dim_indices(names: tuple, shape: tuple, dp_dims) -> list[int]:
    described = ", ".join(f"{n}={k}" for n, k in zip(names, shape)) if names else str(shape)
    if dp_dims is None:
        dims = [i for i, n in enumerate(names) if n in DP_DIM_NAMES]
        if not dims:
            raise ValueError(
                f"mesh=: none of the DeviceMesh's dimensions ({described}) is data parallel by "
                f"name (one of {', '.join(DP_DIM_NAMES)}); pass dp_dims= naming the ones that "
                "split the data (every other dimension reads the same batches)")
        return dims
    wanted = (dp_dims,) if isinstance(dp_dims, (str, int)) else tuple(dp_dims)
    dims = []
    for d in wanted:
        if isinstance(d, str) and d in names:
            i = names.index(d)
        elif isinstance(d, int) and not isinstance(d, bool) and 0 <= d < len(shape):
            i = d
        else:
            raise ValueError(f"dp_dims={dp_dims!r}: {d!r} is not a dimension of the DeviceMesh "
                             f"({described})")
        if i in dims:
            raise ValueError(f"dp_dims={dp_dims!r} names dimension {d!r} twice")
        dims.append(i)
    return sorted(dims)


def _global_rank() -> int:
    return torch_group()[0]


class Sharding:
    """Which share of each epoch this process reads (see the module docstring).

    Built by :func:`sharding` from a loader's arguments; :meth:`resolve` gives ``(rank,
    world_size)`` now (``(0, 1)`` when unsharded). ``sharded`` says whether kuat splits at all.
    ``mesh`` shares are resolved once (a mesh does not change); the global rank again at every
    call (cheap), so a loader built before ``init_process_group`` reads the group later.
    Thread-safe.
    """

    __slots__ = ("kind", "rank", "world_size", "mesh", "dp_dims", "_mesh_share")

    def __init__(self, kind: str, rank=None, world_size=None, mesh=None, dp_dims=None):
        self.kind = kind  # "none" | "explicit" | "global" | "mesh"
        self.rank, self.world_size, self.mesh, self.dp_dims = rank, world_size, mesh, dp_dims
        self._mesh_share = None

    @property
    def sharded(self) -> bool:
        return self.kind != "none"

    def resolve(self, warn: bool = False) -> tuple[int, int]:
        if self.kind == "none":
            return 0, 1
        if self.kind == "explicit":
            return self.rank, self.world_size
        if self.kind == "mesh":
            if self._mesh_share is None:
                self._mesh_share = mesh_share(self.mesh, self.dp_dims)
            return self._mesh_share
        return resolve(warn=warn)

    def __repr__(self) -> str:
        return f"Sharding({self.kind!r}, rank={self.rank}, world_size={self.world_size})"


def sharding(rank=None, world_size=None, mesh=None, dp_dims=None, shard=None) -> Sharding:
    """A loader's :class:`Sharding` from its ``rank``, ``world_size``, ``mesh``, ``dp_dims``
    and ``shard`` arguments (checked here; errors at construction, as torch's).

    Raises:
        ValueError: more than one way given (``rank=`` with ``mesh=``, ``shard=False`` with
            either), ``dp_dims=`` without ``mesh=``, or a bad pair (:func:`check_explicit`); a
            mesh that names no data-parallel dimension (:func:`mesh_share`).
        TypeError: ``shard`` is not a bool or ``None``; a bad ``rank``/``world_size`` type.
    """
    if shard is not None and not isinstance(shard, bool):
        raise TypeError(f"shard should be a bool or None, got {shard=!r}")
    rank, world_size = check_explicit(rank, world_size)
    if dp_dims is not None and mesh is None:
        raise ValueError("dp_dims= names dimensions of mesh=; pass the DeviceMesh as mesh=")
    given = [name for name, v in (("rank=/world_size=", rank), ("mesh=", mesh)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give one of {' and '.join(given)}: both say which share this "
                         "process reads")
    if shard is False and given:
        raise ValueError(f"shard=False contradicts {given[0]}: drop one of them")
    if rank is not None:
        return Sharding("explicit", rank, world_size)
    if mesh is not None:
        spec = Sharding("mesh", mesh=mesh, dp_dims=dp_dims)
        spec.resolve()  # a misconfigured mesh raises now, naming it
        return spec
    if shard:
        resolve()  # RANK/WORLD_SIZE errors surface at construction
        return Sharding("global")
    return Sharding("none")
