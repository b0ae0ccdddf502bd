"""A bounded local cache of remote shards, shared by every loader and process on a machine.

A remote shard is fetched whole (in parallel byte ranges when it is large), its size and
checksum are checked against the manifest, and only then is it renamed into the cache, so a
cache entry is always a complete, verified shard and can be memory-mapped like a local one.

Layout of ``cache_dir`` (default :func:`default_cache_dir`: ``$KUAT_CACHE_DIR``, else
``$KUAT_CACHE/shards``, else ``$XDG_CACHE_HOME/kuat/shards``, else ``~/.cache/kuat/shards``)::

    <key>.arrow             a verified shard; key = xxh3(shard URL) + its checksum, so a
                            shard rewritten at the same URL is a new entry
    .<key>.lock             locked (lockf) while one process downloads <key>; others wait
    .<key>.tmp-<pid>-<tid>  a download in progress (never read; removed by whoever finds its
                            process gone)
    .evict.lock             locked while evicting

Size: at most ``limit_bytes`` (default 50 GiB, ``KUAT_CACHE_LIMIT_BYTES``) of entries; when a new
entry pushes the total over, least recently used entries (by modification time, refreshed on
every hit) are deleted until it fits, never the entry just added. Deleting a shard another
process has mapped is safe on POSIX (the mapping keeps the data). The limit must hold at least
the shards in use at once (workers x shards per batch + prefetch depth).

Thread- and process-safety: every method may be called from many threads and processes at
once; one download per entry happens at a time (a lock file), the others wait and reuse it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from kuat._dirs import shard_cache_dir
from kuat.errors import FormatError
from kuat.format.fs import Remote, retry
from kuat.format.manifest import ShardInfo, file_checksum

__all__ = ["ShardCache", "default_cache_dir", "default_cache_limit"]

log = logging.getLogger("kuat.format.cache")

DEFAULT_LIMIT_BYTES = 50 << 30
# Shards larger than this are fetched as parallel byte ranges of this size (S3's own
# multipart guidance: 8-16 MiB parts saturate a link with a few connections).
CHUNK_BYTES = 16 << 20
CHUNK_THREADS = 8


def default_cache_dir() -> Path:
    """Where remote shards are cached by default: ``$KUAT_CACHE_DIR`` (the shard directory
    itself), else ``shards`` under kuat's cache root (``$KUAT_CACHE``, else
    ``$XDG_CACHE_HOME/kuat``, else ``~/.cache/kuat``; see :mod:`kuat._dirs`)."""
    return shard_cache_dir()


def default_cache_limit() -> int:
    """``KUAT_CACHE_LIMIT_BYTES`` (an int), else 50 GiB."""
    env = os.environ.get("KUAT_CACHE_LIMIT_BYTES")
    if env is None:
        return DEFAULT_LIMIT_BYTES
    try:
        value = int(env)
    except ValueError:
        raise ValueError(f"KUAT_CACHE_LIMIT_BYTES={env!r} must be an integer") from None
    if value <= 0:
        raise ValueError(f"KUAT_CACHE_LIMIT_BYTES={env!r} must be positive")
    return value


# Locks between processes are POSIX record locks (lockf): they belong to the process, so a
# forked worker does not inherit a lock its parent's thread holds (flock's would be inherited
# through the descriptor and never released in the child). They do not exclude threads of one
# process, so each path also has a threading lock; both tables are reset in a forked child,
# where threads that held them do not exist.
_thread_locks: dict[str, threading.Lock] = {}
_table_lock = threading.Lock()


def _reset_locks_after_fork() -> None:
    global _table_lock
    _table_lock = threading.Lock()
    _thread_locks.clear()


os.register_at_fork(after_in_child=_reset_locks_after_fork)


@contextlib.contextmanager
def _lock_file(path: Path):
    """Exclusive lock on ``path`` (created) against other threads and other processes."""
    with _table_lock:
        tlock = _thread_locks.setdefault(str(path), threading.Lock())
    with tlock:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShardCache:
    """Fetches remote shards into ``cache_dir`` and returns local paths to memory-map.

    Args:
        cache_dir: the cache directory (created); ``None``: :func:`default_cache_dir`.
        limit_bytes: the most bytes of shards kept; ``None``: :func:`default_cache_limit`.

    Raises:
        ValueError: ``limit_bytes`` is not a positive int.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None, limit_bytes: int | None = None):
        if limit_bytes is None:
            limit_bytes = default_cache_limit()
        if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool) or limit_bytes <= 0:
            raise ValueError(f"cache_limit_bytes={limit_bytes!r} must be a positive int")
        self.dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.limit_bytes = limit_bytes

    def __repr__(self) -> str:
        return f"ShardCache({str(self.dir)!r}, limit_bytes={self.limit_bytes})"

    def entry(self, url: str, info: ShardInfo) -> Path:
        """The cache path a shard at ``url`` with ``info.checksum`` has (present or not)."""
        key = f"{xxhash.xxh3_64_hexdigest(url.encode())}-{info.checksum.split(':')[-1]}"
        return self.dir / f"{key}.arrow"

    def get(self, remote: Remote, name: str, info: ShardInfo) -> Path:
        """The local path of shard ``name`` of the dataset at ``remote``, fetched if absent.

        Raises:
            kuat.FormatError: the fetched shard's size or checksum differs from the manifest
                (names the URL; nothing is kept).
            RemoteError: the download failed after retries (names the shard and URL).
            FileNotFoundError: the shard does not exist (names the URL).
            OSError: the cache directory cannot be created or written (its subclass by errno:
                ``PermissionError``, ``NotADirectoryError``...; names the cache, the shard and
                the URL, chained).
        """
        url = remote.url_of(name)
        final = self.entry(url, info)
        lock = final.with_name(f".{final.stem}.lock")
        try:
            if self._touch(final):
                return final
            self.dir.mkdir(parents=True, exist_ok=True)
            os.close(os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))  # writable?
        except OSError as e:  # os.utime names no path: say which cache, shard and setting
            raise OSError(
                e.errno,
                f"the shard cache {self.dir} cannot hold shard {name} of {url}: {e.strerror} "
                "(cache_dir= of kuat.open, else $KUAT_CACHE_DIR, else $KUAT_CACHE/shards, "
                "names the directory)",
                e.filename if e.filename is not None else str(final),
            ) from e
        with _lock_file(lock):
            if self._touch(final):  # another thread or process fetched it meanwhile
                return final
            tmp = final.with_name(f".{final.stem}.tmp-{os.getpid()}-{threading.get_ident()}")
            try:
                self._download(remote, name, info, tmp)
                os.replace(tmp, final)  # atomic: the entry appears complete or not at all
            finally:
                tmp.unlink(missing_ok=True)
        log.debug("cached %s (%d bytes) as %s", url, info.bytes, final)
        self._evict(keep=final)
        return final

    def _touch(self, path: Path) -> bool:
        try:
            os.utime(path)  # LRU: a hit makes the entry the most recently used
            return True
        except FileNotFoundError:
            return False

    def _download(self, remote: Remote, name: str, info: ShardInfo, tmp: Path) -> None:
        url, fspath, size = remote.url_of(name), remote.path_of(name), info.bytes
        fs = remote.fs

        def what(detail: str = "") -> str:
            return f"fetching shard {name}{detail} from"

        try:
            with open(tmp, "wb") as f:
                if size <= CHUNK_BYTES:
                    # the size is known: a ranged GET is one request, where a plain cat_file
                    # costs s3fs a HEAD first (to decide on chunking), a second round trip
                    rng = {"start": 0, "end": size} if size else {}
                    data = retry(lambda: fs.cat_file(fspath, **rng), what=what(), url=url)
                    f.write(data)
                else:  # parallel ranges, each written at its offset
                    f.truncate(size)
                    fd = f.fileno()

                    def part(start: int) -> None:
                        end = min(size, start + CHUNK_BYTES)
                        data = retry(
                            lambda: fs.cat_file(fspath, start=start, end=end),
                            what=what(f" bytes {start}-{end}"),
                            url=url,
                        )
                        if len(data) != end - start:
                            raise FormatError(
                                f"shard {url}: range {start}-{end} returned {len(data)} bytes "
                                f"(the manifest records {size} bytes; the object changed or is "
                                "truncated)",
                                path=url,
                            )
                        os.pwrite(fd, data, start)

                    with ThreadPoolExecutor(CHUNK_THREADS, thread_name_prefix="kuat-fetch") as ex:
                        list(ex.map(part, range(0, size, CHUNK_BYTES)))
                f.flush()
                os.fsync(f.fileno())
        except FileNotFoundError as e:
            raise FileNotFoundError(f"shard {name} is missing: {url} not found") from e
        got = os.path.getsize(tmp)
        if got != size:
            raise FormatError(
                f"shard {url} is {got} bytes but the manifest records {size} (truncated or "
                "changed; run `kuat verify`)",
                path=url,
            )
        checksum = file_checksum(tmp)
        if checksum != info.checksum:
            raise FormatError(
                f"shard {url} checksum mismatch: {checksum}, manifest records {info.checksum} "
                "(the object was modified or corrupted in transit)",
                path=url,
            )

    def _evict(self, keep: Path) -> None:
        """Delete least recently used entries until the cache fits ``limit_bytes``; remove
        temporary files of downloads whose process is gone."""
        with _lock_file(self.dir / ".evict.lock"):
            entries = []
            for e in os.scandir(self.dir):
                name = e.name
                if name.startswith(".") and ".tmp-" in name:
                    try:
                        pid = int(name.rsplit(".tmp-", 1)[1].split("-")[0])
                    except ValueError:
                        continue
                    if not _alive(pid):  # a killed download: its bytes are no entry
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(e.path)
                    continue
                if not name.endswith(".arrow") or name.startswith("."):
                    continue
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime_ns, st.st_size, e.path))
            total = sum(size for _, size, _ in entries)
            for _, size, path in sorted(entries):
                if total <= self.limit_bytes:
                    break
                if path == str(keep):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    lock = Path(path).with_name(f".{Path(path).stem}.lock")
                    lock.unlink(missing_ok=True)
                    log.debug("evicted %s (%d bytes) from the shard cache", path, size)
                total -= size


