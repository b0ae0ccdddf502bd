"""Reading any source as one stream of samples: :func:`stream_of` (what mixes, shuffle
buffers, tokenizers and packers read their sources with)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kuat.sources._as_source import as_source
from kuat.sources.protocol import EpochAware, provides
from kuat.sources.stream import Stream

__all__ = ["stream_of"]


def stream_of(source, epoch: int, chunk: int = 64) -> Iterator:
    """Every sample of ``source`` for ``epoch``, unsplit by ranks or workers.

    * a :class:`Stream`: its :meth:`Stream.samples`;
    * a ``datasets.IterableDataset``: read through :class:`kuat.sources.hf.HFIterableSource`;
    * another ``torch.utils.data.IterableDataset``: ``set_epoch(epoch)`` when it has it, then
      ``iter()`` (it must not shard itself by worker inside a mix);
    * a map-style source: indices ``0 .. len - 1`` in order, ``chunk`` at a time through
      ``__getitems__`` when it has one, read in ``epoch``'s context (what a map-style mix's
      window and ``kuat.sample_rng`` follow), inside kuat's loader or not.
    """
    source = as_source(source)
    if isinstance(source, Stream):
        return source.samples(epoch)
    if isinstance(source, torch.utils.data.IterableDataset):
        if provides(source, EpochAware):
            source.set_epoch(epoch)
        return iter(source)
    return _map_stream(source, epoch, chunk)


def _map_stream(source, epoch: int, chunk: int) -> Iterator:
    from kuat.rng import current_epoch, epoch_context, sample_context

    n = len(source)
    getitems = getattr(source, "__getitems__", None)
    for start in range(0, n, chunk):
        indices = list(range(start, min(n, start + chunk)))
        # the epoch's context only around the reads (a generator must not leak it between yields)
        with epoch_context(current_epoch()[0], epoch):
            if getitems:
                items = getitems(indices)
            else:
                items = []
                for i in indices:
                    with sample_context(i):
                        items.append(source[i])
        yield from items
