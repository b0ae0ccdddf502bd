"""Arrow record batches -> kuat rows: the one table path every tabular converter shares.

Parquet, JSON (Lines or arrays), CSV and Hugging Face ``datasets`` all arrive here as Arrow
record batches. This module

* normalises Arrow's physical variants (``large_*``, ``*_view``, dictionary-encoded) to one
  logical type per column (:func:`logical_type`);
* infers each column's type over the **whole input** (:class:`TypeUnifier`): null widens to any
  type, integers widen to wider integers and to float64, float32 to float64, list items
  likewise, as ``pyarrow.csv.read_csv`` and pandas infer over a whole file; anything else is a
  real conflict, reported with the column, the file and the row;
* maps the unified type to a kuat field (:func:`arrow_field`), or refuses naming the column
  and saying what to do;
* applies kuat's null rule at every nesting level (:func:`null_rows`): a null anywhere in a
  row, top-level or inside a list, is an error naming the column, file and row, or the row is
  skipped under ``on_error="skip"``;
* turns each batch into the columns ``Writer.write_batch`` takes, or, with image fields, into
  rows prepared on the driver's thread pool (:func:`write_batches`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kuat.convert._driver import (
    CHUNK_ITEMS,
    ConvertOptions,
    ConvertReport,
    Progress,
    parallel_map,
    prepare_image,
)
from kuat.errors import SchemaError
from kuat.format import Field, FieldType, Writer
from kuat.format import schema as fs
from kuat.format.arrow_views import values_view

__all__ = [
    "TableBatch",
    "TypeUnifier",
    "arrow_field",
    "hf_features_of",
    "hf_metadata",
    "is_image_struct",
    "logical_type",
    "null_rows",
    "write_batches",
]


def _is_list(t: pa.DataType) -> bool:
    return (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_list_view(t)
        or (pa.types.is_large_list_view(t))
    )


def is_image_struct(t: pa.DataType) -> bool:
    """``struct<bytes, path>``: how Hugging Face stores ``Image`` features in Arrow/Parquet."""
    return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0


def logical_type(t: pa.DataType) -> pa.DataType:
    """``t`` with Arrow's physical variants folded: dictionary -> its value type,
    ``large_string``/``string_view`` -> ``string``, ``large_binary``/``binary_view`` ->
    ``binary``, ``large_list``/``list_view`` -> ``list``; extension types -> their storage.
    Nested types are folded recursively."""
    if isinstance(t, pa.ExtensionType):
        return logical_type(t.storage_type)
    if pa.types.is_dictionary(t):
        return logical_type(t.value_type)
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if _is_list(t):
        return pa.list_(logical_type(t.value_type))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(logical_type(t.value_type), t.list_size)
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(logical_type(f.type)) for f in t])
    return t


def _widen_numbers(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    ints = pa.types.is_integer(a), pa.types.is_integer(b)
    floats = pa.types.is_floating(a), pa.types.is_floating(b)
    if all(ints):
        if pa.types.is_signed_integer(a) == pa.types.is_signed_integer(b):
            return a if a.bit_width >= b.bit_width else b
        s, u = (a, b) if pa.types.is_signed_integer(a) else (b, a)
        if s.bit_width > u.bit_width:
            return s
        return pa.int64() if u.bit_width < 64 else pa.float64()
    if all(floats):
        return a if a.bit_width >= b.bit_width else b
    if (ints[0] or floats[0]) and (ints[1] or floats[1]):
        return pa.float64()  # int and float: float64, as pandas and pyarrow infer
    return None


def unify(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The narrowest logical type holding values of both ``a`` and ``b``; ``None`` when they
    conflict (a string and a number, a list and a scalar, ...)."""
    if a == b:
        return a
    if pa.types.is_null(a):
        return b
    if pa.types.is_null(b):
        return a
    num = _widen_numbers(a, b)
    if num is not None:
        return num
    if pa.types.is_fixed_size_list(a) and pa.types.is_fixed_size_list(b):
        inner = unify(a.value_type, b.value_type)
        if inner is None:
            return None
        return pa.list_(inner, a.list_size) if a.list_size == b.list_size else pa.list_(inner)
    if (_is_list(a) or pa.types.is_fixed_size_list(a)) and (
        _is_list(b) or pa.types.is_fixed_size_list(b)
    ):
        inner = unify(a.value_type, b.value_type)
        return None if inner is None else pa.list_(inner)
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        names = [f.name for f in a] + [f.name for f in b if a.get_field_index(f.name) < 0]
        out = []
        for n in names:
            ta = a.field(n).type if a.get_field_index(n) >= 0 else pa.null()
            tb = b.field(n).type if b.get_field_index(n) >= 0 else pa.null()
            t = unify(ta, tb)
            if t is None:
                return None
            out.append(pa.field(n, t))
        return pa.struct(out)
    return None


