"""What a loader reads: kuat datasets, torch map/iterable datasets, Hugging Face datasets, mixes.

:func:`as_source` is called by :class:`kuat.DataLoader` at construction. :func:`mix` interleaves
several sources by weight and :func:`shuffle_buffer` reorders a stream through a bounded buffer.
"""

from __future__ import annotations

__all__ = ["as_source", "mix", "shuffle_buffer"]


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



# Imported after as_source (which they use). The function ``mix`` replaces the submodule of the
# same name as this package's attribute.
from kuat.sources.mix import mix  # noqa: E402
from kuat.sources.shuffle import shuffle_buffer  # noqa: E402
