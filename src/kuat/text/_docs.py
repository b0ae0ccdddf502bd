"""Documents of one epoch, by ordinal: what the packer and the token-budget sampler read.

A *document* is one sample of the source: a mapping with a token field (``input_ids`` by
default: a list, NumPy array or tensor of ints) and optionally ``labels`` (same length, -100
where the loss is masked) or ``loss_mask`` (same length, 1 where a token is trained on), or a
bare sequence of token ids. Its *ordinal* is its position in the epoch's document order:

* map-style sources: the indices ``0 .. N - 1``, or their permutation seeded by
  ``kuat.sampling.shuffle_seed(seed, epoch)`` (the loader's own shuffle seed); any document is
  fetched again by ordinal in one ``__getitems__`` call, so rebuilding a packer's buffer reads
  only the buffer;
* iterable sources: the order of :func:`kuat.sources.reading.stream_of` for the epoch; fetching
  an ordinal again replays the stream up to it (reading, not packing).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

IGNORE_INDEX = -100  # torch.nn.CrossEntropyLoss's default ignore_index, Hugging Face's label pad
CHUNK = 256  # documents fetched per __getitems__ / read_batch call when reading in order


class Doc:
    """One document: ``ids (n,) int64`` and ``labels (n,) int64`` (-100 where masked)."""

    __slots__ = ("ordinal", "index", "ids", "labels", "n")

    def __init__(self, ordinal: int, index: int | None, ids: np.ndarray, labels: np.ndarray):
        self.ordinal, self.index, self.ids, self.labels = ordinal, index, ids, labels
        self.n = len(ids)

    def __len__(self) -> int:
        return self.n


def to_doc(sample, ordinal: int, index: int | None, field: str) -> Doc:
    """``sample`` as a :class:`Doc` (see the module docstring for what a document holds).

    Raises:
        ValueError: no token field, a token field that is not 1-d integers, or ``labels`` /
            ``loss_mask`` of another length (the message names the document's ordinal and
            source index).
    """
    where = f"document {ordinal}" + ("" if index is None else f" (source index {index})")
    if isinstance(sample, Mapping):
        if field not in sample:
            raise ValueError(f"{where}: no field {field!r} (keys {list(sample)})")
        ids = _ints(sample[field], where, field)
        if "labels" in sample and sample["labels"] is not None:
            labels = _ints(sample["labels"], where, "labels")
        elif "loss_mask" in sample and sample["loss_mask"] is not None:
            mask = _ints(sample["loss_mask"], where, "loss_mask")
            if len(mask) != len(ids):
                raise ValueError(f"{where}: loss_mask has {len(mask)} values, {field} {len(ids)}")
            labels = np.where(mask != 0, ids, IGNORE_INDEX)
        else:
            labels = ids
        if len(labels) != len(ids):
            raise ValueError(f"{where}: labels has {len(labels)} values, {field} {len(ids)}")
    else:
        ids = _ints(sample, where, field)
        labels = ids
    return Doc(ordinal, index, ids, labels)


def _ints(value, where: str, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.numpy()
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iub"):
        raise ValueError(
            f"{where}: {name} should be a 1-d sequence of integers, got "
            f"{type(value).__name__} of shape {arr.shape} and dtype {arr.dtype}"
        )
    return arr.astype(np.int64, copy=False)  # (n,) int64: what embeddings and the loss take


class Block:
    """Consecutive documents ``first, first + 1, ...`` in flat buffers (what the packers read).

    ``lengths (k,) int64``; ``ids (T,) int64`` and ``labels (T,) int64`` (-100 where masked),
    the documents' tokens end to end, ``T = lengths.sum()``; ``starts (k,) int64`` where each
    document begins in them.
    """

    __slots__ = ("first", "lengths", "ids", "labels", "starts")

    def __init__(self, first: int, lengths: np.ndarray, ids: np.ndarray, labels: np.ndarray):
        self.first, self.lengths, self.ids, self.labels = first, lengths, ids, labels
        self.starts = np.cumsum(lengths) - lengths  # (k,)

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def of_docs(cls, first: int, docs: list[Doc]) -> Block:
        lengths = np.fromiter((d.n for d in docs), np.int64, len(docs))  # (k,)
        if not docs:
            empty = np.empty(0, np.int64)
            return cls(first, lengths, empty, empty)
        ids = np.concatenate([d.ids for d in docs])  # (T,) int64
        labels = np.concatenate([d.labels for d in docs])  # (T,) int64
        return cls(first, lengths, ids, labels)


class Documents:
    """The documents of one epoch of ``source`` by ordinal (see the module docstring)."""

    def __init__(self, source, field: str, epoch: int, shuffle: bool, seed: int):
        from kuat.sources import as_source

        self.source = as_source(source)
        self.field = field
        self.epoch = epoch
        self.iterable = isinstance(self.source, torch.utils.data.IterableDataset)
        self.order: np.ndarray | None = None
        if not self.iterable:
            n = len(self.source)
            if shuffle:
                from kuat.rng import derive_generator
                from kuat.sampling import shuffle_seed

                rng = derive_generator(shuffle_seed(seed, epoch))  # the epoch's shuffle stream
                self.order = rng.permutation(n)  # (N,) int64: ordinal -> source index
            else:
                self.order = np.arange(n)

    def read(self, start: int = 0) -> Iterator[Doc]:
        """Documents ``start, start + 1, ...`` to the end of the epoch."""
        if self.iterable:
            from kuat.sources.reading import stream_of

            items = itertools.islice(stream_of(self.source, self.epoch), start, None)
            for ordinal, sample in enumerate(items, start):
                yield to_doc(sample, ordinal, None, self.field)
            return
        for lo in range(start, len(self.order), CHUNK):
            yield from self.fetch(range(lo, min(len(self.order), lo + CHUNK)))

    def blocks(self, start: int, size: int) -> Iterator[Block]:
        """Documents ``start, start + 1, ...`` to the end of the epoch, ``size`` per
        :class:`Block` (the last one may be shorter or empty).

        A kuat dataset without transforms is read column-wise: one ``read_batch`` per block
        and one concatenation per field, no Python per document."""
        if self.iterable:
            reader = self.read(start)
            while True:
                docs = list(itertools.islice(reader, size))
                yield Block.of_docs(start, docs)
                if len(docs) < size:
                    return
                start += size
        n = len(self.order)
        while True:
            stop = min(n, start + size)
            yield self.fetch_block(start, stop)
            if stop - start < size:
                return
            start = stop

    def fetch_block(self, start: int, stop: int) -> Block:
        """Documents ``start .. stop - 1`` (a map-style source) as one :class:`Block`."""
        return self.fetch_ordinals(np.arange(start, stop, dtype=np.int64), start)

    def fetch_ordinals(self, ordinals: np.ndarray, first: int = 0) -> Block:
        """The documents at ``ordinals (k,) int64`` (a map-style source; any order) as one
        :class:`Block` in that order (``first``: its ``first`` attribute)."""
        fields = self._columns()
        if fields is None:
            return Block.of_docs(first, self.fetch(ordinals.tolist()))
        indices = self.order[ordinals]
        lengths, flat = self.source.read_flat(indices, self.field)  # (k,), (T,) stored dtype
        ids = flat.astype(np.int64, casting="safe")  # (T,) uint16/uint32 -> int64
        if len(fields) == 1:
            return Block(first, lengths, ids, ids)
        extra_lengths, extra = self.source.read_flat(indices, fields[1])
        bad = np.flatnonzero(extra_lengths != lengths)
        if len(bad):
            o = int(ordinals[bad[0]])
            raise ValueError(
                f"document {o} (source index {int(indices[bad[0]])}): {fields[1]} has "
                f"{int(extra_lengths[bad[0]])} values, {self.field} {int(lengths[bad[0]])}"
            )
        values = extra.astype(np.int64, casting="same_kind")  # (T,) int64
        if fields[1] == "loss_mask":
            values = np.where(values != 0, ids, IGNORE_INDEX)  # (T,) int64
        return Block(first, lengths, ids, values)

    def lengths(self) -> np.ndarray | None:
        """``(N,) int64``: the tokens of each document by source index, found without reading
        the tokens (a local kuat dataset without transforms: its shards' offsets), or ``None``
        when that is not possible (iterable sources, transforms, remote datasets, whose shards
        would all be fetched first, other sources)."""
        from pathlib import Path

        if self.iterable or self._columns() is None or not isinstance(self.source.path, Path):
            return None
        return self.source.sequence_lengths(self.field)

    def _columns(self) -> list[str] | None:
        """The fields to read column-wise (token field, then ``labels`` or ``loss_mask``), or
        ``None`` when the source is not a kuat dataset of integer sequences without transforms."""
        from kuat.sources.dataset import Dataset

        src = self.source
        if type(src) is not Dataset or src.has_transform:
            return None
        schema = src.schema
        fields = [self.field]
        for extra in ("labels", "loss_mask"):
            if extra in schema:
                fields.append(extra)
                break
        for name in fields:
            if name not in schema:
                return None  # the generic path raises the error that names the document
            ftype = schema[name].type
            if ftype.kind != "sequence" or not np.can_cast(ftype.np_dtype, np.int64):
                return None
        return fields

    def fetch(self, ordinals: Sequence[int]) -> list[Doc]:
        """The documents at ``ordinals`` (any order), in that order."""
        ordinals = list(ordinals)
        if not ordinals:
            return []
        if self.iterable:
            wanted = set(ordinals)
            found = {}
            for doc in self.read(0):
                if doc.ordinal in wanted:
                    found[doc.ordinal] = doc
                if doc.ordinal >= max(wanted):
                    break
            return [found[o] for o in ordinals]
        from kuat.rng import current_epoch, epoch_context, sample_context

        indices = [int(self.order[o]) for o in ordinals]
        getitems = getattr(self.source, "__getitems__", None)
        # The source reads this epoch (a map-style mix's window, kuat.sample_rng draws) also
        # outside kuat's loader (iter_rows(epoch), a resume state, torch's DataLoader), which
        # sets nothing; inside the loader this is the epoch the loader set already.
        with epoch_context(current_epoch()[0], self.epoch):
            if getitems is not None:
                samples = getitems(indices)
            else:
                samples = []
                for i in indices:
                    with sample_context(i):
                        samples.append(self.source[i])
        return [
            to_doc(s, o, i, self.field) for s, o, i in zip(samples, ordinals, indices, strict=True)
        ]
