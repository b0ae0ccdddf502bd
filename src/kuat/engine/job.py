"""What a worker does with one task: fetch a batch, collate it, isolate global RNGs, skip failures.

A :class:`FetchJob` is built once by the loader, shared by every worker thread (read-only) or
pickled once for worker processes. Each worker calls :meth:`FetchJob.start` once, then
:meth:`FetchJob.run` per task; per-worker state lives in the returned :class:`WorkerCtx`.

Global RNG isolation (``isolate_rng``): :mod:`kuat.engine.isolate` (reseeded per sample, or per
``__getitems__`` batch; about 3 us a batch for datasets that do not draw).
"""

from __future__ import annotations

import copy
import logging
import pickle
import threading
import time
import types
from dataclasses import dataclass, field

import torch

from kuat import _native, _parallel
from kuat import rng as krng
from kuat.engine import isolate, worker_rng
from kuat.engine.base import (
    COLLATE,
    EMPTY,
    END,
    FETCH,
    OK,
    PIN,
    ResumeAt,
    SchedProbe,
    Seeded,
    WorkerCtx,
    WorkerResume,
    WorkerStopped,
    WorkStats,
    sched_times,
)
from kuat.engine.fetch_scope import FetchScope
from kuat.engine.isolated_fetch import IsolatedFetch
from kuat.engine.worker_copy import worker_dataset
from kuat.engine.worker_info import clear_worker_info, reset_consulted, set_worker_info
from kuat.engine.worker_info import thread_state as _worker_info_state
from kuat.sampling import flag_padding, split_padding
from kuat.sources import protocol

__all__ = ["FetchJob", "WorkerCtx", "per_sample_getitems", "worker_dataset"]

log = logging.getLogger("kuat.engine")
# this thread's kernel seconds and get_worker_info() use (threading.local: read, no call)
_NATIVE, _WORKER_INFO = _native.thread_state(), _worker_info_state()


def _short_rank(key, skipped) -> RuntimeError:
    first = f": {skipped[0][1]}: {skipped[0][2]}" if skipped else ""
    return RuntimeError(
        f"on_error='skip' dropped every sample of the batch {key!r:.200}{first}. Under kuat's "
        "sharding (rank=/world_size=, mesh=, shard=True) every rank yields the same number of "
        "batches; dropping this one would leave this rank a step short of the others, whose "
        "next collective (all_reduce, gather) would then wait for it forever. Fix or filter the "
        "failing samples, or use a larger batch_size")


def per_sample_getitems(dataset) -> bool:
    """Whether ``dataset.__getitems__`` is torch's ``Subset.__getitems__`` over datasets that
    fetch one sample at a time (``random_split`` gives these): then the loader fetches
    ``dataset[i]`` per sample, which is the same call chain, and can isolate each sample."""
    from torch.utils.data import Subset

    while isinstance(dataset, Subset) and type(dataset).__getitems__ is Subset.__getitems__:
        dataset = dataset.dataset
        if not callable(getattr(dataset, "__getitems__", None)):
            return True
    return False


