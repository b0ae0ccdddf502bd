"""Task and result records, the worker loop every engine shares, and error transport.

A *task* is ``(task_id, epoch, key)``: ``key`` is what to fetch (a list of sample indices, one
index, or ``None`` for "the next batch of the iterable"; an iterable's epoch may start from a
:class:`ResumeAt` (the source's own resume, or each worker's saved state: :class:`WorkerResume`),
and an ``IterDataPipe``'s keys carry the epoch's graph seed: :class:`Seeded`). A :class:`Result` comes back with the
task id, the worker id, a kind (``OK``/``END``/``FAIL``/``EMPTY``), the value and the work's
timings. Exceptions travel as :class:`~kuat.engine.failure.Failure` records (picklable) and are
raised in the consumer as the original (a thread) or its equal (a process: type, args,
attributes, chain), with a note naming the worker, the stage that failed (``worker_init_fn``,
the dataset, ``collate_fn``, pinning, the hand-over) and the sample indices (:func:`failure`).
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kuat import rng as krng
from kuat.engine.failure import Failure

_LIVE: weakref.WeakSet = weakref.WeakSet()


class ClosedOnExit:
    """Engine mix-in: ``close()`` also runs when the engine is garbage-collected and, for every
    engine still open, before interpreter finalisation (workers must stop before, not during,
    it). An engine calls ``_track()`` when it starts workers and ``_untrack()`` once they are
    all gone. ``close()`` never waits for a worker that is busy in the dataset (error paths must
    hand control back at once); at exit, :meth:`_wait_stopped` then gives such workers a bounded
    time to leave the dataset before finalisation.
    """

    def _track(self) -> None:
        _LIVE.add(self)

    def _untrack(self) -> None:
        _LIVE.discard(self)

    def _wait_stopped(self, deadline: float) -> None:
        """Wait until ``deadline`` (``time.monotonic()``) for closed workers to end."""

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_EXIT_WAIT_S = 2.0  # at interpreter exit, how long closed workers may take to leave the dataset


@atexit.register
def _close_live_engines() -> None:
    import time

    engines = list(_LIVE)
    for engine in engines:
        engine.close()
    deadline = time.monotonic() + _EXIT_WAIT_S
    for engine in engines:
        engine._wait_stopped(deadline)

__all__ = ["OK", "END", "FAIL", "EMPTY", "Task", "Result", "WorkStats", "SchedProbe", "sched_times", "WorkerResume", "Seeded",
           "Failure",
           "failure",
           "serve", "START", "FETCH", "COLLATE", "PIN", "SEND", "WorkerCtx"]

OK, END, FAIL, EMPTY = 0, 1, 2, 3  # result kinds: batch, iterable exhausted, error, all skipped


class WorkerStopped(BaseException):
    """Raised in a thread worker between two samples of a task once its engine is closed: the
    loader gave up (a time-out, an error, ``break``), so nothing more of the task is fetched.
    A ``BaseException``, so ``on_error="skip"`` and the dataset's own ``except Exception``
    do not swallow it; :func:`serve` ends the worker quietly."""


class Task(NamedTuple):
    task_id: int
    epoch: int
    # list[int] (batch of indices) | int (batch_size=None) | None (iterable) | ResumeAt (an
    # iterable resumed through its kuat_iter_from hook)
    key: object
    base_seed: int  # per-worker global RNG seeds are base_seed + worker_id (as in torch)
    # threads the fetch may use (kuat._parallel): above 1 for an epoch's first batch of a
    # source that splits batches, while the loader holds the other workers back
    width: int = 1


class WorkStats:
    """Seconds a worker spent on one task, and the samples it produced or skipped.

    ``worker_state``: the worker's own dataset state after the task (pickled ``{"dataset",
    "iterator", "ended"}``), reported when the job asks for it (``FetchJob.worker_state``) and
    the worker's IterableDataset or its iterator has ``state_dict``; ``None`` otherwise.

    ``sched``: ``(cpu_s, runq_s, wall_s)`` of the fetch and collate, measured by a thread
    worker while the loader probes how its work shares the GIL (:class:`SchedProbe`): the
    thread's CPU seconds, its seconds runnable but waiting for a core (Linux
    ``/proc/thread-self/schedstat``; 0 elsewhere) and the wall seconds; ``None`` otherwise.

    ``worker_info_consulted``: whether this worker's dataset (or collate) had called
    ``torch.utils.data.get_worker_info()`` by the end of the task; set by thread and process
    workers of a map-style dataset (``True``: its batches may depend on the worker, so the
    consumer never fetches them in its place) and of an IterableDataset read by several workers
    (``False``: every worker yields every item); ``None`` when not applicable.
    """

    __slots__ = ("fetch_s", "fetch_cpu_s", "native_s", "native_cpu_s", "collate_s", "pin_s",
                 "rng_wait_s", "samples", "skipped", "worker_info_consulted", "worker_state",
                 "method", "python_s", "sched")

    def __init__(self):
        self.fetch_s = self.fetch_cpu_s = self.collate_s = self.pin_s = self.rng_wait_s = 0.0
        self.native_s = 0.0  # of fetch_s: inside GIL-releasing kernels (kuat._native)
        self.native_cpu_s = 0.0  # of fetch_cpu_s: the same kernels' CPU seconds
        self.method = ""  # the worker kind that ran it: "inline", "thread" or "process"
        self.python_s = 0.0  # CPU s outside those kernels (fetch + collate): the GIL held
        self.samples = 0
        self.skipped: list[tuple[object, str, str]] = []  # (index, type name, message)
        self.worker_info_consulted: bool | None = None
        self.worker_state: bytes | None = None
        self.sched: tuple[float, float, float] | None = None

    def __getstate__(self):
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state):
        for k, v in zip(self.__slots__, state):
            setattr(self, k, v)


class SchedProbe:
    """Shared by a loader's thread workers (``FetchJob.sched_probe``): while ``on`` (the
    loader's worker choice measures) or ``forced`` (``kuat.doctor`` runs; the inline engine
    too), each fetch reports :attr:`WorkStats.sched`. Set by the consumer thread, read by the
    workers (bools: no lock needed)."""

    __slots__ = ("on", "forced", "__weakref__")

    def __init__(self):
        self.on = self.forced = False

    def wanted(self, method: str) -> bool:
        return (self.on and method == "thread") or (self.forced and method != "process")

    def __getstate__(self):
        return (False,)  # process workers never probe

    def __setstate__(self, state):
        self.on = self.forced = False


def sched_times() -> tuple[float, float]:
    """``(cpu_s, runq_s)`` of the calling thread: CPU seconds, and seconds it was runnable
    but waiting for a core (``/proc/thread-self/schedstat``; ``runq_s`` is 0 where that is
    missing). About 10 us."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            cpu, runq = f.read().split()[:2]
        return int(cpu) * 1e-9, int(runq) * 1e-9
    except (OSError, ValueError):
        import time

        return time.thread_time(), 0.0


