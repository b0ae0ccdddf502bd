"""``kuat.mix``: interleave several sources by weight, deterministically from a seed.

Each step picks a source at random with probability proportional to its weight among the
sources still in play and takes that source's next sample (sources are read in their own order;
shuffle them first, or let the loader shuffle a map-style mix). Stopping:

* ``"first_exhausted"``: the mix ends the first time the source picked has no sample left (as
  ``datasets.interleave_datasets``); an empty source with a positive weight ends it at once;
* ``"all_exhausted"``: a source that runs out leaves the draw (the others' weights are
  renormalised) and the mix ends when every source has run out, so every sample of every source
  appears exactly once (no oversampling, unlike ``datasets``' ``all_exhausted``).

A source of weight 0 is never picked and never counts toward exhaustion.

The sources' batch step (``kuat_batch_transform``, e.g. an on-device ``Normalize``) applies to
every batch of the mix: the first source's that has one (they must agree; kuat warns when
several have one).

Per-sample randomness (``kuat.sample_rng``) inside source ``k > 0`` is seeded from the loader's
seed mixed with ``k``, so that the samples of equal index of two sources draw differently.

When every source is map-style (kuat datasets, ``datasets.Dataset``, torch map-style datasets)
the mix is map-style too (:class:`MapMix`): its schedule (which source fills each position) is
drawn once from the seed, so the loader shuffles, shards across ranks and resumes it like any
map-style dataset. Which samples fill a source's share depends on the epoch: with
``"first_exhausted"`` a source may get fewer positions (``m``) than it has samples (``n``);
epoch ``e`` then reads its samples ``e*m, e*m + 1, ...`` (mod ``n``), a window that moves on each
epoch, so every sample is read once in ``ceil(n / m)`` epochs (as the iterable mix reads each
source's stream on from epoch to epoch). Otherwise it is a :class:`MixStream`, a
:class:`kuat.sources.stream.Stream` whose draws depend on ``(seed, epoch)``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kuat.rng import SALT_MIX, derive_generator
from kuat.sources.protocol import (
    BatchFetch,
    MapSource,
    all_use_sample_rng,
    common_batch_transform,
    prefetcher,
    provides,
    splits_batches,
    thread_agnostic,
)
from kuat.sources.reading import stream_of
from kuat.sources.stream import Stream

__all__ = ["mix", "MapMix", "MixStream"]

_log = logging.getLogger("kuat.sources.mixture")
_MIX_SALT = SALT_MIX
_STOPPING = ("first_exhausted", "all_exhausted")


def mix(
    sources: Sequence,
    weights: Sequence[float] | None = None,
    stopping: str = "first_exhausted",
    seed: int = 0,
    *,
    shuffle_buffer: int | None = None,
):
    """Interleave ``sources`` by ``weights`` (see the module docstring for the rules).

    Args:
        sources: kuat datasets, ``datasets.Dataset`` / ``datasets.IterableDataset``, torch
            map-style or iterable datasets, or other mixes.
        weights: one non-negative number per source (not all 0); ``None`` weighs them equally.
        stopping: ``"first_exhausted"`` or ``"all_exhausted"``.
        seed: seeds the draws (with the epoch, for iterable mixes).
        shuffle_buffer: when given, reorder the mix's output through a buffer of that many
            samples (:func:`kuat.shuffle_buffer`; the result is then iterable).

    Returns:
        A :class:`MapMix` (map-style: ``len`` and ``__getitems__``) when every source is
        map-style, else a :class:`MixStream` (a ``torch.utils.data.IterableDataset``).

    Raises:
        ValueError: no source, a weight count that differs from the source count, a negative,
            non-finite or all-zero weight, an unknown ``stopping``.
        TypeError: a source that is neither map-style nor iterable, a non-int ``seed``.
    """
    from kuat.sources._as_source import as_source

    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence) or not sources:
        raise ValueError(f"mix needs a non-empty sequence of sources, got {sources!r:.100}")
    if weights is None:
        weights = [1.0] * len(sources)
    weights = list(weights)
    if len(weights) != len(sources):
        raise ValueError(f"mix got {len(sources)} sources but {len(weights)} weights")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w) or w < 0:
            raise ValueError(f"mix weights must be finite numbers >= 0, got {weights}")
    if not any(w > 0 for w in weights):
        raise ValueError(f"mix needs at least one positive weight, got {weights}")
    if stopping not in _STOPPING:
        raise ValueError(f"stopping should be one of {_STOPPING}, got {stopping=!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed should be an int, got {seed=!r}")
    srcs = [as_source(s) for s in sources]
    for i, s in enumerate(srcs):
        if not _is_map_style(s) and not isinstance(s, torch.utils.data.IterableDataset):
            raise TypeError(
                f"mix source {i} ({type(s).__name__}) is neither map-style (__len__ and "
                "__getitem__) nor a torch IterableDataset"
            )
    weights = [float(w) for w in weights]
    if all(_is_map_style(s) for s in srcs):
        out = MapMix(srcs, weights, stopping, int(seed))
    else:
        out = MixStream(srcs, weights, stopping, int(seed))
    out.kuat_batch_transform = _batch_transform(srcs, weights)
    if shuffle_buffer is not None:
        from kuat.sources.shuffle import shuffle_buffer as _shuffle_buffer

        out = _shuffle_buffer(out, shuffle_buffer, seed=int(seed))
    return out


def _batch_transform(sources: list, weights: list[float]):
    """The ``kuat_batch_transform`` of the mix: the first drawn source's that has one.

    A batch mixes samples of every source, so one batch step (e.g. on-device ``Normalize``)
    applies to all of them: the sources must agree on it (kuat warns when several have one;
    ``kuat.sources.protocol.common_batch_transform``). Sources of weight 0 are never read.
    """
    return common_batch_transform([s if w > 0 else None for s, w in zip(sources, weights,
                                                                         strict=True)], "mix")


def _is_map_style(source) -> bool:
    return (
        not isinstance(source, torch.utils.data.IterableDataset)
        and isinstance(source, MapSource)
    )


def _generator(seed: int, *extra: int) -> np.random.Generator:
    return derive_generator(seed, *extra, _MIX_SALT)


def _schedule(lengths: list[int], weights: list[float], stopping: str, seed: int) -> np.ndarray:
    """The source picked at each step of a map-style mix, ``(L,) int32``, drawn in blocks."""
    active = [k for k, w in enumerate(weights) if w > 0]
    if stopping == "first_exhausted" and any(lengths[k] == 0 for k in active):
        return np.empty(0, dtype=np.int32)
    rng = _generator(seed)
    counts = np.zeros(len(lengths), dtype=np.int64)
    parts = []
    while active:
        p = np.array([weights[k] for k in active])
        remaining = sum(lengths[k] - int(counts[k]) for k in active)
        block = int(min(1 << 20, max(1024, remaining + 1)))
        picks = np.asarray(active, dtype=np.int32)[
            rng.choice(len(active), size=block, p=p / p.sum())
        ]
        cut, out_of = block, None  # first step whose pick has nothing left
        for k in active:
            steps = np.flatnonzero(picks == k)
            room = lengths[k] - int(counts[k])
            if len(steps) > room and steps[room] < cut:
                cut, out_of = int(steps[room]), k
        parts.append(picks[:cut])
        counts += np.bincount(picks[:cut], minlength=len(lengths))
        if out_of is not None:
            if stopping == "first_exhausted":
                break
            active.remove(out_of)  # draws after the cut are discarded: redrawn without it
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)


class MapMix(torch.utils.data.Dataset):
    """A weighted interleave of map-style sources, itself map-style (built by :func:`mix`).

    Position ``i`` of the mix in epoch ``e`` is sample ``(positions[i] + e * counts[k]) %
    lengths[k]`` of source ``k = source_ids[i]``: the schedule is drawn once, from the seed, at
    construction (5 bytes per sample of memory), and a source with more samples than positions
    (``"first_exhausted"``) reads the next window of them each epoch. The epoch is the kuat
    DataLoader's (``kuat.rng.current_epoch()``, set in its workers); elsewhere (torch's
    DataLoader) call :meth:`set_epoch` before each epoch, as with ``DistributedSampler``.
    ``__getitems__`` fetches each source's share of a batch in one call.

    Loader hooks (``kuat.sources.protocol``), from the sources drawn from: thread-agnostic and
    sample RNG when all of them are, splits batches when one does, prefetch (each source is
    told its samples, in reading order), the batch transform of :func:`mix`.

    Attributes:
        sources: the sources (after ``kuat.sources.as_source``).
        source_ids: ``(L,) int32``, the source of each position.
        positions: ``(L,) int64``, the rank of each position among its source's positions.
        counts: ``(K,) int64``, positions per source (``m``).
        lengths: ``(K,) int64``, samples per source (``n``).

    Thread-safety: read-only after construction (``set_epoch`` aside); safe from several threads
    when the sources are.
    """

    def __init__(self, sources: list, weights: list[float], stopping: str, seed: int):
        self.sources = sources
        self.weights = weights
        self.stopping = stopping
        self.seed = seed
        self._epoch: int | None = None  # set_epoch(); None: the loader's epoch
        self.lengths = np.array([len(s) for s in sources], dtype=np.int64)  # (K,)
        self.source_ids = _schedule(self.lengths.tolist(), weights, stopping, seed)  # (L,)
        self.counts = np.bincount(self.source_ids, minlength=len(sources)).astype(np.int64)  # (K,)
        self.positions = np.empty(len(self.source_ids), dtype=np.int64)  # (L,)
        for k in range(len(sources)):
            at = self.source_ids == k
            self.positions[at] = np.arange(int(at.sum()))
        short = [k for k in range(len(sources)) if 0 < self.counts[k] < self.lengths[k]]
        if short:
            _log.info(
                "mix: each epoch reads %s of the %s samples of sources %s; the window moves on "
                "every epoch, so all of them are read within %s epochs",
                [int(self.counts[k]) for k in short], [int(self.lengths[k]) for k in short],
                short, max(-(-int(self.lengths[k]) // int(self.counts[k])) for k in short),
            )

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch``'s window of each source (needed outside kuat's DataLoader only).

        Raises:
            ValueError: ``epoch`` is not a non-negative int.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch should be a non-negative int, got {epoch!r}")
        self._epoch = int(epoch)

    def _window_epoch(self) -> int:
        if self._epoch is not None:
            return self._epoch
        from kuat.rng import current_epoch

        return current_epoch()[1]

    def _drawn(self) -> list:
        """The sources that fill at least one position (the others are never read)."""
        return [s for k, s in enumerate(self.sources) if self.counts[k] > 0]

    @property
    def kuat_splits_batches(self) -> bool:
        """Whether a batch fetch can use several threads (``kuat.sources.protocol``): one of
        the sources drawn from splits batches and is read with ``__getitems__``, which
        :meth:`__getitems__` calls in the fetching thread for that source's share of the batch
        (so its kernel splits that share; the other shares are fetched as usual)."""
        return any(provides(s, BatchFetch) and splits_batches(s)
                   for s in self._drawn())

    @property
    def kuat_thread_agnostic(self) -> bool:
        """Whether any thread may fetch a batch with the same result (``kuat.sources.protocol``):
        every source drawn from is thread-agnostic (the mix's own state, the schedule and the
        epoch, is read-only or set per thread by the loader)."""
        return all(thread_agnostic(s) for s in self._drawn())

    @property
    def kuat_uses_sample_rng(self) -> bool:
        """Whether the mix draws randomness only from ``kuat.sample_rng`` (so the loader need
        not isolate global generators): every source drawn from does (or is a plain sequence);
        the mix's own schedule is drawn once, from its seed."""
        return all_use_sample_rng(self._drawn())

    def kuat_prefetch(self, indices) -> None:
        """Loader hook (``kuat.sources.protocol.Prefetching``): tell each source that has one
        which of its samples the mix positions ``indices`` (a sequence of N ints, in reading
        order) read, in that order, in the current epoch's window (:meth:`set_epoch`, else the
        epoch of the calling thread's loader context). Returns at once."""
        hooks = [prefetcher(s) for s in self.sources]
        if not any(hooks) or not len(indices):
            return
        idx = np.asarray(indices, dtype=np.int64).reshape(-1) % max(len(self), 1)  # (N,)
        ks = self.source_ids[idx]  # (N,)
        js = (self.positions[idx] + self._window_epoch() * self.counts[ks]) % np.maximum(
            self.lengths[ks], 1)  # (N,)
        for k, hook in enumerate(hooks):
            if hook is not None:
                share = js[ks == k]
                if len(share):
                    hook(share.tolist())

    def __len__(self) -> int:
        return len(self.source_ids)

    def __getitem__(self, index: int):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices) -> list:
        """Samples at mix positions ``indices`` (list of B ints), as their sources return them.

        Raises:
            IndexError: a position outside ``[-len, len)``.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)  # (B,)
        n = len(self)
        if len(idx) and (idx.min() < -n or idx.max() >= n):
            bad = int(idx[(idx < -n) | (idx >= n)][0])
            raise IndexError(f"index {bad} is out of range for a mix of {n} samples")
        idx = idx % n if n else idx
        ks = self.source_ids[idx]  # (B,)
        n = self.lengths[ks]  # (B,)
        # (B,) index within each source: this epoch's window of it
        js = (self.positions[idx] + self._window_epoch() * self.counts[ks]) % np.maximum(n, 1)
        out = [None] * len(idx)
        for k in np.unique(ks).tolist():
            at = np.flatnonzero(ks == k)
            for slot, sample in zip(
                at.tolist(), _fetch(self.sources[k], js[at].tolist(), k), strict=True
            ):
                out[slot] = sample
        return out

    def __repr__(self) -> str:
        return (
            f"MapMix({len(self.sources)} sources, weights={self.weights}, "
            f"stopping={self.stopping!r}, seed={self.seed}, len={len(self)})"
        )


def _source_context(k: int):
    """The per-sample RNG context of source ``k``: source 0 keeps the loader's seed (so a
    one-source mix draws as the source alone); source ``k > 0`` gets a seed derived from it, so
    that sample ``j`` of two sources does not get the same augmentation draws."""
    from kuat.rng import current_epoch, epoch_context, sample_seed

    if k == 0:
        return contextlib.nullcontext()
    seed, epoch = current_epoch()
    return epoch_context(sample_seed(seed, _MIX_SALT, k), epoch)


def _fetch(source, indices: list[int], k: int) -> list:
    from kuat.rng import sample_context

    with _source_context(k):
        getitems = getattr(source, "__getitems__", None)
        if getitems:
            return list(getitems(indices))
        out = []
        for i in indices:
            with sample_context(i):  # the source's own index: same draws as outside the mix
                out.append(source[i])
        return out


class MixStream(Stream):
    """A weighted interleave with at least one iterable source (built by :func:`mix`).

    Epoch ``e`` draws from a generator seeded with ``(seed, e)``; the sources read epoch ``e``
    too (``set_epoch`` / their own ``samples(e)``). Split across ranks and workers as every
    :class:`kuat.sources.stream.Stream`.
    """

    def __init__(self, sources: list, weights: list[float], stopping: str, seed: int):
        super().__init__()
        self.sources = sources
        self.weights = weights
        self.stopping = stopping
        self.seed = seed

    def samples(self, epoch: int) -> Iterator:
        first = self.stopping == "first_exhausted"
        iters = {k: stream_of(s, epoch) for k, s in enumerate(self.sources) if self.weights[k] > 0}
        heads = {}
        for k in list(iters):  # an empty source is known at once
            try:
                with _source_context(k):
                    heads[k] = next(iters[k])
            except StopIteration:
                if first:
                    return
                del iters[k]
        rng = _generator(self.seed, epoch)
        picks: list[int] = []
        while iters:
            if not picks:
                active = list(iters)
                p = np.array([self.weights[k] for k in active])
                picks = np.asarray(active)[
                    rng.choice(len(active), size=1024, p=p / p.sum())
                ].tolist()
                picks.reverse()
            k = picks.pop()
            if k in heads:
                yield heads.pop(k)
                continue
            try:
                with _source_context(k):
                    item = next(iters[k])
            except StopIteration:
                if first:
                    return
                del iters[k]
                picks = []  # redraw without it
                continue
            yield item

    def __repr__(self) -> str:
        return (
            f"MixStream({len(self.sources)} sources, weights={self.weights}, "
            f"stopping={self.stopping!r}, seed={self.seed})"
        )
