"""Reading a kuat dataset's storage: the manifest, lazily mapped shards, columnar batch reads.

A :class:`Store` reads only ``manifest.json`` when opened; a shard is memory-mapped (or, for a
URL, fetched whole into the local cache, then mapped) the first time one of its rows is read,
so opening thousands of shards is instant. Reads are zero-copy views into the mapping until a
gather copies the selected rows once:

1. indices -> (shard, row) with one ``searchsorted`` over the manifest's cumulative row counts;
2. per field and per shard, one gather (:mod:`kuat.format.gather`): ``np.take`` on the
   fixed-size column views (a tensor field becomes one ``(B, *shape)`` copy), offset lookups
   on variable-length columns whose values are sliced as zero-copy ``memoryview`` s; their
   pages are requested from the kernel for all rows at once (``madvise(MADV_WILLNEED)``), so
   rows of a shard that is not in the page cache are read from disk concurrently, not one
   fault at a time.

Nothing here decodes an image or applies a transform: that is the kuat source's work
(:class:`kuat.sources.dataset.Dataset`, what ``kuat.open`` returns).
"""

from __future__ import annotations

import array
import operator
import os
import threading
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import numpy as np

from kuat.errors import FormatError
from kuat.format.cache import Prefetcher, ShardCache
from kuat.format.fs import Remote, is_url, local_path, open_remote
from kuat.format.gather import (
    ImageBatch,
    ImageRows,
    gather_column,
    gather_flat,
    native,
)
from kuat.format.manifest import Manifest, ShardInfo, read_manifest
from kuat.format.members import member_path
from kuat.format.schema import EncodedImage
from kuat.format.shard import Shard, open_shard

__all__ = ["ImageBatch", "Store", "open_store"]


def _table_entry(shard, name: str):
    """What the C gather reads of ``shard``'s column ``name``: a fixed-size field's values
    array, or an image field's ``(bytes view, offsets, width, height)``."""
    col = shard.columns[name]
    if hasattr(col, "values"):
        return col.values
    return (col.bytes.mv, col.bytes.offsets, col.width, col.height)