@dataclass
class FetchJob(IsolatedFetch):
    """Everything a worker needs to turn a task key into a collated batch (picklable)."""

    dataset: object
    iterable: bool
    auto_collation: bool
    batch_size: int | None
    drop_last: bool
    collate_fn: object
    seed: int
    isolate_rng: bool
    on_error: str
    worker_init_fn: object = None
    use_getitems: bool = False
    pin: bool = False  # pin batches in the worker (thread/inline; process workers pin on read)
    rng_use: isolate.RngUse = field(default_factory=isolate.RngUse)
    # the source collates its own batches (``kuat_fetch_collated(indices)``, same result as the
    # default collate of its ``__getitems__``): set when the collate is the default one
    fetch_collated: bool = False
    # the loader's pool of large batch buffers (kuat._buffers; pickles to an empty one)
    buffer_pool: object = None
    # a worker_init_fn that changes the global generators gives each worker its own stream
    # (worker_rng.py): the loader's isolate_global_rng, whatever the source kind
    worker_rng: bool = False
    # report each worker's dataset state with its results (WorkStats.worker_state): torch
    # IterableDatasets, which each worker resumes from its own copy's state (torchdata's rule)
    worker_state: bool = False
    # an IterDataPipe: each worker seeds its graph per epoch (the task key is ``Seeded``) and
    # shards it over (rank, world size) x workers, as torch's DataLoader (graph_settings)
    datapipe: bool = False
    shard: tuple[int, int] = (0, 1)  # (rank, world_size) the datapipe is sharded over
    # kuat's own sharding (rank=/mesh=/shard=True): every rank must yield every batch, so a
    # batch on_error="skip" empties raises instead of vanishing (a rank a step short hangs the
    # others' next collective)
    equal_steps: bool = False
    # exact evaluation (exact_eval=True): keys hold kuat.sampling.PaddingIndex values, whose
    # samples the batch flags in its "is_padding" (B,) bool field
    flag_padding: bool = False
    # while on, thread workers report how their fetches ran (WorkStats.sched: CPU, runqueue and
    # wall seconds), so the loader can tell work that holds the GIL (kuat.loader._auto)
    sched_probe: SchedProbe = field(default_factory=SchedProbe)

    @property
    def thread_agnostic(self) -> bool:
        """Whether any thread may fetch a batch with the same result (no per-worker state, no
        ``worker_init_fn``): pure sequences, or a source declaring ``kuat_thread_agnostic``
        (through torch's wrappers and ``kuat.mix``: ``kuat.sources.protocol.thread_agnostic``)."""
        return self.consumer_may_fetch and protocol.thread_agnostic(self.dataset)

    @property
    def consumer_may_fetch(self) -> bool:
        """Whether the consumer thread may fetch batches in place of the thread workers, from
        its own shallow copy of the dataset (:meth:`start` with ``own_copy=True``): map-style,
        without ``worker_init_fn`` (per-worker set-up). The loader also requires that no worker
        consulted ``get_worker_info()`` (``WorkStats.worker_info_consulted``) unless the source
        is :attr:`thread_agnostic`."""
        return not self.iterable and self.worker_init_fn is None

    def __post_init__(self):
        if protocol.never_draws(self.dataset):
            # nothing to isolate: not even the watch's fingerprints
            self.isolate_rng = self.worker_rng = False
        # a map-style batch is ctx.fetch(key) and nothing around it (once _get has found it)
        self._plain = (not self.iterable and not self.isolate_rng and self.auto_collation
                       and self.on_error == "raise")

    # -- worker lifecycle -------------------------------------------------------------------
    def start(self, worker_id: int, num_workers: int, method: str, base_seed: int, *,
              own_copy: bool = False, stop: threading.Event | None = None) -> WorkerCtx:
        """Per-worker state of one worker. ``own_copy``: an inline worker reads its own copy
        of the dataset, as a thread worker does (the consumer taking over from thread
        workers), instead of the dataset itself (``num_workers=0``, as torch). ``stop``: set
        when the engine closes; a thread worker then starts no further sample of its task.

        ``worker_init_fn`` runs with ``get_worker_info()`` set; a bound method of the dataset
        (``worker_init_fn=dataset.setup``) runs bound to the worker's copy, as in a torch
        worker process, where its ``self`` is that process's copy. In a thread worker it runs
        with the worker's own global generators (:mod:`kuat.engine.worker_rng`)."""
        dataset = worker_dataset(self.dataset, "thread" if own_copy else method)
        if self.datapipe and dataset is not self.dataset:  # its graph is sharded in place:
            dataset = copy.deepcopy(self.dataset)  # each thread its own, as each process
        ctx = WorkerCtx(worker_id, num_workers, method, base_seed, dataset=dataset, stop=stop)
        if method == "inline":
            return ctx
        seed = base_seed + worker_id
        reset_consulted()
        if method == "process":
            torch.set_num_threads(1)
            krng.seed_worker_globals(base_seed, worker_id)  # as torch seeds each worker process
        set_worker_info(method, worker_id, num_workers, seed, ctx.dataset)
        if self.datapipe:  # torch's _sharding_worker_init_fn: ranks first, then workers
            from torch.utils.data.graph_settings import apply_sharding

            rank, world_size = self.shard
            apply_sharding(ctx.dataset, num_workers * world_size, worker_id * world_size + rank)
        init = self.worker_init_fn
        # an iterable's thread worker draws from generators of its own, as a worker process
        keep = method == "thread" and self.iterable and self.worker_rng
        if init is None and not keep:
            return ctx
        if isinstance(init, types.MethodType) and init.__self__ is self.dataset:
            init = types.MethodType(init.__func__, ctx.dataset)
        if method == "thread":
            own = worker_rng.run_init(init, worker_id, base_seed, keep=keep)
            ctx.rng = own if self.worker_rng else None
        elif self.worker_rng:
            before = isolate.fingerprint()
            init(worker_id)
            ctx.rng = True if isolate.fingerprint() != before else None
        else:
            init(worker_id)
        if ctx.rng is not None and not getattr(ctx.rng, "seeded", False):
            self.rng_use.worker_seeded = True
        return ctx

    def stop(self, ctx: WorkerCtx) -> None:
        clear_worker_info(ctx.method)

    def _new_epoch(self, ctx: WorkerCtx, epoch: int, base_seed: int, key) -> None:
        ctx.epoch, ctx.ended = epoch, False
        if ctx.method != "inline" and base_seed != ctx.base_seed:
            ctx.base_seed = base_seed
            seed = base_seed + ctx.worker_id
            if ctx.method == "process" and ctx.rng is None:  # (a worker_init_fn's stream
                krng.seed_worker_globals(base_seed, ctx.worker_id)  # goes on, as in torch)
            elif ctx.method == "thread" and getattr(ctx.rng, "seeded", False):  # (swapped in)
                krng.seed_worker_globals(base_seed, ctx.worker_id, cuda=False)
            set_worker_info(ctx.method, ctx.worker_id, ctx.num_workers, seed, ctx.dataset)
        if isinstance(key, Seeded):  # an IterDataPipe's epoch (torch's _BaseDataLoaderIter)
            from torch.utils.data.graph_settings import apply_random_seed, apply_sharding

            if ctx.method == "inline":
                apply_sharding(ctx.dataset, self.shard[1], self.shard[0])
            apply_random_seed(ctx.dataset, torch.Generator().manual_seed(key.shared_seed))
            key = key.key
        if self.iterable:
            ctx.items = 0
            if protocol.provides(ctx.dataset, protocol.EpochAware):
                ctx.dataset.set_epoch(epoch)
            if isinstance(key, ResumeAt) and isinstance(key.state, WorkerResume):
                self._restore(ctx, key.state.states[ctx.worker_id], fresh=key.batches == 0)
            elif isinstance(key, ResumeAt):  # the source starts after the batches served
                ctx.iterator = ctx.dataset.kuat_iter_from(epoch, key.batches, key.state)
            else:
                ctx.iterator = self._iter_collated(ctx)
                ctx.collated = ctx.iterator is not None
                if not ctx.collated:
                    ctx.iterator = iter(ctx.dataset)
            ctx.reports_state = self.worker_state and (
                protocol.provides(ctx.iterator, protocol.Stateful)
                or protocol.provides(ctx.dataset, protocol.Stateful))

    def _iter_collated(self, ctx: WorkerCtx):
        """The source's own collated batches for this epoch (``kuat_iter_collated``: a Hugging
        Face stream read as Arrow, :mod:`kuat.sources.hf_columnar`), each exactly what the
        collate gives the rows ``iter()`` would; None when it declines or may not be used."""
        if not (self.auto_collation and self.batch_size and self.on_error == "raise"):
            return None
        if not protocol.provides(ctx.dataset, protocol.CollatedStream):
            return None
        return ctx.dataset.kuat_iter_collated(self.collate_fn, self.batch_size, self.drop_last)

    def open_epoch(self, ctx: WorkerCtx, epoch: int, base_seed: int, key) -> bytes | None:
        """Begin epoch ``epoch`` of an iterable now, before its first task: ``iter()`` of the
        dataset, or its restore from ``key`` (torch's single-process iterator calls
        ``iter(dataset)`` when it is made, and torchdata's restores the saved state there).
        Returns the worker's dataset state then (:meth:`_state_of`), or None when it has none.
        Raises what ``iter()`` or a ``load_state_dict`` raises."""
        with krng.epoch_context(self.seed, epoch):
            self._new_epoch(ctx, epoch, base_seed, key)
            return self._state_of(ctx) if ctx.reports_state else None

    @staticmethod
    def _restore(ctx: WorkerCtx, blob: bytes | None, fresh: bool) -> None:
        """Resume this worker's copy from its own saved state (torchdata's order: the dataset's
        state, then ``iter()``, then the iterator's state); ``None``: start afresh. ``fresh``:
        the epoch starts. Its state then is either one its iterator ran out with (saved at the
        previous epoch's end), whose side effects carry over while a new ``iter()`` begins the
        epoch, or that of the epoch's own iterator, made by ``iter(loader)`` before its first
        batch (:meth:`open_epoch`), which goes on as restored."""
        saved = pickle.loads(blob) if blob is not None else {}
        ds = ctx.dataset
        if saved.get("dataset") is not None and protocol.provides(ds, protocol.Stateful):
            ds.load_state_dict(saved["dataset"])
        ctx.iterator = iter(ds)
        if saved.get("iterator") is not None and protocol.provides(ctx.iterator, protocol.Stateful):
            ctx.iterator.load_state_dict(saved["iterator"])
        ctx.ended = bool(saved.get("ended", False))
        if fresh and ctx.ended:
            ctx.iterator, ctx.ended = iter(ds), False

    @staticmethod
    def _state_of(ctx: WorkerCtx) -> bytes:
        """This worker's dataset state now, pickled (a copy: the worker goes on mutating it):
        the iterator's ``state_dict()`` and, when the iterator is another object, the
        dataset's (as torchdata's ``_make_state_dict``)."""
        it, ds = ctx.iterator, ctx.dataset
        it_state = it.state_dict() if protocol.provides(it, protocol.Stateful) else None
        ds_state = (ds.state_dict() if it is not ds and protocol.provides(ds, protocol.Stateful)
                    else None)
        return pickle.dumps({"dataset": ds_state, "iterator": it_state, "ended": ctx.ended},
                            protocol=pickle.HIGHEST_PROTOCOL)

    # -- one task ---------------------------------------------------------------------------
    def run(self, ctx: WorkerCtx, epoch: int, key, base_seed: int, width: int = 1):
        """Fetch and collate the batch of ``key`` in epoch ``epoch``.

        ``width``: threads the fetch may use (:mod:`kuat._parallel`: an epoch's first batch of a
        source that splits batches); helpers' busy and CPU seconds count in ``stats``' fetch and
        native times as the worker's own. ``stats.python_s``: CPU seconds of the fetch outside
        the GIL-releasing kernels that report themselves (:mod:`kuat._native`), plus the
        collate's CPU seconds: about the time this task held the GIL (an upper bound: other code
        that releases it, a system call, a NumPy copy, counts too).

        Returns ``(kind, batch, stats)``: ``(OK, batch, stats)``; ``(EMPTY, None, stats)`` when
        ``on_error="skip"`` dropped every sample; ``(END, None, stats)`` when this worker's
        iterator is exhausted (iterable datasets). ``stats``: fetch/collate/pin times, RNG lock
        wait, skipped samples. Built in a :class:`kuat.collate.batch_scope` (it shares memory
        only with buffers allocated for it). Raises what the dataset, ``collate_fn`` or
        pinning raise (``on_error="raise"``), ``ctx.stage`` naming which (``FETCH``,
        ``COLLATE``, ``PIN``); the engine turns that into a ``FAIL`` result.
        """
        ctx.stage = FETCH
        scope = ctx.scope  # batch_scope, epoch_context, _parallel.share and seed_view.showing
        if scope is None:  # as one object per worker (fetch_scope.py)
            scope = ctx.scope = FetchScope(self.buffer_pool, self.seed)
        scope.epoch, scope.width = epoch, width
        # in a thread worker, torch.initial_seed() answers the worker's seed, not the loop's
        scope.shown = (base_seed + ctx.worker_id if ctx.method == "thread"
                       and (ctx.rng is None or ctx.rng.seeded) else None)
        padding = None
        if self.flag_padding and not self.iterable:  # plain ints for the dataset
            key, padding = split_padding(key)
        st = WorkStats()
        probe = self.sched_probe
        s0 = sched_times() if (probe.on or probe.forced) and probe.wanted(ctx.method) else None
        st.method = ctx.method
        # buffers kuat allocates while fetching this batch are its own: the collate may return
        # views of them; anything else it copies (collate.py)
        with scope:
            t0, c0, n0, nc0 = time.perf_counter(), time.thread_time(), _NATIVE.s, _NATIVE.cpu
            h0 = _parallel.helper_totals() if width > 1 else None  # split fetches only
            if ctx.rng is None or ctx.method != "thread":  # (the usual case: no context to
                swapped_in = None  # enter, two calls fewer per batch than a null one)
                if self._plain and ctx.epoch == epoch and ctx.fetch and not ctx.reports_state:
                    data = ctx.fetch(key)  # (_batch_data's steady case, inline; fetch: a function)
                else:
                    data = self._batch_data(ctx, epoch, key, base_seed, st, swapped_in)
            else:
                # the worker's own global generators (worker_rng.py): a new epoch's iter(),
                # state restore and state taken run with them too (may draw, save or set them)
                with worker_rng.own_stream(ctx.rng, st, self.rng_use,
                                           ctx.epoch != epoch) as swapped_in:
                    data = self._batch_data(ctx, epoch, key, base_seed, st, swapped_in)
            if ctx.reports_state or not self.fetch_collated:  # (the epoch and width: the
                scope.end_fetch()  # state and the collate run without; __exit__ restores all)
            if ctx.reports_state and swapped_in is False:  # (fetched watched: the state
                with worker_rng.swapped(ctx.rng, st):  # may read its generators)
                    st.worker_state = self._state_of(ctx)
            st.fetch_s, st.fetch_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
            st.native_s, st.native_cpu_s = _NATIVE.s - n0, _NATIVE.cpu - nc0
            if width > 1:  # what helper threads did for this fetch (kuat._parallel)
                h1 = _parallel.helper_totals()
                st.fetch_s += h1[0] - h0[0]
                st.fetch_cpu_s += h1[1] - h0[1]
                st.native_s += h1[2] - h0[2]
                st.native_cpu_s += h1[3] - h0[3]
            st.python_s = max(0.0, st.fetch_cpu_s - st.native_cpu_s)  # the GIL held, about
            # iterable: all workers iterating all items? (#11.6; an IterDataPipe is sharded by
            # the loader, as torch does); map-style: may the consumer fetch in its place?
            if ctx.method != "inline" and (ctx.num_workers > 1 or not self.iterable):
                st.worker_info_consulted = _WORKER_INFO.consulted or self.datapipe
            if data is None:
                self._sched(st, s0, t0)
                if self.equal_steps and not self.iterable:
                    raise _short_rank(key, st.skipped)
                return (END if self.iterable else EMPTY), None, st
            if self.fetch_collated:  # the columnar gather went straight to batch tensors
                st.samples, batch = len(key), data
            elif ctx.collated:  # the stream's own (rows, batch), built column by column
                st.samples, batch = data
            else:
                st.samples = len(data) if self.auto_collation else 1
                t1, c1 = time.perf_counter(), time.thread_time()
                ctx.stage = COLLATE
                batch = self.collate_fn(data)
                st.collate_s = time.perf_counter() - t1
                st.python_s += time.thread_time() - c1
            if padding is not None:
                batch = flag_padding(batch, padding)
            if s0 is not None:
                self._sched(st, s0, t0)
        if self.pin and ctx.method != "process":
            from kuat.device import pin_batch

            t2 = time.perf_counter()
            ctx.stage = PIN
            batch = pin_batch(batch)
            st.pin_s = time.perf_counter() - t2
        return OK, batch, st

    def _batch_data(self, ctx: WorkerCtx, epoch: int, key, base_seed: int, st, swapped_in):
        """:meth:`run`'s fetch (a new epoch started first), and the state in ``st`` where it is
        reported and ``swapped_in`` (``worker_rng.own_stream``'s answer, or None) is not False."""
        if ctx.epoch != epoch:
            self._new_epoch(ctx, epoch, base_seed, key)
        if self.iterable:
            data = self._next_items(ctx, st)
        elif self._plain and ctx.fetch is not None:  # (what _fetch_indices calls then, found
            data = ctx.fetch(key)  # at the first batch by _get: three calls fewer)
        else:
            data = self._fetch_indices(ctx, epoch, key, st)
        if ctx.reports_state and swapped_in is not False:
            st.worker_state = self._state_of(ctx)  # where its iterable is now
        return data

    @staticmethod
    def _sched(st: WorkStats, s0, t0: float) -> None:
        """``st.sched`` from the probe's start ``s0`` (``sched_times()``) and ``t0``."""
        if s0 is not None:
            cpu, runq = sched_times()
            st.sched = (cpu - s0[0], runq - s0[1], time.perf_counter() - t0)

    def _next_items(self, ctx: WorkerCtx, st: WorkStats):
        """Up to ``batch_size`` next items of this worker's iterator; None when exhausted."""
        if ctx.ended:
            return None
        it = ctx.iterator
        if ctx.collated:
            item = next(it, None)
            ctx.ended = item is None
            return item
        if not self.auto_collation:
            while True:
                ctx.items += 1  # (counts the item being drawn: the failing one is items - 1)
                try:
                    return next(it)
                except StopIteration:
                    ctx.ended = True
                    return None
                except Exception as e:
                    if self.on_error != "skip":
                        krng.note_failed(e, ctx.items - 1)  # (named by the error's note)
                        raise
                    st.skipped.append((None, type(e).__qualname__, str(e)))
        data = []
        stop, skipped = ctx.stop, 0
        while len(data) < self.batch_size:
            if stop is not None and stop.is_set():
                raise WorkerStopped
            try:
                data.append(next(it))
            except StopIteration:
                ctx.ended = True
                break
            except Exception as e:
                if self.on_error != "skip":
                    at = ctx.items + skipped + len(data)
                    krng.note_failed(e, at)  # (named by the error's note)
                    ctx.items = at + 1
                    raise
                skipped += 1
                st.skipped.append((None, type(e).__qualname__, str(e)))
        ctx.items += skipped + len(data)
        if not data or (self.drop_last and len(data) < self.batch_size):
            return None
        return data

    def _fetch_indices(self, ctx: WorkerCtx, epoch: int, key, st: WorkStats):
        """The samples of ``key`` (list of indices, or one index); None when all were skipped."""
        if not self.auto_collation:
            try:
                return self._fetch(ctx, epoch, [key], st)[0]
            except Exception as e:
                if self.on_error != "skip":
                    raise
                st.skipped.append((key, type(e).__qualname__, str(e)))
                return None
        try:
            return self._fetch(ctx, epoch, key, st)
        except Exception:
            if self.on_error != "skip":
                raise
        # skip mode: retry one sample at a time, keep those that succeed
        kept = []
        for i in key:
            try:
                kept += self._fetch(ctx, epoch, [i], st)
            except Exception as e:
                st.skipped.append((i, type(e).__qualname__, str(e)))
        return kept or None

    def _get(self, ctx: WorkerCtx, key) -> list:
        """The samples of ``key``: one ``__getitems__`` call, or ``dataset[i]`` per sample (or
        the collated batch, with ``fetch_collated``)."""
        if self.fetch_collated:  # the source's kuat_fetch_collated (or a torch Subset's, mapped)
            fetch = ctx.fetch
            if fetch is None:  # (the worker's dataset is fixed: found once)
                fetch = ctx.fetch = protocol.fetch_collated(ctx.dataset)
            return fetch(key)
        if self.use_getitems:
            return ctx.dataset.__getitems__(key)
        return krng.map_samples(self._getitem(ctx), key)

    @staticmethod
    def _getitem(ctx: WorkerCtx):
        """``ctx.dataset.__getitem__``; in a thread worker, one that first checks that the
        engine is not closed (a loader that gave up, on a time-out or an error, must not see
        the rest of the batch fetched: raises ``WorkerStopped``)."""
        getitem = ctx.dataset.__getitem__
        stopped = ctx.stop.is_set if ctx.stop is not None else None
        if stopped is None:
            return getitem

        def checked(i):
            if stopped():
                raise WorkerStopped
            return getitem(i)

        return checked
