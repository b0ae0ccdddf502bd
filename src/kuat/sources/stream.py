"""Iterable sources as one deterministic stream per epoch, split by position.

A :class:`Stream` defines :meth:`Stream.samples`: every sample of an epoch, in order, as a
function of the epoch only. Each rank and each worker iterates that same stream and keeps its
share by position, so:

* **ranks** get samples ``r, r + world_size, ...`` (as ``DistributedSampler``); without
  ``drop_last`` the stream is padded by wrapping around to a multiple of ``world_size``, with it
  the incomplete last round is dropped, so every rank gets the same number of samples, hence the
  same number of batches, and none of them is empty;
* **workers** of a rank take whole batches: worker ``w`` of ``n`` keeps the rank's batches
  ``w, w + n, ...``, so batch ``k`` holds the same samples whatever the number of workers, and
  the loader's round-robin over workers yields them in order. Resuming by replaying the epoch's
  first batches (what :class:`kuat.DataLoader` does for iterable sources) is therefore exact,
  also with another ``num_workers``.

The price: every rank and worker reads the whole stream (and skips what is not its own), like
``datasets``' ``split_dataset_by_node`` does when shards do not divide evenly.

The loader hands a stream its batching with ``kuat_set_batching(batch_size, drop_last)`` and
its share with ``kuat_set_distributed(rank, world_size)`` (``(0, 1)`` unless the loader was
asked to shard: :mod:`kuat.distributed`); without those (torch's DataLoader), a stream is not
split by rank (every rank reads it whole, as any torch ``IterableDataset``) and workers split
sample by sample.
:func:`kuat.sources.reading.stream_of` reads any source as one such stream.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

__all__ = ["Stream", "rank_share", "rest_after", "worker_share"]

_log = logging.getLogger("kuat.sources.stream")


class Stream(torch.utils.data.IterableDataset):
    """Base class of kuat's iterable sources (mixes of iterables, shuffle buffers, HF streaming).

    Subclasses implement :meth:`samples`. ``iter(stream)`` yields this rank's and this
    worker's share of the current epoch (see the module docstring).

    Thread-safety: ``iter()`` may be called from several worker threads at once (each gets an
    independent iterator); ``set_epoch`` and the ``kuat_set_*`` hooks are called by the loader
    before iterating.
    """

    # why this stream cannot give every rank the same number of samples under kuat's sharding
    # (a sentence), or None: it can (rank_share pads or truncates). A sharded kuat.DataLoader
    # refuses a stream that gives a reason, at construction.
    kuat_unequal_shares: str | None = None

    def __init__(self):
        super().__init__()
        self._epoch = 0
        self._rank: int | None = None
        self._world_size: int | None = None
        self._batch_size: int | None = None
        self._drop_last = False

    def samples(self, epoch: int) -> Iterator:
        """Every sample of ``epoch``, in order, unsplit (deterministic given ``epoch``)."""
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``iter()`` reads (the loader calls it every epoch)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch should be a non-negative int, got {epoch!r}")
        self._epoch = epoch

    def kuat_set_distributed(self, rank: int, world_size: int) -> None:
        """Take rank ``rank``'s share of ``world_size`` (called by the loader)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank should be in [0, world_size), got {rank=} {world_size=}")
        self._rank, self._world_size = int(rank), int(world_size)

    def kuat_set_batching(self, batch_size: int | None, drop_last: bool) -> None:
        """Split workers by whole batches of ``batch_size``; ``drop_last`` also truncates ranks."""
        self._batch_size = batch_size
        self._drop_last = bool(drop_last)

    def start_at(self, epoch: int, start: int) -> None:
        """Elastic resume (``kuat.DataLoader``, docs/distributed.md): iterate ``epoch`` from
        its sample ``start`` on, the first ``start`` having been consumed by the ranks of
        another layout; the rest is split as a whole epoch is, padded by wrapping around to
        the epoch's first samples. ``start=0`` clears it; other epochs are not affected. Only
        :meth:`Stream.__iter__` honours it (subclasses that iterate otherwise do not)."""
        self._start = (int(epoch), int(start)) if start else None

    def _rank_and_world(self) -> tuple[int, int]:
        if self._rank is None:
            return 0, 1  # not split by rank unless told (kuat.distributed: who reads what)
        return self._rank, self._world_size

    def __iter__(self) -> Iterator:
        return self._share(self.samples(self._epoch))

    def _share(self, items: Iterator) -> Iterator:
        """This rank's and worker's items of ``items`` (the epoch's whole stream, in order):
        the split of the module docstring. It never looks inside an item, so ``items`` may be
        stand-ins for samples (what :mod:`kuat.sources._hf_split` passes: raw rows that become
        samples only once kept)."""
        rank, world_size = self._rank_and_world()
        info = torch.utils.data.get_worker_info()
        start, head = getattr(self, "_start", None), None
        if start is not None and start[0] == self._epoch:  # elastic resume (start_at)
            head = []
            items = rest_after(items, start[1], world_size, head)
        if world_size > 1:
            items = rank_share(items, rank, world_size, self._drop_last, head)
        if info is not None and info.num_workers > 1:
            items = worker_share(items, info.id, info.num_workers, self._batch_size or 1)
        return items


def rest_after(items: Iterator, start: int, keep: int, head: list) -> Iterator:
    """The items after the first ``start``: the rest of an epoch's stream. Appends the first
    ``keep`` items to ``head`` (what the rest's wrap-around padding repeats) as it reads them,
    lazily: every item is read inside a ``next()`` of the caller (where a worker has set the
    loader's epoch context, which ``kuat.sample_rng`` reads)."""
    for n, item in enumerate(items):
        if n < keep:
            head.append(item)
        if n >= start:
            yield item


def rank_share(items: Iterator, rank: int, world_size: int, drop_last: bool,
               head: list | None = None) -> Iterator:
    """Samples at positions ``rank, rank + world_size, ...`` of ``items``, equal for every rank.

    Without ``drop_last`` the stream is padded by wrapping around (its first samples again, or
    ``head``'s when given) to a multiple of ``world_size``; with it, the incomplete last round
    is dropped. Matches ``torch.utils.data.DistributedSampler`` on the sequence ``items``.
    """
    given = head is not None
    head = head if given else []  # the first world_size samples, for the padding (a given
    # list may still be filling while this reads: rest_after)
    held = None  # this rank's sample of the current round, until the round is complete
    has_held = False
    n = 0
    for item in items:
        if not drop_last and not given and n < world_size:
            head.append(item)
        pos = n % world_size
        n += 1
        if pos == rank:
            if not drop_last:
                yield item
                continue
            held, has_held = item, True
        if drop_last and pos == world_size - 1 and has_held:
            yield held
            held, has_held = None, False
    if drop_last or n == 0 or n % world_size == 0 or not head:
        return
    # Padded positions n .. total-1 repeat samples 0, 1, ... (as DistributedSampler does).
    total = -(-n // world_size) * world_size
    for p in range(n, total):
        if p % world_size == rank:
            yield head[(p - n) % len(head)]


def worker_share(items: Iterator, worker_id: int, num_workers: int, batch_size: int) -> Iterator:
    """Samples of the batches ``worker_id, worker_id + num_workers, ...`` of ``items``."""
    for q, item in enumerate(items):
        if (q // batch_size) % num_workers == worker_id:
            yield item
