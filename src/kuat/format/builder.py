"""Column building: validate one field's values against its type and build the field's Arrow
array for each shard (what :class:`kuat.Writer` does per field).

What each field kind accepts and how it is stored is one row of a table, ``_KINDS``: the
kind's value check (``ColumnBuilder._check_<kind>``: the value as stored, and its
variable-length byte size, which sizes shards), the NumPy dtype of a fixed-size column (taken
whole from an array of a safe dtype, without per-row Python work), and how checked values
become a column chunk and the chunks the shard's Arrow array. Errors name the field, the row,
the expected type and what was given (never the repr of a whole large value).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kuat.errors import DecodeError, SchemaError
from kuat.format.arrow_views import array_from_bytes, array_from_numpy
from kuat.format.schema import EncodedImage, FieldType
from kuat.format.shard_file import DEFER_MIN_BYTES, ShardFile, deferring_works

__all__ = ["ColumnBuilder", "describe_given"]

# the most bytes (or sequence elements) one Arrow binary/string/list value can hold
_MAX_VALUE_BYTES = 2**31 - 2


def _short(value: object) -> str:
    # never repr a whole large value: a 2 GiB bytes object would build an 8 GiB string
    if isinstance(value, (str, bytes, bytearray)) and len(value) > 60:
        return repr(value[:57]) + "..."
    if isinstance(value, memoryview):
        return f"<{value.nbytes} bytes>"
    if isinstance(value, (list, tuple)) and len(value) > 8:
        value = type(value)(value[:8])
        return repr(value)[:57] + "..."
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def describe_given(value: object) -> str:
    """What an error says was given: the type and a short repr, or an array's dtype and shape
    (``"ndarray float64 (3,)"``, ``"int 5"``)."""
    if isinstance(value, np.generic):
        return f"{value.dtype} {_short(value.item())}"
    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype} {tuple(value.shape)}"
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"{type(value).__name__} {value.dtype} {tuple(value.shape)}"
    return f"{type(value).__name__} {_short(value)}"


def _deferrer(shard: ShardFile):
    """``array_from_bytes``'s ``defer``: large data buffers are written from their values."""

    def defer(values: list, size: int) -> pa.Buffer | None:
        if size >= DEFER_MIN_BYTES and deferring_works():
            return shard.defer(values, size)
        return None

    return defer


