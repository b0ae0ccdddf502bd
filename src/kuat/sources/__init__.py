"""What a loader reads: kuat datasets, torch map/iterable datasets, Hugging Face datasets, mixes.

:func:`as_source` is called by :class:`kuat.DataLoader` at construction. :class:`Dataset`
(:mod:`kuat.sources.dataset`) is what ``kuat.open`` returns; :func:`mix` interleaves several
sources by weight and :func:`shuffle_buffer` reorders a stream through a bounded buffer.

Names other than ``as_source`` load lazily: opening and reading a kuat dataset never imports
torch (``kuat inspect`` stays fast), while ``mix`` and the streams need it.
"""

from __future__ import annotations

import importlib

from kuat.sources._as_source import as_source

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
