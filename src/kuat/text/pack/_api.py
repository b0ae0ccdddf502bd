"""The face of :func:`kuat.pack`: the arguments checked, the :class:`Packed` stream and its
resumable :class:`PackIterator` (what each strategy packs, the rows' fields, who packs what
and how a resume costs: :mod:`kuat.text.pack`).

:class:`Packed` chooses, for each iteration, how its rows are found: read and packed in order
(``_inorder.py``: :meth:`Packed.iter_rows`, and sources of unknown lengths) or planned from the
documents' lengths, each consumer building only its own rows (``_plan.py``). Rank and world
size come from the :class:`kuat.sources.stream.Stream` base class (``Packed.kuat_iter_from``),
the worker from ``torch.utils.data.get_worker_info()`` (there and in ``_plan._shared_plan``); the
shuffle seed is derived in :class:`kuat.text._docs.Documents`.
"""

from __future__ import annotations

import bisect
import logging
import math
import numbers
import threading
from collections.abc import Iterator

import numpy as np
import torch

from kuat.sources.stream import Stream
from kuat.text._docs import Documents
from kuat.text.pack._inorder import concat_in_order, fit_in_order
from kuat.text.pack._plan import START, Share, epoch_lengths, fit_plan, plan_rows
from kuat.text.pack._stats import PackStats
from kuat.text.pack._strategies import STRATEGIES

__all__ = ["pack", "Packed", "PackIterator"]

_log = logging.getLogger("kuat.text.pack")

_STATE_VERSION = 1