class Result:
    __slots__ = ("task_id", "worker_id", "kind", "value", "stats")

    def __init__(self, task_id, worker_id, kind, value, stats):
        self.task_id, self.worker_id, self.kind = task_id, worker_id, kind
        self.value, self.stats = value, stats

    def __getstate__(self):
        return (self.task_id, self.worker_id, self.kind, self.value, self.stats)

    def __setstate__(self, state):
        self.task_id, self.worker_id, self.kind, self.value, self.stats = state


class ResumeAt(NamedTuple):
    """Task key of an iterable source resumed mid-epoch: each worker starts its iterator with
    ``dataset.kuat_iter_from(epoch, batches, state)`` (``batches``: the rank's batches of the
    epoch already served; ``state``: what the source's ``kuat_state_at`` said there, or
    ``None``) instead of ``iter(dataset)``; otherwise as ``None``."""

    batches: int
    state: object = None


class WorkerResume(NamedTuple):
    """``ResumeAt.state`` of a torch IterableDataset resumed from its workers' own states (as
    torchdata's ``StatefulDataLoader``): ``states[worker_id]`` is what that worker reported
    (``WorkStats.worker_state``) with the last batch served, or ``None`` (start afresh). The
    worker loads its dataset's part, calls ``iter()``, then loads the iterator's part."""

    states: tuple


