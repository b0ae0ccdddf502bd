"""What a loader measured: cumulative counters and the :meth:`DataLoader.stats` report.

The iterator adds each batch's work (``kuat.engine.base.WorkStats``, measured in the worker) and
the consumer's own times; :meth:`LoaderStats.report` turns the sums into rates and fractions.
Thread-safety: every update and the report hold ``lock`` (``stats()`` may be called from any
thread while a loop iterates).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

__all__ = ["LoaderStats"]

FOLD_EVERY = 32  # results queued in LoaderStats.work before the iterator sums them


class LoaderStats:
    """Cumulative counters of one loader (all its iterators, and its skip_first_batches copies).

    Seconds are wall seconds (``time.perf_counter``) unless named ``*_cpu_s`` (the worker
    thread's ``time.thread_time``).
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def __getstate__(self):
        with self.lock:
            self.fold()
            state = dict(self.__dict__)
        del state["lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.lock = threading.Lock()

    def reset(self):
        self.fetch_s = self.fetch_cpu_s = self.collate_s = self.pin_s = self.rng_wait_s = 0.0
        self.native_s = self.native_cpu_s = self.consumer_cpu_s = 0.0
        # the loop's waits for a worker's result (added by the iterator once per next()):
        # worker_wait_s of wall time, wait_cpu_s of it on a CPU (waking up, taking the GIL
        # back: not Python, left out of python_us_per_sample's consumer; an inline fetch runs
        # inside this wait, and is counted as a worker's)
        self.wait_cpu_s = 0.0
        self.runq_s = 0.0  # of fetch + collate, waiting for a core (when measured)
        # CPU seconds outside GIL-releasing kernels (WorkStats.python_s), by worker kind
        self.python_s = {"inline": 0.0, "thread": 0.0, "process": 0.0}
        self.device_s = self.transform_s = self.wait_s = self.worker_wait_s = self.elapsed_s = 0.0
        self.batches = self.samples = self.skipped = 0
        # (WorkStats, counted) of results taken and not yet summed: the iterator appends each
        # result's worker-side times, and its samples when counted (a batch yielded, not one
        # discarded on resume); a deque, so that append needs no lock
        self.work: collections.deque = collections.deque()

    def fold(self) -> None:
        """Sum the queued results (:attr:`work`) into the counters: :meth:`report` first, and
        the iterator each ``FOLD_EVERY`` results, in one warm loop under the lock its ``next()``
        takes anyway, not one cold call and lock per batch (issue 31). Caller holds ``lock``."""
        work, python_s = self.work, self.python_s
        while work:
            st, counted = work.popleft()
            self.fetch_s += st.fetch_s
            self.fetch_cpu_s += st.fetch_cpu_s
            self.native_s += st.native_s
            self.native_cpu_s += st.native_cpu_s
            if st.method in python_s:
                python_s[st.method] += st.python_s
            self.collate_s += st.collate_s
            self.pin_s += st.pin_s
            self.rng_wait_s += st.rng_wait_s
            if st.sched is not None:  # measured (kuat.engine.base.SchedProbe)
                self.runq_s += st.sched[1]
            if counted:
                self.samples += st.samples
            self.skipped += len(st.skipped)

    def overhead_s(self, num_workers: int) -> float:
        """Seconds ``next()`` spent in kuat's own machinery (see :meth:`report`)."""
        work = self.fetch_s + self.collate_s + self.pin_s if num_workers == 0 else self.worker_wait_s
        return max(0.0, self.wait_s - work - self.device_s - self.transform_s)

    def report(self, num_workers: int, workers: dict | None = None) -> dict[str, Any]:
        """The dict :meth:`kuat.DataLoader.stats` returns (its docstring says what each key is);
        ``workers``: the worker choice's report (``kuat.loader._auto``), under ``"workers"``."""
        with self.lock:
            self.fold()
            el = self.elapsed_s
            overhead = self.overhead_s(num_workers)
            return {
                "batches": self.batches,
                "samples": self.samples,
                "skipped_samples": self.skipped,
                "elapsed_s": el,
                "busy_s": {
                    "fetch": self.fetch_s,
                    "fetch_cpu": self.fetch_cpu_s,
                    "native": self.native_s,
                    "native_cpu": self.native_cpu_s,
                    "runqueue": self.runq_s,
                    "collate": self.collate_s,
                    "pin": self.pin_s,
                    "rng_lock_wait": self.rng_wait_s,
                    "device": self.device_s,
                    "batch_transform": self.transform_s,
                },
                "consumer_wait_s": self.wait_s,
                "worker_wait_s": self.worker_wait_s,
                "input_bound_fraction": self.wait_s / el if el > 0 else 0.0,
                "batches_per_s": self.batches / el if el > 0 else 0.0,
                "samples_per_s": self.samples / el if el > 0 else 0.0,
                "worker_busy_fraction": (self.fetch_s + self.collate_s) / (el * max(1, num_workers))
                if el > 0 else 0.0,
                "loader_overhead_us_per_batch": overhead / self.batches * 1e6
                if self.batches else 0.0,
                "loader_overhead_fraction": overhead / el if el > 0 else 0.0,
                # of the dataset calls, the part outside GIL-releasing kernels that report
                # themselves (kuat.vision's decodes and resizes); None when none reported
                "fetch_python_fraction": max(0.0, self.fetch_s - self.native_s) / self.fetch_s
                if self.native_s > 0 and self.fetch_s > 0 else None,
                "python_us_per_sample": self._python_per_sample(),
                "workers": workers if workers is not None else {},
            }

    def _python_per_sample(self) -> dict[str, float | None]:
        """Microseconds of Python (CPU time outside the GIL-releasing kernels) per sample.

        ``workers``: the fetches and collates, wherever they ran (CPU time of the fetch outside
        the kernels that report themselves through :mod:`kuat._native`, plus the collate's);
        ``consumer``: the loop thread's CPU time inside ``next()``, less the fetches it ran
        itself and its waits for a result (the system calls of blocking and waking: the GIL
        is free then): dispatch, hand-off, ordering, bookkeeping, device copies; ``main_process``:
        ``consumer`` plus the fetches of thread and inline workers, the time the training
        process's GIL is held per sample, the budget of issue 31 (process workers hold their
        own GILs). How it compares to an external sampler of the GIL (py-spy ``--gil``,
        ``docs/benchmarks.md``, "GIL per image"): CPU time is what holds the GIL on an idle
        machine; it counts GIL-free system calls and copies as Python (an upper bound there),
        and it misses the time a preempted thread holds the GIL while off a CPU (which a
        wall-clock sampler counts on a busy machine). All ``None`` before any sample.
        Caller holds ``lock``."""
        n = self.samples
        if not n:
            return {"workers": None, "consumer": None, "main_process": None}
        workers = sum(self.python_s.values())
        # (an inline fetch runs inside the loop's wait for its result: in wait_cpu_s)
        consumer = max(0.0, self.consumer_cpu_s - self.wait_cpu_s)
        main = consumer + self.python_s["thread"] + self.python_s["inline"]
        return {"workers": 1e6 * workers / n, "consumer": 1e6 * consumer / n,
                "main_process": 1e6 * main / n}  # fmt: skip
