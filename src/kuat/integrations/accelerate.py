"""Hugging Face Accelerate (and the HF ``Trainer``): a kuat loader stays a kuat loader.

Accelerate does not rebuild ``type(loader)``: ``prepare`` wraps any torch DataLoader in its own
``DataLoaderShard`` (a torch DataLoader over a ``BatchSamplerShard``) and ``skip_first_batches``
builds a plain torch ``DataLoader`` from the loader's batch sampler. Either way torch's engine
would read the data and the dataset's batch transform would be dropped. :func:`install` replaces
the code of those two function objects, so that every reference to them, whenever it was taken
(``from accelerate import skip_first_batches`` before ``import kuat`` included), does the kuat
equivalent for a ``kuat.DataLoader``; every other loader runs Accelerate's own code unchanged.
``import kuat`` calls :func:`kuat.integrations._import_hook.watch`, which installs at once when Accelerate is loaded and
otherwise right after ``accelerate.data_loader`` loads (an import hook), so the integration does
not depend on import order; ``import kuat`` imports neither Accelerate nor torch.

What ``prepare`` does for a kuat loader: what Accelerate's ``prepare_data_loader`` does for torch's
loader, with Accelerate's own objects, and a kuat loader back.

* sharding (who reads what): Accelerate's. Its own ``prepare_data_loader`` runs on the kuat loader
  (with ``dispatch_batches``/``put_on_device`` off), so its rules apply unchanged: a
  ``BatchSamplerShard`` over the loader's batch sampler (``even_batches``, ``split_batches``,
  ``torch_device_mesh`` as given), an ``IterableDatasetShard`` (or ``datasets``' ``shard``) for an
  iterable dataset, ``SeedableRandomSampler`` for a ``RandomSampler`` with
  ``use_seedable_sampler``, a generator for the sampler, synchronised from process 0 at each
  epoch's start. The kuat loader is then rebuilt with the same arguments and Accelerate's
  batch sampler or dataset, so kuat's engine reads exactly the batches Accelerate's
  ``DataLoaderShard`` would. On one process Accelerate changes nothing (but the sampler, with
  ``use_seedable_sampler``) and ``prepare`` returns the loader itself. kuat's own sampler with
  ``shuffle=True`` and ``seed=None`` *is* a ``RandomSampler`` (:class:`kuat.sampling.RandomEpochSampler`),
  so Accelerate treats it as torch's: it draws from the generator Accelerate synchronises, or
  is replaced by ``SeedableRandomSampler``; with ``seed=`` its order is ``(seed, epoch)`` on every
  rank (no generator is added).
  A loader sharded by kuat itself (``rank=``/``world_size=``, ``mesh=``, ``shard=True``) keeps
  its share and is not sharded again (``split_batches=True`` then raises ``ValueError``).
  ``dispatch_batches=True`` raises ``ValueError``: each rank reads its own batches.
* device placement: with ``device_placement`` and an accelerator device, batches are copied
  there by kuat (as ``device=``), on a side stream.
* end of data: each epoch registers the loader with Accelerate's ``GradientState`` and sets
  ``loader.end_of_dataloader`` before the last batch is returned, with ``remainder`` computed
  as ``DataLoaderShard`` computes it (the dataset length modulo its total batch size over all
  processes), so ``accelerator.accumulate()`` steps on the last, partial window and
  ``gather_for_metrics`` drops exactly the padding of ``even_batches``.
* checkpoints: kuat loaders declare ``use_stateful_dataloader = True``, so
  ``accelerator.save_state``/``load_state`` store and restore ``loader.state_dict()`` (for a
  sharded loader it names the epoch and the synchronised generator's state: the resumed
  epoch is the same order, from the next batch).

``skip_first_batches(loader, n)`` returns a kuat loader with the same options, engine, batch
transform and epoch order whose next epoch skips its first ``n`` batches (kuat skips by index,
fetching nothing); its position is shared with ``loader``, so ``loader``'s next epoch and
``state_dict()`` follow on.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import threading
import types

import torch
from torch.utils.data import BatchSampler, IterableDataset

try:
    from accelerate.data_loader import BatchSamplerShard as _BatchSamplerShard
    from accelerate.data_loader import SeedableRandomSampler
except ImportError:  # Accelerate absent: install() raises ImportError, nothing here is used
    _BatchSamplerShard = SeedableRandomSampler = object

__all__ = ["GradientStateObserver", "ShardedBatchSampler", "install", "prepare_data_loader",
           "skip_first_batches"]

log = logging.getLogger("kuat.integrations.accelerate")

_ORIGINALS: dict[str, object] = {}


def _is_kuat(loader) -> bool:
    # looked up, not imported: the loader's face imports this module (install), and a kuat
    # loader cannot exist before its module is loaded
    face = sys.modules.get("kuat.loader.dataloader")
    return face is not None and isinstance(loader, face.DataLoader)


class GradientStateObserver:
    """One epoch of a kuat loader as Accelerate's ``DataLoaderShard`` reports it to
    ``GradientState`` (``kuat.loader._plan.EpochObserver``): registered when the epoch starts
    (``end_of_dataloader`` cleared, ``remainder`` as ``DataLoaderStateMixin.begin`` computes
    it: the dataset's length modulo ``total_batch_size``, unless ``drop_last``), sets
    ``end_of_dataloader`` before the last batch is returned, removed at the end.

    ``total_batch_size(loader)``: the batch size over all processes (``DataLoaderShard``'s
    property for a loader Accelerate sharded; ``batch_size * world_size`` for one kuat
    shards itself); ``drop_last``: the prepared loader's ``drop_last`` as Accelerate saw it.
    """

    def __init__(self, gradient_state, loader, total_batch_size=None, drop_last=None):
        self._gradient_state, self._loader = gradient_state, loader
        self._total = total_batch_size or _kuat_total_batch_size
        self._drop_last = loader.drop_last if drop_last is None else drop_last

    def epoch_started(self, batches: int | None) -> None:
        loader = self._loader
        loader.end_of_dataloader = False
        loader.remainder = -1
        sharded = loader._options.sharding.sharded
        if sharded and not loader.exact_eval and not self._drop_last:
            # kuat's own strided shares pad by wrap-around between the ranks' samples, where
            # gather_for_metrics' truncation of the last step would drop real samples: keep
            # every gathered sample instead, and say how to make evaluation exact
            _warn_inexact_gather()
            self._gradient_state._add_dataloader(loader)
            return
        with contextlib.suppress(Exception):  # as DataLoaderStateMixin.begin
            if not self._drop_last:
                length = getattr(loader.dataset, "total_dataset_length", len(loader.dataset))
                loader.remainder = length % self._total(loader)
        self._gradient_state._add_dataloader(loader)

    def last_batch(self) -> None:
        self._loader.end_of_dataloader = True

    def epoch_ended(self) -> None:
        self._gradient_state._remove_dataloader(self._loader)


_warned_inexact = False


def _warn_inexact_gather() -> None:
    global _warned_inexact
    if not _warned_inexact:
        _warned_inexact = True
        log.warning("kuat.DataLoader sharded by kuat (rank=/mesh=/shard=True) without "
                    "exact_eval=True under Accelerate: its last step is padded by wrap-around, "
                    "so gather_for_metrics returns the padding too (remainder -1, nothing "
                    "dropped); pass exact_eval=True to an evaluation loader for every sample "
                    "exactly once (docs/distributed.md)")


def _kuat_total_batch_size(loader) -> int:
    return loader.batch_size * loader.world_size  # (TypeError without batch_size: no remainder)


class ShardedBatchSampler(_BatchSamplerShard):
    """Accelerate's ``BatchSamplerShard`` as the batch sampler of a kuat loader it sharded.

    The same object Accelerate built (its attributes copied: ``batch_sampler``,
    ``num_processes``, ``process_index``, ``split_batches``, ``even_batches``, and Accelerate's
    own ``__iter__``/``__len__``), plus what ``DataLoaderShard`` does to its sampler when each
    epoch starts, which kuat's loader calls through ``kuat_set_epoch(epoch)``: synchronise
    ``rng_types`` (``synchronized_generator`` from process 0: a collective, every rank starts
    the epoch) and set the epoch of the sampler inside (kuat's own sampler: its epoch;
    another: its ``set_epoch``). ``state_dict()`` names what the epoch's order depends on (the
    epoch, the inner sampler's generator state when the epoch started, a stateful sampler's
    own state); ``load_state_dict`` restores it, so a resumed epoch replays the same order.

    Thread-safety: called by the loader's consumer thread only.
    """

    @classmethod
    def of(cls, shard, rng_types, generator) -> ShardedBatchSampler:
        if not isinstance(shard, _BatchSamplerShard):  # one process: the batch sampler itself
            # (its batches as they are: even_batches would pad a short last one by wrapping)
            shard = _BatchSamplerShard(shard, num_processes=1, process_index=0, even_batches=False)
        sharded = cls.__new__(cls)
        sharded.__dict__.update(shard.__dict__)
        sharded.rng_types = list(rng_types) if rng_types else None
        sharded.synchronized_generator = generator
        sharded.epoch = 0
        return sharded

    def _inner(self):
        return getattr(self.batch_sampler, "sampler", None)

    def kuat_set_epoch(self, epoch: int) -> None:
        from accelerate.utils import synchronize_rng_states

        if self.rng_types:  # as DataLoaderShard.__iter__, before the epoch's draws
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.epoch = int(epoch)
        _set_inner_epoch(self._inner(), self.epoch)

    def state_dict(self) -> dict:
        inner = self._inner()
        gen = getattr(inner, "generator", None)
        state = {"epoch": self.epoch,
                 "generator": gen.get_state() if isinstance(gen, torch.Generator) else None}
        if callable(getattr(inner, "state_dict", None)) and callable(getattr(inner, "load_state_dict", None)):
            state["sampler"] = inner.state_dict()
        if isinstance(getattr(inner, "initial_seed", None), int):  # SeedableRandomSampler's:
            state["initial_seed"] = inner.initial_seed  # its order is (initial_seed + epoch)
        return state

    def load_state_dict(self, state: dict) -> None:
        inner = self._inner()
        self.epoch = int(state["epoch"])
        _set_inner_epoch(inner, self.epoch)
        gen = getattr(inner, "generator", None)
        if state.get("generator") is not None:
            if gen is None and isinstance(inner, SeedableRandomSampler):
                # Accelerate's makes its generator at its first __iter__ (then seeds it with
                # initial_seed + epoch): a fresh loader's has none yet
                gen = inner.generator = torch.Generator()
            if not isinstance(gen, torch.Generator):
                raise ValueError(f"the saved loader state holds a generator state, but "
                                 f"{type(inner).__name__} has no generator")
            gen.set_state(state["generator"])
        if "sampler" in state:
            inner.load_state_dict(state["sampler"])
        if "initial_seed" in state and hasattr(inner, "initial_seed"):
            inner.initial_seed = int(state["initial_seed"])


def _set_inner_epoch(sampler, epoch: int) -> None:
    from kuat.sampling import EpochSampler

    if isinstance(sampler, EpochSampler):
        sampler.epoch = epoch  # kuat's own: its order of (seed, epoch) (not a set_epoch request)
    elif callable(getattr(sampler, "set_epoch", None)):  # as DataLoaderShard.set_epoch
        sampler.set_epoch(epoch)


# The loader's arguments that are not read back from its attributes: its share (only loaders
# kuat does not shard are rebuilt: their defaults), and the ones Accelerate's shard replaces.
_NOT_COPIED = frozenset({"self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler",
                         "drop_last", "rank", "world_size", "mesh", "dp_dims", "shard"})


def _rebuild(loader, **overrides):
    """``type(loader)(...)`` with the loader's own arguments (its public attributes of those
    names, as Lightning rebuilds loaders; the choices kuat made for ``prefetch_factor``,
    ``worker_type`` and ``seed`` left to the new loader, as they were) and ``overrides``."""
    opts = loader._options
    params = inspect.signature(type(loader).__init__).parameters
    args = {name: getattr(loader, name) for name in params
            if name not in _NOT_COPIED and hasattr(loader, name)}
    if opts.adaptive_prefetch:
        args["prefetch_factor"] = None
    if opts.auto_worker_type:
        args["worker_type"] = None
    if opts.seed_was_none:
        args["seed"] = None
    args.update(overrides)
    return type(loader)(**args)


def _index_batches(loader):
    return loader.sampler if isinstance(loader.sampler, BatchSampler) else loader.batch_sampler


def _shard(dataloader, num_processes, process_index, split_batches, rng_types, even_batches,
           kwargs):
    """Accelerate's sharding of ``dataloader`` (its ``prepare_data_loader``, which builds a
    ``DataLoaderShard``; only its batch sampler, dataset and generator are kept), applied to a
    rebuilt kuat loader. Returns ``(loader, total_batch_size)``."""
    from accelerate.data_loader import DataLoaderShard, get_sampler

    from kuat.sampling import EpochSampler

    inner = get_sampler(dataloader)
    own = isinstance(inner, EpochSampler)
    had_generator = own and inner.generator is not None
    kwargs = {**kwargs, "use_stateful_dataloader": False, "non_blocking": False}
    shard = _ORIGINALS["prepare_data_loader"](
        dataloader, None, num_processes, process_index, split_batches, False,
        list(rng_types) if rng_types is not None else None, False, even_batches, **kwargs)
    if not isinstance(shard, DataLoaderShard):
        raise TypeError(f"kuat.DataLoader: Accelerate's prepare_data_loader gave a "
                        f"{type(shard).__name__}, not the DataLoaderShard kuat rebuilds from")
    total = DataLoaderShard.total_batch_size.fget
    iterable = isinstance(shard.dataset, IterableDataset)
    # use_seedable_sampler: Accelerate puts its SeedableRandomSampler in place of a RandomSampler
    # (kuat's own with shuffle=True and no seed= is one), into the loader's own batch sampler
    replaced = not iterable and get_sampler(shard) is not inner
    if shard.dataset is dataloader.dataset and not replaced and (
            iterable or _index_batches(shard) is _index_batches(dataloader)):
        return dataloader, total  # one process: Accelerate changes nothing
    generator = shard.synchronized_generator
    if own and not had_generator and not dataloader._options.seed_was_none:
        # kuat's own sampler with seed=: the order is (seed, epoch) on every rank already
        inner.generator = generator = None
    rng = [t for t in (shard.rng_types or ()) if generator is not None or t != "generator"]
    if iterable:
        rebuilt = _rebuild(dataloader, dataset=shard.dataset, batch_size=shard.batch_size,
                           drop_last=shard.drop_last)
        # Accelerate's save_state/load_state ask a loader over an IterableDatasetShard for it
        rebuilt.get_sampler = functools.partial(get_sampler, rebuilt)
    elif isinstance(shard.sampler, BatchSampler):  # a batch sampler given as sampler=
        rebuilt = _rebuild(dataloader, dataset=shard.dataset, batch_size=shard.batch_size,
                           sampler=ShardedBatchSampler.of(shard.sampler, rng, generator))
    else:
        rebuilt = _rebuild(dataloader, dataset=shard.dataset,
                           batch_sampler=ShardedBatchSampler.of(shard.batch_sampler, rng, generator))
    return rebuilt, total


def prepare_data_loader(dataloader, device=None, num_processes=None, process_index=None,
                        split_batches: bool = False, put_on_device: bool = False, rng_types=None,
                        dispatch_batches=None, even_batches: bool = True, **kwargs):
    """Accelerate's ``prepare_data_loader`` for a kuat loader (see the module doc).

    Returns a kuat loader: ``dataloader`` itself on one process or when kuat shards it itself,
    else a kuat loader rebuilt with the same arguments over Accelerate's ``BatchSamplerShard``
    (map-style) or ``IterableDatasetShard``. Raises ``ValueError`` for ``dispatch_batches=True``,
    for ``split_batches=True`` on a loader kuat shards itself, and Accelerate's own errors (e.g.
    a batch size that ``split_batches`` cannot divide by the number of processes).
    """
    if dispatch_batches:
        raise ValueError("kuat.DataLoader: Accelerate's dispatch_batches=True is not supported; "
                         "each rank reads its own share through its own workers")
    from accelerate.state import GradientState

    if dataloader._options.sharding.sharded:  # kuat's own sharding, asked for: kept
        if split_batches:
            raise ValueError("kuat.DataLoader: Accelerate's split_batches=True is not supported "
                             "on a loader kuat shards itself (rank=/world_size=, mesh=, "
                             "shard=True); build it without those to let Accelerate shard it")
        if not even_batches:
            log.warning("kuat.DataLoader sharded by kuat (rank=/world_size=, mesh=, shard=True) "
                        "ignores Accelerate's even_batches=False: its ranks get equal shares")
        prepared, total, drop_last = dataloader, None, dataloader.drop_last
    else:
        prepared, total = _shard(dataloader, num_processes, process_index, split_batches,
                                 rng_types, even_batches, kwargs)
        drop_last = dataloader.drop_last
    observe = functools.partial(GradientStateObserver, GradientState(), total_batch_size=total,
                                drop_last=drop_last)
    prepared._attach_framework(observer_factory=observe, device=device if put_on_device else None)
    prepared.end_of_dataloader = False
    prepared.remainder = -1
    return prepared


def skip_first_batches(dataloader, num_batches: int = 0):
    """``accelerate.skip_first_batches`` for a kuat loader: a kuat loader skipping ``num_batches``."""
    return dataloader._skip_first_batches(num_batches)


_KUAT_FNS = {"prepare_data_loader": prepare_data_loader, "skip_first_batches": skip_first_batches}


def _route(name: str, args: tuple, kwargs: dict):
    """What Accelerate's ``name`` does once routed: kuat's version for a kuat loader, else the
    original (a copy of Accelerate's function with its own code, globals and defaults)."""
    dataloader = args[0] if args else kwargs.get("dataloader")
    fn = _KUAT_FNS[name] if _is_kuat(dataloader) else _ORIGINALS[name]
    return fn(*args, **kwargs)


# Code objects swapped into Accelerate's own function objects. They run with the globals of
# accelerate.data_loader, where install() puts ``_kuat_route``.
def _routed_prepare_data_loader(*args, **kwargs):
    return _kuat_route("prepare_data_loader", args, kwargs)  # noqa: F821


def _routed_skip_first_batches(*args, **kwargs):
    return _kuat_route("skip_first_batches", args, kwargs)  # noqa: F821


_ROUTED_CODE = {"prepare_data_loader": _routed_prepare_data_loader.__code__,
                "skip_first_batches": _routed_skip_first_batches.__code__}


def _copy_function(fn):
    copied = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                fn.__closure__)
    copied.__kwdefaults__ = fn.__kwdefaults__
    copied.__dict__.update(fn.__dict__)
    copied.__qualname__, copied.__doc__, copied.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return copied