class Seeded(NamedTuple):
    """Task key of an ``IterDataPipe``'s epoch: ``key`` with the epoch's shared seed, which
    each worker applies to its copy's graph before iterating it (torch's
    ``graph_settings.apply_random_seed``, so every worker shuffles alike before sharding)."""

    shared_seed: int
    key: object


def describe_key(key: object) -> str:
    """What the task of ``key`` fetches, in words: ``"sample indices [2, 3]"``."""
    if isinstance(key, Seeded):
        key = key.key
    if key is None:
        return "the next batch of its IterableDataset"
    if isinstance(key, ResumeAt):
        return f"the next batch of its IterableDataset (resumed after {key.batches} batches)"
    if isinstance(key, list):
        return f"sample indices {key}"
    return f"sample index {key}"


def key_indices(key: object) -> list[int] | None:
    """The sample indices of the task of ``key``; None for an iterable's next batch."""
    if isinstance(key, Seeded):
        key = key.key
    if isinstance(key, list):
        return list(key)
    if key is None or isinstance(key, ResumeAt):
        return None
    return [key]


# The stage a worker was in when it failed (``Failure.stage``, ``kuat.WorkerError.stage``):
# its start, then per task (``FetchJob.run`` keeps ``WorkerCtx.stage`` up to date) the fetch
# (``__getitem__``/``__getitems__``, or ``next()`` of an IterableDataset), ``collate_fn``, the
# pinning of thread workers' batches, and a process worker's hand-over of the batch (its
# shared-memory slot and the pipe).
START, FETCH, COLLATE, PIN, SEND = "worker_init_fn", "fetch", "collate_fn", "pin_memory", "send"


@dataclass
class WorkerCtx:
    """One worker's own state (made by ``FetchJob.start``, passed to every ``FetchJob.run``)."""

    worker_id: int
    num_workers: int
    method: str  # "inline" | "thread" | "process"
    base_seed: int
    dataset: object = None  # this worker's dataset object (see worker_dataset)
    epoch: int | None = None
    iterator: object = None
    ended: bool = False
    extra: dict = field(default_factory=dict)
    probed: bool = False  # this worker's first batch ran isolated and probed (isolate.py)
    reports_state: bool = False  # the iterable or its iterator has state_dict (worker_state)
    collated: bool = False  # the iterator yields (rows, collated batch) (kuat_iter_collated)
    stage: str = FETCH  # what run() is doing: FETCH, COLLATE or PIN (names a failure's stage)
    # its worker_init_fn changed the global generators: the thread worker's own states
    # (worker_rng.OwnRng), or True in a process (its generators are its own)
    rng: object = None
    # set when the engine is closed (thread workers): no further sample of the task starts
    stop: threading.Event | None = None
    scope: object = None  # its FetchScope (kuat.engine.fetch_scope), made at its first batch
    fetch: object = None  # its dataset's collated fetch (FetchJob._get), found at first use
    items: int = 0  # items its iterable's iterator gave this epoch (or since the resume point)


def describe_failure(stage: str, key: object) -> str:
    """What failed, for the note: ``"in collate_fn, collating sample indices [2, 3]"``."""
    what = describe_key(key)
    if stage == START:
        return "while starting (in worker_init_fn), before its first batch"
    if stage == COLLATE:
        return f"in collate_fn, collating {what}"
    if stage == PIN:
        return f"while pinning the batch of {what} (pin_memory=True)"
    if stage == SEND:
        return f"while handing the batch of {what} to the loader (shared memory, pipe)"
    if key is None or isinstance(key, (ResumeAt, Seeded)):
        return f"while fetching {what}"
    return f"while fetching {what} from the dataset"


