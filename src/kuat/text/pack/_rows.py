"""How rows are built: document pieces in flat token buffers, gathered into row dicts.

Whatever decided the rows (the in-order packers of ``_inorder.py``, the plan of ``_plan.py``),
a group of rows is built the same way, by :func:`gather_rows`: one ``(R, L)`` block per field,
filled by one gather over the documents' flat tokens (position ids are ``arange - repeat(segment
starts)``, the token index is the piece's start plus that); the rows are views of these blocks.
No Python runs per token.

* :class:`Items`: document pieces to pack (keys, sizes, where their tokens are), cut, taken,
  compacted and concatenated as whole arrays.
* :func:`concat_rows`, :func:`fit_rows`: the rows of a concat buffer or of a buffer's bins.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from kuat.text._docs import IGNORE_INDEX, Block

__all__ = ["Items", "concat_rows", "fit_rows", "gather_rows"]


class Items:
    """Document pieces to pack: keys ``(ord, piece)``, ``size`` and ``start`` in the flat
    ``ids``/``labels`` buffers (all ``(m,) int64``)."""

    __slots__ = ("ord", "piece", "start", "size", "ids", "labels")

    def __init__(self, ord, piece, start, size, ids, labels):
        self.ord, self.piece, self.start, self.size = ord, piece, start, size
        self.ids, self.labels = ids, labels

    @classmethod
    def empty(cls) -> Items:
        e = np.empty(0, np.int64)
        return cls(e, e, e, e, e, e)

    @classmethod
    def cut(cls, block: Block, ordinals: np.ndarray, length: int, keep=None) -> Items:
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

    def take(self, sel: np.ndarray) -> Items:
        return Items(
            self.ord[sel], self.piece[sel], self.start[sel], self.size[sel], self.ids, self.labels
        )

    def compact(self) -> Items:
        """The same pieces with buffers holding only their tokens (what is carried)."""
        src = _segments(self.start, self.size)
        ids = self.ids[src]
        labels = ids if self.labels is self.ids else self.labels[src]
        return Items(self.ord, self.piece, np.cumsum(self.size) - self.size, self.size, ids, labels)

    @staticmethod
    def concat(a: Items, b: Items) -> Items:
        if not len(a.ord):
            return b
        ids = np.concatenate([a.ids, b.ids])
        same = a.labels is a.ids and b.labels is b.ids  # no loss mask: one buffer serves both
        return Items(
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


def gather_rows(ids, labels, src, seg_len, seg_row, fills, length, pad_id) -> list[dict]:
    """Row dicts (see :mod:`kuat.text.pack`) gathered from the flat token buffers ``ids`` and
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


def concat_rows(ids, labels, seg_start, seg_len, nrows, length, filled, pad_id) -> list[dict]:
    """Rows ``0 .. nrows - 1`` of the buffer ``ids``/``labels`` (the first ``filled`` tokens;
    the rest of the last row is padding); ``seg_start``/``seg_len``: the documents in it."""
    live = (seg_len > 0) & (seg_start < filled)
    starts = np.union1d(seg_start[live], np.arange(nrows) * length)  # (S,) pieces, sorted
    piece_len = np.diff(np.append(starts, filled))  # (S,)
    fills = np.full(nrows, length, np.int64)  # (R,)
    fills[-1] = filled - (nrows - 1) * length
    return gather_rows(ids, labels, starts, piece_len, starts // length, fills, length, pad_id)


def fit_rows(items: Items, bins: list[list[int]], fills: list[int], length: int, pad_id: int):
    """One row per bin: its pieces in arrival order, then padding."""
    counts = np.fromiter(map(len, bins), np.int64, len(bins))  # (R,)
    order = np.fromiter(itertools.chain.from_iterable(bins), np.int64, int(counts.sum()))  # (S,)
    return gather_rows(
        items.ids,
        items.labels,
        items.start[order],
        items.size[order],
        np.repeat(np.arange(len(bins)), counts),  # (S,) the row of each piece
        np.asarray(fills, np.int64),
        length,
        pad_id,
    )
