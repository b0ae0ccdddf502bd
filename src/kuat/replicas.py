"""Replica groups: ranks that read the same share of every epoch, fed and checked together.

A *replica group* is the set of ranks of a loader's process group that read the same share:
on ``mesh=``, the ranks that differ only along the dimensions that are not data parallel
(tensor, pipeline, context parallel); otherwise the ranks whose share (``loader.rank``) is
equal (unsharded, every rank of the default process group). kuat makes replicas identical by
construction: the order depends only on ``(seed, epoch, share)`` and each sample's randomness
on ``(seed, epoch, index)`` (:mod:`kuat.rng`), whatever the workers. Two loader arguments use
the groups:

* ``replicas="broadcast"``: one leader per group (its first rank: coordinate 0 along every
  replica dimension, or the lowest global rank) reads; it sends each collated batch to its
  peers, which read nothing (no workers start on them). Each batch is one uint8 message
  (``torch.distributed.broadcast`` of its two sizes, then of it; on the process group's
  device: CPU for gloo, the current CUDA device for NCCL): the tensors' bytes, then a pickled
  header with the structure, shapes, dtypes and other values; the end of the epoch and the
  dataset's errors travel as headers too, so no peer waits forever. Default ``"read"``:
  every rank reads.
* ``replica_check_every=N``: every ``N`` batches, every rank all-gathers ``(rank, share,
  step, hash)`` (a 64-bit xxh3 of the tensors' bytes, shapes and dtypes and the other values
  of the batches since the last check, :func:`batch_hash`), over the mesh or the default
  process group, and raises :class:`ReplicaMismatchError` naming the ranks that differ; every
  rank joins and every rank raises, so no rank is left waiting in a collective.

On a mesh, the collectives run over the mesh's own per-dimension groups (made by
``init_device_mesh``; no new group), so a pipeline stage can pass its own sub-mesh
(``world_mesh["dp", "tp"]``) and stages that build no loader take no part. Without a mesh they
run over the default process group (with one ``new_group`` per share, made on every rank, for
``"broadcast"`` between several shares): every rank must build and iterate the loader. With
``torch.distributed`` not initialised, there is one rank: nothing is sent nor checked.

Both run in the consumer thread, inside ``next()``, on every rank of the group in the same
order: every rank must iterate the loader to the same step (kuat's shares give equal steps).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from kuat import distributed

__all__ = ["ReplicaFeed", "ReplicaGroup", "ReplicaMismatchError", "batch_hash", "feed_for"]

log = logging.getLogger("kuat.replicas")

_ALIGN = 64  # bytes: each tensor starts aligned in the broadcast buffer (a view of any dtype)


class ReplicaMismatchError(RuntimeError):
    """Replicas (ranks that read the same share) fetched different batches; raised on every
    rank at the check that saw it. ``groups``: ``{share: {hash: [global ranks]}}`` of the
    shares that differ."""

    def __init__(self, message: str, groups: dict):
        super().__init__(message)
        self.groups = groups


def batch_hash(batch, h=None):
    """Add ``batch`` to an ``xxhash.xxh3_64`` (a new one when ``h`` is ``None``) and return it.

    Hashed: the structure (mappings with their keys, in order; sequences; their lengths), each
    tensor's dtype, shape and bytes (copied to the host first when on an accelerator), each
    NumPy array's dtype, shape and bytes, and other values by their pickle (by type name when
    they do not pickle). Equal batches give equal hashes on any host of the same byte order.
    Thread-safe (``h`` is the caller's).
    """
    h = xxhash.xxh3_64() if h is None else h
    if isinstance(batch, torch.Tensor):
        t = batch.detach()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.device.type != "cpu":
            t = t.cpu()
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # (numel * itemsize,) u8
    elif isinstance(batch, np.ndarray):
        h.update(f"A{batch.dtype.str}{batch.shape}".encode())
        h.update(np.ascontiguousarray(batch).reshape(-1).view(np.uint8))
    elif isinstance(batch, Mapping):
        h.update(f"M{len(batch)}".encode())
        for k, v in batch.items():
            batch_hash(k, h)
            batch_hash(v, h)
    elif isinstance(batch, (list, tuple)):
        h.update(f"S{type(batch).__name__}{len(batch)}".encode())
        for v in batch:
            batch_hash(v, h)
    else:
        try:
            h.update(b"P" + pickle.dumps(batch, protocol=4))
        except Exception:  # unpicklable: its type is all that compares across processes
            h.update(f"O{type(batch).__qualname__}".encode())
    return h


class ReplicaGroup:
    """The replica group of this rank for a loader's :class:`kuat.distributed.Sharding`.

    Resolved on first use (the process group may come up after the loader is built). Not
    thread-safe (the consumer thread's).
    """

    def __init__(self, sharding: distributed.Sharding, broadcast: bool = False):
        self._sharding, self.broadcast = sharding, broadcast  # broadcast: make send() groups
        self._ready = False

    def __getstate__(self):  # process groups do not travel: resolved again after unpickling
        return {"_sharding": self._sharding, "broadcast": self.broadcast, "_ready": False}

    def resolve(self) -> None:
        """Find this rank's group, its leader and the steps of a broadcast (once the process
        group is up; a collective over the default group without a mesh: every rank calls
        it at the same point, its first batch)."""
        if self._ready:
            return
        import torch.distributed as dist

        self.active = dist.is_available() and dist.is_initialized()
        self.share = self._sharding.resolve()[0]
        self.rank = distributed.torch_group()[0]
        # leader: this rank reads; src: the global rank of its group's leader; _steps: the
        # (group, source rank) broadcasts it takes part in; _gather: the groups the check's
        # all-gather runs over, in turn (None: the default group)
        self.leader, self.src, self._steps, self._gather = True, self.rank, [], []
        mesh = self._sharding.mesh if self._sharding.kind == "mesh" else None
        if not self.active:
            pass
        elif mesh is not None:
            self._mesh_group(mesh)
        else:
            self._default_group()
        self._ready = self.active  # (a process group may come up later: look again then)

    def _mesh_group(self, mesh) -> None:
        shape, coord = tuple(mesh.mesh.shape), list(mesh.get_coordinate())
        dp = distributed.mesh_dp_dims(mesh, self._sharding.dp_dims)
        self._gather = [mesh.get_group(d) for d in range(len(shape)) if shape[d] > 1]
        replica = [d for d in range(len(shape)) if d not in dp and shape[d] > 1]
        self.leader = all(coord[d] == 0 for d in replica)
        self.src = int(mesh.mesh[tuple(0 if d in replica else c for d, c in enumerate(coord))])
        # broadcast along each replica dimension in turn; along dimension i take part only
        # ranks at coordinate 0 of the later ones (they hold the batch by then), from the one
        # at coordinate 0 of dimension i
        for i, d in enumerate(replica):
            if all(coord[e] == 0 for e in replica[i + 1:]):
                src = list(coord)
                src[d] = 0
                self._steps.append((mesh.get_group(d), int(mesh.mesh[tuple(src)])))

    def _default_group(self) -> None:
        import torch.distributed as dist

        world_size = distributed.torch_group()[1]
        self._gather = [None] if world_size > 1 else []
        shares = [None] * world_size
        dist.all_gather_object(shares, self.share)
        members = [r for r, s in enumerate(shares) if s == self.share]
        self.src, self.leader = members[0], members[0] == self.rank
        distinct = sorted(set(shares))
        if not self.broadcast:  # the check gathers over every rank: no group to make
            return
        if len(distinct) == 1:
            group = None  # every rank reads the same share: the default group is the group
        else:  # new_group is called by every rank, for every share, in the same order
            groups = {s: dist.new_group([r for r, t in enumerate(shares) if t == s])
                      for s in distinct}
            group = groups[self.share]
        if len(members) > 1:
            self._steps.append((group, self.src))

    def is_peer(self) -> bool:
        """This rank receives its batches from the group's leader (``"broadcast"``)."""
        self.resolve()
        return not self.leader

    @property
    def alone(self) -> bool:
        """No peer to send to (a group of one, or no process group)."""
        self.resolve()
        return not self._steps

    @property
    def device(self) -> torch.device:
        """Where the broadcast buffer lives (the process group's device)."""
        return _device(self._steps[0][0]) if self._steps else torch.device("cpu")

    def gather(self, row: list[int]) -> torch.Tensor:
        """``(ranks, len(row))`` int64: ``row`` of every rank of the mesh (or of the default
        process group), in no particular order; ``(1, len(row))`` with one process."""
        import torch.distributed as dist

        self.resolve()
        rows = torch.tensor([row], dtype=torch.int64)  # (1, K)
        for group in self._gather:
            size = dist.get_world_size(group)
            parts = [torch.empty_like(rows) for _ in range(size)]
            dist.all_gather(parts, rows, group=group)
            rows = torch.cat(parts)  # (size * rows, K)
        return rows

    def send(self, header, tensors: list[torch.Tensor] = (), nbytes: int = 0):
        """Run the broadcast steps this rank takes part in, two collectives each (the sizes,
        then one uint8 message: ``tensors`` at their :func:`_pack` offsets, ``nbytes`` in all,
        then ``header`` pickled); returns ``(header, message)`` as the group's leader sent
        them. Only the leader's arguments are read."""
        import torch.distributed as dist

        self.resolve()
        message = sizes = None
        if self.leader:
            hb = bytearray(pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL))
            message = torch.empty(nbytes + len(hb), dtype=torch.uint8, device=self.device)
            pos = 0
            for t in tensors:
                message[pos:pos + t.numel()].copy_(t)
                pos += _aligned(t.numel())
            message[nbytes:].copy_(torch.frombuffer(hb, dtype=torch.uint8))
            sizes = [nbytes, len(hb)]
        for group, src in self._steps:
            device = _device(group)
            box = torch.tensor(sizes if self.rank == src else [0, 0], dtype=torch.int64,
                               device=device)
            dist.broadcast(box, src=src, group=group)
            if self.rank != src:
                sizes = box.tolist()
                message = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            dist.broadcast(message, src=src, group=group)
        header = pickle.loads(message[sizes[0]:].cpu().numpy().tobytes())
        return header, message


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _device(group) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Slot:
    """A tensor's place in the broadcast buffer: ``(offset, nbytes, dtype, shape, device)``."""

    __slots__ = ("offset", "nbytes", "dtype", "shape", "device")

    def __init__(self, offset, nbytes, dtype, shape, device):
        self.offset, self.nbytes, self.dtype = offset, nbytes, dtype
        self.shape, self.device = shape, device


