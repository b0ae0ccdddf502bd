"""Arrow record batches -> kuat rows: the one table path every tabular converter shares.

Parquet, JSON (Lines or arrays), CSV and Hugging Face ``datasets`` all arrive here as Arrow
record batches. The path:

* each column's type is inferred over the **whole input** (:mod:`kuat.convert._table_types`:
  Arrow's physical variants folded to one logical type, widened batch after batch, a real
  conflict reported with the column, the file and the row);
* the unified type maps to a kuat field (:mod:`kuat.convert._table_fields`), or is refused
  naming the column and saying what to do;
* this module applies kuat's null rule at every nesting level (:func:`null_rows`): a null
  anywhere in a row, top-level or inside a list, is an error naming the column, file and row,
  or the row is skipped under ``on_error="skip"``;
* and turns each batch into the columns ``Writer.write_batch`` takes, or, with image fields,
  into rows prepared on the driver's thread pool (:func:`write_batches`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

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
from kuat.convert._table_types import is_image_struct, is_list
from kuat.errors import SchemaError
from kuat.format import Field, Writer
from kuat.format.arrow_views import values_view

__all__ = ["TableBatch", "null_rows", "write_batches"]


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
    if is_list(t) or pa.types.is_fixed_size_list(t):
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
