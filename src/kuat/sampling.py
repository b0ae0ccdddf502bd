"""Which samples each rank reads in each epoch, and in what order.

The order of an epoch depends only on ``(seed, epoch, rank, world_size)`` (docs/loader.md,
"Seeds, generators and order"): shuffling uses a ``torch.Generator`` seeded from ``(seed, epoch)``,
so resuming at batch ``k`` recomputes the epoch's order and starts there, with no state beyond
those integers.

Unsharded (the loader's default, as torch's DataLoader: :mod:`kuat.distributed`), an
:class:`EpochSampler` gives every index of the epoch; it is not a ``DistributedSampler``, so
frameworks that inject one when they find none (Lightning, Fabric) inject theirs, as they do for
torch's loader. With torch's semantics (no ``seed=``) the loader's sampler is also torch's kind
(:class:`RandomEpochSampler` is a ``RandomSampler``, :class:`SequentialEpochSampler` a
``SequentialSampler``), so those frameworks replace it by ``DistributedSampler(dataset)``
exactly as they replace torch's, and every rank reads the samples it would read with torch. Sharded (kuat's own sharding, asked for), a :class:`DistributedEpochSampler`
follows ``torch.utils.data.DistributedSampler``: all ranks see the same permutation; without
``drop_last`` it is padded by wrapping around to a multiple of ``world_size``, with
``drop_last`` the tail is dropped; rank ``r`` takes every ``world_size``-th index starting at
``r``. Every rank therefore gets the same number of samples, hence the same number of batches;
it *is* a ``DistributedSampler`` (same attributes), so frameworks leave it in place.

Exact evaluation (``exact=True``, the loader's ``exact_eval=True``; docs/distributed.md, "Equal
steps and exact evaluation"): every index of the epoch is served exactly once over all ranks,
every rank still gets the same number of batches, and the few positions added to even them out
are :class:`PaddingIndex` values (the loader flags their samples ``is_padding``). The layout is
by *block*, per step, where Accelerate's ``gather_for_metrics`` expects it: with ``W`` ranks,
batch size ``B``, ``N`` indices, ``K = N // (W B)`` full steps and ``R = N - K W B`` indices
left, rank ``r``'s batch ``k < K`` holds positions ``[(k W + r) B, (k W + r + 1) B)`` of the
epoch's order, and its last batch (when ``R > 0``) the ``c = ceil(R / W)`` positions
``[K W B + r c, K W B + (r + 1) c)``, positions ``>= N`` wrapping around to the epoch's first
indices as padding. The ranks' batches of a step, concatenated in rank order, are therefore the
epoch's order, padding only at the end of the last step (``W c - R < W`` positions), so
truncating that step to ``N % (W B)`` samples is exact.

User samplers: :mod:`kuat._sampler_order` saves and restores what the order of a torch sampler
depends on (its generator, torch's global RNG, its epoch, or its own ``state_dict``), so that a
loader resumed mid-epoch replays exactly the same order.

Thread-safety: :class:`EpochSampler` is read-only after construction except for
:meth:`EpochSampler.set_epoch` and the loader's :meth:`EpochSampler.set_distributed` at epoch
start; computing an epoch's indices is safe from any thread.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import (
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from kuat.rng import SALT_SHUFFLE, derive_seed

__all__ = [
    "PADDING_KEY",
    "DistributedEpochSampler",
    "EpochSampler",
    "InfiniteSampler",
    "PaddingIndex",
    "exact_count",
    "exact_share",
    "flag_padding",
    "split_padding",
    "shuffle_seed",
    "batches_of",
    "RandomEpochSampler",
    "SequentialEpochSampler",
    "default_sampler",
]

_REQUESTS = itertools.count(1)  # orders set_epoch calls on loaders and samplers (latest wins)


def shuffle_seed(seed: int, epoch: int) -> int:
    """The 63-bit seed of the shuffle of ``epoch`` (:func:`kuat.rng.derive_seed`)."""
    return derive_seed(seed, epoch, SALT_SHUFFLE, bits=63)


class PaddingIndex(int):
    """An index served only to even out the ranks' batches in exact mode (a plain ``int``
    otherwise): its sample is flagged ``is_padding`` and must not count in a metric. Pickles
    as itself (process workers see it)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"PaddingIndex({int(self)})"


# the key of the (B,) torch.bool flag that exact evaluation adds to every (dict) batch
PADDING_KEY = "is_padding"


