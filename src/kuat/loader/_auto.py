"""What the loader chooses for its user, by measurement: the worker type under
``worker_type=None`` and the worker count under ``num_workers="auto"``.

Thread workers measure how their first batches ran (``kuat.engine.base.WorkStats.sched``: the
thread's CPU seconds, its seconds runnable but waiting for a core, and the wall seconds of each
fetch and collate), a probe thread (:class:`GilProbe`) samples whether it finds the GIL held,
and the consumer measures its own time between batches. Over the first :data:`PROBE_BATCHES`
batches of the first epoch (after each worker's first, which warms up), and for thread workers
until the probe has looked at the GIL for :data:`PROBE_WINDOW_S` (short batches: 12 of them may
last a few milliseconds, too few looks; batches cheaper than :data:`MIN_CPU_S` need no look,
and at most :data:`MAX_PROBE_BATCHES` batches are measured):

* **blocked**: ``wait = wall - cpu - runqueue``, the seconds a fetch was neither running nor
  waiting for a core: blocked on the GIL or on I/O (runqueue time is excluded, so a loaded
  machine does not look like either).
* **GIL-bound** when all of: the batches do real CPU work (at least :data:`MIN_CPU_S` per batch:
  cheaper ones are the inline policy's), outside GIL-releasing kernels that report themselves;
  the probe thread found the GIL held (it waited over :data:`GIL_HELD_S` for it, beyond its
  sleep and its own wait for a core) in at least :data:`GIL_HELD` of its takes (a time average
  of the GIL's occupancy, whatever the length of a batch: Python holds it most of the time;
  I/O waits and NumPy-style kernels leave it free; the probe's mean wait, by contrast, shrinks
  with batches shorter than the switch interval, which release it at each hand-off), or in at
  least :data:`GIL_SOME` of them while the workers' CPU seconds per second stayed at most
  :data:`SERIAL_PARALLEL` though they waited for a core at most :data:`SERIAL_RUNQ` of the
  time they wanted one (workers with cores to run on that never ran together: the GIL
  serialized them; short batches on an idle machine, whose GIL is released at every hand-off,
  can read under 0.4; on a loaded machine CPU seconds per second say nothing); the workers' CPU
  seconds per second stayed under :data:`MAX_PARALLEL` (above it they evidently ran in
  parallel); and either the fetches convoyed (blocked at least :data:`WAIT_SHARE` of their time, and no more
  than :data:`EXPLAIN` times what the other workers' CPU time explains: threads waiting on I/O
  wait far longer than the others run) or, with two or more workers, they were fetching
  (together: one worker at a time is all the GIL allows) at least :data:`BUSY_SHARE` of the
  time while the fetches themselves ran unblocked (whole batches of Python one at a time, each
  shorter than the GIL's switch interval: the waits fall between fetches). GIL-bound
  work moves to process workers on a machine with at least two usable cores that are not
  already busy (the workers waited for a core at most :data:`BUSY_MACHINE` of the time they
  wanted one, and other processes left at least :data:`SPARE_CORES` of the usable cores'
  CPU idle while the window was measured (``/proc/stat``'s busy time less this process's,
  :func:`others_cores`; elsewhere the 1-minute load average, which also counts the last
  minute's past): on a busier machine each process
  hand-off waits for a core on both sides, and short batches ran at 0.2-0.65x the speed of
  inline fetching, see docs/benchmarks.md). Where
  processes cannot help (one core, a busy machine) and the loop waited for its batches (its
  own CPU time under :data:`kuat.loader._adaptive.INLINE_MAX_LOOP_SHARE` of a batch's CPU), a
  map-style dataset whose batches do not depend on the worker is fetched **inline**, in the
  loop's thread (threads holding the GIL run one at a time anyway, and each hand-off costs);
  else threads stay. Anything else (kuat's own datasets, decoding, Arrow gathers, NumPy, I/O)
  stays on threads. On a heavily loaded machine the signals blur, and the rule keeps threads
  (the default before it) unless the probe found the GIL held (then inline, as above).
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
first, the worker assignment goes on where it was; an inline decision takes the next batch
and every batch of later epochs: ``kuat.loader._adaptive``), and so does a kuat stream
(``kuat.sources.stream.Stream``: the new workers replay the epoch's first batches and skip
them); any other iterable dataset's epoch ends on its threads and the next epoch starts on the
chosen workers. Not thread-safe: the consumer thread's.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref

from kuat.engine.base import sched_times
from kuat.loader._adaptive import INLINE_MAX_LOOP_SHARE

__all__ = ["AUTO", "WorkerChoice", "initial_workers", "machine_load", "resolve_num_workers",
           "usable_cores"]

log = logging.getLogger("kuat.loader")

AUTO = "auto"
PROBE_BATCHES = 12  # batches measured (after each worker's first) before deciding
PROBE_WINDOW_S = 0.03  # ... and seconds of GIL probing (thread workers): 40-60 takes when
# the GIL is released often (short batches), fewer but longer waits when it is held for long
MAX_PROBE_BATCHES = 400  # ... unless this many batches went by (the probe ran out)
MIN_CPU_S = 0.5e-3  # CPU seconds per batch below which a hand-off to a process costs as much
# (the loader's "cheap" batches: kuat.loader._adaptive.CHEAP_BATCH_S, which go inline instead)
WAIT_SHARE = 0.25  # of the workers' busy time spent blocked (GIL or I/O)
EXPLAIN = 1.5  # blocked time at most this many times the other workers' CPU time: the GIL
BUSY_SHARE = 0.5  # of the window the workers spent fetching, together (they, not the loop,
# held the GIL)
MAX_PARALLEL = 1.5  # worker CPU seconds per second above which they evidently ran in parallel
GIL_HELD = 0.4  # of the probe's takes that found the GIL held: Python held it much of the time
# (measured on 2 cores at loads of 1.5-5, batch 64 of 10-20 us of Python per item: 0.46-1.0;
# NumPy sorts and sleeps: 0.02-0.27)
GIL_SOME = 0.3  # ... or this much, while the workers' CPU per second stayed <= SERIAL_PARALLEL
SERIAL_PARALLEL = 1.1  # (two workers with GIL-free work on 2 idle cores: 1.4-1.9)
SERIAL_RUNQ = 0.15  # ... while they waited for a core at most this share of the time (idle
# machine: under 0.1; a load of 3-5 on 2 cores: 0.35-0.75)
GIL_HELD_S = 100e-6  # a take that waited longer than this found the GIL held (a sleep's own
# overshoot, Linux's 50 us timer slack, stays under it)
PROBE_SLEEP_S = 0.5e-3  # the probe thread's sleep between two takes of the GIL
PROBE_MAX_S = 30.0  # the probe thread ends by itself after this long
PROBE_IDLE_S = 5.0  # ... or after this long without a measured batch (the epoch ended)
SPARE_CORES = 1.5  # idle cores (usable cores less other processes' CPU) below which
# processes wait for cores (at a load of 4-5 on 2 cores, 2 processes ran a 0.7 ms-batch Python
# dataset at 0.5-0.65x inline even when the GIL-bound threads rarely waited for a core)
BUSY_MACHINE = 0.25  # runqueue share of the workers' wanted CPU above which no core is spare
# (load ~3 on 2 cores: 0.35-0.55, and 2 processes ran a 0.7 ms-batch Python dataset at 0.5x
# inline; an idle machine: under 0.1)
COUNT_MARGIN = 1.25  # workers: ceil(margin * batch cost / loop time per batch)
MAX_WORKERS = 8  # the initial guess's ceiling


def usable_cores() -> int:
    """The cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def machine_load() -> float:
    """The machine's 1-minute load average (``os.getloadavg``: runnable and waiting tasks,
    this process's included); 0 where there is none. The fallback of :func:`others_cores`."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def cpu_snapshot() -> tuple[float, float, float, int] | None:
    """``(machine busy CPU seconds, this process's CPU seconds, monotonic seconds, CPUs)`` now:
    the machine's from ``/proc/stat`` (user, nice, system, irq, softirq, steal of all CPUs),
    this process's from ``time.process_time()`` (all its threads); None where ``/proc/stat``
    cannot be read (not Linux)."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read(1 << 16).split(b"\n")
        head = lines[0].split()
        ticks = [int(x) for x in head[1:9]]
        cpus = sum(1 for ln in lines if ln.startswith(b"cpu") and ln[3:4].isdigit())
        busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]
        return busy / os.sysconf("SC_CLK_TCK"), time.process_time(), time.monotonic(), cpus
    except (OSError, ValueError, IndexError):
        return None


