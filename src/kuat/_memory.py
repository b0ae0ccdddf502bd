"""Peak memory of a process tree, sampled in a background thread (Linux ``smaps_rollup``).

PSS (proportional set size) is the honest sum over processes: pages shared by several
processes (torch's libraries mapped by every worker, fork copy-on-write pages) are divided
among them instead of being counted once per process, as RSS would. It is split by kind
(Linux >= 5.7): ``anon`` (heaps, tensors: what a loader really holds), ``file`` (file-backed
pages such as a memory-mapped dataset shard: page cache the kernel can reclaim) and ``shmem``
(shared memory that the tree maps, e.g. process workers' batch pools in ``/dev/shm``).

PSS only sees pages some process maps. torch's worker processes put each batch in a
``/dev/shm`` file and send its descriptor; the prefetched batches waiting for the training loop
are mapped by no process, so no PSS shows them. Two more kinds therefore read the machine:
``shm_system`` (``Shmem`` of ``/proc/meminfo``: every ``/dev/shm``, ``memfd`` and tmpfs page in
RAM, mapped or not; system-wide, so meaningful on an otherwise quiet machine) and
``anon_shared`` (``anon + shm_system`` read together): what a loader holds that the kernel
cannot reclaim.

The sampler costs CPU (a quarter to half of a core on 2 cores); never time a loader while it runs.
"""

from __future__ import annotations

import os
import threading

import psutil

KINDS = ("pss", "anon", "file", "shmem", "shm_system", "anon_shared")
_FIELDS = {b"Pss:": "pss", b"Pss_Anon:": "anon", b"Pss_File:": "file", b"Pss_Shmem:": "shmem"}


def pss_bytes(pid: int) -> dict[str, int]:
    """PSS of one process in bytes by kind (:data:`KINDS`); zeros when the process is gone.
    Without ``smaps_rollup`` (not Linux), ``pss`` falls back to RSS and the kinds stay 0."""
    out = dict.fromkeys(KINDS, 0)
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                parts = line.split()
                kind = _FIELDS.get(parts[0]) if parts else None
                if kind is not None:
                    out[kind] = int(parts[1]) * 1024  # kB -> bytes
        return out
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    try:
        out["pss"] = psutil.Process(pid).memory_info().rss
    except psutil.Error:
        pass
    return out


def system_shmem_bytes() -> int:
    """The machine's shared memory in RAM in bytes (``Shmem`` of ``/proc/meminfo``: ``/dev/shm``
    files, ``memfd``, tmpfs; mapped by a process or not); 0 where unreadable."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"Shmem:"):
                    return int(line.split()[1]) * 1024  # kB -> bytes
    except OSError:
        pass
    return 0


def tree_pss_bytes(pid: int | None = None) -> dict[str, int]:
    """:func:`pss_bytes` summed over ``pid`` (default: this process) and all its descendants,
    with ``shm_system`` (:func:`system_shmem_bytes`) and ``anon_shared`` (``anon`` + it)."""
    root = psutil.Process(pid or os.getpid())
    try:
        pids = [root.pid] + [c.pid for c in root.children(recursive=True)]
    except psutil.Error:
        pids = [root.pid]
    total = dict.fromkeys(KINDS, 0)
    for p in pids:
        for kind, v in pss_bytes(p).items():
            total[kind] += v
    total["shm_system"] = system_shmem_bytes()
    total["anon_shared"] = total["anon"] + total["shm_system"]
    return total


class PeakMemory:
    """Context manager sampling :func:`tree_pss_bytes` every ``interval_s`` seconds.

    Attributes (dicts of bytes by kind, valid after exit): ``baseline`` (at entry), ``peak``
    (each kind's own peak, so the kinds need not add up to ``pss``) and ``added``
    (``peak - baseline`` per kind).
    """

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.baseline = dict.fromkeys(KINDS, 0)
        self.peak = dict.fromkeys(KINDS, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        for kind, v in tree_pss_bytes().items():
            self.peak[kind] = max(self.peak[kind], v)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakMemory:
        self.baseline = tree_pss_bytes()
        self.peak = dict(self.baseline)
        self._thread = threading.Thread(target=self._run, name="kuat-pss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    @property
    def added(self) -> dict[str, int]:
        return {kind: self.peak[kind] - self.baseline[kind] for kind in KINDS}
