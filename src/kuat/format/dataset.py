"""Reading kuat datasets: lazily memory-mapped shards, batch gathers, per-sample transforms.

Opening a dataset reads only ``manifest.json``; a shard is memory-mapped the first time one of
its rows is read (so opening thousands of shards is instant). Reads are zero-copy views into
the mapping until a batch gather copies the selected rows once.

Hot path of ``__getitems__(indices)`` (torch's batched fetch):

1. indices -> (shard, row) with one ``searchsorted`` over the manifest's cumulative row counts;
2. per field and per shard, one gather: ``np.take`` on the fixed-size column views
   (a tensor field becomes one ``(B, *shape)`` copy), offset lookups on variable-length
   columns whose values are sliced as zero-copy ``memoryview`` s;
3. per sample, only what must be per sample: image decode (or a fused transform writing into
   the batch buffer) and user callables.
"""

from __future__ import annotations

import array
import logging
import operator
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from kuat.errors import FormatError
from kuat.format.arrow_views import values_view
from kuat.format.cache import Prefetcher, ShardCache
from kuat.format.fs import Remote, is_url, local_path, open_remote
from kuat.format.ipc import check_messages
from kuat.format.manifest import (
    Manifest,
    ShardInfo,
    check_regular_file,
    member_path,
    read_manifest,
)
from kuat.format.schema import EncodedImage, FieldType, Schema
from kuat.rng import map_samples, sample_context, sample_rng

__all__ = ["Dataset", "ImageBatch", "open_dataset"]

log = logging.getLogger("kuat.format.dataset")


class ImageBatch(NamedTuple):
    """The stored form of an image field for a batch of B rows (``Dataset.read_batch``).

    Attributes:
        data: B zero-copy ``memoryview`` s of the encoded bytes (read-only, valid while held).
        width, height: ``(B,)`` int32, pixels after EXIF orientation.
        codec: B lower-case codec names (``"jpeg"``, ``"png"``, ...).
    """

    data: list
    width: np.ndarray
    height: np.ndarray
    codec: list


def _decode(data, index: int, source: str) -> np.ndarray:
    """Encoded image -> ``(H, W, 3)`` uint8 RGB (``kuat.vision.decode.decode_image``)."""
    from kuat.vision.decode import decode_image

    return decode_image(data, index=index, source=source)


# -- columns of one opened shard ----------------------------------------------------------
class _Fixed:
    """scalar / bool / tensor: ``values`` is ``(n, *shape)``, a view of the mapping."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray):
        self.values = values


class _Var:
    """string / bytes / sequence: ``offsets`` ``(n + 1,)`` int32 into ``data``."""

    __slots__ = ("offsets", "data", "mv")

    def __init__(self, offsets: np.ndarray, data: np.ndarray):
        self.offsets = offsets
        self.data = data
        self.mv = memoryview(data) if data.dtype == np.uint8 else None

    def spans(self, rows: np.ndarray | list[int]) -> tuple[list[int], list[int]]:
        """Start and end offsets of ``rows`` (an int64 array, or a list of ints)."""
        if isinstance(rows, list):
            o = self.offsets
            return [int(o[r]) for r in rows], [int(o[r + 1]) for r in rows]
        return self.offsets[rows].tolist(), self.offsets[rows + 1].tolist()


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


def _span_positions(start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """``(sum(size),) int64``: ``start[0], start[0] + 1, ..., start[1], ...``."""
    offsets = np.cumsum(size) - size  # (m,)
    return np.repeat(start - offsets, size) + np.arange(int(size.sum()))


def _flat_rows(col: _Var, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths (B,) int64, values (T,))`` of a sequence column's ``rows``, end to end."""
    start = col.offsets[rows].astype(np.int64)  # (B,)
    lengths = col.offsets[rows + 1] - start  # (B,) int64
    if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and (np.diff(rows) == 1).all():
        return lengths, col.data[start[0] : start[0] + int(lengths.sum())]  # consecutive: a view
    return lengths, col.data[_span_positions(start, lengths)]


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


class _Shard:
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


def _open_shard(path: str, info: ShardInfo, schema: Schema, arrow_schema: pa.Schema) -> _Shard:
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
    return _Shard(path, batch.num_rows, columns)