def others_cores(start, end, cores: int) -> float:
    r"""The usable cores' worth of CPU that *other* processes used between two
    :func:`cpu_snapshot`\ s: the machine's busy seconds less this process's, per second,
    scaled from the machine's CPUs to the ``cores`` this process may use (evenly spread);
    without snapshots, the 1-minute load average less this process's one runnable thread
    (which also counts the last minute's past, this process's earlier work included)."""
    if start is None or end is None or end[2] - start[2] < 1e-3:
        return max(0.0, machine_load() - 1)
    other = max(0.0, (end[0] - start[0]) - (end[1] - start[1])) / (end[2] - start[2])
    return other * min(1.0, cores / max(1, end[3]))


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
        self.reason = "as given" if self.decided else (
            f"not decided yet: measured over {PROBE_BATCHES} batches after each worker's "
            "first (warm-up) batch; an epoch shorter than that keeps the type it started with")
        self.numbers: dict[str, float] = {}
        self._skip = num_workers  # each worker's first batch warms up: not measured
        self._n = 0
        self._wall = self._cpu = self._runq = self._native = 0.0
        self._threads = True  # every measured batch came from a thread worker
        self._loop_s, self._loops = 0.0, 0
        self._loop_cpu = 0.0  # the loop's own CPU seconds (its wall time counts GIL waits)
        # the window from the first measured result to the decision: its wall start, and the
        # worker CPU + runqueue seconds and loop seconds within it
        self._t0: float | None = None
        self._cpu0 = None  # cpu_snapshot() at the window's start
        self._win_busy = self._win_wall = 0.0
        self._gil_wait = self._gil_total = 0.0  # the probe thread's (GilProbe)
        self._takes = self._held = 0  # its takes of the GIL, and those that found it held
        self.inline = False  # decided: fetch in the loop's thread (a thread-type choice)
        self._gil_probe: GilProbe | None = None
        self.worker_dependent = False  # a worker called get_worker_info(): keep the count
        self.initial = num_workers  # the count the loader started with (the initial guess)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_gil_probe"] = None
        return state

    # --- measuring --------------------------------------------------------------------------
    @property
    def probing(self) -> bool:
        return not self.decided

    def start_probe(self, flag) -> None:
        """Start the GIL probe thread (:class:`GilProbe`) unless one runs; it runs while
        ``flag.on`` (the job's ``SchedProbe``), at most :data:`PROBE_MAX_S`."""
        if self._gil_probe is None or not self._gil_probe.is_alive():
            self._gil_probe = GilProbe(self, flag)
            self._gil_probe.start()

    def gil_waited(self, wait: float, total: float) -> None:
        """The probe thread waited ``wait`` of ``total`` seconds for the GIL (counted from the
        first measured batch on)."""
        if self._t0 is not None:
            self._gil_wait += wait
            self._gil_total += total
            self._takes += 1
            self._held += wait > GIL_HELD_S

    def observe(self, st) -> bool:
        """A worker's ``WorkStats``; True once enough batches (and, for thread workers, GIL
        probe takes) are measured to decide."""
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
            self._t0, self._cpu0 = time.perf_counter(), cpu_snapshot()
        else:
            self._win_busy += cpu
            self._win_wall += wall
        self._n += 1
        self._wall += wall
        self._cpu += cpu
        self._runq += runq
        self._native += st.native_s
        return self._n >= PROBE_BATCHES and (
            not self._threads or self._gil_total >= PROBE_WINDOW_S  # (looked long enough)
            or self._cpu < MIN_CPU_S * self._n or self._n >= MAX_PROBE_BATCHES)  # (no need)

    def loop(self, seconds: float, cpu: float = 0.0) -> None:
        """The training loop's own wall seconds between two ``next()`` calls, and its thread's
        CPU seconds in them."""
        self._loop_s += seconds
        self._loop_cpu += cpu
        self._loops += 1

    # --- deciding ---------------------------------------------------------------------------
    def decide(self, *, num_workers: int, iterable: bool, persistent: bool,
               cores: int | None = None, other_cpu: float | None = None) -> tuple[str, int]:
        """Decide from what was measured; returns ``(worker_type, num_workers)`` (logged once,
        kept in ``self``). ``cores`` (usable) and ``other_cpu`` (the cores' worth of CPU other
        processes used during the measured window, :func:`others_cores`) are measured unless
        given."""
        cores = usable_cores() if cores is None else cores
        if other_cpu is None:
            other_cpu = others_cores(self._cpu0, cpu_snapshot(), cores)
        spare = cores - other_cpu
        n = max(1, self._n)
        wall, cpu, runq = self._wall, self._cpu, self._runq
        wait = max(0.0, wall - cpu - runq)
        others = max(1, num_workers - 1) * (cpu + runq)
        loop = self._loop_s / self._loops if self._loops else 0.0
        loop_cpu = self._loop_cpu / self._loops if self._loops else 0.0
        window = time.perf_counter() - self._t0 if self._t0 is not None else 0.0
        # worker CPU seconds per second of the window (above 1: they ran in parallel), and the
        # share of it the workers spent fetching (the loop's own time is no measure: its Python
        # waits for the GIL too)
        parallel = self._win_busy / window if window > 0 else 0.0
        busy = self._win_wall / (num_workers * window) if window > 0 else 0.0
        gil_busy = self._gil_wait / self._gil_total if self._gil_total > 0 else 0.0
        held = self._held / self._takes if self._takes else 0.0
        # one fetch waited for another's Python (batches longer than the GIL's switch
        # interval), or, while the workers were busy (they had work all along), the
        # GIL was held for long stretches: whole batches of Python ran one at a time
        # (either way the probe thread found the GIL held most of the time: I/O waits, or
        # work that releases the GIL, leave it free)
        convoy = wait >= WAIT_SHARE * wall and wait <= EXPLAIN * others
        serial = num_workers >= 2 and busy * num_workers >= BUSY_SHARE and wait < 0.5 * wall
        gil = (self._threads and cpu / n >= MIN_CPU_S and self._native < 0.5 * wall
               and (held >= GIL_HELD or (held >= GIL_SOME and parallel <= SERIAL_PARALLEL
                                         and runq <= SERIAL_RUNQ * (cpu + runq)))
               and parallel <= MAX_PARALLEL and (convoy or serial))
        # inline instead, where processes cannot help: the loop waits for its batches (threads
        # holding the GIL run them one at a time, as the loop's thread would, plus hand-offs)
        inline_ok = (not iterable and not self.worker_dependent
                     and loop_cpu <= INLINE_MAX_LOOP_SHARE * cpu / n)
        busy_machine = runq > BUSY_MACHINE * (cpu + runq) or spare < SPARE_CORES
        kind, why = self.worker_type, "as given"
        if self.auto_type:
            if gil and (cores < 2 or busy_machine):
                kind, why = "thread", (
                    "GIL-bound, but one usable core: processes cannot run in parallel"
                    if cores < 2 else
                    f"GIL-bound, but the workers waited for a core {100 * runq / (cpu + runq):.0f}"
                    f"% of the time and other processes used {other_cpu:.1f} of the {cores} "
                    f"usable cores' CPU while it was measured, leaving {spare:.1f}: no spare "
                    "core for processes to run in parallel (each batch's hand-off would wait "
                    "for one too)")
                if inline_ok:
                    self.inline = True
                    why += ("; fetched inline, in the loop's thread (it waited for its batches: "
                            "threads would run them one at a time, plus a hand-off each)")
            elif gil and iterable and persistent:
                kind, why = "thread", ("GIL-bound, but persistent workers of an iterable keep "
                                       "their dataset copies: threads kept")
            elif gil:
                kind, why = "process", "the work holds the GIL: thread workers wait for each other"
            elif not self._threads:
                kind, why = "process", ("the measured batches already ran in process workers "
                                        "(moved there first, e.g. for a dataset drawing from "
                                        "the global random generators): processes kept")
            elif cpu / n < MIN_CPU_S:
                kind, why = "thread", "batches too cheap for a process hand-off"
            elif wait >= cpu:
                kind, why = "thread", "the workers mostly wait on I/O, not on the GIL"
            elif busy < BUSY_SHARE:
                kind, why = "thread", "the workers were mostly idle: threads keep up"
            else:
                kind, why = "thread", "the work releases the GIL: threads run in parallel"
        count = num_workers
        if self.auto_count and not iterable and not self.worker_dependent:
            cost = cpu / n if (kind == "process" and self._threads) else wall / n
            mostly_waiting = wait >= 2 * cpu and kind == "thread"  # (on I/O: not the GIL)
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
            "loop_cpu_ms_per_batch": 1e3 * loop_cpu,
            "workers_on_cpu": parallel,
            "gil_busy_share": gil_busy,
            "gil_held_share": held,
            "gil_probe_takes": self._takes,
            "workers_busy_share": busy,
            "usable_cores": cores,
            "other_processes_cores": other_cpu,
        }
        log.info("kuat.DataLoader: %d %s workers (%s): %d batches, %.3f ms CPU and %.3f ms wall "
                 "per batch, blocked %.0f%% of the time (%.2fx the other workers' CPU time), "
                 "GIL held at %.0f%% of %d probe takes while the workers were busy %.0f%% of the "
                 "time, loop %.3f ms per batch, %d usable cores", count, kind, why, self._n,
                 1e3 * cpu / n, 1e3 * wall / n, 100 * self.numbers["blocked_share"],
                 self.numbers["blocked_per_other_cpu"], 100 * held, self._takes, 100 * busy,
                 1e3 * loop, cores)
        return kind, count

    def by_rng(self, reason: str, num_workers: int) -> None:
        """The global-RNG switch moved the loader to processes (:mod:`kuat.loader._workers`)."""
        self.worker_type, self.num_workers = "process", num_workers
        self.decided, self.by, self.reason = True, "rng", reason

    def no_processes(self, why: str) -> None:
        """Process workers chosen here, or for the RNG, could not start (``_workers.py``):
        thread workers stay, and ``why`` joins the reason."""
        if not self.decided:
            self.by, self.reason = "rng", "processes wanted"
        self.worker_type, self.decided = "thread", True
        self.inline = False
        if why not in self.reason:  # (a copy of the loader tries again, once)
            self.reason = f"{self.reason}; {why}"

    def report(self, loader) -> dict:
        """``stats()["workers"]``: the type and count in use, how they were chosen and why,
        and the measured numbers (empty before a measurement)."""
        worker_type, num_workers = loader.worker_type, loader.num_workers
        inline = not num_workers or (self.inline and worker_type == "thread")
        return {"type": "inline" if inline else worker_type, "num_workers": num_workers,
                "chosen": ("measuring" if not self.decided else self.by),
                "auto_type": self.auto_type, "auto_count": self.auto_count,
                "reason": self.reason, "measured": dict(self.numbers)}


