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

Cost: the swap saves and restores the three generators twice per batch (0.17 ms median on the
loaded 2-core dev machine; NumPy's accessor copies its 2.5 KB state each time), and the fetches of such
workers run one at a time (the generators are process-wide). Only workers whose
``worker_init_fn`` changed the generators pay it, and only for sources that may draw from them
(not kuat's own datasets, which draw from ``kuat.sample_rng``, nor plain tensors and lists).
``worker_type=None`` moves such a loader to process workers from its next epoch's workers.
A worker's ``__getitem__`` that waits for another worker while it holds the lock would wait
forever: a warning names it after :data:`kuat.engine.isolate.STALL_S`.
"""

from __future__ import annotations

import contextlib
import time

from kuat import rng as krng
from kuat.engine import isolate

__all__ = ["OwnRng", "run_init", "swapped"]


class OwnRng:
    """A thread worker's generator states (``kuat.engine.isolate.save()``'s tuple), while they
    are not swapped in. Thread-safety: used by its worker thread only."""

    __slots__ = ("state",)

    def __init__(self, state: tuple):
        self.state = state


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


def run_init(init, worker_id: int, base_seed: int) -> OwnRng | None:
    """Call ``init(worker_id)`` with this thread worker's generators swapped in (seeded as
    torch seeds worker ``worker_id`` of ``base_seed``); the worker's :class:`OwnRng` when
    ``init`` changed them, else None. The caller's generator states are as before in both
    cases. Raises what ``init`` raises (the states restored first)."""
    _acquire("a worker_init_fn")
    try:
        saved = _save_caller()
        try:
            krng.seed_worker_globals(base_seed, worker_id, cuda=False)
            before = isolate.fingerprint()
            init(worker_id)
            if isolate.fingerprint() == before:
                return None
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
    st.rng_wait_s += _acquire("a batch of a worker whose worker_init_fn seeds it")
    try:
        saved = isolate.save()
        isolate.restore(own.state)
        try:
            yield
        finally:
            own.state = isolate.save()
            isolate.restore(saved)
    finally:
        isolate.GLOBAL_RNG_LOCK.release()
