"""Who packs what: with the documents' lengths, every consumer plans the same rows and builds
only its own.

A consumer is one rank's one loader worker. With the lengths of an epoch's documents (a kuat
dataset, or ``pack(lengths=)``) every consumer computes the same *plan* from the lengths alone
and reads and builds only its own rows:

* :class:`Share`: which row positions of the epoch are one consumer's (ranks take rows
  ``rank, rank + world_size, ...``, a rank's workers take whole batches in turn), and the rows
  of an unsplit stream it keeps (the path without lengths).
* :func:`plan_rows`: the consumer's rows of an epoch: ``concat`` rows are token ranges found
  by arithmetic (:class:`~kuat.text.pack._strategies.ConcatSplit`); the fit strategies run the
  bin choice over every buffer's lengths (:func:`fit_plan`, no tokens read).
* :class:`SharedPlan`: the fit plan computed once per process: the thread workers of one loader
  read one plan, each buffer's bin choice made by the first worker to need it.
* assembly (``_assemble``): the documents of the planned pieces read by ordinal, checked
  against the lengths planned, and built into rows (``_rows.py``).

``packed`` below is the :class:`~kuat.text.Packed` being iterated, read for its settings only
(``seq_len``, ``strategy``, ``buffer_size``, ...); the pass's counters (``stats``) and the holder
of the plan its shallow copies share (``plans``) are passed in.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import numpy as np
import torch

from kuat.sources.stream import rank_share, rest_after
from kuat.text._docs import Block, Documents
from kuat.text.pack._inorder import Buffer, fit_buffers
from kuat.text.pack._rows import Items, gather_rows
from kuat.text.pack._stats import PackStats
from kuat.text.pack._strategies import ConcatSplit

__all__ = ["START", "Share", "SharedPlan", "epoch_lengths", "fit_plan", "plan_rows"]

START = (0, 0, ())  # the fit plan's checkpoint at the start of an epoch
_PLAN_CHUNK = 16  # concat rows built per read: one gather serves several batches
_EMPTY = np.empty(0, np.int64)


class Share:
    """Which rows of an epoch one consumer (a rank's worker) yields, and from which batch on.

    Ranks take rows ``rank, rank + world_size, ...`` (``rank_share``); workers take whole
    batches of the rank's rows, batch ``start + j`` going to worker ``j % workers``
    (``worker_share``, shifted by the ``start`` batches already served). ``offset`` (elastic
    resume): the epoch's first ``offset`` rows were consumed under another layout, and the
    shares are those of the rest, rows ``offset + rank, offset + rank + world_size, ...``,
    padded (or truncated) as a whole epoch is."""

    __slots__ = ("rank", "world", "batch", "worker", "workers", "drop_last", "start", "offset")

    def __init__(self, rank, world, batch, worker, workers, drop_last, start, offset=0):
        self.rank, self.world, self.batch = rank, world, batch
        self.worker, self.workers = worker, workers
        self.drop_last, self.start, self.offset = drop_last, start, offset

    def mine(self, positions: np.ndarray) -> np.ndarray:
        """``(R,) bool``: which global row positions (padding positions included) are ours."""
        q = positions - self.offset  # (R,) position in the rest of the epoch
        k = q // self.world // self.batch - self.start  # (R,) batch, from the start
        return ((q >= 0) & (q % self.world == self.rank) & (k >= 0)
                & (k % self.workers == self.worker))

    def takes_all(self) -> bool:
        """Whether this consumer yields every row of the epoch, from the first."""
        return self.world == 1 and self.workers == 1 and self.start == 0 and self.offset == 0

    def served(self, n: int) -> int:
        """Positions an epoch of ``n`` rows has across ranks (padded or truncated)."""
        left = max(0, n - self.offset)
        if self.drop_last:
            return self.offset + left // self.world * self.world
        return self.offset + -(-left // self.world) * self.world

    def filter(self, rows: Iterator[dict]) -> Iterator[dict]:
        """Our rows of the unsplit ``rows`` (what the stream path reads whole)."""
        head = None
        if self.offset:  # the rest, padded with the epoch's first rows
            head = []
            rows = rest_after(rows, self.offset, self.world, head)
        if self.world > 1:
            rows = rank_share(rows, self.rank, self.world, self.drop_last, head)
        for q, row in enumerate(rows):
            k = q // self.batch - self.start
            if k >= 0 and k % self.workers == self.worker:
                yield row


def epoch_lengths(packed, epoch: int, lengths: np.ndarray) -> tuple[Documents, np.ndarray]:
    """The epoch's documents and ``(N,) int64`` lengths by ordinal (``lengths`` by index)."""
    docs = Documents(packed.source, packed.field, epoch, packed.shuffle, packed.seed)
    if len(lengths) != len(docs.order):
        raise ValueError(
            f"pack(lengths=...) has {len(lengths)} lengths, the source {len(docs.order)} documents"
        )
    return docs, lengths[docs.order]


def plan_rows(
    packed, docs: Documents, lens: np.ndarray, stats: PackStats, share: Share, at, plans: dict
) -> Iterator[dict]:
    """Our rows of the epoch of ``docs``, planned from their lengths ``lens`` ``(N,)`` (by
    ordinal, :func:`epoch_lengths`): the choice of rows costs the lengths only; tokens are read
    for our rows only, counted in ``stats``. ``at``: the fit plan's checkpoint to start from
    (``(first row, first document, carried keys)`` of a buffer); ``plans``: the holder of the
    fit plan this process's consumers share (see :func:`_shared_plan`)."""
    if packed.strategy == "concat":
        return _concat_planned(docs, lens, packed, stats, share)
    return _fit_planned(docs, lens, packed, stats, share, at, plans)


def fit_plan(lens: np.ndarray, packed, stats: PackStats, at) -> Iterator:
    """``(first row, Buffer)`` of each buffer of an epoch's fit plan (lengths only), from the
    checkpoint ``at = (first row, first document, carried keys)`` of a buffer."""
    first, start, keys = at
    size, length, n = packed.buffer_size, packed.seq_len, len(lens)
    blocks = (
        Block(lo, lens[lo : lo + size], _EMPTY, _EMPTY)
        for lo in range(start, n + 1, size)
        if lo < n or (n - start) % size == 0  # (as Documents.blocks: a last, empty block)
    )
    ords = np.array([o for o, _ in keys], np.int64)
    pieces = np.array([p for _, p in keys], np.int64)
    sizes = np.minimum(length, lens[ords] - pieces * length)  # (c,) as Items.cut cuts them
    carried = Items(ords, pieces, np.zeros_like(ords), sizes, _EMPTY, _EMPTY)
    for buf in fit_buffers(blocks, packed, stats, carried, False):
        yield first, buf
        first += len(buf.bins)


def _shared_plan(packed, plans: dict, epoch: int, lens: np.ndarray, at) -> SharedPlan:
    """The fit plan of ``epoch`` (lengths ``lens`` by ordinal) from ``at`` that this consumer
    reads: the one the other thread workers of its loader read (they iterate shallow copies of
    one :class:`Packed`, which share its holder ``plans``: ``{"lock", "key", "plan"}``), or a
    new one."""
    info = torch.utils.data.get_worker_info()
    threads = info is not None and getattr(info, "worker_method", None) == "thread"
    readers = info.num_workers if threads else 1
    holder = plans
    key = (epoch, at, readers)
    with holder["lock"]:
        plan = holder["plan"]
        if holder["key"] != key or plan.full():  # (full: a new pass over the same epoch)
            plan = SharedPlan(lambda stats: fit_plan(lens, packed, stats, at), readers)
            holder["key"], holder["plan"] = key, plan
        return plan


class SharedPlan:
    """One pass's fit plan, computed once for the ``readers`` consumers of one process (a
    loader's thread workers), each of which reads every buffer of it: a buffer is planned when
    the first reader needs it (under a lock: the others wait rather than plan it again) and
    dropped once all ``readers`` have joined and passed it, so memory holds the buffers between
    the slowest and the fastest reader. A reader that joins after buffers were dropped (one
    more than expected) plans alone. Each reader's stats count the whole plan, as a plan of its
    own would. Thread-safe."""

    def __init__(self, make, readers: int):
        self._make = make  # stats -> iterator of (first row, Buffer)
        self._readers = readers
        self._lock = threading.Lock()
        self._stats = PackStats()  # what planning the buffers counted, per buffer below
        self._plan = None
        self._buffers: list[tuple] = []  # (first, buf, counts) of buffers base, base + 1, ...
        self._base = 0
        self._done = False
        self._joined = 0
        self._at: dict[int, int] = {}  # reader -> the next buffer it reads

    def full(self) -> bool:
        with self._lock:
            return self._joined >= self._readers

    def read(self, stats: PackStats) -> Iterator:
        """``(first row, Buffer)`` of every buffer in order, each buffer's counts added to
        ``stats``."""
        with self._lock:
            alone = self._base > 0
            me = self._joined
            self._joined += 1
            if not alone:
                self._at[me] = 0
        if alone:
            yield from self._make(stats)
            return
        try:
            i = 0
            while True:
                with self._lock:
                    while i - self._base == len(self._buffers) and not self._done:
                        self._plan_next()
                    if i - self._base == len(self._buffers):
                        return
                    first, buf, counts = self._buffers[i - self._base]
                    self._at[me] = i = i + 1
                    self._drop()
                for name, n in counts:
                    setattr(stats, name, getattr(stats, name) + n)
                yield first, buf
        finally:
            with self._lock:
                del self._at[me]
                self._drop()

    def _plan_next(self) -> None:  # (under the lock)
        if self._plan is None:
            self._plan = self._make(self._stats)
        names = PackStats.COUNTS
        before = [getattr(self._stats, k) for k in names]
        try:
            first, buf = next(self._plan)
        except StopIteration:
            self._done = True
            return
        after = [getattr(self._stats, k) for k in names]
        counts = [(k, b - a) for k, a, b in zip(names, before, after) if b != a]
        self._buffers.append((first, buf, counts))

    def _drop(self) -> None:  # (under the lock) buffers every reader has passed
        if self._joined < self._readers:
            return
        passed = min(self._at.values(), default=self._base + len(self._buffers))
        if passed > self._base:
            del self._buffers[: passed - self._base]
            self._base = passed


def _concat_planned(docs, lens, packed, stats, share) -> Iterator[dict]:
    """Concat-split rows are token ranges ``[p L, (p + 1) L)`` of the epoch: ours are found by
    arithmetic (:class:`~kuat.text.pack._strategies.ConcatSplit`)."""
    length = packed.seq_len
    split = ConcatSplit(lens, length)
    total, n = split.total, split.rows
    stats.documents, stats.tokens, stats.rows = len(lens), total, n
    stats.pad_tokens = n * length - total
    if not n:
        return
    positions = np.arange(share.offset + share.rank, share.served(n), share.world)  # (Q,) ours
    positions = positions[share.mine(positions)]
    rows = np.where(positions < n, positions, (positions - n) % n)  # (Q,) wrap-around padding
    for lo in range(0, len(rows), _PLAN_CHUNK):
        seg_row, seg_ord, seg_off, seg_len, fills = split.pieces(rows[lo : lo + _PLAN_CHUNK])
        yield from _assemble(
            docs, lens, stats, seg_row, seg_ord, seg_off, seg_len, fills, length, packed.pad_id
        )


def _fit_planned(docs, lens, packed, stats, share, at, plans) -> Iterator[dict]:
    """Fit rows: every consumer runs the bin choice over the lengths (no tokens read) from
    ``at`` (a buffer's checkpoint, ``None``: the start), then reads and builds only its rows.
    With ``drop_last``, a row is yielded once its round of ``world_size`` rows is known to be
    complete."""
    world = share.world
    pending: list = []  # our rows whose round may still be incomplete (drop_last)
    planned = 0
    for first, buf in _shared_plan(packed, plans, docs.epoch, lens, at or START).read(stats):
        planned = first + len(buf.bins)
        positions = first + np.arange(len(buf.bins))  # (R,)
        sel = np.flatnonzero(share.mine(positions))
        if len(sel):
            rows = _fit_assemble(docs, lens, stats, buf, sel.tolist(), packed)
            pending.extend(zip(positions[sel].tolist(), rows))
        complete = (share.offset + max(0, planned - share.offset) // world * world
                    if share.drop_last else planned)
        ready = 0
        while ready < len(pending) and pending[ready][0] < complete:
            ready += 1
        for _, row in pending[:ready]:
            yield row
        del pending[:ready]
    n = planned
    if share.drop_last or not n or share.served(n) <= n:
        return
    wrap = np.arange(n, share.served(n))  # padding positions: rows 0, 1, ... again
    wrap = wrap[share.mine(wrap)]
    if not len(wrap):
        return
    want = ((wrap - n) % n).tolist()
    got: dict[int, dict] = {}
    again = PackStats(packed.seq_len)  # (not counted twice)
    for first, buf in fit_plan(lens, packed, again, START):  # rows < world_size again
        sel = [r - first for r in want if first <= r < first + len(buf.bins)]
        if sel:
            rows = _fit_assemble(docs, lens, stats, buf, sel, packed)
            got.update(zip((first + s for s in sel), rows))
        if first + len(buf.bins) > max(want):
            break
    for r in want:
        yield got[r]


def _fit_assemble(docs, lens, stats, buf: Buffer, sel: list[int], packed) -> list[dict]:
    """Rows ``sel`` (positions in ``buf.bins``) of one buffer, read and built."""
    length, items = packed.seq_len, buf.items
    bins = [buf.bins[i] for i in sel]
    counts = np.fromiter(map(len, bins), np.int64, len(bins))  # (R,)
    order = np.fromiter(itertools.chain.from_iterable(bins), np.int64, int(counts.sum()))
    return _assemble(
        docs,
        lens,
        stats,
        np.repeat(np.arange(len(bins)), counts),  # (S,) the row of each piece
        items.ord[order],
        items.piece[order] * length,
        items.size[order],
        np.asarray([buf.fills[i] for i in sel], np.int64),
        length,
        packed.pad_id,
    )


def _assemble(docs, lens, stats, seg_row, seg_ord, seg_off, seg_len, fills, length, pad_id):
    """Read the documents of the planned pieces and build their rows (see
    :func:`gather_rows`): a list of row dicts.

    Pieces ``(S,)``, sorted by row and column: in row ``seg_row``, tokens
    ``seg_off .. seg_off + seg_len`` of document ``seg_ord``; ``fills (R,)``: tokens per row.

    Raises:
        ValueError: a document read has another length than the plan's (names it).
    """
    wanted, inverse = np.unique(seg_ord, return_inverse=True)  # (K,) documents, (S,) which
    block = docs.fetch_ordinals(wanted)
    stats.read_documents += len(wanted)
    stats.read_tokens += int(block.lengths.sum())
    bad = np.flatnonzero(block.lengths != lens[wanted])
    if len(bad):
        o = int(wanted[bad[0]])
        raise ValueError(
            f"document {o} (source index {int(docs.order[o])}) has {int(block.lengths[bad[0]])} "
            f"tokens, but the packing plan was made for {int(lens[o])} (pack(lengths=) or the "
            "dataset's length column disagrees with its documents)"
        )
    return gather_rows(
        block.ids,
        block.labels,
        block.starts[inverse] + seg_off,  # (S,) where each piece starts in the block
        seg_len,
        seg_row,
        fills,
        length,
        pad_id,
    )
