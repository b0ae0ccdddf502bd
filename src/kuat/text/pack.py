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

Who packs what: with the documents' lengths (a kuat dataset, or ``lengths=``), every consumer
(each rank's each loader worker) computes the same *plan* from the lengths alone and reads and
builds only its own rows: ``concat`` rows are token ranges of the epoch, found by arithmetic;
the fit strategies run the bin choice over every buffer's lengths (no tokens read), once per
process: the thread workers of one loader read one plan, each buffer's bin choice made by the
first worker to need it. Without lengths (iterable sources, other map-style sources) each
consumer reads and packs the whole epoch and keeps its rows.

How rows are built: a group of rows (a buffer's, or a chunk of ``concat`` rows) is one
``(R, L)`` block per field, filled by one gather over the documents' flat tokens (position ids
are ``arange - repeat(segment starts)``, the token index is the piece's start plus that); the
rows are views of these blocks.

Resume: through ``kuat.DataLoader``, its ``kuat_iter_from(epoch, batches_served)`` hook starts
each worker at the first batch not yet served: with a plan this costs the plan up to there
(``concat``: one binary search; fit strategies: the bin choice over the lengths before it),
no reading. On its own, :meth:`Packed.iter_rows` returns an iterator whose ``state_dict()`` is a
handful of integers (``concat``: the document and token offset where the next row starts; fit
strategies: the first document of the current buffer, the ``(document, piece)`` keys of the
carried row, and rows already emitted from the buffer). Resuming from it refetches one buffer
and repacks it: the cost is that of one buffer, independent of the position in the epoch (for
map-style sources; an iterable source is re-read, not repacked, up to the buffer).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import numbers
import threading
from collections.abc import Iterator

import numpy as np
import torch

from kuat.sources.stream import Stream, rank_share
from kuat.text._docs import CHUNK, IGNORE_INDEX, Block, Documents

__all__ = ["pack", "Packed", "PackIterator", "STRATEGIES"]

_log = logging.getLogger("kuat.text.pack")

STRATEGIES = ("concat", "first_fit", "best_fit")
_STATE_VERSION = 1
_PLAN_CHUNK = 16  # concat rows built per read: one gather serves several batches
_EMPTY = np.empty(0, np.int64)
_START = (0, 0, ())  # the fit plan's checkpoint at the start of an epoch


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
    lengths=None,
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
        lengths: ``(N,)`` ints, the tokens of each document of a map-style source, by source
            index (e.g. :func:`kuat.text.lengths_of`); read from the source when it is a kuat
            dataset without transforms. Each document read is checked against it.

    Returns:
        A :class:`Packed` stream (a ``torch.utils.data.IterableDataset``). Rows are split by
        position: rank ``r`` of ``W`` takes rows ``r, r + W, ...`` (without ``drop_last``,
        ranks are padded by wrapping around to the first rows, as ``DistributedSampler``
        does), so ranks get equal shares and a row goes to exactly one rank and worker; a
        rank's loader workers take whole batches in turn. Batch rows with
        :func:`kuat.text.pack_collate`.

        With the documents' lengths (a map-style source with ``lengths`` or a kuat dataset),
        each consumer (rank x worker) computes the same packing plan from the lengths alone
        (concat: arithmetic on their running sum; fit strategies: the bin choice over every
        buffer, no tokens read) and reads and builds only its own rows. Otherwise (iterable
        sources, other map-style sources) each consumer reads and packs the whole epoch and
        keeps its rows.

    Raises:
        ValueError: ``seq_len`` or ``buffer_size`` not an int >= 1; an unknown ``strategy`` or
            ``too_long``; ``lengths`` not 1-d ints >= 0. When iterating: ``lengths`` of another
            size than the source, or a document of another length than ``lengths`` says.
        TypeError: ``pad_id`` or ``seed`` not an int, ``field`` not a string.
    """
    if lengths is not None:
        arr = lengths.numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths)
        if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0)):
            raise ValueError(
                f"lengths should be a 1-d sequence of ints >= 0, got shape {arr.shape} "
                f"dtype {arr.dtype}"
            )
        lengths = arr.astype(np.int64)
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
        lengths,
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
        "read_documents",
        "read_tokens",
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
        self,
        source,
        seq_len,
        strategy,
        buffer_size,
        too_long,
        field,
        pad_id,
        shuffle,
        seed,
        lengths=None,
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
        # (N,) document lengths by source index, found once and shared by the shallow copies
        # the loader's thread workers get; None: unknown (read the whole stream)
        self._lengths = {
            "value": lengths,
            "known": lengths is not None,
            "own": lengths is None,  # found from the source itself (not pack(lengths=))
            "lock": threading.Lock(),
        }
        self._checkpoints: dict = {}  # kuat_state_at's plan checkpoints of one epoch
        # the fit plan being read by this process's consumers (thread workers hold shallow
        # copies of this object, so they share it): see _SharedPlan
        self._plans = {"lock": threading.Lock(), "key": None, "plan": None}
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

    def __iter__(self) -> Iterator[dict]:
        return self.kuat_iter_from(self._epoch, 0)

    def kuat_state_at(
        self, epoch: int, batches_served: int, rank: int, world_size: int
    ) -> dict | None:
        """Where the plan of ``epoch`` stands after the first ``batches_served`` batches of
        rank ``rank`` of ``world_size``: a small dict (the checkpoint of the fit strategies' buffer holding the next
        row: its first row and document and the ``(document, piece)`` keys carried into it),
        or ``None`` when there is nothing to say (``concat``, whose rows are found by
        arithmetic; the start of an epoch; unknown lengths). ``kuat.DataLoader.state_dict``
        saves it and hands it back to :meth:`kuat_iter_from`.

        Costs the plan (lengths only) from the last point asked in this epoch: checkpoints
        taken in order cost one plan of the epoch in all. Not thread-safe (the loader calls it
        from its own thread)."""
        if self.strategy == "concat" or not batches_served:
            return None
        lengths = self._doc_lengths()
        if lengths is None:
            return None
        row = rank + world_size * batches_served * (self._batch_size or 1)
        cache = self._checkpoints
        if cache.get("epoch") != epoch:
            cache.clear()
            cache.update(epoch=epoch, points=[_START], complete=False)
        points = cache["points"]
        if row >= points[-1][0] and not cache["complete"]:
            lens = _epoch_lengths(self, epoch, lengths)[1]
            cache["complete"] = True
            for first, buf in _fit_plan(lens, self, PackStats(self.seq_len), points[-1]):
                if first > points[-1][0]:
                    points.append((first, buf.start, buf.carried_keys))
                if first > row:
                    cache["complete"] = False
                    break
        first, start, keys = points[bisect.bisect_right(points, (row, math.inf)) - 1]
        return {
            "version": _STATE_VERSION,
            "strategy": self.strategy,
            "epoch": epoch,
            "first_row": first,
            "start": start,
            "carried": [list(k) for k in keys],
        }

    def kuat_iter_from(
        self, epoch: int, batches_served: int, state: dict | None = None
    ) -> Iterator[dict]:
        """This rank's and this worker's rows of ``epoch`` after the rank's first
        ``batches_served`` batches (``kuat.DataLoader``'s resume hook; see the module
        docstring of :mod:`kuat.loader`): batch ``batches_served`` goes to worker 0, the next
        to worker 1, and so on. ``state``: what :meth:`kuat_state_at` said for this point,
        with which the fit strategies plan from the buffer holding the next row (one buffer's
        bin choice, nothing read before it); without it they plan from the start of the
        epoch (lengths only). Without known lengths the stream is read and packed up to there.

        Raises:
            ValueError: ``state`` is not a state of this strategy and epoch.
        """
        at = None
        if state is not None:
            if (
                not isinstance(state, dict)
                or state.get("version") != _STATE_VERSION
                or state.get("strategy") != self.strategy
                or state.get("epoch") != epoch
            ):
                raise ValueError(
                    f"not a {self.strategy!r} plan state of epoch {epoch}, version "
                    f"{_STATE_VERSION}: {state!r:.200}"
                )
            keys = tuple((int(o), int(p)) for o, p in state["carried"])
            at = (int(state["first_row"]), int(state["start"]), keys)
        rank, world = self._rank_and_world()
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        share = _Share(
            rank, world, self._batch_size or 1, worker, workers, self._drop_last, batches_served
        )
        lengths = self._doc_lengths()
        if lengths is None:
            self._stats = PackStats(self.seq_len)  # (the pass below replaces it)
            return share.filter(self.samples(epoch))
        if self.strategy != "concat" and at is None and share.takes_all() and self._lengths["own"]:
            # one consumer takes every row: packing the epoch in order reads each document once,
            # a block at a time, where the plan would fetch every buffer's documents again by
            # ordinal (same rows; 1.5x faster on 20,000 documents). Lengths given by the user
            # go through the plan, which checks every document against them.
            return self.samples(epoch)
        return _plan_rows(self, epoch, lengths, share, at)

    def _doc_lengths(self) -> np.ndarray | None:
        holder = self._lengths
        if not holder["known"]:
            with holder["lock"]:
                if not holder["known"]:
                    docs = Documents(self.source, self.field, 0, False, 0)
                    holder["value"], holder["known"] = docs.lengths(), True
        return holder["value"]

    def __copy__(self) -> Packed:
        # what a loader's thread worker gets (copy.copy): its own attributes, but the same
        # lengths and plan holders (copy.copy would otherwise go through __getstate__ below,
        # which gives each copy new ones, so every worker found the lengths and planned alone)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __getstate__(self):  # picklable for process workers (a lock is not)
        state = self.__dict__.copy()
        state["_lengths"] = {k: v for k, v in self._lengths.items() if k != "lock"}
        state["_checkpoints"] = {}
        state["_plans"] = {"key": None, "plan": None}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lengths["lock"] = threading.Lock()
        self._plans["lock"] = threading.Lock()

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
        ``padding_fraction`` (pad tokens / row tokens): the packing of the epoch as far as this
        pass decided it (with a plan, every consumer decides every row; ``concat`` decides the
        whole epoch at once); ``read_documents`` and ``read_tokens``: what this pass read (with
        a plan, only its own rows' documents). A resumed pass counts from the resume point's
        buffer. With a loader's workers, each worker's copy counts its own pass."""
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
        self._pos = pos  # where the next row starts; the state dict is built when asked

    def _make_state(self, pos) -> dict:
        state = {"version": _STATE_VERSION, "strategy": self._packed.strategy, "epoch": self._epoch}
        if self._packed.strategy == "concat":
            state["doc"], state["offset"] = pos
        else:
            start, carried, emitted = pos
            state.update(start=start, carried=[list(k) for k in carried], emitted=emitted)
        return state

    def __next__(self) -> dict:
        row, self._pos = next(self._rows)
        return row

    def state_dict(self) -> dict:
        """Where the next row starts: a dict of ints (and, for fit strategies, a list of at most
        ``seq_len`` ``[document, piece]`` pairs)."""
        return self._make_state(self._pos)


# --- strategies: generators of (row, position after the row) ----------------------------------
#
# Both read the documents as flat blocks (kuat.text._docs.Block) and build each group of rows
# with a few NumPy calls over the group's tokens: concat-split reshapes one buffer into rows;
# the fit strategies choose bins in Python (over the documents' sizes only) and then fill all
# of a buffer's rows with one gather per field. No Python runs per token, nor per document in
# the reading of a kuat dataset.


def _concat(docs: Documents, packed: Packed, stats: PackStats, pos) -> Iterator:
    """Concatenate and cut every ``L`` tokens. ``pos``: (document ordinal, token offset)."""
    length, pad_id = packed.seq_len, packed.pad_id
    first, offset = pos
    empty = np.empty(0, np.int64)
    ids = labels = empty  # (T,) int64: tokens read and not yet emitted
    # per document (segment) in the buffer: where it starts in it, its ordinal, the offset in
    # the document of its first buffered token, and the document's full length
    seg_start = seg_ord = seg_off = seg_full = empty
    end = (first, offset)
    for block in docs.blocks(first, CHUNK):
        k = len(block)
        if not k:
            break
        stats.documents += k
        stats.tokens += int(block.lengths.sum())
        stats.read_documents += k
        stats.read_tokens += int(block.lengths.sum())
        b_ids, b_labels, b_starts = block.ids, block.labels, block.starts
        b_off = np.zeros(k, np.int64)
        if block.first == first and offset:  # resuming inside document ``first``
            cut = min(offset, int(block.lengths[0]))
            b_ids, b_labels = b_ids[cut:], b_labels[cut:]
            b_starts = np.maximum(b_starts - cut, 0)
            b_off[0] = cut
        base = len(ids)
        same = labels is ids and b_labels is b_ids  # no loss mask: one buffer serves both
        ids = np.concatenate([ids, b_ids])  # (T,)
        labels = ids if same else np.concatenate([labels, b_labels])  # (T,)
        seg_start = np.concatenate([seg_start, b_starts + base])
        seg_ord = np.concatenate([seg_ord, block.first + np.arange(k)])
        seg_off = np.concatenate([seg_off, b_off])
        seg_full = np.concatenate([seg_full, block.lengths])
        end = (block.first + k, 0)
        nrows = len(ids) // length
        if not nrows:
            continue
        cut_at = nrows * length
        # where each row's successor starts: (document, offset), for the state
        nxt = np.arange(1, nrows + 1) * length  # (R,)
        j = np.searchsorted(seg_start, nxt, "right") - 1
        at = seg_off[j] + nxt - seg_start[j]
        done = at >= seg_full[j]
        after_doc = np.where(done, seg_ord[j] + 1, seg_ord[j]).tolist()
        after_at = np.where(done, 0, at).tolist()
        rows = _concat_rows(
            ids, labels, seg_start, seg_full - seg_off, nrows, length, cut_at, pad_id
        )
        stats.rows += nrows
        for r, row in enumerate(rows):
            yield row, (after_doc[r], after_at[r])
        j0 = int(np.searchsorted(seg_start, cut_at, "right")) - 1
        seg_off = seg_off[j0:].copy()
        seg_off[0] += cut_at - seg_start[j0]
        seg_start = np.maximum(seg_start[j0:] - cut_at, 0)
        seg_ord, seg_full = seg_ord[j0:], seg_full[j0:]
        ids, labels = ids[cut_at:], (None if labels is ids else labels[cut_at:])
        labels = ids if labels is None else labels
    if len(ids):
        filled = len(ids)
        stats.rows += 1
        stats.pad_tokens += length - filled
        yield (
            _concat_rows(ids, labels, seg_start, seg_full - seg_off, 1, length, filled, pad_id)[0],
            end,
        )


def _concat_rows(ids, labels, seg_start, seg_len, nrows, length, filled, pad_id) -> list[dict]:
    """Rows ``0 .. nrows - 1`` of the buffer ``ids``/``labels`` (the first ``filled`` tokens;
    the rest of the last row is padding); ``seg_start``/``seg_len``: the documents in it."""
    live = (seg_len > 0) & (seg_start < filled)
    starts = np.union1d(seg_start[live], np.arange(nrows) * length)  # (S,) pieces, sorted
    piece_len = np.diff(np.append(starts, filled))  # (S,)
    fills = np.full(nrows, length, np.int64)  # (R,)
    fills[-1] = filled - (nrows - 1) * length
    return _gather_rows(ids, labels, starts, piece_len, starts // length, fills, length, pad_id)


def _fit(docs: Documents, packed: Packed, stats: PackStats, pos) -> Iterator:
    """First-fit or best-fit decreasing over buffers. ``pos``: (first document of the buffer,
    keys of the row carried into it, rows already emitted from it)."""
    length = packed.seq_len
    start, carried_keys, skip = pos
    carried = _Items.empty()
    if carried_keys:
        fetched = docs.fetch(sorted({o for o, _ in carried_keys}))
        block = Block.of_docs(0, fetched)
        ordinals = np.array([d.ordinal for d in fetched], np.int64)
        pieces = _Items.cut(block, ordinals, length)
        where = {
            (o, p): i for i, (o, p) in enumerate(zip(pieces.ord.tolist(), pieces.piece.tolist()))
        }
        carried = pieces.take(np.array([where[k] for k in carried_keys], np.int64))
    buffers = _fit_buffers(docs.blocks(start, packed.buffer_size), packed, stats, carried, True)
    for buf in buffers:
        out_keys = (buf.start, buf.carried_keys)
        if len(buf.bins) > skip:
            emit = buf.bins[skip:]
            fills = buf.fills[skip:]
            rows = _fit_rows(buf.items, emit, fills, length, packed.pad_id)
            for e, row in enumerate(rows, skip + 1):
                yield row, (*out_keys, e)
        skip = 0


class _Buffer:
    """One buffer's packing decision: the rows it emits (``bins``: positions in ``items``, each
    in arrival order; ``fills``: their tokens), the first document ``start`` of the buffer and
    the keys of the row carried into it."""

    __slots__ = ("items", "bins", "fills", "start", "carried_keys")

    def __init__(self, items, bins, fills, start, carried_keys):
        self.items, self.bins, self.fills = items, bins, fills
        self.start, self.carried_keys = start, carried_keys


def _fit_buffers(blocks, packed: Packed, stats: PackStats, carried, tokens: bool):
    """The packing decisions of consecutive buffers (:class:`_Buffer`), from ``blocks`` of
    ``buffer_size`` documents: with their tokens (``tokens``), or lengths only (the plan every
    consumer computes alike). ``carried``: the row carried into the first buffer."""
    length, size = packed.seq_len, packed.buffer_size
    drop = packed.too_long == "drop"
    binpack = _first_fit if packed.strategy == "first_fit" else _best_fit
    for block in blocks:
        last = len(block) < size
        lengths = block.lengths
        stats.documents += len(block)
        stats.tokens += int(lengths.sum())
        if tokens:
            stats.read_documents += len(block)
            stats.read_tokens += int(lengths.sum())
        too_long = lengths > length
        if drop:
            stats.dropped_documents += int(too_long.sum())
            stats.dropped_tokens += int(lengths[too_long].sum())
        else:
            stats.split_documents += int(too_long.sum())
        ordinals = block.first + np.arange(len(block))
        new = _Items.cut(block, ordinals, length, keep=~too_long if drop else None)
        items = _Items.concat(carried, new)
        bins, fills = binpack(items.size, length)
        keep_back = None
        if not last and bins:
            emptiest = min(range(len(bins)), key=lambda b: (fills[b], -b))
            if fills[emptiest] < length:
                keep_back = emptiest
        out = [b for b in range(len(bins)) if b != keep_back]
        carried_keys = tuple(zip(carried.ord.tolist(), carried.piece.tolist()))
        emit_bins = [bins[b] for b in out]
        emit_fills = [fills[b] for b in out]
        stats.rows += len(out)
        stats.pad_tokens += length * len(out) - sum(emit_fills)
        yield _Buffer(items, emit_bins, emit_fills, block.first, carried_keys)
        if last:
            return
        keep = [] if keep_back is None else bins[keep_back]
        carried = items.take(np.array(keep, np.int64))
        if tokens:
            carried = carried.compact()


# --- the plan: rows decided from document lengths, so each consumer reads only its own rows -----


class _Share:
    """Which rows of an epoch one consumer (a rank's worker) yields, and from which batch on.

    Ranks take rows ``rank, rank + world_size, ...`` (``rank_share``); workers take whole
    batches of the rank's rows, batch ``start + j`` going to worker ``j % workers``
    (``worker_share``, shifted by the ``start`` batches already served)."""

    __slots__ = ("rank", "world", "batch", "worker", "workers", "drop_last", "start")

    def __init__(self, rank, world, batch, worker, workers, drop_last, start):
        self.rank, self.world, self.batch = rank, world, batch
        self.worker, self.workers = worker, workers
        self.drop_last, self.start = drop_last, start

    def mine(self, positions: np.ndarray) -> np.ndarray:
        """``(R,) bool``: which global row positions (padding positions included) are ours."""
        k = positions // self.world // self.batch - self.start  # (R,) batch, from the start
        return (positions % self.world == self.rank) & (k >= 0) & (k % self.workers == self.worker)

    def takes_all(self) -> bool:
        """Whether this consumer yields every row of the epoch, from the first."""
        return self.world == 1 and self.workers == 1 and self.start == 0

    def served(self, n: int) -> int:
        """Positions an epoch of ``n`` rows has across ranks (padded or truncated)."""
        if self.drop_last:
            return n // self.world * self.world
        return -(-n // self.world) * self.world

    def filter(self, rows: Iterator[dict]) -> Iterator[dict]:
        """Our rows of the unsplit ``rows`` (what the stream path reads whole)."""
        if self.world > 1:
            rows = rank_share(rows, self.rank, self.world, self.drop_last)
        for q, row in enumerate(rows):
            k = q // self.batch - self.start
            if k >= 0 and k % self.workers == self.worker:
                yield row


def _epoch_lengths(packed: Packed, epoch: int, lengths: np.ndarray) -> tuple[Documents, np.ndarray]:
    """The epoch's documents and ``(N,) int64`` lengths by ordinal (``lengths`` by index)."""
    docs = Documents(packed.source, packed.field, epoch, packed.shuffle, packed.seed)
    if len(lengths) != len(docs.order):
        raise ValueError(
            f"pack(lengths=...) has {len(lengths)} lengths, the source {len(docs.order)} documents"
        )
    return docs, lengths[docs.order]


def _plan_rows(
    packed: Packed, epoch: int, lengths: np.ndarray, share: _Share, at
) -> Iterator[dict]:
    """Our rows of ``epoch``, planned from ``lengths`` ``(N,)`` (by source index): the choice of
    rows costs the lengths only; tokens are read for our rows only. ``at``: the fit plan's
    checkpoint to start from (``(first row, first document, carried keys)`` of a buffer)."""
    docs, lens = _epoch_lengths(packed, epoch, lengths)
    stats = packed._stats = PackStats(packed.seq_len)
    if packed.strategy == "concat":
        return _concat_planned(docs, lens, packed, stats, share)
    return _fit_planned(docs, lens, packed, stats, share, at)


def _fit_plan(lens: np.ndarray, packed: Packed, stats: PackStats, at) -> Iterator:
    """``(first row, _Buffer)`` of each buffer of an epoch's fit plan (lengths only), from the
    checkpoint ``at = (first row, first document, carried keys)`` of a buffer."""
    first, start, keys = at
    size, length, n = packed.buffer_size, packed.seq_len, len(lens)
    blocks = (
        Block(lo, lens[lo : lo + size], _EMPTY, _EMPTY)
        for lo in range(start, n + 1, size)
        if lo < n or (n - start) % size == 0  # (as Documents.blocks: a last, empty block)
    )
    ords = np.array([o for o, _ in keys], np.int64)
    pieces = np.array([p for _, p in keys], np.int64)
    sizes = np.minimum(length, lens[ords] - pieces * length)  # (c,) as _Items.cut cuts them
    carried = _Items(ords, pieces, np.zeros_like(ords), sizes, _EMPTY, _EMPTY)
    for buf in _fit_buffers(blocks, packed, stats, carried, False):
        yield first, buf
        first += len(buf.bins)


def _shared_plan(packed: Packed, epoch: int, lens: np.ndarray, at) -> _SharedPlan:
    """The fit plan of ``epoch`` (lengths ``lens`` by ordinal) from ``at`` that this consumer
    reads: the one the other thread workers of its loader read (they iterate shallow copies of
    one :class:`Packed`, whose ``_plans`` they share), or a new one."""
    info = torch.utils.data.get_worker_info()
    threads = info is not None and getattr(info, "worker_method", None) == "thread"
    readers = info.num_workers if threads else 1
    holder = packed._plans
    key = (epoch, at, readers)
    with holder["lock"]:
        plan = holder["plan"]
        if holder["key"] != key or plan.full():  # (full: a new pass over the same epoch)
            plan = _SharedPlan(lambda stats: _fit_plan(lens, packed, stats, at), readers)
            holder["key"], holder["plan"] = key, plan
        return plan


class _SharedPlan:
    """One pass's fit plan, computed once for the ``readers`` consumers of one process (a
    loader's thread workers), each of which reads every buffer of it: a buffer is planned when
    the first reader needs it (under a lock: the others wait rather than plan it again) and
    dropped once all ``readers`` have joined and passed it, so memory holds the buffers between
    the slowest and the fastest reader. A reader that joins after buffers were dropped (one
    more than expected) plans alone. Each reader's stats count the whole plan, as a plan of its
    own would. Thread-safe."""

    def __init__(self, make, readers: int):
        self._make = make  # stats -> iterator of (first row, _Buffer)
        self._readers = readers
        self._lock = threading.Lock()
        self._stats = PackStats()  # what planning the buffers counted, per buffer below
        self._plan = None
        self._buffers: list[tuple] = []  # (first, buf, counts) of buffers base, base + 1, ...
        self._base = 0
        self._done = False
        self._joined = 0
        self._at: dict[int, int] = {}  # reader -> the next buffer it reads

    def full(self) -> bool:
        with self._lock:
            return self._joined >= self._readers

    def read(self, stats: PackStats) -> Iterator:
        """``(first row, _Buffer)`` of every buffer in order, each buffer's counts added to
        ``stats``."""
        with self._lock:
            alone = self._base > 0
            me = self._joined
            self._joined += 1
            if not alone:
                self._at[me] = 0
        if alone:
            yield from self._make(stats)
            return
        try:
            i = 0
            while True:
                with self._lock:
                    while i - self._base == len(self._buffers) and not self._done:
                        self._plan_next()
                    if i - self._base == len(self._buffers):
                        return
                    first, buf, counts = self._buffers[i - self._base]
                    self._at[me] = i = i + 1
                    self._drop()
                for name, n in counts:
                    setattr(stats, name, getattr(stats, name) + n)
                yield first, buf
        finally:
            with self._lock:
                del self._at[me]
                self._drop()

    def _plan_next(self) -> None:  # (under the lock)
        if self._plan is None:
            self._plan = self._make(self._stats)
        names = PackStats._COUNTS
        before = [getattr(self._stats, k) for k in names]
        try:
            first, buf = next(self._plan)
        except StopIteration:
            self._done = True
            return
        after = [getattr(self._stats, k) for k in names]
        counts = [(k, b - a) for k, a, b in zip(names, before, after) if b != a]
        self._buffers.append((first, buf, counts))

    def _drop(self) -> None:  # (under the lock) buffers every reader has passed
        if self._joined < self._readers:
            return
        passed = min(self._at.values(), default=self._base + len(self._buffers))
        if passed > self._base:
            del self._buffers[: passed - self._base]
            self._base = passed


def _concat_planned(docs, lens, packed, stats, share) -> Iterator[dict]:
    """Concat-split rows are token ranges ``[p L, (p + 1) L)`` of the epoch: ours are found by
    arithmetic, each from a binary search over the documents' starts."""
    length = packed.seq_len
    cum = np.concatenate([[0], np.cumsum(lens)])  # (N + 1,) where each document starts
    total = int(cum[-1])
    n = -(-total // length)
    stats.documents, stats.tokens, stats.rows = len(lens), total, n
    stats.pad_tokens = n * length - total
    if not n:
        return
    positions = np.arange(share.rank, share.served(n), share.world)  # (Q,) our rank's positions
    positions = positions[share.mine(positions)]
    rows = np.where(positions < n, positions, (positions - n) % n)  # (Q,) wrap-around padding
    doc_starts = cum[:-1][lens > 0]  # (N',) starts of non-empty documents
    for lo in range(0, len(rows), _PLAN_CHUNK):
        p = rows[lo : lo + _PLAN_CHUNK]  # (R,) rows to build
        begin = p * length  # (R,) first token of each row in the epoch
        end = np.minimum(begin + length, total)  # (R,)
        a = np.searchsorted(doc_starts, begin, "right")  # documents starting inside the row
        b = np.searchsorted(doc_starts, end, "left")
        count = b - a + 1  # (R,) pieces per row: the row's start, then each document start
        seg_row = np.repeat(np.arange(len(p)), count)  # (S,)
        j = np.arange(len(seg_row)) - np.repeat(np.cumsum(count) - count, count)  # (S,)
        inner = doc_starts[np.maximum(a[seg_row] + j - 1, 0)]
        point = np.where(j == 0, begin[seg_row], inner)  # (S,) first token of each piece
        nxt = np.append(point[1:], 0)
        last = np.append(seg_row[1:] != seg_row[:-1], True)  # (S,) the row's last piece
        seg_len = np.where(last, end[seg_row], nxt) - point
        seg_ord = np.searchsorted(cum, point, "right") - 1  # (S,) the non-empty document there
        yield from _assemble(
            docs,
            lens,
            stats,
            seg_row,
            seg_ord,
            point - cum[seg_ord],
            seg_len,
            end - begin,
            length,
            packed.pad_id,
        )


def _fit_planned(docs, lens, packed, stats, share, at) -> Iterator[dict]:
    """Fit rows: every consumer runs the bin choice over the lengths (no tokens read) from
    ``at`` (a buffer's checkpoint, ``None``: the start), then reads and builds only its rows.
    With ``drop_last``, a row is yielded once its round of ``world_size`` rows is known to be
    complete."""
    world = share.world
    pending: list = []  # our rows whose round may still be incomplete (drop_last)
    planned = 0
    for first, buf in _shared_plan(packed, docs.epoch, lens, at or _START).read(stats):
        planned = first + len(buf.bins)
        positions = first + np.arange(len(buf.bins))  # (R,)
        sel = np.flatnonzero(share.mine(positions))
        if len(sel):
            rows = _fit_assemble(docs, lens, stats, buf, sel.tolist(), packed)
            pending.extend(zip(positions[sel].tolist(), rows))
        complete = planned // world * world if share.drop_last else planned
        ready = 0
        while ready < len(pending) and pending[ready][0] < complete:
            ready += 1
        for _, row in pending[:ready]:
            yield row
        del pending[:ready]
    n = planned
    if share.drop_last or not n or n % world == 0:
        return
    wrap = np.arange(n, share.served(n))  # padding positions: rows 0, 1, ... again
    wrap = wrap[share.mine(wrap)]
    if not len(wrap):
        return
    want = ((wrap - n) % n).tolist()
    got: dict[int, dict] = {}
    again = PackStats(packed.seq_len)  # (not counted twice)
    for first, buf in _fit_plan(lens, packed, again, _START):  # rows < world_size again
        sel = [r - first for r in want if first <= r < first + len(buf.bins)]
        if sel:
            rows = _fit_assemble(docs, lens, stats, buf, sel, packed)
            got.update(zip((first + s for s in sel), rows))
        if first + len(buf.bins) > max(want):
            break
    for r in want:
        yield got[r]


def _fit_assemble(docs, lens, stats, buf: _Buffer, sel: list[int], packed) -> list[dict]:
    """Rows ``sel`` (positions in ``buf.bins``) of one buffer, read and built."""
    length, items = packed.seq_len, buf.items
    bins = [buf.bins[i] for i in sel]
    counts = np.fromiter(map(len, bins), np.int64, len(bins))  # (R,)
    order = np.fromiter(itertools.chain.from_iterable(bins), np.int64, int(counts.sum()))
    return _assemble(
        docs,
        lens,
        stats,
        np.repeat(np.arange(len(bins)), counts),  # (S,) the row of each piece
        items.ord[order],
        items.piece[order] * length,
        items.size[order],
        np.asarray([buf.fills[i] for i in sel], np.int64),
        length,
        packed.pad_id,
    )


def _assemble(docs, lens, stats, seg_row, seg_ord, seg_off, seg_len, fills, length, pad_id):
    """Read the documents of the planned pieces and build their rows (see
    :func:`_gather_rows`): a list of row dicts.

    Pieces ``(S,)``, sorted by row and column: in row ``seg_row``, tokens
    ``seg_off .. seg_off + seg_len`` of document ``seg_ord``; ``fills (R,)``: tokens per row.

    Raises:
        ValueError: a document read has another length than the plan's (names it).
    """
    wanted, inverse = np.unique(seg_ord, return_inverse=True)  # (K,) documents, (S,) which
    block = docs.fetch_ordinals(wanted)
    stats.read_documents += len(wanted)
    stats.read_tokens += int(block.lengths.sum())
    bad = np.flatnonzero(block.lengths != lens[wanted])
    if len(bad):
        o = int(wanted[bad[0]])
        raise ValueError(
            f"document {o} (source index {int(docs.order[o])}) has {int(block.lengths[bad[0]])} "
            f"tokens, but the packing plan was made for {int(lens[o])} (pack(lengths=) or the "
            "dataset's length column disagrees with its documents)"
        )
    return _gather_rows(
        block.ids,
        block.labels,
        block.starts[inverse] + seg_off,  # (S,) where each piece starts in the block
        seg_len,
        seg_row,
        fills,
        length,
        pad_id,
    )


class _Items:
    """Document pieces to pack: keys ``(ord, piece)``, ``size`` and ``start`` in the flat
    ``ids``/``labels`` buffers (all ``(m,) int64``)."""

    __slots__ = ("ord", "piece", "start", "size", "ids", "labels")

    def __init__(self, ord, piece, start, size, ids, labels):
        self.ord, self.piece, self.start, self.size = ord, piece, start, size
        self.ids, self.labels = ids, labels

    @classmethod
    def empty(cls) -> _Items:
        e = np.empty(0, np.int64)
        return cls(e, e, e, e, e, e)

    @classmethod
    def cut(cls, block: Block, ordinals: np.ndarray, length: int, keep=None) -> _Items:
        """The non-empty documents of ``block`` cut into pieces of at most ``length`` tokens
        (only those where ``keep``, when given)."""
        lengths = block.lengths
        npieces = -(-lengths // length)  # (k,) 0 for empty documents
        if keep is not None:
            npieces = np.where(keep, npieces, 0)
        doc = np.repeat(np.arange(len(lengths)), npieces)  # (m,)
        piece = np.arange(len(doc)) - np.repeat(np.cumsum(npieces) - npieces, npieces)
        start = block.starts[doc] + piece * length
        size = np.minimum(length, lengths[doc] - piece * length)
        return cls(ordinals[doc], piece, start, size, block.ids, block.labels)

    def take(self, sel: np.ndarray) -> _Items:
        return _Items(
            self.ord[sel], self.piece[sel], self.start[sel], self.size[sel], self.ids, self.labels
        )

    def compact(self) -> _Items:
        """The same pieces with buffers holding only their tokens (what is carried)."""
        src = _segments(self.start, self.size)
        ids = self.ids[src]
        labels = ids if self.labels is self.ids else self.labels[src]
        return _Items(
            self.ord, self.piece, np.cumsum(self.size) - self.size, self.size, ids, labels
        )

    @staticmethod
    def concat(a: _Items, b: _Items) -> _Items:
        if not len(a.ord):
            return b
        ids = np.concatenate([a.ids, b.ids])
        same = a.labels is a.ids and b.labels is b.ids  # no loss mask: one buffer serves both
        return _Items(
            np.concatenate([a.ord, b.ord]),
            np.concatenate([a.piece, b.piece]),
            np.concatenate([a.start, b.start + len(a.ids)]),
            np.concatenate([a.size, b.size]),
            ids,
            ids if same else np.concatenate([a.labels, b.labels]),
        )


def _segments(start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """``(sum(size),) int64``: ``start[0], start[0] + 1, ..., start[1], ...`` (the positions
    of consecutive segments, one gather index for all of them)."""
    offsets = np.cumsum(size) - size  # (m,)
    return np.repeat(start - offsets, size) + np.arange(int(size.sum()))


def _fit_rows(items: _Items, bins: list[list[int]], fills: list[int], length: int, pad_id: int):
    """One row per bin: its pieces in arrival order, then padding."""
    counts = np.fromiter(map(len, bins), np.int64, len(bins))  # (R,)
    order = np.fromiter(itertools.chain.from_iterable(bins), np.int64, int(counts.sum()))  # (S,)
    return _gather_rows(
        items.ids,
        items.labels,
        items.start[order],
        items.size[order],
        np.repeat(np.arange(len(bins)), counts),  # (S,) the row of each piece
        np.asarray(fills, np.int64),
        length,
        pad_id,
    )


def _gather_rows(ids, labels, src, seg_len, seg_row, fills, length, pad_id) -> list[dict]:
    """Row dicts (see the module docstring) gathered from the flat token buffers ``ids`` and
    ``labels`` ``(T,) int64``: document pieces ``(S,)`` sorted by row then column, piece ``s``
    being ``ids[src[s] : src[s] + seg_len[s]]`` in row ``seg_row[s]``; each row's pieces fill its
    columns ``0 .. fills[r] - 1`` in order and padding the rest (``fills (R,)``).

    All rows are built at once, as one ``(R, L)`` block per field: the padding of every row
    that is not full is one more segment, so the segments tile the ``R * L`` slots in order and
    a slot's position id is its offset in its segment (``arange - repeat(segment starts)``) and
    its token the one at ``src + position`` (one ``np.take``). Labels are -100 at every piece's
    first token (nothing predicts across a document boundary) and on the padding. The rows are
    views of these blocks, which this group of rows alone owns."""
    nrows = len(fills)
    counts = np.bincount(seg_row, minlength=nrows)  # (R,) pieces per row
    padded = np.flatnonzero(fills < length)  # (P,) rows with padding
    at = np.cumsum(counts)[padded]  # (P,) where each padding segment goes among the pieces
    seg_src = np.insert(src, at, 0)  # (S + P,) (padding gathers token 0, then is overwritten)
    sizes = np.insert(seg_len, at, length - fills[padded])  # (S + P,)
    seg_dst = np.cumsum(sizes) - sizes  # (S + P,) first slot of each segment in the R * L
    positions = np.arange(nrows * length) - np.repeat(seg_dst, sizes)  # (R * L,) int64
    gather = positions + np.repeat(seg_src, sizes)  # (R * L,) token index in ids / labels
    # (a padding segment may run past the buffer's end: clip, then overwrite it)
    out_ids = np.take(ids, gather, mode="clip")  # (R * L,) int64
    out_labels = out_ids.copy() if labels is ids else np.take(labels, gather, mode="clip")
    pad_slots = _segments(padded * length + fills[padded], length - fills[padded])  # (pads,)
    out_ids[pad_slots] = pad_id
    out_labels[pad_slots] = IGNORE_INDEX
    is_pad = np.zeros(len(sizes), bool)  # (S + P,)
    is_pad[at + np.arange(len(at))] = True  # (np.insert put padding segment i at at[i] + i)
    out_labels[seg_dst[~is_pad]] = IGNORE_INDEX  # nothing predicts a document's first token
    t_ids = torch.from_numpy(out_ids.reshape(nrows, length)).unbind(0)  # R x (L,) int64
    t_labels = torch.from_numpy(out_labels.reshape(nrows, length)).unbind(0)  # R x (L,) int64
    t_pos = torch.from_numpy(positions.reshape(nrows, length)).unbind(0)  # R x (L,) int64
    t_docs = torch.from_numpy(seg_len.astype(np.int32)).split(counts.tolist())  # R x (D,) int32
    return [
        {"input_ids": i, "labels": y, "position_ids": p, "document_lengths": d}
        for i, y, p, d in zip(t_ids, t_labels, t_pos, t_docs)
    ]


def _first_fit(sizes, capacity: int) -> tuple[list[list[int]], list[int]]:
    """Greedy first-fit in arrival order: each item into the lowest-numbered bin with room.
    ``sizes``: ``(n,)`` ints in ``[1, capacity]``. Returns the bins (item positions, in
    arrival order) and their fills.

    Computed bin by bin, which gives the same bins: an item goes to bin ``b`` exactly when it
    fits there and in no earlier bin, and a bin's room depends only on its own items, so bin
    ``b`` is a greedy in-order pass over the items the earlier bins left. Each pass takes the
    longest prefix that fits with one ``cumsum``, then the later items that still fit, each
    found as the first later item no larger than the room left (one vectorised search per item
    taken: few, as the room is smaller than the item that ended the prefix).
    """
    left = np.arange(len(sizes))  # (m,) items in no bin yet, in arrival order
    rest = np.asarray(sizes, np.int64)  # (m,) their sizes
    bins: list[list[int]] = []
    fills: list[int] = []
    # (ndarray methods rather than np.* functions: this loop runs once per row, and NumPy's
    # Python-level wrappers cost as much as the work on ~1,000 sizes)
    while len(left):
        total = rest[:capacity].cumsum()  # (<= capacity,): a bin holds at most that many
        j = int(total.searchsorted(capacity, "right"))  # items 0 .. j - 1 fit together
        room = capacity - int(total[j - 1])
        if room and j + 1 < len(rest):
            after = (rest[j + 1 :] <= room).nonzero()[0]  # (c,) the only later ones that may
        else:  # fit, from j + 1 on
            after = _EMPTY
        if not len(after):  # the prefix is the bin
            bins.append(left[:j].tolist())
            fills.append(capacity - room)
            left, rest = left[j:], rest[j:]
            continue
        after += j + 1  # (c,) positions in ``left``
        later = rest[after]  # (c,)
        picked = []
        k = 0  # position in ``after`` to search from
        while room and k < len(later):
            fits = later[k:] <= room  # (c - k,)
            hit = int(fits.argmax())
            if not fits[hit]:
                break
            picked.append(k + hit)
            room -= int(later[k + hit])
            k += hit + 1
        take = after[picked].tolist()  # (t,) positions in ``left`` of the later items taken
        bins.append(left[:j].tolist() + left[take].tolist())
        fills.append(capacity - room)
        starts, ends = [j, *(t + 1 for t in take)], [*take, len(left)]  # what stays: slices
        left = np.concatenate([left[a:b] for a, b in zip(starts, ends)])
        rest = np.concatenate([rest[a:b] for a, b in zip(starts, ends)])
    return bins, fills


def _best_fit(sizes, capacity: int) -> tuple[list[list[int]], list[int]]:
    """Best-fit decreasing: longest first (ties in arrival order), each into the open bin with
    the least free space that still holds it (ties: the lowest-numbered), else a new bin.
    ``sizes``: ``(n,)`` ints in ``[1, capacity]``. Returns the bins (item positions, each in
    arrival order) and their fills.

    Items of equal size are placed a run at a time, with the same result as one at a time:
    the bin that takes an item of size ``s`` with ``f`` free stays the tightest for the next
    one while ``f - s >= s``, so it takes ``min(k, f // s)`` of a run of ``k``. The Python loop
    runs once per distinct size and bin filled, not once per item.
    """
    sizes = np.asarray(sizes, np.int64)
    n = len(sizes)
    order = np.argsort(-sizes, kind="stable")  # (n,) longest first, ties in arrival order
    ordered = sizes[order]
    run_start = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if n else order
    run_len = np.diff(np.r_[run_start, n])
    owner = np.empty(n, np.int64)  # (n,) the bin of each item, in ``order``
    free: list[tuple[int, int]] = []  # sorted (free space, bin) of bins that are not full
    fills: list[int] = []
    for pos, k, s in zip(run_start.tolist(), run_len.tolist(), ordered[run_start].tolist()):
        while k:
            j = bisect.bisect_left(free, (s, -1))
            if j < len(free):
                space, b = free.pop(j)
            else:
                space, b = capacity, len(fills)
                fills.append(0)
            m = min(k, space // s)
            owner[pos : pos + m] = b
            pos, k = pos + m, k - m
            fills[b] += m * s
            if space - m * s:
                bisect.insort(free, (space - m * s, b))
    item_bin = np.empty(n, np.int64)
    item_bin[order] = owner  # (n,) bin of each item, by arrival
    by_bin = np.argsort(item_bin, kind="stable")  # (n,) items by bin, then arrival
    cuts = np.searchsorted(item_bin[by_bin], np.arange(len(fills) + 1)).tolist()
    members = by_bin.tolist()
    return [members[cuts[b] : cuts[b + 1]] for b in range(len(fills))], fills
