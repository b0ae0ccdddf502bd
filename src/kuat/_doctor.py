"""``kuat.doctor(loader)`` (and ``kuat doctor``): run a few steps of a training loop and say, in one line, whether it
waits for its input, by how much, and which stage of the input to look at, with the numbers.

It reads what the loader measures (:meth:`kuat.DataLoader.stats`, the difference over the steps
it runs) and the time the loop spends between ``next()`` calls (``step_fn``, or nothing). The
stages, and the evidence for each (per batch):

* **storage**: the workers' fetch waited (wall time far above its CPU time) and did not convoy
  on the GIL: reading files, a network, a remote store;
* **decode**: most of the fetch ran inside GIL-releasing kernels that report themselves
  (``kuat.vision``'s decodes and resizes: ``busy_s["native"]``);
* **Python/GIL**: the fetch and collate are CPU time outside such kernels (per-sample
  ``__getitem__``, per-row iterables, transforms in Python); with thread workers, also fetches
  that waited for one another's GIL (``stats()["workers"]``);
* **hand-off**: kuat's own per-batch machinery (dispatch, ordering, crossing threads or
  processes: ``loader_overhead_us_per_batch``) is most of the wait;
* **host-to-device copy**: copies to the device (``device=``, ``pin_memory``) are most of it.

Input-bound means the loop spent at least :data:`INPUT_BOUND` of its time inside ``next()``.
Not a torch API: a kuat diagnostic. Works with any ``kuat.DataLoader``; iterates it (starting
epochs as a training loop would: the loader's position moves on).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kuat.engine.base import sched_times

__all__ = ["Diagnosis", "doctor"]

INPUT_BOUND = 0.10  # share of the loop's time inside next() from which it is input-bound
_NUMBERS = ("consumer_wait_s", "worker_wait_s", "elapsed_s", "batches", "samples")
_BUSY = ("fetch", "fetch_cpu", "native", "runqueue", "collate", "pin", "rng_lock_wait", "device",
         "batch_transform")


@dataclass
class Diagnosis:
    """What :func:`doctor` found. ``str()`` is the one-line verdict.

    Attributes:
        input_bound: the loop spent at least ``INPUT_BOUND`` of its time waiting in ``next()``.
        wait_share: that share (0..1).
        speedup: how much faster the loop would run with instant input (``total / step``).
        stage: ``"storage"``, ``"decode"``, ``"Python/GIL"``, ``"hand-off"``,
            ``"host-to-device copy"``, or ``None`` when not input-bound.
        steps: batches taken.
        numbers: milliseconds per batch of each measure (``wait``, ``step``, ``fetch``,
            ``fetch_cpu``, ``native``, ``collate``, ``device``, ``overhead``, ...), the
            workers' type and count and how they were chosen.
        line: the verdict.
    """

    input_bound: bool
    wait_share: float
    speedup: float
    stage: str | None
    steps: int
    numbers: dict[str, Any] = field(default_factory=dict)
    line: str = ""

    def __str__(self) -> str:
        return self.line


def doctor(loader, steps: int = 50, step_fn: Callable[[Any], Any] | None = None) -> Diagnosis:
    """Run ``steps`` batches of ``loader`` through ``step_fn`` and diagnose the input.

    Args:
        loader: a :class:`kuat.DataLoader` (its statistics are read, never reset).
        steps: batches measured (int >= 1), after one more that is not (it pays for the
            epoch's and the workers' start); new epochs start when one ends (an empty loader
            gives up after two epochs without a batch).
        step_fn: the training step, called with each batch (its time is the loop's own);
            ``None``: the loop does nothing (how fast can the input go?).

    Returns:
        A :class:`Diagnosis`; ``str()`` of it is the one-line verdict.

    Raises:
        TypeError: ``loader`` is not a ``kuat.DataLoader`` (no ``stats()``).
        ValueError: ``steps`` is not a positive int.
        Whatever iterating the loader or ``step_fn`` raises.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps should be a positive int, got {steps=!r}")
    if not callable(getattr(loader, "stats", None)):
        raise TypeError(f"kuat.doctor needs a kuat.DataLoader (with stats()), got "
                        f"{type(loader).__name__}")
    probe = getattr(getattr(loader, "_job", None), "sched_probe", None)
    if probe is not None:  # workers in threads and the loop's own thread report runqueue time
        probe.forced = True
    try:
        epochs = _Epochs(loader)
        taken = _run(epochs, 1, step_fn)[0]  # warm-up: the epoch's and the workers' start
        before = loader.stats()
        epochs.runq = 0.0
        t_start = time.perf_counter()
        taken, step_s = _run(epochs, steps, step_fn) if taken else (0, 0.0)
        total_s = time.perf_counter() - t_start
    finally:
        if probe is not None:
            probe.forced = False
    return diagnose(before, loader.stats(), taken, step_s, total_s, epochs.runq)


class _Epochs:
    """The loader's batches, epoch after epoch; ``next()`` returns ``None`` when two epochs in a
    row had no batch (an empty loader)."""

    def __init__(self, loader):
        self._loader, self._it = loader, iter(loader)
        self.runq = 0.0  # seconds this thread waited for a core inside next()

    def next(self):
        r0 = sched_times()[1]
        try:
            for _ in range(2):
                try:
                    return (next(self._it),)
                except StopIteration:
                    self._it = iter(self._loader)
            return None
        finally:
            self.runq += sched_times()[1] - r0


def _run(epochs: _Epochs, steps: int, step_fn) -> tuple[int, float]:
    """``(batches taken, seconds in step_fn)`` of up to ``steps`` batches."""
    step_s, taken = 0.0, 0
    while taken < steps:
        got = epochs.next()
        if got is None:
            break
        t0 = time.perf_counter()
        if step_fn is not None:
            step_fn(got[0])
        step_s += time.perf_counter() - t0
        taken += 1
    return taken, step_s


def _delta(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in _NUMBERS}
    d["busy"] = {k: after["busy_s"][k] - before["busy_s"][k] for k in _BUSY}
    return d


def diagnose(before: dict, after: dict, steps: int, step_s: float, total_s: float,
             loop_runq: float = 0.0) -> Diagnosis:
    """The verdict from two ``stats()`` snapshots around ``steps`` batches, the loop's own
    seconds ``step_s``, the wall seconds ``total_s`` of the whole run and ``loop_runq``, the
    seconds the loop's thread waited for a core inside ``next()`` (a loaded machine's delay,
    not kuat's hand-off)."""
    d = _delta(before, after)
    workers = after.get("workers", {})
    n = max(1, steps)
    wait = d["consumer_wait_s"]
    busy = d["busy"]
    wait_share = wait / total_s if total_s > 0 else 0.0
    speedup = total_s / step_s if step_s > 0 else float("inf")
    inline = workers.get("num_workers", 0) == 0
    work = busy["fetch"] + busy["collate"] + busy["pin"]
    # the loop thread's runqueue time inside next(), less the inline fetches' own (counted in
    # their fetch time already)
    stalled = max(0.0, loop_runq - (busy["runqueue"] if inline else 0.0))
    overhead = max(0.0, wait - (work if inline else d["worker_wait_s"]) - busy["device"]
                   - busy["batch_transform"] - stalled)
    ms = {  # per batch
        "wait": wait, "step": step_s, "fetch": busy["fetch"], "fetch_cpu": busy["fetch_cpu"],
        "runqueue": busy["runqueue"],
        "native": busy["native"], "collate": busy["collate"], "pin": busy["pin"],
        "device": busy["device"], "overhead": overhead, "rng_lock_wait": busy["rng_lock_wait"],
    }
    numbers: dict[str, Any] = {k: 1e3 * v / n for k, v in ms.items()}
    numbers.update(workers=workers.get("type"), num_workers=workers.get("num_workers"),
                   chosen=workers.get("chosen"), samples_per_s=d["samples"] / total_s
                   if total_s > 0 else 0.0)
    bound = wait_share >= INPUT_BOUND
    stage = _stage(ms, workers) if bound else None
    head = (f"input-bound: the loop waited {100 * wait_share:.0f}% of {total_s:.2f} s "
            f"({numbers['wait']:.2f} ms per batch, its own step {numbers['step']:.2f} ms); "
            + (f"{_times(speedup)} faster with instant input" if numbers["step"] >= MIN_STEP_MS
               else "the loop does nothing else (time a real step: step_fn=, or --step), so it "
                    "runs at the input's rate") if bound else
            f"not input-bound: the loop waited {100 * wait_share:.0f}% of {total_s:.2f} s "
            f"({numbers['wait']:.2f} ms per batch against a step of {numbers['step']:.2f} ms): "
            "the step itself is the bottleneck")
    line = head if stage is None else f"{head}. Look at {stage}: {_evidence(stage, numbers)}"
    return Diagnosis(bound, wait_share, speedup, stage, steps, numbers, line)


MIN_STEP_MS = 0.05  # a loop step shorter than this per batch is an empty loop: no speed-up


def _times(x: float) -> str:
    return "unboundedly" if x == float("inf") else f"{x:.1f}x"


def _stage(ms: dict, workers: dict) -> str:
    """The stage the wait comes from (see the module docstring)."""
    wait = ms["wait"]
    if ms["device"] >= 0.5 * wait:
        return "host-to-device copy"
    work = ms["fetch"] + ms["collate"]
    if ms["overhead"] >= 0.5 * wait or work <= 0:
        return "hand-off"
    if ms["native"] >= 0.5 * ms["fetch"]:
        return "decode"
    if "GIL" in str(workers.get("reason", "")) and "holds" in str(workers.get("reason", "")):
        return "Python/GIL"
    # off a core by choice (the runqueue is a loaded machine's delay): I/O, or, in thread
    # workers, another's GIL (then about as long as the others' CPU time, not far longer)
    off_cpu = ms["fetch"] - ms["fetch_cpu"] - ms["runqueue"]
    if off_cpu >= 0.5 * (ms["fetch"] - ms["runqueue"]) and off_cpu >= 2 * ms["fetch_cpu"]:
        return "storage"
    return "Python/GIL"


def _evidence(stage: str, n: dict) -> str:
    chosen = _CHOSEN.get(n["chosen"], n["chosen"])
    who = (f"{n['num_workers']} {n['workers']} workers ({chosen})" if n["num_workers"]
           else "no workers (the loop's own thread)")
    per = "ms per batch"
    if stage == "host-to-device copy":
        return f"copies took {n['device']:.2f} {per} of the {n['wait']:.2f} ms waited; {who}"
    if stage == "hand-off":
        return (f"kuat's own dispatch and hand-off took {n['overhead']:.2f} {per} of the "
                f"{n['wait']:.2f} ms waited (fetch {n['fetch']:.2f}, collate {n['collate']:.2f}); "
                f"{who}")
    if stage == "decode":
        return (f"native decoding took {n['native']:.2f} of the {n['fetch']:.2f} {per} fetching; "
                f"{who}: more workers, or a cheaper decode (smaller images, ROI decode)")
    if stage == "storage":
        return (f"fetches took {n['fetch']:.2f} {per}, only {n['fetch_cpu']:.2f} of it on CPU "
                f"({n['runqueue']:.2f} waiting for a core): waiting on reads; {who}: more "
                "workers, a local copy, or larger reads")
    from kuat.loader._auto import usable_cores

    more = ("more process workers (num_workers=)" if (n["num_workers"] or 0) < usable_cores()
            else "the workers have every core already: less Python per sample")
    fix = (f"{more}, or batched reads (__getitems__, kuat's formats)"
           if n["workers"] == "process" else
           "process workers (worker_type=None chooses them when this holds the GIL), or "
           "batched reads (__getitems__, kuat's formats)")
    return (f"fetches took {n['fetch']:.2f} {per} ({n['fetch_cpu']:.2f} on CPU, "
            f"{n['native']:.2f} in native kernels) and collate {n['collate']:.2f}; {who}: {fix}")


# stats()["workers"]["chosen"] in words
_CHOSEN = {"measuring": "type still being measured", "measured": "type chosen by measurement",
           "rng": "processes: the dataset draws from the global random generators",
           "given": "as given"}
