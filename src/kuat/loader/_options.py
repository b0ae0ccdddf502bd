"""The loader's arguments, checked once: torch's checks in torch's order and words, then kuat's.

:func:`check_arguments` validates and normalises every ``DataLoader.__init__`` argument and
returns :class:`LoaderOptions` (frozen); :class:`SourceTraits` (frozen) is what the source can
do, asked of :mod:`kuat.sources.protocol` once, when the loader is built. Nothing here starts
work or reads global state except ``torch.cuda``/accelerator availability.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kuat import distributed
from kuat.device import accelerator_available
from kuat.engine.job import per_sample_getitems
from kuat.sources import protocol as _protocol

__all__ = ["LoaderOptions", "SourceTraits", "check_arguments", "check_device",
           "check_equal_steps", "is_iter_datapipe", "resolve_pin", "wrap_datapipe"]


@dataclass(frozen=True)
class LoaderOptions:
    """The loader's fixed choices, from ``DataLoader.__init__``'s arguments after checking.

    Only what the loader derives and reads later; the arguments it keeps as they were
    (``num_workers``, ``timeout``, ``on_error``, ...) are its public attributes, which a caller
    may set again, so they are not copied here."""

    prefetch_factor: int | None  # 2 with workers when not given (as torch), None without
    adaptive_prefetch: bool  # workers and prefetch_factor not given: kuat may prefetch deeper
    worker_type: str  # "thread" or "process" (the first engine's)
    auto_worker_type: bool  # worker_type=None with workers: may move to processes
    device: torch.device | None  # a CUDA device, or None (host batches)
    sharding: distributed.Sharding  # who reads what: unsharded unless asked (kuat.distributed)
    seed: int | None
    seed_was_none: bool  # the first epoch's base_seed draw becomes the seed
    pin: bool  # pin batches (pin_memory, or a CUDA device), an accelerator being present
    replicas: str = "read"  # "read": every rank reads; "broadcast": a leader per replica group
    replica_check_every: int | None = None  # compare replicas' batch hashes every N batches
    exact_eval: bool = False  # every sample once over the ranks, padding flagged (sampling.py)


@dataclass(frozen=True)
class SourceTraits:
    """What the loader's source can do (:mod:`kuat.sources.protocol`), asked once, when the
    loader is built. (The two hooks the protocol says are read at each epoch start,
    ``kuat_prefetch`` and ``kuat_splits_batches``, are asked by :mod:`kuat.loader._epoch`.)

    ``own_sampler``: the loader built its own sampler (no ``sampler``/``batch_sampler`` given,
    map-style), so it shards, orders and resumes indices itself.
    """

    iterable: bool
    own_sampler: bool
    batch_fetch: bool  # __getitems__, one call per batch (and not a per-sample Subset chain)
    collated_fetch: bool  # kuat_fetch_collated (through torch's wrappers)
    uses_sample_rng: bool  # draws only from kuat.sample_rng
    batching: bool  # kuat_set_batching (iterable)
    distributed: bool  # kuat_set_distributed (iterable)
    stateful: bool  # state_dict / load_state_dict
    plan_state: bool  # kuat_state_at (iterable)
    resumable: bool  # kuat_iter_from (iterable)
    batch_transform: Callable[[Any], Any] | None

    @classmethod
    def of(cls, source, *, iterable: bool, own_sampler: bool) -> SourceTraits:
        p = _protocol
        return cls(
            iterable=iterable,
            own_sampler=own_sampler,
            batch_fetch=p.provides(source, p.BatchFetch) and not per_sample_getitems(source),
            collated_fetch=p.fetch_collated(source) is not None,
            uses_sample_rng=p.uses_sample_rng(source),
            batching=p.provides(source, p.Batching),
            distributed=p.provides(source, p.Distributed),
            stateful=p.provides(source, p.Stateful),
            plan_state=p.provides(source, p.PlanState),
            resumable=p.provides(source, p.ResumableIterable),
            batch_transform=p.batch_transform(source),
        )


def check_device(device) -> torch.device | None:
    """``None`` for host batches, else the CUDA device; ``ValueError`` for anything else."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device should be None, 'cpu' or a CUDA device, got {device=!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} but CUDA is not available on this machine "
            "(torch.cuda.is_available() is False); pass device=None or 'cpu'"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device should be None, 'cpu' or a CUDA device, got {device=!r}")
    return None if dev.type == "cpu" else dev