def pack(
    source,
    seq_len: int,
    strategy: str = "best_fit",
    *,
    buffer_size: int = 1024,
    too_long: str = "split",
    field: str = "input_ids",
    pad_id: int = 0,
    shuffle: bool = False,
    seed: int = 0,
    lengths=None,
) -> Packed:
    """Pack the documents of ``source`` into rows of ``seq_len`` tokens, on the fly.

    Args:
        source: map-style (a kuat dataset, ``datasets.Dataset``, torch ``Dataset``) or iterable
            (``datasets.IterableDataset``, :func:`kuat.mix` of streams, a torch
            ``IterableDataset``) source of documents: mappings with ``field`` (1-d ints) and
            optionally ``labels`` (-100 where masked) or ``loss_mask`` (1 where trained on), or
            bare sequences of token ids.
        seq_len: ``L``, tokens per row.
        strategy: ``"concat"``, ``"first_fit"`` or ``"best_fit"`` (see :mod:`kuat.text.pack`).
        buffer_size: documents packed together by the fit strategies (memory and the cost of a
            resume grow with it; padding shrinks). Ignored by ``"concat"``.
        too_long: documents longer than ``seq_len`` in fit strategies: ``"split"`` into pieces
            of ``seq_len`` (the last one shorter) or ``"drop"``.
        field: the token field of the documents.
        pad_id: the ``input_ids`` value of padding.
        shuffle: read a map-style source in a permuted order, a new one each epoch (seeded by
            ``(seed, epoch)`` as the loader's sampler is); iterable sources keep their order.
        seed: the run seed for ``shuffle``.
        lengths: ``(N,)`` ints, the tokens of each document of a map-style source, by source
            index (e.g. :func:`kuat.text.lengths_of`); read from the source when it is a kuat
            dataset without transforms. Each document read is checked against it.

    Returns:
        A :class:`Packed` stream (a ``torch.utils.data.IterableDataset``). Rows are split by
        position: rank ``r`` of ``W`` takes rows ``r, r + W, ...`` (without ``drop_last``,
        ranks are padded by wrapping around to the first rows, as ``DistributedSampler``
        does), so ranks get equal shares and a row goes to exactly one rank and worker; a
        rank's loader workers take whole batches in turn. Batch rows with
        :func:`kuat.text.pack_collate`.

        With the documents' lengths (a map-style source with ``lengths`` or a kuat dataset),
        each consumer (rank x worker) computes the same packing plan from the lengths alone
        (concat: arithmetic on their running sum; fit strategies: the bin choice over every
        buffer, no tokens read) and reads and builds only its own rows. Otherwise (iterable
        sources, other map-style sources) each consumer reads and packs the whole epoch and
        keeps its rows.

    Raises:
        ValueError: ``seq_len`` or ``buffer_size`` not an int >= 1; an unknown ``strategy`` or
            ``too_long``; ``lengths`` not 1-d ints >= 0. When iterating: ``lengths`` of another
            size than the source, or a document of another length than ``lengths`` says.
        TypeError: ``pad_id`` or ``seed`` not an int, ``field`` not a string.
    """
    if lengths is not None:
        arr = lengths.numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths)
        if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0)):
            raise ValueError(
                f"lengths should be a 1-d sequence of ints >= 0, got shape {arr.shape} "
                f"dtype {arr.dtype}"
            )
        lengths = arr.astype(np.int64)
    for name, v in (("seq_len", seq_len), ("buffer_size", buffer_size)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{name} should be an int >= 1, got {v!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy should be one of {STRATEGIES}, got {strategy!r}")
    if too_long not in ("split", "drop"):
        raise ValueError(f"too_long should be 'split' or 'drop', got {too_long!r}")
    for name, v in (("pad_id", pad_id), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} should be an int, got {v!r}")
    if not isinstance(field, str):
        raise TypeError(f"field should be a field name, got {field!r}")
    return Packed(
        source,
        int(seq_len),
        strategy,
        int(buffer_size),
        too_long,
        field,
        int(pad_id),
        bool(shuffle),
        int(seed),
        lengths,
    )


class Packed(Stream):
    """Packed rows of a source (see :func:`pack`, which validates the arguments).

    Thread-safety: as every :class:`kuat.sources.stream.Stream`, independent iterators may run
    in several threads; :meth:`stats` reports the pass most recently finished or in progress
    on this object.
    """

    def __init__(
        self,
        source,
        seq_len,
        strategy,
        buffer_size,
        too_long,
        field,
        pad_id,
        shuffle,
        seed,
        lengths=None,
    ):
        super().__init__()
        from kuat.sources import as_source

        self.source = as_source(source)
        self.seq_len = seq_len
        self.strategy = strategy
        self.buffer_size = buffer_size
        self.too_long = too_long
        self.field = field
        self.pad_id = pad_id
        self.shuffle = shuffle
        self.seed = seed
        self._stats = PackStats(seq_len)
        # (N,) document lengths by source index, found once and shared by the shallow copies
        # the loader's thread workers get; None: unknown (read the whole stream)
        self._lengths = {
            "value": lengths,
            "known": lengths is not None,
            "own": lengths is None,  # found from the source itself (not pack(lengths=))
            "lock": threading.Lock(),
        }
        self._checkpoints: dict = {}  # kuat_state_at's plan checkpoints of one epoch
        # the fit plan being read by this process's consumers (thread workers hold shallow
        # copies of this object, so they share it): see kuat.text.pack._plan.SharedPlan
        self._plans = {"lock": threading.Lock(), "key": None, "plan": None}
        if shuffle and isinstance(self.source, torch.utils.data.IterableDataset):
            _log.warning(
                "pack(shuffle=True) over an iterable source keeps the stream's order; shuffle "
                "the stream itself (kuat.shuffle_buffer, datasets' IterableDataset.shuffle)"
            )

    def __repr__(self) -> str:
        return (
            f"Packed({self.source!r:.60}, seq_len={self.seq_len}, strategy={self.strategy!r}, "
            f"buffer_size={self.buffer_size}, too_long={self.too_long!r})"
        )

    def __iter__(self) -> Iterator[dict]:
        return self.kuat_iter_from(self._epoch, 0)

    def kuat_state_at(
        self, epoch: int, batches_served: int, rank: int, world_size: int
    ) -> dict | None:
        """Where the plan of ``epoch`` stands after the first ``batches_served`` batches of
        rank ``rank`` of ``world_size``: a small dict (the checkpoint of the fit strategies' buffer holding the next
        row: its first row and document and the ``(document, piece)`` keys carried into it),
        or ``None`` when there is nothing to say (``concat``, whose rows are found by
        arithmetic; the start of an epoch; unknown lengths). ``kuat.DataLoader.state_dict``
        saves it and hands it back to :meth:`kuat_iter_from`.

        Costs the plan (lengths only) from the last point asked in this epoch: checkpoints
        taken in order cost one plan of the epoch in all. Not thread-safe (the loader calls it
        from its own thread)."""
        if self.strategy == "concat" or not batches_served:
            return None
        lengths = self._doc_lengths()
        if lengths is None:
            return None
        row = rank + world_size * batches_served * (self._batch_size or 1)
        cache = self._checkpoints
        if cache.get("epoch") != epoch:
            cache.clear()
            cache.update(epoch=epoch, points=[START], complete=False)
        points = cache["points"]
        if row >= points[-1][0] and not cache["complete"]:
            lens = epoch_lengths(self, epoch, lengths)[1]
            cache["complete"] = True
            for first, buf in fit_plan(lens, self, PackStats(self.seq_len), points[-1]):
                if first > points[-1][0]:
                    points.append((first, buf.start, buf.carried_keys))
                if first > row:
                    cache["complete"] = False
                    break
        first, start, keys = points[bisect.bisect_right(points, (row, math.inf)) - 1]
        return {
            "version": _STATE_VERSION,
            "strategy": self.strategy,
            "epoch": epoch,
            "first_row": first,
            "start": start,
            "carried": [list(k) for k in keys],
        }

    def kuat_iter_from(
        self, epoch: int, batches_served: int, state: dict | None = None
    ) -> Iterator[dict]:
        """This rank's and this worker's rows of ``epoch`` after the rank's first
        ``batches_served`` batches (``kuat.DataLoader``'s resume hook; see the module
        docstring of :mod:`kuat.loader`): batch ``batches_served`` goes to worker 0, the next
        to worker 1, and so on. ``state``: what :meth:`kuat_state_at` said for this point,
        with which the fit strategies plan from the buffer holding the next row (one buffer's
        bin choice, nothing read before it); without it they plan from the start of the
        epoch (lengths only). Without known lengths the stream is read and packed up to there.

        Raises:
            ValueError: ``state`` is not a state of this strategy and epoch.
        """
        at = None
        if state is not None:
            if (
                not isinstance(state, dict)
                or state.get("version") != _STATE_VERSION
                or state.get("strategy") != self.strategy
                or state.get("epoch") != epoch
            ):
                raise ValueError(
                    f"not a {self.strategy!r} plan state of epoch {epoch}, version "
                    f"{_STATE_VERSION}: {state!r:.200}"
                )
            keys = tuple((int(o), int(p)) for o, p in state["carried"])
            at = (int(state["first_row"]), int(state["start"]), keys)
        rank, world = self._rank_and_world()
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        elastic = getattr(self, "_start", None)  # start_at: rows consumed elsewhere
        offset = (elastic[1] if elastic is not None and elastic[0] == epoch
                  and not batches_served and at is None else 0)
        share = Share(rank, world, self._batch_size or 1, worker, workers, self._drop_last,
                      batches_served, offset)
        lengths = self._doc_lengths()
        if lengths is None:
            self._stats = PackStats(self.seq_len)  # (the pass below replaces it)
            return share.filter(self.samples(epoch))
        if self.strategy != "concat" and at is None and share.takes_all() and self._lengths["own"]:
            # one consumer takes every row: packing the epoch in order reads each document once,
            # a block at a time, where the plan would fetch every buffer's documents again by
            # ordinal (same rows; 1.5x faster on 20,000 documents). Lengths given by the user
            # go through the plan, which checks every document against them.
            return self.samples(epoch)
        docs, lens = epoch_lengths(self, epoch, lengths)
        self._stats = PackStats(self.seq_len)
        return plan_rows(self, docs, lens, self._stats, share, at, self._plans)

    def _doc_lengths(self) -> np.ndarray | None:
        holder = self._lengths
        if not holder["known"]:
            with holder["lock"]:
                if not holder["known"]:
                    docs = Documents(self.source, self.field, 0, False, 0)
                    holder["value"], holder["known"] = docs.lengths(), True
        return holder["value"]

    def __copy__(self) -> Packed:
        # what a loader's thread worker gets (copy.copy): its own attributes, but the same
        # lengths and plan holders (copy.copy would otherwise go through __getstate__ below,
        # which gives each copy new ones, so every worker found the lengths and planned alone)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __getstate__(self):  # picklable for process workers (a lock is not)
        state = self.__dict__.copy()
        state["_lengths"] = {k: v for k, v in self._lengths.items() if k != "lock"}
        state["_checkpoints"] = {}
        state["_plans"] = {"key": None, "plan": None}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lengths["lock"] = threading.Lock()
        self._plans["lock"] = threading.Lock()

    def samples(self, epoch: int) -> Iterator[dict]:
        """Every packed row of ``epoch``, in order (unsplit by ranks and workers)."""
        return (row for row in self.iter_rows(epoch))

    def iter_rows(self, epoch: int = 0, state: dict | None = None) -> PackIterator:
        """An iterator over the rows of ``epoch`` (all of them, unsplit), from the start or from
        ``state`` (a :meth:`PackIterator.state_dict`, which then also gives the epoch).

        Raises:
            ValueError: ``state`` is not a state of this strategy and version.
        """
        return PackIterator(self, epoch, state)

    def stats(self) -> dict:
        """Counts of the most recent pass over this object: ``documents`` read, ``tokens`` in
        them, ``rows`` emitted, ``pad_tokens``, ``split_documents`` (longer than ``seq_len``,
        split), ``dropped_documents`` and ``dropped_tokens`` (``too_long="drop"``), and
        ``padding_fraction`` (pad tokens / row tokens): the packing of the epoch as far as this
        pass decided it (with a plan, every consumer decides every row; ``concat`` decides the
        whole epoch at once); ``read_documents`` and ``read_tokens``: what this pass read (with
        a plan, only its own rows' documents). A resumed pass counts from the resume point's
        buffer. With a loader's workers, each worker's copy counts its own pass."""
        return self._stats.as_dict()


class PackIterator(Iterator[dict]):
    """Rows of one epoch from a :class:`Packed`, with a small resumable state.

    ``state_dict()`` after ``k`` rows, given back to :meth:`Packed.iter_rows`, yields exactly
    the rows ``k, k + 1, ...`` of an uninterrupted pass.
    """

    def __init__(self, packed: Packed, epoch: int, state: dict | None):
        if state is not None:
            if (
                not isinstance(state, dict)
                or state.get("version") != _STATE_VERSION
                or state.get("strategy") != packed.strategy
            ):
                raise ValueError(
                    f"not a {packed.strategy!r} packer state of version {_STATE_VERSION}: "
                    f"{state!r:.200}"
                )
            epoch = int(state["epoch"])
        self._packed = packed
        self._epoch = epoch
        packed._stats = self._stats = PackStats(packed.seq_len)
        docs = Documents(packed.source, packed.field, epoch, packed.shuffle, packed.seed)
        if packed.strategy == "concat":
            pos = (0, 0) if state is None else (int(state["doc"]), int(state["offset"]))
            self._rows = concat_in_order(docs, packed, self._stats, pos)
        else:
            pos = (0, (), 0)
            if state is not None:
                carried = tuple((int(o), int(p)) for o, p in state["carried"])
                pos = (int(state["start"]), carried, int(state["emitted"]))
            self._rows = fit_in_order(docs, packed, self._stats, pos)
        self._pos = pos  # where the next row starts; the state dict is built when asked

    def _make_state(self, pos) -> dict:
        state = {"version": _STATE_VERSION, "strategy": self._packed.strategy, "epoch": self._epoch}
        if self._packed.strategy == "concat":
            state["doc"], state["offset"] = pos
        else:
            start, carried, emitted = pos
            state.update(start=start, carried=[list(k) for k in carried], emitted=emitted)
        return state

    def __next__(self) -> dict:
        row, self._pos = next(self._rows)
        return row

    def state_dict(self) -> dict:
        """Where the next row starts: a dict of ints (and, for fit strategies, a list of at most
        ``seq_len`` ``[document, piece]`` pairs)."""
        return self._make_state(self._pos)
