"""What the loader chooses for its user, by measurement: the worker type under
``worker_type=None`` and the worker count under ``num_workers="auto"``.

Thread workers measure how their first batches ran (``kuat.engine.base.WorkStats.sched``: the
thread's CPU seconds, its seconds runnable but waiting for a core, and the wall seconds of each
fetch and collate), and the consumer measures its own time between batches. Over the first
:data:`PROBE_BATCHES` batches of the first epoch (after each worker's first, which warms up):

* **off-CPU share**: ``wait = wall - cpu - runqueue``, the seconds a worker was neither running
  nor waiting for a core: blocked on the GIL or on I/O. Runqueue time is excluded, so a loaded
  machine (other processes competing for the cores) does not look like GIL contention.
* **GIL-bound** when the batches do real CPU work (at least :data:`MIN_CPU_S` per batch), the
  workers spent at least :data:`WAIT_SHARE` of their time blocked, and that blocked time is no
  more than :data:`EXPLAIN` times what the *other* workers' CPU time could explain (``(N - 1) *
  (cpu + runqueue)``; with one worker, its own): threads convoying on the GIL wait while the
  others run Python; threads waiting on I/O wait far longer than the others run. GIL-bound work
  moves to process workers (on a machine with at least two usable cores); work that releases
  the GIL (kuat's own datasets, decoding, Arrow gathers, NumPy) and I/O-bound work stay on
  threads.
* **count** (``num_workers="auto"``): ``ceil(1.25 * cost / loop)`` workers, ``cost`` the
  seconds one batch takes a worker of the chosen type (CPU seconds for processes, wall seconds
  for threads), ``loop`` the training loop's own wall seconds per batch (between ``next()``
  calls), at least 1, at most the usable cores (``os.sched_getaffinity``), or four times that
  for thread workers that mostly wait on I/O. Before the decision ``loader.num_workers`` reads
  :func:`initial_workers` (the usable cores, at least 2, at most 8), an int as frameworks
  expect. An iterable dataset's count never changes (it splits itself by worker: the count
  decides which items each worker reads, and a resumed state holds one state per worker), nor
  that of a dataset whose workers called ``get_worker_info()``.

The decision is taken once per loader (it survives epochs and ``load_state_dict``; a loader
built afresh measures again, and the choice never changes a batch), logged once at INFO, and
shown by ``stats()["workers"]``. A map-style epoch moves at once (in-flight batches finish
first, the worker assignment goes on where it was); an iterable dataset's epoch ends on its
threads and the next epoch starts on the chosen workers (a worker moved mid-epoch would have to
replay its iterator). Not thread-safe: the consumer thread's.
"""

from __future__ import annotations

import logging
import math
import os
import time

__all__ = ["AUTO", "WorkerChoice", "initial_workers", "resolve_num_workers", "usable_cores"]

log = logging.getLogger("kuat.loader")

AUTO = "auto"
PROBE_BATCHES = 12  # batches measured (after each worker's first) before deciding
MIN_CPU_S = 0.2e-3  # CPU seconds per batch below which a hand-off to a process costs as much
WAIT_SHARE = 0.25  # of the workers' busy time spent blocked (GIL or I/O)
EXPLAIN = 1.5  # blocked time at most this many times the other workers' CPU time: the GIL
WAITED_SHARE = 0.5  # of the window the loop waited for the workers (they were never idle)
SERIAL_SLACK = 0.4  # ... and workers on a CPU at most 1 + this per further worker, though
# each fetch ran unblocked (batches shorter than the GIL's switch interval): one at a time
COUNT_MARGIN = 1.25  # workers: ceil(margin * batch cost / loop time per batch)
MAX_WORKERS = 8  # the initial guess's ceiling