def _first_valid_row(arr: pa.Array) -> int:
    valid = values_view(arr.is_valid())
    return int(np.argmax(valid)) if valid.any() else 0


@dataclass
class TypeUnifier:
    """Column types over the whole input, fed one record batch at a time.

    ``add(batch, path, first_row)`` folds the batch's columns into :attr:`types` (ordered by
    first appearance) and collects the categories of dictionary-encoded columns.

    Raises (from ``add``):
        kuat.SchemaError: a column whose values conflict (names the column, the file and the
            first row of the conflicting value, and the type it had so far and where from).
    """

    types: dict[str, pa.DataType] = field(default_factory=dict)
    seen_at: dict[str, str] = field(default_factory=dict)
    categories: dict[str, list] = field(default_factory=dict)

    def add(self, batch: pa.RecordBatch | pa.Table, path: str, first_row: int) -> None:
        names = batch.schema.names
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise SchemaError(
                f"{path} has the column(s) {dup} more than once (from row {first_row}); kuat "
                "columns need distinct names: rename them"
            )
        for name, arr in zip(names, batch.columns):
            if isinstance(arr, pa.ChunkedArray):
                arr = arr.combine_chunks()
            if pa.types.is_dictionary(arr.type):
                cats = self.categories.setdefault(name, [])
                known = set(cats)
                for v in arr.dictionary.to_pylist():
                    if v not in known:
                        known.add(v)
                        cats.append(v)
            t = logical_type(arr.type)
            if pa.types.is_null(t) or arr.null_count == len(arr):
                # no value to type here: only widens (and keeps the column known)
                self.types.setdefault(name, pa.null())
                continue
            self.add_type(name, t, f"{path} row {first_row + _first_valid_row(arr)}")

    def add_type(self, name: str, t: pa.DataType, at: str) -> None:
        """Fold one more type of column ``name`` (found at ``at``, for errors) in."""
        t = logical_type(t)
        old = self.types.get(name)
        if old is None or pa.types.is_null(old):
            self.types[name] = t
            if not pa.types.is_null(t):
                self.seen_at[name] = at
            return
        if pa.types.is_null(t):
            return
        new = unify(old, t)
        if new is None:
            raise SchemaError(
                f"column {name!r} holds {t} values at {at}, but {old} before (first at "
                f"{self.seen_at[name]}); kuat needs one type per column: fix the data, or "
                "convert the files separately",
                field=name,
            )
        self.types[name] = new

    def update(self, other: TypeUnifier) -> None:
        """Fold in the types another unifier found (e.g. over one file)."""
        for name, t in other.types.items():
            self.add_type(name, t, other.seen_at.get(name, "?"))
        for name, cats in other.categories.items():
            mine = self.categories.setdefault(name, [])
            known = set(mine)
            mine.extend(c for c in cats if c not in known)


