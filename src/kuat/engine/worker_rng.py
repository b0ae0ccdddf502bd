"""A thread worker's own global random generators, as each of torch's worker processes has.

torch seeds each worker process's Python ``random`` and torch's default generator with
``base_seed + worker_id`` and NumPy's legacy global generator from ``(base_seed, worker_id)``,
then calls ``worker_init_fn``, which may seed them again (``torch.manual_seed(...)``, or torch's
documented ``seed_worker`` recipe: ``np.random.seed(torch.initial_seed() % 2**32)``). Those
generators belong to the worker: the main process's are untouched, and the worker's samples
draw from (and read, ``torch.initial_seed()``) the state its ``worker_init_fn`` left.

Thread workers share one process's generators, so kuat keeps each one's state apart:

1. **Start** (:func:`run_init`): ``worker_init_fn`` runs under the exclusive side of
   :data:`kuat.engine.isolate.GLOBAL_RNG_LOCK` with the worker's state swapped in, seeded as
   torch seeds a worker process (CPU generators only). Around it the caller's states are saved
   and restored: the three CPU generators, CUDA's generators when CUDA is initialised, and
   torch's queue of lazy CUDA seeding (``torch.manual_seed`` before CUDA starts queues a seed
   for every GPU: in a thread it would replace the training script's). If the generators'
   :func:`~kuat.engine.isolate.fingerprint` changed (the function seeded or drew), the worker
   keeps that state as its own (:class:`OwnRng`); otherwise nothing is kept and its samples
   follow kuat's per-sample isolation (``kuat.engine.isolate``).
2. **Fetches** of a worker that keeps its own state (:func:`swapped`) run with it swapped in,
   under the exclusive lock, and save it back afterwards: the samples draw from the worker's
   stream exactly as in torch's worker process (the same values: kuat gives each worker the
   batches torch gives it), never from or into the training loop's generators. Per-sample
   reseeding does not apply: the ``worker_init_fn`` chose how the worker is seeded.

3. **Iterable datasets** (no ``worker_init_fn`` seeding needed): an ``IterableDataset`` draws
   where torch cannot re-fetch (an iterator is consumed), so per-sample isolation cannot apply;
   instead each thread worker of one gets its own generators from the start, seeded as torch
   seeds worker processes (``OwnRng.seeded``), so its items equal torch's (and a stateful
   iterator's ``torch.get_rng_state()``/``set_rng_state`` in ``state_dict``/``load_state_dict``
   save and restore the worker's stream, not the training loop's). Not to serialise workers
   that never draw, :func:`own_stream` *probes*: each epoch's first batch (with ``iter()`` and
   any state restore) runs swapped in; if the worker's stream did not change, later batches run
   *watched* (the shared side of the lock, one fingerprint before and after) until one changes
   the generators, after which the worker's batches run swapped in again (one batch's draws
   then came from the process's generators: a dataset that starts drawing only after its
   first batch gets torch's values up to there). A worker seen drawing marks
   ``RngUse.worker_seeded``: ``worker_type=None`` makes the next epoch's workers processes.
   No worker waits for another's slow batch: a hold of the generators longer than
   :data:`YIELD_S` is not waited for (the batch runs watched, unlocked; a warning if the
   generators changed meanwhile), so a slow first item does not stall the other workers.

Cost: the swap saves and restores the three generators twice per batch (0.17 ms median on the
loaded 2-core dev machine; NumPy's accessor copies its 2.5 KB state each time), and the fetches of such
workers run one at a time (the generators are process-wide). Only workers whose
``worker_init_fn`` changed the generators, or whose iterable draws, pay it, and only for sources
that may draw from them (not kuat's own datasets, which draw from ``kuat.sample_rng``, nor plain
tensors and lists). ``worker_type=None`` moves such a loader to process workers from its next
epoch's workers. A worker's ``__getitem__`` that waits for another worker while it holds the
lock would wait forever: a warning names it after :data:`kuat.engine.isolate.STALL_S`.
"""

from __future__ import annotations

import contextlib
import logging
import time

from kuat import rng as krng
from kuat.engine import isolate, seed_view

__all__ = ["OwnRng", "run_init", "swapped", "own_stream", "YIELD_S"]

log = logging.getLogger("kuat.engine")


class OwnRng:
    """A thread worker's generator states (``kuat.engine.isolate.save()``'s tuple), while they
    are not swapped in. ``seeded``: kuat seeded them as torch seeds a worker (an iterable's
    worker; no ``worker_init_fn`` changed them), so they are probed and watched
    (:func:`own_stream`) and seeded again when the epoch's ``base_seed`` changes; ``swap``:
    such a worker's batches run swapped in (else watched). Thread-safety: used by its worker
    thread only."""

    __slots__ = ("state", "seeded", "swap")

    def __init__(self, state: tuple, seeded: bool = False):
        self.state = state
        self.seeded = seeded
        self.swap = True


def _save_caller() -> tuple:
    """The caller's CPU generators, CUDA's when initialised, and torch's lazy CUDA seed queue."""
    import torch

    cuda = None
    if torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    lazy = None if tracker is None else dict(vars(tracker))
    return isolate.save(), cuda, tracker, lazy


