"""Parquet, JSON Lines and CSV files -> kuat dataset, read with pyarrow in record batches.

Column types map from Arrow (anything else raises ``ValueError`` naming the column):
integers/floats -> the same scalar type, bool -> bool, (large) string -> string, (large)
binary -> bytes, list of numbers -> sequence, fixed-size list(s) of numbers -> tensor, and
``struct<bytes, path>`` (how Hugging Face exports ``Image``) -> image. Columns named in
``image_fields`` become images: binary columns hold encoded bytes, string columns hold file
paths (relative paths resolve against the directory of the file that names them).

Several files (a list, or a glob such as ``"data/*.parquet"``) are read in sorted order and
must share the first file's columns; their types are cast to the first file's.
Nulls are refused with a ``SchemaError`` naming the column, file and row.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa

from kuat.convert._driver import (
    ConvertOptions,
    ConvertReport,
    log_skipped,
    prepare_image,
    write_dataset,
)
from kuat.errors import FormatError, SchemaError
from kuat.format import Field, FieldType, Schema, Writer
from kuat.format import schema as fs
from kuat.format.arrow_views import values_view

__all__ = ["from_parquet", "from_jsonl", "from_csv", "arrow_field", "expand_paths"]


def expand_paths(paths: str | os.PathLike | Sequence) -> list[str]:
    """Files named by ``paths`` (a path, a glob, or a list of either), sorted within a glob.

    Raises:
        FileNotFoundError: a path does not exist or a glob matches nothing.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = []
    for p in paths:
        p = os.fspath(p)
        if glob.has_magic(p):
            matched = sorted(glob.glob(p))
            if not matched:
                raise FileNotFoundError(f"no file matches {p!r}")
            out.extend(matched)
        elif os.path.exists(p):
            out.append(p)
        else:
            raise FileNotFoundError(f"no such file: {p}")
    if not out:
        raise FileNotFoundError("no input files given")
    return out


def _numeric_name(t: pa.DataType) -> str | None:
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return np.dtype(t.to_pandas_dtype()).name
    return None


def _is_image_struct(t: pa.DataType) -> bool:
    return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0


def arrow_field(name: str, t: pa.DataType, image: bool = False) -> Field:
    """The kuat :class:`Field` for an Arrow column type (see the module docstring).

    Raises:
        ValueError: the type has no kuat equivalent.
    """
    if image or _is_image_struct(t):
        if (
            pa.types.is_binary(t)
            or pa.types.is_large_binary(t)
            or pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or _is_image_struct(t)
        ):
            return Field(name, fs.image())
        raise ValueError(f"column {name!r} of type {t} cannot hold images (bytes or paths)")
    num = _numeric_name(t)
    if num is not None:
        return Field(name, FieldType("scalar", num))
    if pa.types.is_boolean(t):
        return Field(name, fs.bool_())
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return Field(name, fs.string())
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return Field(name, fs.binary())
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = _numeric_name(t.value_type)
        if inner is not None:
            return Field(name, fs.sequence(inner))
    if pa.types.is_fixed_size_list(t):
        shape, inner = [], t
        while pa.types.is_fixed_size_list(inner):
            shape.append(inner.list_size)
            inner = inner.value_type
        num = _numeric_name(inner)
        if num is not None and all(n > 0 for n in shape):
            return Field(name, fs.tensor(tuple(shape), num))
    raise ValueError(f"column {name!r} has Arrow type {t}, which has no kuat field type")


def _batches(kind: str, path: str, batch_size: int) -> Iterator[pa.RecordBatch]:
    """The record batches of one file; a file pyarrow cannot parse raises ``FormatError``."""
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            yield from pq.ParquetFile(path).iter_batches(batch_size=batch_size)
        elif kind == "jsonl":
            import pyarrow.json as pj

            yield from pj.read_json(path).to_batches(max_chunksize=batch_size)
        elif kind == "csv":
            import pyarrow.csv as pc

            yield from pc.open_csv(path)
        else:
            raise ValueError(f"unknown tabular kind {kind!r}")
    except (pa.ArrowException, OSError) as e:  # ArrowInvalid: a parse error
        raise FormatError(f"{path} is not a readable {kind} file: {e}", path=path) from e


def _column(field: Field, arr: pa.Array, path: str, first_row: int, base: str) -> object:
    """An Arrow column -> the form ``Writer.write_batch`` takes (images: raw values)."""
    if arr.null_count:
        row = first_row + int(np.argmax(values_view(arr.is_null())))
        raise SchemaError(
            f"column {field.name!r} of {path} has a null at row {row} "
            f"(kuat fields are not nullable)",
            field=field.name,
        )
    kind = field.type.kind
    if kind in ("scalar", "bool", "tensor"):
        try:
            return values_view(arr)  # (N,) or (N, *shape)
        except ValueError as e:  # nulls inside the lists of a tensor column
            raise SchemaError(
                f"column {field.name!r} of {path} (rows {first_row}..): {e} "
                "(kuat fields are not nullable)",
                field=field.name,
            ) from e
    if kind == "sequence":
        dt = field.type.np_dtype
        return [np.asarray(v, dtype=dt) for v in arr.to_pylist()]
    if kind == "image":
        values = arr.to_pylist()
        if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            return [("path", os.path.join(base, v)) for v in values]
        if _is_image_struct(arr.type):
            return [
                ("bytes", v["bytes"])
                if v.get("bytes") is not None
                else ("path", os.path.join(base, v.get("path") or ""))
                for v in values
            ]
        return [("bytes", v) for v in values]
    return arr.to_pylist()


