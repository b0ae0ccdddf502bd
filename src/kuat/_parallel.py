"""Split one batch's GIL-free work over idle cores: the first batch of an epoch.

When an epoch starts, every worker is idle and the training loop waits for batch 0. Fetched
by one worker, batch 0 takes a whole batch's decode time while the other workers decode
batches the loop does not need yet. Instead the loader gives batch 0 a *width* (its number of
workers) and holds the other workers back until batch 0 is out; the source's batch kernel asks
:func:`width` and, when it is above 1, runs parts of the batch with :func:`run_parts`: the
first part in the calling worker, the others on helper threads of this process. At most
``width`` threads are busy, so the cores the held-back workers would use are used instead.

Neutral ground (as :mod:`kuat._native`): the engine sets the width around a fetch
(:class:`share`), a source's kernel (``kuat.vision``'s batch decode) reads it; neither
imports the other. Parts must be independent (each writes only its own slots of a batch
buffer) and must not run user code or draw random numbers: a part's result must not depend on
the thread that runs it, so the pixels are the same at every width.

Helpers are threads started for one call and joined before it returns (``width - 1`` of them:
one per held-back worker; starting one costs about 0.1 ms, once per epoch), so no thread
outlives the fetch and nothing is left behind by a ``fork``. Accounting (for the loader's ``stats()``): the busy wall seconds, CPU seconds
and native-kernel seconds of the parts run by helpers are added to per-thread totals of the
calling thread (:func:`helper_totals`), and the caller's wait for them counts as native-kernel
time (the caller runs no Python meanwhile).

Thread-safety: :func:`run_parts` may be called from any number of threads at once (each call
starts and waits for its own helpers).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kuat import _native

__all__ = ["share", "width", "run_parts", "helper_totals", "add_helper_times",
           "split_even"]


class _Local(threading.local):
    def __init__(self):
        self.width = 1
        # (busy wall s, cpu s, native s, native cpu s) of parts helpers ran for this thread
        # (cumulative)
        self.busy_s = self.cpu_s = self.native_s = self.native_cpu_s = 0.0


_local = _Local()


def thread_state() -> _Local:
    """This module's per-thread state (a ``threading.local``: ``width``, ...), for
    :class:`kuat.engine.fetch_scope.FetchScope`, which sets ``width`` as :class:`share` does
    together with the fetch's other settings. Internal."""
    return _local


class share:  # noqa: N801 (used like a function: ``with share(2):``)
    """Let the fetch in this thread use up to ``n`` threads (itself included); nestable."""

    __slots__ = ("_n", "_prev")

    def __init__(self, n: int):
        self._n = max(1, int(n))

    def __enter__(self):
        self._prev, _local.width = _local.width, self._n
        return self

    def __exit__(self, *exc) -> None:
        _local.width = self._prev


def width() -> int:
    """How many threads the current fetch in this thread may use (1: no split)."""
    return _local.width


def helper_totals() -> tuple[float, float, float, float]:
    """``(busy_s, cpu_s, native_s, native_cpu_s)`` of the parts helpers ran for this thread,
    cumulative (only differences are meaningful): wall seconds, CPU seconds, native-kernel
    wall and CPU seconds (:mod:`kuat._native`)."""
    return _local.busy_s, _local.cpu_s, _local.native_s, _local.native_cpu_s


def add_helper_times(busy_s: float, cpu_s: float, native_s: float, native_cpu_s: float) -> None:
    """Count a helper's seconds for the calling thread (:func:`helper_totals`): :func:`run_parts`
    does for its parts, a C kernel that starts its own helper threads for its own."""
    _local.busy_s += busy_s
    _local.cpu_s += cpu_s
    _local.native_s += native_s
    _local.native_cpu_s += native_cpu_s


def split_even(costs: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` ranges of ``costs`` with nearly equal sums, at most ``parts``
    of them, none empty (fewer when there are fewer items)."""
    n = len(costs)
    parts = max(1, min(parts, n))
    total = float(sum(costs))
    bounds, acc, lo = [], 0.0, 0
    for j, c in enumerate(costs):
        acc += c
        k = len(bounds) + 1  # the range being filled
        remaining_items, remaining_ranges = n - j - 1, parts - k
        if k < parts and (acc >= total * k / parts or remaining_items == remaining_ranges):
            bounds.append((lo, j + 1))
            lo = j + 1
    if lo < n:
        bounds.append((lo, n))
    return bounds


class _Part:
    __slots__ = ("fn", "result", "error", "busy_s", "cpu_s", "native_s", "native_cpu_s")

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.result = self.error = None
        self.busy_s = self.cpu_s = self.native_s = self.native_cpu_s = 0.0


def _run_part(part: _Part) -> None:
    t0, c0, n0 = time.perf_counter(), time.thread_time(), _native.seconds()
    nc0 = _native.cpu_seconds()
    try:
        part.result = part.fn()
    except BaseException as e:  # handed to the caller, raised there
        part.error = e
    part.busy_s = time.perf_counter() - t0
    part.cpu_s = time.thread_time() - c0
    part.native_s = _native.seconds() - n0
    part.native_cpu_s = _native.cpu_seconds() - nc0
    part.fn = None


def run_parts(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run ``fns`` concurrently, ``fns[0]`` in this thread, the others on helper threads;
    return their results in order once all have finished.

    Raises the exception of the lowest-numbered part that raised (after every part ended, so
    no part still writes into a buffer the caller is about to drop). Meant for parts that
    release the GIL (C kernels); it gains nothing for Python code.
    """
    if len(fns) <= 1:
        return [fn() for fn in fns]
    parts = [_Part(fn) for fn in fns[1:]]
    threads = [threading.Thread(target=_run_part, args=(p,), name=f"kuat-helper-{k}", daemon=True)
               for k, p in enumerate(parts)]
    for t in threads:
        t.start()
    first_error, results = None, [None]
    try:
        results[0] = fns[0]()
    except BaseException as e:
        first_error = e
    t0 = _native.clock()
    for t in threads:
        # no time-out: a part writes into the caller's buffer, which must not be handed on
        # (or reused) while a helper may still write; parts are bounded C kernels
        t.join()
    _native.add_since(t0)  # waiting for the helpers' kernels: no Python runs
    for p in parts:
        add_helper_times(p.busy_s, p.cpu_s, p.native_s, p.native_cpu_s)
        if first_error is None and p.error is not None:
            first_error = p.error
        results.append(p.result)
    if first_error is not None:
        try:
            raise first_error
        finally:
            first_error = None
    return results