class Store:
    """Manifest + lazily opened shards: the storage under a kuat dataset and its transformed
    views (which share one store).

    ``path`` is a local directory (shards memory-mapped in place) or, with ``remote``, the
    dataset's URL: shards are then fetched whole into ``cache`` (a ``ShardCache``), mapped from
    there, prefetched in epoch order (:meth:`prefetch`), and at most ``max_open`` of them stay
    mapped (the least recently opened is dropped; the cache may then evict its file).

    Reads (:meth:`read_batch`, :meth:`gather`, :meth:`raw`, :meth:`locate`) take global row
    indices ``0 <= i < num_rows`` (negative ones count from the end, as a sequence's).

    Thread-safety: every method may be called from many threads at once (shards are opened
    under ``lock``; mapped memory is read-only). Picklable (for process workers): the copy
    re-opens shards lazily and, after a fork, makes its own remote file system.
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
        self.shards: list[Shard | None] = [None] * len(self.shard_paths)
        self.lock = threading.Lock()
        self.opened: list[int] = []  # remote: ids of mapped shards, oldest first
        # field -> per shard, what the C gather reads of its column (None while unmapped):
        # kept in step with `shards` under `lock` (_native_table)
        self._tables: dict[str, list] = {}
        self._plans: dict[tuple, list | None] = {}  # (fields, self_advised) -> _gather_plan's
        self.prefetcher: Prefetcher | None = None
        self.pid = os.getpid()

    def __getstate__(self):
        state = self.__dict__.copy()
        # pickled Arrow schemas lose nested not-null flags: rebuild it from ours on load
        del state["shards"], state["lock"], state["arrow_schema"]
        del state["opened"], state["prefetcher"], state["pid"], state["_tables"], state["_plans"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.arrow_schema = self.schema.to_arrow()
        self._init_runtime()

    @property
    def max_open(self) -> int:
        return 2 * self.prefetch_shards + 16

    def shard(self, k: int) -> Shard:
        """Shard ``k``, opened (mapped, or fetched then mapped) on first use."""
        s = self.shards[k]
        if s is None:
            with self.lock:
                s = self.shards[k]
                if s is None:
                    info = self.manifest.shards[k]
                    where = f"shard {k}: 'file'"
                    if self.remote is None:
                        path = member_path(self.path, info.file, where=where)
                        s = open_shard(path, info, self.schema, self.arrow_schema)
                    else:
                        s = self._open_remote(k, info, where)
                    self.shards[k] = s
                    for name, table in self._tables.items():
                        table[k] = _table_entry(s, name)
        return s

    def _after_fork(self) -> None:
        """In a forked worker: the parent's fsspec event loop and prefetch thread did not
        survive the fork; make a new file system (fsspec's instance cache is per process)."""
        if self.pid != os.getpid():
            self.pid = os.getpid()
            self.prefetcher = None
            self.remote = open_remote(self.remote.url, self.remote.storage_options)

    def _open_remote(self, k: int, info: ShardInfo, where: str) -> Shard:
        self._after_fork()
        member_path(self.remote.url, info.file, where=where)  # a key below the prefix
        for attempt in range(3):
            local = self.cache.get(self.remote, info.file, info)
            try:
                s = open_shard(str(local), info, self.schema, self.arrow_schema)
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
            old = self.opened.pop(0)
            self.shards[old] = None
            for table in self._tables.values():
                table[old] = None
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
        # shards already in the cache need no fetch thread (a warm epoch then starts none: the
        # threads and their bookkeeping cost a warm epoch ~10% against local disk); one evicted
        # before its use is fetched by the reader, as without prefetch
        infos, url_of = self.manifest.shards, self.remote.url_of
        order = [k for k in order.tolist()
                 if not self.cache.entry(url_of(infos[k].file), infos[k]).exists()]  # fmt: skip
        with self.lock:
            self._after_fork()
            if self.prefetcher is None:
                if not order:
                    return
                self.prefetcher = Prefetcher(self._prefetch_one, self.prefetch_shards)
            opened = [k for k, s in enumerate(self.shards) if s is not None]
        self.prefetcher.start(order, used=opened)

    def _prefetch_one(self, k: int) -> Path:
        info = self.manifest.shards[k]
        member_path(self.remote.url, info.file, where=f"shard {k}: 'file'")
        return self.cache.get(self.remote, info.file, info)

    def close(self) -> None:
        with self.lock:
            self.shards = [None] * len(self.shard_paths)
            self._tables = {}
            self.opened = []
            if self.prefetcher is not None:
                self.prefetcher.close()
                self.prefetcher = None

    def locate(self, index: int) -> tuple[str, int]:
        """``(shard path, row within the shard)`` of sample ``index``."""
        i = self.index(index)
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.shard_paths[k], i - int(self.starts[k])

    # -- indices ---------------------------------------------------------------------------
    def index(self, index: object) -> int:
        """``index`` as a non-negative row; raises TypeError (a slice, a non-integer) or
        IndexError (out of range) as a sequence would."""
        if isinstance(index, slice):
            raise TypeError(
                "kuat.Dataset takes integer indices; use ds.__getitems__(range(...)) or "
                "ds.read_batch(...) for several rows"
            )
        i = operator.index(index)
        n = self.num_rows
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for a dataset of {n} rows")
        return i

    def indices(self, indices: object) -> np.ndarray:
        """Non-negative ``(B,)`` int64 indices; raises IndexError/TypeError like a sequence."""
        arr = None
        if type(indices) is list:  # what batch samplers give: Python ints (floats refused)
            try:
                packed = array.array("q", indices)
            except (TypeError, OverflowError):
                packed = None
            # the usual case, once per batch with the GIL held: no NumPy call but the view
            # (array.array holds int64s; the builtins check the range without NumPy's
            # dispatch, which costs tens of us after a batch decode has evicted the caches)
            if packed and min(packed) >= 0 and max(packed) < self.num_rows:
                return np.frombuffer(packed, np.int64)  # (B,) read-only
            if packed is not None:
                arr = np.frombuffer(packed, np.int64)
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
            arr = np.array([self.index(i) for i in arr], dtype=np.int64)
        if arr.size == 0:
            return np.zeros(0, np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"indices must be integers, got dtype {arr.dtype}")
        n = self.num_rows
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
        if len(self.starts) == 1:  # one shard: no search
            return np.zeros(len(idx), np.int64), [(self.shard(0), None, idx)]
        sid = np.searchsorted(self.starts, idx, side="right") - 1  # (B,)
        local = idx - self.starts[sid]  # (B,) row within its shard
        if len(idx) and (sid == sid[0]).all():
            return sid, [(self.shard(int(sid[0])), None, local)]
        by_shard: dict[int, list[int]] = {}
        for j, k in enumerate(sid.tolist()):  # cheaper than argsort + unique for B ~ 10^2
            pos = by_shard.get(k)
            if pos is None:
                by_shard[k] = [j]
            else:
                pos.append(j)
        rows = local.tolist()  # Python ints: indexing with them is cheaper than tiny arrays
        return sid, [(self.shard(k), pos, [rows[j] for j in pos]) for k, pos in by_shard.items()]

    def gather(self, idx: np.ndarray, fields: Sequence[str],
               self_advised: Collection[str] = ()) -> tuple[np.ndarray, dict]:
        """Shard id per row ``(B,)`` int64 and column-wise values of rows ``idx`` (checked
        ``(B,)`` int64 from :meth:`indices`), as :meth:`read_batch` returns them.
        ``self_advised``: image fields whose reader asks the kernel for the rows' pages itself
        (``kuat.vision.Compose``'s batch decode, without the GIL): not advised here, and
        their ``ImageBatch.codec`` is ``None`` (that reader reads the bytes alone).

        With the C gather (:func:`kuat.format.gather.native`), fixed-size fields take one C
        call each for the whole batch, whatever the shards (no per-row or per-shard Python: a
        batch of an ImageNet-sized dataset spans about as many shards as rows), and a
        self-advised image field is an :class:`kuat.format.gather.ImageRows` (its rows, read
        by the batch decoder in C, or gathered in one C call when asked); the other fields go
        by shard groups."""
        c = native()
        plan = None if c is None else self._gather_plan(fields, self_advised)
        if plan is None:
            sid, groups = self._groups(idx)
            return sid, {name: gather_column(name, self.schema[name].type, groups, len(idx),
                                             advise=name not in self_advised) for name in fields}
        sid, local = self._rows(idx, c[2])
        out, groups = {}, None
        for name, how, ftype, dt in plan:
            col = None
            table = how and (self._tables.get(name) or self._native_table(name))  # (once made)
            if how == "fixed":  # (native_fixed, inlined: once per field and batch)
                col = np.empty((len(idx), *(ftype.shape or ())), dt)  # (B, *shape)
                if c[0](table, sid, local, col) >= 0:
                    col = None  # a shard of the batch not mapped yet
            elif how == "image":  # read by a batch decoder: its rows, sliced if it asks
                col = ImageRows(self, name, table, sid, local, idx)
            if col is None:  # not a C field, or a shard of the batch not mapped yet: by groups
                if groups is None:  # (which map the batch's shards and hold them)
                    groups = self._groups(idx)[1]
                col = gather_column(name, ftype, groups, len(idx), advise=name not in self_advised)
            out[name] = col
        return sid, out

    def _gather_plan(self, fields: Sequence[str], self_advised: Collection[str]) -> list | None:
        """``[(name, how, field type, dtype)]`` of :meth:`gather` with the C gather (``how``:
        :meth:`_native_kind`), or ``None`` when no field takes it; kept per ``(fields,
        self_advised)``, so that a batch reads no schema entry."""
        key = (tuple(fields), tuple(self_advised))
        plan = self._plans.get(key, False)
        if plan is False:
            plan = []
            for name in fields:
                ftype = self.schema[name].type
                dt = ftype.np_dtype if ftype.kind != "bool" else np.dtype(bool)
                plan.append((name, self._native_kind(name, self_advised), ftype, dt))
            if not any(how for _, how, _, _ in plan):
                plan = None
            self._plans[key] = plan  # (one dict store: atomic under the GIL)
        return plan

    def _native_kind(self, name: str, self_advised: Collection[str]) -> str | None:
        """How the C gather takes field ``name``: ``"fixed"``, ``"image"`` or ``None``."""
        kind = self.schema[name].type.kind
        if kind in ("scalar", "bool", "tensor"):
            return "fixed"
        return "image" if kind == "image" and name in self_advised else None

    def _rows(self, idx: np.ndarray, locate_rows) -> tuple[np.ndarray, np.ndarray]:
        """``(sid, local)``: each row's shard and row within it, ``(B,)`` int64 each (located
        by the C ``locate_rows``: one call where NumPy takes four)."""
        if len(self.starts) == 1:
            return np.zeros(len(idx), np.int64), idx
        sid, local = np.empty(len(idx), np.int64), np.empty(len(idx), np.int64)
        locate_rows(self.starts, idx, sid, local)
        return sid, local

    def _native_table(self, name: str) -> list:
        """Per shard, what the C gather reads of field ``name``'s column (``None`` while the
        shard is not mapped; :meth:`shard` fills the entry as it maps it)."""
        table = self._tables.get(name)
        if table is None:
            with self.lock:
                table = self._tables.get(name)
                if table is None:
                    table = [None if s is None else _table_entry(s, name) for s in self.shards]
                    self._tables[name] = table
        return table

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
        idx = self.indices(indices)
        if fields is None:
            fields = self.schema.names
        elif isinstance(fields, str):
            fields = [fields]
        for name in fields:
            if name not in self.schema:
                raise ValueError(f"no field {name!r} in {self.schema}")
        return self.gather(idx, fields)[1]

    def sequence_lengths(self, field: str) -> np.ndarray:
        """``(N,) int64``: the number of values of sequence ``field`` in every row, from the
        shards' offsets (no values read; maps every shard, so a remote dataset fetches them).

        Raises:
            ValueError: ``field`` is not a sequence field of the schema.
        """
        self._check_sequence(field)
        parts = [np.diff(self.shard(k).columns[field].offsets) for k in range(len(self.starts))]
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
        self._check_sequence(field)
        idx = self.indices(indices)
        _, groups = self._groups(idx)
        return gather_flat(field, self.schema[field].type.np_dtype, groups, len(idx))

    def _check_sequence(self, field: str) -> None:
        if field not in self.schema or self.schema[field].type.kind != "sequence":
            raise ValueError(f"{field!r} is not a sequence field of {self.schema}")

    def raw(self, index: int) -> dict:
        """Sample ``index`` without decoding or transforms (images as :class:`EncodedImage`
        with ``bytes`` data)."""
        i = self.index(index)
        _, cols = self.gather(np.array([i], np.int64), self.schema.names)
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


def open_store(
    path: str | os.PathLike,
    *,
    storage_options: Mapping | None = None,
    cache_dir: str | os.PathLike | None = None,
    cache_limit_bytes: int | None = None,
    prefetch_shards: int = 4,
) -> Store:
    """The :class:`Store` of the kuat dataset at ``path`` (reads only the manifest).

    The arguments are ``kuat.open``'s (:func:`kuat.sources.dataset.open_dataset` documents
    them and what is raised).
    """
    if not isinstance(prefetch_shards, int) or isinstance(prefetch_shards, bool) or prefetch_shards < 0:
        raise ValueError(f"prefetch_shards={prefetch_shards!r} must be a non-negative int")
    if is_url(path):
        remote = open_remote(path, storage_options)
        cache = ShardCache(cache_dir, cache_limit_bytes)
        return Store(remote.url, read_manifest(remote.url, storage_options=storage_options),
                      remote, cache, prefetch_shards)  # fmt: skip
    if storage_options:
        raise ValueError(
            f"storage_options are for URLs (s3://, gs://, ...); {os.fspath(path)!r} is a local path"
        )
    p = Path(local_path(path))
    return Store(p, read_manifest(p))