def _from_tables(
    kind: str,
    paths,
    dst,
    *,
    image_fields: Sequence[str],
    batch_size: int,
    opts: ConvertOptions,
) -> ConvertReport:
    t0 = time.perf_counter()
    files = expand_paths(paths)
    report = ConvertReport(str(dst))
    first = next(_batches(kind, files[0], batch_size), None)
    if first is None:
        raise ValueError(f"{files[0]} holds no rows (cannot infer the columns)")
    arrow_schema = first.schema
    unknown = [n for n in image_fields if n not in arrow_schema.names]
    if unknown:
        raise ValueError(
            f"image field {unknown[0]!r} is not a column of {files[0]} ({arrow_schema.names})"
        )
    try:
        fields = [arrow_field(f.name, f.type, f.name in image_fields) for f in arrow_schema]
    except ValueError as e:
        raise ValueError(f"{e} (in {files[0]})") from e
    schema = Schema(fields)
    image_names = [f.name for f in fields if f.type.kind == "image"]
    metadata = {"source": kind, "files": [os.path.basename(f) for f in files]}

    def file_batches() -> Iterator[tuple[str, int, dict]]:
        for path in files:
            base = os.path.dirname(os.path.abspath(path))
            row = 0
            for batch in _batches(kind, path, batch_size):
                if not batch.schema.equals(arrow_schema):
                    if batch.schema.names != arrow_schema.names:
                        raise SchemaError(
                            f"{path} has columns {batch.schema.names}, but {files[0]} has "
                            f"{arrow_schema.names}"
                        )
                    try:
                        batch = pa.Table.from_batches([batch]).cast(arrow_schema).to_batches()[0]
                    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                        raise SchemaError(
                            f"{path}: columns do not cast to {files[0]}'s types: {e}"
                        ) from e
                cols = {
                    f.name: _column(f, batch.column(i), path, row, base)
                    for i, f in enumerate(fields)
                }
                yield path, row, cols
                row += batch.num_rows

    def rows():
        for path, row, cols in file_batches():
            n = len(cols[fields[0].name])
            for j in range(n):
                yield (
                    f"{path} row {row + j}",
                    {name: cols[name][j] for name in schema.names},
                )

    def prepare(item):
        where, row = item
        for name in image_names:
            how, value = row[name]
            if how == "path":
                with open(value, "rb") as f:
                    data = f.read()
                src = value
            else:
                data, src = value, f"{where} field {name!r}"
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise SchemaError(
                    f"{src}: expected image bytes, got {type(data).__name__}", field=name
                )
            row[name] = prepare_image(bytes(data), src, opts)
        return row

    if not image_names and opts.engine == "local":  # whole columns, no per-row work
        with Writer(dst, schema, metadata=metadata, **opts.writer_kwargs()) as w:
            for _, _, cols in file_batches():
                w.write_batch(cols)
            report.rows = w.num_rows
    else:
        write_dataset(
            dst,
            schema,
            metadata,
            prepare,
            rows(),
            opts,
            report=report,
            desc=f"convert {kind}",
            source_of=lambda item: item[0],
        )
    report.seconds = time.perf_counter() - t0
    log_skipped(report)
    return report


def _opts(kw: dict) -> ConvertOptions:
    return ConvertOptions(**kw)


_DOC_ARGS = """
    Args:
        paths: a file, a glob, or a list of either.
        dst: the dataset directory to write.
        image_fields: columns holding images (bytes, or file paths relative to the file's
            directory); ``struct<bytes, path>`` columns are images without being named.
        batch_size: rows per Arrow record batch read.
        num_workers, progress, overwrite, on_error, resize_shorter, quality, decode_check,
            shard_bytes, engine, rows_per_task: see :class:`kuat.convert.ConvertOptions`
            (``engine="ray"`` converts on a Ray cluster, same rows in the same order).

    Returns:
        a :class:`kuat.convert.ConvertReport`.

    Raises:
        FileNotFoundError: no input file.
        ValueError: a column type has no kuat equivalent (names the column).
        kuat.FormatError: a file that does not parse as its format (names the file).
        kuat.SchemaError: a null value, or files whose columns differ.
        kuat.DecodeError: an unreadable image with ``on_error="raise"``.
"""


def from_parquet(
    paths,
    dst,
    *,
    image_fields: Sequence[str] = (),
    batch_size: int = 1024,
    **options,
) -> ConvertReport:
    return _from_tables(
        "parquet", paths, dst, image_fields=image_fields, batch_size=batch_size, opts=_opts(options)
    )


def from_jsonl(
    paths,
    dst,
    *,
    image_fields: Sequence[str] = (),
    batch_size: int = 1024,
    **options,
) -> ConvertReport:
    return _from_tables(
        "jsonl", paths, dst, image_fields=image_fields, batch_size=batch_size, opts=_opts(options)
    )


def from_csv(
    paths,
    dst,
    *,
    image_fields: Sequence[str] = (),
    batch_size: int = 1024,
    **options,
) -> ConvertReport:
    return _from_tables(
        "csv", paths, dst, image_fields=image_fields, batch_size=batch_size, opts=_opts(options)
    )


from_parquet.__doc__ = "Convert Parquet file(s) into a kuat dataset." + _DOC_ARGS
from_jsonl.__doc__ = (
    "Convert JSON Lines file(s) (one object per line) into a kuat dataset." + _DOC_ARGS
)
from_csv.__doc__ = (
    "Convert CSV file(s) (header row, types inferred by pyarrow) into a kuat dataset." + _DOC_ARGS
)