class GilProbe(threading.Thread):
    """A daemon thread that takes the GIL every :data:`PROBE_SLEEP_S` and measures how long it
    waited for it: the wall time of ``time.sleep`` beyond the sleep, less the thread's own
    runqueue time (a loaded machine's delay, not the GIL's). Python held by other threads makes
    it wait (until the holder's next release: the end of its batch, or the switch interval, 5
    ms); work that releases the GIL, or waits on I/O, lets it in at once. The share of takes
    that waited (:data:`GIL_HELD_S`) samples how much of the time the GIL was held. Costs about
    10% of a core while it runs (the first batches of an epoch, until the choice is made: 30 ms
    for short batches)."""

    def __init__(self, choice: WorkerChoice, flag):
        super().__init__(name="kuat-gil-probe", daemon=True)
        # weak: the probe ends with its loader (and keeps neither alive)
        self._choice, self._flag = weakref.ref(choice), weakref.ref(flag)

    def run(self) -> None:
        end = time.perf_counter() + PROBE_MAX_S
        seen, idle_until = -1, 0.0
        _, r0 = sched_times()
        while True:
            choice, flag = self._choice(), self._flag()
            if choice is None or flag is None or not flag.on or choice.decided:
                return
            t0 = time.perf_counter()
            if choice._n != seen:  # no batch for PROBE_IDLE_S: the epoch ended (or paused)
                seen, idle_until = choice._n, t0 + PROBE_IDLE_S
            if t0 > end or t0 > idle_until:
                return
            del choice, flag
            time.sleep(PROBE_SLEEP_S)
            t1 = time.perf_counter()
            _, r1 = sched_times()
            runq, r0 = r1 - r0, r1  # (its share of a loaded machine counts neither way)
            choice = self._choice()
            if choice is not None:
                choice.gil_waited(max(0.0, t1 - t0 - PROBE_SLEEP_S - runq),
                                  max(PROBE_SLEEP_S, time.perf_counter() - t0 - runq))
