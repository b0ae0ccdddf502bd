"""Hugging Face Accelerate (and the HF ``Trainer``): a kuat loader stays a kuat loader.

Accelerate does not rebuild ``type(loader)``: ``prepare`` wraps any torch DataLoader in its own
``DataLoaderShard`` (a torch DataLoader over a ``BatchSamplerShard``) and ``skip_first_batches``
builds a plain torch ``DataLoader`` from the loader's batch sampler. Either way torch's engine
would read the data and the dataset's batch transform would be dropped. :func:`install` wraps
those two functions (in ``accelerate.data_loader``, and where they were imported by name:
``accelerate``, ``accelerate.accelerator``, ``transformers.trainer``) so that for a
``kuat.DataLoader`` they do the kuat equivalent; every other loader goes to Accelerate's own
function unchanged. :class:`kuat.DataLoader` calls :func:`install` when it is built while
``accelerate`` is imported; call it yourself if you import Accelerate after building loaders.

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


def _dispatching(name: str, kuat_fn):
    original = _ORIGINALS[name]

    @functools.wraps(original)
    def wrapper(dataloader, *args, **kwargs):
        if _is_kuat(dataloader):
            return kuat_fn(dataloader, *args, **kwargs)
        return original(dataloader, *args, **kwargs)

    wrapper.__kuat_dispatch__ = True
    return wrapper


def install() -> None:
    """Route Accelerate's ``prepare_data_loader``/``skip_first_batches`` for kuat loaders to kuat.

    Idempotent; other loaders reach Accelerate's functions unchanged. Also patches the names
    that ``accelerate``, ``accelerate.accelerator`` and ``transformers.trainer`` imported, when
    those modules are loaded. Raises ``ImportError`` when Accelerate is not installed.
    """
    import accelerate.data_loader as adl

    for name, kuat_fn in (("prepare_data_loader", prepare_data_loader),
                          ("skip_first_batches", skip_first_batches)):
        current = getattr(adl, name)
        if not getattr(current, "__kuat_dispatch__", False):
            _ORIGINALS[name] = current
            setattr(adl, name, _dispatching(name, kuat_fn))
        patched = getattr(adl, name)
        for module_name in ("accelerate", "accelerate.accelerator", "transformers.trainer"):
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, name, None) is _ORIGINALS[name]:
                setattr(module, name, patched)
