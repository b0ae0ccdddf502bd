"""The lock around the process's global random generators (:mod:`kuat.engine.isolate`):
many holders of the shared side (batches fetched watched), or one of the exclusive side (a
sample run with the generators reseeded); an exclusive holder may let others *join* it.

Thread-safety: every method may be called from any thread; :meth:`SharedExclusiveLock.open`,
``close``, ``bump`` and ``mark`` by the exclusive holder only.
"""

from __future__ import annotations

import threading
import time

__all__ = ["JOINED", "SharedExclusiveLock"]

JOINED = "joined"  # acquire()/acquire_shared(join=True): the shared side, beside an open holder


class SharedExclusiveLock:
    """Many holders of the shared side at once, or one holder of the exclusive side; or, once
    that holder opens it (:meth:`open`), it and holders of the shared side that *joined* it
    (``join=True``: they fetch watched beside it: :mod:`kuat.engine.isolate`, 1).

    ``patience`` (seconds, both sides): give up (return False) once the lock has been held
    without a break, by anyone, for that long; ``None`` waits for ever. Measured from when the
    lock was taken, not from when this waiter came: once a holder is stuck (its sample waits
    for another worker), later waiters give up at once instead of each waiting again.
    """

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # threads waiting for the exclusive side
        self._held_since = 0.0  # time.monotonic() when the lock was last taken while free
        self._open = False  # the exclusive holder lets others join (the shared side) beside it
        self._joined = 0  # holders of the shared side that joined (counted in _shared too)
        self._overlap = False  # one was there at some time since the holder's last mark()
        # changes when the exclusive side is taken or released and when its holder reseeds or
        # restores the generators (bump, mark): a fetch beside it read the same value before
        # and after only if no reseed can have hidden a draw from its fingerprints
        self.generation = 0

    def _wait(self, free, patience: float | None, not_before: float) -> bool:
        while not free():
            if patience is None:
                self._cond.wait()
                continue
            left = max(self._held_since + patience, not_before) - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(left)
        return True

    def _join(self):
        self._shared += 1
        self._joined += 1
        self._overlap = True
        return JOINED

    def acquire_shared(self, patience: float | None = None, not_before: float = 0.0,
                       join: bool = False):
        """Take the shared side; False (not taken) once the lock was held ``patience`` s
        (and not before ``time.monotonic()`` is ``not_before``); with ``join``, :data:`JOINED`
        (taken beside the exclusive holder) as soon as that holder opened the lock."""
        with self._cond:
            if not self._wait(lambda: not self._exclusive or (join and self._open), patience,
                              not_before):
                return False
            if self._exclusive:
                return self._join()
            if not self._shared:
                self._held_since = time.monotonic()
            self._shared += 1
            return True

    def try_join(self) -> bool:
        """Join the shared side beside an open exclusive holder now, or do nothing (False)."""
        with self._cond:
            if not (self._exclusive and self._open):
                return False
            self._join()
            return True

    def release_shared(self, joined: bool = False) -> None:
        with self._cond:
            self._shared -= 1
            self._joined -= joined
            if (not self._shared and self._waiting) or (joined and not self._joined):
                self._cond.notify_all()

    def acquire(self, patience: float | None = None, not_before: float = 0.0,
                join: bool = False):
        """Take the exclusive side; False (not taken) once the lock was held ``patience`` s
        (and not before ``time.monotonic()`` is ``not_before``); with ``join``, :data:`JOINED`
        (the shared side, beside the holder) as soon as the holder opened the lock."""
        with self._cond:
            self._waiting += 1
            try:
                if not self._wait(lambda: not (self._exclusive or self._shared)
                                  or (join and self._open), patience, not_before):
                    return False
            finally:
                self._waiting -= 1
            if self._exclusive:
                return self._join()
            self._exclusive = True
            self._held_since = time.monotonic()
            self.generation += 1
            return True

    def release(self) -> None:
        with self._cond:
            self._exclusive = self._open = False
            self.generation += 1
            self._cond.notify_all()

    # -- the exclusive holder's (kuat.engine.isolate, 1) ------------------------------------------
    def open(self) -> None:
        """Let threads join beside this holder (``join=True``) until :meth:`close` or
        :meth:`release`."""
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def close(self, patience: float | None = None) -> bool:
        """Admit no more joiners and wait until those beside the holder are gone; False when
        some are still there after ``patience`` s (the lock stays closed)."""
        deadline = None if patience is None else time.monotonic() + patience
        with self._cond:
            self._open = False
            while self._joined:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def bump(self) -> None:
        """The holder is about to reseed or restore the generators."""
        with self._cond:
            self.generation += 1

    def mark(self) -> None:
        """The holder reseeded the generators for a sample: :meth:`overlapped` tells, after
        it, whether a joiner was there meanwhile."""
        with self._cond:
            self.generation += 1
            self._overlap = self._joined > 0

    def overlapped(self) -> bool:
        return self._overlap

    @property
    def held_since(self) -> float:
        """``time.monotonic()`` when the lock was last taken while free (names one hold)."""
        return self._held_since

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
