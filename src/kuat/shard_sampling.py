"""A shard-aware shuffle: each rank reads few shards at a time, so remote caches stay small.

A global permutation (``DataLoader(shuffle=True)``) touches every shard in every batch: on a
remote dataset each rank then needs the whole dataset in its cache to make progress. This
sampler follows MosaicML Streaming's ``py1b`` algorithm (``streaming/base/shuffle/py1b.py``:
shuffle the shards, then shuffle samples within fixed-size blocks), adapted to kuat's ranks:

1. the shards are permuted, seeded by ``(seed, epoch)``;
2. their samples, in that shard order, are split into ``world_size`` equal contiguous spans
   (padded by wrap-around like ``DistributedSampler``); rank ``r`` takes span ``r``;
3. each rank's span is cut into blocks of ``block_size`` samples and each block is permuted.

Trade-off (quality vs cache): a block mixes about ``block_size / rows_per_shard + 1`` shards,
which is how many shards a rank reads at a time (plus the dataset's ``prefetch_shards``), so the
cache a rank needs is about that many shards. Samples never move further than one block, and
samples of one shard stay close in the order: ``block_size`` of a few shards' rows already
decorrelates batches well for shards written from shuffled sources; raise it (up to ``len``:
a full shuffle of the rank's span) when the shards are sorted (by class, by source).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from kuat.rng import derive_generator
from kuat.sampling import shuffle_seed
from kuat.sources.protocol import prefetcher

__all__ = ["ShardShuffleSampler"]


class ShardShuffleSampler(Sampler[int]):
    """Sample indices of one rank's share of an epoch, shuffled shard-aware (see the module).

    Args:
        dataset: a kuat dataset (``kuat.open``); its manifest gives the shard row counts.
        block_size: samples shuffled together (>= 1); see the trade-off above.
        seed: run seed; epoch ``e`` is seeded with ``kuat.sampling.shuffle_seed(seed, e)``.
        rank, world_size: this rank and the number of data-parallel ranks.

    Use as torch's ``DistributedSampler``: ``DataLoader(ds, sampler=s, batch_size=...)``;
    ``kuat.DataLoader`` sets the epoch itself (``kuat_set_epoch``), torch's needs
    ``s.set_epoch(e)`` before each epoch. Each ``iter()`` hands the epoch's order to the
    dataset (``kuat_prefetch``), which prefetches remote shards in that order. ``len(s)`` is
    ``ceil(N / world_size)``. Deterministic given ``(seed, epoch, rank, world_size)``.

    Raises:
        ValueError: ``block_size`` < 1, ``world_size`` < 1 or ``rank`` outside it.
        TypeError: ``dataset`` has no kuat manifest.
    """

    def __init__(
        self, dataset, *, block_size: int = 1 << 14, seed: int = 0, rank: int = 0,
        world_size: int = 1,
    ):  # fmt: skip
        manifest = getattr(dataset, "manifest", None)
        if manifest is None or not hasattr(manifest, "shards"):
            raise TypeError(
                f"ShardShuffleSampler needs a kuat dataset (kuat.open), got {type(dataset).__name__}"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive int")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be a positive int")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} must be in [0, {world_size=})")
        self.dataset = dataset
        self.rows = np.array([s.rows for s in manifest.shards], np.int64)  # (S,) rows per shard
        self.block_size = block_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order ``iter(sampler)`` gives."""
        self.epoch = epoch

    kuat_set_epoch = set_epoch  # kuat.DataLoader sets its epoch (so resume restores it)

    def __len__(self) -> int:
        return math.ceil(int(self.rows.sum()) / self.world_size)

    def indices(self, epoch: int) -> list[int]:
        """This rank's indices of ``epoch``, in order (``len(self)`` ints)."""
        n = int(self.rows.sum())
        if n == 0:
            return []
        g = torch.Generator()
        g.manual_seed(shuffle_seed(self.seed, epoch))
        starts = np.concatenate([[0], np.cumsum(self.rows)[:-1]])  # (S,) first row of each
        shards = torch.randperm(len(self.rows), generator=g).numpy()  # (S,) shard order
        order = np.concatenate([np.arange(starts[k], starts[k] + self.rows[k]) for k in shards])
        per_rank = len(self)
        total = per_rank * self.world_size
        if total > n:  # pad by wrapping around, like DistributedSampler
            order = np.resize(order, total)
        span = order[self.rank * per_rank : (self.rank + 1) * per_rank]  # (per_rank,)
        # blocks: one generator per (epoch seed, rank), so ranks shuffle independently
        rng = derive_generator(shuffle_seed(self.seed, epoch), self.rank)
        out = span.copy()
        for b in range(0, per_rank, self.block_size):
            rng.shuffle(out[b : b + self.block_size])  # in place, within the block
        return out.tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.indices(self.epoch)
        prefetch = prefetcher(self.dataset)  # the dataset's, or through a torch wrapper
        if prefetch is not None:
            prefetch(order)
        return iter(order)
