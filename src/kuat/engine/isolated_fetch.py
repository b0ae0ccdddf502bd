"""Fetching with global-RNG isolation: the part of :class:`kuat.engine.job.FetchJob` that
probes, watches and reseeds Python's ``random``, NumPy's global generator and torch's default
CPU generator around a dataset's calls (the rules: :mod:`kuat.engine.isolate`).

A mixin: :class:`IsolatedFetch` reads the job's ``isolate_rng``, ``rng_use``, ``seed`` and
``use_getitems`` and calls its ``_get(ctx, key)`` (the plain fetch).
"""

from __future__ import annotations

import operator
import threading
import time
import zlib

import numpy as np
import torch

from kuat import rng as krng
from kuat.engine import isolate, seed_view
from kuat.engine.base import WorkerCtx, WorkStats

__all__ = ["IsolatedFetch"]

_WATCH = object()  # FetchJob._isolated: fetch this first batch watched, not probed
_STALLED = object()  # FetchJob._isolated: the lock was held too long; fetch watched, unlocked
_JOINED = object()  # FetchJob._isolated: the shared side joined beside an open prober
# fetches beside an open prober (isolate.py, 1) a batch may try while it reseeds meanwhile
BESIDE_TRIES = 3


def _index_key(index) -> int:
    """An int for a sample key: the index itself, or a stable hash of a non-integer key."""
    try:
        return operator.index(index)
    except TypeError:
        return zlib.crc32(repr(index).encode())


def _batch_key(key) -> int:
    """An int for a batch of sample keys (a CRC of the indices and their count)."""
    try:
        a = np.asarray(key, dtype=np.int64)  # (B,)
        return zlib.crc32(a.tobytes()) | (a.size << 32)
    except (TypeError, ValueError, OverflowError):
        return zlib.crc32(repr(key).encode())



class _Pending(threading.local):
    # the RngUse whose RngUse.fetch_begins counted this thread's fetch, not yet ended (per
    # thread, and saved and restored around each fetch: a dataset may iterate another loader)
    use = None
    began = None  # the same RngUse while that fetch runs, ended or not (_isolated's note)


_PENDING = _Pending()


def _pending_ends(use) -> None:
    """End this thread's fetch counted for ``use`` (``RngUse.fetch_ends``), once."""
    if _PENDING.use is use:
        _PENDING.use = None
        use.fetch_ends()