class _AttribWatch:
    """Calls ``on_change()`` whenever files in ``directory`` have their attributes changed
    (Linux inotify ``IN_ATTRIB``: an ``os.utime``, which is how a reader in another process
    marks a cache entry used), once per burst of events. One daemon thread blocked in
    ``select``; :meth:`close` ends it.

    Raises:
        OSError: inotify is not available (not Linux, or out of watches or instances).
    """

    _IN_ATTRIB = 0x00000004
    _CLOSE_CHECK_S = 1.0  # the thread notices close() at least this often

    def __init__(self, directory: Path, on_change):
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if not hasattr(libc, "inotify_init1"):
            raise OSError("inotify is not available on this platform")
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        if libc.inotify_add_watch(fd, os.fsencode(directory), self._IN_ATTRIB) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"inotify_add_watch({directory}) failed")
        self._fd, self._on_change, self._closed = fd, on_change, False
        threading.Thread(target=self._run, name="kuat-prefetch-watch", daemon=True).start()

    def _run(self) -> None:
        import select

        try:
            while not self._closed:
                ready, _, _ = select.select([self._fd], [], [], self._CLOSE_CHECK_S)
                if ready:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._fd, 4096):  # drain: one wake-up per burst
                            pass
                    self._on_change()
        finally:
            os.close(self._fd)

    def close(self) -> None:
        self._closed = True


