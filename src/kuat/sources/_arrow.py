"""Vectorised row gathers over chunked Arrow columns, without Python work per value.

``pyarrow.ChunkedArray.take`` concatenates every chunk of a column before it gathers (tens of
milliseconds per batch on a memory-mapped column of a few hundred chunks), and
``datasets.table.Table.fast_gather`` builds one single-row slice per row. The gathers here keep
one zero-copy NumPy view per chunk and touch only the rows asked for: one
``searchsorted`` for the whole batch, then one small NumPy operation per chunk touched.

Only columns without nulls whose values are fixed-width numbers qualify (checked by
:func:`numeric_column` / :func:`numeric_list_column`); everything else goes through the
caller's general path.

Thread-safety: the column objects are read-only after construction and safe to share between
threads.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

__all__ = ["ChunkIndex", "ScalarColumn", "ListColumn", "numeric_column", "numeric_list_column"]


def _is_fixed_width_number(t: pa.DataType) -> bool:
    return pat.is_integer(t) or pat.is_floating(t)


class ChunkIndex:
    """Maps global row numbers to ``(chunk, row within chunk)`` for a chunked column.

    Args:
        lengths: the row count of each chunk, in order.
    """

    def __init__(self, lengths: list[int]):
        self.starts = np.zeros(len(lengths) + 1, dtype=np.int64)  # (C + 1,)
        np.cumsum(lengths, out=self.starts[1:])
        self.num_rows = int(self.starts[-1])

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(chunk ids, local rows)``, both ``(B,) int64``, of global ``rows`` ``(B,) int64``."""
        if len(self.starts) == 2:  # one chunk: no search
            return np.zeros(len(rows), dtype=np.int64), rows
        chunk = np.searchsorted(self.starts, rows, side="right") - 1  # (B,)
        return chunk, rows - self.starts[chunk]


def _root(buf: pa.Buffer) -> pa.Buffer:
    while buf.parent is not None:
        buf = buf.parent

    return buf


