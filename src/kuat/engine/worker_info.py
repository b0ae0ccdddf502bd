"""``torch.utils.data.get_worker_info()`` per worker thread: a patch of torch (the other:
``torch.initial_seed()``, :mod:`kuat.engine.seed_view`).

torch answers ``get_worker_info()`` from one module global, set in each worker process. kuat's
thread workers share a process, so the function's code is replaced (once, idempotently) by a
version that first looks at a ``threading.local`` and falls back to torch's global: every
reference to it (``from torch.utils.data import get_worker_info`` included) sees the info of the
kuat thread worker calling it, and ``None`` in the main thread, as under torch. Each call also
marks the calling worker as having consulted its worker info (:func:`worker_info_consulted`),
which the loader reads to warn about unsplit iterables and to keep per-worker batches in
their worker.
"""

from __future__ import annotations

import os
import threading

__all__ = ["set_worker_info", "clear_worker_info", "worker_info_consulted", "reset_consulted"]


class _PerThreadWorkerInfo(threading.local):
    info = None
    consulted = False  # get_worker_info() was called in this worker since it started


_thread_info = _PerThreadWorkerInfo()


def _reset_lock_in_child() -> None:
    # A fork while another thread held the lock would leave it locked forever in the child.
    global _install_lock
    _install_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_in_child)
_install_lock = threading.Lock()


def _thread_aware_get_worker_info():  # code object swapped into torch's get_worker_info
    local = _kuat_thread_worker_info  # noqa: F821 (a global of torch's worker module)
    local.consulted = True
    info = local.info
    return _worker_info if info is None else info  # noqa: F821


def _install_thread_worker_info() -> None:
    """Make ``torch.utils.data.get_worker_info()`` answer per thread.

    torch's function returns one module global. Its code is replaced (once, idempotently) by a
    version that first looks at a ``threading.local`` and falls back to that global, so every
    reference to it (``from torch.utils.data import get_worker_info`` included) sees the info of
    the kuat thread worker calling it, and ``None`` in the main thread, as under torch. Each
    call also marks the calling thread as having consulted its worker info
    (:func:`worker_info_consulted`). Installed in worker processes too, for that mark.
    """
    from torch.utils.data._utils import worker as wmod

    with _install_lock:
        if getattr(wmod, "_kuat_thread_worker_info", None) is not None:
            return
        wmod._kuat_thread_worker_info = _thread_info
        wmod.get_worker_info.__code__ = _thread_aware_get_worker_info.__code__


def set_worker_info(method: str, worker_id: int, num_workers: int, seed: int, dataset) -> None:
    """Set what ``torch.utils.data.get_worker_info()`` returns in this worker."""
    from torch.utils.data._utils import worker as wmod

    try:
        info = wmod.WorkerInfo(
            id=worker_id,
            num_workers=num_workers,
            seed=seed,
            dataset=dataset,
            worker_method="thread" if method == "thread" else "multiprocessing",
        )
    except TypeError:  # torch without the worker_method field
        info = wmod.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)
    _install_thread_worker_info()
    if method == "thread":
        _thread_info.info = info
    else:
        wmod._worker_info = info


def reset_consulted() -> None:
    """A worker starts: it has not consulted ``get_worker_info()`` yet."""
    _thread_info.consulted = False


def thread_state():
    """This module's per-thread state (a ``threading.local``: ``consulted``, ``info``), for
    the engine, which reads ``consulted`` after each fetch without a call
    (:func:`worker_info_consulted`). Internal."""
    return _thread_info


def worker_info_consulted() -> bool:
    """Whether ``get_worker_info()`` was called in this worker since it started (:func:`reset_consulted`)."""
    return _thread_info.consulted


def clear_worker_info(method: str) -> None:
    """Unset this worker's ``get_worker_info()`` (its engine is stopping)."""
    from torch.utils.data._utils import worker as wmod

    if method == "thread":
        _thread_info.info = None
    elif method == "process":
        wmod._worker_info = None
