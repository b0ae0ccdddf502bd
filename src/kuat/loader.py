"""``kuat.DataLoader``: a drop-in for ``torch.utils.data.DataLoader``: sampler -> engine -> device.

Pipeline (DESIGN.md, "Data flow"): the sampler gives each epoch's batches of indices from
``(seed, epoch, rank, world_size)``; an engine (``kuat.engine``: inline, threads or processes)
fetches and collates each batch in a worker; the consumer restores order, pins or copies to a
device one batch ahead, applies the dataset's ``kuat_batch_transform`` and yields. Every choice
(engine, sampler, RNG isolation, pinning) is made once, at construction or when an epoch starts
(the first ``next()`` of an iterator: ``iter()`` alone starts nothing); the per-batch loop
(``_LoaderIter._next_batch``) only dispatches tasks and takes results.

Seams with sources (``kuat.sources``)
--------------------------------------
The loader calls ``kuat.sources.as_source(dataset)`` once, at construction, and reads what it
returns (``loader.dataset`` stays the object the user passed). A source is either

* map-style: ``__len__`` and ``__getitem__(index)``, optionally ``__getitems__(indices) ->
  list of samples`` (then one call per batch, as torch does); or
* iterable: an instance of ``torch.utils.data.IterableDataset``; each worker iterates it and
  shards itself with ``torch.utils.data.get_worker_info()`` (per thread in thread mode).

Every optional hook the loader honours on a source (``kuat_fetch_collated``, ``kuat_prefetch``,
``kuat_batch_transform``, ``kuat_set_distributed``, ``state_dict``, ...) is named, with when it is
called, its shapes and its thread-safety, in one place: :mod:`kuat.sources.protocol`; the loader
checks sources against those protocols and accessors only.

Seams with frameworks
---------------------
The loader is a ``torch.utils.data.DataLoader`` (a subclass that replaces torch's iteration with
kuat's engine; torch's ``__setattr__``, ``multiprocessing_context``, ``_auto_collation`` and
``_index_sampler`` are inherited unchanged). Frameworks that rebuild a loader from its attributes
(Lightning's ``_update_dataloader``: ``type(loader)(**attributes named like __init__ arguments)``)
get a kuat loader with the same kuat options back, because every ``__init__`` argument is kept
as a public attribute of that name (``rank``/``world_size`` are live properties, so a rebuilt
loader resolves them again). Its own sampler is a ``DistributedSampler``
(:class:`kuat.sampling.EpochSampler`), so frameworks see no need to inject one. Integrations for
frameworks that do not rebuild ``type(loader)`` live in :mod:`kuat.integrations`.
"""

from __future__ import annotations

import collections
import copy
import itertools
import logging
import math
import multiprocessing
import os
import pickle
import queue
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, IterableDataset, Sampler, SequentialSampler
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data._utils.collate import default_collate as torch_default_collate
from torch.utils.data._utils.collate import default_convert
from torch.utils.data.dataloader import _DatasetKind

from kuat import sources as _sources
from kuat._buffers import BufferPool
from kuat.collate import default_collate
from kuat.device import DeviceCopier, accelerator_available
from kuat.engine.base import END, FAIL, OK, ResumeAt, Task
from kuat.engine.inline import InlineEngine
from kuat.engine.job import FetchJob, per_sample_getitems
from kuat.engine.process import ProcessEngine
from kuat.engine.thread import ThreadEngine
from kuat.errors import LoaderTimeoutError
from kuat.rng import epoch_context
from kuat.sampling import (
    EpochSampler,
    describe_sampler,
    next_request,
    order_state,
    restore_order,
    sampler_generator,
)
from kuat.sources import protocol as _protocol

__all__ = ["DataLoader"]

log = logging.getLogger("kuat.loader")

_STATE_VERSION = 1
_TASK_IDS = itertools.count()  # unique across iterators, so stale results are recognised
_MASK63 = (1 << 63) - 1
# Workers with the default prefetch_factor: batches whose fetch + collate take less than this
# of CPU (the worker thread's own time: waiting for the GIL held by the other threads inflates
# wall times several-fold on a busy machine) and less than _CHEAP_WALL_FACTOR times it of wall
# time (a batch waiting on I/O is not cheap) are "cheap", and up to _CHEAP_PREFETCH per worker
# are kept in flight (benchmarks/bench_overhead.py: a no-op batch costs ~48 us inline, ~80 us
# with 2 threads at depth 2, ~55 us at depth 8, on a loaded 2-core machine).
_CHEAP_BATCH_S = 0.5e-3
_CHEAP_WALL_FACTOR = 4
_CHEAP_PREFETCH = 8
_INLINE_PROBE = 16  # batches observed before deciding to fetch cheap batches in the consumer
# ... and only while the training loop's own time per batch (between next() calls) is under this
# share of the batch's fetch + collate work: worker threads could hide at most that much
_INLINE_MAX_LOOP_SHARE = 0.25


def _base_seed(seed: int, epoch: int) -> int:
    """Per-epoch base of the per-worker seeds (``base + worker_id``, as torch's ``base_seed``)."""
    ss = np.random.SeedSequence([seed & ((1 << 64) - 1), epoch & ((1 << 64) - 1), 0x57524B52])
    lo, hi = ss.generate_state(2, np.uint32)
    return (int(lo) | (int(hi) << 32)) & (_MASK63 >> 8)


