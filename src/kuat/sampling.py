"""Which samples each rank reads in each epoch, and in what order.

The order of an epoch depends only on ``(seed, epoch, rank, world_size)`` (DESIGN.md,
"Determinism and state"): shuffling uses a ``torch.Generator`` seeded from ``(seed, epoch)``,
so resuming at batch ``k`` recomputes the epoch's order and starts there, with no state beyond
those integers.

Distributed shares follow ``torch.utils.data.DistributedSampler``: all ranks see the same
permutation; without ``drop_last`` it is padded by wrapping around to a multiple of
``world_size``, with ``drop_last`` the tail is dropped; rank ``r`` takes every ``world_size``-th
index starting at ``r``. Every rank therefore gets the same number of samples, hence the same
number of batches.

Thread-safety: :class:`EpochSampler` is read-only after construction except for
:meth:`EpochSampler.set_epoch`; computing an epoch's indices is safe from any thread.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = ["EpochSampler", "shuffle_seed", "batches_of"]

_MASK64 = (1 << 64) - 1
_SHUFFLE_SALT = 0x5348554646  # "SHUFF": keeps shuffle seeds apart from per-sample seeds


def shuffle_seed(seed: int, epoch: int) -> int:
    """The 63-bit seed of the shuffle of ``epoch`` (NumPy ``SeedSequence`` mixing)."""
    ss = np.random.SeedSequence([seed & _MASK64, epoch & _MASK64, _SHUFFLE_SALT])
    lo, hi = ss.generate_state(2, np.uint32)
    return (int(lo) | (int(hi) << 32)) & ((1 << 63) - 1)


class EpochSampler(Sampler[int]):
    """Sample indices of one rank's share of one epoch.

    Args:
        num_samples: the dataset length ``N`` (>= 0), or a sized dataset whose ``len()`` is read
            at every epoch (as torch's samplers do, so a dataset may grow between epochs).
        shuffle: permute the indices each epoch.
        seed: run seed; the permutation of epoch ``e`` is seeded with ``shuffle_seed(seed, e)``.
        rank: this process's rank in ``[0, world_size)``.
        world_size: number of ranks (>= 1).
        drop_last: with ``world_size > 1``, drop the tail instead of padding by wrap-around.
        generator: when given, shuffling draws from it exactly as ``torch.utils.data.RandomSampler``
            does (so orders match torch's DataLoader with the same generator); the order then
            depends on the generator's state, not on ``(seed, epoch)``.

    ``len(sampler)`` is the per-rank count: ``ceil(N / world_size)``, or ``N // world_size``
    with ``drop_last``.
    """

    def __init__(
        self,
        num_samples: int | Sized,
        *,
        shuffle: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
    ):
        self._source = None if isinstance(num_samples, int) else num_samples
        n = num_samples if self._source is None else len(self._source)
        if n < 0:
            raise ValueError(f"num_samples should be >= 0, got {num_samples=}")
        if world_size < 1:
            raise ValueError(f"world_size should be >= 1, got {world_size=}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank should be in [0, {world_size}), got {rank=}")
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.generator = generator
        self.epoch = 0
        self._n = n

    @property
    def n(self) -> int:
        """The dataset length (read again from the dataset when one was given)."""
        return self._n if self._source is None else len(self._source)

    @property
    def per_rank(self) -> int:
        n = self.n
        if self.world_size == 1:
            return n
        if self.drop_last:
            return n // self.world_size
        return math.ceil(n / self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order ``iter(sampler)`` gives."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.per_rank

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices(self.epoch))

    def indices(self, epoch: int) -> list[int]:
        """This rank's indices of ``epoch``, in order (a list of ``len(self)`` ints)."""
        n = self.n
        per_rank = self.per_rank
        if self.shuffle and n > 0:
            if self.generator is not None:
                # RandomSampler draws randperm(n) once per full pass, then once for the remainder.
                order = torch.randperm(n, generator=self.generator).tolist()
                torch.randperm(n, generator=self.generator)
            else:
                g = torch.Generator()
                g.manual_seed(shuffle_seed(self.seed, epoch))
                order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.world_size == 1:
            return order
        total = per_rank * self.world_size
        if total > n:  # pad by wrapping around, like DistributedSampler
            pad = total - n
            order += (order * math.ceil(pad / n))[:pad] if n else []
        else:
            order = order[:total]
        return order[self.rank : total : self.world_size]


def batches_of(indices: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    """Split ``indices`` into consecutive batches of ``batch_size`` (the last may be shorter)."""
    stop = len(indices) - len(indices) % batch_size if drop_last else len(indices)
    return [indices[i : i + batch_size] for i in range(0, stop, batch_size)]
