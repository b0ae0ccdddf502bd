"""Seconds each thread spends inside native kernels that release the GIL (for ``stats()``).

A source's heavy per-sample work (a JPEG region decode, a resize) runs in C with the GIL
released; everything around it (planning, generators, wrapping, the loop) is Python. To show
how much of a fetch is that Python, the kernels' wrappers add their wall time here
(:func:`add`) and the engine reads the per-thread total before and after a
fetch (:func:`seconds`). The loader reports the difference as ``busy_s["native"]`` and
``fetch_python_fraction``.

Neutral ground: the engine knows nothing of images and ``kuat.vision`` nothing of the engine;
both import only this. Cost: one ``time.perf_counter()`` pair (about 0.1 us) per kernel call.

Thread-safety: the total is per thread (each thread only adds to and reads its own).
"""

from __future__ import annotations

import threading

__all__ = ["add", "seconds"]


class _Total(threading.local):
    def __init__(self):
        self.s = 0.0


_total = _Total()


def add(seconds_: float) -> None:
    """Add ``seconds_`` (wall seconds spent in a GIL-releasing kernel) to this thread's total."""
    _total.s += seconds_


def seconds() -> float:
    """This thread's running total of kernel seconds (only differences are meaningful)."""
    return _total.s
