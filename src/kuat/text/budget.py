"""Token-budget batching: batches bounded by padded tokens instead of a sample count.

The scheme of fairseq's ``batch_by_size`` and Megatron/ESPnet's bucketing: each epoch, permute
the samples, cut the permutation into buckets of ``bucket_size`` samples, sort each bucket by
length, cut it greedily into batches whose padded size (``batch rows x longest row``) stays
within ``max_tokens``, then shuffle the batches. Sorting inside a bucket keeps rows of a batch
of similar length (little padding); the bucket bound keeps randomness between buckets.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from kuat.rng import SALT_TOKEN_BATCHES, derive_generator

__all__ = ["TokenBudgetBatchSampler", "lengths_of"]

_log = logging.getLogger("kuat.text.budget")


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of sample indices whose padded token count stays within ``max_tokens``.

    Args:
        lengths: ``(N,)`` tokens of each sample (ints >= 0), e.g. :func:`lengths_of`.
        max_tokens: the budget per batch, counted with padding: ``len(batch) * L``, ``L`` the
            batch's longest sample rounded up to ``pad_to_multiple_of`` (what
            :func:`kuat.pad_collate` with the same ``pad_to_multiple_of`` produces). A sample
            longer than the budget forms a batch alone (truncate it in the collate with
            ``max_length``).
        max_batch_size: also bound the samples per batch (``None``: only the budget).
        shuffle: permute samples and batches each epoch (seeded by ``(seed, epoch)``); without it
            buckets follow the index order and batches keep their order.
        seed: the run seed (pass the same on every rank).
        bucket_size: samples sorted together (default ``100 * max_tokens / mean length``,
            about a hundred batches; ``N`` sorts the whole epoch: least padding, least
            randomness).
        pad_to_multiple_of: see ``max_tokens``.
        rank, world_size: this rank's share, both or neither; neither: the global rank
            (``kuat.distributed.resolve``: ``torch.distributed`` when it is initialised at
            ``iter()``, else ``RANK``/``WORLD_SIZE``, else 0 and 1), as a
            ``DistributedSampler`` shards. A sharded ``kuat.DataLoader`` (``mesh=``,
            ``rank=``, ``shard=True``) hands it its share (:meth:`kuat_set_distributed`).
        drop_last: with ``world_size > 1``, drop the last batches that do not fill a round of
            ranks instead of repeating the first ones (every rank gets the same number of
            batches either way, as ``DistributedSampler`` does for samples).

    ``len(sampler)`` is this rank's number of batches in the current epoch. Iterating yields
    lists of ``int`` indices. Use it as ``batch_sampler=`` of ``kuat.DataLoader`` (which sets
    its epoch every epoch and resumes it exactly) or of torch's ``DataLoader`` (call
    :meth:`set_epoch` before each epoch, as with ``DistributedSampler``).

    Raises:
        ValueError: ``lengths`` not 1-d non-negative ints; ``max_tokens``, ``bucket_size``,
            ``max_batch_size`` or ``pad_to_multiple_of`` not an int >= 1; a rank outside
            ``[0, world_size)``, or only one of ``rank`` and ``world_size``.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray | torch.Tensor,
        max_tokens: int,
        *,
        max_batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        bucket_size: int | None = None,
        pad_to_multiple_of: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
    ):
        arr = lengths.numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths)
        if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0)):
            raise ValueError(
                f"lengths should be a 1-d sequence of ints >= 0, got shape {arr.shape} "
                f"dtype {arr.dtype}"
            )
        self.lengths = arr.astype(np.int64)  # (N,)
        for name, v in (
            ("max_tokens", max_tokens),
            ("max_batch_size", max_batch_size),
            ("bucket_size", bucket_size),
            ("pad_to_multiple_of", pad_to_multiple_of),
        ):
            if v is None and name != "max_tokens":
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name} should be an int >= 1, got {v!r}")
        if (rank is None) != (world_size is None):  # kuat.DataLoader's rule
            raise ValueError(f"give both rank and world_size or neither, got {rank=} {world_size=}")
        if world_size is not None and (world_size < 1 or not 0 <= rank < world_size):
            raise ValueError(f"rank should be in [0, world_size), got {rank=} {world_size=}")
        if bucket_size is None:
            mean = float(self.lengths.mean()) if len(self.lengths) else 1.0
            bucket_size = max(1, int(100 * max_tokens / max(mean, 1.0)))
        self.max_tokens = int(max_tokens)
        self.max_batch_size = max_batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.bucket_size = int(bucket_size)
        self.multiple = pad_to_multiple_of
        self.rank, self.world_size = rank, world_size
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``iter()`` yields."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch should be a non-negative int, got {epoch!r}")
        self.epoch = int(epoch)

    kuat_set_epoch = set_epoch  # kuat.DataLoader calls this with its epoch before each epoch

    def kuat_set_distributed(self, rank: int, world_size: int) -> None:
        """Take share ``rank`` of ``world_size`` (a sharded ``kuat.DataLoader`` calls it at each
        epoch start, so a mesh's data-parallel share wins over the global rank)."""
        from kuat import distributed

        self.rank, self.world_size = distributed.check_explicit(rank, world_size)

    def _rank_and_world(self) -> tuple[int, int]:
        from kuat import distributed

        return distributed.resolve(self.rank, self.world_size)

    def batches(self, epoch: int) -> list[list[int]]:
        """Every batch of ``epoch``, all ranks together, in order (deterministic)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        from kuat.sampling import shuffle_seed

        n = len(self.lengths)
        rng = derive_generator(shuffle_seed(self.seed, epoch), SALT_TOKEN_BATCHES)
        order = rng.permutation(n) if self.shuffle else np.arange(n)  # (N,)
        out: list[list[int]] = []
        for lo in range(0, n, self.bucket_size):
            bucket = order[lo : lo + self.bucket_size]
            bucket = bucket[np.argsort(self.lengths[bucket], kind="stable")]  # shortest first
            out.extend(self._cut(bucket))
        if self.shuffle:
            out = [out[i] for i in rng.permutation(len(out))]
        self._cache = (epoch, out)
        return out

    def _cut(self, bucket: np.ndarray) -> list[list[int]]:
        """Greedy over a bucket sorted shortest first: grow a batch while ``rows x width`` (the
        newest, longest row rounded up to ``pad_to_multiple_of``) fits the budget."""
        out: list[list[int]] = []
        current: list[int] = []
        cap = self.max_batch_size or len(bucket) or 1
        for i, n in zip(bucket.tolist(), self.lengths[bucket].tolist(), strict=True):
            width = self._round(n)
            if current and ((len(current) + 1) * width > self.max_tokens or len(current) >= cap):
                out.append(current)
                current = []
            current.append(i)
        if current:
            out.append(current)
        return out

    def _round(self, n: int) -> int:
        m = self.multiple
        return n if not m or n % m == 0 else n + m - n % m

    def _share(self, batches: list[list[int]]) -> list[list[int]]:
        rank, world = self._rank_and_world()
        if world == 1:
            return batches
        n = len(batches)
        if self.drop_last:
            total = n // world * world
        else:
            total = -(-n // world) * world
        return [batches[p % n] for p in range(rank, total, world)] if n else []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._share(self.batches(self.epoch)))

    def __len__(self) -> int:
        return len(self._share(self.batches(self.epoch)))

    def __repr__(self) -> str:
        return (
            f"TokenBudgetBatchSampler(N={len(self.lengths)}, max_tokens={self.max_tokens}, "
            f"bucket_size={self.bucket_size}, shuffle={self.shuffle}, seed={self.seed})"
        )


def lengths_of(dataset, field: str = "input_ids") -> np.ndarray:
    """``(N,) int64``: the length of ``field`` in every sample of ``dataset``.

    A ``datasets.Dataset`` is read from its Arrow column's offsets (no per-row Python); a kuat
    dataset from its shards' offsets (a sequence field) or column-wise ``read_batch`` gathers
    (no decoding, no transforms); anything else is indexed sample by sample.

    Raises:
        KeyError: ``field`` is not a column / key of the samples.
        ValueError: a ``datasets.Dataset`` row whose ``field`` is null (names the row).
    """
    from kuat.sources.hf import is_hf_map_dataset

    if is_hf_map_dataset(dataset):
        import pyarrow.compute as pc

        if field not in dataset.column_names:
            raise KeyError(f"{field!r} is not a column of the dataset ({dataset.column_names})")
        table = dataset.with_format("arrow")[:]  # after select/shuffle: the rows in order
        col = table.column(field)
        if col.null_count:  # a null list has no length (NaN -> int64 min if let through)
            row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise ValueError(
                f"lengths_of: row {row} of {field!r} is null (no token list); drop or fill such "
                f"rows first (e.g. dataset.filter(lambda r: r[{field!r}] is not None))"
            )
        return pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    from kuat.sources.dataset import Dataset

    if isinstance(dataset, Dataset):
        n, step = len(dataset), 1 << 16
        if field not in dataset.schema:
            raise KeyError(f"{field!r} is not a field of the dataset ({dataset.schema.names})")
        if dataset.schema[field].type.kind == "sequence":
            return dataset.sequence_lengths(field)  # from the shards' offsets
        out = np.empty(n, np.int64)  # (N,)
        for lo in range(0, n, step):
            rows = dataset.read_batch(range(lo, min(n, lo + step)), [field])[field]
            out[lo : lo + len(rows)] = [len(r) for r in rows]
        return out
    return np.fromiter((len(dataset[i][field]) for i in range(len(dataset))), np.int64)