class _Stats:
    """Cumulative counters of one loader (all its iterators)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.lock = threading.Lock()

    def reset(self):
        self.fetch_s = self.fetch_cpu_s = self.collate_s = self.pin_s = self.rng_wait_s = 0.0
        self.native_s = 0.0
        self.device_s = self.transform_s = self.wait_s = self.worker_wait_s = self.elapsed_s = 0.0
        self.batches = self.samples = self.skipped = 0


class DataLoader(_TorchDataLoader):
    """Iterate batches of ``dataset``; a drop-in for ``torch.utils.data.DataLoader``.

    Every argument torch's DataLoader takes keeps torch's meaning, default and validation
    errors (mirrored from ``torch/utils/data/dataloader.py``); ``len()`` follows torch. The
    kuat additions are keyword-only.

    Args:
        dataset: a map-style dataset (``__getitem__``/``__len__``, optionally ``__getitems__``)
            or a ``torch.utils.data.IterableDataset``. Read through
            ``kuat.sources.as_source(dataset)``.
        batch_size, shuffle, sampler, batch_sampler, drop_last, collate_fn: as in torch. The
            default ``collate_fn`` is :func:`kuat.default_collate` (torch's structures, zero-copy
            when samples are consecutive views of one batch buffer).
        num_workers: ``0`` fetches in the calling thread; ``N`` uses N worker threads
            (``worker_type="thread"``) or processes (``worker_type="process"``).
        pin_memory: return tensors in pinned memory (containers as torch). Without an
            accelerator pinning is skipped with one warning, as torch does.
        timeout: seconds to wait for a batch from the workers before
            :class:`kuat.errors.LoaderTimeoutError`; ``0`` waits forever. Must be ``0`` when
            ``num_workers=0`` (torch fails with an assertion at iteration; kuat raises
            ``ValueError`` at construction).
        worker_init_fn: called once in each worker (thread or process) with its id, after
            seeding, with ``get_worker_info()`` set.
        multiprocessing_context: start method for process workers; default ``fork`` on Linux
            (as torch), else the platform default, with the job pickled once into bytes.
            Ignored by thread workers.
        generator: as torch: drives the shuffle (``RandomSampler``'s draws, lazily, so orders
            and the generator's state equal torch's for the same generator, also over abandoned
            epochs) and each epoch's ``base_seed`` (one draw when the epoch's first batch is
            requested). Orders then depend on the generator's state: :meth:`state_dict` saves
            it as it was when the epoch started (as torchdata's ``StatefulDataLoader`` does),
            so resume stays exact.
        prefetch_factor: batches in flight per worker (default 2 with workers, as torch). When
            it is not given, workers (threads or processes) keep up to 8 per worker in flight
            while batches take under 0.5 ms of work, so that each worker wakes once per several
            cheap batches instead of once per batch (the attribute still reads 2); and, with
            thread workers, when most of the first 16 batches are that cheap, the training loop
            waited for them and its own time between batches is under a quarter of their work,
            a map-style dataset is fetched in the training loop's thread for the rest of the
            epoch, as with ``num_workers=0`` (a hand-off costs more than the work), from a
            shallow copy of its own, as a worker's. Never with a ``worker_init_fn`` or when a
            worker's dataset called ``get_worker_info()`` (its batches may depend on the
            worker), unless the source declares ``kuat_thread_agnostic`` (kuat datasets; pure
            sequences; torch's ``Subset``, ``random_split``, ``StackDataset``,
            ``ConcatDataset`` and ``kuat.mix`` of those: ``kuat.sources.protocol``).
            An epoch's first batch of a source that splits batches (a kuat dataset with a fused
            image transform, ``kuat_splits_batches``; a ``kuat.mix``, torch ``Subset`` or
            ``random_split`` part of one) is fetched alone, by all workers' cores
            (thread or process workers), and the others start when it is back: the loop
            gets it in about ``1 / num_workers`` of a batch's time. Memory: each batch in
            flight holds its own buffer from the moment a worker starts it, so up to
            ``prefetch_factor * num_workers`` batches plus the one the loop holds are resident
            (``(64, 3, 224, 224)`` uint8: 9.2 MiB each); ``prefetch_factor=1`` trades prefetch
            depth for memory.
        persistent_workers: keep workers between epochs.
        pin_memory_device: deprecated in torch; ignored with torch's warning.
        in_order: yield batches in sampler order (``True``) or as they complete.
        worker_type: ``None`` (default), ``"thread"`` or ``"process"``. ``None`` starts
            thread workers and moves to process workers as soon as the dataset is seen to draw
            from the global random generators (``isolate_global_rng``: those samples would run
            one at a time in threads, and at the speed of torch's process workers in
            processes); the in-flight batches finish first, the new workers run
            ``worker_init_fn`` again, and ``loader.worker_type`` tells which is in use (logged
            at INFO). Each thread worker reads its own
            shallow copy of the dataset (``copy.copy``, a few microseconds per worker start),
            so, as in torch's worker processes, what a worker sets on it (``worker_init_fn``
            narrowing ``get_worker_info().dataset``, a handle opened lazily) stays in that
            worker, while the data its attributes point to (tensors, arrays, memory-mapped
            shards, caches created in ``__init__``) is shared, not copied; define ``__copy__``
            to change that. Threads need no pickling and no start-up and run truly in parallel
            wherever the work releases the GIL (NumPy, torch ops, image decoding, Arrow
            gathers); pure-Python per-sample work is GIL-bound (``stats()``: ``fetch_cpu`` far
            below ``fetch`` and a high ``input_bound_fraction``). Process workers send each
            batch's tensors through a reused ring of nameless shared-memory slots (about as
            many per worker as it has batches in flight; nothing is left in ``/dev/shm`` even
            when a process is killed); tensors of 256 KiB and more reach the training loop as views of their
            slot (no copy; the slot is reused once they are gone), smaller ones are copied,
            and with pinning the batch is copied once into pinned memory. On a time-out, an
            error or Ctrl-C, control comes back at once: busy process workers are terminated,
            busy thread workers are left to finish their current sample and end.
        seed: the run seed; shuffle order depends only on ``(seed, epoch, rank, world_size)``
            and each sample's randomness on ``(seed, epoch, index)``. ``None`` (default): the
            first epoch's ``base_seed`` becomes the seed (``seed`` reads ``None`` until then),
            so ``torch.manual_seed`` makes runs reproducible; and on one process
            ``shuffle=True`` shuffles as torch's ``RandomSampler`` does, from the seed it draws
            from torch's default generator each epoch (saved by :meth:`state_dict`), so the
            batches are torch's. Whatever the seed, the loader
            draws from torch's default generator (or ``generator``) exactly as torch's
            DataLoader does, one int64 per epoch (the first epoch only with
            ``persistent_workers``), so code that shares that generator gets torch's numbers.
            Pass the same seed on every rank.
        device: ``None``, ``"cpu"`` or a CUDA device: batches are copied there on a side
            stream, one batch ahead. ``ValueError`` at construction when CUDA is absent.
        on_error: ``"raise"`` (default) or ``"skip"``: drop samples whose fetch raises (the
            batch is retried one sample at a time), warn once per distinct error, count them in
            :meth:`stats`, never yield an empty batch.
        rank, world_size: this process's share; give both or neither. ``None`` (default):
            resolved again when each epoch starts (and by ``len()``): from ``torch.distributed``
            when it is initialised, else from the ``RANK``/``WORLD_SIZE`` environment variables
            (torchrun sets them; one warning per process that the process group is not up),
            else ``0`` and ``1``. So a loader built before ``init_process_group`` (or by a
            framework before it spawns) reads its rank's share. ``loader.rank`` and
            ``loader.world_size`` give the current resolution. Only the loader's own sampler is
            sharded (a user ``sampler``/``batch_sampler`` is used as given): every rank gets the
            same number of batches, padded by wrap-around (``DistributedSampler``) or, with
            ``drop_last``, truncated.
        isolate_global_rng: make a map-style dataset's draws from Python's ``random``, NumPy's
            global generator and torch's default CPU generator reproducible whatever the worker
            count and type: a dataset seen to draw (each worker's first batch is probed, later
            batches are watched; see :mod:`kuat.engine.isolate`) runs each ``dataset[i]`` with
            those generators reseeded from ``(seed, epoch, i)``, or each ``__getitems__`` call
            from ``(seed, epoch, batch indices)``, under a process-wide lock, restoring the
            caller's generator states after. Datasets that do not draw pay about 3 us per
            batch (``range``, lists, tuples, arrays, tensors and ``TensorDataset``: nothing).
            In thread mode the samples of a drawing dataset run one at a time
            (``stats()["busy_s"]["rng_lock_wait"]`` shows the cost). torch's ``Subset`` (and
            so ``random_split``) over a per-sample dataset is read per sample, so each sample
            is isolated. ``None`` (default): on unless the dataset sets
            ``kuat_uses_sample_rng = True`` (or every dataset a torch wrapper or a ``kuat.mix``
            reads does); never for iterable datasets (process workers still
            seed the global RNGs per worker, as torch does; thread workers share the process's).
        snapshot_every_n_steps: accepted for torchdata ``StatefulDataLoader`` compatibility
            (a positive int or ``None``) and stored; kuat's state is a few integers taken at
            any step, so every :meth:`state_dict` call is exact whatever its value.

    Iteration is lazy, as a framework expects: ``iter(loader)`` neither starts workers nor
    advances the epoch; the epoch starts (rank and world size resolved, generator state saved,
    workers started) at the first ``next()``. The loader pickles (also after iterating; live
    workers are not carried: a persistent pool is started again on the other side).

    Raises:
        ValueError / TypeError: invalid arguments (torch's messages for torch's arguments and
            for the checks torch's samplers make, e.g. ``shuffle=True`` over an empty dataset).

    Thread-safety: iterate a loader from one thread at a time; :meth:`stats` and
    :meth:`state_dict` may be called from any thread.
    """

    __initialized = False  # the same mangled name as torch's, so torch's __setattr__ guard holds
    # Accelerate's save_state/load_state store state_dict() of loaders that declare this
    # (torchdata's StatefulDataLoader call pattern); kuat's state is exact at every batch.
    use_stateful_dataloader = True

    def __init__(
        self,
        dataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | Iterable | None = None,
        batch_sampler: Sampler | Iterable | None = None,
        num_workers: int = 0,
        collate_fn: Callable | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable | None = None,
        multiprocessing_context=None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        worker_type: str | None = None,
        seed: int | None = None,
        device: str | torch.device | None = None,
        on_error: str = "raise",
        rank: int | None = None,
        world_size: int | None = None,
        isolate_global_rng: bool | None = None,
        snapshot_every_n_steps: int | None = None,
    ):
        # --- torch's checks, in torch's order and with torch's messages ------------------
        if num_workers < 0:
            raise ValueError(
                "num_workers option should be non-negative; "
                "use num_workers=0 to disable multiprocessing."
            )
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if num_workers == 0 and prefetch_factor is not None:
            raise ValueError(
                "prefetch_factor option could only be specified in multiprocessing."
                "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
            )
        adaptive_prefetch = prefetch_factor is None
        if num_workers > 0 and prefetch_factor is None:
            prefetch_factor = 2
        elif prefetch_factor is not None and prefetch_factor < 0:
            raise ValueError("prefetch_factor option should be non-negative")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")

        # --- kuat's own arguments ------------------------------------------------------------
        if worker_type not in (None, "thread", "process"):
            raise ValueError(
                f"worker_type should be None, 'thread' or 'process', got {worker_type=}")
        auto_worker_type = worker_type is None
        if worker_type is None:
            worker_type = "thread"
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error should be 'raise' or 'skip', got {on_error=}")
        if timeout > 0 and num_workers == 0:
            raise ValueError(
                f"timeout={timeout} needs num_workers > 0: with num_workers=0 batches are loaded "
                "in the calling thread, which cannot time out (torch fails at iteration)"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise TypeError(f"seed should be an int or None, got {seed=!r}")
        seed_was_none = seed is None  # then the first epoch's base_seed draw becomes the seed
        if snapshot_every_n_steps is not None and (
            isinstance(snapshot_every_n_steps, bool) or not isinstance(snapshot_every_n_steps, int)
            or snapshot_every_n_steps < 1
        ):
            raise ValueError(
                f"snapshot_every_n_steps should be a positive int or None, got {snapshot_every_n_steps=!r}"
            )
        self._device = _check_device(device)
        self._rank_arg, self._world_size_arg = _check_distributed(rank, world_size)
        rank, world_size = self._resolve_distributed(warn=False)

        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self._adaptive_prefetch = adaptive_prefetch  # workers, prefetch_factor not given
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.in_order = in_order
        self.worker_type = worker_type
        self._auto_worker_type = auto_worker_type and num_workers > 0
        self.seed = None if seed is None else int(seed)
        self._torch_base_seed: int | None = None  # the last base_seed drawn as torch draws it
        self.device = self._device
        self.on_error = on_error
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self._seed_was_none = seed_was_none
        self._torch_order = seed_was_none  # shuffle=True on one process shuffles as torch's
        self._dist_applied: tuple[int, int] | None = None  # (rank, world_size) of the last epoch

        source = _sources.as_source(dataset)
        self._source = source
        iterable = isinstance(source, IterableDataset) or isinstance(dataset, IterableDataset)
        if iterable:
            if shuffle not in {False, None}:
                raise ValueError(
                    f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
                )
            if sampler is not None:
                raise ValueError(
                    f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}"
                )
            elif batch_sampler is not None:
                raise ValueError(
                    "DataLoader with IterableDataset: expected unspecified "
                    f"batch_sampler option, but got batch_sampler={batch_sampler}"
                )
        else:
            shuffle = bool(shuffle)
        self._iterable = iterable
        self._dataset_kind = _DatasetKind.Iterable if iterable else _DatasetKind.Map

        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive "
                    "with batch_size, shuffle, sampler, and "
                    "drop_last"
                )
            batch_size = None
            drop_last = False
        elif batch_size is None:
            if drop_last:
                raise ValueError(
                    "batch_size=None option disables auto-batching "
                    "and is mutually exclusive with drop_last"
                )

        self._own_sampler = sampler is None and not iterable
        if sampler is None:
            if iterable:
                sampler = _InfiniteSampler()
                if _protocol.provides(source, _protocol.Batching):  # workers take whole batches
                    source.kuat_set_batching(batch_size, drop_last)
            elif batch_sampler is None:
                sampler = EpochSampler(
                    source, shuffle=shuffle, seed=self.seed, rank=rank,
                    world_size=world_size, drop_last=drop_last, generator=generator,
                )
            else:
                sampler = SequentialSampler(source)
                self._own_sampler = False
        if batch_size is not None and batch_sampler is None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)

        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        auto_collation = batch_sampler is not None
        if collate_fn is None:
            collate_fn = default_collate if auto_collation else default_convert
        self.collate_fn = collate_fn
        self.persistent_workers = persistent_workers

        # --- what workers run, decided once ---------------------------------------------------
        use_getitems = (auto_collation and not iterable
                        and _protocol.provides(source, _protocol.BatchFetch)
                        and not per_sample_getitems(source))
        if isolate_global_rng is None:
            isolate_global_rng = not _protocol.uses_sample_rng(source)
        if not isinstance(isolate_global_rng, bool):
            raise TypeError(f"isolate_global_rng should be a bool or None, got {isolate_global_rng=!r}")
        self.isolate_global_rng = isolate_global_rng
        self._pin = False
        if pin_memory and pin_memory_device:
            warnings.warn(
                "pin_memory_device is deprecated, the current accelerator will be used as the device,"
                f"ignore pin_memory_device='{pin_memory_device}'.",
                stacklevel=2,
            )
        if pin_memory or (self._device is not None and self._device.type == "cuda"):
            if accelerator_available():
                self._pin = True
            else:
                warnings.warn(
                    "'pin_memory' argument is set as true but no accelerator is found, "
                    "then device pinned memory won't be used.",
                    stacklevel=2,
                )
        # torch's default_collate allocates in shared memory inside any worker (it sees
        # get_worker_info()); kuat's gives the same structures without that, and zero-copy.
        job_collate = default_collate if collate_fn is torch_default_collate else collate_fn
        self._job = FetchJob(
            dataset=source,
            iterable=iterable,
            auto_collation=auto_collation,
            batch_size=batch_size,
            drop_last=drop_last,
            collate_fn=job_collate,
            seed=self.seed,
            isolate_rng=isolate_global_rng and not iterable,
            on_error=on_error,
            worker_init_fn=worker_init_fn,
            use_getitems=use_getitems,
            fetch_collated=(use_getitems and job_collate is default_collate and on_error == "raise"
                            and _protocol.fetch_collated(source) is not None),
            pin=self._pin and worker_type == "thread" or (self._pin and num_workers == 0),
            # batch-sized buffers reused once freed, outside malloc's arenas (kuat/_buffers.py)
            buffer_pool=BufferPool(),
        )
        self._job_bytes: bytes | None = None
        self._batch_transform = _protocol.batch_transform(source)
        self._stats = _Stats()
        self._warned: set[tuple[str, str]] = set()
        self._advised = False
        self._warned_unsplit = False
        self._engine = None  # persistent workers only
        self._live_iter = None  # weakref to the iterator using the persistent workers
        self._progress: list | None = None  # [epoch, batches served, exhausted] of the last iter
        self._pending: tuple[int, int] | None = None  # (epoch, batches to skip) for the next iter
        self._closed = False
        self._IterableDataset_len_called = None
        self._iterator = None  # torch's attribute; kuat keeps persistent workers in _engine
        self._gradient_state = None  # Accelerate's GradientState, once prepared by Accelerate
        self._skip_first = 0  # batches the next epoch skips (skip_first_batches)
        self._source_at: tuple = (None, None, None)  # (epoch, served, source state) loaded
        self._progress_owner = None  # weakref: the loader a skip_first_batches copy reports to
        self.__initialized = True
        self.check_worker_number_rationality()
        if "accelerate" in sys.modules:  # route Accelerate's prepare/skip for kuat loaders here
            from kuat.integrations.accelerate import install

            try:
                install()
            except ImportError as e:  # a broken Accelerate install: the loader works without it
                log.debug("kuat.DataLoader: Accelerate integration not installed: %s", e)

    def check_worker_number_rationality(self) -> None:
        """Warn, as torch does, when more worker *processes* than usable CPUs are asked for.

        Thread workers are not counted: they are cheap and mostly wait on work that releases
        the GIL.
        """
        if not self.num_workers or self.worker_type != "process":
            return
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cpus is not None and self.num_workers > cpus:
            warnings.warn(
                f"This DataLoader will create {self.num_workers} worker processes in total. Our "
                f"suggested max number of worker in current system is {cpus}, which is smaller "
                "than what this DataLoader is going to create.",
                stacklevel=3,
            )

    # --- rank and world size ------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank now (the explicit ``rank=``, else resolved; see the class doc)."""
        return self._resolve_distributed(warn=False)[0]

    @property
    def world_size(self) -> int:
        """The number of ranks now (the explicit ``world_size=``, else resolved)."""
        return self._resolve_distributed(warn=False)[1]

    def _resolve_distributed(self, warn: bool = True) -> tuple[int, int]:
        if self._rank_arg is not None:
            return self._rank_arg, self._world_size_arg
        return _distributed_from_environment(warn)

    def _apply_distributed(self) -> tuple[int, int]:
        """Resolve rank and world size and hand them to the sampler / iterable source."""
        rank, world_size = self._resolve_distributed()
        if isinstance(self.sampler, EpochSampler):
            self.sampler.set_distributed(rank, world_size)
        if (rank, world_size) != self._dist_applied:
            if self._iterable and _protocol.provides(self._source, _protocol.Distributed):
                self._source.kuat_set_distributed(rank, world_size)
                self._job_bytes = None  # spawned workers get the source with its new share
                if self._engine is not None:  # persistent workers hold the old share
                    self._engine.close()
                    self._engine = None
            if world_size > 1 and self._seed_was_none and self._own_sampler:
                log.warning("kuat.DataLoader on rank %d of %d drew its seed from torch's default "
                            "generator; pass the same seed= on every rank so that all ranks "
                            "shuffle alike", rank, world_size)
            self._dist_applied = (rank, world_size)
        return rank, world_size

    def __len__(self) -> int:
        self._apply_distributed()
        if self._skip_first:
            return max(0, self._len() - self._skip_first)
        return self._len()

    def _len(self) -> int:
        if self._iterable:
            length = self._IterableDataset_len_called = len(self._source)
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else math.ceil(length / self.batch_size)
            return length
        return len(self._index_sampler)

    # --- epochs and state -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next epoch started ``epoch`` (later ones follow from it).

        Calling ``loader.sampler.set_epoch(epoch)`` (what Lightning and the HF Trainer do with a
        ``DistributedSampler``) has the same effect; the later call wins, except that it keeps
        the position of a :meth:`load_state_dict` of the same epoch.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch should be a non-negative int, got {epoch=!r}")
        self._pending = (next_request(), int(epoch), 0, {})

    def _batches_per_epoch(self) -> int | None:
        if self._iterable:
            return None
        try:
            return len(self)
        except TypeError:
            return None

    def _order_at_start(self) -> dict[str, Any]:
        """The states an epoch started now would begin from (``state_dict()`` between epochs).

        A user sampler's state is left out when it follows from others: when it draws from
        torch's global RNG (a fresh epoch draws from it as it will be then) or from the loader's
        own ``generator`` (restored, then drawn from as in the uninterrupted run).
        """
        rng: dict[str, Any] = {}
        if self.generator is not None:
            rng["generator"] = self.generator.get_state()
        if not self._own_sampler and not self._iterable:
            state = order_state(self._index_sampler)
            follows = state is not None and (
                "global_rng" in state
                or (self.generator is not None and sampler_generator(self._index_sampler) is self.generator)
            )
            if not follows:
                rng["sampler"] = state
        return rng

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: a small dict of ints (plus the source's own state).

        Keys: ``version``, ``seed``, ``torch_order`` (``shuffle=True`` shuffles as torch's
        ``RandomSampler``: ``seed=None``), ``epoch`` (the epoch the next batch belongs to),
        ``batches_served_in_epoch``, ``rank``, ``world_size``; ``sampler_seed`` (mid-epoch,
        with ``torch_order``: the seed that epoch's shuffle drew); ``source`` when the source has
        ``kuat_state_at()`` (iterable sources) or ``state_dict()``; ``generator`` (a
        ``torch.uint8`` state tensor of ``generator=`` as it was when the epoch started, as
        torchdata's ``StatefulDataLoader`` saves it); for a user
        ``sampler``/``batch_sampler``, ``sampler``: what its order depends on
        (:func:`kuat.sampling.order_state`: its own ``state_dict()``, its generator's state,
        torch's global RNG state, its epoch), or ``None`` when kuat cannot tell. Taken mid-epoch
        it resumes after the last batch yielded; at the end of an epoch it points at the start
        of the next one. Costs a few microseconds (plus a generator state copy, a few KiB; for a
        source with ``kuat_state_at``, its own cost: ``kuat.pack``'s fit strategies extend their
        plan from the last point asked, lengths only, one plan of the epoch over all calls).
        Called with no arguments, as ``StatefulDataLoader.state_dict()``.
        """
        if self._pending is not None:
            _, epoch, served, rng = self._pending
        elif self._progress is None:
            epoch, served, rng = 0, 0, None
        else:
            epoch, served, exhausted, rng = self._progress
            n = self._batches_per_epoch() if not exhausted else None
            if exhausted or (n is not None and served >= n):
                epoch, served, rng = epoch + 1, 0, None
        if rng is None or not rng:  # the next epoch starts from the states as they are now
            rng = self._order_at_start()
        rank, world_size = self._resolve_distributed(warn=False)
        state = {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "torch_order": self._torch_order,
            "epoch": epoch,
            "batches_served_in_epoch": served,
            "rank": rank,
            "world_size": world_size,
            **rng,
        }
        if self._iterable and _protocol.provides(self._source, _protocol.PlanState):
            state["source"] = self._source.kuat_state_at(epoch, served, rank, world_size)
        elif _protocol.provides(self._source, _protocol.Stateful):
            state["source"] = self._source.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next epoch started continues that position.

        The seed is taken from the state, and ``generator=``'s state (as it was when the saved
        epoch started) is restored. The number of workers and their type may differ; the rank
        may differ (all ranks are at the same position), the world size may not.

        Warns (``UserWarning``) when the resume cannot be exact: another world size, a state
        saved with (without) ``generator=`` loaded into a loader without (with) one, or a user
        sampler whose order kuat cannot save (the warning names it; kuat then replays
        ``iter(sampler)`` and skips the batches already served).

        Raises:
            ValueError: the state is not a kuat loader state of a known version.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"not a kuat DataLoader state of version {_STATE_VERSION}: {state!r:.200}")
        world_size = self._resolve_distributed(warn=False)[1]
        served = int(state["batches_served_in_epoch"])
        if state.get("world_size") != world_size:
            warnings.warn(f"kuat DataLoader: resuming a state saved with world_size="
                          f"{state.get('world_size')} with world_size={world_size}: rank shares "
                          "differ, resume is not exact", stacklevel=2)
        rng: dict[str, Any] = {}
        if (state.get("generator") is None) != (self.generator is None):
            warnings.warn("kuat DataLoader: the state was saved "
                          f"{'with' if state.get('generator') is not None else 'without'} a "
                          f"generator= and this loader has {'one' if self.generator else 'none'}: "
                          "the order of the resumed epoch is not the saved one", stacklevel=2)
        elif self.generator is not None:
            rng["generator"] = state["generator"]
        if state.get("sampler_seed") is not None:  # the epoch's torch-style shuffle seed
            rng["sampler_seed"] = state["sampler_seed"]
        self._torch_order = bool(state.get("torch_order", self._torch_order))
        if not self._own_sampler and not self._iterable:
            if "sampler" in state and state["sampler"] is not None:
                rng["sampler"] = state["sampler"]
            elif served:
                warnings.warn(
                    f"kuat DataLoader: cannot tell what the order of the user "
                    f"{describe_sampler(self._index_sampler)} depends on (no state_dict(), no "
                    "generator, not a torch sampler): resuming replays iter(sampler) and skips "
                    f"the {served} batches served, exact only if its order repeats",
                    stacklevel=2,
                )
        if state["seed"] is not None:  # None: saved before the first epoch drew it
            self._set_seed(state["seed"])
        if self._engine is not None:  # persistent workers hold the old seed
            self._engine.close()
            self._engine = None
        # the source's own point in its plan there, handed to kuat_iter_from (iterable sources)
        self._source_at = (int(state["epoch"]), served, state.get("source"))
        self._pending = (next_request(), int(state["epoch"]), served, rng)
        if "source" in state and _protocol.provides(self._source, _protocol.Stateful):
            self._source.load_state_dict(state["source"])

    # --- statistics -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Where input time went, summed over this loader's iterations so far.

        Returns a dict: ``batches``, ``samples``, ``skipped_samples``; ``elapsed_s`` (wall time
        inside iteration, from the first ``next()`` of each epoch to its last); ``busy_s``, the
        seconds each stage was busy, summed over workers: ``fetch`` (dataset calls), ``fetch_cpu``
        (their CPU time: far below ``fetch`` in thread mode means GIL-bound or I/O-bound),
        ``collate``, ``pin``, ``rng_lock_wait`` (waiting for global-RNG isolation), ``device``
        (consumer: copy out of shared memory / to the device), ``batch_transform``;
        ``consumer_wait_s`` (the training loop waiting for data: every second spent inside
        ``next()``, waiting for workers, copying out of shared memory or to the device, pinning
        and batch transforms included), ``worker_wait_s`` (the part of it spent waiting for a
        worker's result), ``input_bound_fraction`` (``consumer_wait_s / elapsed_s``: the
        fraction of the loop's time it waited for its input), ``batches_per_s``, ``samples_per_s``,
        ``worker_busy_fraction`` (``(fetch + collate) / (elapsed_s * num_workers)``);
        ``loader_overhead_us_per_batch``: microseconds per batch that ``next()`` spent in kuat's
        own machinery (dispatch, ordering, hand-off, bookkeeping): ``consumer_wait_s`` minus the
        dataset's fetch, collate and pinning (with ``num_workers=0``) or minus ``worker_wait_s``
        (with workers), minus device copies and batch transforms, per batch;
        ``loader_overhead_fraction``: the same seconds over ``elapsed_s`` (the share of the
        loop's time, i.e. of the mean batch time, that this machinery costs).
        ``busy_s["native"]``: of ``fetch``, the seconds inside native kernels that release the
        GIL and report themselves (``kuat.vision``'s JPEG decodes and resizes);
        ``fetch_python_fraction``: ``(fetch - native) / fetch``, the share of the dataset calls
        spent around those kernels (per-sample Python, generators, allocation, wrapping,
        waiting for the GIL); ``None`` when no kernel reported (other sources).
        """
        s = self._stats
        with s.lock:
            el = s.elapsed_s
            return {
                "batches": s.batches,
                "samples": s.samples,
                "skipped_samples": s.skipped,
                "elapsed_s": el,
                "busy_s": {
                    "fetch": s.fetch_s,
                    "fetch_cpu": s.fetch_cpu_s,
                    "native": s.native_s,
                    "collate": s.collate_s,
                    "pin": s.pin_s,
                    "rng_lock_wait": s.rng_wait_s,
                    "device": s.device_s,
                    "batch_transform": s.transform_s,
                },
                "consumer_wait_s": s.wait_s,
                "worker_wait_s": s.worker_wait_s,
                "input_bound_fraction": s.wait_s / el if el > 0 else 0.0,
                "batches_per_s": s.batches / el if el > 0 else 0.0,
                "samples_per_s": s.samples / el if el > 0 else 0.0,
                "worker_busy_fraction": (s.fetch_s + s.collate_s) / (el * max(1, self.num_workers))
                if el > 0 else 0.0,
                "loader_overhead_us_per_batch": self._overhead_s(s) / s.batches * 1e6
                if s.batches else 0.0,
                "loader_overhead_fraction": self._overhead_s(s) / el if el > 0 else 0.0,
                # of the dataset calls, the part outside GIL-releasing kernels that report
                # themselves (kuat.vision's decodes and resizes); None when none reported
                "fetch_python_fraction": max(0.0, s.fetch_s - s.native_s) / s.fetch_s
                if s.native_s > 0 and s.fetch_s > 0 else None,
            }

    def _overhead_s(self, s: _Stats) -> float:
        work = s.fetch_s + s.collate_s + s.pin_s if self.num_workers == 0 else s.worker_wait_s
        return max(0.0, s.wait_s - work - s.device_s - s.transform_s)

    # --- iteration --------------------------------------------------------------------------
    def __iter__(self) -> _LoaderIter:
        """An iterator over one epoch; nothing starts until its first ``next()``."""
        return self._get_iterator()

    def _get_iterator(self) -> _LoaderIter:
        if self._closed:
            raise RuntimeError("this kuat DataLoader was closed")
        return _LoaderIter(self)

    def _next_epoch(self) -> tuple[int, int, dict]:
        """``(epoch, batches to skip, states to restore)`` of the epoch about to start."""
        pending, self._pending = self._pending, None
        request = getattr(self.sampler, "epoch_request", None) if self._own_sampler else None
        if request is not None:
            self.sampler.epoch_request = None
            if pending is None or (request[0] > pending[0] and request[1] != pending[1]):
                return request[1], 0, {}
        if pending is not None:
            return pending[1], pending[2], pending[3]
        return self._following_epoch(), 0, {}

    def _following_epoch(self) -> int:
        return 0 if self._progress is None else self._progress[0] + 1

    def _begin_epoch(self, it: _LoaderIter) -> None:
        """Start the epoch of ``it`` (its first ``next()``): resolve, snapshot, start workers."""
        if self._closed:
            raise RuntimeError("this kuat DataLoader was closed")
        self._apply_distributed()
        epoch, skip, restore = self._next_epoch()
        if self._skip_first:  # a skip_first_batches copy: its first epoch skips that many
            skip, self._skip_first = self._skip_first, 0
        if "generator" in restore:
            self.generator.set_state(restore["generator"])
        elif self.generator is not None and epoch != self._following_epoch():
            warnings.warn(
                f"kuat DataLoader: starting epoch {epoch} after "
                f"{'no epoch' if self._progress is None else f'epoch {self._progress[0]}'} with "
                "generator=: the order comes from the generator's current state, not from epoch "
                f"{epoch}'s, so it is not the order an uninterrupted run had. Resume with "
                "load_state_dict() (which restores the generator), or pass seed= instead",
                stacklevel=3,
            )
        if isinstance(self.sampler, EpochSampler):
            self.sampler.epoch = epoch  # (not set_epoch: that is a request from outside)
        elif callable(getattr(self._index_sampler, "kuat_set_epoch", None)):
            self._index_sampler.kuat_set_epoch(epoch)  # e.g. kuat.text.TokenBudgetBatchSampler
        elif callable(getattr(self.sampler, "kuat_set_epoch", None)):  # inside a BatchSampler
            self.sampler.kuat_set_epoch(epoch)  # e.g. kuat.ShardShuffleSampler
        at_start: dict[str, Any] = dict(restore)
        if self.generator is not None:
            at_start.setdefault("generator", self.generator.get_state())
        base_seed = self._draw_base_seed()  # then the sampler's draws, as torch
        if self.seed is None:  # seed=None: the run seed is the first epoch's torch base_seed
            self._set_seed(base_seed)
        if self.generator is None:
            base_seed = _base_seed(self.seed, epoch)
            sampler = self.sampler
            if isinstance(sampler, EpochSampler) and sampler.shuffle and sampler.num_replicas == 1:
                # in torch, shuffle=True is a RandomSampler, which draws its own seed from the
                # default generator every epoch and shuffles with it: kuat makes the same draw
                # and, with seed=None, shuffles as torch does (saved at the epoch's start for
                # resume); with seed= the order stays a function of (seed, epoch)
                drawn = int(torch.empty((), dtype=torch.int64).random_().item())
                if self._torch_order:
                    at_start.setdefault("sampler_seed", drawn)
                    sampler.torch_seed = (epoch, int(at_start["sampler_seed"]))
        if "sampler" not in at_start and not self._own_sampler and not self._iterable:
            at_start["sampler"] = order_state(self._index_sampler)  # as it starts: after base_seed
        if self._iterable and skip and _protocol.provides(self._source, _protocol.ResumableIterable):
            saved = self._source_at[2] if self._source_at[:2] == (epoch, skip) else None
            at = ResumeAt(skip, saved)  # the source starts there itself
            keys, discard = itertools.repeat(at), 0
        elif self._iterable:
            keys, discard = itertools.repeat(None), skip
        else:
            keys, discard = self._keys(epoch, skip, restore.get("sampler")), 0
        if self.persistent_workers:
            if self._engine is None:
                self._engine = self._make_engine(base_seed)
            engine, owned = self._engine, False
            previous = self._live_iter() if self._live_iter is not None else None
            if previous is not None and previous is not it:  # as torch resets its one iterator
                previous._abandon()
        else:
            engine, owned = self._make_engine(base_seed), True
        self._progress = [epoch, skip, False, at_start]
        owner = self._progress_owner() if self._progress_owner is not None else None
        if owner is not None:  # the loader this copy skips for follows on from its position
            owner._progress, owner._pending = self._progress, None
            if owner.seed is None:  # and from the seed the copy's first epoch drew
                owner._set_seed(self.seed)
        if self.persistent_workers:
            self._live_iter = weakref.ref(it)
        it._setup(engine, owned, epoch, base_seed, keys, discard, self._progress)

    def _keys(self, epoch: int, skip: int, sampler_state: dict | None):
        if self._own_sampler:
            prefetch = _protocol.prefetcher(self._source)  # the source's, or a torch wrapper's
            if prefetch is not None:
                indices = self.sampler.indices(epoch)  # drawn whole: remote shards in this order
                with epoch_context(self._job.seed, epoch):  # a mix reads this epoch's window
                    prefetch(indices[skip * (self.batch_size or 1):])
            else:  # drawn lazily, as torch's RandomSampler draws from a generator
                indices = self.sampler.iter_epoch(epoch)
            if self.batch_size is not None:
                indices = _batched(indices, self.batch_size, self.drop_last)
            return itertools.islice(indices, skip, None)
        if sampler_state is not None:
            keys = restore_order(self._index_sampler, sampler_state)
        else:
            keys = iter(self._index_sampler)
        return itertools.islice(keys, skip, None)

    def _draw_base_seed(self) -> int:
        """torch's ``base_seed``: one int64 from ``generator`` (torch's default generator
        without one) each time torch creates an iterator, i.e. every epoch, but only for the
        first epoch with ``persistent_workers`` (torch then keeps one iterator and resets
        it). Drawn exactly so, so that swapping torch's DataLoader for kuat's leaves every
        other user of those generators (model initialisation, a ``RandomSampler`` without a
        generator, augmentations in the loop) with the numbers it had."""
        if self.persistent_workers and self._torch_base_seed is not None:
            return self._torch_base_seed
        drawn = torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        self._torch_base_seed = int(drawn.item())
        return self._torch_base_seed

    def _set_seed(self, seed: int) -> None:
        self.seed = int(seed)
        self._job.seed = self.seed
        self._job_bytes = None
        if isinstance(self.sampler, EpochSampler):
            self.sampler.seed = self.seed

    def _make_engine(self, base_seed: int):
        if self.num_workers == 0:
            return InlineEngine(self._job, base_seed)
        if self.worker_type == "thread" and self._auto_worker_type and self._job.rng_use.draws:
            self.worker_type = "process"
            log.info("kuat.DataLoader: the dataset draws from the global random generators; "
                     "moving to %d process workers (in threads its samples would run one at "
                     "a time)", self.num_workers)
        if self.worker_type == "thread":
            return ThreadEngine(self._job, self.num_workers, base_seed)
        ctx = self.multiprocessing_context
        if ctx is None:
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
        if ctx.get_start_method() == "fork":
            payload = self._job
        else:  # pickled once per loader, not once per worker start
            if self._job_bytes is None:
                self._job_bytes = pickle.dumps(self._job, protocol=pickle.HIGHEST_PROTOCOL)
            payload = self._job_bytes
        return ProcessEngine(payload, self.num_workers, base_seed, ctx, pin=self._pin)

    def close(self) -> None:
        """Stop persistent workers and refuse further iteration. Idempotent."""
        self._closed = True
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self._job.buffer_pool.clear(close=True)  # idle batch buffers go back to the OS

    def __getstate__(self) -> dict[str, Any]:
        """Everything but live workers: persistent ones are started again after unpickling."""
        state = dict(self.__dict__)
        state["_engine"] = None
        state["_live_iter"] = None
        state["_job_bytes"] = None
        state["_progress_owner"] = None
        return state

    # --- framework hooks (kuat.integrations) --------------------------------------------------
    def _prepare_for_accelerate(self, device) -> None:
        """Called by Accelerate's ``prepare`` (see :mod:`kuat.integrations.accelerate`)."""
        from accelerate.state import GradientState

        if device is not None and torch.device(device).type == "cuda" and self._device is None:
            self._device = self.device = torch.device(device)
        self._gradient_state = GradientState()
        self.end_of_dataloader = False
        self.remainder = -1

    def _skip_first_batches(self, num_batches: int) -> DataLoader:
        """A copy whose next epoch skips its first ``num_batches`` (Accelerate's skip_first_batches).

        The copy shares the options, the dataset, statistics and position: when it starts an
        epoch, this loader's ``state_dict()`` and next epoch follow from it.
        """
        if isinstance(num_batches, bool) or not isinstance(num_batches, (int, np.integer)) or num_batches < 0:
            raise ValueError(f"num_batches should be a non-negative int, got {num_batches=!r}")
        skipping = copy.copy(self)  # through __getstate__: no live workers
        skipping._skip_first = int(num_batches)
        skipping._progress_owner = weakref.ref(self)
        self._pending = None  # the copy starts the pending epoch, if any
        return skipping

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        engine = self.__dict__.get("_engine")
        if engine is not None:
            engine.close()

    def _advise(self) -> None:
        """Once per loader: say so when global-RNG isolation serialises thread workers."""
        if (self._advised or self.worker_type != "thread" or self.num_workers < 2
                or self._auto_worker_type):
            return
        s = self._stats
        if s.rng_wait_s > 0.25 * max(s.fetch_s, 1e-9) and s.rng_wait_s > 0.1:
            self._advised = True
            log.warning(
                "kuat.DataLoader: thread workers spent %.1f s of %.1f s of fetching waiting for "
                "global-RNG isolation (samples run one at a time so that random/np.random/torch "
                "draws are reproducible). If the dataset draws no global randomness pass "
                "isolate_global_rng=False; otherwise draw from kuat.sample_rng(index) and set "
                "kuat_uses_sample_rng = True on the dataset, or use worker_type='process'.",
                s.rng_wait_s, s.fetch_s,
            )

    def _warn_unsplit_iterable(self) -> None:
        """Once per loader: an IterableDataset that never asked which worker it runs in."""
        if self._warned_unsplit:
            return
        self._warned_unsplit = True
        warnings.warn(
            f"kuat DataLoader: the IterableDataset {type(self.dataset).__name__} never called "
            f"torch.utils.data.get_worker_info() in its workers, so each of the "
            f"{self.num_workers} workers yields the whole dataset and every item arrives "
            f"{self.num_workers} times (as with torch's DataLoader). Split the items in __iter__ "
            "by get_worker_info().id and .num_workers (or in worker_init_fn, the recipe in "
            "torch's IterableDataset documentation), or use num_workers=1",
            UserWarning,
            stacklevel=4,
        )

    def _warn_skipped(self, skipped) -> None:
        for index, type_name, message in skipped:
            key = (type_name, re.sub(r"\d+", "#", message))
            if key not in self._warned:
                self._warned.add(key)
                warnings.warn(
                    f"kuat DataLoader skipped sample {index}: {type_name}: {message} "
                    "(on_error='skip'; later samples failing the same way are only counted in "
                    "stats()['skipped_samples'])",
                    RuntimeWarning,
                    stacklevel=4,
                )


class _InfiniteSampler(Sampler):
    """The sampler attribute of an iterable-dataset loader (as torch's, yields ``None``)."""

    def __iter__(self):
        while True:
            yield None


def _check_device(device) -> torch.device | None:
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device should be None, 'cpu' or a CUDA device, got {device=!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} but CUDA is not available on this machine "
            "(torch.cuda.is_available() is False); pass device=None or 'cpu'"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device should be None, 'cpu' or a CUDA device, got {device=!r}")
    return None if dev.type == "cpu" else dev


def _check_distributed(rank, world_size) -> tuple[int | None, int | None]:
    if (rank is None) != (world_size is None):
        raise ValueError(f"give both rank and world_size or neither, got {rank=} {world_size=}")
    if rank is None:
        return None, None
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} should be an int or None, got {name}={value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank should be in [0, world_size), got {rank=} {world_size=}")
    return int(rank), int(world_size)


_warned_env = False


def _distributed_from_environment(warn: bool) -> tuple[int, int]:
    """``(rank, world_size)``: torch.distributed when initialised, else RANK/WORLD_SIZE, else 0, 1."""
    global _warned_env
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world_size is None:
        return 0, 1
    try:
        rank, world_size = int(rank), int(world_size)
    except ValueError as e:
        raise ValueError(f"RANK={rank!r} and WORLD_SIZE={world_size!r} should be ints") from e
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"environment RANK={rank} should be in [0, WORLD_SIZE={world_size})")
    if warn and world_size > 1 and not _warned_env:
        _warned_env = True
        log.warning("kuat.DataLoader: torch.distributed is not initialised; reading rank %d of "
                    "%d from the RANK/WORLD_SIZE environment variables", rank, world_size)
    return rank, world_size


def _batched(indices, batch_size: int, drop_last: bool):
    """Consecutive lists of ``batch_size`` indices, drawn lazily (as torch's BatchSampler)."""
    it = iter(indices)
    while True:
        batch = list(itertools.islice(it, batch_size))
        if not batch or (drop_last and len(batch) < batch_size):
            return
        yield batch


class _PacedKeys:
    """An epoch's keys (batches of indices, or one index), pulled from the sampler no later
    than torch's multi-worker iterator pulls them: ``prefetch_factor * num_workers`` when the
    epoch starts, then one more per batch it returns (``_try_put_index``). kuat's dispatch pulls
    on demand and may pull fewer (or, for cheap batches, more); the pull that exhausts the
    sampler draws from its generator (``RandomSampler``'s trailing ``randperm``), so a loop that
    leaves an epoch early (``limit_train_batches``, ``break``) would otherwise leave that
    generator one draw behind torch's. :meth:`keep_up` pulls the missing keys into a queue that
    dispatch takes first; :meth:`may_pull` keeps dispatch (which may run further ahead, by
    ``_CHEAP_PREFETCH``) from making the exhausting pull before torch would, when the number of
    keys is known. Not thread-safe (the consumer thread's)."""

    __slots__ = ("_keys", "_queue", "_ahead", "_count", "pulled", "exhausted")

    def __init__(self, keys: Iterator, ahead: int, count: int | None):
        self._keys = keys
        self._queue: collections.deque = collections.deque()
        self._ahead = ahead
        self._count = count  # keys in the epoch (len of the batch sampler), None if unknown
        self.pulled = 0
        self.exhausted = False

    def may_pull(self, returned: int, in_flight: int) -> bool:
        """False when the next pull would be the exhausting one (all ``count`` keys pulled)
        and torch would not make it yet; never False with nothing in flight (a sampler whose
        ``len`` is short of its keys still ends its epoch only when it is exhausted)."""
        if self._queue or self.exhausted or in_flight == 0 or self._count is None:
            return True
        return self.pulled < self._count or self.pulled < self._ahead + returned

    def __iter__(self):
        return self

    def __next__(self):
        if self._queue:
            return self._queue.popleft()
        return self._pull()

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
                self._queue.append(self._pull())
            except StopIteration:
                return


class _LoaderIter:
    """One epoch of a :class:`DataLoader`: dispatches tasks, restores order, yields batches.

    Created by ``iter(loader)`` without side effects; the epoch starts at the first ``next()``.
    """

    def __init__(self, loader: DataLoader):
        self._loader = loader
        self._started = False
        self._closed = False
        self._finished = False

    def _setup(self, engine, owned: bool, epoch: int, base_seed: int, keys, discard: int,
               progress: list) -> None:
        loader = self._loader
        self._started = True
        self._engine = engine
        self._owned = owned
        self._epoch, self._base_seed = epoch, base_seed
        # torch pulls ahead only with workers (its single-process iterator pulls per batch,
        # as kuat's inline engine does)
        nw = loader.num_workers
        count = None
        if nw and not loader._iterable and progress[1] == 0:
            try:
                count = loader._len()
            except (TypeError, NotImplementedError):
                count = None
        self._keys = _PacedKeys(keys, loader.prefetch_factor * nw, count) if nw else keys
        self._returned = 0
        self._keys_done = False
        self._discard = discard
        self._progress = progress
        self._nw = engine.num_workers
        self._inline = isinstance(engine, InlineEngine)
        self._max_inflight = 1 if self._inline else max(1, loader.prefetch_factor * self._nw)
        self._base_inflight = self._max_inflight
        self._adapt = loader._adaptive_prefetch and not self._inline
        # cheap batches of a map-style source, with the consumer waiting for them: fetch them
        # in the consumer thread instead (the hand-off would cost more than the work)
        # (thread workers only: a process worker's dataset is a full copy, the consumer's
        # would share what its attributes point to with the user's object)
        self._may_go_inline = (self._adapt and isinstance(engine, ThreadEngine)
                               and loader._job.consumer_may_fetch)
        self._agnostic = loader._job.thread_agnostic
        # An epoch's first batch, of a source whose batch kernel splits (kuat._parallel): fetched
        # with every worker's core while the other workers wait for it (see _dispatch)
        self._first_width = (self._nw if self._nw > 1 and not self._inline and not loader._iterable
                             and _protocol.splits_batches(loader._source) else 1)
        self._holding: int | None = None  # task id of that first batch while it is fetched
        self._seen = self._cheap = self._blocked = 0
        self._work_s = self._loop_s = 0.0  # of the batches seen: their work; the loop's own time
        self._loop_mark: float | None = None  # thread_time() when next() last returned
        self._active = [True] * self._nw
        self._rr = 0
        self._tasks: dict[int, int] = {}  # task id -> worker id, in flight
        self._order: collections.deque[int] = collections.deque()  # dispatch order (in_order)
        self._ready: dict[int, Any] = {}
        self._in_order = loader.in_order
        self._timeout = loader.timeout
        self._stats = loader._stats
        self._copier = DeviceCopier(loader._device) if loader._device is not None else None
        self._staged = None
        self._deferred: BaseException | None = None
        self._transform = loader._batch_transform
        self._gradient_state = loader._gradient_state
        self._epoch_batches = None
        self._look_ahead = False
        self._ahead: Any = _NOTHING
        if self._gradient_state is not None:  # Accelerate: say when the last batch is returned
            self._epoch_batches = loader._batches_per_epoch()
            self._look_ahead = self._epoch_batches is None
            loader.end_of_dataloader = False
            loader.remainder = -1
            if not loader.drop_last and loader.batch_size is not None:
                try:  # as Accelerate's DataLoaderStateMixin.begin
                    loader.remainder = len(loader.dataset) % (loader.batch_size * loader.world_size)
                except TypeError:
                    pass
            self._gradient_state._add_dataloader(loader)
        self._t_mark: float | None = None
        self._warn = weakref.WeakMethod(loader._warn_skipped)

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._loader)

    # --- the per-batch loop -------------------------------------------------------------------
    def __next__(self):
        t0 = time.perf_counter()  # starting the epoch (workers) is time the loop waits, too
        if not self._started:
            if self._closed:
                raise StopIteration
            self._loader._begin_epoch(self)
        if self._t_mark is None:
            self._t_mark = t0
        if self._may_go_inline and self._loop_mark is not None:
            # the training loop's own CPU time since the last batch (its wall time would count
            # the time the workers held the GIL)
            self._loop_s += time.thread_time() - self._loop_mark
        try:
            batch = self._next_looking_ahead() if self._look_ahead else self._produce()
        finally:  # every second inside next() is a second the training loop waited for input
            self._account_time(t0)
        if self._may_go_inline:
            self._loop_mark = time.thread_time()
        self._progress[1] += 1
        self._returned += 1
        if isinstance(self._keys, _PacedKeys):
            self._keys.keep_up(self._returned)
        if self._epoch_batches is not None and self._progress[1] >= self._epoch_batches:
            self._loader.end_of_dataloader = True
        with self._stats.lock:
            self._stats.batches += 1
        return batch

    def _produce(self):
        """The next batch, transformed; raises StopIteration at the end of the epoch."""
        failed = None
        try:
            batch = self._next_device_batch() if self._copier else self._next_batch()
            if self._transform is not None:
                t1 = time.perf_counter()
                batch = self._transform(batch)
                self._stats.transform_s += time.perf_counter() - t1
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

    def _next_looking_ahead(self):
        """One batch ahead, as Accelerate's DataLoaderShard: ``end_of_dataloader`` is set before
        the last batch of an epoch of unknown length is returned. An error while fetching the
        batch after the current one is raised at the next call."""
        if self._ahead is _NOTHING:
            self._ahead = self._produce()
        elif self._ahead is _DONE:
            self._release_gradient_state()
            raise StopIteration
        elif isinstance(self._ahead, _Raise):
            error, self._ahead = self._ahead.error, _NOTHING
            raise error
        batch = self._ahead
        try:
            self._ahead = self._produce()
        except StopIteration:
            self._ahead = _DONE
            self._loader.end_of_dataloader = True
        except Exception as e:
            self._ahead = _Raise(e)
        return batch

    def _next_batch(self):
        while True:
            self._dispatch()
            r = self._take()
            if r is None:
                raise StopIteration
            self._account(r)
            if r.kind == OK:
                if self._discard:
                    self._discard -= 1
                    continue
                return r.value
            if r.kind == END:
                self._active[r.worker_id] = False
            elif r.kind == FAIL:
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
        if self._holding is not None or self._to_processes() or self._to_inline():
            return
        while len(self._tasks) + len(self._ready) < self._max_inflight and not self._keys_done:
            w = self._next_worker()
            if w is None:
                return
            if isinstance(self._keys, _PacedKeys) and not self._keys.may_pull(
                self._returned, len(self._tasks) + len(self._ready)
            ):
                return  # torch would not pull the sampler's end yet (see _PacedKeys)
            try:
                key = next(self._keys)
            except StopIteration:
                self._keys_done = True
                return
            tid = next(_TASK_IDS)
            self._tasks[tid] = w
            if self._in_order:
                self._order.append(tid)
            width = 1
            if self._first_width > 1 and self._returned == 0 and len(self._tasks) == 1 \
                    and not self._ready:
                width, self._holding = self._first_width, tid
            self._engine.submit(w, Task(tid, self._epoch, key, self._base_seed, width))
            if width > 1:
                return

    def _to_processes(self) -> bool:
        """``worker_type=None``: once the dataset is seen to draw from the global RNGs, let the
        thread workers' batches in flight finish (True while they do), then continue the
        epoch on process workers."""
        lo = self._loader
        if not (lo._auto_worker_type and lo._job.rng_use.draws
                and isinstance(self._engine, ThreadEngine)):
            return False
        if self._tasks:
            return True
        old = self._engine
        if self._owned or lo._engine is old:
            old.close()
        new = lo._make_engine(self._base_seed)
        if not self._owned:
            lo._engine = new
        self._engine, self._nw = new, new.num_workers
        self._active, self._rr, self._may_go_inline = [True] * self._nw, 0, False
        self._max_inflight = self._base_inflight = max(1, lo.prefetch_factor * self._nw)
        return False

    def _to_inline(self) -> bool:
        """After ``_INLINE_PROBE`` batches, most of them cheap and waited for by the consumer,
        whose own time between batches is small next to their work: let the workers' batches
        in flight finish (True while they do), then fetch the rest of the epoch in this thread
        (the thread workers are released, or kept when persistent). Its shallow copy of the
        dataset is its own, as a worker's, unless the source is thread-agnostic."""
        if not (self._may_go_inline and self._seen >= _INLINE_PROBE):
            return False
        if (self._cheap < 0.75 * self._seen or self._blocked < 0.75 * self._seen
                or self._loop_s > _INLINE_MAX_LOOP_SHARE * self._work_s):
            self._may_go_inline = False
            return False
        if self._tasks:
            return True
        if self._owned:
            self._engine.close()
        log.debug("kuat.DataLoader: batches take under %.1f ms of work and the training loop "
                  "waits for them: fetching them in its thread", _CHEAP_BATCH_S * 1e3)
        self._engine = InlineEngine(self._loader._job, self._base_seed,
                                    own_copy=not self._agnostic)
        self._owned = True  # the inline engine; persistent thread workers stay with the loader
        self._inline, self._nw, self._active, self._rr = True, 1, [True], 0
        self._max_inflight, self._adapt, self._may_go_inline = 1, False, False
        return False

    def _next_worker(self) -> int | None:
        for _ in range(self._nw):
            w, self._rr = self._rr, (self._rr + 1) % self._nw
            if self._active[w]:
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
                    return self._ready.pop(next(iter(self._ready)))
                if not self._tasks:
                    return None
            self._blocked += 1
            r = self._get()
            if self._tasks.pop(r.task_id, None) is None:
                continue  # stale: from an abandoned epoch of persistent workers
            self._ready[r.task_id] = r
            if r.task_id == self._holding:  # the split first batch: start the other workers
                self._holding = None
                self._dispatch()

    def _get(self):
        t0 = time.perf_counter()
        try:
            return self._engine.get(self._timeout if self._timeout > 0 else None)
        except queue.Empty:
            raise LoaderTimeoutError(
                f"DataLoader timed out after {self._timeout} seconds waiting for a batch from its "
                f"{self._nw} {self._loader.worker_type} workers ({len(self._tasks)} batches in flight)"
            ) from None
        finally:
            w = time.perf_counter() - t0
            with self._stats.lock:
                self._stats.worker_wait_s += w

    def _next_device_batch(self):
        """Stage the next host batch's copy before returning the current one (one ahead)."""
        if self._deferred is not None:
            exc, self._deferred = self._deferred, None
            raise exc
        if self._staged is None:
            self._staged = self._stage(self._next_batch())
        current, self._staged = self._staged, None
        try:
            self._staged = self._stage(self._next_batch())
        except StopIteration:
            pass
        except BaseException as e:
            self._deferred = e
        t0 = time.perf_counter()
        batch = self._copier.wait(current)
        with self._stats.lock:
            self._stats.device_s += time.perf_counter() - t0
        return batch

    def _stage(self, batch):
        t0 = time.perf_counter()
        staged = self._copier.stage(batch)
        with self._stats.lock:
            self._stats.device_s += time.perf_counter() - t0
        return staged

    # --- bookkeeping --------------------------------------------------------------------------
    def _account(self, r) -> None:
        st = r.stats
        if st is None:
            return
        if self._adapt:
            # Cheap batches (the work takes less than a worker hand-off and wake-up costs many
            # times over): keep more in flight so each worker wakes once per several batches.
            work = st.fetch_s + st.collate_s
            cheap = (st.fetch_cpu_s + st.collate_s < _CHEAP_BATCH_S
                     and work < _CHEAP_WALL_FACTOR * _CHEAP_BATCH_S)
            self._max_inflight = self._nw * _CHEAP_PREFETCH if cheap else self._base_inflight
            self._seen += 1
            self._cheap += cheap
            self._work_s += work
            if st.worker_info_consulted and not self._agnostic:
                self._may_go_inline = False  # its batches may depend on the worker
        s = self._stats
        with s.lock:
            s.fetch_s += st.fetch_s
            s.fetch_cpu_s += st.fetch_cpu_s
            s.native_s += st.native_s
            s.collate_s += st.collate_s
            s.pin_s += st.pin_s
            s.rng_wait_s += st.rng_wait_s
            if r.kind == OK and not self._discard:
                s.samples += st.samples
            s.skipped += len(st.skipped)
        if st.skipped:
            warn = self._warn()
            if warn is not None:
                warn(st.skipped)
        if st.worker_info_consulted is False and self._loader._iterable:
            self._loader._warn_unsplit_iterable()

    def _account_time(self, t0: float) -> None:
        # wall time from the first next() of the epoch to the end of the latest one, and the
        # part of it spent inside next() (from t0)
        now = time.perf_counter()
        with self._stats.lock:
            self._stats.elapsed_s += now - self._t_mark
            self._stats.wait_s += now - t0
        self._t_mark = now

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._progress[2] = True
            if self._gradient_state is not None:
                self._loader.end_of_dataloader = True
            # looking ahead, the user has yet to receive the last batch: stay registered
            self.close(release_gradient_state=not self._look_ahead)
            self._loader._advise()

    def _abandon(self) -> None:
        """A newer iterator took over the persistent workers: this one yields nothing more."""
        self._keys_done = self._finished = True
        self._holding = None
        self._tasks.clear()
        self._ready.clear()
        self._order.clear()
        self._staged = self._deferred = None
        self._closed = True
        self._release_gradient_state()

    def _release_gradient_state(self) -> None:
        """Leave Accelerate's GradientState (as DataLoaderShard.end()). Idempotent."""
        gradient_state = self.__dict__.get("_gradient_state")  # absent before the epoch starts
        if gradient_state is not None:
            self._gradient_state = None
            gradient_state._remove_dataloader(self._loader)

    def close(self, broken: bool = False, release_gradient_state: bool = True) -> None:
        """Release the workers (this epoch's, or persistent ones when they broke). Idempotent."""
        if release_gradient_state:
            self._release_gradient_state()
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        self._keys_done = True
        if self._owned:
            self._engine.close()
        elif broken and self._loader._engine is self._engine:
            self._engine.close()
            self._loader._engine = None

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