class ColumnBuilder:
    """Validates and accumulates the values of one field for the current shard.

    ``check_value``/``check_column`` validate (raising :class:`kuat.SchemaError`, nothing
    kept); ``add_value``/``add_slice`` keep checked values; ``finish`` returns the shard's
    Arrow array and starts the next shard. Not thread-safe (the Writer's one thread).
    """

    def __init__(self, name: str, ftype: FieldType):
        self.name = name
        self.t = ftype
        self._kind = _KINDS[ftype.kind]
        # a fixed-size column's dtype, None for a variable-length kind
        self._dtype = None if self._kind.dtype is None else self._kind.dtype(ftype)
        self.chunks: list = []  # validated column pieces (np.ndarray or list)
        self.pending: list = []  # validated single values not yet in a chunk

    # -- errors ----------------------------------------------------------------------------
    def error(self, row: int, value: object, detail: str = "") -> SchemaError:
        extra = f" ({detail})" if detail else ""
        return SchemaError(
            f"field {self.name!r} row {row}: expected {self.t.describe()}, got "
            f"{describe_given(value)}{extra}",
            field=self.name,
        )

    # -- single values ---------------------------------------------------------------------
    def check_value(self, value: object, row: int) -> tuple[object, int]:
        """Validated value and its variable-length byte size."""
        return self._kind.check(self, value, row)

    def _check_scalar(self, value: object, row: int) -> tuple[object, int]:
        dt = self.t.np_dtype
        if isinstance(value, (bool, np.bool_)):
            raise self.error(row, value)
        if dt.kind in "iu":
            if not isinstance(value, (int, np.integer)):
                raise self.error(row, value)
            info = np.iinfo(dt)
            if not info.min <= int(value) <= info.max:
                raise self.error(row, value, f"out of range [{info.min}, {info.max}]")
            return int(value), 0
        if not isinstance(value, (int, float, np.integer, np.floating)):
            raise self.error(row, value)
        self._check_float(value, row)
        return value, 0

    def _check_bool(self, value: object, row: int) -> tuple[bool, int]:
        if not isinstance(value, (bool, np.bool_)):
            raise self.error(row, value)
        return bool(value), 0

    def _check_string(self, value: object, row: int) -> tuple[str, int]:
        if not isinstance(value, str):
            raise self.error(row, value)
        n = self._utf8_size(value, row, value)
        self._check_size(value, row, n)
        return value, n

    def _check_bytes(self, value: object, row: int) -> tuple[bytes, int]:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise self.error(row, value)
        value = bytes(value)
        self._check_size(value, row, len(value))
        return value, len(value)

    def _check_tensor(self, value: object, row: int) -> tuple[np.ndarray, int]:
        t = self.t
        arr = self._array(value, row, len(t.shape))
        if tuple(arr.shape) != t.shape:
            raise self.error(row, value, "shape differs")
        return arr, 0

    def _check_sequence(self, value: object, row: int) -> tuple[np.ndarray, int]:
        arr = self._array(value, row, 1)
        self._check_size(value, row, len(arr), "elements")
        return arr, arr.nbytes

    def _check_strings(self, value: object, row: int) -> tuple[list[str], int]:
        """A list/tuple (or 1-D str/object array) of ``str`` -> a new ``list[str]`` and its
        size: UTF-8 bytes plus 4 offset bytes per string."""
        if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "UO":
            value = value.tolist()
        if not isinstance(value, (list, tuple)):  # a str is not a list of its characters
            raise self.error(row, value, "give a list of str")
        out = list(value)
        n = 4 * len(out)
        for k, s in enumerate(out):
            if not isinstance(s, str):
                raise self.error(row, value, f"item {k} is {describe_given(s)}")
            n += self._utf8_size(s, row, value)
        self._check_size(value, row, len(out), "strings")
        self._check_size(value, row, n)
        return out, n

    def _check_image(self, value: object, row: int) -> tuple[EncodedImage, int]:
        from kuat.vision.probe import probe_image

        if isinstance(value, EncodedImage):
            data, width, height, codec = value
        elif isinstance(value, Mapping) and "bytes" in value:
            data = value["bytes"]
            width, height, codec = value.get("width"), value.get("height"), value.get("codec")
        elif isinstance(value, (bytes, bytearray, memoryview)):
            data, width, height, codec = value, None, None, None
        else:
            raise self.error(row, value, "give encoded image bytes")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise self.error(row, data, "give encoded image bytes")
        data = bytes(data)
        if width is None or height is None or codec is None:
            try:
                width, height, codec = probe_image(data)
            except DecodeError as e:
                raise SchemaError(
                    f"field {self.name!r} row {row}: expected an encoded image, got "
                    f"{len(data)} bytes {data[:8]!r}...: {e}",
                    field=self.name,
                ) from e
        if not (isinstance(width, (int, np.integer)) and isinstance(height, (int, np.integer))):
            raise self.error(row, value, "width/height must be ints")
        if not (0 < int(width) < 2**31 and 0 < int(height) < 2**31) or not isinstance(codec, str):
            raise self.error(row, value, f"invalid size {width}x{height} or codec {codec!r}")
        self._check_size(data, row, len(data))
        return EncodedImage(data, int(width), int(height), codec), len(data) + len(codec)

    def _array(self, value: object, row: int, ndim: int) -> np.ndarray:
        """``value`` as an array of the field's dtype, refusing lossy casts."""
        dtype = self.t.np_dtype
        try:
            if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor
                value = value.detach().cpu().numpy()
            if isinstance(value, np.ndarray):
                arr = value
                if arr.dtype != dtype and not np.can_cast(arr.dtype, dtype, "safe"):
                    raise self.error(row, value, "unsafe dtype cast")
                arr = arr.astype(dtype, copy=False)
            else:
                loose = np.asarray(value)
                if loose.dtype.kind not in "iufb" or (
                    loose.dtype.kind == "b" and dtype.kind != "b"
                ):
                    raise self.error(row, value)
                arr = np.asarray(value, dtype=dtype)
                if loose.size and not np.array_equal(arr, loose):
                    raise self.error(row, value, "values do not fit the dtype")
        except (OverflowError, ValueError, TypeError) as e:
            if isinstance(e, SchemaError):
                raise
            raise self.error(row, value, str(e)) from e
        if arr.dtype.kind == "f" and dtype.kind in "iu":
            raise self.error(row, value)
        if arr.ndim != ndim:
            raise self.error(row, value, f"expected {ndim} dimension(s)")
        return arr

    def _check_size(self, value: object, row: int, n: int, unit: str = "bytes") -> None:
        if n > _MAX_VALUE_BYTES:
            raise self.error(
                row,
                value,
                f"{n} {unit}, more than the {_MAX_VALUE_BYTES} one Arrow value can hold "
                "(int32 offsets)",
            )

    def _check_float(self, value: object, row: int) -> None:
        """A finite ``value`` must stay finite in the field's float dtype (no silent inf)."""
        dt = self.t.np_dtype
        try:
            f = float(value)
        except OverflowError as e:  # an int beyond float64
            raise self.error(row, value, f"out of range of {dt}") from e
        if math.isfinite(f):
            with np.errstate(over="ignore"):
                finite = np.isfinite(dt.type(f))
            if not finite:
                raise self.error(row, value, f"out of range of {dt} (max {np.finfo(dt).max})")

    def _utf8_size(self, s: str, row: int, value: object) -> int:
        """The UTF-8 size of ``s`` (shards are sized by it); refuses lone surrogates."""
        if s.isascii():
            return len(s)
        try:
            return len(s.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise self.error(row, value, f"not encodable as UTF-8: {e.reason} at {e.start}") from e

    # -- whole columns ---------------------------------------------------------------------
    def check_column(self, values: object, n: int, first_row: int) -> tuple[object, np.ndarray]:
        """Validated column (np.ndarray or list) and per-row variable byte sizes ``(n,)``."""
        t = self.t
        dt = self._dtype
        if dt is not None and isinstance(values, np.ndarray):
            shape = t.shape or ()  # () for a scalar or bool
            want_ndim = 1 + len(shape)
            # the field's own dtype, or a number that casts safely (a bool field takes only
            # bools: no number casts safely to bool)
            ok = (
                values.ndim == want_ndim
                and len(values) == n
                and tuple(values.shape[1:]) == shape
                and (
                    values.dtype == dt
                    or (values.dtype.kind in "iuf" and np.can_cast(values.dtype, dt, "safe"))
                )
            )
            if ok:
                return np.ascontiguousarray(values, dtype=dt), np.zeros(n, np.int64)
            if values.ndim == want_ndim and len(values) == n and values.dtype != object:
                # the dtype is not a safe cast: check every row (names the first bad one);
                # if all fit (small uint64 values in an int64 field, say), take them
                for j in range(n):
                    self.check_value(values[j], first_row + j)
                if self._kind.takes_checked_ints and values.dtype.kind in "iu":
                    return values.astype(dt), np.zeros(n, np.int64)
                raise SchemaError(
                    f"field {self.name!r}: expected a column of {t.describe()}, got "
                    f"{describe_given(values)}",
                    field=self.name,
                )
        if isinstance(values, np.ndarray) and values.dtype != object:
            values = list(values)
        try:
            values = list(values)
        except TypeError as e:
            raise SchemaError(
                f"field {self.name!r}: a column must be a sequence, got {type(values).__name__}",
                field=self.name,
            ) from e
        if len(values) != n:
            raise SchemaError(
                f"field {self.name!r}: column has {len(values)} rows, expected {n}", field=self.name
            )
        out, sizes = [], np.zeros(n, np.int64)
        for j, v in enumerate(values):
            value, sizes[j] = self.check_value(v, first_row + j)
            out.append(value)
        return self._kind.chunk(self, out), sizes

    # -- accumulation ----------------------------------------------------------------------
    def add_value(self, value: object) -> None:
        self.pending.append(value)

    def add_slice(self, column: object, start: int, stop: int) -> None:
        self._seal_pending()
        self.chunks.append(column[start:stop])

    def _seal_pending(self) -> None:
        if not self.pending:
            return
        self.chunks.append(self._kind.chunk(self, self.pending))
        self.pending = []

    def reset(self) -> None:
        """Drop every value kept for the current shard (the write is aborted)."""
        self.chunks, self.pending = [], []

    def finish(self, shard: ShardFile) -> pa.Array:
        """The field's Arrow array for the current shard, to be written to ``shard`` (large
        binary/string data buffers are deferred to it, see :mod:`kuat.format.shard_file`);
        resets the builder."""
        self._seal_pending()
        chunks, self.chunks = self.chunks, []
        return self._kind.array(self, chunks, shard)


# -- checked values -> a column chunk -------------------------------------------------------
def _numbers(b: ColumnBuilder, values: list) -> np.ndarray:
    return np.asarray(values, dtype=b._dtype)  # (N,)


def _tensors(b: ColumnBuilder, values: list) -> np.ndarray:
    # (N, *shape)
    return np.stack(values) if values else np.empty((0, *b.t.shape), b.t.np_dtype)


def _as_is(b: ColumnBuilder, values: list) -> list:
    return values


# -- a shard's chunks -> its Arrow array ----------------------------------------------------
def _fixed(b: ColumnBuilder, chunks: list) -> np.ndarray:
    """The shard's ``(N, *shape)`` column of a fixed-size field."""
    dt = b._dtype
    return np.concatenate(chunks) if chunks else np.empty((0, *(b.t.shape or ())), dt)


def _numbers_array(b: ColumnBuilder, chunks: list, shard: ShardFile) -> pa.Array:
    return array_from_numpy(_fixed(b, chunks).astype(b._dtype, copy=False))


def _tensors_array(b: ColumnBuilder, chunks: list, shard: ShardFile) -> pa.Array:
    flat = array_from_numpy(_fixed(b, chunks).reshape(-1))  # (N, *shape) -> (N * numel,)
    return pa.FixedSizeListArray.from_arrays(flat, type=b.t.arrow_type)


def _binary_array(b: ColumnBuilder, chunks: list, shard: ShardFile) -> pa.Array:
    values = [v for c in chunks for v in c]
    return array_from_bytes(values, b.t.arrow_type, defer=_deferrer(shard))


def _strings_array(b: ColumnBuilder, chunks: list, shard: ShardFile) -> pa.Array:
    values = [v for c in chunks for v in c]
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum(np.fromiter(map(len, values), np.int64, len(values)), out=offsets[1:])
    flat = [s for v in values for s in v]
    return pa.ListArray.from_arrays(
        array_from_numpy(offsets),
        array_from_bytes(flat, pa.string(), defer=_deferrer(shard)),
        type=b.t.arrow_type,
    )


def _sequence_array(b: ColumnBuilder, chunks: list, shard: ShardFile) -> pa.Array:
    t = b.t
    values = [v for c in chunks for v in c]
    lengths = np.fromiter((len(v) for v in values), np.int64, len(values))
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(values) if values else np.empty(0, t.np_dtype)
    return pa.ListArray.from_arrays(
        array_from_numpy(offsets),
        array_from_numpy(flat.astype(t.np_dtype, copy=False)),
        type=t.arrow_type,
    )


def _image_array(b: ColumnBuilder, chunks: list, shard: ShardFile) -> pa.Array:
    values = [v for c in chunks for v in c]
    return pa.StructArray.from_arrays(
        [
            array_from_bytes([v.data for v in values], pa.binary(), defer=_deferrer(shard)),
            array_from_numpy(np.fromiter((v.width for v in values), np.int32, len(values))),
            array_from_numpy(np.fromiter((v.height for v in values), np.int32, len(values))),
            array_from_bytes([v.codec for v in values], pa.string()),
        ],
        fields=list(b.t.arrow_type),
    )


@dataclass(frozen=True)
class _Kind:
    """How one field kind is checked and stored.

    Attributes:
        check: ``ColumnBuilder._check_<kind>``: ``(builder, value, row) -> (checked value,
            variable-length bytes)``; raises :class:`kuat.SchemaError`.
        chunk: ``(builder, checked values) -> column chunk`` (an array, or the list itself).
        array: ``(builder, chunks, shard) -> the shard's Arrow array``.
        dtype: ``FieldType -> NumPy dtype`` of a fixed-size column, taken whole from an
            array of that (or a safely cast) dtype; ``None`` for a variable-length kind.
        takes_checked_ints: an array column of another integer dtype is taken once every
            row passed ``check`` (small uint64 values in an int64 field, say).
    """

    check: Callable[[ColumnBuilder, object, int], tuple[object, int]]
    chunk: Callable[[ColumnBuilder, list], object]
    array: Callable[[ColumnBuilder, list, ShardFile], pa.Array]
    dtype: Callable[[FieldType], np.dtype] | None = None
    takes_checked_ints: bool = False


def _own_dtype(t: FieldType) -> np.dtype:
    return t.np_dtype


def _bool_dtype(t: FieldType) -> np.dtype:
    return np.dtype(bool)


_KINDS: dict[str, _Kind] = {
    "scalar": _Kind(ColumnBuilder._check_scalar, _numbers, _numbers_array, _own_dtype, True),
    "bool": _Kind(ColumnBuilder._check_bool, _numbers, _numbers_array, _bool_dtype),
    "tensor": _Kind(ColumnBuilder._check_tensor, _tensors, _tensors_array, _own_dtype),
    "string": _Kind(ColumnBuilder._check_string, _as_is, _binary_array),
    "bytes": _Kind(ColumnBuilder._check_bytes, _as_is, _binary_array),
    "strings": _Kind(ColumnBuilder._check_strings, _as_is, _strings_array),
    "sequence": _Kind(ColumnBuilder._check_sequence, _as_is, _sequence_array),
    "image": _Kind(ColumnBuilder._check_image, _as_is, _image_array),
}
