"""Process-tree measurements: CPU seconds and PSS (proportional set size), via psutil.

PSS splits every shared page between the processes that map it, so summing PSS over a
process and its children counts shared memory (torch's libraries, a memory-mapped dataset,
fork copy-on-write pages) once, unlike RSS. It is read from ``/proc/<pid>/smaps_rollup``,
split by kind (Linux >= 5.7 reports the split; older kernels give the total only):

- ``anon``: anonymous memory (heaps, tensors, Python objects): what the loader really costs;
- ``file``: file-backed pages (shared libraries, a memory-mapped dataset shard): page cache
  the kernel can drop and re-read under memory pressure;
- ``shmem``: shared memory that the tree maps (``/dev/shm`` batch pools of process workers,
  tmpfs files), split like any shared page.

PSS only sees pages that some process maps. torch's worker processes put each batch in a
``/dev/shm`` file and send its descriptor; until the training loop receives it (``prefetch_factor
x num_workers`` batches at a time) no process maps it, so it appears in no PSS at all: 46 MiB
of ImageNet batches (5 x 9.2 MiB) with 2 workers, measured. :func:`tree_pss` therefore also
reads ``shm_system``, the machine's shared memory in RAM (``Shmem`` in ``/proc/meminfo``: every
``/dev/shm`` file, ``memfd`` and tmpfs page, mapped or not). It is system-wide: its change over
a run is the run's own only on an otherwise quiet machine, which ``kuat bench`` asks for anyway.
What a loader holds that the kernel cannot drop (short of swapping) is ``anon_shared``,
``anon + shm_system`` read together (so its peak is one moment's sum, not two peaks added).

As a script, it runs a command and prints the peak PSS of its process tree by kind::

    python -m benchmarks.measure [--interval-s 0.05] -- python train.py ...
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


PSS_KINDS = ("pss", "anon", "file", "shmem")
# what tree_pss() and the sampler report: the PSS kinds of the tree plus the machine's shared memory
MEMORY_KINDS = (*PSS_KINDS, "shm_system", "anon_shared")
_ROLLUP_FIELDS = {
    b"Pss:": "pss",
    b"Pss_Anon:": "anon",
    b"Pss_File:": "file",
    b"Pss_Shmem:": "shmem",
}


def pss_breakdown(pid: int) -> dict[str, int] | None:
    """``{"pss", "anon", "file", "shmem"}`` in bytes of one process from its
    ``smaps_rollup``; ``None`` when the process is gone or unreadable. On kernels without
    the split, ``anon``/``file``/``shmem`` are 0 and only ``pss`` is meaningful."""
    out = dict.fromkeys(PSS_KINDS, 0)
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                key = _ROLLUP_FIELDS.get(line.split(maxsplit=1)[0]) if line else None
                if key is not None:
                    out[key] = int(line.split()[1]) * 1024  # kB -> bytes
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return out


ANON_KINDS = ("heap", "arenas", "stacks", "batch_sized", "other")
_ARENA_ALIGN = 64 << 20  # glibc's per-thread malloc arenas: 64 MiB-aligned reservations


def anon_by_mapping(pid: int, batch_bytes: int | None = None) -> dict[str, int] | None:
    """Anonymous resident bytes of one process by what holds them, from ``/proc/<pid>/smaps``
    (RSS, not PSS: the anonymous pages of one process are its own); ``None`` when unreadable.

    - ``heap``: the main ``brk`` heap (the main thread's malloc arena);
    - ``arenas``: glibc's per-thread malloc arenas (a 64 MiB-aligned read-write mapping
      followed by its ``PROT_NONE`` reserve): worker threads' ``malloc`` (libjpeg's state,
      a decoder's scratch, small NumPy arrays) stays resident there after ``free``;
    - ``stacks``: ``[stack]`` and thread stacks (a mapping right after a guard page);
    - ``batch_sized``: with ``batch_bytes``, anonymous mappings whose size is a multiple of
      it (one batch buffer each, or neighbours the kernel merged into one mapping);
    - ``other``: every other anonymous mapping (large mallocs, tensors, NumPy arrays, and a
      batch buffer the kernel merged with a neighbour of another size).

    Diff two readings (before building a loader, after its epochs) to see what a loader added.
    """
    rows = []  # (start, end, perms, name, anonymous bytes)
    try:
        with open(f"/proc/{pid}/smaps") as f:
            cur = None
            for line in f:
                head = line.split(maxsplit=6)
                if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    cur = [lo, hi, head[1], head[5].strip() if len(head) > 5 else "", 0]
                    rows.append(cur)
                elif head[0] == "Anonymous:" and cur is not None:
                    cur[4] = int(head[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    out = dict.fromkeys(ANON_KINDS, 0)
    for k, (lo, hi, _perms, name, anon) in enumerate(rows):
        if not anon:
            continue
        prev = rows[k - 1] if k else None
        nxt = rows[k + 1] if k + 1 < len(rows) else None
        if name == "[heap]":
            kind = "heap"
        elif name.startswith("[stack"):
            kind = "stacks"
        elif name:
            continue  # file-backed (a private file mapping's written pages)
        elif (lo % _ARENA_ALIGN == 0 and nxt is not None and nxt[0] == hi
              and nxt[2].startswith("---") and nxt[1] - lo <= _ARENA_ALIGN):
            kind = "arenas"
        elif prev is not None and prev[1] == lo and prev[2].startswith("---") \
                and prev[1] - prev[0] <= 64 << 10 and not prev[3]:
            kind = "stacks"
        elif batch_bytes and (hi - lo) % batch_bytes < 4096 and hi - lo >= batch_bytes:
            kind = "batch_sized"
        else:
            kind = "other"
        out[kind] += anon
    return out


def _load_kuat_memory():
    """``kuat._memory`` (kuat's own PSS sampler: standard library and psutil only), loaded
    from this checkout by path: peers run in interpreters where kuat is not installed."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "src" / "kuat" / "_memory.py"
    spec = importlib.util.spec_from_file_location("_kuat_bench_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The machine's shared memory in RAM in bytes (``Shmem`` of ``/proc/meminfo``: ``/dev/shm``
# files, ``memfd``, tmpfs, SysV segments; mapped by a process or not); 0 where unreadable.
system_shmem_bytes = _load_kuat_memory().system_shmem_bytes


def tree_pss(pid: int) -> dict[str, int]:
    """:func:`pss_breakdown` summed over ``pid`` and its live descendants (zeros if gone),
    plus ``shm_system`` (:func:`system_shmem_bytes`) and ``anon_shared`` (``anon`` +
    ``shm_system``): bytes by kind of :data:`MEMORY_KINDS`."""
    total = dict.fromkeys(MEMORY_KINDS, 0)
    for p in tree(pid):
        one = pss_breakdown(p.pid)
        if one is not None:
            for k in PSS_KINDS:
                total[k] += one[k]
    total["shm_system"] = system_shmem_bytes()
    total["anon_shared"] = total["anon"] + total["shm_system"]
    return total


def tree_pss_bytes(pid: int) -> int:
    """PSS in bytes summed over ``pid`` and its live descendants (0 if ``pid`` is gone)."""
    return tree_pss(pid)["pss"]


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

    ``peak_bytes`` is the highest total PSS seen; ``peak`` holds the highest value of each
    kind of :data:`MEMORY_KINDS` (each kind's own peak, so they need not add up); ``samples`` is the number of readings taken. Start with ``start()``, end with
    ``stop()`` (idempotent). Not thread-safe beyond that.

    The sampler costs CPU (a quarter to half of a core on a 2-core machine with process
    workers), so ``kuat bench`` never runs it while it times a loader: memory is measured in
    runs of its own.
    """

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak = dict.fromkeys(MEMORY_KINDS, 0)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kuat-bench-pss", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = tree_pss(self.pid)
            if now["pss"]:
                for k in MEMORY_KINDS:
                    self.peak[k] = max(self.peak[k], now[k])
                self.samples += 1
            self._stop.wait(self.interval_s)

    @property
    def peak_bytes(self) -> int:
        return self.peak["pss"]

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


def main(argv: list[str] | None = None) -> int:
    """Run ``argv``'s command, sample its process tree's PSS, print each kind's peak (MiB) and
    how much the machine's shared memory grew meanwhile."""
    import argparse
    import subprocess

    p = argparse.ArgumentParser(description="peak PSS of a command's process tree, by kind")
    p.add_argument("--interval-s", type=float, default=0.05, help="sampling period (s)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command (after --)")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("give the command to measure after --")
    shm_before = system_shmem_bytes()
    proc = subprocess.Popen(cmd)
    sampler = PeakPssSampler(proc.pid, args.interval_s).start()
    try:
        rc = proc.wait()
    finally:
        sampler.stop()
    peak = {k: v / 2**20 for k, v in sampler.peak.items()}
    print(
        f"peak PSS {peak['pss']:.1f} MiB: anonymous {peak['anon']:.1f}, file-backed "
        f"{peak['file']:.1f}, shared {peak['shmem']:.1f} ({sampler.samples} samples, "
        f"every {args.interval_s:g} s; each kind's own peak); the machine's shared memory "
        f"grew by up to {(sampler.peak['shm_system'] - shm_before) / 2**20:.1f} MiB"
    )
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