def arrow_field(
    name: str, t: pa.DataType, image: bool = False, metadata: dict | None = None
) -> Field:
    """The kuat :class:`Field` for a column of logical Arrow type ``t`` (see
    :func:`logical_type`; physical variants are folded first).

    integers/floats -> the same scalar type, bool -> bool, string -> string, binary -> bytes,
    list of numbers -> ``sequence``, list of strings (also dictionary-encoded) -> ``strings``,
    all-empty lists -> ``sequence[int64]``, fixed-size
    list(s) of numbers -> ``tensor``, ``struct<bytes, path>`` or a column named in
    ``image_fields`` -> image.

    Raises:
        ValueError: the type has no kuat equivalent; the message names the column and says
            what to do.
    """
    t = logical_type(t)
    md = dict(metadata or {})
    if image or is_image_struct(t):
        if pa.types.is_binary(t) or pa.types.is_string(t) or is_image_struct(t):
            return Field(name, fs.image(), md)
        raise ValueError(f"column {name!r} of type {t} cannot hold images (bytes or paths)")
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return Field(name, FieldType("scalar", np.dtype(t.to_pandas_dtype()).name), md)
    if pa.types.is_boolean(t):
        return Field(name, fs.bool_(), md)
    if pa.types.is_string(t):
        return Field(name, fs.string(), md)
    if pa.types.is_binary(t) or pa.types.is_fixed_size_binary(t):
        return Field(name, fs.binary(), md)
    if pa.types.is_null(t):
        raise ValueError(
            f"column {name!r} holds only nulls in the whole input; kuat fields are not "
            "nullable: drop the column or fill it before converting"
        )
    if pa.types.is_fixed_size_list(t):
        shape, inner = [], t
        while pa.types.is_fixed_size_list(inner):
            shape.append(inner.list_size)
            inner = inner.value_type
        if (pa.types.is_integer(inner) or pa.types.is_floating(inner)) and all(shape):
            dtype = np.dtype(inner.to_pandas_dtype()).name
            return Field(name, fs.tensor(tuple(shape), dtype), md)
        if pa.types.is_string(inner) and len(shape) == 1:  # fixed-length lists of strings
            return Field(name, fs.strings(), md)
    if _is_list(t):
        inner = t.value_type
        if pa.types.is_null(inner):  # every list in the input is empty
            return Field(name, fs.sequence("int64"), md)
        if pa.types.is_integer(inner) or pa.types.is_floating(inner):
            return Field(name, fs.sequence(np.dtype(inner.to_pandas_dtype()).name), md)
        if pa.types.is_boolean(inner):
            return Field(name, fs.sequence("uint8"), md)
        if pa.types.is_string(inner):
            return Field(name, fs.strings(), md)
        if pa.types.is_binary(inner):
            raise ValueError(
                f"column {name!r} is a list of byte strings ({t}); kuat lists hold numbers or "
                "UTF-8 strings: decode the items to str, or store one bytes value per row"
            )
        if _is_list(inner) or pa.types.is_fixed_size_list(inner):
            raise ValueError(
                f"column {name!r} holds nested lists of varying length ({t}); kuat stores a "
                "variable-length 1-D sequence (of numbers or strings) or a fixed-shape "
                "tensor: flatten each row into one list (with a second column of the inner "
                "lengths to split it again), or pad the rows to one shape, before converting"
            )
    raise ValueError(
        f"column {name!r} has Arrow type {t}, which has no kuat field type; cast it to a "
        "number, string, bytes or list of numbers before converting"
    )


def null_rows(arr: pa.Array) -> np.ndarray:
    """``(N,)`` bool: rows of ``arr`` holding a null at any nesting level (the row itself, an
    item of its list, a field of its struct)."""
    n = len(arr)
    bad = values_view(arr.is_null()) if arr.null_count else np.zeros(n, bool)
    t = arr.type
    if pa.types.is_dictionary(t):
        return bad
    if isinstance(t, pa.ExtensionType):
        return bad | null_rows(arr.storage)
    if _is_list(t) or pa.types.is_fixed_size_list(t):
        values = arr.flatten()  # the items of non-null rows, honouring the parent's offset
        inner = null_rows(values)
        if inner.any():
            parents = values_view(pc.list_parent_indices(arr))  # (items,) row of each item
            bad = bad.copy()
            bad[parents[inner]] = True
    elif pa.types.is_struct(t):
        for child in arr.flatten():
            bad = bad | null_rows(child)
    return bad


def hf_features_of(metadata: dict) -> dict | None:
    """The ``datasets`` features dict from an Arrow schema's ``huggingface`` metadata."""
    raw = metadata.get(b"huggingface") or metadata.get("huggingface")
    if not raw:
        return None
    try:
        info = json.loads(raw)
        features = info.get("info", {}).get("features")
    except (ValueError, AttributeError):
        return None
    return features if isinstance(features, dict) else None


def hf_metadata(feature) -> tuple[dict, bool]:
    """``(field metadata, is image)`` for a ``datasets`` feature given as its dict form:
    ``ClassLabel`` names, also inside ``Sequence``/``List``/``LargeList``."""
    if not isinstance(feature, dict):
        if isinstance(feature, list) and feature:
            return hf_metadata(feature[0])[0], False
        return {}, False
    kind = feature.get("_type")
    if kind == "ClassLabel" and isinstance(feature.get("names"), list):
        return {"names": list(feature["names"])}, False
    if kind == "Image":
        return {}, True
    if kind in ("Sequence", "List", "LargeList"):
        return hf_metadata(feature.get("feature"))[0], False
    return {}, False


