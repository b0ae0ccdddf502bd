"""Seconds each thread spends inside native kernels that release the GIL (for ``stats()``).

A source's heavy per-sample work (a JPEG region decode, a resize) runs in C with the GIL
released; everything around it (planning, generators, wrapping, the loop) is Python. To show
how much of a fetch is that Python, the kernels' wrappers add their wall time here
(:func:`add`) and the engine reads the per-thread total before and after a
fetch (:func:`seconds`). The loader reports the difference as ``busy_s["native"]`` and
``fetch_python_fraction``. The kernels timed with :func:`clock` / :func:`add_since` also add
the thread's CPU seconds inside them (:func:`cpu_seconds`): a worker's CPU time outside them
is its Python (the GIL held), ``stats()["python_us_per_sample"]``.

Neutral ground: the engine knows nothing of images and ``kuat.vision`` nothing of the engine;
both import only this. Cost: one ``time.perf_counter()`` and one ``time.thread_time()`` pair (about 0.5 us) per
kernel call; kernels are called once per batch on the fused image path.

Thread-safety: the total is per thread (each thread only adds to and reads its own).
"""

from __future__ import annotations

import threading
import time

__all__ = ["add", "add_since", "clock", "cpu_seconds", "seconds", "totals"]


class _Total(threading.local):
    def __init__(self):
        self.s = 0.0
        self.cpu = 0.0


_total = _Total()


def thread_state() -> _Total:
    """This module's per-thread totals (a ``threading.local``: ``s``, ``cpu``), for the
    engine, which reads them around each fetch without a call (:func:`totals` is the same
    pair). Internal."""
    return _total


def add(seconds_: float, cpu: float = 0.0) -> None:
    """Add ``seconds_`` (wall seconds spent in a GIL-releasing kernel) to this thread's total,
    and ``cpu`` (this thread's CPU seconds in it, where the kernel measured them) to
    :func:`cpu_seconds`."""
    _total.s += seconds_
    _total.cpu += cpu


def seconds() -> float:
    """This thread's running total of kernel seconds (only differences are meaningful)."""
    return _total.s


def totals() -> tuple[float, float]:
    """``(seconds(), cpu_seconds())`` in one call (the engine reads both around each fetch)."""
    t = _total
    return t.s, t.cpu


def cpu_seconds() -> float:
    """This thread's running total of CPU seconds inside kernels timed with :func:`clock`."""
    return _total.cpu


def clock() -> tuple[float, float]:
    """``(wall, thread CPU)`` now: pass it to :func:`add_since` when the kernel returns."""
    return time.perf_counter(), time.thread_time()


def add_since(t0: tuple[float, float]) -> None:
    """Add the wall and this thread's CPU seconds since ``t0`` (:func:`clock`, taken just
    before a GIL-releasing kernel) to this thread's totals."""
    _total.s += time.perf_counter() - t0[0]
    _total.cpu += time.thread_time() - t0[1]
