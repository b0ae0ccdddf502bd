"""The input files of one tabular format (Parquet, JSON Lines or arrays, CSV/TSV), read as
Arrow record batches in two passes: pass 1 infers the column types over every file
(:meth:`TableFiles.infer`), pass 2 yields the batches to convert
(:meth:`TableFiles.table_batches`), reusing pass 1's parsed JSON/CSV batches up to
:data:`KEEP_BYTES`. How each format is read (JSON blocks of whole lines, CSV blocks grown until
the longest record fits) is described in :mod:`kuat.convert.tabular`.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator

import pyarrow as pa

from kuat.convert._table import TableBatch
from kuat.convert._table_types import TypeUnifier
from kuat.errors import FormatError, SchemaError

__all__ = ["CSV_BLOCK", "KEEP_BYTES", "TableFiles"]

_JSON_BLOCK = 1 << 20  # bytes of whole lines per JSON Lines parse; a longer line extends it
CSV_BLOCK = 1 << 20  # pyarrow's CSV block; doubled until the longest record fits
# JSON/CSV batches parsed by the first pass are kept for the second up to this many bytes of
# Arrow data (parsing is most of the cost); larger inputs are parsed again
KEEP_BYTES = 256 << 20


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
        if self.total > KEEP_BYTES:
            self.batches = None  # too much: the second pass parses this file again
        else:
            self.batches.append(batch)


class TableFiles:
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
        block = self.csv_block.get(path, CSV_BLOCK)
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

        d, size, block = self._delimiter(path), os.path.getsize(path), CSV_BLOCK
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