@dataclass
class TableBatch:
    """One record batch of the input and where it comes from.

    Attributes:
        batch: the batch (columns cast to the unified types by :func:`write_batches`).
        where: the file (or ``"dataset"``) the rows come from, for errors.
        first_row: the row number of the batch's first row within ``where``.
        base: the directory relative image paths resolve against (``None``: as given).
    """

    batch: pa.RecordBatch
    where: str
    first_row: int
    base: str | None = None


def _cast(arr: pa.Array, target: pa.DataType, name: str, where: str, first_row: int) -> pa.Array:
    if isinstance(arr.type, pa.ExtensionType):
        arr = arr.storage
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)  # decoded: categories go to the field metadata
    if arr.type == target:
        return arr
    try:
        return arr.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise SchemaError(
            f"column {name!r} of {where} (rows {first_row}..{first_row + len(arr) - 1}): "
            f"{arr.type} values do not convert to {target}: {e}",
            field=name,
        ) from e


def _tensor(arr: pa.Array, f: Field) -> np.ndarray:
    """A column of (nested) lists of one shape -> ``(N, *shape)`` (a view where Arrow's layout
    allows one)."""
    if pa.types.is_fixed_size_list(arr.type):
        return values_view(arr)  # (N, *shape)
    n, flat = len(arr), arr
    for size in f.type.shape:  # variable-size lists that must hold exactly `size` items
        lengths = values_view(flat.value_lengths())
        if (lengths != size).any():
            k = int(np.argmax(lengths != size))
            raise ValueError(f"a list of {lengths[k]} items where the shape needs {size}")
        flat = flat.flatten()
    return values_view(flat).reshape(n, *f.type.shape)  # (N * prod(shape),) -> (N, *shape)


def _sequence(arr: pa.Array, dtype: np.dtype) -> list[np.ndarray]:
    lengths = values_view(arr.value_lengths())  # (N,); null rows were refused before
    values = arr.flatten()
    if pa.types.is_null(values.type):  # list<null>: every list is empty (nulls were refused)
        values = values.cast(pa.from_numpy_dtype(dtype))
    if pa.types.is_boolean(values.type):
        values = values.cast(pa.uint8())
    flat = values_view(values).astype(dtype, copy=False)  # (sum(lengths),)
    return np.split(flat, np.cumsum(lengths)[:-1])  # N views of (L_i,)


def _resolve(path: str, base: str | None) -> str:
    if base is None or os.path.isabs(path):
        return path
    joined = os.path.join(base, path)
    return joined if os.path.exists(joined) or not os.path.exists(path) else path


def _columns(fields: Sequence[Field], batch: pa.RecordBatch, where: str, first_row: int, base):
    """A null-free batch -> ``{field: column}`` as ``Writer.write_batch`` takes it (image
    columns as ``("bytes", data)`` / ``("path", file)`` items, prepared later)."""
    out = {}
    for f, arr in zip(fields, batch.columns):
        kind = f.type.kind
        try:
            if kind in ("scalar", "bool"):
                out[f.name] = values_view(arr)  # (N,)
            elif kind == "tensor":
                out[f.name] = _tensor(arr, f)  # (N, *shape)
            elif kind == "sequence":
                out[f.name] = _sequence(arr, f.type.np_dtype)
            elif kind == "image":
                values = arr.to_pylist()
                if pa.types.is_string(arr.type):
                    out[f.name] = [("path", _resolve(v, base)) for v in values]
                elif is_image_struct(arr.type):
                    out[f.name] = [
                        ("bytes", v["bytes"])
                        if v.get("bytes") is not None
                        else ("path", _resolve(v.get("path") or "", base))
                        for v in values
                    ]
                else:
                    out[f.name] = [("bytes", v) for v in values]
            else:
                out[f.name] = arr.to_pylist()
        except ValueError as e:
            raise SchemaError(
                f"column {f.name!r} of {where} (rows {first_row}..): {e}", field=f.name
            ) from e
    return out


