"""One epoch of a loader: dispatch tasks to workers, restore order, copy, transform, yield.

:class:`LoaderIter` is what ``iter(loader)`` returns. It is created without side effects
(unless ``eager``); its first ``next()`` asks for the epoch's plan (``_plan.EpochPlan``) (the
loader decides the epoch, its keys and its engine then) and from there reads only the plan. The per-batch
loop (:meth:`LoaderIter._next_batch`) dispatches tasks round-robin to workers up to the
prefetch bound, takes results in order (or as completed), and hands the batch on.
"""

from __future__ import annotations

import collections
import functools
import itertools
import queue
import time
from collections.abc import Callable
from typing import Any

from kuat.device import CopiesAhead
from kuat.engine.base import END, FAIL, OK, Task
from kuat.engine.inline import InlineEngine
from kuat.errors import LoaderTimeoutError
from kuat.loader import _adaptive, _plan
from kuat.loader._paced import PacedKeys
from kuat.loader._stats import FOLD_EVERY

__all__ = ["LoaderIter", "PacedKeys"]

_TASK_IDS = itertools.count()  # unique across iterators, so stale results are recognised
_task = functools.partial(tuple.__new__, Task)  # Task((...)) without its Python __new__


class LoaderIter:
    """One epoch of a :class:`kuat.DataLoader`: dispatches tasks, restores order, yields batches.

    Args:
        start: called once, at the first ``next()`` (``eager``: now), with this iterator;
            returns the epoch's plan (the loader starts the epoch then: rank, seeds, workers).
        length: ``len()`` of the epoch (the loader's ``len``).
        eager: start the epoch now (what the loader asks for ``num_workers=0`` over a torch
            ``IterableDataset``, whose ``iter()`` torch calls when its iterator is made).
    """

    def __init__(self, start: Callable[[LoaderIter], _plan.EpochPlan], length: Callable[[], int],
                 eager: bool = False):
        self._start = start
        self._length = length
        self._started = False
        self._closed = False
        self._finished = False
        if eager:
            self._begin()

    def _setup(self, plan: _plan.EpochPlan) -> None:
        self._started = True
        self._plan = plan
        self._lease = plan.lease
        self._epoch, self._base_seed = plan.epoch, plan.base_seed
        self._keys = PacedKeys(plan.keys, *plan.pace) if plan.pace is not None else plan.keys
        self._paced = plan.pace is not None
        self._returned = 0
        self._taken = 0  # results of kind OK taken from the engine (yielded or discarded)
        self._keys_done = False
        self._discard = plan.discard
        self._position = plan.position
        self._done = plan.position.keys  # which keys are done (set before the epoch starts)
        self._adapt: _adaptive.Adaptation = plan.adaptation
        self._nw = self._lease.engine.num_workers
        self._bind()
        self._active = [True] * self._nw
        self._rr = plan.first_worker
        # per worker, its tasks from submission until taken (in_order=False's capacity)
        self._load = [0] * self._nw
        self._tasks: dict[int, int] = {}  # task id -> worker id, in flight
        self._ordinals: dict[int, int | None] = {}  # task id -> its key's ordinal (Position)
        self._order: collections.deque[int] = collections.deque()  # dispatch order (in_order)
        self._ready: dict[int, Any] = {}
        self._in_order = plan.in_order
        self._timeout = plan.timeout
        self._stats = plan.stats
        self._copies = CopiesAhead(plan.device, plan.stats) if plan.device is not None else None
        self._transform = plan.transform
        self._feed = plan.feed
        self._plain = self._copies is None and self._transform is None  # host batches as taken
        self._observer = plan.observer
        self._epoch_batches = None
        self._look_ahead = False
        self._ahead: Any = _NOTHING
        if self._observer is not None:  # a framework wants to know when the last batch comes
            self._epoch_batches = plan.batches
            self._look_ahead = plan.batches is None
            self._observer.epoch_started(plan.batches)
        self._t_mark: float | None = None
        self._adapt.threads_start()  # (before the first task: the caller's generators now)
        self._wait_s = self._wait_cpu_s = 0.0  # of this next(), waiting for results (_take)
        self._events = plan.events

    def _bind(self) -> None:
        """The engine's ``submit`` per worker and its ``get``, as the per-batch loop calls
        them: a thread engine's queue methods themselves (``calls()``: no Python frame)."""
        eng = self._lease.engine
        self._submit, self._get = eng.calls() if hasattr(eng, "calls") else (
            [functools.partial(eng.submit, w) for w in range(eng.num_workers)], eng.get)

    @property
    def _engine(self):
        """The engine fetching this epoch's batches (tests and diagnostics)."""
        return self._lease.engine

    @property
    def _inline(self) -> bool:
        """Batches are fetched in this thread (``num_workers=0``, or taken over)."""
        return isinstance(self._lease.engine, InlineEngine)

    def _begin(self) -> None:
        """Start the epoch (what the first ``next()`` does first)."""
        self._setup(self._start(self))

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self._length()

    # --- the per-batch loop -------------------------------------------------------------------
    def __next__(self):
        t0, c0 = time.perf_counter(), time.thread_time()  # an epoch's start is waiting, too
        if not self._started:
            if self._closed:
                raise StopIteration
            self._begin()
        position, adapt = self._position, self._adapt
        position.opened = False  # (an epoch opened by iter() is started: _state)
        if self._t_mark is None:
            self._t_mark = t0
        # every second inside next() is a second the training loop waited for input
        try:
            if adapt.watching:
                adapt.loop_resumed()
            batch = self._next_looking_ahead() if self._look_ahead else self._produce()
            if not self._returned:  # (may wait for other first batches: before the loop's
                adapt.loop_has_batch()  # own time starts)
            if adapt.watching:
                adapt.loop_paused()
            position.advance()
            self._returned += 1
            if self._paced:
                self._keys.keep_up(self._returned)
            if self._epoch_batches is not None and position.served >= self._epoch_batches:
                self._plan.observer.last_batch()
        except BaseException:
            self._account_time(t0, c0, 0)
            raise
        self._account_time(t0, c0, 1)
        return batch

    def _produce(self):
        """The next batch, transformed; raises StopIteration at the end of the epoch."""
        failed = None
        try:  # fetched here, or received from the replica group's leader (_plan.BatchFeed)
            if self._feed is not None:
                batch = self._feed.next(self._fetch, _BatchError)
            else:
                batch = self._next_batch() if self._plain else self._fetch()
        except StopIteration:
            self._finish()
            raise
        except _BatchError as e:  # a dataset error: the iterator stays usable, as in torch
            failed = e.exc
        except BaseException:  # time-out, dead worker, KeyboardInterrupt: release the workers
            self.close(broken=True)
            raise
        if failed is not None:
            # Raised outside the except clause and without a local naming it: the exception then
            # holds no reference cycle (context -> _BatchError -> exception), so the iterator and
            # its workers go as soon as the caller drops the exception, not at the next gc run.
            # Raised as it is: its __cause__ and __context__ are the worker's (a ``raise ...
            # from`` here would replace them).
            exc, failed = failed, None
            try:
                raise exc
            finally:
                del exc
        return batch

    def _fetch(self):
        batch = self._copies(self._next_batch) if self._copies else self._next_batch()
        if self._transform is not None:
            t1 = time.perf_counter()
            batch = self._transform(batch)
            self._stats.transform_s += time.perf_counter() - t1
        return batch

    def _next_looking_ahead(self):
        """One batch ahead, as Accelerate's DataLoaderShard: the observer hears of the last
        batch of an epoch of unknown length before it is returned. An error while fetching the
        batch after the current one is raised at the next call."""
        if self._ahead is _NOTHING:
            self._ahead = self._produce()
        elif self._ahead is _DONE:
            self._end_observation()
            raise StopIteration
        elif isinstance(self._ahead, _Raise):
            error, self._ahead = self._ahead.error, _NOTHING
            raise error
        batch = self._ahead
        try:
            self._ahead = self._produce()
        except StopIteration:
            self._ahead = _DONE
            self._plan.observer.last_batch()
        except Exception as e:
            self._ahead = _Raise(e)
        return batch

    def _next_batch(self):
        done, order, ready = self._done, self._order, self._ready
        while True:
            self._dispatch()
            if order and order[0] in ready:  # (in order, here already: _take's first answer)
                r = ready.pop(order.popleft())
            elif (r := self._take()) is None:
                raise StopIteration
            ok = r.kind == OK
            batch = ok and not self._discard  # (a replayed batch, served before, is not)
            self._taken += ok
            if (st := r.stats) is not None:  # (the worker's measurements)
                self._adapt.on_result(st)
                self._stats.work.append((st, batch))  # (summed by LoaderStats.fold)
                if st.worker_state is not None:  # committed when its batch is returned (advance)
                    self._position.took(r.worker_id, st.worker_state, ok)
                if st.skipped:
                    self._events.skipped(st.skipped)
                if st.worker_info_consulted is False and self._plan.iterable:
                    self._events.unsplit_iterable()
            ordinal = self._ordinals.pop(r.task_id, None)
            # a batch to return is done once returned; a failed, empty or replayed one is done
            # now (resume does not fetch it again)
            if ordinal is not None and done is not None:
                done.took(ordinal, batch)
            if batch:
                return r.value
            if ok:  # (a replayed batch)
                self._discard -= 1
                continue
            if r.kind == END:
                self._active[r.worker_id] = False
                continue
            if r.kind == FAIL:
                raise _BatchError(r.value.exception())  # the original, in this process
            # EMPTY: every sample of the batch was skipped; never yield an empty batch

    def _dispatch(self) -> None:
        """Submit tasks round-robin over active workers, up to the prefetch bound.

        A batch counts against the bound from submission until it is yielded (as in torch), so
        results waiting for their turn (``in_order``) hold no more memory than the bound.

        An epoch's first batch, when the source splits batches (``kuat_splits_batches``), goes
        alone, with a width of ``num_workers`` threads (:mod:`kuat._parallel`): nothing else is
        submitted until it is back, so the cores of the waiting workers decode parts of it
        instead of batches the loop does not need yet, and the loop gets it in about
        ``1 / num_workers`` of a batch's time. The other workers start as soon as it is back,
        before it is returned. Order, pixels (each sample's randomness comes from its own
        generator, drawn in the fetching worker) and errors (the first failing sample, in
        sample order) are those of an unsplit fetch.
        """
        adapt = self._adapt
        if adapt.holding is not None or (
                not adapt.steady() and (self._to_processes() or self._to_inline())):
            return
        tasks, ready, done, keys = self._tasks, self._ready, self._done, self._keys
        queued = keys.queue if self._paced else None  # (keys keep_up pulled, taken first; the
        # steady in-order case inline: a batch's Python runs cold, ~1 us a call, issue 31)
        while len(tasks) + len(ready) < adapt.max_inflight and not self._keys_done:
            w = self._rr
            if self._in_order and self._active[w]:  # (_next_worker's first answer)
                self._rr = (w + 1) % self._nw
            elif (w := self._next_worker()) is None:
                return
            if queued:
                key = queued.popleft()
            else:
                if self._paced and not keys.may_pull(self._returned, len(tasks) + len(ready)):
                    return  # torch would not pull the sampler's end yet (see PacedKeys)
                try:
                    key = next(keys)
                except StopIteration:
                    self._keys_done = True
                    return
            tid = next(_TASK_IDS)
            tasks[tid] = w
            self._ordinals[tid] = done.dispatched() if done is not None else None
            self._load[w] += 1
            if self._in_order:
                self._order.append(tid)
            width = (adapt.first_batch_width(self._returned, len(tasks), len(ready))
                     if adapt.first_width > 1 and not self._returned else 1)
            if width > 1:
                adapt.holding = tid
            self._submit[w](_task((tid, self._epoch, key, self._base_seed, width)))
            if width > 1:
                return

    def _to_processes(self) -> bool:
        """Other workers wanted (``_adaptive``: the dataset draws from the global RNGs, or the
        worker choice measured): let the batches in flight finish and be yielded (True while
        they are), then continue the epoch on them, the round-robin where it was."""
        answer = self._adapt.processes_wanted(busy=bool(self._tasks or self._ready))
        if answer != _adaptive.NOW:
            return answer == _adaptive.WAIT
        new = self._lease.to_processes(*self._adapt.move_to)
        if new is None:  # process workers cannot start (_workers.py): these threads go on
            self._adapt.moved_to_processes(self._nw, kind="thread")
            return False
        self._nw = new.num_workers
        self._bind()
        self._active, self._rr, self._load = [True] * self._nw, self._rr % self._nw, [0] * self._nw
        if self._plan.iterable:  # a replayable stream (_adaptive): the new workers start the
            # epoch again and skip every batch the old ones produced (as a replayed resume)
            self._discard, self._taken = self._discard + self._taken, 0
            self._rr = self._plan.first_worker
        self._adapt.moved_to_processes(self._nw, kind=self._lease.worker_type)
        return False

    def _to_inline(self) -> bool:
        """Cheap batches the loop waits for (``_adaptive``): let the workers'
        batches in flight finish (True while they do), then fetch the rest of the epoch in this
        thread (the thread workers are released, or kept when persistent). Its shallow copy of
        the dataset is its own, as a worker's, unless the source is thread-agnostic."""
        answer = self._adapt.inline_wanted(busy=bool(self._tasks))
        if answer != _adaptive.NOW:
            return answer == _adaptive.WAIT
        self._lease.to_inline(own_copy=not self._adapt.agnostic)
        self._bind()
        self._nw, self._active, self._rr, self._load = 1, [True], 0, [0]
        self._adapt.moved_inline()
        return False

    def _next_worker(self) -> int | None:
        """The next active worker, round-robin. With ``in_order=False`` a worker already holding
        its share of the fixed prefetch bound (``prefetch_factor`` when all are active; counted
        from submission until taken) is skipped, as torch's ``_try_put_index`` does: a worker
        stuck in a slow sample is given no more work while the others go on (with
        ``in_order=True`` torch skips nobody: batches come back in dispatch order anyway). The
        deeper prefetch of cheap batches then goes to the other workers, never queues behind a
        busy one."""
        if self._in_order:
            for _ in range(self._nw):
                w, self._rr = self._rr, (self._rr + 1) % self._nw
                if self._active[w]:
                    return w
            return None
        share = self._adapt.base_inflight // max(1, sum(self._active))
        for _ in range(self._nw):
            w, self._rr = self._rr, (self._rr + 1) % self._nw
            if self._active[w] and self._load[w] < share:
                return w
        return None

    def _take(self):
        """The next result to yield (in order, or as completed); None when the epoch is over."""
        while True:
            if self._in_order:
                if not self._order:
                    return None
                if self._order[0] in self._ready:
                    return self._ready.pop(self._order.popleft())
            else:
                if self._ready:
                    r = self._ready.pop(next(iter(self._ready)))
                    if r.worker_id < len(self._load) and self._load[r.worker_id] > 0:
                        self._load[r.worker_id] -= 1
                    return r
                if not self._tasks:
                    return None
            self._adapt.blocked += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                r = self._get(self._timeout if self._timeout > 0 else None)
            except queue.Empty:
                raise self._timed_out() from None
            finally:  # (added to the stats with the rest of next(): _account_time)
                self._wait_s += time.perf_counter() - t0
                self._wait_cpu_s += time.thread_time() - c0
            if self._tasks.pop(r.task_id, None) is None:
                continue  # stale: from an abandoned epoch of persistent workers
            self._ready[r.task_id] = r
            if r.task_id == self._adapt.holding:  # the split first batch: start the others
                self._adapt.holding = None
                self._dispatch()

    def _timed_out(self) -> LoaderTimeoutError:
        return LoaderTimeoutError(
            f"DataLoader timed out after {self._timeout} seconds waiting for a batch from its "
            f"{self._nw} {self._lease.worker_type} workers ({len(self._tasks)} batches in flight)")

    # --- bookkeeping --------------------------------------------------------------------------
    def _account_time(self, t0: float, c0: float, batches: int) -> None:
        # wall time from the first next() of the epoch to the end of the latest one, and the
        # part of it spent inside next() (from t0); this thread's CPU time since c0; the waits
        # for results in it (stats.waited's, one lock for all); ``batches`` returned (0 or 1)
        now, cpu = time.perf_counter(), time.thread_time() - c0
        st = self._stats
        with st.lock:
            st.consumer_cpu_s += cpu
            st.elapsed_s += now - self._t_mark
            st.wait_s += now - t0
            st.worker_wait_s += self._wait_s
            st.wait_cpu_s += self._wait_cpu_s
            st.batches += batches
            if len(st.work) >= FOLD_EVERY:
                st.fold()
        self._wait_s = self._wait_cpu_s = 0.0
        self._t_mark = now

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._position.exhausted = True
            if self._plan.observer is not None:
                self._plan.observer.last_batch()
            # looking ahead, the user has yet to receive the last batch: stay registered
            self.close(end_observation=not self._look_ahead)
            self._events.finished()

    def _abandon(self) -> None:
        """A newer iterator took over the persistent workers: this one yields nothing more."""
        self._keys_done = self._finished = True
        self._adapt.holding = None
        self._tasks.clear()
        self._ready.clear()
        self._order.clear()
        self._copies = None  # (a staged copy's memory goes now)
        self._closed = True
        self._end_observation()

    def _end_observation(self) -> None:
        """Tell the framework's observer the epoch is over (as DataLoaderShard.end()). Idempotent."""
        observer = self.__dict__.get("_observer")  # absent before the epoch starts
        if observer is not None:
            self._observer = None
            observer.epoch_ended()

    def close(self, broken: bool = False, end_observation: bool = True) -> None:
        """Release the workers (this epoch's, or persistent ones when they broke). Idempotent."""
        if end_observation:
            self._end_observation()
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        self._keys_done = True
        self._lease.release(broken)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_NOTHING, _DONE = object(), object()  # look-ahead states: nothing fetched yet / epoch over


class _Raise:
    """Look-ahead state: fetching the next batch raised ``error``."""

    def __init__(self, error: BaseException):
        self.error = error


class _BatchError(Exception):
    """Internal: carries a worker's exception out of the per-batch loop."""

    def __init__(self, exc: BaseException):
        super().__init__()
        self.exc = exc

