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

What ``prepare`` does for a kuat loader (it returns the same object):

* sharding: none is added; kuat shards by rank itself, resolved when each epoch starts (the
  Accelerator has initialised ``torch.distributed`` by then), in equal shares as Accelerate's
  ``even_batches=True`` does. ``split_batches=True`` and ``dispatch_batches=True`` raise
  ``ValueError`` (kuat has no equivalent).
* device placement: with ``device_placement`` and an accelerator device, batches are copied
  there by kuat (as ``device=``), on a side stream.
* end of data: each epoch registers the loader with Accelerate's ``GradientState`` and sets
  ``loader.end_of_dataloader`` before the last batch is returned (``remainder`` as Accelerate
  computes it), so ``accelerator.accumulate()`` steps on the last, partial window.
* checkpoints: kuat loaders declare ``use_stateful_dataloader = True``, so
  ``accelerator.save_state``/``load_state`` store and restore ``loader.state_dict()``.

``skip_first_batches(loader, n)`` returns a kuat loader with the same options, engine, batch
transform and epoch order whose next epoch skips its first ``n`` batches (kuat skips by index,
fetching nothing); its position is shared with ``loader``, so ``loader``'s next epoch and
``state_dict()`` follow on.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import types

__all__ = ["GradientStateObserver", "install", "prepare_data_loader", "skip_first_batches"]

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
    it), ``end_of_dataloader`` set before the last batch is returned, removed at the end."""

    def __init__(self, gradient_state, loader):
        self._gradient_state, self._loader = gradient_state, loader

    def epoch_started(self, batches: int | None) -> None:
        loader = self._loader
        loader.end_of_dataloader = False
        loader.remainder = -1
        if not loader.drop_last and loader.batch_size is not None:
            try:  # as Accelerate's DataLoaderStateMixin.begin
                loader.remainder = len(loader.dataset) % (loader.batch_size * loader.world_size)
            except TypeError:
                pass
        self._gradient_state._add_dataloader(loader)

    def last_batch(self) -> None:
        self._loader.end_of_dataloader = True

    def epoch_ended(self) -> None:
        self._gradient_state._remove_dataloader(self._loader)


def prepare_data_loader(dataloader, device=None, num_processes=None, process_index=None,
                        split_batches: bool = False, put_on_device: bool = False, rng_types=None,
                        dispatch_batches=None, even_batches: bool = True, **kwargs):
    """Accelerate's ``prepare_data_loader`` for a kuat loader (see the module doc).

    Returns ``dataloader`` itself, prepared. Raises ``ValueError`` for ``split_batches=True`` or
    ``dispatch_batches=True``.
    """
    if split_batches:
        raise ValueError("kuat.DataLoader: Accelerate's split_batches=True is not supported; each "
                         "rank reads batches of batch_size from its own share")
    if dispatch_batches:
        raise ValueError("kuat.DataLoader: Accelerate's dispatch_batches=True is not supported; "
                         "each rank reads its own share through its own workers")
    if not even_batches:
        log.warning("kuat.DataLoader ignores Accelerate's even_batches=False: ranks always get "
                    "equal shares (padded by wrap-around, or truncated with drop_last)")
    if kwargs.get("use_seedable_sampler"):  # the HF Trainer's default (AcceleratorConfig)
        log.warning("kuat.DataLoader ignores Accelerate's use_seedable_sampler=True: its order "
                    "is kuat's own, from seed= (or torch's default generator with seed=None), "
                    "and resumes exactly through state_dict()")
    from accelerate.state import GradientState

    observe = functools.partial(GradientStateObserver, GradientState())
    dataloader._attach_framework(observer_factory=observe,
                                 device=device if put_on_device else None)
    dataloader.end_of_dataloader = False
    dataloader.remainder = -1
    return dataloader


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