class _Store:
    """Manifest + lazily opened shards, shared by a dataset and its transformed views.

    ``path`` is a local directory (shards memory-mapped in place) or, with ``remote``, the
    dataset's URL: shards are then fetched whole into ``cache`` (a ``ShardCache``), mapped from
    there, prefetched in epoch order (:meth:`prefetch`), and at most ``max_open`` of them stay
    mapped (the least recently opened is dropped; the cache may then evict its file).
    """

    def __init__(
        self,
        path: Path | str,
        manifest: Manifest,
        remote: Remote | None = None,
        cache: ShardCache | None = None,
        prefetch_shards: int = 4,
    ):
        self.path = path
        self.manifest = manifest
        self.remote = remote
        self.cache = cache
        self.prefetch_shards = prefetch_shards
        self.schema = manifest.schema
        self.arrow_schema = manifest.schema.to_arrow()
        rows = np.fromiter((s.rows for s in manifest.shards), np.int64, len(manifest.shards))
        self.starts = np.zeros(len(rows), np.int64)  # first global row of each shard
        np.cumsum(rows[:-1], out=self.starts[1:])
        self.num_rows = int(rows.sum())
        # names were checked by parse_manifest; symbolic links are checked at first access
        self.shard_paths = [
            remote.url_of(s.file) if remote is not None else os.path.join(path, s.file)
            for s in manifest.shards
        ]
        self._init_runtime()

    def _init_runtime(self) -> None:
        self.shards: list[_Shard | None] = [None] * len(self.shard_paths)
        self.lock = threading.Lock()
        self.opened: list[int] = []  # remote: ids of mapped shards, oldest first
        self.prefetcher: Prefetcher | None = None
        self.pid = os.getpid()

    def __getstate__(self):
        state = self.__dict__.copy()
        # pickled Arrow schemas lose nested not-null flags: rebuild it from ours on load
        del state["shards"], state["lock"], state["arrow_schema"]
        del state["opened"], state["prefetcher"], state["pid"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.arrow_schema = self.schema.to_arrow()
        self._init_runtime()

    @property
    def max_open(self) -> int:
        return 2 * self.prefetch_shards + 16

    def shard(self, k: int) -> _Shard:
        s = self.shards[k]
        if s is None:
            with self.lock:
                s = self.shards[k]
                if s is None:
                    info = self.manifest.shards[k]
                    where = f"shard {k}: 'file'"
                    if self.remote is None:
                        path = member_path(self.path, info.file, where=where)
                        s = _open_shard(path, info, self.schema, self.arrow_schema)
                    else:
                        s = self._open_remote(k, info, where)
                    self.shards[k] = s
        return s

    def _after_fork(self) -> None:
        """In a forked worker: the parent's fsspec event loop and prefetch thread did not
        survive the fork; make a new file system (fsspec's instance cache is per process)."""
        if self.pid != os.getpid():
            self.pid = os.getpid()
            self.prefetcher = None
            self.remote = open_remote(self.remote.url, self.remote.storage_options)

    def _open_remote(self, k: int, info: ShardInfo, where: str) -> _Shard:
        self._after_fork()
        member_path(self.remote.url, info.file, where=where)  # a key below the prefix
        for attempt in range(3):
            local = self.cache.get(self.remote, info.file, info)
            try:
                s = _open_shard(str(local), info, self.schema, self.arrow_schema)
                break
            except FormatError as e:  # evicted by another process between fetch and map
                if attempt == 2 or os.path.exists(local):
                    raise FormatError(
                        f"shard {k} ({self.remote.url_of(info.file)}), cached as {local}: {e}",
                        path=self.remote.url_of(info.file),
                    ) from e
        if self.prefetcher is not None:
            self.prefetcher.used(k)
        self.opened.append(k)
        if len(self.opened) > self.max_open:  # drop the oldest mapping (arrays stay valid)
            self.shards[self.opened.pop(0)] = None
        return s

    def prefetch(self, indices) -> None:
        """Start fetching, in the background, the shards of ``indices`` (the epoch's sample
        order) in the order they are first needed. Local datasets: nothing to do."""
        if self.remote is None or self.prefetch_shards == 0 or self.num_rows == 0:
            return
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)  # (N,) sample indices
        if idx.size == 0:
            return
        idx = idx[(idx >= 0) & (idx < self.num_rows)]
        sid = np.searchsorted(self.starts, idx, side="right") - 1  # (N,) shard of each
        _, first = np.unique(sid, return_index=True)
        order = sid[np.sort(first)]  # shard ids by first use
        with self.lock:
            self._after_fork()
            if self.prefetcher is None:
                self.prefetcher = Prefetcher(self._prefetch_one, self.prefetch_shards)
            opened = [k for k, s in enumerate(self.shards) if s is not None]
        self.prefetcher.start(order.tolist(), used=opened)

    def _prefetch_one(self, k: int) -> Path:
        info = self.manifest.shards[k]
        member_path(self.remote.url, info.file, where=f"shard {k}: 'file'")
        return self.cache.get(self.remote, info.file, info)

    def close(self) -> None:
        with self.lock:
            self.shards = [None] * len(self.shard_paths)
            self.opened = []
            if self.prefetcher is not None:
                self.prefetcher.close()
                self.prefetcher = None