def check_torch_workers(num_workers, timeout, prefetch_factor, persistent_workers):
    """torch's checks of the worker arguments, in torch's order and words; returns
    ``(prefetch_factor, adaptive)`` (2 with workers when not given, as torch)."""
    if num_workers < 0:
        raise ValueError(
            "num_workers option should be non-negative; "
            "use num_workers=0 to disable multiprocessing."
        )
    if timeout < 0:
        raise ValueError("timeout option should be non-negative")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing."
            "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
        )
    adaptive = prefetch_factor is None
    if num_workers > 0 and prefetch_factor is None:
        prefetch_factor = 2
    elif prefetch_factor is not None and prefetch_factor < 0:
        raise ValueError("prefetch_factor option should be non-negative")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    return prefetch_factor, adaptive


def is_iter_datapipe(dataset) -> bool:
    """Whether ``dataset`` is a ``torch.utils.data.IterDataPipe`` (torch's DataLoader shuffles,
    seeds and shards its graph: ``torch.utils.data.graph_settings``)."""
    from torch.utils.data import IterDataPipe

    return isinstance(dataset, IterDataPipe)


def wrap_datapipe(dataset, shuffle):
    """What torch's DataLoader does to a DataPipe it is given: wrap it for pickling (so
    ``loader.dataset`` is the wrapper, as torch's) and, for an ``IterDataPipe`` with
    ``shuffle`` given, turn its shufflers on or off (``apply_shuffle_settings``)."""
    from torch.utils.data import IterDataPipe, MapDataPipe
    from torch.utils.data.datapipes.datapipe import (
        _IterDataPipeSerializationWrapper,
        _MapDataPipeSerializationWrapper,
    )
    from torch.utils.data.graph_settings import apply_shuffle_settings

    if isinstance(dataset, IterDataPipe):
        wrapped = _IterDataPipeSerializationWrapper(dataset)
        if shuffle is not None:  # torch: on the graph the wrapper holds
            apply_shuffle_settings(dataset, shuffle=shuffle)
        return wrapped
    if isinstance(dataset, MapDataPipe):
        return _MapDataPipeSerializationWrapper(dataset)
    return dataset


def check_torch_sampling(iterable, shuffle, sampler, batch_sampler, batch_size, drop_last,
                         datapipe=False):
    """torch's checks of the sampling arguments, in torch's order and words; returns
    ``(shuffle, batch_size, drop_last)`` as torch normalises them. ``datapipe``: an
    ``IterDataPipe``, whose ``shuffle`` torch applies to its graph (:func:`wrap_datapipe`)."""
    if iterable:
        if shuffle not in {False, None} and not datapipe:
            raise ValueError(
                f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
            )
        if sampler is not None:
            raise ValueError(
                f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}"
            )
        elif batch_sampler is not None:
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified "
                f"batch_sampler option, but got batch_sampler={batch_sampler}"
            )
    else:
        shuffle = bool(shuffle)
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive "
                "with batch_size, shuffle, sampler, and "
                "drop_last"
            )
        batch_size = None
        drop_last = False
    elif batch_size is None:
        if drop_last:
            raise ValueError(
                "batch_size=None option disables auto-batching "
                "and is mutually exclusive with drop_last"
            )
    return shuffle, batch_size, drop_last


def check_arguments(*, num_workers, timeout, prefetch_factor, persistent_workers, worker_type,
                    on_error, seed, snapshot_every_n_steps, device, rank,
                    world_size, mesh=None, dp_dims=None, shard=None, replicas="read",
                    replica_check_every=None, exact_eval=False) -> LoaderOptions:
    """Every argument but the dataset and sampling ones, checked (torch's first)."""
    prefetch_factor, adaptive = check_torch_workers(num_workers, timeout, prefetch_factor,
                                                    persistent_workers)
    if worker_type not in (None, "thread", "process"):
        raise ValueError(
            f"worker_type should be None, 'thread' or 'process', got {worker_type=}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error should be 'raise' or 'skip', got {on_error=}")
    if timeout > 0 and num_workers == 0:
        raise ValueError(
            f"timeout={timeout} needs num_workers > 0: with num_workers=0 batches are loaded "
            "in the calling thread, which cannot time out (torch fails at iteration)"
        )
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError(f"seed should be an int or None, got {seed=!r}")
    if snapshot_every_n_steps is not None and (
        isinstance(snapshot_every_n_steps, bool) or not isinstance(snapshot_every_n_steps, int)
        or snapshot_every_n_steps < 0
    ):  # torchdata reads 0 (and None) as "no periodic snapshot"; kuat is exact at every batch
        raise ValueError(
            "snapshot_every_n_steps should be a non-negative int or None, got "
            f"{snapshot_every_n_steps=!r}"
        )
    dev = check_device(device)
    if not isinstance(exact_eval, bool):
        raise TypeError(f"exact_eval should be a bool, got {exact_eval=!r}")
    spec = distributed.sharding(rank, world_size, mesh, dp_dims, shard)
    check_replicas(spec, seed, replicas, replica_check_every)
    return LoaderOptions(
        prefetch_factor=prefetch_factor,
        adaptive_prefetch=adaptive,
        worker_type="thread" if worker_type is None else worker_type,
        auto_worker_type=worker_type is None and num_workers > 0,
        device=dev,
        sharding=spec,
        seed=None if seed is None else int(seed),
        seed_was_none=seed is None,
        pin=False,  # resolve_pin, after the sampling arguments are checked (torch's order)
        replicas=replicas,
        replica_check_every=replica_check_every,
        exact_eval=exact_eval,
    )