def usable_cores() -> int:
    """The cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def initial_workers(cores: int) -> int:
    """``num_workers="auto"`` before the first batches are measured: the usable cores, at
    least 2 (two threads show whether the work holds the GIL), at most :data:`MAX_WORKERS`."""
    return min(max(2, cores), MAX_WORKERS)


def resolve_num_workers(num_workers) -> tuple[object, bool]:
    """``(num_workers, auto)``: ``"auto"`` becomes :func:`initial_workers` (``auto`` True);
    anything else passes through unchanged for torch's checks.

    Raises:
        ValueError: a string other than ``"auto"``.
    """
    if isinstance(num_workers, str):
        if num_workers != AUTO:
            raise ValueError(f"num_workers should be an int >= 0 or 'auto', got {num_workers=!r}")
        return initial_workers(usable_cores()), True
    return num_workers, False


class WorkerChoice:
    """One loader's worker choice: what is measured, what was decided and why (pickles with
    the loader, measurements included).

    Args:
        auto_type: ``worker_type=None`` with workers (the type is measured).
        auto_count: ``num_workers="auto"`` (the count is measured).
        worker_type: the type the loader starts with.
        num_workers: the count it starts with.
    """

    def __init__(self, *, auto_type: bool, auto_count: bool, worker_type: str, num_workers: int):
        self.auto_type, self.auto_count = auto_type, auto_count
        self.worker_type, self.num_workers = worker_type, num_workers
        self.decided = not (auto_type or auto_count)
        self.by = "measured" if not self.decided else "given"
        self.reason = "as given" if self.decided else "not measured yet"
        self.numbers: dict[str, float] = {}
        self._skip = num_workers  # each worker's first batch warms up: not measured
        self._n = 0
        self._wall = self._cpu = self._runq = self._native = 0.0
        self._threads = True  # every measured batch came from a thread worker
        self._loop_s, self._loops = 0.0, 0
        # the window from the first measured result to the decision: its wall start, and the
        # worker CPU + runqueue seconds and loop seconds within it
        self._t0: float | None = None
        self._win_busy = self._win_loop = 0.0
        self.worker_dependent = False  # a worker called get_worker_info(): keep the count
        self.applied = self.decided  # the loader's worker_type/num_workers follow the decision

    # --- measuring --------------------------------------------------------------------------
    @property
    def probing(self) -> bool:
        return not self.decided

    def observe(self, st) -> bool:
        """A worker's ``WorkStats``; True once enough batches are measured to decide."""
        if st.worker_info_consulted:
            self.worker_dependent = True
        if self._skip > 0:
            self._skip -= 1
            return False
        if st.sched is not None:
            cpu, runq, wall = st.sched
        else:  # a process worker: no GIL to share
            cpu, runq, wall = st.fetch_cpu_s, 0.0, st.fetch_s + st.collate_s
            self._threads = False
        if self._t0 is None:  # (its work was done before the window starts)
            self._t0 = time.perf_counter()
        else:
            self._win_busy += cpu + runq
        self._n += 1
        self._wall += wall
        self._cpu += cpu
        self._runq += runq
        self._native += st.native_s
        return self._n >= PROBE_BATCHES

    def loop(self, seconds: float) -> None:
        """The training loop's own wall seconds between two ``next()`` calls."""
        self._loop_s += seconds
        self._loops += 1
        if self._t0 is not None:
            self._win_loop += seconds

    # --- deciding ---------------------------------------------------------------------------
    def decide(self, *, num_workers: int, iterable: bool, persistent: bool,
               cores: int | None = None) -> tuple[str, int]:
        """Decide from what was measured; returns ``(worker_type, num_workers)`` (logged once,
        kept in ``self``)."""
        cores = usable_cores() if cores is None else cores
        n = max(1, self._n)
        wall, cpu, runq = self._wall, self._cpu, self._runq
        wait = max(0.0, wall - cpu - runq)
        others = max(1, num_workers - 1) * (cpu + runq)
        loop = self._loop_s / self._loops if self._loops else 0.0
        window = time.perf_counter() - self._t0 if self._t0 is not None else 0.0
        # workers on a CPU (or waiting for one) per second of the window, and the share of it
        # the loop waited for them (they had work queued all along)
        parallel = self._win_busy / window if window > 0 else 0.0
        waited = 1.0 - self._win_loop / window if window > 0 else 0.0
        # one fetch waited for another's Python (batches longer than the GIL's switch
        # interval), or whole batches ran one at a time while the loop waited for them
        convoy = wait >= WAIT_SHARE * wall and wait <= EXPLAIN * others
        serial = (num_workers >= 2 and waited >= WAITED_SHARE and wait < WAIT_SHARE * wall
                  and parallel <= 1 + SERIAL_SLACK * (num_workers - 1))
        gil = (self._threads and cpu / n >= MIN_CPU_S and self._native < 0.5 * wall
               and (convoy or serial))
        kind, why = self.worker_type, "as given"
        if self.auto_type:
            if gil and cores < 2:
                kind, why = "thread", "GIL-bound, but one usable core: processes cannot run in parallel"
            elif gil and iterable and persistent:
                kind, why = "thread", ("GIL-bound, but persistent workers of an iterable keep "
                                       "their dataset copies: threads kept")
            elif gil:
                kind, why = "process", "the work holds the GIL: thread workers wait for each other"
            elif not self._threads:
                kind, why = "process", "process workers (measured in processes)"
            elif cpu / n < MIN_CPU_S:
                kind, why = "thread", "batches too cheap for a process hand-off"
            elif wait < WAIT_SHARE * wall:
                kind, why = "thread", "the work releases the GIL: threads run in parallel"
            else:
                kind, why = "thread", "the workers mostly wait on I/O, not on the GIL"
        count = num_workers
        if self.auto_count and not iterable and not self.worker_dependent:
            cost = cpu / n if (kind == "process" and self._threads) else wall / n
            mostly_waiting = (cpu + runq) < 0.5 * wall and kind == "thread"
            cap = cores * (4 if mostly_waiting else 1)
            need = math.ceil(COUNT_MARGIN * cost / loop) if loop > 0 else cap
            count = max(1, min(cap, need))
            why += f"; {count} workers for a loop of {loop * 1e3:.2f} ms per batch"
        elif self.auto_count:
            why += ("; count kept: an iterable dataset splits itself by worker" if iterable else
                    "; count kept: the dataset asks get_worker_info()")
        self.worker_type, self.num_workers = kind, count
        self.decided, self.reason = True, why
        self.numbers = {
            "batches": self._n,
            "cpu_ms_per_batch": 1e3 * cpu / n,
            "wall_ms_per_batch": 1e3 * wall / n,
            "runqueue_ms_per_batch": 1e3 * runq / n,
            "blocked_share": wait / wall if wall > 0 else 0.0,
            "blocked_per_other_cpu": wait / others if others > 0 else 0.0,
            "loop_ms_per_batch": 1e3 * loop,
            "workers_on_cpu": parallel,
            "loop_waited_share": waited,
            "usable_cores": cores,
        }
        log.info("kuat.DataLoader: %d %s workers (%s): %d batches, %.3f ms CPU and %.3f ms wall "
                 "per batch, blocked %.0f%% of the time (%.2fx the other workers' CPU time), "
                 "%.2f workers on a CPU while the loop waited %.0f%% of the time, loop %.3f ms "
                 "per batch, %d usable cores", count, kind, why, self._n, 1e3 * cpu / n,
                 1e3 * wall / n, 100 * self.numbers["blocked_share"],
                 self.numbers["blocked_per_other_cpu"], parallel, 100 * waited, 1e3 * loop, cores)
        return kind, count

    def by_rng(self, reason: str, num_workers: int) -> None:
        """The global-RNG switch moved the loader to processes (:mod:`kuat.loader._workers`)."""
        self.worker_type, self.num_workers = "process", num_workers
        self.decided, self.applied, self.by, self.reason = True, True, "rng", reason

    def report(self, worker_type: str, num_workers: int) -> dict:
        """``stats()["workers"]``: the type and count in use, how they were chosen and why,
        and the measured numbers (empty before a measurement)."""
        return {"type": worker_type if num_workers else "inline", "num_workers": num_workers,
                "chosen": ("measuring" if not self.decided else self.by),
                "auto_type": self.auto_type, "auto_count": self.auto_count,
                "reason": self.reason, "measured": dict(self.numbers)}
