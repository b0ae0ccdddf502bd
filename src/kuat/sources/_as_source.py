"""What the loader reads for a dataset: :func:`as_source` (Hugging Face datasets adapted).

Its own module so that the sources that read other sources (``mix``, ``shuffle_buffer``,
:func:`kuat.sources.reading.stream_of`) import it without importing the package's
``__init__`` (which would close an import cycle through ``kuat.sources.hf``).
"""

from __future__ import annotations

__all__ = ["as_source"]


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
