"""Fetching shards into the shard cache ahead of use (:class:`Prefetcher`).

A cache entry's use is marked by touching its *use mark* (:func:`use_mark`), not the entry: the
entry's own times then change only when its bytes do, which is how
:class:`kuat.format.cache.ShardCache` knows a verified entry is unchanged. The prefetcher
watches the marks to see readers in other processes use what it fetched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

__all__ = ["Prefetcher", "use_mark"]

log = logging.getLogger("kuat.format.cache")


def use_mark(entry: Path) -> Path:
    """The file beside cache entry ``<key>.arrow`` whose modification time is the entry's last
    use (``.<key>.ok``; it also holds the entry's verification stamp, see
    :class:`kuat.format.cache.ShardCache`)."""
    return entry.with_name(f".{entry.stem}.ok")


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
    it) or when its entry's use mark (:func:`use_mark`) was touched after the fetch (a reader in
    another process, a process worker, hit it). Both wake the fetch threads at once: the first is a call, the
    second an inotify ``IN_ATTRIB`` event on the cache directory (Linux). Where inotify is
    unavailable a full window re-checks its entries every 50 ms instead, which may start each
    fetch up to that much later than the use that made room for it.

    Args:
        fetch: ``fetch(k) -> Path``, fetches shard ``k`` into the cache (``ShardCache.get``)
            and returns its entry, whose :func:`use_mark` exists; called from several threads
            at once.
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
                mtime = os.stat(use_mark(path)).st_mtime_ns
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
            return os.stat(use_mark(path)).st_mtime_ns != mtime_ns
        except FileNotFoundError:  # evicted
            return True
