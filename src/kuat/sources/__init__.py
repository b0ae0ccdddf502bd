"""What a loader reads: kuat datasets, torch map/iterable datasets, Hugging Face datasets, mixes.

:func:`as_source` is called by :class:`kuat.DataLoader` at construction. :class:`Dataset`
(:mod:`kuat.sources.dataset`) is what ``kuat.open`` returns; :func:`mix` interleaves several
sources by weight and :func:`shuffle_buffer` reorders a stream through a bounded buffer.

Names other than ``as_source`` load lazily: opening and reading a kuat dataset never imports
torch (``kuat inspect`` stays fast), while ``mix`` and the streams need it.
"""

from __future__ import annotations

import importlib

__all__ = ["Dataset", "as_source", "mix", "open_dataset", "shuffle_buffer"]

# public name -> the module that defines it
_LAZY = {
    "Dataset": "kuat.sources.dataset",
    "open_dataset": "kuat.sources.dataset",
    "mix": "kuat.sources.mixture",
    "shuffle_buffer": "kuat.sources.shuffle",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kuat.sources' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def as_source(dataset):
    """Return the object the loader should read for ``dataset``.

    * ``datasets.Dataset`` -> :class:`kuat.sources.hf.HFMapSource` (one Arrow gather per batch);
    * ``datasets.IterableDataset`` -> :class:`kuat.sources.hf.HFIterableSource` (split across
      ranks and workers by position, see :mod:`kuat.sources.stream`);
    * everything else (kuat datasets, torch map-style and iterable datasets, kuat mixes) is
      returned unchanged.

    ``datasets`` is never imported unless ``dataset`` comes from it.
    """
    import sys

    if "datasets" not in sys.modules:  # an HF dataset object implies its library is loaded
        return dataset  # (and kuat.sources.hf need not be imported: a first batch sooner)
    from kuat.sources.hf import is_hf_iterable_dataset, is_hf_map_dataset

    if is_hf_map_dataset(dataset):
        from kuat.sources.hf import HFMapSource

        return HFMapSource(dataset)
    if is_hf_iterable_dataset(dataset):
        from kuat.sources.hf import HFIterableSource

        return HFIterableSource(dataset)
    return dataset
