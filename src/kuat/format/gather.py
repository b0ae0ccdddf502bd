"""Gathering: one field's values of a batch of rows, copied (or viewed) out of the mapped shards
that hold them, column-wise (what :meth:`kuat.format.store.Store.read_batch` returns per field).

The rows come grouped by shard (``Store``'s groups: ``(shard, batch positions or None, rows
within the shard)``); each field kind is gathered by one function of the table ``_GATHER``:

- scalar / bool / tensor: one ``np.take`` per shard into a ``(B, *shape)`` array;
- image: an :class:`ImageBatch` of zero-copy ``memoryview`` s and ``(B,)`` widths/heights;
- bytes / string / sequence: zero-copy ``memoryview`` s, ``str`` s, or read-only array views;
- strings: new ``list[str]``.

Variable-length rows' pages are requested from the kernel for all rows of a shard at once
(``madvise(MADV_WILLNEED)``), so rows not in the page cache are read concurrently, not one fault
at a time. Nothing is decoded here.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kuat.format.schema import FieldType

__all__ = ["ImageBatch", "ImageRows", "gather_column", "gather_flat", "native", "use_native"]

# Binary/sequence/string rows are advised to the kernel (madvise WILLNEED) only when a batch's
# rows average at least this: 16 pages, where the ~3.5 us system call per row is small beside
# what reads such a row (a decode); image fields are always advised (see _Var.will_need).
_ADVISE_MIN_MEAN_BYTES = 64 << 10


class ImageBatch(NamedTuple):
    """The stored form of an image field for a batch of B rows (:meth:`Store.read_batch`).

    Attributes:
        data: B zero-copy ``memoryview`` s of the encoded bytes (read-only, valid while held).
        width, height: ``(B,)`` int32, pixels after EXIF orientation.
        codec: B lower-case codec names (``"jpeg"``, ``"png"``, ...); ``None`` for a field
            whose reader decodes the bytes itself (``Store.gather``'s ``self_advised``).
    """

    data: list
    width: np.ndarray
    height: np.ndarray
    codec: list


# (take_rows, image_rows, locate_rows) of kuat.vision._roijpeg, registered when the ROI
# decoder loads (kuat.vision.decode, as kuat.rng.use_native_words): scalar, bool, tensor and
# self-advised image columns of a batch gathered across shards in one C call each, no
# per-row Python; the rows' shards located in one more
_native: tuple | None = None


def use_native(take_rows, image_rows, locate_rows) -> None:
    """Gather fixed-size and self-advised image columns with these C functions (``_roijpeg.c``
    ``take_rows``, ``image_rows`` and ``locate_rows``: the same values as the Python gather
    and ``np.searchsorted``; tests compare). Not for users."""
    global _native
    _native = (take_rows, image_rows, locate_rows)


def native() -> tuple | None:
    """``(take_rows, image_rows, locate_rows)`` when registered (:func:`use_native`), else
    ``None``."""
    return _native


def native_images(image_rows, table: list, sid: np.ndarray, local: np.ndarray) -> ImageBatch | None:
    """A self-advised image field's :class:`ImageBatch` (``codec=None``), rows ``local`` of
    shards ``sid`` (``(B,)`` int64 each), gathered by ``image_rows`` from ``table`` (per shard
    ``(bytes view, offsets, width, height)``, or None while unmapped); ``None`` when a shard of
    the batch is not mapped."""
    b = len(sid)
    width, height = np.empty(b, np.int32), np.empty(b, np.int32)
    views = image_rows(table, sid, local, width, height)
    return None if type(views) is int else ImageBatch(views, width, height, None)


class ImageRows:
    """A self-advised image column of a batch not yet sliced (``Store.gather`` with the C
    gather): the rows as their shards' table entries, for a batch decoder that reads them in C
    (``kuat.vision._rows``: no per-row view, no ``(B,)`` size array made). Reads as an
    :class:`ImageBatch` (``data``, ``width``, ``height``; ``codec`` ``None``): the views and
    sizes are gathered on first access (one ``image_rows`` call; by the store's shard groups
    when a shard of the batch is not mapped, which maps it and holds its views).

    Attributes:
        table: per shard ``(bytes view, offsets, width, height)`` of the column, or ``None``
            while the shard is not mapped (the store's list: read, never written, here).
        sid, local, idx: ``(B,)`` int64 each row's shard, its row in that shard, and its
            global row (the sample index).

    Thread-safety: owned by the thread fetching the batch.
    """

    __slots__ = ("table", "sid", "local", "idx", "_store", "_name", "_batch")

    def __init__(self, store, name: str, table: list, sid: np.ndarray, local: np.ndarray,
                 idx: np.ndarray):
        self.table, self.sid, self.local, self.idx = table, sid, local, idx
        self._store, self._name, self._batch = store, name, None

    def batch(self) -> ImageBatch:
        """The rows as an :class:`ImageBatch` (``codec=None``), gathered once."""
        if self._batch is None:
            c = native_images(_native[1], self.table, self.sid, self.local)
            if c is None:  # a shard not mapped (or dropped since): by the store's shard
                store, name = self._store, self._name  # groups, which map them (not advised:
                c = gather_column(name, store.schema[name].type, store._groups(self.idx)[1],
                                  len(self.idx), advise=False)  # the reader does it)
            self._batch = c
        return self._batch

    def __len__(self) -> int:
        return len(self.sid)

    data = property(lambda self: self.batch().data)
    width = property(lambda self: self.batch().width)
    height = property(lambda self: self.batch().height)
    codec = property(lambda self: None)


def gather_column(name: str, ftype: FieldType, groups: list, b: int, advise: bool = True) -> object:
    """Field ``name``'s column for the ``b`` rows of ``groups`` (``Store._groups``' list of
    ``(shard, positions or None, local rows)``), in batch order, as ``read_batch`` returns it.
    ``advise=False``: an image field's rows are not advised (their reader does it, from the
    bytes alone: its codec names are not made either, ``codec=None``)."""
    if ftype.kind == "image":
        return _images(name, ftype, groups, b, advise)
    return _GATHER[ftype.kind](name, ftype, groups, b)


def _fixed(name: str, ftype: FieldType, groups: list, b: int) -> np.ndarray:
    kind = ftype.kind
    dt = ftype.np_dtype if kind != "bool" else np.dtype(bool)
    res = np.empty((b, *(ftype.shape or ())), dt)  # (B, *shape)
    for shard, pos, rows in groups:
        col = shard.columns[name].values
        if pos is None:
            # one copy straight into res; indices are already checked, and
            # mode="clip" avoids numpy's buffered (extra-copy) out= path
            np.take(col, rows, axis=0, out=res, mode="clip")
        elif len(pos) <= 8:  # few rows in this shard: per-row copies are cheaper
            for p, r in zip(pos, rows):
                res[p] = col[r]
        else:
            res[pos] = np.take(col, rows, axis=0, mode="clip")
    return res


def _images(name: str, ftype: FieldType, groups: list, b: int, advise: bool = True) -> ImageBatch:
    width, height = np.empty(b, np.int32), np.empty(b, np.int32)
    if not advise and len(groups) == 1:  # one shard, read by a batch decoder: B views only
        shard, _, rows = groups[0]
        col = shard.columns[name]
        starts, ends = col.bytes.spans(rows)
        mv = col.bytes.mv
        np.take(col.width, rows, out=width, mode="clip")
        np.take(col.height, rows, out=height, mode="clip")
        return ImageBatch([mv[s:e] for s, e in zip(starts, ends)], width, height, None)
    data = [None] * b
    codec = [None] * b if advise else None
    for shard, pos, rows in groups:
        col = shard.columns[name]
        p = range(b) if pos is None else pos
        starts, ends = col.bytes.spans(rows)
        mv = col.bytes.mv
        if advise:  # read the rows' pages now, all at once
            col.bytes.will_need(starts, ends)
            cs, ce = col.codec.spans(rows)
            cdata = col.codec.data
            for j, s2, e2 in zip(p, cs, ce):
                codec[j] = cdata[s2:e2].tobytes().decode()
        for j, s, e in zip(p, starts, ends):
            data[j] = mv[s:e]
        if pos is None:
            np.take(col.width, rows, out=width, mode="clip")
            np.take(col.height, rows, out=height, mode="clip")
        else:
            width[pos] = np.take(col.width, rows, mode="clip")
            height[pos] = np.take(col.height, rows, mode="clip")
    return ImageBatch(data, width, height, codec)


def _string_lists(name: str, ftype: FieldType, groups: list, b: int) -> list:
    res = [None] * b
    for shard, pos, rows in groups:
        p = range(b) if pos is None else pos
        for j, v in zip(p, shard.columns[name].rows(rows)):
            res[j] = v
    return res


def _variable(name: str, ftype: FieldType, groups: list, b: int) -> list:
    """bytes, string and sequence rows: one slice of the column's data each."""
    kind = ftype.kind
    res = [None] * b
    for shard, pos, rows in groups:
        col = shard.columns[name]
        p = range(b) if pos is None else pos
        starts, ends = col.spans(rows)
        # rows a transform decodes (an image stored as bytes, audio) are worth a
        # hint; short rows (tokens, text) cost less to fault in than to advise
        col.will_need(starts, ends, min_mean_bytes=_ADVISE_MIN_MEAN_BYTES)
        if kind == "bytes":
            mv = col.mv
            for j, s, e in zip(p, starts, ends):
                res[j] = mv[s:e]
        elif kind == "string":
            data = col.data
            for j, s, e in zip(p, starts, ends):
                res[j] = data[s:e].tobytes().decode()
        else:
            data = col.data
            for j, s, e in zip(p, starts, ends):
                res[j] = data[s:e]
    return res


