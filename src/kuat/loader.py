"""``kuat.DataLoader``: a drop-in for ``torch.utils.data.DataLoader``: sampler -> engine -> device.

Pipeline (DESIGN.md, "Data flow"): the sampler gives each epoch's batches of indices from
``(seed, epoch, rank, world_size)``; an engine (``kuat.engine``: inline, threads or processes)
fetches and collates each batch in a worker; the consumer restores order, pins or copies to a
device one batch ahead, applies the dataset's ``kuat_batch_transform`` and yields. Every choice
(engine, sampler, RNG isolation, pinning) is made once, at construction or at ``iter()``; the
per-batch loop (``_LoaderIter._next_batch``) only dispatches tasks and takes results.

Seams with sources (``kuat.sources``)
--------------------------------------
The loader calls ``kuat.sources.as_source(dataset)`` once, at construction, and reads what it
returns (``loader.dataset`` stays the object the user passed). A source is either

* map-style: ``__len__`` and ``__getitem__(index)``, optionally ``__getitems__(indices) ->
  list of samples`` (then one call per batch, as torch does); or
* iterable: an instance of ``torch.utils.data.IterableDataset``; each worker iterates it and
  shards itself with ``torch.utils.data.get_worker_info()`` (per thread in thread mode).

Optional attributes the loader honours on the source:

* ``kuat_uses_sample_rng = True``: the source draws randomness only from ``kuat.sample_rng``,
  so global RNGs need no per-sample isolation (see ``isolate_global_rng``).
* ``kuat_batch_transform``: a callable applied to each collated batch after pinning / the
  device copy (on the device when there is one), or ``None``.
* ``set_epoch(epoch)`` (iterable sources): called in each worker, on that worker's copy, before
  iterating each epoch (also with persistent workers).
* ``kuat_set_distributed(rank, world_size)`` and ``kuat_set_batching(batch_size, drop_last)``
  (iterable sources): called once at construction, so the source takes its rank's share and
  splits workers by whole batches (then batch ``k`` is the same whatever the worker count,
  which makes replay-based resume exact; with ``drop_last`` rank shares are truncated instead
  of padded). Map-style sources are sharded by the loader's sampler and need nothing.
* ``kuat_prefetch(indices)`` (map-style sources): called at the start of each epoch, when the
  loader owns the sampler, with this rank's sample indices in the order the epoch reads them
  (after a resume, from the resume point), so remote storage can prefetch in that order.
* ``kuat_set_epoch(epoch)`` on a user's sampler or batch sampler: called with the loader's epoch
  before each epoch (so a resumed loader resumes the sampler's epoch too); torch's samplers,
  which lack it, are left to the user's ``set_epoch`` as in torch.
* ``state_dict()`` / ``load_state_dict(state)``: the source's own resumable state, stored
  under ``"source"`` in the loader's state. For iterable sources without it, resuming replays
  (fetches and drops) the batches already served in the epoch.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import multiprocessing
import os
import pickle
import queue
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, IterableDataset, Sampler, SequentialSampler
from torch.utils.data._utils.collate import default_collate as torch_default_collate
from torch.utils.data._utils.collate import default_convert

from kuat import sources as _sources
from kuat.collate import default_collate
from kuat.device import DeviceCopier, accelerator_available
from kuat.engine.base import END, FAIL, OK, Task
from kuat.engine.inline import InlineEngine
from kuat.engine.job import FetchJob, per_sample_getitems
from kuat.engine.process import ProcessEngine
from kuat.engine.thread import ThreadEngine
from kuat.errors import LoaderTimeoutError
from kuat.sampling import EpochSampler, batches_of

__all__ = ["DataLoader"]

log = logging.getLogger("kuat.loader")

_STATE_VERSION = 1
_TASK_IDS = itertools.count()  # unique across iterators, so stale results are recognised
_MASK63 = (1 << 63) - 1
# Thread workers with the default prefetch_factor: batches whose fetch + collate take less than
# this are "cheap", and up to _CHEAP_PREFETCH per worker are kept in flight (benchmarks/
# bench_overhead.py: a no-op batch costs ~48 us inline, ~80 us with 2 threads at depth 2, ~55 us
# at depth 8, on a loaded 2-core machine).
_CHEAP_BATCH_S = 0.5e-3
_CHEAP_PREFETCH = 8
_INLINE_PROBE = 16  # batches observed before deciding to fetch cheap batches in the consumer


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

    def reset(self):
        self.fetch_s = self.fetch_cpu_s = self.collate_s = self.pin_s = self.rng_wait_s = 0.0
        self.device_s = self.transform_s = self.wait_s = self.worker_wait_s = self.elapsed_s = 0.0
        self.batches = self.samples = self.skipped = 0


class DataLoader:
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
        generator: as torch: drives the shuffle (``RandomSampler`` draws, so orders equal
            torch's for the same generator) and each epoch's ``base_seed``. Orders then depend
            on the generator's state, so exact resume needs ``generator=None``.
        prefetch_factor: batches in flight per worker (default 2 with workers, as torch). When
            it is not given, thread workers keep up to 8 per worker in flight while batches take
            under 0.5 ms of work, so that each worker wakes once per several cheap batches
            instead of once per batch (the attribute still reads 2); and when most of the
            first 16 batches are that cheap and the training loop waited for them, a source
            whose batches do not depend on the thread fetching them (kuat datasets, pure
            sequences; no ``worker_init_fn``) is fetched in the training loop's thread for the
            rest of the epoch, as with ``num_workers=0`` (a hand-off costs more than the work).
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
            batch's tensors through a reused ring of nameless shared-memory slots (about
            ``prefetch_factor`` per worker; nothing is left in ``/dev/shm`` even when a process
            is killed); tensors of 256 KiB and more reach the training loop as views of their
            slot (no copy; the slot is reused once they are gone), smaller ones are copied,
            and with pinning the batch is copied once into pinned memory. On a time-out, an
            error or Ctrl-C, control comes back at once: busy process workers are terminated,
            busy thread workers are left to finish their current sample and end.
        seed: the run seed; shuffle order depends only on ``(seed, epoch, rank, world_size)``
            and each sample's randomness on ``(seed, epoch, index)``. ``None`` draws one at
            construction from torch's default generator (so ``torch.manual_seed`` makes runs
            reproducible). Pass the same seed on every rank.
        device: ``None``, ``"cpu"`` or a CUDA device: batches are copied there on a side
            stream, one batch ahead. ``ValueError`` at construction when CUDA is absent.
        on_error: ``"raise"`` (default) or ``"skip"``: drop samples whose fetch raises (the
            batch is retried one sample at a time), warn once per distinct error, count them in
            :meth:`stats`, never yield an empty batch.
        rank, world_size: this process's share; default from ``torch.distributed`` when it is
            initialised, else ``0`` and ``1``. Only the loader's own sampler is sharded (a user
            ``sampler``/``batch_sampler`` is used as given): every rank gets the same number of
            batches, padded by wrap-around (``DistributedSampler``) or, with ``drop_last``,
            truncated.
        isolate_global_rng: make a map-style dataset's draws from Python's ``random``, NumPy's
            global generator and torch's default CPU generator reproducible whatever the worker
            count and type: a dataset seen to draw (each worker's first batch is probed, later
            batches are watched; see :mod:`kuat.engine.isolate`) runs each ``dataset[i]`` with
            those generators reseeded from ``(seed, epoch, i)``, or each ``__getitems__`` call
            from ``(seed, epoch, batch indices)``, under a process-wide lock, restoring the
            caller's generator states after. Datasets that do not draw pay about 5 us per
            batch (``range``, lists, tuples, arrays, tensors and ``TensorDataset``: nothing). In thread mode the samples of a drawing dataset run one at a time
            (``stats()["busy_s"]["rng_lock_wait"]`` shows the cost). torch's ``Subset`` (and
            so ``random_split``) over a per-sample dataset is read per sample, so each sample
            is isolated. ``None`` (default): on unless the dataset sets
            ``kuat_uses_sample_rng = True``; never for iterable datasets (process workers still
            seed the global RNGs per worker, as torch does; thread workers share the process's).

    Raises:
        ValueError / TypeError: invalid arguments (torch's messages for torch's arguments).

    Thread-safety: iterate a loader from one thread at a time; :meth:`stats` and
    :meth:`state_dict` may be called from any thread.
    """

    _locked_attrs = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
                     "persistent_workers")
    __initialized = False

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
        adaptive_prefetch = prefetch_factor is None and worker_type != "process"
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
        seed_was_none = seed is None
        if seed is None:  # drawn once, like torch's base_seed, so torch.manual_seed reproduces it
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        self._device = _check_device(device)
        rank, world_size = _distributed(rank, world_size)

        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self._adaptive_prefetch = adaptive_prefetch  # thread workers, prefetch_factor not given
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.in_order = in_order
        self.worker_type = worker_type
        self._auto_worker_type = auto_worker_type and num_workers > 0
        self.seed = int(seed)
        self.device = self._device
        self.on_error = on_error
        self.rank, self.world_size = rank, world_size

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
                if hasattr(source, "kuat_set_distributed"):
                    source.kuat_set_distributed(rank, world_size)
                if hasattr(source, "kuat_set_batching"):  # kuat streams: workers take whole batches
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
        use_getitems = (auto_collation and not iterable and hasattr(source, "__getitems__")
                        and bool(source.__getitems__) and not per_sample_getitems(source))
        if isolate_global_rng is None:
            isolate_global_rng = not getattr(source, "kuat_uses_sample_rng", False)
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
        if world_size > 1 and seed_was_none:
            log.warning("kuat.DataLoader on rank %d of %d drew its seed from torch's default "
                        "generator; pass the same seed= on every rank so that all ranks shuffle "
                        "alike", rank, world_size)
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
                            and callable(getattr(source, "kuat_fetch_collated", None))),
            pin=self._pin and worker_type == "thread" or (self._pin and num_workers == 0),
        )
        self._job_bytes: bytes | None = None
        self._batch_transform = getattr(source, "kuat_batch_transform", None)
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
        self.__initialized = True
        if num_workers and worker_type == "process":
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            if cpus is not None and num_workers > cpus:
                warnings.warn(
                    f"This DataLoader will create {num_workers} worker processes in total. Our "
                    f"suggested max number of worker in current system is {cpus}, which is smaller "
                    "than what this DataLoader is going to create.",
                    stacklevel=2,
                )

    # --- torch's attribute protocol -----------------------------------------------------------
    def __setattr__(self, attr, val):
        if self.__initialized and attr in self._locked_attrs:
            raise ValueError(
                f"{attr} attribute should not be set after {self.__class__.__name__} is initialized"
            )
        super().__setattr__(attr, val)

    @property
    def multiprocessing_context(self):
        return self.__multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, multiprocessing_context):
        if multiprocessing_context is not None:
            if self.num_workers > 0:
                if isinstance(multiprocessing_context, str):
                    valid_start_methods = multiprocessing.get_all_start_methods()
                    if multiprocessing_context not in valid_start_methods:
                        raise ValueError(
                            "multiprocessing_context option "
                            f"should specify a valid start method in {valid_start_methods!r}, but got "
                            f"multiprocessing_context={multiprocessing_context!r}"
                        )
                    multiprocessing_context = multiprocessing.get_context(multiprocessing_context)
                if not isinstance(multiprocessing_context, multiprocessing.context.BaseContext):
                    raise TypeError(
                        "multiprocessing_context option should be a valid context "
                        "object or a string specifying the start method, but got "
                        f"multiprocessing_context={multiprocessing_context}"
                    )
            else:
                raise ValueError(
                    "multiprocessing_context can only be used with "
                    "multi-process loading (num_workers > 0), but got "
                    f"num_workers={self.num_workers}"
                )
        self.__multiprocessing_context = multiprocessing_context

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self):
        return self.batch_sampler if self._auto_collation else self.sampler

    def __len__(self) -> int:
        if self._iterable:
            length = self._IterableDataset_len_called = len(self._source)
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else math.ceil(length / self.batch_size)
            return length
        return len(self._index_sampler)

    # --- epochs and state -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter(loader)`` epoch ``epoch`` (later ones follow from it)."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch should be a non-negative int, got {epoch=!r}")
        self._pending = (int(epoch), 0)

    def _batches_per_epoch(self) -> int | None:
        if self._iterable:
            return None
        try:
            return len(self)
        except TypeError:
            return None

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: a small dict of ints (plus the source's own state).

        Keys: ``version``, ``seed``, ``epoch`` (the epoch the next batch belongs to),
        ``batches_served_in_epoch``, ``rank``, ``world_size``, and ``source`` when the source has ``state_dict()``. Taken mid-epoch it resumes after the
        last batch yielded; at the end of an epoch it points at the start of the next one.
        Costs a few microseconds.
        """
        if self._pending is not None:
            epoch, served = self._pending
        elif self._progress is None:
            epoch, served = 0, 0
        else:
            epoch, served, exhausted = self._progress
            n = self._batches_per_epoch() if not exhausted else None
            if exhausted or (n is not None and served >= n):
                epoch, served = epoch + 1, 0
        state = {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "epoch": epoch,
            "batches_served_in_epoch": served,
            "rank": self.rank,
            "world_size": self.world_size,
        }
        source_state = getattr(self._source, "state_dict", None)
        if callable(source_state):
            state["source"] = source_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next ``iter()`` continues that epoch.

        The seed is taken from the state. The number of workers and their type may differ.

        Raises:
            ValueError: the state is not a kuat loader state of a known version.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"not a kuat DataLoader state of version {_STATE_VERSION}: {state!r:.200}")
        if (state.get("world_size"), state.get("rank")) != (self.world_size, self.rank):
            log.warning("resuming a state of rank %s/%s on rank %s/%s: shares differ, resume is "
                        "not exact", state.get("rank"), state.get("world_size"), self.rank,
                        self.world_size)
        self.seed = int(state["seed"])
        self._job.seed = self.seed
        self._job_bytes = None
        if isinstance(self.sampler, EpochSampler):
            self.sampler.seed = self.seed
        if self._engine is not None:  # persistent workers hold the old seed
            self._engine.close()
            self._engine = None
        self._pending = (int(state["epoch"]), int(state["batches_served_in_epoch"]))
        if "source" in state and hasattr(self._source, "load_state_dict"):
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
        (with workers), minus device copies and batch transforms, per batch.
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
            }

    def _overhead_s(self, s: _Stats) -> float:
        work = s.fetch_s + s.collate_s + s.pin_s if self.num_workers == 0 else s.worker_wait_s
        return max(0.0, s.wait_s - work - s.device_s - s.transform_s)

    # --- iteration --------------------------------------------------------------------------
    def __iter__(self) -> _LoaderIter:
        if self._closed:
            raise RuntimeError("this kuat DataLoader was closed")
        if self._pending is not None:
            epoch, skip = self._pending
            self._pending = None
        else:
            epoch, skip = (0 if self._progress is None else self._progress[0] + 1), 0
        if isinstance(self.sampler, EpochSampler):
            self.sampler.set_epoch(epoch)
        elif callable(getattr(self._index_sampler, "kuat_set_epoch", None)):
            self._index_sampler.kuat_set_epoch(epoch)  # e.g. kuat.text.TokenBudgetBatchSampler
        elif callable(getattr(self.sampler, "kuat_set_epoch", None)):  # inside a BatchSampler
            self.sampler.kuat_set_epoch(epoch)  # e.g. kuat.ShardShuffleSampler
        if self.generator is not None:  # as torch: one base_seed draw per iterator
            base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        else:
            base_seed = _base_seed(self.seed, epoch)
        if self._iterable:
            keys, discard = itertools.repeat(None), skip
        else:
            keys, discard = self._keys(epoch, skip), 0
        if self.persistent_workers:
            if self._engine is None:
                self._engine = self._make_engine(base_seed)
            engine, owned = self._engine, False
            previous = self._live_iter() if self._live_iter is not None else None
            if previous is not None:  # as torch resets its one iterator: the old one ends
                previous._abandon()
        else:
            engine, owned = self._make_engine(base_seed), True
        self._progress = [epoch, skip, False]
        it = _LoaderIter(self, engine, owned, epoch, base_seed, keys, discard, self._progress)
        if self.persistent_workers:
            self._live_iter = weakref.ref(it)
        return it

    def _keys(self, epoch: int, skip: int):
        if self._own_sampler:
            indices = self.sampler.indices(epoch)
            prefetch = getattr(self._source, "kuat_prefetch", None)
            if prefetch is not None:  # remote storage fetches shards in this order
                start = skip * (self.batch_size or 1)
                prefetch(indices[start:])
            if self.batch_size is None:
                return iter(indices[skip:])
            return iter(batches_of(indices, self.batch_size, self.drop_last)[skip:])
        return itertools.islice(iter(self._index_sampler), skip, None)

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


def _distributed(rank, world_size) -> tuple[int, int]:
    if rank is None and world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError(f"give both rank and world_size or neither, got {rank=} {world_size=}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank should be in [0, world_size), got {rank=} {world_size=}")
    return int(rank), int(world_size)


class _LoaderIter:
    """One epoch of a :class:`DataLoader`: dispatches tasks, restores order, yields batches."""

    def __init__(self, loader: DataLoader, engine, owned: bool, epoch: int, base_seed: int,
                 keys, discard: int, progress: list):
        self._loader = loader
        self._engine = engine
        self._owned = owned
        self._epoch, self._base_seed = epoch, base_seed
        self._keys = keys
        self._keys_done = False
        self._discard = discard
        self._progress = progress
        self._nw = engine.num_workers
        self._inline = isinstance(engine, InlineEngine)
        self._max_inflight = 1 if self._inline else max(1, loader.prefetch_factor * self._nw)
        self._base_inflight = self._max_inflight
        self._adapt = loader._adaptive_prefetch and isinstance(engine, ThreadEngine)
        # cheap batches of a thread-agnostic source, with the consumer waiting for them: fetch
        # them in the consumer thread instead (the hand-off would cost more than the work)
        self._may_go_inline = self._adapt and loader._job.thread_agnostic
        self._seen = self._cheap = self._blocked = 0
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
        self._finished = False
        self._closed = False
        self._t_mark: float | None = None
        self._warn = weakref.WeakMethod(loader._warn_skipped)

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._loader)

    # --- the per-batch loop -------------------------------------------------------------------
    def __next__(self):
        t0 = time.perf_counter()
        if self._t_mark is None:
            self._t_mark = t0
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
            failed = e.exc, e.cause
        except BaseException:  # time-out, dead worker, KeyboardInterrupt: release the workers
            self.close(broken=True)
            raise
        finally:  # every second inside next() is a second the training loop waited for input
            self._account_time(t0)
        if failed is not None:
            # Raised outside the except clause and without a local naming it: the exception then
            # holds no reference cycle (context -> _BatchError -> exception), so the iterator and
            # its workers go as soon as the caller drops the exception, not at the next gc run.
            exc, cause = failed
            failed = None
            try:
                raise exc from cause
            finally:
                del exc, cause
        self._progress[1] += 1
        with self._stats.lock:
            self._stats.batches += 1
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
                failure = r.value
                if self._inline and failure.original is not None:
                    exc = failure.original
                    if hasattr(exc, "add_note"):
                        exc.add_note(f"kuat DataLoader: while fetching {_describe(failure.key)}")
                    raise _BatchError(exc, None)
                raise _BatchError(*failure.exception())
            # EMPTY: every sample of the batch was skipped; never yield an empty batch

    def _dispatch(self) -> None:
        """Submit tasks round-robin over active workers, up to the prefetch bound.

        A batch counts against the bound from submission until it is yielded (as in torch), so
        results waiting for their turn (``in_order``) hold no more memory than the bound.
        """
        if self._to_processes() or self._to_inline():
            return
        while len(self._tasks) + len(self._ready) < self._max_inflight and not self._keys_done:
            w = self._next_worker()
            if w is None:
                return
            try:
                key = next(self._keys)
            except StopIteration:
                self._keys_done = True
                return
            tid = next(_TASK_IDS)
            self._tasks[tid] = w
            if self._in_order:
                self._order.append(tid)
            self._engine.submit(w, Task(tid, self._epoch, key, self._base_seed))

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
        self._active, self._rr, self._adapt = [True] * self._nw, 0, False
        self._max_inflight = self._base_inflight = max(1, lo.prefetch_factor * self._nw)
        return False

    def _to_inline(self) -> bool:
        """After ``_INLINE_PROBE`` batches, most of them cheap and waited for by the consumer:
        let the workers' batches in flight finish (True while they do), then fetch the rest
        of the epoch in this thread (the thread workers are released, or kept when
        persistent)."""
        if not (self._may_go_inline and self._seen >= _INLINE_PROBE):
            return False
        if self._cheap < 0.75 * self._seen or self._blocked < 0.75 * self._seen:
            self._may_go_inline = False
            return False
        if self._tasks:
            return True
        if self._owned:
            self._engine.close()
        log.debug("kuat.DataLoader: batches take under %.1f ms of work and the training loop "
                  "waits for them: fetching them in its thread", _CHEAP_BATCH_S * 1e3)
        self._engine = InlineEngine(self._loader._job, self._base_seed)
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
            cheap = st.fetch_s + st.collate_s < _CHEAP_BATCH_S
            self._max_inflight = self._nw * _CHEAP_PREFETCH if cheap else self._base_inflight
            self._seen += 1
            self._cheap += cheap
        s = self._stats
        with s.lock:
            s.fetch_s += st.fetch_s
            s.fetch_cpu_s += st.fetch_cpu_s
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
        if st.worker_info_consulted is False:
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
            self.close()
            self._loader._advise()

    def _abandon(self) -> None:
        """A newer iterator took over the persistent workers: this one yields nothing more."""
        self._keys_done = self._finished = True
        self._tasks.clear()
        self._ready.clear()
        self._order.clear()
        self._staged = self._deferred = None
        self._closed = True

    def close(self, broken: bool = False) -> None:
        """Release the workers (this epoch's, or persistent ones when they broke). Idempotent."""
        if self._closed:
            return
        self._closed = True
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


class _BatchError(Exception):
    """Internal: carries a worker's exception (and its cause) out of the per-batch loop."""

    def __init__(self, exc: BaseException, cause: BaseException | None):
        super().__init__()
        self.exc, self.cause = exc, cause


def _describe(key) -> str:
    from kuat.engine.base import describe_key

    return describe_key(key)