def _pack(batch):
    """``(skeleton, tensors, nbytes)``: the batch with each tensor replaced by a
    :class:`_Slot` (its offset in the message, each aligned to 64 bytes), the tensors' bytes as
    flat uint8 views, in that order, and the bytes they take in all."""
    tensors: list[torch.Tensor] = []
    offset = 0

    def walk(x):
        nonlocal offset
        if isinstance(x, torch.Tensor):
            t = x.detach().contiguous()
            nbytes = t.numel() * t.element_size()
            slot = _Slot(offset, nbytes, t.dtype, tuple(t.shape), t.device.type)
            tensors.append(t.reshape(-1).view(torch.uint8))  # (nbytes,) uint8
            offset += _aligned(nbytes)
            return slot
        if isinstance(x, Mapping):
            items = {k: walk(v) for k, v in x.items()}
            return items if type(x) is dict else _rebuild(x, items)
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    skeleton = walk(batch)
    return skeleton, tensors, offset


def _rebuild(mapping, items):
    try:
        return type(mapping)(items)
    except TypeError:
        return items


def _unpack(skeleton, buffer: torch.Tensor):
    def walk(x):
        if isinstance(x, _Slot):
            raw = buffer[x.offset:x.offset + x.nbytes]
            t = raw.view(x.dtype).reshape(x.shape) if x.nbytes else torch.empty(x.shape, dtype=x.dtype)
            return t if t.device.type == x.device else t.to(x.device)  # where the leader had it
        if isinstance(x, Mapping):
            items = {k: walk(v) for k, v in x.items()}
            return items if type(x) is dict else _rebuild(x, items)
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(skeleton)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``RuntimeError`` with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__qualname__}: {exc}")