def check_replicas(spec, seed, replicas, replica_check_every) -> None:
    """``replicas`` and ``replica_check_every`` (:mod:`kuat.replicas`), and ``seed=`` with
    ``mesh=``: ``seed=None`` would take each rank's seed from its own torch default generator
    (often seeded per rank), so replicas could shuffle and augment differently; kuat asks for
    the seed rather than agree on one by a collective that ranks without a loader (middle
    pipeline stages) or a rank calling ``state_dict()`` alone would never join."""
    if replicas not in ("read", "broadcast"):
        raise ValueError(f"replicas should be 'read' or 'broadcast', got {replicas=!r}")
    if replica_check_every is not None and (
            isinstance(replica_check_every, bool) or not isinstance(replica_check_every, int)
            or replica_check_every < 1):
        raise ValueError("replica_check_every should be a positive int (batches) or None, got "
                         f"{replica_check_every=!r}")
    if spec.kind == "mesh" and seed is None:
        raise ValueError(
            "mesh= needs seed= (the same int on every rank): with seed=None each rank would "
            "take its seed from its own torch default generator, and ranks that differ only "
            "along the mesh's other dimensions (replicas) could shuffle and augment "
            "differently")


def check_equal_steps(opts: LoaderOptions, traits: SourceTraits, source, *, sampler,
                      batch_sampler, batch_size, drop_last, on_error, in_order=True) -> None:
    """What kuat's sharding (every rank the same number of batches) and ``exact_eval`` (every
    sample once, padding flagged) need of the source and the sampling arguments, checked at
    construction (``docs/distributed.md``, "Equal steps and exact evaluation"). ``sampler`` and
    ``batch_sampler`` are the user's (``None`` when not given).

    Raises:
        ValueError: naming what cannot be served in equal steps (or exactly) and why.
    """
    name = type(source).__name__
    if opts.exact_eval:
        why = None
        if traits.iterable:
            why = (f"the dataset ({name}) is an IterableDataset: its samples cannot be counted "
                   "and laid out ahead; use a map-style dataset")
        elif sampler is not None or batch_sampler is not None:
            why = ("a sampler/batch_sampler given decides the order and shares itself; leave "
                   "both out so the loader lays the epoch out")
        elif batch_size is None or drop_last:
            why = f"it needs batch_size >= 1 and drop_last=False, got {batch_size=} {drop_last=}"
        elif on_error == "skip":
            why = "on_error='skip' drops samples; use on_error='raise'"
        elif not in_order:
            why = ("in_order=False may yield the padded last batch before others, where "
                   "gather_for_metrics would not truncate it; use in_order=True")
        if why is not None:
            raise ValueError(f"exact_eval=True serves every sample exactly once: {why}")
    if opts.sharding.sharded and not traits.iterable:
        _check_sampler_takes_a_share(sampler, batch_sampler, opts.sharding)
    if not opts.sharding.sharded or not traits.iterable:
        return
    how = "kuat's sharding (rank=/world_size=, mesh=, shard=True)"
    if not traits.distributed:
        raise ValueError(
            f"{how} gives every rank the same number of batches, but {name} is an "
            "IterableDataset kuat cannot split: it does not take a share "
            "(kuat_set_distributed), so how many samples each rank would yield is unknown, "
            "and a rank a step short hangs the others' collectives. Either split it in its "
            "__iter__ (by torch.distributed's rank) and drop kuat's sharding, or make it a "
            "kuat.sources.stream.Stream (samples(epoch); kuat.mix([it]) wraps any iterable)")
    reason = _protocol.unequal_shares(source)
    if reason:
        raise ValueError(f"{how} gives every rank the same number of batches, but {name} "
                         f"cannot: {reason}")
    if on_error == "skip":
        raise ValueError(
            f"{how} over an IterableDataset ({name}) with on_error='skip': a skipped sample "
            "changes how many batches this rank yields (a failing generator ends), and a "
            "rank a step short hangs the others' collectives; use on_error='raise'")


