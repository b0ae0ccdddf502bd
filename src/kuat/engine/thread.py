"""N worker threads: one task queue each, one shared result queue.

Threads are daemons named ``kuat-worker-<i>``; each runs :func:`kuat.engine.base.serve` and
sees its own ``torch.utils.data.get_worker_info()``. Work that releases the GIL (decoding,
resizing, copies, Arrow gathers) runs truly in parallel.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from kuat.engine.base import ClosedOnExit, Result, Task, serve

__all__ = ["ThreadEngine"]

log = logging.getLogger("kuat.engine")
_JOIN_S = 2.0


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
        self._track()
        for i in range(num_workers):
            t = threading.Thread(
                target=serve,
                args=(job, i, num_workers, "thread", f"{name}-{i}", base_seed),
                kwargs={"recv": self._tasks[i].get, "send": self._results.put},
                name=f"{name}-{i}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)

    def worker_name(self, worker_id: int) -> str:
        return self._threads[worker_id].name

    def submit(self, worker_id: int, task: Task) -> None:
        self._tasks[worker_id].put(task)

    def get(self, timeout_s: float | None = None) -> Result:
        """The next result to arrive. Raises ``queue.Empty`` after ``timeout_s`` seconds."""
        return self._results.get(timeout=timeout_s)

    def close(self) -> None:
        """Ask every worker to stop and wait up to 2 s for them (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for q in self._tasks:
            q.put(None)
        deadline = time.monotonic() + _JOIN_S
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            log.warning("kuat worker threads %s are still inside the dataset after %.0f s; "
                        "they are daemons and end with the process", stuck, _JOIN_S)
        self._untrack()