class ReplicaFeed:
    """A loader's :class:`kuat.loader._plan.BatchFeed` (``replicas=``, ``replica_check_every=``).

    Kept by the loader across epochs: the step count and the hash of the batches since the
    last check run on. Not thread-safe (the consumer thread's).
    """

    def __init__(self, sharding: distributed.Sharding, broadcast: bool, check_every: int | None):
        self.group = ReplicaGroup(sharding, broadcast)
        self.broadcast = broadcast
        self.check_every = check_every
        self.steps = 0
        self._hash = xxhash.xxh3_64()

    def __getstate__(self):
        return {"group": self.group, "broadcast": self.broadcast,
                "check_every": self.check_every, "steps": self.steps, "_hash": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._hash = xxhash.xxh3_64()

    def is_peer(self) -> bool:
        """This rank receives its batches (``replicas="broadcast"``, not the group's leader)."""
        return self.broadcast and self.group.is_peer()

    def next(self, fetch: Callable[[], Any], dataset_error: type[BaseException]) -> Any:
        batch = self._broadcast(fetch, dataset_error) if self.broadcast else fetch()
        if self.check_every is not None:
            batch_hash(batch, self._hash)
            self.steps += 1
            if self.steps % self.check_every == 0:
                self.check()
        return batch

    def _broadcast(self, fetch, dataset_error):
        group = self.group
        if group.alone:
            return fetch()
        if group.leader:
            try:
                batch = fetch()
            except StopIteration:
                group.send(("end", None))
                raise
            except dataset_error as e:
                group.send(("error", _portable(e.exc)))
                raise
            except BaseException as e:
                group.send(("stopped", f"{type(e).__qualname__}: {e}"))
                raise
            skeleton, tensors, nbytes = _pack(batch)
            group.send(("batch", skeleton), tensors, nbytes)
            return batch
        (kind, value), message = group.send(None)
        if kind == "batch":
            return _unpack(value, message)
        if kind == "end":
            raise StopIteration
        if kind == "error":
            if hasattr(value, "add_note"):  # Python >= 3.11
                value.add_note(f"(raised by the dataset on rank {group.src}, the leader of "
                               "this rank's replica group, replicas='broadcast')")
            raise dataset_error(value)
        raise RuntimeError(f"the leader of this rank's replica group (rank {group.src}) stopped "
                           f"reading: {value}")

    def check(self) -> None:
        """Compare the hash of the batches since the last check across every replica group;
        raises :class:`ReplicaMismatchError` on every rank when a group differs."""
        group = self.group
        group.resolve()
        digest = int(np.uint64(self._hash.intdigest()).view(np.int64))
        self._hash = xxhash.xxh3_64()
        rows = group.gather([group.rank, group.share, self.steps, digest]).tolist()
        shares: dict[int, dict[int, list[int]]] = {}
        steps = {r[2] for r in rows}
        for rank, share, _, h in rows:
            shares.setdefault(share, {}).setdefault(h, []).append(rank)
        differ = {s: dict(sorted(((h, sorted(r)) for h, r in by.items()), key=lambda x: x[1]))
                  for s, by in sorted(shares.items()) if len(by) > 1}
        if len(steps) > 1:
            raise ReplicaMismatchError(
                f"replica check: ranks are at different steps ({sorted(steps)}); every rank must "
                "iterate the loader in step (replica_check_every)", differ)
        if differ:
            lines = "; ".join(
                f"share {s}: " + " vs ".join(f"ranks {r}" for r in by.values())
                for s, by in differ.items())
            mine = " (this rank's group)" if group.share in differ else ""
            raise ReplicaMismatchError(
                f"replica check at step {self.steps}: replicas read different batches in the "
                f"last {self.check_every} steps: {lines}{mine}. Replicas read the same share "
                "and must see identical batches: pass the same seed= (and the same dataset, "
                "sampler and collate_fn) on every rank", differ)


def feed_for(sharding: distributed.Sharding, replicas: str,
             check_every: int | None) -> ReplicaFeed | None:
    """The loader's :class:`ReplicaFeed`, or ``None`` when every rank reads unchecked."""
    if replicas == "read" and check_every is None:
        return None
    return ReplicaFeed(sharding, replicas == "broadcast", check_every)

