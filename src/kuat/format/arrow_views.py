"""NumPy <-> Arrow for null-free arrays, built from their buffers.

``pyarrow.Array.to_numpy`` and ``pyarrow.array`` import pandas on their first call (about a
second, more on a busy machine), which every process reading or writing a shard would pay
once: ``kuat inspect``, each process worker, each converter. The arrays kuat reads and writes
have no nulls, so their values buffer is all that these calls would produce anyway.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

__all__ = ["values_view", "array_from_numpy", "array_from_bytes"]

_MAX_OFFSET = 2**31 - 1


def _primitive(arr: pa.Array) -> np.ndarray:
    n = len(arr)
    if pa.types.is_boolean(arr.type):  # bit-packed, least significant bit first
        buf = arr.buffers()[1]
        if n == 0 or buf is None:
            return np.zeros(0, bool)
        bits = np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")
        return bits[arr.offset : arr.offset + n].astype(bool)  # (n,) a copy
    dtype = np.dtype(arr.type.to_pandas_dtype())  # a NumPy type; does not import pandas
    buf = arr.buffers()[1]
    if n == 0 or buf is None:
        return np.zeros(0, dtype)
    return np.frombuffer(buf, dtype, count=n, offset=arr.offset * dtype.itemsize)


def values_view(arr: pa.Array) -> np.ndarray:
    """The values of a null-free Arrow array as NumPy.

    Args:
        arr: a numeric or boolean array ``(n,)``, or a (nested) fixed-size list of numbers
            ``(n,)`` of ``[d0][d1]...``.

    Returns:
        ``(n,)``, or ``(n, d0, d1, ...)`` for fixed-size lists: a read-only zero-copy view of
        the Arrow buffer (it keeps the buffer, e.g. a memory-mapped shard, alive), except
        for booleans, which Arrow packs into bits and are unpacked into a copy.

    Raises:
        ValueError: the array has nulls, or is of another type.
    """
    if arr.null_count:
        raise ValueError(f"array of {arr.type} has {arr.null_count} nulls")
    shape = []
    flat = arr
    while pa.types.is_fixed_size_list(flat.type):
        shape.append(flat.type.list_size)
        flat = flat.flatten()  # honours the parent's offset
        if flat.null_count:
            raise ValueError(f"array of {arr.type} has null items")
    t = flat.type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise ValueError(f"no NumPy view for an array of {arr.type}")
    return _primitive(flat).reshape(len(arr), *shape)  # (n * prod(shape),) -> (n, *shape)


def array_from_numpy(values: np.ndarray) -> pa.Array:
    """A ``(n,)`` numeric or bool ndarray as an Arrow array without nulls.

    Numbers are wrapped without a copy when ``values`` is contiguous (the Arrow array keeps
    it alive); booleans are packed into bits.
    """
    values = np.ascontiguousarray(values)
    if values.ndim != 1:
        raise ValueError(f"expected a 1-D array, got shape {values.shape}")
    n = len(values)
    if values.dtype == np.bool_:
        bits = np.packbits(values, bitorder="little")  # (ceil(n / 8),) uint8
        return pa.Array.from_buffers(pa.bool_(), n, [None, pa.py_buffer(bits)])
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), n, [None, pa.py_buffer(values)])


def array_from_bytes(values: list, type: pa.DataType, *, defer=None) -> pa.Array:
    """``bytes`` values (``pa.binary()``), or ``str`` values (``pa.string()``, encoded as
    UTF-8, which must succeed: lone surrogates raise ``UnicodeEncodeError``), as an Arrow
    array without nulls (one copy of the data).

    ``defer(values, size)``, if given, may return a buffer to stand for the joined data
    instead of the copy (``None``: join them); see :mod:`kuat.format.shard_file`.

    Raises:
        ValueError: the values hold 2 GiB or more together (int32 offsets).
    """
    if pa.types.is_string(type):
        values = [v.encode("utf-8") for v in values]
    elif not pa.types.is_binary(type):
        raise ValueError(f"type must be string or binary, got {type}")
    n = len(values)
    lengths = np.fromiter(map(len, values), np.int64, n)  # (n,)
    ends = np.cumsum(lengths)  # (n,) int64
    total = int(ends[-1]) if n else 0
    if total > _MAX_OFFSET:
        raise ValueError(f"{n} values hold {total} bytes, more than int32 offsets address")
    offsets = np.zeros(n + 1, np.int32)
    offsets[1:] = ends
    data = defer(values, total) if defer is not None and total else None
    if data is None:
        data = pa.py_buffer(b"".join(values))
    return pa.Array.from_buffers(type, n, [None, pa.py_buffer(offsets), data])