def _restore_caller(saved: tuple) -> None:
    import torch

    cpu, cuda, tracker, lazy = saved
    isolate.restore(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    if tracker is not None:
        vars(tracker).clear()
        vars(tracker).update(lazy)


def _acquire(what: str) -> float:
    """Take the exclusive lock (blocking), warning once it has waited ``STALL_S``; returns the
    seconds waited."""
    t0 = time.perf_counter()
    if not isolate.GLOBAL_RNG_LOCK.acquire(patience=isolate.STALL_S):
        isolate.warn_stalled(what)
        isolate.GLOBAL_RNG_LOCK.acquire()
    return time.perf_counter() - t0


def run_init(init, worker_id: int, base_seed: int, *, keep: bool = False) -> OwnRng | None:
    """Call ``init(worker_id)`` (``None``: nothing) with this thread worker's generators
    swapped in (seeded as torch seeds worker ``worker_id`` of ``base_seed``); the worker's
    :class:`OwnRng` when ``init`` changed them, else, with ``keep`` (an iterable's worker),
    the seeded state as an ``OwnRng(seeded=True)``, else None. The caller's generator states
    are as before in every case. Raises what ``init`` raises (the states restored first)."""
    _acquire("a worker_init_fn" if init is not None else "a worker's own generators")
    try:
        saved = _save_caller()
        try:
            krng.seed_worker_globals(base_seed, worker_id, cuda=False)
            before = isolate.fingerprint()
            if init is not None:
                init(worker_id)
            if isolate.fingerprint() == before:
                return OwnRng(isolate.save(), seeded=True) if keep else None
            return OwnRng(isolate.save())
        finally:
            _restore_caller(saved)
    finally:
        isolate.GLOBAL_RNG_LOCK.release()


@contextlib.contextmanager
def swapped(own: OwnRng, st):
    """Run the body with the worker's generators ``own`` swapped in (exclusive lock); they are
    saved back into ``own`` afterwards and the caller's restored. ``st.rng_wait_s`` gets the
    seconds spent waiting for the lock."""
    st.rng_wait_s += _acquire("a batch of a worker with generators of its own")
    try:
        saved = isolate.save()
        isolate.restore(own.state)
        seed_view.hide(_initial_seed())  # (a view shown: torch.initial_seed() reads its own)
        try:
            yield
        finally:
            own.state = isolate.save()
            isolate.restore(saved)
    finally:
        isolate.GLOBAL_RNG_LOCK.release()


def _initial_seed() -> int:
    import torch

    return torch.default_generator.initial_seed()


# How long an iterable's worker waits for another worker's hold of the generators (its probed
# or drawing batch) before it fetches without them (no worker waits for a slow one's batch)
YIELD_S = 0.25
_warned_unowned = False


@contextlib.contextmanager
def own_stream(own: OwnRng, st, use, probe: bool):
    """The body (a batch of the worker owning ``own``) with its own generators: swapped in
    (:func:`swapped`) when ``worker_init_fn`` seeded them, else (``own.seeded``) swapped in
    while probing (``probe``: an epoch's first batch) or once seen drawing, watched otherwise
    (module docstring, 3). A draw seen while swapped in sets ``use.worker_seeded``. Yields
    whether the generators are swapped in (False: watched; the caller swaps them in to take
    the iterable's state, which may read them).

    Another worker's batch holding the generators for over :data:`YIELD_S` (a slow first
    batch) is not waited for: the body runs watched, without them (torch's workers never wait
    for each other); if the generators changed meanwhile the next batch is swapped in, and a
    warning says that this batch's draws, if it drew, were not its own."""
    if not own.seeded:
        with swapped(own, st):
            yield True
        return
    if probe:
        own.swap = True
    lock = isolate.GLOBAL_RNG_LOCK
    t0 = time.perf_counter()
    if own.swap and lock.acquire(patience=YIELD_S):
        st.rng_wait_s += time.perf_counter() - t0
        try:
            saved = isolate.save()
            isolate.restore(own.state)
            seed_view.hide(_initial_seed())
            try:
                before = isolate.fingerprint()
                yield True
                drew = isolate.fingerprint() != before
            finally:
                own.state = isolate.save()
                isolate.restore(saved)
        finally:
            lock.release()
        if drew:
            use.worker_seeded = True
        else:  # (a restore that set the generators counts as drawing: they are its own now)
            own.swap = False
        return
    unowned = own.swap  # (it wanted its generators and another worker held them too long)
    locked = not unowned and lock.acquire_shared(patience=YIELD_S)
    st.rng_wait_s += time.perf_counter() - t0
    try:
        before, restores = isolate.fingerprint(), isolate.restores()
        yield False
        # something drew (the dataset, or the training loop): swap in from the next batch
        changed = isolate.fingerprint() != before
        own.swap = changed
        # (unlocked, another worker may have swapped its own states in or out meanwhile: that
        # changes the fingerprint without a draw, and is not warned about)
        if changed and (unowned or not locked) and isolate.restores() == restores:
            _warn_unowned()
    finally:
        if locked:
            lock.release_shared()


def _warn_unowned() -> None:
    global _warned_unowned
    if _warned_unowned:
        return
    _warned_unowned = True
    log.warning(
        "kuat: a thread worker of an IterableDataset fetched a batch while another worker's "
        "batch held the global random generators for over %.2f s, and they changed meanwhile: "
        "if the dataset draws from random/np.random/torch, that batch's draws were not its "
        "worker's own (not reproducible). worker_type='process' gives each worker its own "
        "generators with no waiting", YIELD_S)
