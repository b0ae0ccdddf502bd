"""A bounded local cache of remote shards, shared by every loader and process on a machine.

A remote shard is fetched whole (in parallel byte ranges when it is large; a server that ignores
``Range`` and sends the whole object is accepted), its size and checksum are checked against
the manifest, and only then is it renamed into the cache, so a cache entry starts as a
complete, verified shard and can be memory-mapped like a local one.

An entry can be damaged later (a disk filling up, a copied or edited cache directory, a tool
writing into it). So every open checks the entry's size (one ``stat``), and its content
checksum is checked again whenever the entry's file changed since it was verified: the
verification stamp records the entry's ``(inode, size, mtime_ns, ctime_ns)``, and any write to
the file changes them (``ctime`` cannot be set back). Uses are marked on a separate file, so
reusing an entry across processes and runs costs a ``stat``, a 40-byte read and a ``utime``
per shard opened (35-60 us, against 7-10 us for the ``utime`` alone; a loaded 2-core machine);
the checksum (xxh3, ~1 GiB/s on one loaded core, so ~60 ms for a 64 MiB shard) is paid only
after a change, and by an entry cached by an older kuat. A damaged entry is fetched again, with
a warning naming the shard, its URL and what was wrong. Bytes that rot on the disk without any
write are not seen (the file's times do not change): ``kuat verify`` reads every byte.

Layout of ``cache_dir`` (default :func:`default_cache_dir`: ``$KUAT_CACHE_DIR``, else
``$KUAT_CACHE/shards``, else ``$XDG_CACHE_HOME/kuat/shards``, else ``~/.cache/kuat/shards``)::

    <key>.arrow             a verified shard; key = xxh3(shard URL) + its checksum, so a
                            shard rewritten at the same URL is a new entry
    .<key>.ok               its verification stamp; its mtime is the entry's last use
                            (:func:`kuat.format.prefetch.use_mark`)
    .<key>.lock             locked (lockf) while one process downloads <key>; others wait
    .<key>.tmp-<pid>-<tid>  a download in progress (never read; removed by whoever finds its
                            process gone)
    .evict.lock             locked while evicting

Size: at most ``limit_bytes`` (default 50 GiB, ``KUAT_CACHE_LIMIT_BYTES``) of entries; when a new
entry pushes the total over, least recently used entries (by their use mark's modification
time, refreshed on every hit) are deleted until it fits, never the entry just added. Deleting a shard another
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
from kuat.format.prefetch import Prefetcher, use_mark

# Prefetcher is re-exported: kuat.format.store imports it from here

__all__ = ["Prefetcher", "ShardCache", "default_cache_dir", "default_cache_limit"]

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
            if self._hit(final, info):
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
            if self._hit(final, info) or self._reverify(final, name, url, info):
                return final  # another thread or process fetched (or verified) it meanwhile
            tmp = final.with_name(f".{final.stem}.tmp-{os.getpid()}-{threading.get_ident()}")
            try:
                self._download(remote, name, info, tmp)
                os.replace(tmp, final)  # atomic: the entry appears complete or not at all
                _write_stamp(final)
            finally:
                tmp.unlink(missing_ok=True)
        log.debug("cached %s (%d bytes) as %s", url, info.bytes, final)
        self._evict(keep=final)
        return final

    def _hit(self, entry: Path, info: ShardInfo) -> bool:
        """The entry is present, of the manifest's size and unchanged since it was verified:
        mark the use (LRU, and the prefetcher's signal) and say so."""
        try:
            st = os.stat(entry)
            if st.st_size != info.bytes or _read_stamp(entry) != _stamp_of(st):
                return False
            os.utime(use_mark(entry))  # LRU: a hit makes the entry the most recently used
            return True
        except FileNotFoundError:
            return False

    def _reverify(self, entry: Path, name: str, url: str, info: ShardInfo) -> bool:
        """Under the entry's lock, an entry that failed :meth:`_hit`: verify its bytes against
        the manifest and stamp it (``True``), or remove it, warning, to be fetched again."""
        try:
            got = os.path.getsize(entry)
        except FileNotFoundError:
            return False
        if got != info.bytes:
            problem = f"it is {got} bytes, the manifest records {info.bytes}"
        else:
            checksum = file_checksum(entry)
            if checksum == info.checksum:
                _write_stamp(entry)
                os.utime(use_mark(entry))
                return True
            problem = f"its checksum is {checksum}, the manifest records {info.checksum}"
        log.warning("kuat: the cached copy of shard %s (%s) at %s is damaged (%s): fetching it "
                    "again", name, url, entry, problem)  # fmt: skip
        entry.unlink(missing_ok=True)
        use_mark(entry).unlink(missing_ok=True)
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
                    whole = threading.Event()  # a server ignored Range and sent every byte

                    def part(start: int) -> None:
                        if whole.is_set():
                            return
                        end = min(size, start + CHUNK_BYTES)
                        data = retry(
                            lambda: fs.cat_file(fspath, start=start, end=end),
                            what=what(f" bytes {start}-{end}"),
                            url=url,
                        )
                        if len(data) == size != end - start:  # a 200 with the whole object
                            if not whole.is_set():  # (the checksum below tells if it is right)
                                whole.set()
                                log.info("%s ignored Range and sent the whole shard (%d bytes)",
                                         url, size)  # fmt: skip
                                os.pwrite(fd, data, 0)
                            return
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
                try:  # last use: the use mark's mtime (an entry without one: its own)
                    used = os.stat(use_mark(Path(e.path))).st_mtime_ns
                except FileNotFoundError:
                    used = st.st_mtime_ns
                entries.append((used, st.st_size, e.path))
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
                    use_mark(Path(path)).unlink(missing_ok=True)
                    log.debug("evicted %s (%d bytes) from the shard cache", path, size)
                total -= size


def _stamp_of(st: os.stat_result) -> str:
    # any write to the entry changes its mtime and ctime; ctime cannot be set back
    return f"{st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}\n"


def _read_stamp(entry: Path) -> str | None:
    try:
        fd = os.open(use_mark(entry), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, 200).decode("ascii", "replace")
    finally:
        os.close(fd)


def _write_stamp(entry: Path) -> None:
    """Record that ``entry``, as it is now, was verified (atomically: a reader never sees half
    a stamp). The caller holds the entry's lock."""
    mark = use_mark(entry)
    tmp = mark.with_name(f"{mark.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_text(_stamp_of(os.stat(entry)))
        os.replace(tmp, mark)
    finally:
        tmp.unlink(missing_ok=True)