def _is_fused(t: object) -> bool:
    return hasattr(t, "apply_encoded")


def _decodes_batches(t: object) -> bool:
    """A fused transform that decodes a whole batch on a device (``apply_encoded_batch``)."""
    return hasattr(t, "apply_encoded_batch") and str(getattr(t, "decode_device", "cpu")) != "cpu"


_LOCATION_KW: dict[type, bool] = {}


def _takes_location(t: object) -> bool:
    """Whether ``t.apply_encoded`` accepts ``index=``/``source=`` (for error messages)."""
    key = type(t)
    ok = _LOCATION_KW.get(key)
    if ok is None:
        import inspect

        try:
            params = inspect.signature(t.apply_encoded).parameters
            ok = ("index" in params and "source" in params) or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
            )
        except (TypeError, ValueError):
            ok = False
        _LOCATION_KW[key] = ok
    return ok


class _BatchTransform:
    """Applies each fused image transform's ``batch_transform()`` to its field of a batch."""

    def __init__(self, fns: dict[str, Callable]):
        self.fns = fns

    def __call__(self, batch):
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"kuat_batch_transform expects the collated batch to be a dict with fields "
                f"{sorted(self.fns)}, got {type(batch).__name__} (a whole-sample transform "
                "changed the sample's structure; apply the batch step yourself)"
            )
        batch = dict(batch)
        for name, fn in self.fns.items():
            batch[name] = fn(batch[name])
        return batch

    def __repr__(self) -> str:
        return f"_BatchTransform({self.fns!r})"


