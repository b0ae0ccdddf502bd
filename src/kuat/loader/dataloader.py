"""``kuat.DataLoader``: the torch-compatible face of the loader.

The class keeps torch's signature, public attributes, validation errors and ``len()``; its
methods delegate: arguments to :mod:`._options`, the epoch to :mod:`._epoch` (which hands the
iterator of :mod:`._iterator` an :class:`~._plan.EpochPlan`), the position and state dict to
:mod:`._state`, engines to :mod:`._workers`, statistics to :mod:`._stats`. What each argument
does in depth (prefetch depth, worker types, RNG isolation, resume) is in ``docs/loader.md``.

Seams with frameworks: the loader *is* a ``torch.utils.data.DataLoader`` (torch's
``__setattr__``, ``multiprocessing_context``, ``_auto_collation`` and ``_index_sampler`` are
inherited unchanged). Frameworks that rebuild a loader from its attributes (Lightning's
``_update_dataloader``: ``type(loader)(**attributes named like __init__ arguments)``) get a kuat
loader with the same options back, because every ``__init__`` argument is kept as a public
attribute of that name. Integrations for frameworks that do not rebuild ``type(loader)`` live
in :mod:`kuat.integrations`; they reach the loader through :meth:`DataLoader._attach_framework`
and :meth:`DataLoader._skip_first_batches` only.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import BatchSampler, IterableDataset, Sampler, SequentialSampler
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data._utils.collate import default_collate as torch_default_collate
from torch.utils.data._utils.collate import default_convert
from torch.utils.data.dataloader import _DatasetKind

from kuat import replicas as _replicas
from kuat import sources as _sources
from kuat._buffers import BufferPool
from kuat.collate import default_collate
from kuat.engine.job import FetchJob
from kuat.loader import _auto, _epoch, _notices, _options, _state
from kuat.loader._iterator import LoaderIter
from kuat.loader._stats import LoaderStats
from kuat.loader._workers import WorkerPool
from kuat.sampling import EpochSampler, InfiniteSampler, default_sampler, next_request

__all__ = ["DataLoader"]

log = logging.getLogger("kuat.loader")

_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(_TorchDataLoader[_T_co]):  # generic as torch's: kuat.DataLoader[dict] works
    """Iterate batches of ``dataset``; a drop-in for ``torch.utils.data.DataLoader``.

    Every argument torch's DataLoader takes keeps torch's meaning, default and validation
    errors (mirrored from ``torch/utils/data/dataloader.py``); ``len()`` follows torch. The
    kuat additions are keyword-only. ``docs/loader.md`` explains the behaviour behind each.

    Args:
        dataset: a map-style dataset (``__getitem__``/``__len__``, optionally ``__getitems__``)
            or a ``torch.utils.data.IterableDataset``; read through
            ``kuat.sources.as_source(dataset)`` (hooks: :mod:`kuat.sources.protocol`).
        batch_size, shuffle, sampler, batch_sampler, drop_last, collate_fn: as in torch. The
            default ``collate_fn`` is :func:`kuat.default_collate` (torch's structures, zero-copy
            when samples are consecutive views of one batch buffer).
        num_workers: ``0`` fetches in the calling thread; ``N`` uses N worker threads
            (``worker_type="thread"``) or processes; ``"auto"``: measured (``docs/loader.md``).
        pin_memory: return tensors in pinned memory (containers as torch). Without an
            accelerator pinning is skipped with one warning, as torch does.
        timeout: seconds (>= 0) to wait for a batch from the workers before
            :class:`kuat.errors.LoaderTimeoutError`; ``0`` waits forever. ``ValueError`` at
            construction when positive with ``num_workers=0`` (torch fails at iteration).
        worker_init_fn: called once in each worker (thread or process) with its id, after
            seeding, with ``get_worker_info()`` set.
        multiprocessing_context: start method for process workers; default: the default
            context, as torch (``multiprocessing.set_start_method``). Ignored by threads.
        generator: as torch: drives the shuffle and each epoch's ``base_seed``; its state when
            an epoch starts is saved by :meth:`state_dict` (as torchdata's
            ``StatefulDataLoader``), so resume stays exact.
        prefetch_factor: batches in flight per worker (default 2 with workers, as torch; when
            not given, cheap batches are prefetched deeper and may be fetched in the loop's own
            thread: ``docs/loader.md``, "Prefetch depth").
        persistent_workers: keep workers between epochs.
        pin_memory_device: deprecated in torch; ignored with torch's warning.
        in_order: yield batches in sampler order (``True``) or as they complete.
        worker_type: ``None`` (default: threads, moving to processes once the dataset draws
            from the global RNGs or holds the GIL), ``"thread"`` or ``"process"``.
            ``loader.worker_type`` tells which is in use (``docs/loader.md``, "Workers").
        seed: the run seed (int): shuffle order depends only on ``(seed, epoch, rank,
            world_size)`` and each sample's randomness on ``(seed, epoch, index)``. ``None``
            (default): the first epoch's ``base_seed`` becomes the seed (``torch.manual_seed``
            makes runs reproducible) and ``shuffle=True`` on one process shuffles as torch's
            ``RandomSampler``. Pass the same seed on every rank.
        device: ``None``, ``"cpu"`` or a CUDA device: batches are copied there on a side
            stream, one batch ahead. ``ValueError`` at construction when CUDA is absent.
        on_error: ``"raise"`` (default) or ``"skip"``: drop samples whose fetch raises (the
            batch is retried one sample at a time), warn once per distinct error, count them
            in :meth:`stats`, never yield an empty batch.
        rank, world_size, mesh, dp_dims, shard: who reads what (``docs/loader.md``, "Who reads
            what"). By default none of them: kuat shards nothing, as torch's DataLoader (every
            rank reads every sample; a sampler a framework injects or the user passes decides
            the share). kuat's own sharding, asked for with one of: ``rank=``/``world_size=``
            (both ints); ``mesh=`` a ``DeviceMesh`` (the share is this rank's coordinate over
            its data-parallel dimensions, ``dp_dims=`` or those named like ``dp``; the other
            dimensions read identical batches); ``shard=True`` (the global rank, from
            ``torch.distributed`` else ``RANK``/``WORLD_SIZE``, resolved each epoch). Sharded,
            every rank gets the same number of batches (wrap-around padding, or truncation
            with ``drop_last``) and ``loader.sampler`` is a ``DistributedSampler``, so
            frameworks add none. ``ValueError`` for two ways at once, a mesh with no
            data-parallel dimension, or ``mesh=`` without ``seed=``.
        replicas: ``"read"`` (default: every rank reads its share) or ``"broadcast"``: in each
            replica group (ranks reading the same share: ``mesh=``'s non-data-parallel
            dimensions, else equal ``loader.rank``) one leader reads and sends each batch to
            its peers (``docs/distributed.md``, "Meshes and replicas"; :mod:`kuat.replicas`).
        replica_check_every: ``None`` (default) or N: every N batches the replicas compare a
            64-bit hash of their batches and every rank raises
            ``kuat.replicas.ReplicaMismatchError`` naming the ranks that differ.
        exact_eval: serve every sample exactly once over the ranks, still in equal steps: the
            few samples that even out the last step are flagged by a ``(B,) torch.bool``
            ``"is_padding"`` key added to every (dict) batch, laid out where Accelerate's
            ``gather_for_metrics`` truncates (``docs/distributed.md``, "Equal steps and exact
            evaluation"). Map-style, the loader's own sampler, ``drop_last=False``, no
            ``on_error="skip"``, ``in_order=True`` (else ``ValueError``); a non-dict batch
            raises ``TypeError``.
        isolate_global_rng: make a map-style dataset's draws from ``random``, NumPy's global
            generator and torch's default CPU generator reproducible whatever the workers
            (``docs/loader.md``, "Global random generators"). ``None``: on unless the source
            draws only from ``kuat.sample_rng`` (``kuat_uses_sample_rng``).
        snapshot_every_n_steps: accepted for ``StatefulDataLoader`` compatibility (an int >= 0
            or ``None``, as torchdata); every :meth:`state_dict` call is exact whatever its value.

    Iteration is lazy: ``iter(loader)`` neither starts workers nor advances the epoch, which
    starts at the first ``next()`` (at ``iter()`` with ``num_workers=0`` over a torch
    ``IterableDataset``: torch calls ``iter(dataset)`` there). Pickles without live workers.

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
        mesh=None,
        dp_dims=None,
        shard: bool | None = None,
        replicas: str = "read",
        replica_check_every: int | None = None,
        exact_eval: bool = False,
        isolate_global_rng: bool | None = None,
        snapshot_every_n_steps: int | None = None,
    ):
        num_workers, auto_count = _auto.resolve_num_workers(num_workers)  # "auto": a guess
        opts = _options.check_arguments(
            num_workers=num_workers, timeout=timeout, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers, worker_type=worker_type, on_error=on_error,
            seed=seed, snapshot_every_n_steps=snapshot_every_n_steps, device=device, rank=rank,
            world_size=world_size, mesh=mesh, dp_dims=dp_dims, shard=shard, replicas=replicas,
            replica_check_every=replica_check_every, exact_eval=exact_eval,
        )
        self._device = opts.device
        datapipe = _options.is_iter_datapipe(dataset)
        self.dataset = dataset = _options.wrap_datapipe(dataset, shuffle)
        self.num_workers = num_workers
        self.prefetch_factor = opts.prefetch_factor
        self.pin_memory, self.pin_memory_device = pin_memory, pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.in_order = in_order
        self.worker_type, self.seed = opts.worker_type, opts.seed
        self._torch_base_seed: int | None = None  # the last base_seed drawn as torch draws it
        self.device = self._device
        self.on_error, self.snapshot_every_n_steps = on_error, snapshot_every_n_steps
        self.replicas, self.replica_check_every = replicas, replica_check_every
        # kept, so that Lightning's type(loader)(**attributes) rebuild keeps kuat's sharding
        self.mesh, self.dp_dims, self.shard = mesh, dp_dims, shard
        self._feed = _replicas.feed_for(opts.sharding, replicas, replica_check_every)
        self.exact_eval = opts.exact_eval
        self._torch_order = opts.seed_was_none  # shuffle=True on one process shuffles as torch's
        self._dist_applied: tuple[int, int] | None = None  # (rank, world_size) of the last epoch

        source = _sources.as_source(dataset)
        self._source = source
        iterable = isinstance(source, IterableDataset) or isinstance(dataset, IterableDataset)
        shuffle, batch_size, drop_last = _options.check_torch_sampling(
            iterable, shuffle, sampler, batch_sampler, batch_size, drop_last, datapipe)
        self._dataset_kind = _DatasetKind.Iterable if iterable else _DatasetKind.Map
        own_sampler = sampler is None and not iterable and batch_sampler is None
        traits = _options.SourceTraits.of(source, iterable=iterable, own_sampler=own_sampler)
        _options.check_equal_steps(opts, traits, source, sampler=sampler, batch_sampler=batch_sampler,
                                   batch_size=batch_size, drop_last=drop_last, on_error=on_error,
                                   in_order=in_order)
        if sampler is None:
            if iterable:
                sampler = InfiniteSampler()
                if traits.batching:  # workers take whole batches
                    source.kuat_set_batching(batch_size, drop_last)
            elif batch_sampler is None:
                r, ws = opts.sharding.resolve()
                sampler = default_sampler(
                    source, sharded=opts.sharding.sharded, shuffle=shuffle, seed=self.seed,
                    seed_given=not opts.seed_was_none, rank=r, world_size=ws, drop_last=drop_last,
                    generator=generator, exact=opts.exact_eval, batch_size=batch_size)
            else:
                sampler = SequentialSampler(source)
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
        use_getitems = auto_collation and not iterable and traits.batch_fetch
        if isolate_global_rng is None:
            isolate_global_rng = not traits.uses_sample_rng
        if not isinstance(isolate_global_rng, bool):
            raise TypeError(f"isolate_global_rng should be a bool or None, got {isolate_global_rng=!r}")
        self.isolate_global_rng = isolate_global_rng
        pin = _options.resolve_pin(pin_memory, pin_memory_device, self._device)
        opts = dataclasses.replace(opts, pin=pin)
        self._options, self._traits = opts, traits
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
            worker_rng=isolate_global_rng,
            on_error=on_error,
            worker_init_fn=worker_init_fn,
            use_getitems=use_getitems,
            fetch_collated=(use_getitems and job_collate is default_collate and on_error == "raise"
                            and traits.collated_fetch),
            pin=pin and opts.worker_type == "thread" or (pin and num_workers == 0),
            # batch-sized buffers reused once freed, outside malloc's arenas (kuat/_buffers.py)
            buffer_pool=BufferPool(),
            worker_state=iterable and not traits.resumable,  # per-worker dataset states
            datapipe=datapipe,  # seeded and sharded per worker, as torch (graph_settings)
            equal_steps=opts.sharding.sharded, flag_padding=opts.exact_eval)
        self._stats = LoaderStats()
        self._choice = _auto.WorkerChoice(auto_type=opts.auto_worker_type, auto_count=auto_count,
                                          worker_type=opts.worker_type, num_workers=num_workers)
        self._warned: set[tuple[str, str]] = set()
        self._advised = self._warned_unsplit = False
        self._workers = WorkerPool()
        self._state = _state.LoaderState()
        self._observer_factory = None  # a framework's per-epoch observer (kuat.integrations)
        self._closed = False
        self._IterableDataset_len_called = None
        self._iterator = None  # torch's attribute; kuat keeps persistent workers in _workers
        self.__initialized = True
        self.check_worker_number_rationality()
        if "accelerate" in sys.modules:  # route Accelerate's prepare/skip for kuat loaders here
            from kuat.integrations.accelerate import install

            try:
                install()
            except ImportError as e:  # a broken Accelerate install: the loader works without it
                log.debug("kuat.DataLoader: Accelerate integration not installed: %s", e)

    def check_worker_number_rationality(self) -> None:
        """Warn, as torch does and in torch's words, when more worker *processes* than usable
        CPUs are asked for (threads are not counted: :func:`kuat.loader._notices.worker_number`)."""
        _notices.worker_number(self)

    # --- rank and world size ------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's share now (``0`` unsharded; see ``shard``/``mesh``/``rank`` above)."""
        return self._resolve_distributed(warn=False)[0]

    @property
    def world_size(self) -> int:
        """The number of shares now (``1`` unsharded: every rank reads everything)."""
        return self._resolve_distributed(warn=False)[1]

    def _resolve_distributed(self, warn: bool = True) -> tuple[int, int]:
        return self._options.sharding.resolve(warn=warn)

    def __len__(self) -> int:
        _epoch.apply_distributed(self)
        skip = self._state.skip_first
        return max(0, self._len() - skip) if skip else self._len()

    def _len(self) -> int:
        return _epoch.epoch_length(self)

    def _batches_per_epoch(self) -> int | None:
        if self._traits.iterable:
            return None
        try:
            return len(self)
        except TypeError:
            return None

    # --- epochs and state -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next epoch started ``epoch`` (later ones follow from it).

        Calling ``loader.sampler.set_epoch(epoch)`` (what Lightning and the HF Trainer do with a
        ``DistributedSampler``) has the same effect; the later call wins, but either keeps a
        :meth:`load_state_dict`'s position in that epoch (a resumed HF Trainer calls both).
        So does a streaming ``datasets.IterableDataset``'s own ``set_epoch`` (as in torch).

        Raises:
            ValueError: ``epoch`` is not a non-negative int.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch should be a non-negative int, got {epoch=!r}")
        if getattr(p := self._state.pending, "loaded", None) is None or p.epoch != int(epoch):
            self._state.pending = _state.Pending(next_request(), int(epoch), 0, {})
        _epoch.dataset_epoch_request(self)  # an earlier dataset.set_epoch() is overridden

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: a small dict of ints (plus the source's own state).

        Keys: ``version``, ``seed``, ``torch_order`` (``shuffle=True`` shuffles as torch's
        ``RandomSampler``: ``seed=None``), ``epoch`` (the epoch the next batch belongs to),
        ``batches_served_in_epoch``, ``rank``, ``world_size``, ``samples_consumed`` and
        ``layout`` (docs/distributed.md, "Elastic resume"); ``sampler_seed`` (mid-epoch,
        with ``torch_order``: the seed that epoch's shuffle drew); ``source`` when the source
        has ``kuat_state_at()`` (iterable sources) or ``state_dict()``; ``generator`` (a
        ``torch.uint8`` state tensor of ``generator=`` as it was when the epoch started, as
        torchdata's ``StatefulDataLoader`` saves it); for a user ``sampler``/``batch_sampler``,
        ``sampler``: what its order depends on (:func:`kuat._sampler_order.order_state`), or
        ``None`` when kuat cannot tell. Taken mid-epoch it resumes after the last batch
        yielded; at the end of an epoch it points at the start of the next one. Costs a few
        microseconds (plus a generator state copy, a few KiB, and the source's own cost).
        Called with no arguments, as ``StatefulDataLoader.state_dict()``.
        """
        _epoch.draw_ahead(self)  # at an epoch's start: its draws, so that the state names them
        return _state.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next epoch started continues that position.

        The seed is taken from the state, and ``generator=``'s state (as it was when the saved
        epoch started) is restored. Workers, rank (all ranks are at the same position) and, with
        the loader's own sampler, world and batch size may differ (docs/distributed.md).

        Warns (``UserWarning``) when the resume cannot be exact: a state saved with (without)
        ``generator=`` loaded into a loader without (with) one, or a user sampler whose order
        kuat cannot save (kuat then replays ``iter(sampler)`` and skips the batches served).

        Raises:
            ValueError: not a kuat loader state of a known version; saved mid-epoch with a
                layout that cannot continue exactly (the message names the change).
        """
        _state.load_state_dict(self, state)

    def _set_seed(self, seed: int) -> None:
        self.seed = int(seed)
        self._job.seed = self.seed
        if isinstance(self.sampler, EpochSampler):
            self.sampler.seed = self.seed

    # --- statistics -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Where input time went, summed over this loader's iterations so far.

        Returns a dict: ``batches``, ``samples``, ``skipped_samples``; ``elapsed_s`` (wall time
        inside iteration, from the first ``next()`` of each epoch to its last); ``busy_s``, the
        seconds each stage was busy, summed over workers: ``fetch`` (dataset calls),
        ``fetch_cpu`` (their CPU time: far below ``fetch`` in thread mode means GIL-bound or
        I/O-bound), ``native`` (of ``fetch``, inside GIL-releasing kernels that report
        themselves: ``kuat.vision``'s decodes and resizes; ``native_cpu``: their CPU),
        ``runqueue`` (waiting for a core, while kuat measures: ``_auto``, ``kuat.doctor``),
        ``collate``, ``pin``,
        ``rng_lock_wait`` (waiting for global-RNG isolation), ``device`` (consumer: copies out
        of shared memory or to the device), ``batch_transform``; ``consumer_wait_s`` (every
        second the training loop spent inside ``next()``), ``worker_wait_s`` (the part of it
        spent waiting for a worker's result), ``input_bound_fraction`` (``consumer_wait_s /
        elapsed_s``), ``batches_per_s``, ``samples_per_s``, ``worker_busy_fraction`` (``(fetch +
        collate) / (elapsed_s * num_workers)``); ``loader_overhead_us_per_batch``: microseconds
        per batch ``next()`` spent in kuat's own machinery (dispatch, ordering, hand-off,
        bookkeeping: ``consumer_wait_s`` minus the work with ``num_workers=0`` or minus
        ``worker_wait_s`` with workers, minus device copies and batch transforms);
        ``loader_overhead_fraction``: those seconds over ``elapsed_s``;
        ``fetch_python_fraction``: ``(fetch - native) / fetch``, ``None`` when no kernel
        reported; ``python_us_per_sample``: CPU microseconds of Python (outside those kernels)
        per sample, ``{"workers", "consumer", "main_process"}`` (``LoaderStats.report``);
        ``workers``: the type and count in use and how they were chosen (``_auto``).
        """
        return self._stats.report(self.num_workers, self._choice.report(self))

    # --- iteration --------------------------------------------------------------------------
    def __iter__(self) -> LoaderIter:
        """An iterator over one epoch; it starts at its first ``next()`` (see the class)."""
        return self._get_iterator()

    def _get_iterator(self) -> LoaderIter:
        if self._closed:
            raise RuntimeError("this kuat DataLoader was closed")
        return LoaderIter(lambda it: _epoch.plan_epoch(self, it), self.__len__,
                          eager=_epoch.opens_at_iter(self))

    def close(self) -> None:
        """Stop persistent workers and refuse further iteration. Idempotent."""
        self._closed = True
        self._workers.close()
        self._job.buffer_pool.clear(close=True)  # idle batch buffers go back to the OS

    def __getstate__(self) -> dict[str, Any]:
        """Everything but live workers: persistent ones are started again after unpickling."""
        state = dict(self.__dict__)
        state["_workers"] = WorkerPool()
        state["_state"] = dataclasses.replace(self._state, owner=None)
        return state

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        workers = self.__dict__.get("_workers")
        if workers is not None:
            workers.close()

    # --- framework seams (kuat.integrations) ----------------------------------------------------
    def _attach_framework(self, observer_factory=None, device=None) -> None:
        """A framework integration's hold on the loader: ``observer_factory(loader)`` makes each
        epoch's :class:`~kuat.loader._plan.EpochObserver`; ``device``, a CUDA device batches
        are copied to when the loader has none."""
        if device is not None and torch.device(device).type == "cuda" and self._device is None:
            self._device = self.device = torch.device(device)
        if observer_factory is not None:
            self._observer_factory = observer_factory

    def _skip_first_batches(self, num_batches: int) -> DataLoader:
        """A copy whose next epoch skips its first ``num_batches`` (Accelerate's skip_first_batches).

        The copy shares the options, the dataset, statistics and position: when it starts an
        epoch, this loader's ``state_dict()`` and next epoch follow from it.

        Raises:
            ValueError: ``num_batches`` is not a non-negative int.
        """
        if isinstance(num_batches, bool) or not isinstance(num_batches, (int, np.integer)) or num_batches < 0:
            raise ValueError(f"num_batches should be a non-negative int, got {num_batches=!r}")
        skipping = copy.copy(self)  # through __getstate__: no live workers
        skipping._state = dataclasses.replace(self._state, skip_first=int(num_batches),
                                              owner=weakref.ref(self))
        self._state.pending = None  # the copy starts the pending epoch, if any
        return skipping

    # --- what the loader says once (kuat.loader._notices) -------------------------------------
    def _advise(self) -> None:
        _notices.advise(self)

