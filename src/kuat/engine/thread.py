"""N worker threads: one task queue each, one shared result queue.

Threads are daemons named ``kuat-worker-<i>``; each runs :func:`kuat.engine.base.serve` and
sees its own ``torch.utils.data.get_worker_info()``. Work that releases the GIL (decoding,
resizing, copies, Arrow gathers) runs truly in parallel.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable

from kuat.engine.base import ClosedOnExit, Result, Task, serve

__all__ = ["ThreadEngine"]

log = logging.getLogger("kuat.engine")
_JOIN_S = 0.05  # close(): how long to wait for idle workers to end (busy ones are not waited for)


class _Closing:
    __slots__ = ("now",)

    def __init__(self):
        self.now = False


class ThreadEngine(ClosedOnExit):
    """``num_workers`` daemon threads running ``job``; see the package docstring for the API."""

    def __init__(self, job, num_workers: int, base_seed: int, *, name: str = "kuat-worker"):
        self.num_workers = num_workers
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self._tasks: list[queue.SimpleQueue[Task | None]] = [
            queue.SimpleQueue() for _ in range(num_workers)
        ]
        self._threads = []
        self._closed = False
        self._stop = threading.Event()
        # set with _stop, read by each worker's recv as a plain attribute (Event.is_set() is a
        # Python call per task)
        self._closing = _Closing()
        self._track()
        for i in range(num_workers):
            t = threading.Thread(
                target=serve,
                args=(job, i, num_workers, "thread", f"{name}-{i}", base_seed),
                kwargs={"recv": self._recv_for(i), "send": self._results.put,
                        "stop": self._stop},
                name=f"{name}-{i}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)

    def _recv_for(self, worker_id: int):
        # The closure holds the queue and the event, not the engine (which must stay collectable).
        tasks, closing = self._tasks[worker_id], self._closing

        def recv() -> Task | None:
            task = tasks.get()
            # once closed, tasks still queued are dropped: a worker ends after its current one
            return None if closing.now else task

        return recv

    def worker_name(self, worker_id: int) -> str:
        return self._threads[worker_id].name

    def submit(self, worker_id: int, task: Task) -> None:
        self._tasks[worker_id].put(task)

    def calls(self) -> tuple[list, Callable[[float | None], Result]]:
        """``(submits, get)``: per worker, its ``submit(worker_id, task)`` as a callable
        taking the task, and :meth:`get`, as the queues' own C methods: the calls the
        loader's per-batch loop makes, without a Python frame each (issue 31)."""
        return [q.put for q in self._tasks], functools.partial(self._results.get, True)

    def get(self, timeout_s: float | None = None) -> Result:
        """The next result to arrive. Raises ``queue.Empty`` after ``timeout_s`` seconds."""
        return self._results.get(timeout=timeout_s)

    def close(self) -> None:
        """Ask every worker to stop; return at once (idempotent).

        Idle workers end within ``_JOIN_S``; a worker busy in the dataset is not waited for
        (a time-out, an error or Ctrl-C must hand control back at once): it drops its result
        and every queued task, fetches no further sample of its current task, and ends when its
        current ``__getitem__``/``next()`` returns. A segmentation fault (or any fatal signal)
        in a thread worker ends the whole process: threads cannot survive it, unlike torch's
        worker processes (``worker_type="process"`` reports it as a ``kuat.WorkerError``, a
        ``RuntimeError``, as torch does).
        Threads are daemons; at interpreter exit they get up to 2 s to leave the dataset.
        """
        if self._closed:
            return
        self._closed = True
        self._closing.now = True
        self._stop.set()
        for q in self._tasks:
            q.put(None)
        deadline = time.monotonic() + _JOIN_S
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self._threads):
            self._untrack()

    def _wait_stopped(self, deadline: float) -> None:
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            log.warning("kuat worker threads %s are still inside the dataset at interpreter "
                        "exit; they are daemons and end with the process", stuck)
        self._untrack()
