"""What a worker does with one task: fetch a batch, collate it, isolate global RNGs, skip failures.

A :class:`FetchJob` is built once by the loader, shared by every worker thread (read-only) or
pickled once for worker processes. Each worker calls :meth:`FetchJob.start` once, then
:meth:`FetchJob.run` per task; per-worker state lives in the returned :class:`WorkerCtx`.

Global RNG isolation (``isolate_rng``): see :mod:`kuat.engine.isolate`. Map-style datasets that
are seen to draw from Python's ``random``, NumPy's legacy global generator or torch's default CPU
generator run with those reseeded from ``(seed, epoch, index)`` per sample (``__getitem__``
path) or from ``(seed, epoch, batch indices)`` per batch (``__getitems__`` path); datasets that
do not draw pay two fingerprints and a shared lock per batch (about 3 us).
"""

from __future__ import annotations

import copy
import logging
import operator
import pickle
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from kuat import _native, _parallel
from kuat import rng as krng
from kuat.collate import batch_scope
from kuat.engine import isolate
from kuat.engine.base import (
    COLLATE,
    EMPTY,
    END,
    FETCH,
    OK,
    PIN,
    ResumeAt,
    Seeded,
    WorkerResume,
    WorkStats,
)
from kuat.engine.worker_info import (
    clear_worker_info,
    reset_consulted,
    set_worker_info,
    worker_info_consulted,
)
from kuat.sources import protocol

__all__ = ["FetchJob", "WorkerCtx", "per_sample_getitems", "worker_dataset"]

log = logging.getLogger("kuat.engine")


_WATCH = object()  # FetchJob._isolated: fetch this first batch watched, not probed


def _index_key(index) -> int:
    """An int for a sample key: the index itself, or a stable hash of a non-integer key."""
    try:
        return operator.index(index)
    except TypeError:
        return zlib.crc32(repr(index).encode())


def _batch_key(key) -> int:
    """An int for a batch of sample keys (a CRC of the indices and their count)."""
    try:
        a = np.asarray(key, dtype=np.int64)  # (B,)
        return zlib.crc32(a.tobytes()) | (a.size << 32)
    except (TypeError, ValueError, OverflowError):
        return zlib.crc32(repr(key).encode())


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


def worker_dataset(dataset, method: str):
    """The dataset object one worker reads: its own shallow copy in a thread worker.

    A torch worker process reads its own copy of the dataset (forked or unpickled), so what a
    worker does to it (``worker_init_fn`` narrowing ``get_worker_info().dataset``, a file handle
    or connection opened lazily in ``__getitem__``, a counter, a per-worker cache assigned on
    first use) stays in that worker. Thread workers keep that: each gets ``copy.copy(dataset)``
    when it starts (once per worker per engine: each epoch, or once with persistent workers),
    taken after the main thread's last change. A shallow copy shares what the attributes point
    to: tensors, arrays, memory-mapped shards, file lists (read-only data, shared at no cost)
    and also mutable containers created in ``__init__`` (a dict used as a cache is then shared,
    and must be safe to use from several threads, as CPython's dict is). Attributes *assigned*
    in a worker are its own. A dataset that wants no copy (or a deeper one) defines
    ``__copy__``; one that cannot be copied is shared, with a warning. Cost: one
    ``copy.copy`` per worker start, about 3 us for a ``TensorDataset``, an ``ImageFolder`` or a
    kuat dataset (measurements in ``tests/test_parity_workers.py``'s docstring); in process
    mode (the worker has its own copy already) and inline mode (torch's ``num_workers=0`` reads
    the dataset itself) nothing is copied.
    """
    if method != "thread":
        return dataset
    try:
        return copy.copy(dataset)
    except Exception as e:  # un-copyable (a C extension type, a __reduce__ that refuses)
        log.warning(
            "kuat thread workers share one %s object: copy.copy() failed (%s: %s), so state a "
            "worker sets on it is seen by every worker. Define __copy__ on the dataset, or use "
            "worker_type='process'", type(dataset).__name__, type(e).__name__, e,
        )
        return dataset


@dataclass
class WorkerCtx:
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
    stage: str = FETCH  # what run() is doing: FETCH, COLLATE or PIN (names a failure's stage)