_GATHER = {
    "scalar": _fixed,
    "bool": _fixed,
    "tensor": _fixed,
    "image": _images,
    "strings": _string_lists,
    "bytes": _variable,
    "string": _variable,
    "sequence": _variable,
}


# -- a sequence field's rows end to end ---------------------------------------------------------
def gather_flat(name: str, dtype: np.dtype, groups: list, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence field ``name``'s ``b`` rows of ``groups``, end to end: ``(lengths (B,) int64,
    values (T,))`` of ``dtype``, ``T = lengths.sum()``, with one gather per shard (consecutive
    rows of one shard are one read-only view of it)."""
    if len(groups) == 1:
        shard, _, rows = groups[0]
        return _flat_rows(shard.columns[name], np.asarray(rows, np.int64))
    lengths = np.empty(b, np.int64)
    parts = []
    for shard, pos, rows in groups:
        n, values = _flat_rows(shard.columns[name], np.asarray(rows, np.int64))
        lengths[pos] = n
        parts.append((np.asarray(pos, np.int64), n, values))
    out = np.empty(int(lengths.sum()), dtype)  # (T,)
    at = np.cumsum(lengths) - lengths  # (B,) where each row goes
    for pos, n, values in parts:
        out[_span_positions(at[pos], n)] = values
    return lengths, out


def _span_positions(start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """``(sum(size),) int64``: ``start[0], start[0] + 1, ..., start[1], ...``."""
    offsets = np.cumsum(size) - size  # (m,)
    return np.repeat(start - offsets, size) + np.arange(int(size.sum()))


def _flat_rows(col, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths (B,) int64, values (T,))`` of a sequence column's ``rows``, end to end."""
    start = col.offsets[rows].astype(np.int64)  # (B,)
    lengths = col.offsets[rows + 1] - start  # (B,) int64
    if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and (np.diff(rows) == 1).all():
        return lengths, col.data[start[0] : start[0] + int(lengths.sum())]  # consecutive: a view
    return lengths, col.data[_span_positions(start, lengths)]
