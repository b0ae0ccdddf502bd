"""Writing kuat datasets: validate rows against the schema, roll shards, rename into place.

Each shard is one Arrow IPC record batch, written to ``.shard-NNNNN.arrow.tmp`` and renamed
to ``shard-NNNNN.arrow`` once complete; the manifest is written last (also renamed into
place), so an interrupted write never leaves a directory that opens as a dataset.

The :class:`Writer` sizes and rolls shards and owns the write's lifecycle; what a field
accepts and how its column is built is :mod:`kuat.format.builder`'s, and the directory's names,
lock and clearing are :mod:`kuat.format.layout`'s.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa

from kuat.errors import FormatError, SchemaError
from kuat.format.builder import ColumnBuilder, describe_given
from kuat.format.fs import Remote, is_url, local_path, open_remote, retry
from kuat.format.layout import (
    clear_directory,
    is_shard_file,
    lock_directory,
    prepare_remote,
    shard_name,
    temporary_path,
    unlock_directory,
)
from kuat.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    write_manifest,
    writer_name,
)
from kuat.format.schema import FieldType, Schema
from kuat.format.shard_file import ShardFile

__all__ = ["Writer", "DEFAULT_SHARD_BYTES"]

log = logging.getLogger("kuat.format.writer")

DEFAULT_SHARD_BYTES = 128 << 20
# Arrow binary/string offsets are int32: one shard's variable-length data must stay < 2 GiB.
_MAX_SHARD_BYTES = 1 << 30


class Writer:
    """Writes a kuat dataset directory: Arrow IPC shards plus ``manifest.json``.

    Usage::

        schema = kuat.Schema({"image": kuat.format.image(), "label": kuat.format.int64()})
        with kuat.Writer("train.kuat", schema) as w:
            w.write({"image": jpeg_bytes, "label": 3})
            w.write_batch({"image": [b1, b2], "label": [0, 1]})

    Args:
        path: the dataset directory (created if missing), or a URL (``s3://bucket/x.kuat``,
            any fsspec URL): each shard is written to a local temporary directory, uploaded
            (with retries) as soon as it is complete and deleted locally; the manifest is
            uploaded last, so a reader never sees a partial dataset.
        schema: a :class:`Schema` or a mapping ``{name: FieldType}``.
        shard_bytes: target shard size in bytes; a shard is closed before a row would take it
            past this (a single larger row gets a shard of its own). 128 MiB by default: large
            enough that thousands of shards cover an ImageNet-sized set, small enough that a
            shard (buffered in memory until written, as one record batch) stays cheap.
        overwrite: replace an existing dataset at ``path``. Without it an existing dataset,
            or a non-empty directory that is not a kuat dataset, is refused.
        metadata: JSON-serialisable dict kept in the manifest (class names, source, ...).
        storage_options: fsspec options for a URL ``path`` (credentials, ``endpoint_url``).

    Image values are encoded bytes (width/height/codec probed from the header), an
    :class:`EncodedImage`, or a dict ``{"bytes": ..., "width": ..., "height": ..., "codec": ...}``.

    Shard files are written by one background thread (``kuat-writer-0``) while rows keep
    coming, so at most two shards are held in memory: the one being filled and the one being
    written. An error writing a shard (a full disk) is raised by the next ``write`` that
    fills a shard, or by ``close()``.

    Not thread-safe: one thread writes. Rows are stored in the order written. One Writer
    per directory at a time: it holds an advisory lock (``.kuat-writer.lock``, flock) until
    ``close()``/``abort()``, and a second Writer, in any process, is refused. (Object stores
    have no such lock: two Writers to one URL at once leave whichever manifest came last.)

    Raises:
        FileExistsError: ``path`` holds a dataset (or other files) and ``overwrite`` is False,
            or another Writer is writing into it.
        kuat.format.fs.RemoteError: a URL destination cannot be reached (after retries);
            nothing is written anywhere.
        ImportError: the URL scheme's fsspec backend is not installed (names the package).
        kuat.SchemaError: a row or column does not match the schema (names field, row,
            expected and given type); nothing of that row/batch is written.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        schema: Schema | Mapping[str, FieldType],
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        overwrite: bool = False,
        metadata: dict | None = None,
        storage_options: Mapping | None = None,
    ):
        if not isinstance(schema, Schema):
            schema = Schema(schema)
        if not isinstance(shard_bytes, int) or not 1 <= shard_bytes <= _MAX_SHARD_BYTES:
            raise ValueError(
                f"shard_bytes={shard_bytes!r} must be an int in [1, {_MAX_SHARD_BYTES}]"
            )
        metadata = dict(metadata or {})
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as e:
            raise TypeError(f"metadata must be JSON-serialisable: {e}") from e
        self._remote: Remote | None = None
        if is_url(path):
            self._remote = open_remote(path, storage_options)
            self.path: Path | str = self._remote.url
        else:
            if storage_options:
                raise ValueError(f"storage_options are for URLs; {path!r} is a local path")
            self.path = Path(local_path(path))
        self._dir = self.path  # where shards are written (a local staging folder for a URL)
        self.schema = schema
        self.shard_bytes = shard_bytes
        self.metadata = metadata
        self._arrow_schema = schema.to_arrow().with_metadata(
            {"kuat.schema": json.dumps(schema.to_json())}
        )
        self._builders = [ColumnBuilder(f.name, f.type) for f in schema]
        self._fixed_row_bytes = sum(f.type.fixed_row_bytes for f in schema)
        self._shards: list[ShardInfo] = []  # written and renamed into place, in order
        self._next_shard = 0
        # the thread writing shard files (one shard in flight), started by the first flush
        self._shard_thread: ThreadPoolExecutor | None = None
        self._pending_shard: Future | None = None
        self._rows_in_shard = 0
        self._bytes_in_shard = 0
        self._rows = 0
        self._closed = False
        self.manifest: Manifest | None = None
        self._lock_fd: int | None = None
        self._prepare_directory(overwrite)

    # -- directory (its names, lock and clearing: kuat.format.layout) ------------------------
    def _prepare_directory(self, overwrite: bool) -> None:
        if self._remote is not None:
            prepare_remote(self._remote, overwrite)
            self._dir = Path(tempfile.mkdtemp(prefix="kuat-upload-"))
            return
        p = self.path
        if p.exists() and not p.is_dir():
            raise FileExistsError(f"{p} exists and is not a directory")
        p.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_directory(p)
        try:
            clear_directory(p, overwrite)
        except BaseException:
            self._unlock()
            raise

    def _unlock(self) -> None:
        if self._remote is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            return
        fd, self._lock_fd = self._lock_fd, None
        unlock_directory(self.path, fd)

    def _upload(self, local: Path, name: str) -> None:
        remote = self._remote
        retry(
            lambda: remote.fs.put_file(str(local), remote.path_of(name)),
            what=f"uploading shard {name} to",
            url=remote.url_of(name),
        )
        local.unlink()

    # -- writing ---------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows written so far."""
        return self._rows

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"Writer for {self.path} is closed")

    def _check_names(self, names: object, what: str) -> None:
        expected = self.schema.names
        if set(names) != set(expected):
            missing = [n for n in expected if n not in names]
            extra = [n for n in names if n not in self.schema]
            if missing:
                raise SchemaError(
                    f"{what} is missing field {missing[0]!r} (schema: {self.schema})",
                    field=missing[0],
                )
            raise SchemaError(
                f"{what} has field {extra[0]!r} that is not in the schema ({self.schema})",
                field=str(extra[0]),
            )

    def write(self, row: Mapping[str, object]) -> None:
        """Append one row ``{field: value}``.

        Raises:
            kuat.SchemaError: a field is missing, unknown, or of the wrong type.
        """
        self._check_open()
        if not isinstance(row, Mapping):
            raise TypeError(f"row must be a mapping of field -> value, got {type(row).__name__}")
        self._check_names(row, f"row {self._rows}")
        checked = []
        size = self._fixed_row_bytes
        for b in self._builders:
            value, n = b.check_value(row[b.name], self._rows)
            checked.append(value)
            size += n
        if self._rows_in_shard and self._bytes_in_shard + size > self.shard_bytes:
            self._flush_shard()
        for b, value in zip(self._builders, checked):
            b.add_value(value)
        self._rows_in_shard += 1
        self._bytes_in_shard += size
        self._rows += 1

    def write_batch(self, columns: Mapping[str, object]) -> None:
        """Append the rows of ``{field: column}`` (lists, or arrays of ``(N, ...)``).

        All columns must have the same length N. Fixed-size columns given as NumPy arrays
        of the field's dtype are taken without per-row Python work.

        Raises:
            kuat.SchemaError: a column is missing, unknown, of another length or type.
        """
        self._check_open()
        if not isinstance(columns, Mapping):
            raise TypeError(
                f"columns must be a mapping of field -> column, got {type(columns).__name__}"
            )
        self._check_names(columns, "batch")
        lengths = {}
        for name, col in columns.items():
            try:
                lengths[name] = len(col)
            except TypeError as e:
                raise SchemaError(
                    f"field {name!r}: a column must be a sequence or an array, got {describe_given(col)}",
                    field=str(name),
                ) from e
        n = next(iter(lengths.values()))
        if any(v != n for v in lengths.values()):
            raise SchemaError(f"columns have different lengths: {lengths}")
        if n == 0:
            return
        checked, sizes = [], np.full(n, self._fixed_row_bytes, np.int64)
        for b in self._builders:
            col, s = b.check_column(columns[b.name], n, self._rows)
            checked.append(col)
            sizes += s
        start = 0
        while start < n:
            room = self.shard_bytes - self._bytes_in_shard
            cum = np.cumsum(sizes[start:])
            take = int(np.searchsorted(cum, room, side="right"))
            if take == 0:
                if self._rows_in_shard:
                    self._flush_shard()
                    continue
                take = 1  # a row larger than shard_bytes gets a shard of its own
            stop = start + take
            for b, col in zip(self._builders, checked):
                b.add_slice(col, start, stop)
            self._rows_in_shard += take
            self._bytes_in_shard += int(cum[take - 1])
            self._rows += take
            start = stop
            if self._bytes_in_shard >= self.shard_bytes and start < n:
                self._flush_shard()

    def _flush_shard(self) -> None:
        """Seal the current shard's columns and hand them to the shard thread, which writes
        the file while this thread goes on taking rows (at most one shard in flight: this
        first waits for the previous one, and raises its error)."""
        if not self._rows_in_shard:
            return
        name = shard_name(self._next_shard)
        tmp = temporary_path(self._dir / name)
        shard = ShardFile(tmp)
        try:
            arrays = [b.finish(shard) for b in self._builders]
            self._wait_shard()
        except BaseException:
            shard.close()
            raise
        if self._shard_thread is None:
            self._shard_thread = ThreadPoolExecutor(1, thread_name_prefix="kuat-writer")
        self._pending_shard = self._shard_thread.submit(
            self._write_shard, shard, arrays, name, self._rows_in_shard
        )
        self._next_shard += 1
        self._rows_in_shard = 0
        self._bytes_in_shard = 0

    def add_shard(self, path: str | os.PathLike, info: ShardInfo) -> ShardInfo:
        """Move a complete shard written elsewhere into this dataset as its next shard.

        The file is renamed into place (``os.replace``): its bytes are neither read nor
        rewritten, so the caller vouches that it was written by a :class:`Writer` with this
        schema, and ``info`` (its rows, bytes and checksum, e.g. from that Writer's manifest)
        is recorded as is. Rows written before are flushed to a shard of their own first.
        This is how a distributed conversion assembles the shards its tasks wrote.

        Returns:
            the shard's entry in this dataset's manifest (its new name).

        Raises:
            kuat.FormatError: the file's size differs from ``info.bytes`` (names the file).
            OSError: the rename failed (another file system, say).
        """
        self._check_open()
        self._flush_shard()
        self._wait_shard()  # the shard in flight comes first in the manifest
        src = Path(path)
        size = os.path.getsize(src)
        if size != info.bytes:
            raise FormatError(
                f"shard {src} holds {size} bytes, its manifest entry says {info.bytes}",
                path=src,
            )
        name = shard_name(self._next_shard)
        os.replace(src, self.path / name)
        self._next_shard += 1
        entry = ShardInfo(name, info.rows, info.bytes, info.checksum)
        self._shards.append(entry)
        self._rows += info.rows
        return entry

    def _write_shard(self, shard: ShardFile, arrays: list, name: str, rows: int) -> ShardInfo:
        """On the shard thread: write, checksum and fsync one shard, then rename it into place.

        One pass over the bytes: values go from their objects to the file, hashed on the way
        (no joined copy, no re-read for the checksum), and one fsync per shard.
        """
        with shard:
            batch = pa.RecordBatch.from_arrays(arrays, schema=self._arrow_schema)
            with pa.ipc.new_stream(pa.PythonFile(shard, mode="w"), self._arrow_schema) as w:
                w.write_batch(batch)
            del arrays, batch  # the deferred placeholders
            checksum = shard.sync()
            size = shard.tell()
        final = self._dir / name
        os.replace(shard.path, final)
        if self._remote is not None:  # uploaded on this thread too, while rows keep coming
            self._upload(final, name)
        log.debug("wrote %s: %d rows, %d bytes", final, rows, size)
        return ShardInfo(name, rows, size, checksum)

    def _wait_shard(self) -> None:
        """Wait for the shard in flight, if any, and record it.

        Raises:
            OSError: writing it failed (a full disk, say), chained to the cause.
        """
        pending, self._pending_shard = self._pending_shard, None
        if pending is None:
            return
        try:
            info = pending.result()
        except OSError as e:
            raise OSError(
                e.errno,
                f"writing shard {len(self._shards)} of {self.path} failed: {e.strerror or e}",
            ) from e
        self._shards.append(info)

    def _stop_shard_thread(self) -> None:
        if self._shard_thread is not None:
            self._shard_thread.shutdown(wait=True)
            self._shard_thread = None

    # -- closing ---------------------------------------------------------------------------
    def close(self) -> Manifest:
        """Write the last shard, then the manifest (atomically). Idempotent. If that fails
        (a full disk, say), the write is aborted (see :meth:`abort`) and the error re-raised.

        Returns:
            the dataset's :class:`Manifest`.
        """
        if self._closed:
            return self.manifest
        try:
            self._flush_shard()
            self._wait_shard()
            self._stop_shard_thread()
            manifest = Manifest(
                schema=self.schema,
                shards=tuple(self._shards),
                metadata=self.metadata,
                created_by=writer_name(),
            )
            if self._remote is None:
                write_manifest(self.path, manifest)
            else:
                write_manifest(self.path, manifest, storage_options=self._remote.storage_options)
        except BaseException:
            self.abort()  # no dataset; delete the shards rather than leave them unlisted
            raise
        self._closed = True
        self.manifest = manifest
        self._unlock()
        log.debug(
            "wrote kuat dataset %s: %d rows in %d shards", self.path, self._rows, len(self._shards)
        )
        return self.manifest

    def abort(self) -> None:
        """Stop without writing a manifest and delete the shards written so far."""
        if self._closed:
            return
        self._closed = True
        for b in self._builders:
            b.reset()
        try:  # let the shard in flight finish before deleting (its error is moot now)
            self._wait_shard()
        except Exception as e:
            log.debug("the shard being written when %s was aborted failed: %s", self.path, e)
        self._stop_shard_thread()
        if self._remote is not None:
            for info in self._shards:  # best effort: without a manifest it is no dataset
                try:
                    self._remote.fs.rm_file(self._remote.path_of(info.file))
                except Exception as e:
                    log.debug("cannot delete %s: %s", self._remote.url_of(info.file), e)
        for e in os.scandir(self._dir):
            if is_shard_file(e.name) and e.name != MANIFEST_NAME:
                try:
                    os.unlink(e.path)
                except OSError:  # best effort: the directory is not a dataset either way
                    pass
        self._unlock()
        log.warning(
            "aborted writing %s after %d rows; no dataset was written", self.path, self._rows
        )

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __repr__(self) -> str:
        return f"Writer({str(self.path)!r}, rows={self._rows}, shards={len(self._shards)})"