class _Region:
    """Every chunk's buffer inside ONE memory region (a memory-mapped Arrow file, or a single
    chunk): a typed view of the whole region plus each chunk's first element in it, so that a
    gather across chunks is one NumPy fancy index instead of one per chunk.

    Attributes:
        view: ``(M,)`` read-only view of the region in the chunks' dtype.
        starts: ``(C,) int64``, where chunk ``c``'s elements begin in ``view``.
    """

    def __init__(self, view: np.ndarray, starts: np.ndarray):
        self.view = view
        self.starts = starts

    @classmethod
    def of(cls, arrays: list[np.ndarray], buffers: list[pa.Buffer]) -> _Region | None:
        """The region of ``arrays`` (zero-copy views of ``buffers``), or None if there is none."""
        if not arrays:
            return None
        roots = {(r.address, r.size): r for r in map(_root, buffers)}
        if len(roots) != 1:
            return None
        (root,) = roots.values()
        dtype = arrays[0].dtype
        item = dtype.itemsize
        if root.address % item:
            return None
        starts = np.zeros(len(arrays), dtype=np.int64)
        for i, a in enumerate(arrays):
            if a.dtype != dtype:
                return None
            if a.size == 0:
                continue  # never indexed
            delta = a.ctypes.data - root.address
            if delta % item or delta < 0 or delta + a.nbytes > root.size:
                return None
            starts[i] = delta // item
        view = np.frombuffer(root, dtype=dtype, count=root.size // item)  # (M,)
        return cls(view, starts)


class ScalarColumn:
    """A fixed-width numeric column without nulls, one zero-copy NumPy view per chunk."""

    def __init__(self, column: pa.ChunkedArray):
        chunks = [c for c in column.chunks if len(c)]
        self.index = ChunkIndex([len(c) for c in chunks])
        self.chunks = [c.to_numpy(zero_copy_only=True) for c in chunks]
        self.dtype = np.dtype(column.type.to_pandas_dtype())
        self.region = _Region.of(self.chunks, [c.buffers()[1] for c in chunks])

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Values at global ``rows`` ``(B,) int64`` -> ``(B,)`` of the column's dtype."""
        if len(self.chunks) == 1:
            return self.chunks[0][rows]
        chunk, local = self.index.locate(rows)
        if self.region is not None:
            return self.region.view[self.region.starts[chunk] + local]  # (B,)
        out = np.empty(len(rows), dtype=self.dtype)  # (B,)
        for c in np.unique(chunk).tolist():
            sel = chunk == c
            out[sel] = self.chunks[c][local[sel]]
        return out


class ListColumn:
    """A list (or large list) column of fixed-width numbers without nulls at either level.

    Each chunk is kept as its offsets ``(n + 1,)`` and values, both zero-copy NumPy views.
    """

    def __init__(self, column: pa.ChunkedArray):
        chunks = [c for c in column.chunks if len(c)]
        self.index = ChunkIndex([len(c) for c in chunks])
        # ListArray.offsets honours the chunk's own slice offset and indexes into .values,
        # which ignores it, so values[offsets[i]:offsets[i + 1]] is row i of the chunk.
        self.offsets = [c.offsets.to_numpy(zero_copy_only=True) for c in chunks]
        self.values = [c.values.to_numpy(zero_copy_only=True) for c in chunks]
        self.dtype = np.dtype(column.type.value_type.to_pandas_dtype())
        self.offsets_region = _Region.of(self.offsets, [c.offsets.buffers()[1] for c in chunks])
        self.values_region = _Region.of(self.values, [c.values.buffers()[1] for c in chunks])

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows at global ``rows`` ``(B,) int64``, concatenated in that order.

        Returns:
            ``(offsets, values)``: ``offsets`` ``(B + 1,) int64`` into ``values`` ``(N,)`` (the
            column's value dtype), so row ``i`` is ``values[offsets[i]:offsets[i + 1]]``.
        """
        if len(rows) == 0 or not self.offsets:
            return np.zeros(len(rows) + 1, dtype=np.int64), np.empty(0, dtype=self.dtype)
        chunk, local = self.index.locate(rows)
        if self.offsets_region is not None and self.values_region is not None:
            return self._take_in_regions(chunk, local)
        starts = np.empty(len(rows), dtype=np.int64)  # (B,)
        ends = np.empty(len(rows), dtype=np.int64)  # (B,)
        for c in np.unique(chunk).tolist() if len(self.offsets) > 1 else [0]:
            sel = chunk == c if len(self.offsets) > 1 else slice(None)
            offs = self.offsets[c]
            starts[sel] = offs[local[sel]]
            ends[sel] = offs[local[sel] + 1]
        lengths = ends - starts  # (B,)
        out_offsets = np.zeros(len(rows) + 1, dtype=np.int64)  # (B + 1,)
        np.cumsum(lengths, out=out_offsets[1:])
        if len(self.values) == 1:
            # One fancy-index gather: position j of row i reads values[starts[i] + j].
            gather = np.repeat(starts - out_offsets[:-1], lengths) + np.arange(out_offsets[-1])
            return out_offsets, self.values[0][gather]  # (N,)
        pieces = [
            self.values[c][s:e]
            for c, s, e in zip(chunk.tolist(), starts.tolist(), ends.tolist(), strict=True)
        ]
        values = np.concatenate(pieces) if pieces else np.empty(0, dtype=self.dtype)
        return out_offsets, values  # (N,)

    def _take_in_regions(self, chunk: np.ndarray, local: np.ndarray):
        offs, vals = self.offsets_region, self.values_region
        at = offs.starts[chunk] + local  # (B,) rows' offset positions in the region
        starts = offs.view[at].astype(np.int64)  # (B,) value positions within each chunk
        lengths = offs.view[at + 1] - starts  # (B,)
        starts += vals.starts[chunk]  # (B,) value positions in the region
        out_offsets = np.zeros(len(chunk) + 1, dtype=np.int64)  # (B + 1,)
        np.cumsum(lengths, out=out_offsets[1:])
        # Position j of row i reads region[starts[i] + j]: one gather for the whole batch.
        gather = np.repeat(starts - out_offsets[:-1], lengths) + np.arange(out_offsets[-1])
        return out_offsets, vals.view[gather]  # (B + 1,), (N,)


def numeric_column(column: pa.ChunkedArray) -> ScalarColumn | None:
    """A :class:`ScalarColumn` for ``column`` when it qualifies (numbers, no nulls), else None."""
    if not _is_fixed_width_number(column.type) or column.null_count:
        return None
    return ScalarColumn(column)


def numeric_list_column(column: pa.ChunkedArray) -> ListColumn | None:
    """A :class:`ListColumn` for ``column`` when it qualifies, else None.

    Qualifies: ``list<number>`` or ``large_list<number>``, no null list and no null value.
    """
    t = column.type
    if not (pat.is_list(t) or pat.is_large_list(t)) or not _is_fixed_width_number(t.value_type):
        return None
    if column.null_count:
        return None
    for chunk in column.chunks:
        if chunk.values.null_count:
            return None
    return ListColumn(column)
