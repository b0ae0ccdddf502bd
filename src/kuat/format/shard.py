"""One shard opened for reading: an Arrow IPC file memory-mapped, checked against its manifest
entry, and its columns exposed as NumPy views of the mapping.

:func:`open_shard` maps the file (zero-copy), checks its size, messages, schema, row count and
nulls, and returns a :class:`Shard` whose ``columns`` are views :class:`kuat.format.store.Store`
gathers rows from; nothing is copied until a gather. Every error is a ``kuat.FormatError``
naming the shard's path.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pyarrow as pa

from kuat.errors import FormatError
from kuat.format.arrow_views import values_view
from kuat.format.ipc import check_messages
from kuat.format.manifest import ShardInfo
from kuat.format.members import check_regular_file
from kuat.format.schema import FieldType, Schema

__all__ = ["Shard", "open_shard"]


# -- columns of one opened shard ----------------------------------------------------------
class _Fixed:
    """scalar / bool / tensor: ``values`` is ``(n, *shape)``, a view of the mapping."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray):
        self.values = values


def _libc_madvise():
    """libc's ``madvise(addr, length, advice)`` through ctypes (Linux), or None. Python's
    ``mmap.madvise`` needs an ``mmap`` object; shards are mapped by Arrow, which offers none."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_WILLNEED"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()
_PAGE = mmap.PAGESIZE


class _Var:
    """string / bytes / sequence: ``offsets`` ``(n + 1,)`` int32 into ``data``."""

    __slots__ = ("offsets", "data", "mv", "_addr")

    def __init__(self, offsets: np.ndarray, data: np.ndarray):
        self.offsets = offsets
        self.data = data
        self.mv = memoryview(data) if data.dtype == np.uint8 else None
        self._addr = data.ctypes.data if data.size else 0  # where the values start in memory

    def spans(self, rows: np.ndarray | list[int]) -> tuple[list[int], list[int]]:
        """Start and end offsets of ``rows`` (an int64 array, or a list of ints)."""
        if isinstance(rows, list):
            o = self.offsets
            return [int(o[r]) for r in rows], [int(o[r + 1]) for r in rows]
        return self.offsets[rows].tolist(), self.offsets[rows + 1].tolist()

    def will_need(self, starts: list[int], ends: list[int], min_mean_bytes: int = 0) -> None:
        """Tell the kernel that the values ``data[s:e]`` of each span are about to be read
        (``madvise(MADV_WILLNEED)``): pages not in the page cache are read from disk now, all
        spans at once, instead of one page fault at a time when a reader first touches them.

        Why: a batch's rows are scattered over the shard, and the first reader of their bytes
        (the fused transform's header parse, one sample after another, holding the GIL) took
        one disk read per sample when the shard was not cached: an epoch's first batch took
        0.28-1.66 s instead of 0.05 s on a cold cache (``benchmarks/first_batch.py``; with
        this, 0.12-0.20 s). Warm, it costs about 3.5 us per span (a system call that finds
        the pages cached): nothing beside a JPEG decode, but 5-8x the whole gather of 64
        short token rows (29 -> 145-230 us measured). So callers whose rows may be cheap pass
        ``min_mean_bytes``: spans averaging fewer bytes than that are not advised (the gather
        then faults them in as before). Only a hint: never raises, and does nothing where
        ``madvise`` is unavailable (not Linux) or the call fails.
        """
        if _madvise is None or not self._addr:
            return
        addr, itemsize = self._addr, self.data.itemsize
        if min_mean_bytes and (sum(ends) - sum(starts)) * itemsize < min_mean_bytes * len(ends):
            return
        for s, e in zip(starts, ends):
            if e > s:
                lo = (addr + s * itemsize) & ~(_PAGE - 1)  # madvise wants a page-aligned start
                _madvise(lo, addr + e * itemsize - lo, mmap.MADV_WILLNEED)


class _Strings:
    """strings (``list<string>``): row ``r`` holds strings ``offsets[r]:offsets[r + 1]`` of
    ``items``."""

    __slots__ = ("offsets", "items")

    def __init__(self, offsets: np.ndarray, items: _Var):
        self.offsets, self.items = offsets, items

    def rows(self, rows: list[int]) -> list[list[str]]:
        """A new ``list[str]`` per row of ``rows``."""
        o, io, data = self.offsets, self.items.offsets, self.items.data
        out = []
        for r in rows:
            a, b = int(o[r]), int(o[r + 1])
            base = int(io[a])
            raw = data[base : int(io[b])].tobytes()  # the row's strings, decoded one by one
            ends = (io[a + 1 : b + 1] - base).tolist()
            out.append([raw[s:e].decode() for s, e in zip([0, *ends[:-1]], ends)])
        return out


class _Image:
    __slots__ = ("bytes", "width", "height", "codec")

    def __init__(self, data: _Var, width: np.ndarray, height: np.ndarray, codec: _Var):
        self.bytes, self.width, self.height, self.codec = data, width, height, codec


def _var_column(arr: pa.Array, value_dtype: np.dtype | None = None) -> _Var:
    n = len(arr)
    bufs = arr.buffers()
    offsets = (
        np.frombuffer(bufs[1], np.int32, count=n + 1, offset=arr.offset * 4)
        if n
        else (np.zeros(1, np.int32))
    )
    if value_dtype is None:  # string / binary: the data buffer
        data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.empty(0, np.uint8)
    else:  # list<T>: the child array's values (offsets index into it)
        data = values_view(arr.values) if len(arr.values) else np.empty(0, value_dtype)
    return _Var(offsets, data)


def _fixed_column(arr: pa.Array, ftype: FieldType) -> _Fixed:
    # bool: bit-packed, unpacked once per shard; others: zero-copy views of the mapping
    if ftype.kind == "tensor":  # (n * numel,) -> (n, *shape)
        return _Fixed(values_view(arr.flatten()).reshape(len(arr), *ftype.shape))
    return _Fixed(values_view(arr))


def _has_nulls(arr: pa.Array) -> bool:
    if arr.null_count:
        return True
    if isinstance(arr, pa.StructArray):
        return any(_has_nulls(arr.field(i)) for i in range(arr.type.num_fields))
    if isinstance(arr, (pa.ListArray, pa.FixedSizeListArray)):
        return _has_nulls(arr.flatten())
    return False


class Shard:
    """One opened shard: ``path``, ``rows``, and ``columns`` (``{field: column view}``, views
    of the mapping that stay valid, and keep it mapped, while referenced)."""

    __slots__ = ("path", "rows", "columns")

    def __init__(self, path: str, rows: int, columns: dict):
        self.path, self.rows, self.columns = path, rows, columns


def _schema_diff(got: pa.Schema, want: pa.Schema) -> str:
    try:
        names = got.names
        diffs = [
            f"{f.name}: {f.type} vs {got.field(f.name).type if f.name in names else 'missing'}"
            for f in want
            if f.name not in names or not got.field(f.name).type.equals(f.type)
        ]
        return "; ".join(diffs) or f"shard schema: {got}"
    except (UnicodeDecodeError, KeyError, ValueError, pa.ArrowException):  # corrupt names
        return "the shard's schema is unreadable"


def _read_batch(path: str, info: ShardInfo, arrow_schema: pa.Schema) -> pa.RecordBatch:
    try:
        size = check_regular_file(path, "shard").st_size
    except FileNotFoundError as e:
        raise FormatError(f"shard {path} is missing", path=path) from e
    except OSError as e:
        raise FormatError(f"cannot stat shard {path}: {e}", path=path) from e
    if size != info.bytes:
        what = "truncated" if size < info.bytes else "larger than recorded"
        raise FormatError(
            f"shard {path} is {size} bytes but the manifest records {info.bytes} ({what}; "
            "run `kuat verify`)",
            path=path,
        )
    try:
        mm = pa.memory_map(path, "r")
        try:
            data = mm.read_buffer()  # zero-copy view of the whole file
        finally:
            mm.close()  # the mapping stays alive as long as buffers reference it
        # IPC file format (also accepted): "ARROW1" + 2 padding bytes, then the same stream;
        # reading that stream, not the footer, means the checked messages are the ones read
        stream = data.slice(8) if data.size >= 8 and data[:6].to_pybytes() == b"ARROW1" else data
        check_messages(stream, path)  # nothing compressed: no stated size allocates
        reader = pa.ipc.open_stream(stream)
        schema = reader.schema
        if not schema.remove_metadata().equals(arrow_schema):
            raise FormatError(
                f"shard {path} does not match the manifest's schema "
                f"({_schema_diff(schema, arrow_schema)})",
                path=path,
            )
        batches = list(reader)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise FormatError(f"shard {path} is not a readable Arrow IPC file: {e}", path=path) from e
    try:
        if len(batches) == 1:
            batch = batches[0]
        else:  # written by another tool: concatenate once (a copy) so columns are contiguous
            table = pa.Table.from_batches(batches, schema=schema).combine_chunks()
            batch = pa.RecordBatch.from_arrays(
                [c.chunk(0) if c.num_chunks else pa.array([], type=c.type) for c in table.columns],
                schema=schema,
            )
        batch.validate(full=True)
    except (pa.ArrowException, ValueError) as e:
        raise FormatError(f"shard {path} is corrupt: {e}", path=path) from e
    if batch.num_rows != info.rows:
        raise FormatError(
            f"shard {path} holds {batch.num_rows} rows but the manifest records {info.rows}",
            path=path,
        )
    for name, col in zip(batch.schema.names, batch.columns):
        if _has_nulls(col):
            raise FormatError(f"shard {path}: field {name!r} has null values", path=path)
    return batch


def open_shard(path: str, info: ShardInfo, schema: Schema, arrow_schema: pa.Schema) -> Shard:
    """Map the local shard file ``path`` and check it against its manifest entry ``info``
    (size, Arrow messages, ``arrow_schema``, row count, no nulls).

    Raises:
        kuat.FormatError: the file is missing, of another size, unreadable, corrupt or does
            not match, naming ``path`` (the cause chained).
    """
    batch = _read_batch(path, info, arrow_schema)
    columns = {}
    try:
        for f, arr in zip(schema, batch.columns):
            kind = f.type.kind
            if kind in ("scalar", "bool", "tensor"):
                columns[f.name] = _fixed_column(arr, f.type)
            elif kind in ("string", "bytes"):
                columns[f.name] = _var_column(arr)
            elif kind == "sequence":
                columns[f.name] = _var_column(arr, f.type.np_dtype)
            elif kind == "strings":
                columns[f.name] = _Strings(_var_column(arr).offsets, _var_column(arr.values))
            else:
                columns[f.name] = _Image(
                    _var_column(arr.field(0)),
                    values_view(arr.field(1)),
                    values_view(arr.field(2)),
                    _var_column(arr.field(3)),
                )
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise FormatError(f"shard {path} has unreadable buffers: {e}", path=path) from e
    return Shard(path, batch.num_rows, columns)