class Prefetcher:
    """Fetches shards into a :class:`ShardCache` ahead of use, in the order an epoch needs them.

    :meth:`start` is given the shard ids in order of first use (from the sampler's order for
    the epoch); up to ``depth`` background threads fetch them concurrently, at most ``depth``
    shards ahead of use (fetched but unused, or in flight). Concurrent fetches are what hide
    a store's per-request latency: one fetch at a time pays the round trip once per shard
    (50 ms x 32 shards is 1.6 s of an epoch that may take 1 s to read), ``depth`` at once pay
    it once per ``depth`` shards. The depth bounds the cache space prefetch takes:
    ``depth * shard_bytes``.

    A shard counts as used when :meth:`used` is called for it (a reader in this process opened
    it) or when its cache entry was touched after the fetch (a reader in another process, a
    process worker, hit it). Both wake the fetch threads at once: the first is a call, the
    second an inotify ``IN_ATTRIB`` event on the cache directory (Linux). Where inotify is
    unavailable a full window re-checks its entries every 50 ms instead, which may start each
    fetch up to that much later than the use that made room for it.

    Args:
        fetch: ``fetch(k) -> Path``, fetches shard ``k`` into the cache (``ShardCache.get``);
            called from several threads at once.
        depth: shards fetched ahead of the first unused one (>= 1), and fetches in flight.

    Thread-safety: all methods may be called from any thread. A fetch error is logged and left
    for the reader, which fetches the shard itself and raises with the shard and URL.
    """

    _POLL_S = 0.05  # how often a full window re-checks other processes' use of its entries

    def __init__(self, fetch, depth: int):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"prefetch depth={depth!r} must be a positive int")
        self._fetch = fetch
        self.depth = depth
        self._cond = threading.Condition()
        self._order: list[int] = []
        self._pos = 0  # next position of _order to fetch
        self._generation = 0
        self._used: set[int] = set()
        self._local_use = False  # a used() this epoch: readers notify, no need to look
        self._pending: list[tuple[int, Path, int]] = []  # fetched, not yet seen used
        self._inflight = 0
        self._threads: list[threading.Thread] = []
        self._watch: _AttribWatch | None = None  # while a full window waits on another process
        self._watch_failed = False
        self._closed = False

    def start(self, order, used=()) -> None:
        """Prefetch shards ``order`` (ids, in order of first use), replacing an earlier
        order (a new epoch); shards in ``used`` are already open and are skipped."""
        with self._cond:
            if self._closed:
                return
            self._order = [int(k) for k in order]
            self._pos = 0
            self._generation += 1
            self._used = {int(k) for k in used}
            self._local_use = False
            self._pending = []
            self._threads = [t for t in self._threads if t.is_alive()]
            for i in range(len(self._threads), min(self.depth, len(self._order))):
                t = threading.Thread(target=self._run, name=f"kuat-prefetch-{i}", daemon=True)
                t.start()
                self._threads.append(t)
            self._cond.notify_all()

    def used(self, k: int) -> None:
        """Shard ``k`` was opened by a reader (frees a place in the window)."""
        with self._cond:
            self._used.add(k)
            self._local_use = True
            if self._watch is not None:  # readers are here: no need to watch the directory
                self._watch.close()
                self._watch = None
            self._cond.notify()  # one fetch thread; it wakes the next if there is more room

    def _entries_touched(self) -> None:
        """inotify: a cache entry's attributes changed; a reader in another process may have
        used one of ours (readers in this process call :meth:`used` instead)."""
        with self._cond:
            if self._pending and not self._local_use:
                self._cond.notify()

    def close(self) -> None:
        """Stop prefetching (downloads in progress finish). Idempotent."""
        with self._cond:
            self._closed = True
            if self._watch is not None:
                self._watch.close()
            self._cond.notify_all()

    def _watch_entries(self, directory: Path) -> None:
        """Under the lock: watch the cache directory for other processes' use, from when a
        full window waits on it until a reader in this process shows up (:meth:`used`)."""
        if self._watch is None and not self._watch_failed:
            try:
                self._watch = _AttribWatch(directory, self._entries_touched)
            except OSError as e:
                self._watch_failed = True
                log.debug("no inotify on %s (%s): prefetch polls for other processes' use",
                          directory, e)  # fmt: skip

    def _next(self) -> tuple[int, int] | None:
        """Under the lock: wait for a place in the window; ``(shard id, generation)`` to fetch,
        or ``None`` when closed."""
        while True:
            if self._closed:
                return None
            self._pending = [p for p in self._pending if not self._was_used(*p)]
            while self._pos < len(self._order) and self._order[self._pos] in self._used:
                self._pos += 1
            if self._pos < len(self._order) and len(self._pending) + self._inflight < self.depth:
                k = self._order[self._pos]
                self._pos += 1
                self._inflight += 1
                if len(self._pending) + self._inflight < self.depth:
                    self._cond.notify()  # more room: wake one more thread (not all: a herd)
                return k, self._generation
            # another process's use is seen by inotify, else only by looking again
            if self._pending and not self._local_use:
                self._watch_entries(self._pending[0][1].parent)
            poll = self._pending and not self._local_use and self._watch is None
            self._cond.wait(self._POLL_S if poll else None)

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._next()
            if job is None:
                return
            k, generation = job
            path = None
            try:
                path = self._fetch(k)
                mtime = os.stat(path).st_mtime_ns
            except FileNotFoundError:  # evicted already: nothing pending
                path = None
            except Exception as e:  # the reader fetches again and raises with context
                log.warning("prefetching shard %d failed: %s", k, e)
                path = None
            with self._cond:
                self._inflight -= 1
                if path is not None and generation == self._generation and k not in self._used:
                    self._pending.append((k, path, mtime))
                self._cond.notify()

    def _was_used(self, k: int, path: Path, mtime_ns: int) -> bool:
        if k in self._used:
            return True
        if self._local_use:  # readers here call used(): no stat (a syscall, a GIL hand-off)
            return False
        try:
            return os.stat(path).st_mtime_ns != mtime_ns
        except FileNotFoundError:  # evicted
            return True
