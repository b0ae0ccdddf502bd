"""Process-tree measurements: CPU seconds and PSS (proportional set size), via psutil.

PSS splits every shared page between the processes that map it, so summing PSS over a
process and its children counts shared memory (torch's libraries, a memory-mapped dataset,
fork copy-on-write pages) once, unlike RSS. It is read from ``/proc/<pid>/smaps_rollup``.
"""

from __future__ import annotations

import os
import threading
import time

import psutil


def tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and all its live descendants (those that vanish are skipped)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_pss_bytes(pid: int) -> int:
    """PSS in bytes summed over ``pid`` and its live descendants (0 if ``pid`` is gone)."""
    total = 0
    for p in tree(pid):
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return total


def tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of ``pid`` (default: this process) and its descendants.

    Includes the reaped children of every process in the tree (``children_user`` /
    ``children_system``), so a worker that exited since the last call is still counted
    once its parent has waited for it.
    """
    total = 0.0
    for p in tree(os.getpid() if pid is None else pid):
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class PeakPssSampler:
    """Samples the PSS of a process tree every ``interval_s`` seconds in a daemon thread.

    ``peak_bytes`` is the highest sum seen; ``samples`` the number of readings taken.
    Start with ``start()``, end with ``stop()`` (idempotent). Not thread-safe beyond that.
    """

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kuat-bench-pss", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            pss = tree_pss_bytes(self.pid)
            if pss:
                self.peak_bytes = max(self.peak_bytes, pss)
                self.samples += 1
            self._stop.wait(self.interval_s)

    def start(self) -> PeakPssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def now() -> float:
    """Monotonic wall clock in seconds."""
    return time.perf_counter()