class Dataset:
    """A kuat dataset opened for random access; map-style and torch-compatible.

    ``ds[i]`` returns ``{field: value}``:

    - image: ``(H, W, 3)`` uint8 RGB ``np.ndarray`` (decoded with
      ``kuat.vision.decode.decode_image``), or what the field's transform returns;
    - int/float/bool scalar: Python ``int``/``float``/``bool``;
    - tensor: ``np.ndarray`` of the declared ``shape`` and ``dtype``;
    - sequence: 1-D ``np.ndarray``; string: ``str``; bytes: ``bytes``.

    ``raw(i)`` returns the same without decoding (images as :class:`EncodedImage`),
    ``read_batch(indices)`` a column-wise batch with one gather per field, and
    ``__getitems__(indices)`` the list of sample dicts torch's ``DataLoader`` asks for.
    Indices behave like a Python sequence's (negative from the end, ``IndexError`` outside).

    Thread-safety: every read method may be called from many threads at once (shards are
    opened under a lock; mapped memory is read-only). Picklable (for process workers):
    the copy re-opens shards lazily.

    Raises:
        kuat.FormatError: on first access to a missing, truncated or corrupt shard, naming
            its path (opening checks only the manifest).
        kuat.DecodeError: an image cannot be decoded (names the sample index and shard).
    """

    # A batch depends only on its indices (and the loader's seed/epoch), never on which thread
    # fetches it: the loader may fetch cheap batches in the consumer thread (no hand-off).
    kuat_thread_agnostic = True

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        storage_options: Mapping | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_limit_bytes: int | None = None,
        prefetch_shards: int = 4,
        _store: _Store | None = None,
    ):
        if _store is None:
            _store = _open_store(
                path, storage_options, cache_dir, cache_limit_bytes, prefetch_shards
            )
        self._store = _store
        self._field_transforms: dict[str, Callable] = {}
        self._sample_transform: Callable | None = None

    # -- description -----------------------------------------------------------------------
    @property
    def path(self) -> Path | str:
        """The dataset directory (a ``Path``), or its URL (a ``str``) for a remote dataset."""
        return self._store.path

    @property
    def schema(self) -> Schema:
        return self._store.schema

    @property
    def manifest(self) -> Manifest:
        return self._store.manifest

    @property
    def metadata(self) -> dict:
        """The user metadata kept in the manifest (class names, source, ...)."""
        return self._store.manifest.metadata

    @property
    def num_shards(self) -> int:
        return len(self._store.shard_paths)

    @property
    def shard_paths(self) -> list[str]:
        return list(self._store.shard_paths)

    def __len__(self) -> int:
        return self._store.num_rows

    def __repr__(self) -> str:
        return (
            f"kuat.Dataset({str(self.path)!r}, rows={len(self)}, shards={self.num_shards}, "
            f"schema={self.schema})"
        )

    def locate(self, index: int) -> tuple[str, int]:
        """``(shard path, row within the shard)`` of sample ``index``."""
        i = self._index(index)
        k = int(np.searchsorted(self._store.starts, i, side="right")) - 1
        return self._store.shard_paths[k], i - int(self._store.starts[k])

    # -- indices ---------------------------------------------------------------------------
    def _index(self, index: object) -> int:
        if isinstance(index, slice):
            raise TypeError(
                "kuat.Dataset takes integer indices; use ds.__getitems__(range(...)) or "
                "ds.read_batch(...) for several rows"
            )
        i = operator.index(index)
        n = self._store.num_rows
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for a dataset of {n} rows")
        return i

    def _indices(self, indices: object) -> np.ndarray:
        """Non-negative ``(B,)`` int64 indices; raises IndexError/TypeError like a sequence."""
        arr = None
        if type(indices) is list:  # what batch samplers give: Python ints (floats refused)
            try:
                arr = np.frombuffer(array.array("q", indices), np.int64)  # (B,) read-only
            except (TypeError, OverflowError):
                arr = None
        if arr is None:
            if hasattr(indices, "detach"):  # torch.Tensor
                indices = indices.detach().cpu().numpy()
            arr = np.asarray(indices)
        if arr.ndim != 1:  # a nested list or a bare int: refused, as a list would
            raise TypeError(
                f"indices must be a 1-D sequence of ints, got {type(indices).__name__} of "
                f"shape {arr.shape}"
            )
        if arr.dtype == object or arr.dtype == np.uint64:
            arr = np.array([self._index(i) for i in arr], dtype=np.int64)
        if arr.size == 0:
            return np.zeros(0, np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"indices must be integers, got dtype {arr.dtype}")
        n = self._store.num_rows
        idx = arr if arr.dtype == np.int64 else arr.astype(np.int64)
        if idx.min() >= 0 and idx.max() < n:  # the usual case: two reductions, no copy
            return idx
        idx = idx.copy()
        idx[idx < 0] += n
        bad = (idx < 0) | (idx >= n)
        if bad.any():
            first = int(arr[np.argmax(bad)])
            raise IndexError(f"index {first} is out of range for a dataset of {n} rows")
        return idx

    # -- gather ----------------------------------------------------------------------------
    def _groups(self, idx: np.ndarray) -> tuple[np.ndarray, list]:
        """Shard id per index ``(B,)`` and ``[(shard, positions or None, local rows)]``.

        ``positions`` (a list of batch positions) is ``None`` when every row is in one shard,
        and ``local rows`` (rows within the shard) is then the ``(B,)`` int64 array, else a
        list of ints.
        """
        store = self._store
        if len(store.starts) == 1:  # one shard: no search
            return np.zeros(len(idx), np.int64), [(store.shard(0), None, idx)]
        sid = np.searchsorted(store.starts, idx, side="right") - 1  # (B,)
        local = idx - store.starts[sid]  # (B,) row within its shard
        if len(idx) and (sid == sid[0]).all():
            return sid, [(store.shard(int(sid[0])), None, local)]
        by_shard: dict[int, list[int]] = {}
        for j, k in enumerate(sid.tolist()):  # cheaper than argsort + unique for B ~ 10^2
            pos = by_shard.get(k)
            if pos is None:
                by_shard[k] = [j]
            else:
                pos.append(j)
        rows = local.tolist()  # Python ints: indexing with them is cheaper than tiny arrays
        return sid, [(store.shard(k), pos, [rows[j] for j in pos]) for k, pos in by_shard.items()]

    def _gather(self, idx: np.ndarray, fields: Sequence[str]) -> tuple[np.ndarray, dict]:
        """Shard id per row ``(B,)`` and column-wise values of rows ``idx`` (see
        :meth:`read_batch`)."""
        sid, groups = self._groups(idx)
        b = len(idx)
        out = {}
        for name in fields:
            ftype = self.schema[name].type
            kind = ftype.kind
            if kind in ("scalar", "bool", "tensor"):
                dt = ftype.np_dtype if kind != "bool" else np.dtype(bool)
                res = np.empty((b, *(ftype.shape or ())), dt)  # (B, *shape)
                for shard, pos, rows in groups:
                    col = shard.columns[name].values
                    if pos is None:
                        # one copy straight into res; indices are already checked, and
                        # mode="clip" avoids numpy's buffered (extra-copy) out= path
                        np.take(col, rows, axis=0, out=res, mode="clip")
                    elif len(pos) <= 8:  # few rows in this shard: per-row copies are cheaper
                        for p, r in zip(pos, rows):
                            res[p] = col[r]
                    else:
                        res[pos] = np.take(col, rows, axis=0, mode="clip")
                out[name] = res
            elif kind == "image":
                data, codec = [None] * b, [None] * b
                width, height = np.empty(b, np.int32), np.empty(b, np.int32)
                for shard, pos, rows in groups:
                    col = shard.columns[name]
                    p = range(b) if pos is None else pos
                    starts, ends = col.bytes.spans(rows)
                    mv = col.bytes.mv
                    cs, ce = col.codec.spans(rows)
                    cdata = col.codec.data
                    for j, s, e, s2, e2 in zip(p, starts, ends, cs, ce):
                        data[j] = mv[s:e]
                        codec[j] = cdata[s2:e2].tobytes().decode()
                    if pos is None:
                        np.take(col.width, rows, out=width, mode="clip")
                        np.take(col.height, rows, out=height, mode="clip")
                    else:
                        width[pos] = np.take(col.width, rows, mode="clip")
                        height[pos] = np.take(col.height, rows, mode="clip")
                out[name] = ImageBatch(data, width, height, codec)
            elif kind == "strings":
                res = [None] * b
                for shard, pos, rows in groups:
                    p = range(b) if pos is None else pos
                    for j, v in zip(p, shard.columns[name].rows(rows)):
                        res[j] = v
                out[name] = res
            else:
                res = [None] * b
                for shard, pos, rows in groups:
                    col = shard.columns[name]
                    p = range(b) if pos is None else pos
                    starts, ends = col.spans(rows)
                    if kind == "bytes":
                        mv = col.mv
                        for j, s, e in zip(p, starts, ends):
                            res[j] = mv[s:e]
                    elif kind == "string":
                        data = col.data
                        for j, s, e in zip(p, starts, ends):
                            res[j] = data[s:e].tobytes().decode()
                    else:
                        data = col.data
                        for j, s, e in zip(p, starts, ends):
                            res[j] = data[s:e]
                out[name] = res
        return sid, out

    def read_batch(self, indices: Sequence[int], fields: Sequence[str] | None = None) -> dict:
        """Column-wise read of rows ``indices`` with one gather per field and shard.

        Returns ``{field: column}`` for ``fields`` (default all), B = ``len(indices)``:

        - scalar / bool: ``(B,)`` array of the field's dtype;
        - tensor: ``(B, *shape)`` array (one copy of the selected rows);
        - image: :class:`ImageBatch` (zero-copy ``memoryview`` s, ``(B,)`` width/height);
        - bytes: B zero-copy ``memoryview`` s; string: B ``str``;
        - sequence: B read-only 1-D array views;
        - strings: B new ``list[str]``.

        No transform is applied and nothing is decoded. Memoryviews and views keep the shard
        mapped while referenced.
        """
        idx = self._indices(indices)
        if fields is None:
            fields = self.schema.names
        elif isinstance(fields, str):
            fields = [fields]
        for name in fields:
            if name not in self.schema:
                raise ValueError(f"no field {name!r} in {self.schema}")
        return self._gather(idx, fields)[1]

    def sequence_lengths(self, field: str) -> np.ndarray:
        """``(N,) int64``: the number of values of sequence ``field`` in every row, from the
        shards' offsets (no values read; maps every shard, so a remote dataset fetches them).

        Raises:
            ValueError: ``field`` is not a sequence field of the schema.
        """
        if field not in self.schema or self.schema[field].type.kind != "sequence":
            raise ValueError(f"{field!r} is not a sequence field of {self.schema}")
        store = self._store
        parts = [np.diff(store.shard(k).columns[field].offsets) for k in range(self.num_shards)]
        if not parts:
            return np.empty(0, np.int64)
        return np.concatenate(parts).astype(np.int64, copy=False)  # (N,) int32 -> int64

    def read_flat(self, indices: Sequence[int], field: str) -> tuple[np.ndarray, np.ndarray]:
        """Sequence ``field`` of rows ``indices``, end to end: ``(lengths (B,) int64, values
        (T,))`` in the field's dtype, ``T = lengths.sum()``, with one gather per shard (no
        per-row views; consecutive rows of one shard are one read-only view of it).

        Raises:
            ValueError: ``field`` is not a sequence field of the schema.
            IndexError: an index out of range.
        """
        if field not in self.schema or self.schema[field].type.kind != "sequence":
            raise ValueError(f"{field!r} is not a sequence field of {self.schema}")
        idx = self._indices(indices)
        _, groups = self._groups(idx)
        if len(groups) == 1:
            shard, _, rows = groups[0]
            return _flat_rows(shard.columns[field], np.asarray(rows, np.int64))
        lengths = np.empty(len(idx), np.int64)
        parts = []
        for shard, pos, rows in groups:
            n, values = _flat_rows(shard.columns[field], np.asarray(rows, np.int64))
            lengths[pos] = n
            parts.append((np.asarray(pos, np.int64), n, values))
        out = np.empty(int(lengths.sum()), self.schema[field].type.np_dtype)  # (T,)
        at = np.cumsum(lengths) - lengths  # (B,) where each row goes
        for pos, n, values in parts:
            out[_span_positions(at[pos], n)] = values
        return lengths, out

    # -- samples ---------------------------------------------------------------------------
    def raw(self, index: int) -> dict:
        """Sample ``index`` without decoding or transforms (images as :class:`EncodedImage`
        with ``bytes`` data)."""
        i = self._index(index)
        _, cols = self._gather(np.array([i], np.int64), self.schema.names)
        out = {}
        for f in self.schema:
            c = cols[f.name]
            kind = f.type.kind
            if kind == "image":
                out[f.name] = EncodedImage(
                    bytes(c.data[0]), int(c.width[0]), int(c.height[0]), c.codec[0]
                )
            elif kind in ("scalar", "bool"):
                out[f.name] = c[0].item()
            elif kind == "tensor":
                out[f.name] = c[0]
            elif kind == "bytes":
                out[f.name] = bytes(c[0])
            elif kind == "sequence":
                out[f.name] = np.array(c[0])
            else:
                out[f.name] = c[0]
        return out

    def __getitem__(self, index: int) -> dict:
        return self._samples(np.array([self._index(index)], np.int64), batch_buffer=False)[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        """The samples ``indices`` as a list of dicts (torch's batched-fetch contract).

        With a fused image transform of fixed output size ``(H, W)``, each sample's image is
        ``buf[j]``, a view of one ``(B, 3, H, W)`` uint8 tensor, so collation is free.
        """
        return self._samples(self._indices(indices), batch_buffer=True)

    def kuat_fetch_collated(self, indices: Sequence[int]):
        """``kuat.default_collate(self.__getitems__(indices))``, without per-sample objects.

        What the loader calls when its collate is the default one (``kuat.default_collate``
        or torch's): the columnar gather goes straight to batch tensors. Same structures,
        dtypes and values as collating the samples: ``{field: batch}`` with int scalars as
        ``(B,)`` int64, float scalars ``(B,)`` float64, bools ``(B,)`` bool (as torch collates
        Python numbers), tensors ``(B, *shape)`` of their dtype (the gather's own copy, no
        second one), strings a list of B ``str``; images, bytes, sequences and fields with a
        transform are built per sample and collated per field. With a whole-sample transform
        the samples are built and collated as they would be. Thread-safe (as ``__getitems__``).
        """
        from kuat.collate import default_collate

        idx = self._indices(indices)
        if self._sample_transform is not None or len(idx) == 0:
            return default_collate(self._samples(idx, batch_buffer=True))
        sid, cols = self._gather(idx, self.schema.names)
        import torch

        ft = self._field_transforms
        out = {}
        index_list = None
        for f in self.schema:
            c, kind, t = cols[f.name], f.type.kind, ft.get(f.name)
            if t is None and kind == "tensor":
                out[f.name] = torch.from_numpy(c)  # (B, *shape): the gather's fresh copy
            elif t is None and kind in ("scalar", "bool") and c.dtype != np.uint64:
                # as torch.tensor(list of Python numbers): int64, float64 or bool, (B,)
                want = np.bool_ if kind == "bool" else np.float64 if c.dtype.kind == "f" else np.int64
                out[f.name] = torch.from_numpy(c.astype(want, copy=False))
            elif t is None and kind == "string":
                out[f.name] = c  # B str, as default_collate leaves strings
            else:
                if index_list is None:
                    index_list = idx.tolist()
                values = self._field_values(f, c, index_list, sid, True)
                out[f.name] = default_collate(values)
        return out

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def _samples(self, idx: np.ndarray, batch_buffer: bool) -> list[dict]:
        b = len(idx)
        if b == 0:
            return []
        sid, cols = self._gather(idx, self.schema.names)
        index_list = idx.tolist()
        per_field = [self._field_values(f, cols[f.name], index_list, sid, batch_buffer)
                     for f in self.schema]
        names = self.schema.names
        samples = [dict(zip(names, vals)) for vals in zip(*per_field)]
        st = self._sample_transform
        if st is not None:
            it = iter(samples)
            samples = map_samples(lambda _i: st(next(it)), index_list)
        return samples

    def _field_values(self, f, c, index_list: list, sid: np.ndarray, batch_buffer: bool) -> list:
        """The B per-sample values of field ``f`` from its gathered column ``c``."""
        kind, t = f.type.kind, self._field_transforms.get(f.name)
        if kind == "image":
            return self._images(c, index_list, sid, self._store.shard_paths, t, batch_buffer)
        if kind in ("scalar", "bool"):
            values = c.tolist()  # (B,) -> Python ints/floats/bools
        elif kind == "tensor":
            values = list(c)  # (B, *shape) -> B views of shape
        elif kind == "bytes":
            values = [bytes(v) for v in c]
        elif kind == "sequence":
            values = [np.array(v) for v in c]  # writable copies
        else:
            values = c
        if t is not None:
            it = iter(values)  # called in order: the j-th call gets the j-th value
            values = map_samples(lambda _i: t(next(it)), index_list)
        return values

    def _images(self, c: ImageBatch, index_list, sid, paths, t, batch_buffer: bool) -> list:
        sources = [paths[k] for k in sid.tolist()]
        if t is None:
            return [_decode(d, i, s) for d, i, s in zip(c.data, index_list, sources)]
        import torch

        widths, heights = c.width.tolist(), c.height.tolist()
        if _is_fused(t):
            if _decodes_batches(t):  # e.g. Compose(decode_device="cuda"): nvJPEG, one call
                rngs = [sample_rng(i).numpy for i in index_list]
                out = t.apply_encoded_batch(
                    c.data, widths, heights, rngs, indices=index_list, sources=sources
                )
                return list(out)  # (B, 3, H, W) on the device -> B views, or B tensors
            loc = _takes_location(t)
            size = t.output_size() if hasattr(t, "output_size") else None
            values = []
            if size is not None and batch_buffer:
                h, w = size
                from kuat.collate import new_batch_buffer

                buf = new_batch_buffer((len(index_list), 3, h, w), torch.uint8)  # (B, 3, H, W)
                for j, (d, wd, ht, i, s) in enumerate(
                    zip(c.data, widths, heights, index_list, sources)
                ):
                    kw = {"index": i, "source": s} if loc else {}
                    with sample_context(i):
                        t.apply_encoded(d, wd, ht, sample_rng(i).numpy, out=buf[j].numpy(), **kw)
                    values.append(buf[j])  # a view: collate returns buf without copying
                return values
            for d, wd, ht, i, s in zip(c.data, widths, heights, index_list, sources):
                kw = {"index": i, "source": s} if loc else {}
                with sample_context(i):
                    arr = t.apply_encoded(d, wd, ht, sample_rng(i).numpy, **kw)
                values.append(torch.from_numpy(np.ascontiguousarray(arr)))  # (3, H, W) uint8
            return values
        values = []
        for d, i, s in zip(c.data, index_list, sources):
            hwc = _decode(d, i, s)  # (H, W, 3) uint8
            if not hwc.flags.writeable:  # torch tensors must own writable memory
                hwc = hwc.copy()
            chw = torch.from_numpy(hwc).permute(2, 0, 1)  # -> (3, H, W) view
            with sample_context(i):
                values.append(t(chw))
        return values

    # -- transforms ------------------------------------------------------------------------
    def with_transform(self, transform: Mapping[str, Callable] | Callable | None) -> Dataset:
        """A view of this dataset that applies ``transform`` to each sample (shards shared).

        Args:
            transform: ``{field: callable}`` for per-field transforms; or one callable that
                gets each whole decoded sample dict and may return anything; or ``None``.
                It replaces this view's transform (it does not compose with it). For an
                image field:

                - an object with ``apply_encoded`` (``kuat.vision.protocol.FusedImageTransform``)
                  gets the encoded bytes, the stored width/height and the sample's generator
                  (``kuat.sample_rng(index).numpy``); with a fixed ``output_size()`` it writes
                  into one ``(B, 3, H, W)`` uint8 batch buffer;
                - any other callable gets a ``(3, H, W)`` uint8 ``torch.Tensor`` (so torchvision
                  v2 transforms work).

                ``kuat.sample_rng()`` works inside every user callable (the sample's index is set).

        Raises:
            ValueError: a key is not a field of the schema.
            TypeError: a transform is not callable / has no ``apply_encoded``.
        """
        view = Dataset(self.path, _store=self._store)
        if transform is None:
            return view
        if isinstance(transform, Mapping):
            for name, t in transform.items():
                if name not in self.schema:
                    raise ValueError(f"with_transform: no field {name!r} in {self.schema}")
                if not (callable(t) or _is_fused(t)):
                    raise TypeError(
                        f"with_transform: the transform of field {name!r} is not callable: {t!r}"
                    )
                if _is_fused(t) and self.schema[name].type.kind != "image":
                    raise TypeError(
                        f"with_transform: field {name!r} is {self.schema[name].type.describe()}; "
                        "fused image transforms apply to image fields only"
                    )
            view._field_transforms = dict(transform)
        elif callable(transform):
            view._sample_transform = transform
        else:
            raise TypeError(
                f"with_transform takes a dict of field -> callable or a callable, got {transform!r}"
            )
        return view

    def kuat_prefetch(self, indices) -> None:
        """Loader hook, called once per epoch (on the loader's copy) with this rank's sample
        indices in the order the epoch reads them (a sequence of ints): a remote dataset starts
        fetching their shards into its cache in that order, ``prefetch_shards`` ahead of use.
        A local dataset does nothing. Returns at once; safe from any thread."""
        self._store.prefetch(indices)

    @property
    def has_transform(self) -> bool:
        """Whether samples pass through a transform (:meth:`with_transform`); when not,
        :meth:`read_batch` returns exactly the values ``__getitems__`` would."""
        return bool(self._field_transforms) or self._sample_transform is not None

    @property
    def kuat_batch_transform(self) -> Callable | None:
        """Callable applying each fused image transform's ``batch_transform()`` to its field
        of the collated batch dict (the loader calls it after the device copy), or ``None``."""
        fns = {}
        for name, t in self._field_transforms.items():
            if _is_fused(t) and hasattr(t, "batch_transform"):
                fn = t.batch_transform()
                if fn is not None:
                    fns[name] = fn
        return _BatchTransform(fns) if fns else None

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Drop this dataset's shard mappings (shared with its transformed views). Idempotent;
        a later read maps the shards again. Arrays returned earlier stay valid."""
        self._store.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_store(path, storage_options, cache_dir, cache_limit_bytes, prefetch_shards) -> _Store:
    if not isinstance(prefetch_shards, int) or isinstance(prefetch_shards, bool) or prefetch_shards < 0:
        raise ValueError(f"prefetch_shards={prefetch_shards!r} must be a non-negative int")
    if is_url(path):
        remote = open_remote(path, storage_options)
        cache = ShardCache(cache_dir, cache_limit_bytes)
        return _Store(remote.url, read_manifest(remote.url, storage_options=storage_options),
                      remote, cache, prefetch_shards)  # fmt: skip
    if storage_options:
        raise ValueError(
            f"storage_options are for URLs (s3://, gs://, ...); {os.fspath(path)!r} is a local path"
        )
    p = Path(local_path(path))
    return _Store(p, read_manifest(p))


def open_dataset(
    path: str | os.PathLike,
    *,
    storage_options: Mapping | None = None,
    cache_dir: str | os.PathLike | None = None,
    cache_limit_bytes: int | None = None,
    prefetch_shards: int = 4,
) -> Dataset:
    """Open the kuat dataset at ``path`` (reads only the manifest; shards map lazily).

    Args:
        path: a local directory, a ``file://`` URL, or an fsspec URL (``s3://bucket/x.kuat``,
            ``gs://``, ``az://``, ``http(s)://``, ``memory://``).
        storage_options: fsspec options for a URL (``{"endpoint_url": ..., "key": ...,
            "secret": ...}`` for s3fs; see :mod:`kuat.format.fs`).
        cache_dir: where remote shards are cached (``KUAT_CACHE_DIR``, default
            ``~/.cache/kuat/shards``); shared safely by every loader and process.
        cache_limit_bytes: the cache's size limit in bytes (``KUAT_CACHE_LIMIT_BYTES``,
            default 50 GiB); least recently used shards are evicted beyond it.
        prefetch_shards: remote shards fetched ahead of use, in the epoch's order, when a
            ``kuat.DataLoader`` starts an epoch (0: none).

    Raises:
        kuat.FormatError: no manifest, not JSON, invalid or of an unknown version.
        kuat.format.fs.RemoteError: a remote manifest cannot be read after retries.
        ImportError: the URL scheme's fsspec backend is not installed (names the package).
        ValueError: ``storage_options`` given for a local path, or a bad cache setting.
    """
    return Dataset(
        path,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit_bytes=cache_limit_bytes,
        prefetch_shards=prefetch_shards,
    )