def split_padding(key: list) -> tuple[list[int], torch.Tensor]:
    """``(plain ints, (B,) torch.bool: is padding)`` of a batch's indices (padding ones are
    :class:`PaddingIndex` values). Costs a C-level scan when none is (every batch but a
    rank's last)."""
    if PaddingIndex not in map(type, key):
        return key, torch.zeros(len(key), dtype=torch.bool)
    return [int(i) for i in key], torch.tensor([type(i) is PaddingIndex for i in key])


def flag_padding(batch, padding: torch.Tensor):
    """``batch`` (a mapping of B samples) with ``batch["is_padding"] = padding``, a ``(B,)
    torch.bool`` tensor (True where the sample is padding, :func:`split_padding`): a new dict
    for a ``dict`` or a read-only mapping, set in place in any other mutable mapping (its type
    kept).

    Raises:
        TypeError: ``batch`` is not a mapping (exact evaluation flags dict batches only),
            naming its type.
        ValueError: ``batch`` already has an ``is_padding`` key.
    """
    from collections.abc import Mapping, MutableMapping

    if type(batch) is not dict and not isinstance(batch, Mapping):
        raise TypeError(
            f"exact_eval=True flags padding samples with the key {PADDING_KEY!r}, so batches must "
            f"be dicts (mappings); this loader's batch is a {type(batch).__name__}. Return dict "
            "samples (or a collate_fn that returns a dict), or evaluate without exact_eval")
    if PADDING_KEY in batch:
        raise ValueError(
            f"exact_eval=True adds the key {PADDING_KEY!r} to every batch, but the batch already "
            f"has one (keys: {list(batch)[:10]}); rename that field")
    if type(batch) is not dict and isinstance(batch, MutableMapping):
        batch[PADDING_KEY] = padding
        return batch
    return {**batch, PADDING_KEY: padding}


def next_request() -> int:
    """A number larger than every earlier one: orders ``set_epoch`` requests (latest wins)."""
    return next(_REQUESTS)


