"""When an epoch's keys are pulled from the sampler: no later than torch's multi-worker
iterator pulls them (:class:`PacedKeys`, used by :mod:`kuat.loader._iterator`)."""

from __future__ import annotations

import collections
from collections.abc import Iterator

__all__ = ["PacedKeys"]


class PacedKeys:
    """An epoch's keys (batches of indices, or one index), pulled from the sampler no later
    than torch's multi-worker iterator pulls them: ``prefetch_factor * num_workers`` when the
    epoch starts, then one more per batch it returns (``_try_put_index``). kuat's dispatch pulls
    on demand and may pull fewer (or, for cheap batches, more); the pull that exhausts the
    sampler draws from its generator (``RandomSampler``'s trailing ``randperm``), so a loop that
    leaves an epoch early (``limit_train_batches``, ``break``) would otherwise leave that
    generator one draw behind torch's. :meth:`keep_up` pulls the missing keys into a queue that
    dispatch takes first; :meth:`may_pull` keeps dispatch (which may run further ahead, by
    ``_adaptive.CHEAP_PREFETCH``) from making the exhausting pull before torch
    would, when the number of keys is known. Not thread-safe (the consumer thread's)."""

    __slots__ = ("_keys", "queue", "_ahead", "_count", "pulled", "exhausted")

    def __init__(self, keys: Iterator, ahead: int, count: int | None):
        self._keys = keys
        # keys pulled by keep_up, taken first (the iterator's dispatch pops them itself: one
        # Python call fewer per batch than next())
        self.queue: collections.deque = collections.deque()
        self._ahead = ahead
        self._count = count  # keys in the epoch (len of the batch sampler), None if unknown
        self.pulled = 0
        self.exhausted = False

    def may_pull(self, returned: int, in_flight: int) -> bool:
        """False when the next pull would be the exhausting one (all ``count`` keys pulled)
        and torch would not make it yet; never False with nothing in flight (a sampler whose
        ``len`` is short of its keys still ends its epoch only when it is exhausted)."""
        if self.queue or self.exhausted or in_flight == 0 or self._count is None:
            return True
        return self.pulled < self._count or self.pulled < self._ahead + returned

    def __iter__(self):
        return self

    def __next__(self):
        return self.queue.popleft() if self.queue else self._pull()

    def _pull(self):
        if self.exhausted:
            raise StopIteration
        try:
            key = next(self._keys)
        except StopIteration:
            self.exhausted = True
            raise
        self.pulled += 1
        return key

    def keep_up(self, returned: int) -> None:
        """Pull (and queue) keys until torch would have pulled as many after ``returned``
        batches."""
        while not self.exhausted and self.pulled < self._ahead + returned:
            try:
                self.queue.append(self._pull())
            except StopIteration:
                return
