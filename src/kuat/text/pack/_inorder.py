"""Packing while reading an epoch's documents in order: the rows decided buffer after buffer.

What :class:`~kuat.text.Packed` iterates when it reads every document (:meth:`Packed.iter_rows`,
and every consumer of a source without known lengths): generators of ``(row, position after
the row)``, the position being what :class:`~kuat.text.PackIterator` saves to resume.

* :func:`concat_in_order`: concatenate and cut every ``L`` tokens.
* :func:`fit_in_order`: the fit strategies over consecutive buffers of ``buffer_size``
  documents, through :func:`fit_buffers`: each buffer's bins from the strategy
  (``_strategies.py``), the emptiest row carried into the next buffer (except at the end of the
  epoch). The plan (``_plan.py``) runs the same :func:`fit_buffers` over lengths alone.

``packed`` below is the :class:`~kuat.text.Packed` being iterated (its settings; ``stats``: the
pass's :class:`~kuat.text.pack._stats.PackStats`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kuat.text._docs import CHUNK, Block, Documents
from kuat.text.pack._rows import Items, concat_rows, fit_rows
from kuat.text.pack._stats import PackStats
from kuat.text.pack._strategies import FIT_STRATEGIES

__all__ = ["Buffer", "concat_in_order", "fit_buffers", "fit_in_order"]

# Both packers read the documents as flat blocks (kuat.text._docs.Block) and build each group
# of rows with a few NumPy calls over the group's tokens: concat-split reshapes one buffer into
# rows; the fit strategies choose bins in Python (over the documents' sizes only) and then fill
# all of a buffer's rows with one gather per field. No Python runs per token, nor per document
# in the reading of a kuat dataset.


def concat_in_order(docs: Documents, packed, stats: PackStats, pos) -> Iterator:
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
        rows = concat_rows(
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
            concat_rows(ids, labels, seg_start, seg_full - seg_off, 1, length, filled, pad_id)[0],
            end,
        )


def fit_in_order(docs: Documents, packed, stats: PackStats, pos) -> Iterator:
    """First-fit or best-fit decreasing over buffers. ``pos``: (first document of the buffer,
    keys of the row carried into it, rows already emitted from it)."""
    length = packed.seq_len
    start, carried_keys, skip = pos
    carried = Items.empty()
    if carried_keys:
        fetched = docs.fetch(sorted({o for o, _ in carried_keys}))
        block = Block.of_docs(0, fetched)
        ordinals = np.array([d.ordinal for d in fetched], np.int64)
        pieces = Items.cut(block, ordinals, length)
        where = {
            (o, p): i for i, (o, p) in enumerate(zip(pieces.ord.tolist(), pieces.piece.tolist()))
        }
        carried = pieces.take(np.array([where[k] for k in carried_keys], np.int64))
    buffers = fit_buffers(docs.blocks(start, packed.buffer_size), packed, stats, carried, True)
    for buf in buffers:
        out_keys = (buf.start, buf.carried_keys)
        if len(buf.bins) > skip:
            emit = buf.bins[skip:]
            fills = buf.fills[skip:]
            rows = fit_rows(buf.items, emit, fills, length, packed.pad_id)
            for e, row in enumerate(rows, skip + 1):
                yield row, (*out_keys, e)
        skip = 0


class Buffer:
    """One buffer's packing decision: the rows it emits (``bins``: positions in ``items``, each
    in arrival order; ``fills``: their tokens), the first document ``start`` of the buffer and
    the keys of the row carried into it."""

    __slots__ = ("items", "bins", "fills", "start", "carried_keys")

    def __init__(self, items, bins, fills, start, carried_keys):
        self.items, self.bins, self.fills = items, bins, fills
        self.start, self.carried_keys = start, carried_keys


def fit_buffers(blocks, packed, stats: PackStats, carried, tokens: bool):
    """The packing decisions of consecutive buffers (:class:`Buffer`), from ``blocks`` of
    ``buffer_size`` documents: with their tokens (``tokens``), or lengths only (the plan every
    consumer computes alike). ``carried``: the row carried into the first buffer."""
    length, size = packed.seq_len, packed.buffer_size
    drop = packed.too_long == "drop"
    binpack = FIT_STRATEGIES[packed.strategy]
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
        new = Items.cut(block, ordinals, length, keep=~too_long if drop else None)
        items = Items.concat(carried, new)
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
        yield Buffer(items, emit_bins, emit_fills, block.first, carried_keys)
        if last:
            return
        keep = [] if keep_back is None else bins[keep_back]
        carried = items.take(np.array(keep, np.int64))
        if tokens:
            carried = carried.compact()
