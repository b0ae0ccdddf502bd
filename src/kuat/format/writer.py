"""Writing kuat datasets: validate rows against the schema, roll shards, rename into place.

Each shard is one Arrow IPC record batch, written to ``.shard-NNNNN.arrow.tmp`` and renamed
to ``shard-NNNNN.arrow`` once complete; the manifest is written last (also renamed into
place), so an interrupted write never leaves a directory that opens as a dataset.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa

from kuat.errors import DecodeError, FormatError, SchemaError
from kuat.format.arrow_views import array_from_bytes, array_from_numpy
from kuat.format.fs import Remote, is_url, local_path, open_remote, retry
from kuat.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    member_path,
    read_manifest,
    write_manifest,
)
from kuat.format.schema import EncodedImage, FieldType, Schema
from kuat.format.shard_file import DEFER_MIN_BYTES, ShardFile, deferring_works

__all__ = ["Writer", "DEFAULT_SHARD_BYTES"]

log = logging.getLogger("kuat.format.writer")

DEFAULT_SHARD_BYTES = 128 << 20
# Arrow binary/string offsets are int32: one shard's variable-length data must stay < 2 GiB.
_MAX_SHARD_BYTES = 1 << 30
# the most bytes (or sequence elements) one Arrow binary/string/list value can hold
_MAX_VALUE_BYTES = 2**31 - 2
_SHARD_RE = re.compile(
    r"^(shard-\d{5,}\.arrow|\.shard-\d{5,}\.arrow\.tmp.*|\.manifest\.json\.tmp.*)$"
)


# held (flock) by the one Writer writing into a directory; not part of the dataset
LOCK_NAME = ".kuat-writer.lock"


def lock_directory(directory: Path) -> int | None:
    """Take ``directory``'s writer lock (an exclusive ``flock`` on ``.kuat-writer.lock``).

    Returns:
        the lock's file descriptor, for :func:`unlock_directory`; ``None`` on a file system
        without ``flock`` (some network mounts), where writing goes on unlocked.

    Raises:
        FileExistsError: another Writer or merge holds it (it would delete and rename over
            this one's shards, and this one over its).
    """
    path = directory / LOCK_NAME
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FileExistsError(
                f"another kuat Writer is writing into {directory} (it holds {path}); "
                "wait for it to finish or write elsewhere"
            ) from None
        except OSError as e:
            os.close(fd)
            log.debug("cannot lock %s (%s); writing without a lock", path, e)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder removed the file between our open and lock: again
    raise FileExistsError(f"cannot take the writer lock {path}")


def unlock_directory(directory: Path, fd: int | None) -> None:
    """Release a lock from :func:`lock_directory` (removing the file first, which the
    inode check there relies on)."""
    if fd is None:
        return
    try:
        os.unlink(directory / LOCK_NAME)
    except OSError:
        pass
    os.close(fd)


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.arrow"


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


def _given(value: object) -> str:
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


class _Builder:
    """Validates and accumulates the values of one field for the current shard."""

    def __init__(self, name: str, ftype: FieldType):
        self.name = name
        self.t = ftype
        self.chunks: list = []  # validated column pieces (np.ndarray or list)
        self.pending: list = []  # validated single values not yet in a chunk

    # -- errors ----------------------------------------------------------------------------
    def error(self, row: int, value: object, detail: str = "") -> SchemaError:
        extra = f" ({detail})" if detail else ""
        return SchemaError(
            f"field {self.name!r} row {row}: expected {self.t.describe()}, got "
            f"{_given(value)}{extra}",
            field=self.name,
        )

    # -- single values ---------------------------------------------------------------------
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

    def check_value(self, value: object, row: int) -> tuple[object, int]:
        """Validated value and its variable-length byte size."""
        t = self.t
        kind = t.kind
        if kind == "scalar":
            dt = t.np_dtype
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
        if kind == "bool":
            if not isinstance(value, (bool, np.bool_)):
                raise self.error(row, value)
            return bool(value), 0
        if kind == "string":
            if not isinstance(value, str):
                raise self.error(row, value)
            n = self._utf8_size(value, row, value)
            self._check_size(value, row, n)
            return value, n
        if kind == "strings":
            return self._check_strings(value, row)
        if kind == "bytes":
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise self.error(row, value)
            value = bytes(value)
            self._check_size(value, row, len(value))
            return value, len(value)
        if kind == "tensor":
            arr = self._array(value, row, len(t.shape))
            if tuple(arr.shape) != t.shape:
                raise self.error(row, value, "shape differs")
            return arr, 0
        if kind == "sequence":
            arr = self._array(value, row, 1)
            self._check_size(value, row, len(arr), "elements")
            return arr, arr.nbytes
        return self._check_image(value, row)

    def _utf8_size(self, s: str, row: int, value: object) -> int:
        """The UTF-8 size of ``s`` (shards are sized by it); refuses lone surrogates."""
        if s.isascii():
            return len(s)
        try:
            return len(s.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise self.error(row, value, f"not encodable as UTF-8: {e.reason} at {e.start}") from e

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
                raise self.error(row, value, f"item {k} is {_given(s)}")
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

    # -- whole columns ---------------------------------------------------------------------
    def check_column(self, values: object, n: int, first_row: int) -> tuple[object, np.ndarray]:
        """Validated column (np.ndarray or list) and per-row variable byte sizes ``(n,)``."""
        t = self.t
        if t.kind in ("scalar", "bool", "tensor") and isinstance(values, np.ndarray):
            want_ndim = 1 if t.kind != "tensor" else 1 + len(t.shape)
            dt = t.np_dtype if t.kind != "bool" else np.dtype(bool)
            ok = values.ndim == want_ndim and len(values) == n
            if t.kind == "tensor":
                ok = ok and tuple(values.shape[1:]) == t.shape
            if t.kind == "bool":
                ok = ok and values.dtype.kind == "b"
            else:
                ok = (
                    ok
                    and values.dtype.kind in "iuf"
                    and (values.dtype == dt or np.can_cast(values.dtype, dt, "safe"))
                )
            if ok:
                return np.ascontiguousarray(values, dtype=dt), np.zeros(n, np.int64)
            if values.ndim == want_ndim and len(values) == n and values.dtype != object:
                # the dtype is not a safe cast: check every row (names the first bad one);
                # if all fit (small uint64 values in an int64 field, say), take them
                for j in range(n):
                    self.check_value(values[j], first_row + j)
                if t.kind == "scalar" and values.dtype.kind in "iu":
                    return values.astype(dt), np.zeros(n, np.int64)
                raise SchemaError(
                    f"field {self.name!r}: expected a column of {t.describe()}, got "
                    f"{_given(values)}",
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
        if t.kind in ("scalar", "bool"):
            return np.asarray(out, dtype=t.np_dtype if t.kind == "scalar" else bool), sizes
        if t.kind == "tensor":
            return np.stack(out) if out else np.empty((0, *t.shape), t.np_dtype), sizes
        return out, sizes

    # -- accumulation ----------------------------------------------------------------------
    def add_value(self, value: object) -> None:
        self.pending.append(value)

    def add_slice(self, column: object, start: int, stop: int) -> None:
        self._seal_pending()
        self.chunks.append(column[start:stop])

    def _seal_pending(self) -> None:
        if not self.pending:
            return
        t = self.t
        if t.kind == "scalar":
            chunk = np.asarray(self.pending, dtype=t.np_dtype)
        elif t.kind == "bool":
            chunk = np.asarray(self.pending, dtype=bool)
        elif t.kind == "tensor":
            chunk = np.stack(self.pending)
        else:
            chunk = list(self.pending)
        self.chunks.append(chunk)
        self.pending = []

    def finish(self, shard: ShardFile) -> pa.Array:
        """The field's Arrow array for the current shard, to be written to ``shard`` (large
        binary/string data buffers are deferred to it, see :mod:`kuat.format.shard_file`);
        resets the builder."""
        self._seal_pending()
        chunks, self.chunks = self.chunks, []
        t = self.t
        if t.kind in ("scalar", "bool", "tensor"):
            dt = t.np_dtype if t.kind != "bool" else np.dtype(bool)
            col = np.concatenate(chunks) if chunks else np.empty((0, *(t.shape or ())), dt)
            if t.kind == "tensor":
                flat = array_from_numpy(col.reshape(-1))  # (N, *shape) -> (N * numel,)
                return pa.FixedSizeListArray.from_arrays(flat, type=t.arrow_type)
            return array_from_numpy(col.astype(dt, copy=False))
        values = [v for c in chunks for v in c]
        if t.kind in ("string", "bytes"):
            return array_from_bytes(values, t.arrow_type, defer=_deferrer(shard))
        if t.kind == "strings":
            offsets = np.zeros(len(values) + 1, np.int32)
            np.cumsum(np.fromiter(map(len, values), np.int64, len(values)), out=offsets[1:])
            flat = [s for v in values for s in v]
            return pa.ListArray.from_arrays(
                array_from_numpy(offsets),
                array_from_bytes(flat, pa.string(), defer=_deferrer(shard)),
                type=t.arrow_type,
            )
        if t.kind == "sequence":
            lengths = np.fromiter((len(v) for v in values), np.int64, len(values))
            offsets = np.zeros(len(values) + 1, np.int32)
            np.cumsum(lengths, out=offsets[1:])
            flat = np.concatenate(values) if values else np.empty(0, t.np_dtype)
            return pa.ListArray.from_arrays(
                array_from_numpy(offsets),
                array_from_numpy(flat.astype(t.np_dtype, copy=False)),
                type=t.arrow_type,
            )
        # image
        return pa.StructArray.from_arrays(
            [
                array_from_bytes([v.data for v in values], pa.binary(), defer=_deferrer(shard)),
                array_from_numpy(np.fromiter((v.width for v in values), np.int32, len(values))),
                array_from_numpy(np.fromiter((v.height for v in values), np.int32, len(values))),
                array_from_bytes([v.codec for v in values], pa.string()),
            ],
            fields=list(t.arrow_type),
        )


def prepare_remote(remote: Remote, overwrite: bool) -> None:
        """The remote twin of ``Writer._clear_directory``: refuse or clear what is at the URL
        (the old manifest first, so no reader sees a mix). Run before anything is written, so
        an unreachable destination fails here, naming the URL.

        Raises:
            FileExistsError: a dataset or other objects are there and ``overwrite`` is False.
            kuat.format.fs.RemoteError: the destination cannot be reached after retries.
        """
        url = remote.url
        fs = remote.fs

        def listing() -> list[str]:
            try:
                return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(remote.path, detail=False)]
            except FileNotFoundError:
                return []

        names = retry(listing, what="listing", url=url)
        if MANIFEST_NAME in names:
            if not overwrite:
                raise FileExistsError(
                    f"{url} is already a kuat dataset; pass overwrite=True (--overwrite) to "
                    "replace it"
                )
            try:
                old = [s.file for s in read_manifest(url, storage_options=remote.storage_options).shards]
            except FormatError:
                old = []
            manifest = remote.path_of(MANIFEST_NAME)
            retry(lambda: fs.rm_file(manifest), what="deleting the old manifest", url=url)
            names = [n for n in names if n != MANIFEST_NAME] + old
        others = [n for n in names if not _SHARD_RE.match(n)]
        if others and not overwrite:
            raise FileExistsError(
                f"{url} is a non-empty prefix that is not a kuat dataset ({others[0]!r}, ...); "
                "pass overwrite=True (--overwrite) to write into it anyway"
            )
        for name in set(n for n in names if _SHARD_RE.match(n)):
            key = member_path(url, name)  # never delete outside the dataset's prefix
            try:
                retry(lambda k=key: fs.rm_file(remote.path_of(k[len(url) + 1 :])),
                      what="deleting an old shard", url=key)  # fmt: skip
            except FileNotFoundError:
                pass


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
        self._builders = [_Builder(f.name, f.type) for f in schema]
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

    # -- directory -------------------------------------------------------------------------
    def _lock(self) -> None:
        self._lock_fd = lock_directory(self.path)

    def _unlock(self) -> None:
        if self._remote is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            return
        fd, self._lock_fd = self._lock_fd, None
        unlock_directory(self.path, fd)

    def _prepare_directory(self, overwrite: bool) -> None:
        if self._remote is not None:
            self._prepare_remote(overwrite)
            self._dir = Path(tempfile.mkdtemp(prefix="kuat-upload-"))
            return
        p = self.path
        if p.exists() and not p.is_dir():
            raise FileExistsError(f"{p} exists and is not a directory")
        p.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._clear_directory(overwrite)
        except BaseException:
            self._unlock()
            raise

    def _clear_directory(self, overwrite: bool) -> None:
        p = self.path
        manifest = p / MANIFEST_NAME
        if manifest.exists():
            if not overwrite:
                raise FileExistsError(
                    f"{p} is already a kuat dataset; pass overwrite=True (--overwrite) to replace it"
                )
            try:
                old = [s.file for s in read_manifest(p).shards]
            except FormatError:
                old = []
            manifest.unlink()  # from here on the directory is no longer a dataset
            for name in old:
                try:  # never delete outside the dataset, whatever the old manifest says
                    path = member_path(p, name)
                except FormatError:
                    continue
                if os.path.isfile(path) or os.path.islink(path):
                    os.unlink(path)
        others = [
            e.name for e in os.scandir(p) if not _SHARD_RE.match(e.name) and e.name != LOCK_NAME
        ]
        if others and not overwrite:
            raise FileExistsError(
                f"{p} is a non-empty directory that is not a kuat dataset ({others[0]!r}, ...); "
                "pass overwrite=True (--overwrite) to write into it anyway"
            )
        for e in os.scandir(p):  # leftovers of an interrupted write
            if _SHARD_RE.match(e.name) and e.is_file():
                os.unlink(e.path)

    def _prepare_remote(self, overwrite: bool) -> None:
        prepare_remote(self._remote, overwrite)

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
                    f"field {name!r}: a column must be a sequence or an array, got {_given(col)}",
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
        tmp = self._dir / f".{name}.tmp-{os.getpid()}"
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
                created_by=f"kuat {_version()}",
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
            b.chunks, b.pending = [], []
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
            if _SHARD_RE.match(e.name) and e.name != MANIFEST_NAME:
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


def _version() -> str:
    from kuat import __version__

    return __version__