class IsolatedFetch:
    """``_fetch(ctx, epoch, key, st)``: the samples of ``key``, isolated where needed."""

    def _fetch(self, ctx: WorkerCtx, epoch: int, key, st: WorkStats) -> list:
        """The samples of ``key``, with global-RNG isolation where the dataset needs it."""
        if not self.isolate_rng or ctx.rng is not None:  # (a worker_init_fn's own stream)
            return self._get(ctx, key)
        # a thread worker's fetch begun before the loop has its epoch's first batch: the loop
        # does not draw until its unisolated part has ended, any draws of it rewound
        # (RngUse.loop_has_batch; _isolated ends it early, once it has rewound)
        use, pending = self.rng_use, _PENDING
        prev = pending.use, pending.began
        counted = ctx.method == "thread" and use.fetch_begins()
        pending.use = pending.began = use if counted else None
        try:
            return self._fetch_isolating(ctx, epoch, key, st)
        finally:
            _pending_ends(use)
            if ctx.method == "thread":
                use.fetch_done()
            pending.use, pending.began = prev

    def _fetch_isolating(self, ctx: WorkerCtx, epoch: int, key, st: WorkStats) -> list:
        use = self.rng_use
        if use.draws or not ctx.probed:
            ctx.probed = True
            # Once a probe in this process saw no draw, a thread's first batch is watched
            # instead: probing it would hold the exclusive lock for a whole batch and stall
            # every other worker (measured: ~80 ms at an epoch's start, after which one worker
            # ran a batch behind and the loader held one more batch buffer). The watch catches
            # a draw all the same and re-fetches the batch isolated. Without the watch (false
            # alarms) and in worker processes (their own generators) each worker still probes.
            if not self._may_watch_first(ctx):
                return self._first(ctx, epoch, key, st, join=True)
        return self._watch(ctx, epoch, key, st, join=True)

    def _first(self, ctx: WorkerCtx, epoch: int, key, st: WorkStats, join: bool):
        """A worker's first batch: probed (isolated), or watched once a probe saw no draw;
        with ``join``, fetched beside a probe that runs now (:meth:`_beside`)."""
        data = self._isolated(ctx, epoch, key, st, first=True, join=join)
        if data is _STALLED:
            return self._watched(ctx, epoch, key, st, locked=False)
        if data is _JOINED:
            return self._beside(ctx, epoch, key, st, first=True)
        if data is _WATCH:
            return self._watch(ctx, epoch, key, st, join=join)
        return data

    def _watch(self, ctx: WorkerCtx, epoch: int, key, st: WorkStats, join: bool):
        """A later batch (or a first one after a probe saw no draw): watched."""
        use = self.rng_use
        if not use.watch:
            return self._get(ctx, key)
        # A holder of the exclusive side for STALL_S may be a sample waiting for this worker
        # (a barrier across workers, as in torch's own tests): unless the dataset is known to
        # draw, the batch is then fetched without the lock, watched all the same. A probe
        # (an open holder) is not waited for: the batch is fetched beside it (_beside)
        lock = isolate.GLOBAL_RNG_LOCK
        draws = use.draws
        locked = lock.acquire_shared(patience=None if draws else isolate.STALL_S,
                                     join=join and not draws)
        if locked is isolate.JOINED:
            return self._beside(ctx, epoch, key, st, first=False)
        if locked is True and use.draws:  # known to draw (another worker's probe, maybe
            lock.release_shared()  # while this one waited): isolated, not unisolated and
            return self._isolated(ctx, epoch, key, st)  # again (not after a stall: the
            # stuck holder may be waiting for this worker's sample, fetched watched first)
        return self._watched(ctx, epoch, key, st, locked)

    def _beside(self, ctx: WorkerCtx, epoch: int, key, st: WorkStats, first: bool):
        """The samples of ``key`` fetched watched beside an open prober (this thread joined
        the shared side; isolate.py, 1), which it releases: they stand when the generators
        did not change and the prober did not reseed them meanwhile (``generation``). When
        something drew, the batch is fetched again isolated (as a watched batch that drew);
        when the prober reseeded, beside it again (``BESIDE_TRIES`` in all) while it is open,
        then as it would have been without joining."""
        use, lock = self.rng_use, isolate.GLOBAL_RNG_LOCK
        for attempt in range(BESIDE_TRIES):
            if attempt and not lock.try_join():
                break  # the prober closed the lock, or is gone
            generation = lock.generation
            try:
                data, drew = self._fetch_watched(ctx, key)
            finally:
                reseeded = lock.generation != generation
                lock.release_shared(joined=True)
            if not drew and not reseeded:
                return data
            del data
            if not reseeded:  # something drew (the dataset, or another thread): isolated
                data = self._isolated(ctx, epoch, key, st, rewind=True)
                if not use.draws:
                    use.false_alarm()
                return data
        if first:
            return self._first(ctx, epoch, key, st, join=False)
        return self._watch(ctx, epoch, key, st, join=False)

    def _watched(self, ctx: WorkerCtx, epoch: int, key, st: WorkStats, locked: bool):
        """The samples of ``key`` fetched un-isolated between two fingerprints (holding the
        shared side of the lock when ``locked``, which it releases); fetched again isolated
        when the generators changed meanwhile (the dataset drew, or another thread did).

        Not ``locked`` (the lock's holder was stuck, maybe waiting for this very fetch): the
        fetch ran while another sample had the generators reseeded, so what it read of them
        (``torch.initial_seed()``) was that sample's. Once it has let the holder go on, the
        batch is fetched again, isolated, and the first result dropped; unless the holder is
        still there ``STALL_GRACE_S`` later (stuck on something else, a slow read: the other
        workers must go on) and the fetch drew nothing: its result then stands."""
        use = self.rng_use
        try:
            data, drew = self._fetch_watched(ctx, key)
        finally:
            if locked:
                isolate.GLOBAL_RNG_LOCK.release_shared()
        if locked and not drew:
            return data
        if not locked and not drew:
            hold = isolate.GLOBAL_RNG_LOCK.held_since
            grace = 0.0 if hold == use.stuck_hold else time.monotonic() + isolate.STALL_GRACE_S
            again = self._isolated(ctx, epoch, key, st, grace_until=grace)
            if again is not _STALLED:
                return again
            use.stuck_hold = hold  # (the same hold stuck: the next fetches do not wait)
            return data
        del data  # fetched with unseeded draws (or another thread drew): fetch it isolated
        data = self._isolated(ctx, epoch, key, st, rewind=True)
        if locked and not use.draws:
            use.false_alarm()
        return data

    def _fetch_watched(self, ctx: WorkerCtx, key):
        """``(samples of key, whether the global generators changed while they were fetched)``."""
        before = isolate.fingerprint()
        data = self._get(ctx, key)
        return data, isolate.fingerprint() != before

    def _may_watch_first(self, ctx: WorkerCtx) -> bool:
        """Whether this worker's first batch may be watched instead of probed, while the watch
        is on and the dataset is not known to draw: always for a thread worker, and for the
        consumer of a process where a probe already saw no draw.

        A thread worker never probes beside the others: a probe reseeds the generators they
        share, so a batch fetched beside it could not tell its own draws from the reseeds and
        was fetched again (twice, for a dataset that draws nothing: a ``__getitem__`` with side
        effects, a counter or a lazily opened handle, then ran more often than under torch).
        Watched, a batch is fetched again only when the generators changed while it ran (the
        dataset drew, or the training loop did)."""
        use = self.rng_use
        if not use.watch or use.draws:
            return False
        return ctx.method == "thread" or (ctx.method != "process" and use.probed)

    def _isolated(self, ctx: WorkerCtx, epoch: int, key, st: WorkStats, first: bool = False,
                  grace_until: float | None = None, join: bool = False, rewind: bool = False):
        """The samples of ``key`` with the global RNGs reseeded per sample (``__getitem__``)
        or per batch (``__getitems__``), under the exclusive lock; probes whether the dataset
        draws until that is known. With ``first`` (a worker's first batch), returns ``_WATCH``
        instead when, by the time the lock is had, another thread of this process has probed a
        batch and seen no draw (workers that started together then watch side by side instead
        of probing one after another). Returns ``_STALLED`` instead when the lock has been
        held ``STALL_S`` (and it is past ``grace_until``) by then, for a first batch or one
        given ``grace_until``, while the dataset is not known to draw (``_watched``). With
        ``join``, returns ``_JOINED`` (the shared side held, beside the holder) as soon as the
        holder is an open prober, while the dataset is not known to draw (``_beside``).

        While the dataset is not known to draw, the holder opens the lock: others fetch beside
        it instead of waiting for its samples (:meth:`_probed`)."""
        use = self.rng_use
        lock = isolate.GLOBAL_RNG_LOCK
        t0 = time.perf_counter()
        got = lock.acquire(patience=isolate.STALL_S, not_before=grace_until or 0.0,
                           join=join and not use.draws)
        if got is isolate.JOINED:
            st.rng_wait_s += time.perf_counter() - t0
            return _JOINED
        if not got:
            if (first or grace_until is not None) and not use.draws:
                # the holder may be waiting for this worker's sample: the caller fetches it
                # watched, without the lock
                st.rng_wait_s += time.perf_counter() - t0
                return _STALLED
            isolate.warn_stalled("a batch that must run isolated")
            lock.acquire()
        try:
            st.rng_wait_s += time.perf_counter() - t0
            if first and self._may_watch_first(ctx):
                return _WATCH
            caller = use.caller_state
            if rewind and caller is not None and ctx.method == "thread":
                # the batch drew, watched, before the loop had its first batch: those draws
                # were the workers' own, from the generators the caller will read on (its
                # next epoch's shuffle): rewind them, as a worker process never draws from them
                isolate.restore(caller)
            elif rewind and _PENDING.began is use and caller is None:
                isolate.late_draws()  # begun before the loop's first batch, not waited for
            _pending_ends(use)  # (from here the caller's generators are saved and restored)
            # the caller's generator states stay as they were; a worker process's own too
            # while its dataset is not known to draw (a probed batch: code outside the dataset,
            # a collate_fn, then draws from base_seed + worker_id's stream, as in torch); once
            # every batch is isolated it is not restored (0.15 ms a batch)
            saved = isolate.save() if ctx.method != "process" or not use.draws else None
            if not use.draws:
                lock.open()  # (after the save: a draw beside it is in the state restored)
            view = seed_view.current()
            viewed = view.shown, view.hidden
            if view.shown is None:  # torch.initial_seed() answers what it would unisolated
                seed_view.install()
                view.shown = (ctx.base_seed + ctx.worker_id if ctx.method == "process"
                              else torch.default_generator.initial_seed())
            try:
                if self.use_getitems:
                    s = krng.global_rng_seed(self.seed, epoch, _batch_key(key))
                    out = self._probed(s, lambda: self._get(ctx, key))
                    use.probed = True
                    return out
                out = []
                getitem = self._getitem(ctx)
                for i in key:
                    s = krng.global_rng_seed(self.seed, epoch, _index_key(i))
                    out += self._probed(s, lambda i=i: krng.map_samples(getitem, (i,)))
                use.probed = True
                return out
            finally:
                if saved is not None:
                    lock.bump()
                    isolate.restore(saved)
                view.shown, view.hidden = viewed
        finally:
            lock.release()

    def _probed(self, seed: int, fetch):
        """``fetch()`` with the global generators seeded from ``seed`` (the caller holds the
        exclusive side); sets ``rng_use.draws`` when it drew. A change of the generators
        while another thread fetched beside it (the lock open) may be that thread's draw, and
        that draw may have taken the sample's own: the lock is then closed (no more joiners;
        those there finish) and the sample fetched again."""
        use, lock = self.rng_use, isolate.GLOBAL_RNG_LOCK
        while True:
            lock.bump()
            isolate.seed_globals_cpu(seed)
            seed_view.hide(seed)
            lock.mark()
            probe = None if use.draws else isolate.fingerprint()
            out = fetch()
            if probe is None or isolate.fingerprint() == probe:
                return out
            if not lock.overlapped():
                use.draws = True  # (from now on every sample runs isolated: no joiners)
                self._close(lock)
                return out
            del out
            self._close(lock)

    @staticmethod
    def _close(lock) -> None:
        if not lock.close(patience=isolate.STALL_S):
            isolate.warn_stalled("a sample fetched again with the generators to itself")
            lock.close()