def _checked(fields, batches: Iterable[TableBatch], opts: ConvertOptions, report, progress):
    """Cast every batch to the fields' Arrow types and apply the null rule; yields
    ``(TableBatch, kept batch, (M,) int64 row numbers of the kept rows within the batch)``."""
    for tb in batches:
        batch, where, row0 = tb.batch, tb.where, tb.first_row
        n = batch.num_rows
        names = batch.schema.names
        arrays = []
        bad_any = np.zeros(n, bool)
        bad_col = np.full(n, -1)  # (N,) the first field with a null, per row
        first_bad: tuple[int, str] | None = None
        for c, (f, target) in enumerate(fields):
            if f.name in names:
                arr = batch.column(names.index(f.name))
                if isinstance(arr, pa.ChunkedArray):
                    arr = arr.combine_chunks()
                arr = _cast(arr, target, f.name, where, row0)
            else:  # a key that no record of this block has
                arr = pa.nulls(n, target)
            arrays.append(arr)
            bad = values_view(arr.is_null()) if f.type.kind == "image" else null_rows(arr)
            if bad.any():
                k = int(np.argmax(bad))
                if first_bad is None or k < first_bad[0]:
                    first_bad = (k, f.name)
                bad_col[bad & ~bad_any] = c
                bad_any |= bad
        if first_bad is not None:
            k, name = first_bad
            if opts.on_error == "raise":
                raise SchemaError(
                    f"column {name!r} of {where} has a null at row {row0 + k} (a missing "
                    "value, or a null inside its list); kuat fields are not nullable: fill "
                    "or drop it, or pass on_error='skip' (--on-error skip) to leave such rows out",
                    field=name,
                )
            for k in np.flatnonzero(bad_any):
                name = fields[bad_col[k]][0].name
                report.skipped.append(
                    (f"{where} row {row0 + int(k)}", f"column {name!r} holds a null")
                )
            progress.update(int(bad_any.sum()))
        kept = pa.RecordBatch.from_arrays(arrays, names=[f.name for f, _ in fields])
        if first_bad is not None:
            kept = kept.filter(pa.array(~bad_any))
        yield tb, kept, np.flatnonzero(~bad_any)


def write_batches(
    w: Writer,
    fields: Sequence[tuple[Field, pa.DataType]],
    batches: Iterable[TableBatch],
    opts: ConvertOptions,
    report: ConvertReport,
    *,
    total: int | None = None,
    desc: str = "convert",
) -> None:
    """Write every row of ``batches`` to ``w``.

    ``fields`` pairs each kuat field with the Arrow type its column is cast to (the type
    unified over the whole input). Without image fields whole batches go to
    ``Writer.write_batch``; with them, rows are prepared (read, probed, checked, optionally
    re-encoded) on ``opts.workers`` threads by :func:`kuat.convert._driver.parallel_map`.

    Raises:
        kuat.SchemaError: a null (``on_error="raise"``), or a value that does not convert.
        kuat.DecodeError: an unreadable image (``on_error="raise"``).
    """
    kuat_fields = [f for f, _ in fields]
    image_names = [f.name for f in kuat_fields if f.type.kind == "image"]
    if not image_names:
        progress = Progress(total, desc, opts.progress, opts.progress_interval_s)
        try:
            for tb, batch, _ in _checked(fields, batches, opts, report, progress):
                w.write_batch(_columns(kuat_fields, batch, tb.where, tb.first_row, tb.base))
                progress.update(batch.num_rows)
        finally:
            progress.close()
        return

    def rows() -> Iterator[tuple[str, dict]]:
        silent = Progress(None, desc, False)  # parallel_map counts the rows
        for tb, batch, kept in _checked(fields, batches, opts, report, silent):
            cols = _columns(kuat_fields, batch, tb.where, tb.first_row, tb.base)
            for j, r in enumerate(kept):
                yield (
                    f"{tb.where} row {tb.first_row + int(r)}",
                    {name: cols[name][j] for name in cols},
                )

    def prepare(item):
        where, row = item
        for name in image_names:
            how, value = row[name]
            if how == "path":
                with open(value, "rb") as fh:
                    data = fh.read()
                src = value
            else:
                data, src = value, f"{where} field {name!r}"
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise SchemaError(
                    f"{src}: expected image bytes, got {type(data).__name__}", field=name
                )
            row[name] = prepare_image(bytes(data), src, opts)
        return row

    for row in parallel_map(
        prepare,
        rows(),
        opts,
        total=total,
        desc=desc,
        source_of=lambda it: it[0],
        report=report,
        chunk_size=CHUNK_ITEMS,
    ):
        w.write(row)
