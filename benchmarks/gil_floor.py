"""The GIL floor: the least Python a pipeline of thread workers over kuat's batch fetch needs.

A reference for ``kuat bench --scaling`` (issue 31), not a loader anyone should use: N
threads, each taking a batch's index list from its own queue, calling the dataset's
``kuat_fetch_collated`` (the same one C call per batch, pooled buffers and pixels as
``kuat.DataLoader``'s thread workers: ``kuat.sources._rows_fetch``) and putting the batch on
one result queue; the loop thread hands tasks out round robin, ``2 * num_workers`` ahead as
torch does, and returns batches in order. Nothing else: no ``stats()``, no state to save or
resume, no adaptation (inline fetch, moving to processes), no per-worker RNG streams or
``get_worker_info()``, no timeouts, no pinning; an error ends the epoch. What kuat's engine does per
batch on top of this (the steps above, for every dataset and every option) is what its GIL
time per image has over this one's, measured in the same hour on the same host: on a host
whose wake-up cost moves the absolute reading by 2x from one hour to the next, the difference
is the number to work on.

Thread-safety: one epoch at a time, from one thread (the loop's).
"""

from __future__ import annotations

import queue
import threading

import numpy as np

__all__ = ["Floor"]


class Floor:
    """``Floor(dataset, num_workers, batch_size, seed)``: :meth:`epoch` ``e`` yields the
    batches of a shuffled epoch (``drop_last``), as ``dataset.kuat_fetch_collated`` builds
    them (``{field: tensor}``, an image field ``(B, 3, H, W)`` uint8). ``dataset``: a kuat
    ``Dataset`` (``kuat.open``, with or without a transform). Raises what a fetch raised, in
    the loop thread, at the batch that failed; an epoch left early leaves nothing to the
    next (its batches still in flight are dropped when they arrive)."""

    def __init__(self, dataset, num_workers: int, batch_size: int, seed: int = 0):
        from kuat._buffers import BufferPool

        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1 (thread workers)")
        self._ds, self._bs, self._seed = dataset, batch_size, seed
        self._rng = np.random.default_rng(seed)
        self._pool = BufferPool()  # the loader's pool, as kuat's thread workers share it
        self._tasks = [queue.SimpleQueue() for _ in range(num_workers)]
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, args=(q,), daemon=True,
                                          name=f"floor-worker-{i}")
                         for i, q in enumerate(self._tasks)]  # fmt: skip
        for t in self._threads:
            t.start()

    def _work(self, tasks: queue.SimpleQueue) -> None:
        from kuat import rng
        from kuat._buffers import thread_state

        thread_state().pool = self._pool  # (what kuat's FetchScope sets for each batch)
        current = rng.thread_state().current  # kuat.sample_rng's (seed, epoch): the crops'
        current.seed = self._seed
        get, put, fetch = tasks.get, self._results.put, self._ds.kuat_fetch_collated
        while (task := get()) is not None:
            k, epoch, indices = task
            current.epoch = epoch
            try:
                put((epoch, k, fetch(indices)))
            except BaseException as e:  # the loop raises it at batch k
                put((epoch, k, e))

    def epoch(self, e: int):
        """The batches of epoch ``e`` (a generator; one at a time)."""
        perm = self._rng.permutation(len(self._ds))
        bs, n = self._bs, len(self._tasks)
        keys = [perm[i * bs:(i + 1) * bs].tolist() for i in range(len(perm) // bs)]
        sent, got = 0, {}
        while sent < min(len(keys), 2 * n):
            self._tasks[sent % n].put((sent, e, keys[sent]))
            sent += 1
        get = self._results.get
        for k in range(len(keys)):
            while k not in got:
                # ((k, batch),) of this epoch: an epoch left early (an error, a break) leaves
                # its batches in flight, dropped here; no local keeps a batch alive
                got.update(r[1:] for r in (get(),) if r[0] == e)
            if sent < len(keys):
                self._tasks[sent % n].put((sent, e, keys[sent]))
                sent += 1
            if isinstance(got[k], BaseException):
                raise got.pop(k)
            yield got.pop(k)  # (not kept here: the loop frees it, as it would kuat's)

    def close(self) -> None:
        """End the threads (after their current batch)."""
        for q in self._tasks:
            q.put(None)