def _takes_a_share(s) -> bool:
    """A sampler that decides its rank's share itself: a ``DistributedSampler``, one with a rank
    and a number of ranks (``kuat.ShardShuffleSampler``), or one the loader gives its share to
    (``kuat_set_distributed``: ``kuat.TokenBudgetBatchSampler``)."""
    return (isinstance(s, torch.utils.data.DistributedSampler)
            or callable(getattr(s, "kuat_set_distributed", None))
            or any(hasattr(s, r) and hasattr(s, w) for r, w in _SHARE_ATTRS))


# (rank, number of ranks) attribute names: DistributedSampler's, Accelerate's, kuat's
_SHARE_ATTRS = (("rank", "num_replicas"), ("process_index", "num_processes"), ("rank", "world_size"))


def _wrapped(s, depth: int = 4):
    """``s`` and the samplers it wraps (``sampler``/``batch_sampler``/``_batch_sampler``:
    torch's ``BatchSampler``, Accelerate's ``SkipBatchSampler``, Lightning's predict wrapper),
    ``depth`` levels down."""
    yield s
    if depth:
        for attr in ("sampler", "batch_sampler", "_batch_sampler"):
            inner = getattr(s, attr, None)
            if inner is not None and inner is not s:
                yield from _wrapped(inner, depth - 1)


def _declared_share(s) -> tuple[int, int] | None:
    """``(rank, world_size)`` a sampler says it reads, where it says one."""
    for r, w in _SHARE_ATTRS:
        rank, world = getattr(s, r, None), getattr(s, w, None)
        if isinstance(rank, int) and isinstance(world, int):
            return rank, world
    return None


def _check_sampler_takes_a_share(sampler, batch_sampler, sharding) -> None:
    """Under kuat's sharding, a user's sampler (or batch sampler, or the sampler inside it)
    must take this rank's share; one that does not would give every rank every sample, the
    rank silently ignored. ``ValueError`` naming it; also (explicit ``rank=``/``world_size=``)
    when one says it reads another share than the loader's."""
    given = batch_sampler if batch_sampler is not None else sampler
    if given is not None and sharding.kind == "explicit":
        pair = (sharding.rank, sharding.world_size)
        for s in _wrapped(given):
            declared = _declared_share(s)
            if declared is not None and declared != pair:
                raise ValueError(
                    f"kuat.DataLoader(rank={pair[0]}, world_size={pair[1]}) was given a "
                    f"{type(s).__name__} that reads share {declared[0]} of {declared[1]}: "
                    "build the sampler with the loader's rank and world size")
    if given is None or _takes_a_share(given) or any(
            # one inside a wrapper: the loader gives its share only to the batch sampler it
            # holds (kuat_set_distributed), so an inner one must have its rank already
            _takes_a_share(s) and (getattr(s, "kuat_set_distributed", None) is None
                                   or getattr(s, "rank", None) is not None)
            for s in _wrapped(given)):
        return
    raise ValueError(
        f"kuat's sharding (rank=/world_size=, mesh=, shard=True) shards the loader's own "
        f"sampler, but a {type(given).__name__} was given, which does not take a rank's share: "
        "every rank would read all of its indices. Give a sampler that shards, e.g. "
        "torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank) (or a "
        "batch sampler over one), or leave the sampler out (shuffle=, seed=) for kuat's own")


def resolve_pin(pin_memory: bool, pin_memory_device: str, device: torch.device | None) -> bool:
    """Whether batches are pinned: ``pin_memory`` (or a CUDA ``device``) with an accelerator
    present; torch's warnings for a deprecated ``pin_memory_device`` and a missing accelerator."""
    if pin_memory and pin_memory_device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the device,"
            f"ignore pin_memory_device='{pin_memory_device}'.",
            stacklevel=3,
        )
    if pin_memory or (device is not None and device.type == "cuda"):
        if accelerator_available():
            return True
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, "
            "then device pinned memory won't be used.",
            stacklevel=3,
        )
    return False
