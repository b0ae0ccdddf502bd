"""Parquet, JSON (Lines or arrays) and CSV/TSV files -> kuat dataset, read with pyarrow.

Column types are inferred over the **whole input** (every block of every file; see
:mod:`kuat.convert._table`): an integer column that holds ``2.5`` at row 150,000 becomes
float64, a column that is null in one file takes its type from the others, and a real
conflict (a string in a number column) is a ``SchemaError`` naming the column, file and row.
Types then map to kuat fields (:func:`arrow_field`): integers/floats -> the same scalar type,
bool -> bool, strings (also ``large_string``, ``string_view`` and dictionary-encoded columns
such as pandas ``Categorical``, whose categories go to the field's ``metadata["categories"]``)
-> string, binary -> bytes, lists of numbers -> sequence, fixed-size lists -> tensor,
``struct<bytes, path>`` (Hugging Face ``Image``) -> image. Columns named in ``image_fields``
become images: binary columns hold encoded bytes, string columns file paths (relative paths
resolve against the directory of the file that names them).

A Parquet file written by ``datasets`` keeps its features in the schema's ``huggingface``
metadata: ``ClassLabel`` names (also inside ``Sequence``) go to the field's
``metadata["names"]``, ``Image`` columns become images, and the manifest keeps the features
(``metadata["hf_features"]``), as ``datasets.load_dataset("parquet")`` restores them.

Reading: any valid file reads, whatever its record sizes. JSON Lines is parsed in blocks of
whole lines (a record longer than a block extends its block); a ``.json`` file whose first
character is ``[`` is a JSON array of records (what ``datasets.load_dataset("json")`` reads);
CSV blocks grow until the longest record fits, quoted values may hold newlines, and a CSV
file whose types change after its first block is read whole once to infer them. Types come
first (a Parquet file's from its schema; JSON and CSV files are parsed, and the parsed
batches are kept for the conversion up to 256 MiB, beyond which they are parsed again).

Several files (a list, or a glob such as ``"data/*.parquet"``) are read in sorted order and
must have the same columns (JSON records may omit keys: a missing key is a null).
Nulls, top-level or inside lists, follow kuat's null rule: a ``SchemaError`` naming the
column, file and row, or the row is skipped with ``on_error="skip"``.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import io
import json
import os
import tempfile
from collections.abc import Iterator, Sequence

import pyarrow as pa

from kuat.convert._driver import ConvertOptions, ConvertReport, converting
from kuat.convert._table import (
    TableBatch,
    TypeUnifier,
    arrow_field,
    hf_features_of,
    hf_metadata,
    write_batches,
)
from kuat.errors import FormatError, KuatError, SchemaError
from kuat.format import Schema
from kuat.format.fs import download, is_url, open_remote

__all__ = ["from_parquet", "from_jsonl", "from_csv", "arrow_field", "expand_paths"]


def expand_paths(
    paths: str | os.PathLike | Sequence, storage_options: dict | None = None
) -> list[str]:
    """Files named by ``paths`` (a path, a glob, or a list of either), sorted within a glob.
    URLs (``s3://b/*.parquet``, ``http://host/x.csv``) stay URLs; their globs are expanded by
    their fsspec file system (not over HTTP, which cannot list).

    Raises:
        FileNotFoundError: a path does not exist or a glob matches nothing.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = []
    for p in paths:
        p = os.fspath(p)
        if is_url(p):
            if glob.has_magic(p) and not p.startswith(("http://", "https://")):
                remote = open_remote(p, storage_options)
                protocol = p.split("://", 1)[0]
                matched = sorted(f"{protocol}://{m}" for m in remote.fs.glob(remote.path))
                if not matched:
                    raise FileNotFoundError(f"no file matches {p!r}")
                out.extend(matched)
            else:
                out.append(p)
        elif glob.has_magic(p):
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


_JSON_BLOCK = 1 << 20  # bytes of whole lines per JSON Lines parse; a longer line extends it
_CSV_BLOCK = 1 << 20  # pyarrow's CSV block; doubled until the longest record fits
# JSON/CSV batches parsed by the first pass are kept for the second up to this many bytes of
# Arrow data (parsing is most of the cost); larger inputs are parsed again
_KEEP_BYTES = 256 << 20


def _json_kind(path: str) -> str:
    """``"array"`` when the first non-blank character is ``[``, ``"lines"`` when it is ``{``.

    Raises:
        kuat.FormatError: neither (names the file and what it starts with).
    """
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        while not head:
            more = f.read(1 << 16)
            if not more:
                break
            head = more.lstrip(b" \t\r\n")
    if head[:1] == b"[":
        return "array"
    if head[:1] == b"{" or not head:
        return "lines"
    raise FormatError(
        f"{path} is neither JSON Lines (one object per line) nor a JSON array of objects: it "
        f"starts with {head[:20]!r}",
        path=path,
    )


def _json_array(path: str, batch_size: int) -> Iterator[pa.RecordBatch]:
    """A file holding one JSON array of objects, as ``datasets.load_dataset("json")`` reads
    it: types inferred over every record of the array."""
    with open(path, "rb") as f:
        try:
            records = json.load(f)
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{path} is not a readable JSON array: {e}", path=path) from e
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), 0)
        raise FormatError(
            f"{path} holds a JSON array, but item {bad} is not an object (a record): kuat reads "
            "an array of objects, one per row",
            path=path,
        )
    names: dict[str, None] = {}
    for r in records:
        names.update(dict.fromkeys(r))
    for start in range(0, max(len(records), 1), batch_size):
        part = records[start : start + batch_size]
        cols = {}
        for name in names:
            values = [r.get(name) for r in part]
            try:
                cols[name] = pa.array(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
                kinds = [type(v) for v in values if v is not None]
                row = next((i for i, v in enumerate(values) if type(v) is not kinds[0]), 0)
                raise SchemaError(
                    f"column {name!r} of {path} holds {type(values[row]).__name__} values at "
                    f"row {start + row}, but {kinds[0].__name__} before: {e}",
                    field=name,
                ) from e
        if part:
            yield pa.RecordBatch.from_pydict(cols)


def _json_lines(path: str, batch_size: int) -> Iterator[pa.RecordBatch]:
    """JSON Lines in blocks of whole lines, so that no record straddles a pyarrow block."""
    import pyarrow.json as pj

    row = 0
    with open(path, "rb") as f:
        pending = bytearray()  # the start of a line that the last read cut
        while True:
            chunk = f.read(_JSON_BLOCK)
            if chunk:
                cut = chunk.rfind(b"\n") + 1
                if cut == 0:  # a record longer than the block: read on to its end
                    pending += chunk
                    continue
                block = bytes(pending) + chunk[:cut]
                pending = bytearray(chunk[cut:])
            else:
                block = bytes(pending)
            if block.strip():
                try:
                    table = pj.read_json(
                        io.BytesIO(block),
                        read_options=pj.ReadOptions(block_size=len(block) + 1, use_threads=False),
                    )
                except pa.ArrowInvalid as e:
                    raise FormatError(
                        f"{path} is not a readable jsonl file (in the block of rows from {row}; "
                        "expected JSON Lines, one object per line, or one JSON array of "
                        f"objects): {e}",
                        path=path,
                    ) from e
                for batch in table.to_batches(max_chunksize=batch_size):
                    row += batch.num_rows
                    yield batch
            if not chunk:
                return


def _csv(path: str, batch_size: int, delimiter: str, block: int, types) -> Iterator:
    import pyarrow.csv as pc

    reader = pc.open_csv(
        path,
        read_options=pc.ReadOptions(block_size=block),
        parse_options=pc.ParseOptions(delimiter=delimiter, newlines_in_values=True),
        convert_options=pc.ConvertOptions(column_types=types or None),
    )
    for batch in reader:
        yield from pa.Table.from_batches([batch]).to_batches(max_chunksize=batch_size)


class _Kept:
    """First-pass batches of one file, until the whole input's budget is spent."""

    def __init__(self, total: int):
        self.batches: list | None = []
        self.total = total  # bytes kept so far, this file included

    def append(self, batch: pa.RecordBatch) -> None:
        if self.batches is None:
            return
        self.total += batch.nbytes
        if self.total > _KEEP_BYTES:
            self.batches = None  # too much: the second pass parses this file again
        else:
            self.batches.append(batch)


class _Files:
    """The input files of one tabular format, read as Arrow record batches (see the module
    docstring for how each format is read)."""

    def __init__(self, kind: str, files: list[str], batch_size: int, delimiter: str | None):
        self.kind, self.files, self.batch_size = kind, files, batch_size
        self.delimiter = delimiter
        self.csv_block: dict[str, int] = {}  # per CSV file: a block size its records fit in
        self.types: dict | None = None  # unified column types (after infer)
        self.kept: dict[str, list[pa.RecordBatch]] = {}  # first-pass batches, per file
        self.kept_bytes = 0

    def _delimiter(self, path: str) -> str:
        if self.delimiter is not None:
            return self.delimiter
        return "\t" if path.lower().endswith((".tsv", ".tab")) else ","

    def batches(self, path: str) -> Iterator[pa.RecordBatch]:
        """The record batches of one file; a file that does not parse raises ``FormatError``."""
        try:
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                yield from pq.ParquetFile(path).iter_batches(batch_size=self.batch_size)
            elif self.kind == "jsonl":
                if _json_kind(path) == "array":
                    yield from _json_array(path, self.batch_size)
                else:
                    yield from _json_lines(path, self.batch_size)
            elif self.kind == "csv":
                yield from self._csv_batches(path)
            else:
                raise ValueError(f"unknown tabular kind {self.kind!r}")
        except (pa.ArrowException, OSError) as e:  # ArrowInvalid: a parse error
            if isinstance(e, FileNotFoundError):
                raise
            raise FormatError(f"{path} is not a readable {self.kind} file: {e}", path=path) from e

    def _csv_batches(self, path: str) -> Iterator[pa.RecordBatch]:
        """Second pass: the block size and the column types are known from the first."""
        types = {n: t for n, t in (self.types or {}).items() if not pa.types.is_null(t)}
        block = self.csv_block.get(path, _CSV_BLOCK)
        yield from _csv(path, self.batch_size, self._delimiter(path), block, types)

    def _keep(self, path: str, kept: _Kept | None) -> None:
        if kept is not None and kept.batches is not None:
            self.kept[path] = kept.batches
            self.kept_bytes = kept.total

    def _parquet_types(self, path: str, u: TypeUnifier) -> list[str]:
        """First pass over a Parquet file: the types from its schema; the data is read only
        for dictionary-encoded columns (their categories)."""
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        dict_cols = [f.name for f in schema if pa.types.is_dictionary(f.type)]
        for f in schema:
            if f.name not in dict_cols:
                u.add_type(f.name, f.type, f"{path} (its schema)")
        if dict_cols:
            u.add(pq.read_table(path, columns=dict_cols), path, 0)
        return schema.names

    def _csv_types(self, path: str, u: TypeUnifier) -> list[str]:
        """First pass over a CSV file: a block size every record fits in (doubled from 1 MiB
        until pyarrow stops reporting a record that straddles blocks), and the types; when
        they change after the first block (pyarrow's streaming reader fixes them there), the
        file is read whole once to infer them over all of it."""
        import pyarrow.csv as pc

        d, size, block = self._delimiter(path), os.path.getsize(path), _CSV_BLOCK
        while True:
            local, names, row, kept = TypeUnifier(), [], 0, _Kept(self.kept_bytes)
            try:
                for batch in _csv(path, self.batch_size, d, block, None):
                    names = batch.schema.names
                    local.add(batch, path, row)
                    row += batch.num_rows
                    kept.append(batch)
            except pa.ArrowInvalid as e:
                if "straddl" in str(e) and block <= size:
                    block *= 2
                    continue
                if "conversion error" not in str(e):
                    raise
                table = pc.read_csv(
                    path,
                    read_options=pc.ReadOptions(block_size=max(block, size + 1)),
                    parse_options=pc.ParseOptions(delimiter=d, newlines_in_values=True),
                )
                local, names, kept = TypeUnifier(), table.schema.names, None
                local.add(table, path, 0)
            self.csv_block[path] = block
            u.update(local)
            self._keep(path, kept)
            return names

    def schema_metadata(self, path: str) -> dict:
        if self.kind != "parquet":
            return {}
        import pyarrow.parquet as pq

        return pq.read_schema(path).metadata or {}

    def infer(self) -> TypeUnifier:
        """Pass 1: every file's columns and their types unified over the whole input."""
        u = TypeUnifier()
        first_names = None
        for path in self.files:
            names = self.infer_file(path, u)
            first_names = self.check_columns(path, names, first_names)
        self.types = dict(u.types)
        return u

    def infer_file(self, path: str, u: TypeUnifier) -> list[str]:
        """Pass 1 over one file: its types folded into ``u``; returns its column names.

        Raises:
            kuat.FormatError: the file does not parse (names it).
            kuat.SchemaError: a column's values conflict (names the file and row).
        """
        names: dict[str, None] = {}
        try:
            if self.kind == "csv":
                names.update(dict.fromkeys(self._csv_types(path, u)))
            elif self.kind == "parquet":
                names.update(dict.fromkeys(self._parquet_types(path, u)))
            else:
                row, kept = 0, _Kept(self.kept_bytes)
                for batch in self.batches(path):
                    names.update(dict.fromkeys(batch.schema.names))
                    u.add(batch, path, row)
                    row += batch.num_rows
                    kept.append(batch)
                self._keep(path, kept)
        except (pa.ArrowException, OSError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise FormatError(f"{path} is not a readable {self.kind} file: {e}", path=path) from e
        return list(names)

    def check_columns(self, path: str, names: list[str], first: list[str] | None) -> list[str]:
        """Every file but JSON Lines (whose records may omit keys) has the first's columns.

        Raises:
            kuat.SchemaError: ``path``'s columns differ from the first file's.
        """
        if first is None:
            return names
        if self.kind != "jsonl" and set(names) != set(first):
            raise SchemaError(f"{path} has columns {names}, but {self.files[0]} has {first}")
        return first

    def table_batches(self) -> Iterator[TableBatch]:
        """Pass 2: the batches of every file, with where they come from."""
        for path in self.files:
            base = os.path.dirname(os.path.abspath(path))
            row = 0
            kept = self.kept.pop(path, None)
            for batch in kept if kept is not None else self.batches(path):
                yield TableBatch(batch, path, row, base)
                row += batch.num_rows


def _from_tables(
    kind: str,
    paths,
    dst,
    *,
    image_fields: Sequence[str],
    batch_size: int,
    opts: ConvertOptions,
    delimiter: str | None = None,
) -> ConvertReport:
    files = expand_paths(paths, opts.storage_options)
    if opts.engine == "ray":
        return _convert_files_on_ray(kind, files, dst, image_fields, batch_size, opts, delimiter)
    with tempfile.TemporaryDirectory(prefix="kuat-sources-") as stage:
        local = [download(f, stage, opts.storage_options) if is_url(f) else f for f in files]
        try:
            return _convert_files(
                kind, files, local, dst, image_fields, batch_size, opts, delimiter
            )
        except (KuatError, ValueError) as e:
            named = _named_as_given(e, {c: f for c, f in zip(local, files) if c != f})
            if named is None:
                raise
            raise named from e


def _named_as_given(e: Exception, urls: dict[str, str]) -> Exception | None:
    """``e`` again, its message and ``path``/``source`` naming each URL the user gave where
    they named the temporary local copy it was parsed from (the copy is gone when the error
    is read, and the user never named it); ``None`` when ``e`` names no copy.

    Every parse, inference and conversion error of a staged file passes through here, so no
    error site needs to know whether its file was downloaded."""
    message = str(e)
    copies = [c for c in urls if c in message]
    if not copies:
        return None
    for c in copies:
        message = message.replace(c, urls[c])
    named = copy.copy(e)  # same type and attributes (row, field, index ...)
    named.args = (message, *e.args[1:])
    for attr in ("path", "source"):
        value = getattr(named, attr, None)
        if isinstance(value, str) and value in urls:
            setattr(named, attr, urls[value])
    return named


def _convert_files(kind, files, local, dst, image_fields, batch_size, opts, delimiter):
    """``files`` as named by the user; ``local``: the same, URLs downloaded to local copies
    (each is parsed twice: type inference, then conversion). Image paths in a table are
    resolved next to the local file."""
    src = _Files(kind, local, batch_size, delimiter)
    unifier = src.infer()
    fields, metadata = _plan(kind, files, unifier, src.schema_metadata(local[0]), image_fields)
    with converting(dst, Schema([f for f, _ in fields]), opts, metadata) as (w, report):
        write_batches(w, fields, src.table_batches(), opts, report, desc=f"convert {kind}")
    return report


def _plan(kind, files, unifier: TypeUnifier, first_metadata: dict, image_fields):
    """The kuat fields ``[(Field, arrow type)]`` and the dataset metadata of a conversion,
    from the unified column types (both engines)."""
    if not unifier.types:
        raise ValueError(f"{files[0]} holds no rows (cannot infer the columns)")
    unknown = [n for n in image_fields if n not in unifier.types]
    if unknown:
        raise ValueError(
            f"image field {unknown[0]!r} is not a column of {files[0]} ({list(unifier.types)})"
        )
    hf_features = hf_features_of(first_metadata)
    fields = []
    for name, t in unifier.types.items():
        md, is_image = hf_metadata((hf_features or {}).get(name))
        if name in unifier.categories:
            md["categories"] = unifier.categories[name]
        try:
            f = arrow_field(name, t, is_image or name in image_fields, md)
        except ValueError as e:
            raise ValueError(f"{e} (in {', '.join(files)})") from e
        fields.append((f, t))
    metadata = {"source": kind, "files": [os.path.basename(f) for f in files]}
    if hf_features is not None:
        metadata["hf_features"] = hf_features
    return fields, metadata


def _convert_files_on_ray(kind, files, dst, image_fields, batch_size, opts, delimiter):
    """The Ray engine: one task per input file infers its column types (the driver reads no
    rows; it unifies the files' types in file order, as the local engine does over the
    whole input), then one task per file converts it."""
    from kuat.convert._ray import convert_on_ray, map_on_ray, ray_session

    with ray_session():  # one Ray instance for both passes
        plan = _Files(kind, files, batch_size, delimiter)
        found = map_on_ray(_infer_task, files, opts, fn_kwargs={"plan": plan, "opts": opts})
        unifier, first_names = TypeUnifier(), None
        for path, (types, names, block, _) in zip(files, found):
            unifier.update(types)  # a conflict between files names both (file and row)
            first_names = plan.check_columns(path, names, first_names)
            if block is not None:
                plan.csv_block[path] = block
        plan.types = dict(unifier.types)
        fields, metadata = _plan(kind, files, unifier, found[0][3], image_fields)

        def write_part(w, path: str, part_opts: ConvertOptions, report: ConvertReport) -> None:
            with _local_copy(path, part_opts) as local:
                one = copy.copy(plan)
                one.files, one.kept, one.kept_bytes = [local], {}, 0
                one.csv_block = {local: plan.csv_block.get(path, _CSV_BLOCK)}
                write_batches(
                    w, fields, one.table_batches(), part_opts, report, desc=f"convert {kind}"
                )

        schema = Schema([f for f, _ in fields])
        return convert_on_ray(dst, schema, metadata, opts, files, write_part, _path_of_part)


def _path_of_part(path: str) -> list[str]:
    """The one input file of a Ray part (its size and time go into its fingerprint)."""
    return [path]


def _infer_task(path: str, k: int, payload: bytes, *, plan: _Files, opts: ConvertOptions):
    """Ray task: pass 1 over one file -> ``(its TypeUnifier, its column names, its CSV block
    size or None, the first file's schema metadata)``."""
    with _local_copy(path, opts) as local:
        one = copy.copy(plan)
        # kept_bytes past the budget: pass 1 keeps no batches in memory (pass 2 is another task)
        one.files, one.kept, one.kept_bytes, one.csv_block = [local], {}, _KEEP_BYTES + 1, {}
        u = TypeUnifier()
        names = one.infer_file(local, u)
        for name in list(u.seen_at):  # name the file as the user did, not its local copy
            u.seen_at[name] = u.seen_at[name].replace(local, path, 1)
        return u, names, one.csv_block.get(local), one.schema_metadata(local) if k == 0 else {}


@contextlib.contextmanager
def _local_copy(path: str, opts: ConvertOptions):
    """``path`` itself, or a URL downloaded into a temporary directory for the block."""
    if not is_url(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="kuat-sources-") as stage:
        yield download(path, stage, opts.storage_options)


def _opts(kw: dict) -> ConvertOptions:
    return ConvertOptions(**kw)


_DOC_ARGS = """
    Args:
        paths: a file, a glob, or a list of either.
        dst: the dataset directory to write.
        image_fields: columns holding images (bytes, or file paths relative to the file's
            directory); ``struct<bytes, path>`` columns are images without being named.
        batch_size: rows per Arrow record batch read.
        options: ``num_workers``, ``progress``, ``progress_interval_s``, ``overwrite``,
            ``on_error``, ``resize_shorter``, ``quality``, ``decode_check``,
            ``shard_bytes``, ``engine`` (``"ray"``: one Ray task per input file, the same
            rows in the same order): see :class:`kuat.convert.ConvertOptions`.

    Returns:
        a :class:`kuat.convert.ConvertReport`.

    Raises:
        FileNotFoundError: no input file.
        ValueError: a column type has no kuat equivalent (names the column).
        kuat.FormatError: a file that does not parse as its format (names the file).
        kuat.SchemaError: a null value (names column, file and row; skipped with
            ``on_error="skip"``), a column whose types conflict, or files whose columns differ.
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
    delimiter: str | None = None,
    **options,
) -> ConvertReport:
    if delimiter is not None and (not isinstance(delimiter, str) or len(delimiter) != 1):
        raise ValueError(f"delimiter={delimiter!r} must be one character, e.g. ',' or '\\t'")
    return _from_tables(
        "csv",
        paths,
        dst,
        image_fields=image_fields,
        batch_size=batch_size,
        opts=_opts(options),
        delimiter=delimiter,
    )


from_parquet.__doc__ = "Convert Parquet file(s) into a kuat dataset." + _DOC_ARGS
from_jsonl.__doc__ = (
    "Convert JSON file(s) into a kuat dataset: JSON Lines (one object per line), or a JSON "
    "array of objects (detected by content)." + _DOC_ARGS
)
from_csv.__doc__ = (
    "Convert CSV file(s) (header row, types inferred over the whole input) into a kuat "
    "dataset.\n\n    ``delimiter``: the field separator (one character); ``None`` (default): "
    "a tab for ``.tsv``/``.tab`` files, else a comma." + _DOC_ARGS
)
