"""Peak memory of a process tree, sampled in a background thread (Linux ``smaps_rollup``).

PSS (proportional set size) is the honest sum over processes: pages shared by several
processes (torch's libraries mapped by every worker, fork copy-on-write pages) are divided
among them instead of being counted once per process, as RSS would.
"""

from __future__ import annotations

import os
import threading

import psutil


def pss_bytes(pid: int) -> int:
    """PSS of one process in bytes; falls back to RSS where smaps_rollup is unavailable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def tree_pss_bytes(pid: int | None = None) -> int:
    """PSS summed over ``pid`` (default: this process) and all its descendants."""
    root = psutil.Process(pid or os.getpid())
    try:
        pids = [root.pid] + [c.pid for c in root.children(recursive=True)]
    except psutil.Error:
        pids = [root.pid]
    return sum(pss_bytes(p) for p in pids)


class PeakMemory:
    """Context manager sampling :func:`tree_pss_bytes` every ``interval_s`` seconds.

    Attributes (bytes, valid after exit): ``baseline`` (at entry), ``peak``, ``added``
    (``peak - baseline``).
    """

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.baseline = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, tree_pss_bytes())

    def __enter__(self) -> PeakMemory:
        self.baseline = self.peak = tree_pss_bytes()
        self._thread = threading.Thread(target=self._run, name="kuat-pss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, tree_pss_bytes())

    @property
    def added(self) -> int:
        return self.peak - self.baseline
