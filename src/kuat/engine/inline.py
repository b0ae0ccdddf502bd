"""``num_workers=0``: each task runs in the calling thread when its result is asked for."""

from __future__ import annotations

import collections
import queue

from kuat.engine.base import FAIL, Result, Task, failure

__all__ = ["InlineEngine"]


class InlineEngine:
    """Runs tasks lazily, in submission order, in the thread that calls :meth:`get`.

    There is no worker: ``torch.utils.data.get_worker_info()`` stays ``None`` and
    ``worker_init_fn`` is not called, as with torch's ``num_workers=0``.
    """

    num_workers = 1
    name = "main thread"

    def __init__(self, job, base_seed: int, *, own_copy: bool = False):
        self._job = job
        self._where = ("the kuat DataLoader's own thread (taking over from its worker threads)"
                       if own_copy else "the kuat DataLoader's own thread (num_workers=0)")
        # own_copy: the consumer takes over from thread workers and, like each of them, reads
        # its own shallow copy of the dataset (FetchJob.start)
        self._ctx = job.start(0, 1, "inline", base_seed, own_copy=own_copy)
        self._tasks: collections.deque[Task] = collections.deque()

    def open_epoch(self, epoch: int, base_seed: int, key) -> bytes | None:
        """Begin an iterable's epoch now (``FetchJob.open_epoch``: ``iter(dataset)``, or its
        restore); its dataset state then, or None. Raises what that raises."""
        return self._job.open_epoch(self._ctx, epoch, base_seed, key)

    def submit(self, worker_id: int, task: Task) -> None:
        self._tasks.append(task)

    def get(self, timeout_s: float | None = None) -> Result:
        if not self._tasks:
            raise queue.Empty
        task = self._tasks.popleft()
        try:
            kind, value, stats = self._job.run(self._ctx, task.epoch, task.key, task.base_seed,
                                               task.width)
        except Exception as e:
            value = failure(e, self.name, self._where, self._ctx.stage, task.key)
            kind, stats = FAIL, None
        return Result(task.task_id, 0, kind, value, stats)

    def close(self) -> None:
        self._tasks.clear()