def describe_worker(name: str, method: str) -> str:
    """The worker called ``name`` in words: ``"kuat worker kuat-worker-1 (process 4242)"``."""
    kind = "thread" if method == "thread" else f"process {os.getpid()}"
    return f"kuat worker {name} ({kind})"


def failure(exc: BaseException, worker: str, where: str, stage: str, key: object) -> Failure:
    """The :class:`Failure` of ``exc``, raised in the worker named ``worker`` (described as
    ``where``: ``"kuat worker kuat-worker-1 (thread)"``) in ``stage`` of the task of ``key``.

    Its note, as torch's "Caught ValueError in DataLoader worker process 1" but naming the
    stage and the batch: ``"Raised in kuat worker kuat-worker-1 (thread) in collate_fn,
    collating sample indices [2, 3]."``; the failing sample (``kuat.rng.failed_sample``: its
    index, or an iterable item's position in this worker's epoch) is named.
    """
    indices = None if stage == START else key_indices(key)
    sample = krng.failed_sample(exc) if stage == FETCH else None
    if sample is not None and indices is not None and len(indices) > 1:
        note = f"Raised in {where} while fetching sample index {sample} (of sample indices {indices}) from the dataset."
    elif sample is not None and indices is None:  # an iterable's item
        resumed = isinstance(key.key if isinstance(key, Seeded) else key, ResumeAt)
        since = ("since the resumed epoch's position" if resumed
                 else "in this epoch")
        note = (f"Raised in {where} {describe_failure(stage, key)}: its iterator raised at "
                f"item {sample} of this worker's items {since} (counting from 0).")
    else:
        note = f"Raised in {where} {describe_failure(stage, key)}."
    return Failure(exc, worker, note, indices=indices, stage=stage)


def serve(
    job,
    worker_id: int,
    num_workers: int,
    method: str,
    name: str,
    base_seed: int,
    recv: Callable[[], Task | None],
    send: Callable[[Result], None],
    stop=None,
) -> None:
    """The loop of one worker: start the job, then run tasks until ``recv()`` returns None.

    An exception while starting (for example in ``worker_init_fn``) is reported as the result of
    every task, so the consumer raises it on its next batch. A ``SystemExit`` or
    ``KeyboardInterrupt``, while starting or in a task, is reported once and ends the loop.
    ``stop`` (thread workers): an event set when the engine closes, checked by the job
    between samples (:class:`WorkerStopped` then ends the loop, reporting nothing).
    """
    where = describe_worker(name, method)
    init_failure = None
    ctx = None
    try:
        ctx = (job.start(worker_id, num_workers, method, base_seed) if stop is None
               else job.start(worker_id, num_workers, method, base_seed, stop=stop))
    except BaseException as e:  # SystemExit too: a thread that died silently would hang the loader
        init_failure = failure(e, name, where, START, None)
    try:
        while True:
            task = recv()
            if task is None:
                return
            if init_failure is not None:
                send(Result(task.task_id, worker_id, FAIL, init_failure, None))
                if init_failure.ends_worker:
                    return
                continue
            try:
                kind, value, stats = job.run(ctx, task.epoch, task.key, task.base_seed,
                                             task.width)
            except Exception as e:
                kind, value, stats = FAIL, failure(e, name, where, ctx.stage, task.key), None
            except WorkerStopped:  # the engine closed during the task: nobody waits for it
                return
            except BaseException as e:  # SystemExit, KeyboardInterrupt: report, then end
                send(Result(task.task_id, worker_id, FAIL,
                            failure(e, name, where, ctx.stage, task.key), None))
                return
            send(Result(task.task_id, worker_id, kind, value, stats))
            del value
    finally:
        if ctx is not None:
            job.stop(ctx)
