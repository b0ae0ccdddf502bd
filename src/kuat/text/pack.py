"""``kuat.pack``: documents packed on the fly into fixed-length rows, resumable from a small state.

Strategies (what each packs and where it comes from):

* ``"concat"``: concatenate the documents and cut every ``seq_len`` tokens (torchtitan's and
  Megatron's pretraining packing); a document may continue in the next row. No padding but in
  the last row of the epoch.
* ``"first_fit"``: read ``buffer_size`` documents, put each, in arrival order, into the first
  row with room (greedy first-fit; torchtune's ``PackedDataset`` is the one-open-row variant).
* ``"best_fit"``: best-fit decreasing over the same buffer: longest first, each into the row it
  fills most tightly (TRL's ``pack_dataset(strategy="bfd")``, over a bounded buffer instead of
  the whole table).

In both fit strategies the emptiest row of a buffer is not emitted but carried into the next
buffer (except at the end of the epoch), so padding stays near the bin-packing optimum without
holding more than one buffer. Documents longer than ``seq_len`` are split into ``seq_len`` pieces
or dropped (``too_long=``), counted in :meth:`Packed.stats`.

Each row (Hugging Face's packed-row conventions, as ``DataCollatorWithFlattening`` produces):

* ``input_ids (L,) int64``; padding (only in fit strategies and the last row) is ``pad_id``;
* ``labels (L,) int64``: the document's labels, aligned with ``input_ids`` (the model shifts
  them), ``-100`` at the first token of every document piece (so no token predicts across a
  document boundary), on masked tokens and on padding;
* ``position_ids (L,) int64``: ``0, 1, ...`` restarting at every document piece (and at the
  padding, which is a segment of its own), which is how Hugging Face's flash-attention path finds
  document boundaries;
* ``document_lengths (D,) int32``: the lengths of the row's document pieces, in order (padding
  not included).

Resume: :meth:`Packed.iter_rows` returns an iterator whose ``state_dict()`` is a handful of
integers (``concat``: the document and token offset where the next row starts; fit strategies:
the first document of the current buffer, the ``(document, piece)`` keys of the carried row, and
rows already emitted from the buffer). Resuming refetches one buffer and repacks it: the cost
is that of one buffer, independent of the position in the epoch (for map-style sources; an
iterable source is re-read, not repacked, up to the buffer).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import numbers
from collections.abc import Iterator

import numpy as np
import torch

from kuat.sources.stream import Stream
from kuat.text._docs import IGNORE_INDEX, Doc, Documents

__all__ = ["pack", "Packed", "PackIterator", "STRATEGIES"]

_log = logging.getLogger("kuat.text.pack")

STRATEGIES = ("concat", "first_fit", "best_fit")
_STATE_VERSION = 1


def pack(
    source,
    seq_len: int,
    strategy: str = "best_fit",
    *,
    buffer_size: int = 1024,
    too_long: str = "split",
    field: str = "input_ids",
    pad_id: int = 0,
    shuffle: bool = False,
    seed: int = 0,
) -> Packed:
    """Pack the documents of ``source`` into rows of ``seq_len`` tokens, on the fly.

    Args:
        source: map-style (a kuat dataset, ``datasets.Dataset``, torch ``Dataset``) or iterable
            (``datasets.IterableDataset``, :func:`kuat.mix` of streams, a torch
            ``IterableDataset``) source of documents: mappings with ``field`` (1-d ints) and
            optionally ``labels`` (-100 where masked) or ``loss_mask`` (1 where trained on), or
            bare sequences of token ids.
        seq_len: ``L``, tokens per row.
        strategy: ``"concat"``, ``"first_fit"`` or ``"best_fit"`` (see the module docstring).
        buffer_size: documents packed together by the fit strategies (memory and the cost of a
            resume grow with it; padding shrinks). Ignored by ``"concat"``.
        too_long: documents longer than ``seq_len`` in fit strategies: ``"split"`` into pieces
            of ``seq_len`` (the last one shorter) or ``"drop"``.
        field: the token field of the documents.
        pad_id: the ``input_ids`` value of padding.
        shuffle: read a map-style source in a permuted order, a new one each epoch (seeded by
            ``(seed, epoch)`` as the loader's sampler is); iterable sources keep their order.
        seed: the run seed for ``shuffle``.

    Returns:
        A :class:`Packed` stream (a ``torch.utils.data.IterableDataset``): each rank and each
        worker of the loader packs the whole epoch (deterministically) and keeps its rows by
        position, so ranks get equal shares and a row goes to exactly one rank and worker
        (without ``drop_last``, ranks are padded by wrapping around to the first rows, as
        ``DistributedSampler`` does). Batch rows with :func:`kuat.text.pack_collate`.

    Raises:
        ValueError: ``seq_len`` or ``buffer_size`` not an int >= 1; an unknown ``strategy`` or
            ``too_long``.
        TypeError: ``pad_id`` or ``seed`` not an int, ``field`` not a string.
    """
    for name, v in (("seq_len", seq_len), ("buffer_size", buffer_size)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{name} should be an int >= 1, got {v!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy should be one of {STRATEGIES}, got {strategy!r}")
    if too_long not in ("split", "drop"):
        raise ValueError(f"too_long should be 'split' or 'drop', got {too_long!r}")
    for name, v in (("pad_id", pad_id), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} should be an int, got {v!r}")
    if not isinstance(field, str):
        raise TypeError(f"field should be a field name, got {field!r}")
    return Packed(
        source,
        int(seq_len),
        strategy,
        int(buffer_size),
        too_long,
        field,
        int(pad_id),
        bool(shuffle),
        int(seed),
    )


class PackStats:
    """Counters of one pass of a packer (see :meth:`Packed.stats`)."""

    _COUNTS = (
        "documents",
        "tokens",
        "rows",
        "pad_tokens",
        "split_documents",
        "dropped_documents",
        "dropped_tokens",
    )
    __slots__ = _COUNTS + ("seq_len",)

    def __init__(self, seq_len: int = 0):
        for name in self._COUNTS:
            setattr(self, name, 0)
        self.seq_len = seq_len

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self._COUNTS}
        slots = self.rows * self.seq_len
        out["padding_fraction"] = self.pad_tokens / slots if slots else 0.0
        return out


class Packed(Stream):
    """Packed rows of a source (see :func:`pack`, which validates the arguments).

    Thread-safety: as every :class:`kuat.sources.stream.Stream`, independent iterators may run
    in several threads; :meth:`stats` reports the pass most recently finished or in progress
    on this object.
    """

    def __init__(
        self, source, seq_len, strategy, buffer_size, too_long, field, pad_id, shuffle, seed
    ):
        super().__init__()
        from kuat.sources import as_source

        self.source = as_source(source)
        self.seq_len = seq_len
        self.strategy = strategy
        self.buffer_size = buffer_size
        self.too_long = too_long
        self.field = field
        self.pad_id = pad_id
        self.shuffle = shuffle
        self.seed = seed
        self._stats = PackStats(seq_len)
        if shuffle and isinstance(self.source, torch.utils.data.IterableDataset):
            _log.warning(
                "pack(shuffle=True) over an iterable source keeps the stream's order; shuffle "
                "the stream itself (kuat.shuffle_buffer, datasets' IterableDataset.shuffle)"
            )

    def __repr__(self) -> str:
        return (
            f"Packed({self.source!r:.60}, seq_len={self.seq_len}, strategy={self.strategy!r}, "
            f"buffer_size={self.buffer_size}, too_long={self.too_long!r})"
        )

    def samples(self, epoch: int) -> Iterator[dict]:
        """Every packed row of ``epoch``, in order (unsplit by ranks and workers)."""
        return (row for row in self.iter_rows(epoch))

    def iter_rows(self, epoch: int = 0, state: dict | None = None) -> PackIterator:
        """An iterator over the rows of ``epoch`` (all of them, unsplit), from the start or from
        ``state`` (a :meth:`PackIterator.state_dict`, which then also gives the epoch).

        Raises:
            ValueError: ``state`` is not a state of this strategy and version.
        """
        return PackIterator(self, epoch, state)

    def stats(self) -> dict:
        """Counts of the most recent pass over this object: ``documents`` read, ``tokens`` in
        them, ``rows`` emitted, ``pad_tokens``, ``split_documents`` (longer than ``seq_len``,
        split), ``dropped_documents`` and ``dropped_tokens`` (``too_long="drop"``), and
        ``padding_fraction`` (pad tokens / row tokens). A resumed pass counts from the resume
        point. With a loader's workers, each worker's copy counts its own pass."""
        return self._stats.as_dict()


class PackIterator(Iterator[dict]):
    """Rows of one epoch from a :class:`Packed`, with a small resumable state.

    ``state_dict()`` after ``k`` rows, given back to :meth:`Packed.iter_rows`, yields exactly
    the rows ``k, k + 1, ...`` of an uninterrupted pass.
    """

    def __init__(self, packed: Packed, epoch: int, state: dict | None):
        if state is not None:
            if (
                not isinstance(state, dict)
                or state.get("version") != _STATE_VERSION
                or state.get("strategy") != packed.strategy
            ):
                raise ValueError(
                    f"not a {packed.strategy!r} packer state of version {_STATE_VERSION}: "
                    f"{state!r:.200}"
                )
            epoch = int(state["epoch"])
        self._packed = packed
        self._epoch = epoch
        packed._stats = self._stats = PackStats(packed.seq_len)
        docs = Documents(packed.source, packed.field, epoch, packed.shuffle, packed.seed)
        if packed.strategy == "concat":
            pos = (0, 0) if state is None else (int(state["doc"]), int(state["offset"]))
            self._rows = _concat(docs, packed, self._stats, pos)
        else:
            pos = (0, (), 0)
            if state is not None:
                carried = tuple((int(o), int(p)) for o, p in state["carried"])
                pos = (int(state["start"]), carried, int(state["emitted"]))
            self._rows = _fit(docs, packed, self._stats, pos)
        self._state = self._make_state(pos)

    def _make_state(self, pos) -> dict:
        state = {"version": _STATE_VERSION, "strategy": self._packed.strategy, "epoch": self._epoch}
        if self._packed.strategy == "concat":
            state["doc"], state["offset"] = pos
        else:
            start, carried, emitted = pos
            state.update(start=start, carried=[list(k) for k in carried], emitted=emitted)
        return state

    def __next__(self) -> dict:
        row, pos = next(self._rows)
        self._state = self._make_state(pos)
        return row

    def state_dict(self) -> dict:
        """Where the next row starts: a dict of ints (and, for fit strategies, a list of at most
        ``seq_len`` ``[document, piece]`` pairs)."""
        return dict(self._state)


# --- strategies: generators of (row, position after the row) ----------------------------------


def _concat(docs: Documents, packed: Packed, stats: PackStats, pos) -> Iterator:
    """Concatenate and cut every ``L`` tokens. ``pos``: (document ordinal, token offset)."""
    length = packed.seq_len
    first, offset = pos
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    filled = 0
    end = (first, offset)
    for doc in docs.read(first):
        end = (doc.ordinal + 1, 0)
        stats.documents += 1
        stats.tokens += doc.n
        at = offset if doc.ordinal == first else 0
        while at < doc.n:
            take = min(length - filled, doc.n - at)
            pieces.append((doc.ids[at : at + take], doc.labels[at : at + take]))
            filled += take
            at += take
            if filled == length:
                after = (doc.ordinal, at) if at < doc.n else (doc.ordinal + 1, 0)
                stats.rows += 1
                yield _row(pieces, length, packed.pad_id), after
                pieces, filled = [], 0
    if pieces:
        stats.rows += 1
        stats.pad_tokens += length - filled
        yield _row(pieces, length, packed.pad_id), end


def _fit(docs: Documents, packed: Packed, stats: PackStats, pos) -> Iterator:
    """First-fit or best-fit decreasing over buffers. ``pos``: (first document of the buffer,
    keys of the row carried into it, rows already emitted from it)."""
    length, size = packed.seq_len, packed.buffer_size
    drop = packed.too_long == "drop"
    binpack = _first_fit if packed.strategy == "first_fit" else _best_fit
    start, carried_keys, skip = pos
    fetched = docs.fetch(sorted({o for o, _ in carried_keys}))
    by_key = {it[0]: it for it in _pieces(fetched, length)}
    carried = [by_key[k] for k in carried_keys]
    reader = docs.read(start)
    while True:
        new_docs = list(itertools.islice(reader, size))
        last = len(new_docs) < size
        items = carried  # (key, ids, labels, n) of every piece to pack
        for doc in new_docs:
            n = doc.n
            stats.documents += 1
            stats.tokens += n
            if n <= length:
                if n:  # empty documents add nothing
                    items.append(((doc.ordinal, 0), doc.ids, doc.labels, n))
            elif drop:
                stats.dropped_documents += 1
                stats.dropped_tokens += n
            else:
                stats.split_documents += 1
                items.extend(_pieces([doc], length))
        sizes = [it[3] for it in items]
        bins, fills = binpack(sizes, length)
        keep_back = None
        if not last and bins:
            emptiest = min(range(len(bins)), key=lambda b: (fills[b], -b))
            if fills[emptiest] < length:
                keep_back = emptiest
        emitted = 0
        out_keys = tuple(carried_keys)
        for b, members in enumerate(bins):
            if b == keep_back:
                continue
            emitted += 1
            if emitted <= skip:
                continue
            stats.rows += 1
            stats.pad_tokens += length - fills[b]
            row = _row([(items[i][1], items[i][2]) for i in members], length, packed.pad_id)
            yield row, (start, out_keys, emitted)
        if last:
            return
        skip = 0
        carried = [] if keep_back is None else [items[i] for i in bins[keep_back]]
        carried_keys = tuple(it[0] for it in carried)
        start += size


def _pieces(docs: list[Doc], length: int) -> list[tuple]:
    """``[((ordinal, piece), ids, labels, n), ...]``: documents cut into ``length`` tokens."""
    out = []
    for doc in docs:
        for p, at in enumerate(range(0, doc.n, length)):
            ids = doc.ids[at : at + length]
            out.append(((doc.ordinal, p), ids, doc.labels[at : at + length], len(ids)))
    return out


def _first_fit(sizes: list[int], capacity: int) -> tuple[list[list[int]], list[int]]:
    """Greedy first-fit in arrival order: each item into the lowest-numbered bin with room.
    Returns the bins (item positions) and their fills.

    A max-segment-tree over the bins' free space finds that bin in O(log n)."""
    n = len(sizes)
    leaves = 1
    while leaves < max(n, 1):
        leaves *= 2
    tree = [capacity] * (2 * leaves)  # free space; unopened bins are empty (capacity)
    bins: list[list[int]] = []
    for i, s in enumerate(sizes):
        node = 1
        while node < leaves:  # leftmost leaf with free space >= s (the root always has one)
            node = 2 * node if tree[2 * node] >= s else 2 * node + 1
        b = node - leaves
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        tree[node] -= s
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins, [capacity - tree[leaves + b] for b in range(len(bins))]


def _best_fit(sizes: list[int], capacity: int) -> tuple[list[list[int]], list[int]]:
    """Best-fit decreasing: longest first (ties in arrival order), each into the open bin with
    the least free space that still holds it, else a new bin. Returns the bins (item
    positions, each in arrival order) and their fills."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    free: list[tuple[int, int]] = []  # sorted (free space, bin) of bins that are not full
    bins: list[list[int]] = []
    fills: list[int] = []
    for i in order:
        s = sizes[i]
        j = bisect.bisect_left(free, (s, -1))
        if j < len(free):
            space, b = free.pop(j)
        else:
            space, b = capacity, len(bins)
            bins.append([])
            fills.append(0)
        bins[b].append(i)
        fills[b] += s
        if space - s:
            bisect.insort(free, (space - s, b))
    for members in bins:  # each row keeps its documents in arrival order
        members.sort()
    return bins, fills


def _row(pieces: list[tuple[np.ndarray, np.ndarray]], length: int, pad_id: int) -> dict:
    """One row of ``length`` tokens from document pieces (see the module docstring)."""
    lengths = np.fromiter((len(ids) for ids, _ in pieces), np.int64, len(pieces))  # (D,)
    filled = int(lengths.sum())
    pad = length - filled
    ids = np.full(length, pad_id, np.int64)  # (L,)
    labels = np.full(length, IGNORE_INDEX, np.int64)  # (L,)
    if pieces:
        ids[:filled] = np.concatenate([p[0] for p in pieces])
        labels[:filled] = np.concatenate([p[1] for p in pieces])
    seg_lengths = np.append(lengths, pad) if pad else lengths  # the padding is a segment too
    starts = np.cumsum(seg_lengths) - seg_lengths  # (S,)
    starts = starts[seg_lengths > 0]
    labels[starts[starts < filled]] = IGNORE_INDEX  # nothing predicts a document's first token
    positions = np.arange(length) - np.repeat(np.cumsum(seg_lengths) - seg_lengths, seg_lengths)
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(positions),  # (L,) int64
        "document_lengths": torch.from_numpy(lengths.astype(np.int32)),  # (D,) int32
    }
