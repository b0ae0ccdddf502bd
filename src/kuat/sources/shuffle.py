"""``kuat.shuffle_buffer``: reorder a stream through a bounded buffer, dropping and duplicating
nothing.

The classic streaming shuffle (``tf.data``'s ``shuffle``, ``datasets.IterableDataset.shuffle``):
fill a buffer of ``size`` samples; then for each new sample, emit a uniformly chosen buffered one
and put the new one in its slot; at the end, emit what is left in a random order. Draws come from
a generator seeded with ``(seed, epoch)``, so each epoch has its own order and a run is
reproducible (and resumable by replay).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator

from kuat.rng import SALT_SHUFFLE_BUFFER, derive_generator
from kuat.sources.protocol import batch_transform
from kuat.sources.reading import stream_of
from kuat.sources.stream import Stream

__all__ = ["shuffle_buffer", "ShuffleBuffer"]

_DRAWS = 1024  # slot draws made at once


def shuffle_buffer(source, size: int, seed: int = 0) -> ShuffleBuffer:
    """``source`` (map-style or iterable) reordered through a buffer of ``size`` samples.

    Args:
        source: any source :func:`kuat.mix` accepts.
        size: samples held (memory grows with it; ``1`` keeps the order).
        seed: seeds the draws, with the epoch.

    Returns:
        A :class:`ShuffleBuffer` (a ``torch.utils.data.IterableDataset``, split across ranks and
        workers like every :class:`kuat.sources.stream.Stream`).

    Raises:
        ValueError: ``size`` is not an int >= 1.
        TypeError: ``seed`` is not an int.
    """
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise ValueError(f"shuffle_buffer size should be an int >= 1, got {size=!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed should be an int, got {seed=!r}")
    return ShuffleBuffer(source, int(size), int(seed))


class ShuffleBuffer(Stream):
    """See :func:`shuffle_buffer`."""

    def __init__(self, source, size: int, seed: int):
        super().__init__()
        from kuat.sources._as_source import as_source

        self.source = as_source(source)
        self.size = size
        self.seed = seed

    @property
    def kuat_batch_transform(self):
        """The source's batch step (applied by the loader to every batch), or ``None``."""
        return batch_transform(self.source)

    def samples(self, epoch: int) -> Iterator:
        rng = derive_generator(self.seed, epoch, SALT_SHUFFLE_BUFFER)
        buf: list = []
        slots: list[int] = []
        for item in stream_of(self.source, epoch):
            if len(buf) < self.size:
                buf.append(item)
                continue
            if not slots:
                slots = rng.integers(0, self.size, size=_DRAWS).tolist()
            j = slots.pop()
            out, buf[j] = buf[j], item
            yield out
        for j in rng.permutation(len(buf)).tolist():
            yield buf[j]

    def __repr__(self) -> str:
        return f"ShuffleBuffer({self.source!r:.60}, size={self.size}, seed={self.seed})"