@dataclass
class FetchJob:
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
    # report each worker's dataset state with its results (WorkStats.worker_state): torch
    # IterableDatasets, which each worker resumes from its own copy's state (torchdata's rule)
    worker_state: bool = False
    # an IterDataPipe: each worker seeds its graph per epoch (the task key is ``Seeded``) and
    # shards it over (rank, world size) x workers, as torch's DataLoader (graph_settings)
    datapipe: bool = False
    shard: tuple[int, int] = (0, 1)  # (rank, world_size) the datapipe is sharded over

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
        if self.isolate_rng and protocol.never_draws(self.dataset):
            self.isolate_rng = False  # nothing to isolate: not even the watch's fingerprints

    # -- worker lifecycle -------------------------------------------------------------------
    def start(self, worker_id: int, num_workers: int, method: str, base_seed: int, *,
              own_copy: bool = False) -> WorkerCtx:
        """Per-worker state of one worker. ``own_copy``: an inline worker reads its own shallow
        copy of the dataset, as a thread worker does (the consumer taking over from thread
        workers), instead of the dataset itself (``num_workers=0``, as torch)."""
        dataset = worker_dataset(self.dataset, "thread" if own_copy else method)
        if self.datapipe and dataset is not self.dataset:  # its graph is sharded in place:
            dataset = copy.deepcopy(self.dataset)  # each thread its own, as each process
        ctx = WorkerCtx(worker_id, num_workers, method, base_seed, dataset=dataset)
        if method == "inline":
            return ctx
        seed = base_seed + worker_id
        reset_consulted()
        if method == "process":
            torch.set_num_threads(1)
            krng.seed_global_rngs(seed)  # as torch seeds each worker process
        set_worker_info(method, worker_id, num_workers, seed, ctx.dataset)
        if self.datapipe:  # torch's _sharding_worker_init_fn: ranks first, then workers
            from torch.utils.data.graph_settings import apply_sharding

            rank, world_size = self.shard
            apply_sharding(ctx.dataset, num_workers * world_size, worker_id * world_size + rank)
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)
        return ctx

    def stop(self, ctx: WorkerCtx) -> None:
        clear_worker_info(ctx.method)

    def _new_epoch(self, ctx: WorkerCtx, epoch: int, base_seed: int, key) -> None:
        ctx.epoch, ctx.ended = epoch, False
        if ctx.method != "inline" and base_seed != ctx.base_seed:
            ctx.base_seed = base_seed
            seed = base_seed + ctx.worker_id
            if ctx.method == "process":
                krng.seed_global_rngs(seed)
            set_worker_info(ctx.method, ctx.worker_id, ctx.num_workers, seed, ctx.dataset)
        if isinstance(key, Seeded):  # an IterDataPipe's epoch (torch's _BaseDataLoaderIter)
            from torch.utils.data.graph_settings import apply_random_seed, apply_sharding

            if ctx.method == "inline":
                apply_sharding(ctx.dataset, self.shard[1], self.shard[0])
            apply_random_seed(ctx.dataset, torch.Generator().manual_seed(key.shared_seed))
            key = key.key
        if self.iterable:
            if protocol.provides(ctx.dataset, protocol.EpochAware):
                ctx.dataset.set_epoch(epoch)
            if isinstance(key, ResumeAt) and isinstance(key.state, WorkerResume):
                self._restore(ctx, key.state.states[ctx.worker_id], fresh=key.batches == 0)
            elif isinstance(key, ResumeAt):  # the source starts after the batches served
                ctx.iterator = ctx.dataset.kuat_iter_from(epoch, key.batches, key.state)
            else:
                ctx.iterator = iter(ctx.dataset)
            ctx.reports_state = self.worker_state and (
                protocol.provides(ctx.iterator, protocol.Stateful)
                or protocol.provides(ctx.dataset, protocol.Stateful))

    @staticmethod
    def _restore(ctx: WorkerCtx, blob: bytes | None, fresh: bool) -> None:
        """Resume this worker's copy from its own saved state (torchdata's order: the dataset's
        state, then ``iter()``, then the iterator's state); ``None``: start afresh. ``fresh``:
        the epoch starts (a state saved at an epoch's end): then a new ``iter()`` begins it."""
        saved = pickle.loads(blob) if blob is not None else {}
        ds = ctx.dataset
        if saved.get("dataset") is not None and protocol.provides(ds, protocol.Stateful):
            ds.load_state_dict(saved["dataset"])
        ctx.iterator = iter(ds)
        if saved.get("iterator") is not None and protocol.provides(ctx.iterator, protocol.Stateful):
            ctx.iterator.load_state_dict(saved["iterator"])
        ctx.ended = bool(saved.get("ended", False))
        if fresh and blob is not None:
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

        ``width``: threads the fetch may use (:mod:`kuat._parallel`; the loader gives an
        epoch's first batch its number of workers when the source splits batches). Work done
        by helper threads is added to ``stats`` (``fetch_s`` and ``native_s``: their busy
        seconds, ``fetch_cpu_s``: their CPU seconds), as if the worker had done it.

        Returns ``(kind, batch, stats)``: ``(OK, batch, stats)``; ``(EMPTY, None, stats)`` when
        ``on_error="skip"`` dropped every sample; ``(END, None, stats)`` when this worker's
        iterator is exhausted (iterable datasets). ``stats`` holds the fetch/collate/pin times,
        the global-RNG lock wait and the skipped samples. The batch is built inside a
        :class:`kuat.collate.batch_scope`, so it shares memory only with buffers allocated for
        it. Raises whatever the dataset, ``collate_fn`` or pinning raise (with
        ``on_error="raise"``), ``ctx.stage`` then naming which of them (``FETCH``, ``COLLATE``,
        ``PIN``); the engine turns that into a ``FAIL`` result.
        """
        ctx.stage = FETCH
        if ctx.epoch != epoch:
            self._new_epoch(ctx, epoch, base_seed, key)
        st = WorkStats()
        # buffers kuat allocates while fetching this batch are its own: the collate may return
        # views of them; anything else it copies (collate.py)
        with batch_scope(self.buffer_pool):
            t0, c0, n0 = time.perf_counter(), time.thread_time(), _native.seconds()
            h0 = _parallel.helper_totals() if width > 1 else None  # split fetches only
            with krng.epoch_context(self.seed, epoch), _parallel.share(width):
                if self.iterable:
                    data = self._next_items(ctx, st)
                else:
                    data = self._fetch_indices(ctx, epoch, key, st)
            st.fetch_s, st.fetch_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
            st.native_s = _native.seconds() - n0
            if width > 1:  # what helper threads did for this fetch (kuat._parallel)
                h1 = _parallel.helper_totals()
                st.fetch_s += h1[0] - h0[0]
                st.fetch_cpu_s += h1[1] - h0[1]
                st.native_s += h1[2] - h0[2]
            # iterable: all workers iterating all items? (#11.6); map-style: may the consumer
            # fetch in place of this worker? (consumer_may_fetch)
            if ctx.method != "inline" and (ctx.num_workers > 1 or not self.iterable):
                # (an IterDataPipe is sharded by the loader, as torch does)
                st.worker_info_consulted = worker_info_consulted() or self.datapipe
            if ctx.reports_state:  # where this worker's iterable is, after this batch
                st.worker_state = self._state_of(ctx)
            if data is None:
                return (END if self.iterable else EMPTY), None, st
            if self.fetch_collated:  # the columnar gather went straight to batch tensors
                st.samples, batch = len(key), data
            else:
                st.samples = len(data) if self.auto_collation else 1
                t1 = time.perf_counter()
                ctx.stage = COLLATE
                batch = self.collate_fn(data)
                st.collate_s = time.perf_counter() - t1
        if self.pin and ctx.method != "process":
            from kuat.device import pin_batch

            t2 = time.perf_counter()
            ctx.stage = PIN
            batch = pin_batch(batch)
            st.pin_s = time.perf_counter() - t2
        return OK, batch, st

    def _next_items(self, ctx: WorkerCtx, st: WorkStats):
        """Up to ``batch_size`` next items of this worker's iterator; None when exhausted."""
        if ctx.ended:
            return None
        it = ctx.iterator
        if not self.auto_collation:
            while True:
                try:
                    return next(it)
                except StopIteration:
                    ctx.ended = True
                    return None
                except Exception as e:
                    if self.on_error != "skip":
                        raise
                    st.skipped.append((None, type(e).__qualname__, str(e)))
        data = []
        while len(data) < self.batch_size:
            try:
                data.append(next(it))
            except StopIteration:
                ctx.ended = True
                break
            except Exception as e:
                if self.on_error != "skip":
                    raise
                st.skipped.append((None, type(e).__qualname__, str(e)))
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
            return protocol.fetch_collated(ctx.dataset)(key)
        if self.use_getitems:
            return ctx.dataset.__getitems__(key)
        return krng.map_samples(ctx.dataset.__getitem__, key)

    def _fetch(self, ctx: WorkerCtx, epoch: int, key, st: WorkStats) -> list:
        """The samples of ``key``, with global-RNG isolation where the dataset needs it."""
        if not self.isolate_rng:
            return self._get(ctx, key)
        use = self.rng_use
        if use.draws or not ctx.probed:
            ctx.probed = True
            # Once a probe in this process saw no draw, a thread's first batch is watched
            # instead: probing it would hold the exclusive lock for a whole batch and stall
            # every other worker (measured: ~80 ms at an epoch's start, after which one worker
            # ran a batch behind and the loader held one more batch buffer). The watch catches
            # a draw all the same and re-fetches the batch isolated. Without the watch (false
            # alarms) and in worker processes (their own generators) each worker still probes.
            if not self._may_watch_first(ctx):
                data = self._isolated(ctx, epoch, key, st, first=True)
                if data is not _WATCH:
                    return data
        if not use.watch:
            return self._get(ctx, key)
        lock = isolate.GLOBAL_RNG_LOCK
        lock.acquire_shared()
        try:
            before = isolate.fingerprint()
            data = self._get(ctx, key)
            drew = isolate.fingerprint() != before
        finally:
            lock.release_shared()
        if not drew:
            return data
        del data  # fetched with unseeded draws (or another thread drew): fetch it isolated
        data = self._isolated(ctx, epoch, key, st)
        if not use.draws:
            use.false_alarm()
        return data

    def _may_watch_first(self, ctx: WorkerCtx) -> bool:
        """Whether this worker's first batch may be watched instead of probed: a thread (or the
        consumer) of a process where a probe already saw no draw, while the watch is on."""
        use = self.rng_use
        return ctx.method != "process" and use.probed and use.watch and not use.draws

    def _isolated(self, ctx: WorkerCtx, epoch: int, key, st: WorkStats, first: bool = False):
        """The samples of ``key`` with the global RNGs reseeded per sample (``__getitem__``)
        or per batch (``__getitems__``), under the exclusive lock; probes whether the dataset
        draws until that is known. With ``first`` (a worker's first batch), returns ``_WATCH``
        instead when, by the time the lock is had, another thread of this process has probed a
        batch and seen no draw (workers that started together then watch side by side instead
        of probing one after another)."""
        ds, use = ctx.dataset, self.rng_use
        t0 = time.perf_counter()
        with isolate.GLOBAL_RNG_LOCK:
            st.rng_wait_s += time.perf_counter() - t0
            if first and self._may_watch_first(ctx):
                return _WATCH
            saved = isolate.save() if ctx.method != "process" else None
            try:
                if self.use_getitems:
                    isolate.seed_globals_cpu(krng.global_rng_seed(self.seed, epoch, _batch_key(key)))
                    probe = None if use.draws else isolate.fingerprint()
                    out = self._get(ctx, key)
                    if probe is not None and isolate.fingerprint() != probe:
                        use.draws = True
                    use.probed = True
                    return out
                out = []
                for i in key:
                    isolate.seed_globals_cpu(krng.global_rng_seed(self.seed, epoch, _index_key(i)))
                    probe = None if use.draws else isolate.fingerprint()
                    out += krng.map_samples(ds.__getitem__, (i,))
                    if probe is not None and isolate.fingerprint() != probe:
                        use.draws = True
                use.probed = True
                return out
            finally:
                if saved is not None:
                    isolate.restore(saved)