class EpochSampler(Sampler[int]):
    """Sample indices of one rank's share of one epoch (every index when unsharded).

    Args:
        num_samples: the dataset length ``N`` (>= 0), or a sized dataset whose ``len()`` is read
            at every epoch (as torch's samplers do, so a dataset may grow between epochs).
        shuffle: permute the indices each epoch. ``ValueError`` when the dataset is empty (as
            ``torch.utils.data.RandomSampler``).
        seed: run seed; the permutation of epoch ``e`` is seeded with ``shuffle_seed(seed, e)``.
        rank: this process's rank in ``[0, world_size)``.
        world_size: number of ranks (>= 1); also readable as ``num_replicas``.
        drop_last: with ``world_size > 1``, drop the tail instead of padding by wrap-around.
        generator: when given, shuffling draws from it exactly as ``torch.utils.data.RandomSampler``
            does, lazily (one ``randperm(N)`` when the first index is drawn, one more after the
            last, as RandomSampler's generator function does), so orders and the generator's
            state match torch's DataLoader with the same generator even over abandoned epochs.
            The order then depends on the generator's state, not on ``(seed, epoch)``. With
            ``world_size > 1`` the permutation is drawn whole at the first index.
        exact: exact evaluation (module docstring): every index once over all ranks, in the
            block layout, padding positions as :class:`PaddingIndex`. Needs ``batch_size``;
            ``ValueError`` with ``drop_last``.
        batch_size: the loader's per-rank batch size ``B`` (read only with ``exact``; kept as
            ``exact_batch_size``).

    ``len(sampler)`` is the per-rank count: ``ceil(N / world_size)``, or ``N // world_size``
    with ``drop_last`` (``num_samples``, as DistributedSampler); with ``exact``, ``K B + c``
    (module docstring), the same on every rank.

    Rank and world size may change between epochs (the loader resolves them when each epoch
    starts, through :meth:`set_distributed`).
    """

    dataset: Sized | None
    exact: bool = False  # (class defaults: samplers pickled before exact mode existed)
    exact_batch_size: int | None = None

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
        exact: bool = False,
        batch_size: int | None = None,
    ):
        # (for DistributedEpochSampler, DistributedSampler.__init__ is not called: it would
        # query torch.distributed now, and kuat resolves rank and world size at epoch start)
        self.dataset = None if isinstance(num_samples, int) else num_samples
        n = num_samples if self.dataset is None else len(self.dataset)
        if n < 0:
            raise ValueError(f"num_samples should be >= 0, got {num_samples=}")
        if shuffle and n == 0:  # RandomSampler's check and message
            raise ValueError(
                f"num_samples should be a positive integer value, but got num_samples={n}"
            )
        if exact and (drop_last or not batch_size or batch_size < 1):
            raise ValueError(
                "exact evaluation serves every sample once in batches: it needs a batch_size "
                f">= 1 and drop_last=False, got {batch_size=} {drop_last=}")
        # (not "batch_size": an index sampler with one could pass for a batch sampler)
        self.exact, self.exact_batch_size = bool(exact), batch_size
        self.set_distributed(rank, world_size)
        self.shuffle = shuffle
        self.seed = seed
        # (epoch, seed): shuffle that epoch as torch's RandomSampler does with that seed (the
        # loader sets it with seed=None on one process); None: the order is (seed, epoch)'s
        self.torch_seed: tuple[int, int] | None = None
        self.drop_last = drop_last
        self.generator = generator
        self.epoch = 0
        self.epoch_request: tuple[int, int] | None = None  # (request number, epoch) of set_epoch
        self._n = n

    def set_distributed(self, rank: int, world_size: int) -> None:
        """Select this process's share (DistributedSampler's checks and messages)."""
        if world_size < 1:
            raise ValueError(f"world_size should be >= 1, got {world_size=}")
        if not 0 <= rank < world_size:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {world_size - 1}]"
            )
        self.rank, self.num_replicas = int(rank), int(world_size)

    @property
    def world_size(self) -> int:
        return self.num_replicas

    @property
    def n(self) -> int:
        """The dataset length (read again from the dataset when one was given)."""
        return self._n if self.dataset is None else len(self.dataset)

    @property
    def num_samples(self) -> int:
        """This rank's number of indices per epoch (DistributedSampler's attribute)."""
        n = self.n
        if self.num_replicas == 1:
            return n
        if self.exact:
            return exact_count(n, self.num_replicas, self.exact_batch_size)
        if self.drop_last:
            return n // self.num_replicas
        return math.ceil(n / self.num_replicas)

    per_rank = num_samples

    @property
    def total_size(self) -> int:
        return self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order ``iter(sampler)`` gives (and the loader's next epoch).

        Frameworks call this before each epoch, as on a DistributedSampler (Lightning, the HF
        Trainer); the owning :class:`kuat.DataLoader` then starts that epoch.
        """
        self.epoch = int(epoch)
        self.epoch_request = (next_request(), self.epoch)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        return self.iter_epoch(self.epoch)

    def iter_epoch(self, epoch: int) -> Iterator[int]:
        """This rank's indices of ``epoch``, drawn lazily from ``generator`` when there is one."""
        n = self.n
        if self.shuffle and self.generator is not None and self.num_replicas == 1 and n > 0:
            return self._lazy_random(n)
        return iter(self.indices(epoch))

    def _lazy_random(self, n: int) -> Iterator[int]:
        # torch.utils.data.RandomSampler.__iter__ (replacement=False, num_samples=n): one full
        # pass, then randperm(n)[:0] -- drawn, though it yields nothing, when the pass is done.
        yield from torch.randperm(n, generator=self.generator).tolist()
        torch.randperm(n, generator=self.generator)

    def indices(self, epoch: int) -> list[int]:
        """This rank's indices of ``epoch``, in order (a list of ``len(self)`` ints)."""
        n = self.n
        per_rank = self.num_samples
        if self.shuffle and n > 0:
            if self.generator is not None:
                order = list(self._lazy_random(n))
            elif self.torch_seed is not None and self.torch_seed[0] == epoch:
                # torch.utils.data.RandomSampler.__iter__ with the seed it drew (replacement=
                # False, num_samples=n): a generator seeded with it, one randperm
                g = torch.Generator()
                g.manual_seed(self.torch_seed[1])
                order = torch.randperm(n, generator=g).tolist()
            elif self.seed is None:
                # iterated outside its loader before the loader drew its seed (a framework's
                # DistributedSamplerWrapper over it): as torch's RandomSampler, a seed drawn
                # from torch's default generator at each iteration, so ranks with equal global
                # seeds agree (Lightning's seed_everything)
                g = torch.Generator()
                g.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
                order = torch.randperm(n, generator=g).tolist()
            else:
                g = torch.Generator()
                g.manual_seed(shuffle_seed(self.seed, epoch))
                order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.num_replicas == 1:
            return order
        if self.exact:
            return exact_share(order, self.rank, self.num_replicas, self.exact_batch_size)
        total = per_rank * self.num_replicas
        if total > n:  # pad by wrapping around, like DistributedSampler
            pad = total - n
            order += (order * math.ceil(pad / n))[:pad] if n else []
        else:
            order = order[:total]
        return order[self.rank : total : self.num_replicas]


class DistributedEpochSampler(EpochSampler, DistributedSampler):
    """An :class:`EpochSampler` that shards: the loader's own sampler under kuat's sharding
    (``rank=``/``world_size=``, ``mesh=``, ``shard=True``). A
    ``torch.utils.data.DistributedSampler`` (its attributes and its order of shares), so that
    Lightning, Fabric and the HF Trainer, which inject a ``DistributedSampler`` where they find
    none, leave this one in place rather than sharding a second time."""


class _TorchKind(EpochSampler):
    """What torch's ``RandomSampler``/``SequentialSampler`` expose beyond an EpochSampler."""

    @property
    def data_source(self) -> Sized:
        return self.dataset if self.dataset is not None else range(self._n)


class RandomEpochSampler(_TorchKind, RandomSampler):
    """The loader's own sampler for ``shuffle=True`` with ``seed=None``, unsharded: it shuffles
    as torch's ``RandomSampler`` (a seed drawn from torch's default generator each epoch) and
    *is* one (``replacement=False``), so frameworks that recognise torch's samplers treat the
    loader exactly as torch's: Lightning injects ``DistributedSampler(dataset, shuffle=True)``
    (not a wrapper around this order), Accelerate's ``use_seedable_sampler`` replaces it with
    its ``SeedableRandomSampler``. With ``seed=`` the order is kuat's ``(seed, epoch)`` and the
    sampler a plain :class:`EpochSampler`, which frameworks wrap instead."""

    replacement = False
    _num_samples = None  # RandomSampler's: "all of the data source"


class SequentialEpochSampler(_TorchKind, SequentialSampler):
    """The loader's own sampler for ``shuffle=False``, unsharded: every index in order, and a
    ``torch.utils.data.SequentialSampler`` (frameworks treat it as torch's)."""


def default_sampler(num_samples: int | Sized, *, sharded: bool, shuffle: bool, seed: int | None,
                seed_given: bool, **kwargs) -> EpochSampler:
    """The sampler a loader builds when given none: a :class:`DistributedEpochSampler` under
    kuat's sharding; unsharded, a :class:`SequentialEpochSampler` (``shuffle=False``), a
    :class:`RandomEpochSampler` (``shuffle=True`` with ``seed_given=False``: torch's semantics)
    or an :class:`EpochSampler` (``shuffle=True`` with a seed given: kuat's order).
    ``kwargs`` are :class:`EpochSampler`'s."""
    if sharded:
        kind = DistributedEpochSampler
    elif not shuffle:
        kind = SequentialEpochSampler
    else:
        kind = EpochSampler if seed_given else RandomEpochSampler
    return kind(num_samples, shuffle=shuffle, seed=seed, **kwargs)


def exact_count(n: int, world_size: int, batch_size: int) -> int:
    """Indices per rank in exact mode: ``K B + ceil(R / W)`` (module docstring)."""
    full, rest = divmod(n, world_size * batch_size)
    return full * batch_size + -(-rest // world_size)


def exact_share(order: list[int], rank: int, world_size: int, batch_size: int,
                skip: int = 0) -> list[int]:
    """Rank ``rank``'s indices of the epoch ``order`` in exact mode (the block layout of the
    module docstring): ``exact_count`` of them, padding positions as :class:`PaddingIndex`.
    ``skip``: lay out ``order[skip:]``, padded from ``order``'s start (elastic resume)."""
    whole, order = order, order[skip:]
    n, b = len(order), batch_size
    full = n // (world_size * b)
    out = []
    for k in range(full):  # step k: positions [(k W + r) B, (k W + r + 1) B)
        lo = (k * world_size + rank) * b
        out += order[lo : lo + b]
    start = full * world_size * b
    c = -(-(n - start) // world_size)  # the last step's share, padded by wrapping around
    for p in range(start + rank * c, start + (rank + 1) * c):
        out.append(order[p] if p < n else PaddingIndex(whole[(p - n) % len(whole)]))
    return out


class InfiniteSampler(Sampler):
    """The ``sampler`` attribute of an iterable-dataset loader (as torch's ``_InfiniteConstantSampler``:
    yields ``None`` forever)."""

    def __iter__(self):
        while True:
            yield None


def batches_of(indices: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    """Split ``indices`` into consecutive batches of ``batch_size`` (the last may be shorter)."""
    stop = len(indices) - len(indices) % batch_size if drop_last else len(indices)
    return [indices[i : i + batch_size] for i in range(0, stop, batch_size)]
