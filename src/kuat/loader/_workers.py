"""Which engine runs an epoch: inline, threads or processes, and persistent workers.

A :class:`WorkerPool` (one per loader) makes engines (:mod:`kuat.engine`) and keeps the
persistent one between epochs; each epoch's iterator gets a :class:`Lease`: the engine it uses,
whether it owns it (closes it at the end) and the moves the adaptive policy may ask for
(thread workers -> process workers, workers -> the consumer thread).
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import weakref

from kuat.engine import rng_hint
from kuat.engine.inline import InlineEngine
from kuat.engine.process import ProcessEngine
from kuat.engine.thread import ThreadEngine

__all__ = ["WorkerPool", "Lease"]

log = logging.getLogger("kuat.loader")


class WorkerPool:
    """Makes a loader's engines; holds its persistent workers (``persistent_workers=True``).

    Pickles (and copies) to an empty pool: live workers never travel.
    """

    def __init__(self):
        self.persistent = None  # the engine kept between epochs
        self.live_iter = None  # weakref to the iterator using it
        # why process workers chosen under worker_type=None could not start (the job does
        # not pickle for a spawn/forkserver context): threads from then on, without retrying
        self.no_processes: str | None = None

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()

    def make(self, loader, base_seed: int):
        """A new engine for ``loader`` (its options and its job), seeded from ``base_seed``.

        ``worker_type=None``: once the job saw the dataset draw from the global RNGs, or from
        the start when its attributes hold a torchvision random transform
        (:mod:`kuat.engine.rng_hint`), process workers are made instead of threads, and
        ``loader.worker_type`` says so; a decision of
        :mod:`kuat.loader._auto` not yet applied (an iterable's, taken during the last epoch)
        sets ``loader.worker_type`` and ``loader.num_workers`` first.
        """
        job = loader._job
        adopt(loader)
        if loader.num_workers == 0:
            return InlineEngine(job, base_seed)
        auto = loader._options.auto_worker_type
        why = None
        if auto and self.no_processes is not None:
            loader.worker_type = "thread"  # (processes could not start: not tried again)
        elif auto and (loader.worker_type == "thread" or not loader._choice.decided):
            # (a move to processes for the RNG mid-epoch comes with worker_type set)
            why = _why_processes(job.rng_use, job.dataset)
        if why is not None:
            loader.worker_type = "process"
            loader._choice.by_rng(why, loader.num_workers)
            log.info("kuat.DataLoader: %s; moving to %d process workers (in threads its samples "
                     "would run one at a time)", why, loader.num_workers)
        if loader.worker_type == "thread":
            return ThreadEngine(job, loader.num_workers, base_seed)
        ctx = loader.multiprocessing_context
        if ctx is None:  # torch's choice: the default context (multiprocessing.set_start_method)
            ctx = multiprocessing.get_context()
        # the job itself: forked, or pickled by multiprocessing as each worker starts (inside
        # its spawning context, so a dataset holding multiprocessing.Value/Lock objects works,
        # as with torch; pickled into bytes ahead of that it raises "should only be shared
        # between processes through inheritance")
        payload = job
        try:
            return ProcessEngine(payload, loader.num_workers, base_seed, ctx,
                                 pin=loader._options.pin, warn_pickle=not auto)
        except (TypeError, AttributeError, pickle.PicklingError) as e:
            if not auto:  # worker_type="process" given: torch's error, as torch raises it
                raise
            # kuat chose processes (worker_type=None) for a dataset that ran in threads: a job
            # that does not pickle for this context keeps running there, as it did
            self.no_processes = (f"process workers could not start ({type(e).__name__}: {e}, "
                                 f"under the {ctx.get_start_method()!r} start method): thread "
                                 "workers kept")
            loader.worker_type = "thread"
            loader._choice.no_processes(self.no_processes)
            log.warning("kuat.DataLoader: %s; pass worker_type='thread' to start on them, or "
                        "make the dataset picklable", self.no_processes)
            return ThreadEngine(job, loader.num_workers, base_seed)

    def drop_persistent(self) -> None:
        """Close the persistent workers (they hold an old seed or share); the next epoch starts
        new ones."""
        if self.persistent is not None:
            self.persistent.close()
            self.persistent = None

    def lease(self, loader, base_seed: int, it) -> Lease:
        """The engine of the epoch ``it`` starts: the persistent one (made on first use; an
        older iterator still using it yields nothing more, as torch resets its one iterator),
        or a new one the epoch owns."""
        if not loader.persistent_workers:
            return Lease(self, loader, self.make(loader, base_seed), True, base_seed)
        if self.persistent is not None and adopt(loader):
            self.drop_persistent()  # the chosen workers replace them
        if self.persistent is None:
            self.persistent = self.make(loader, base_seed)
        previous = self.live_iter() if self.live_iter is not None else None
        if previous is not None and previous is not it:
            previous._abandon()
        self.live_iter = weakref.ref(it)
        return Lease(self, loader, self.persistent, False, base_seed)

    def close(self) -> None:
        self.drop_persistent()


def _why_processes(use, dataset) -> str | None:
    """Why ``worker_type=None`` should start process workers rather than threads (their
    samples would run one at a time under global-RNG isolation), or ``None``."""
    if use.worker_seeded:
        return "worker_init_fn seeds the global random generators"
    if use.draws:
        return "the dataset draws from the global random generators"
    hint = rng_hint.draws_hint(dataset)
    if hint is not None:
        return f"the dataset applies torchvision's {hint}, which draws from torch's generator"
    return None


def adopt(loader) -> bool:
    """Apply a decision of the loader's ``_auto.WorkerChoice`` not applied yet (the type under
    ``worker_type=None``, the count under ``num_workers="auto"``, unless the attribute was set
    since); True when it changed either. Idempotent (a ``skip_first_batches`` copy shares the
    choice, and each applies it to itself)."""
    choice = loader._choice
    if not choice.decided or choice.by != "measured" or not loader.num_workers:
        return False
    before = (loader.worker_type, loader.num_workers)
    if choice.auto_type and loader.worker_type == "thread":  # (it only ever moves to processes)
        loader.worker_type = choice.worker_type
    if choice.auto_count and loader.num_workers == choice.initial:
        loader.num_workers = choice.num_workers
    return (loader.worker_type, loader.num_workers) != before


class Lease:
    """The engine one epoch uses (``engine``) and whether the epoch owns it (``owned``)."""

    def __init__(self, pool: WorkerPool, loader, engine, owned: bool, base_seed: int):
        self._pool, self._loader = pool, loader
        self.engine, self.owned, self._base_seed = engine, owned, base_seed

    @property
    def worker_type(self) -> str:
        return self._loader.worker_type

    def to_processes(self, worker_type: str = "process", num_workers: int | None = None):
        """Replace the workers (idle now) with ``num_workers`` (default: as many) workers of
        ``worker_type``; returns the new engine (thread workers where kuat's choice of process
        workers could not start them), or ``None`` where the pool already knows process workers
        cannot start (the workers are kept)."""
        loader, pool = self._loader, self._pool
        if pool.no_processes is not None and worker_type == "process":
            return None  # (kuat's choice of processes, which cannot start: threads kept)
        loader.worker_type = worker_type
        if num_workers is not None:
            loader.num_workers = num_workers
        old = self.engine
        if self.owned or pool.persistent is old:
            old.close()
        new = pool.make(self._loader, self._base_seed)
        if not self.owned:
            pool.persistent = new
        self.engine = new
        return new

    def to_inline(self, own_copy: bool):
        """Fetch the rest of the epoch in the consumer thread (workers idle now): releases the
        epoch's workers (persistent ones stay with the loader); returns the inline engine."""
        if self.owned:
            self.engine.close()
        self.engine = InlineEngine(self._loader._job, self._base_seed, own_copy=own_copy)
        self.owned = True
        return self.engine

    def release(self, broken: bool) -> None:
        """End of the epoch: close the engine it owns, or persistent workers that broke."""
        if self.owned:
            self.engine.close()
        elif broken and self._pool.persistent is self.engine:
            self.engine.close()
            self._pool.persistent = None