def install() -> None:
    """Route Accelerate's ``prepare_data_loader``/``skip_first_batches`` for kuat loaders to kuat.

    The code of Accelerate's two function objects is replaced (once, idempotently; the way
    :mod:`kuat.engine.worker_info` patches torch's ``get_worker_info``), so every reference to
    them routes, whenever it was taken: ``from accelerate import skip_first_batches`` before
    kuat was imported, ``accelerate.accelerator``'s and ``transformers.trainer``'s names
    included. Other loaders reach Accelerate's original code unchanged, and
    ``inspect.signature`` still shows Accelerate's signature (``__wrapped__``). Called when
    ``import kuat`` finds Accelerate loaded, when Accelerate is loaded after kuat (the import
    hook of :mod:`kuat.integrations._import_hook`) and when a ``kuat.DataLoader`` is built. Raises ``ImportError`` when
    Accelerate is not installed.
    """
    adl = sys.modules.get("accelerate.data_loader")
    if adl is None:
        import accelerate.data_loader as adl
    with _install_lock:
        adl.__dict__["_kuat_route"] = _route
        for name in _KUAT_FNS:
            fn = adl.__dict__[name]
            if getattr(fn, "__kuat_dispatch__", False):
                continue
            _ORIGINALS[name] = _copy_function(fn)
            fn.__code__ = _ROUTED_CODE[name]
            fn.__wrapped__ = _ORIGINALS[name]
            fn.__kuat_dispatch__ = True


_install_lock = threading.Lock()
