"""A streaming ``datasets.IterableDataset`` read as blocks of rows, row for row what iterating it gives.

:func:`arrow_tables` walks the dataset's prepared examples iterable (``datasets``' own objects,
``_prepare_ex_iterable_for_iteration``: the epoch's shard order, its shuffle generators, its
``split_dataset_by_node`` split) and returns a function that yields blocks (``pyarrow.Table``,
or :class:`PyBlock` for what a batched ``map`` returned) whose rows, concatenated, are exactly
the rows ``iter(examples_iterable)`` gives (same rows, same order), or ``None`` when some node
needs rows (a ``map``/``filter`` of Python rows, a generator source, a node this module does
not know). Each node is read as its ``__iter__`` reads its child:

* Parquet/Arrow shards (``ArrowExamplesIterable``): its own ``_iter_arrow`` (the shard reader);
* ``FormattedExamplesIterable`` (feature types): when its child iterates Arrow, its
  ``__iter__`` formats the tables of its own ``_iter_arrow``: those, as they are (whatever is
  below, e.g. ``datasets``' Arrow shuffle); else the child's rows, typed per row as there;
* ``RebatchedArrowExamplesIterable``: the child's rows; ``select_columns``, ``skip``,
  ``take``, the node split (``StepExamplesIterable``): the same operation on blocks;
* ``shuffle(seed, buffer_size)`` (``BufferShuffledExamplesIterable.__iter__``): the node's
  generator, deep-copied, permutes blocks cut where the row-by-row buffer reshuffles (first
  ``buffer_size`` rows, then every ``buffer_size - buffer_size // 2``): each permutation has
  the row path's length, so the draws and the order are the same;
* ``interleave_datasets`` and the shard interleave (``CyclingMultiSourcesExamplesIterable``
  and its random subclass, ``InterleavedShardsExamplesIterable``): the node's own
  source-index iterator (same generator, same draws) and its stopping rule, replayed over
  row cursors, one ``take`` per output block;
* a batched ``map`` (:mod:`kuat.sources._hf_map`), also one written for Arrow (a
  table-formatted ``map``, fed its child's Arrow order).

Thread-safety: each call of the returned function builds its own iterators; the examples
iterable must be the caller's own copy (as :class:`kuat.sources.hf.HFIterableSource` makes).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np

from kuat.sources._hf_blocks import PyBlock, Tables, concat, take
from kuat.sources._hf_map import (
    formatted_blocks,
    mapped_blocks,
    python_format,
    table_format,
    table_mapped_blocks,
)

__all__ = ["arrow_tables", "batches_of", "position_share", "resumed_inside", "stateless"]

_CHUNK = 4096  # rows per output block of an interleave (one take each)


def resumed_inside(ds) -> bool:
    """Whether iterating ``ds`` (a ``datasets.IterableDataset`` at its epoch) starts from a
    state given to its ``load_state_dict``: ``datasets`` then loads it into its nodes at
    ``__iter__`` for the epoch it was saved in (only), which :func:`stateless` reads ignore."""
    start = getattr(ds, "_starting_state_dict", None)
    return bool(start) and ds.epoch == start.get("epoch")


def stateless(node) -> None:
    """Clear the resume state ``datasets`` keeps on ``node`` and every node below it (the
    caller's own copy): each iteration then starts at the beginning, as a fresh iterator
    does, however often a node is re-read (an interleave restarting an exhausted source)."""
    node._state_dict = None
    if hasattr(node, "_interleaved"):
        node._interleaved = None
    for child in getattr(node, "ex_iterables", None) or (
            [node.ex_iterable] if hasattr(node, "ex_iterable") else []):
        stateless(child)


def arrow_tables(node) -> Tables | None:
    """``() -> iterator of blocks`` giving the rows ``iter(node)`` gives, in order, or
    ``None``. Call :func:`stateless` on ``node`` first (a prepared examples iterable tracks
    its progress)."""
    if type(node).__module__ != "datasets.iterable_dataset":
        return None
    name = type(node).__name__
    if name == "ArrowExamplesIterable":
        return lambda: (t for _key, t in node._iter_arrow() if len(t))
    if name == "FormattedExamplesIterable":
        if not python_format(node.formatting):
            return None  # a tensor format: rows are not Python values
        if node.ex_iterable.iter_arrow:  # its __iter__ formats its own Arrow tables
            child = arrow_tables(node.ex_iterable) if _arrow_order_is_row_order(node) else None
            if child is None:  # datasets' own Arrow iteration (e.g. its chunked shuffle)
                return lambda: (t for _key, t in node._iter_arrow() if len(t))
            return lambda: _formatted_arrow(node, child)
        child = arrow_tables(node.ex_iterable)
        return None if child is None else formatted_blocks(node, child)
    if name == "MappedExamplesIterable":
        if table_format(node.formatting):  # a function written for Arrow
            return table_mapped_blocks(node, _arrow_input(node.ex_iterable))
        child = arrow_tables(node.ex_iterable)
        return None if child is None else mapped_blocks(node, child)
    if name == "InterleavedShardsExamplesIterable":
        return arrow_tables(node._interleave_shards())
    if name in _ROW_NODES:
        child = arrow_tables(node.ex_iterable)
        return None if child is None else (lambda: _ROW_NODES[name](node, child))
    if name in ("CyclingMultiSourcesExamplesIterable", "RandomlyCyclingMultiSourcesExamplesIterable"):
        children = [arrow_tables(c) for c in node.ex_iterables]
        if any(c is None for c in children):
            return None
        return lambda: _interleave(node, children)
    return None


def _arrow_input(rebatched) -> Tables | None:
    """Blocks whose rows are ``rebatched.ex_iterable.iter_arrow()``'s, in that order (what a
    ``RebatchedArrowExamplesIterable`` re-cuts for a table-formatted ``map``): read as
    :func:`arrow_tables` reads them where that is the same order, else with ``datasets``' own
    Arrow iteration (e.g. its chunked buffer shuffle); None where ``datasets`` converts Python
    rows to Arrow there (no Arrow below) or for another node."""
    if type(rebatched).__name__ != "RebatchedArrowExamplesIterable":
        return None
    below = rebatched.ex_iterable
    if not below.iter_arrow:
        return None
    if _arrow_order_is_row_order(below):
        tables = arrow_tables(below)
        if tables is not None:
            return tables
    return lambda: (t for _key, t in below._iter_arrow() if len(t))


def _arrow_order_is_row_order(node) -> bool:
    """Whether ``node.iter_arrow()`` gives its rows in ``iter(node)``'s order: not below a
    buffer shuffle (it permutes Arrow chunks as they come) nor a cycle of sources that are not
    re-cut into one-row tables (``interleave_datasets`` re-cuts them: then it cycles rows). A
    table-formatted ``map`` iterates rows as the tables of its ``_iter_arrow``, whatever is
    below it."""
    name = type(node).__name__
    if name == "MappedExamplesIterable" and table_format(node.formatting):
        return True
    if name in ("BufferShuffledExamplesIterable", "InterleavedShardsExamplesIterable"):
        return False
    kids = getattr(node, "ex_iterables", None)
    if kids is not None:
        return all(type(k).__name__ == "RebatchedArrowExamplesIterable" and k.batch_size == 1
                   and _arrow_order_is_row_order(k) for k in kids)
    return not hasattr(node, "ex_iterable") or _arrow_order_is_row_order(node.ex_iterable)


class _Feed:
    """A stand-in child examples iterable whose ``_iter_arrow`` yields given tables."""

    def __init__(self, tables: Iterator):
        self._tables = tables

    def _iter_arrow(self):
        for t in self._tables:
            yield None, t


def _formatted_arrow(node, child: Tables) -> Iterator:
    """``FormattedExamplesIterable._iter_arrow`` (missing columns, cast to its features)
    over our blocks of its child's rows, in row order (all Arrow: its child iterates Arrow,
    so no Python ``map`` is below it)."""
    clone = copy.copy(node)
    clone.ex_iterable = _Feed(child())
    for _key, t in clone._iter_arrow():
        if len(t):
            yield t


def _recut(blocks: Iterator, first: int, then: int) -> Iterator:
    """The rows of ``blocks`` in blocks of ``first`` rows, then ``then`` rows each (the last
    one shorter)."""
    pending: list = []
    have = 0
    want = first
    for t in blocks:
        pending.append(t)
        have += len(t)
        while have >= want:
            whole = concat(pending)
            yield whole.slice(0, want)
            rest = whole.slice(want)
            pending, have, want = ([rest] if len(rest) else []), len(rest), then
    if have:
        yield concat(pending)


def _shuffle(node, child: Tables) -> Iterator:
    """``BufferShuffledExamplesIterable``'s rows: its generator (deep-copied, as both of its
    iterators do) permutes the buffer each time the row-by-row ``__iter__`` would, on the
    same number of rows: fed ``buffer_size`` rows first, then ``buffer_size - buffer_size //
    2`` at a time, its ``_iter_arrow`` arithmetic gives exactly ``__iter__``'s order."""
    size = int(node.buffer_size)
    keep = size // 2
    rng = copy.deepcopy(node.generator)
    buffer = None
    for block in _recut(child(), size, size - keep):
        buffer = block if buffer is None else concat([buffer, block])
        if len(buffer) >= size:
            shuffled = take(buffer, rng.permutation(len(buffer)))
            yield shuffled.slice(0, len(buffer) - keep)
            buffer = shuffled.slice(len(buffer) - keep)
    if buffer is not None and len(buffer):
        yield take(buffer, rng.permutation(len(buffer)))


def _step(node, child: Tables) -> Iterator:
    """``StepExamplesIterable``'s rows (``split_dataset_by_node`` by position): rows
    ``offset, offset + step, ...``."""
    n = 0
    for block in child():
        idx = np.arange((node.offset - n) % node.step, len(block), node.step)
        n += len(block)
        if len(idx):
            yield take(block, idx)


def _skip(node, child: Tables) -> Iterator:
    """``SkipExamplesIterable``'s rows: all but the first ``n``."""
    left = int(node.n)
    for block in child():
        if left >= len(block):
            left -= len(block)
            continue
        yield block.slice(left) if left else block
        left = 0


def _take_first(node, child: Tables) -> Iterator:
    """``TakeExamplesIterable``'s rows: the first ``n``."""
    left = int(node.n)
    for block in child():
        if left <= 0:
            return
        yield block if len(block) <= left else block.slice(0, left)
        left -= len(block)


def _select(node, child: Tables) -> Iterator:
    """``SelectColumnsIterable``'s rows: its columns, in its order."""
    names = list(node.column_names)
    for block in child():
        if isinstance(block, PyBlock):
            yield PyBlock({c: block.columns[c] for c in names}, block.n)
        else:
            yield block.select(names)


def _rebatched(node, child: Tables) -> Iterator:
    """``RebatchedArrowExamplesIterable.__iter__``: its child's rows, as they are."""
    return child()


_ROW_NODES = {  # one-child nodes: (node, child) -> the blocks of node's __iter__ rows
    "RebatchedArrowExamplesIterable": _rebatched,
    "BufferShuffledExamplesIterable": lambda node, child: _shuffle(node, child),
    "StepExamplesIterable": _step,
    "SkipExamplesIterable": _skip,
    "TakeExamplesIterable": _take_first,
    "SelectColumnsIterable": _select,
}


class _Cursor:
    """Rows of one source, one at a time, with one table of look-ahead."""

    def __init__(self, tables: Tables):
        self._it = tables()
        self.table = None
        self.pos = 0

    def has_row(self) -> bool:
        while self.table is None or self.pos >= len(self.table):
            nxt = next(self._it, None)
            if nxt is None:
                return False
            self.table, self.pos = nxt, 0
        return True


def _interleave(node, children: list[Tables]) -> Iterator:
    """``node``'s rows (``datasets``' ``CyclingMultiSourcesExamplesIterable.__iter__``, which
    yields one example of source ``i`` per index its ``_get_indices_iterator`` gives, with the
    same stopping rule), gathered into blocks of up to ``_CHUNK`` rows."""
    strategy = node.stopping_strategy
    without = strategy == "all_exhausted_without_replacement"
    stop = np.all if strategy in ("all_exhausted", "all_exhausted_without_replacement") else np.any
    cursors = [_Cursor(c) for c in children]
    exhausted = np.full(len(children), False)
    tables: dict[int, tuple[int, object]] = {}  # id(block) -> (base row, block) of this chunk
    order: list = []
    rows: list[int] = []
    base = 0

    def flush():
        return take(concat(_same_columns([t for _b, t in order])), rows)

    for i in node._get_indices_iterator():
        if stop(exhausted):
            break
        if exhausted[i] and without:
            continue
        cur = cursors[i]
        if cur.has_row():
            t = cur.table
            entry = tables.get(id(t))
            if entry is None:
                entry = tables[id(t)] = (base, t)
                order.append(entry)
                base += len(t)
            rows.append(entry[0] + cur.pos)
            cur.pos += 1
        if not cur.has_row():  # the row just taken was its last: exhausted (datasets' rule)
            exhausted[i] = True
            if not without:
                cursors[i] = _Cursor(children[i])
        if len(rows) >= _CHUNK:
            yield flush()
            keep = {id(c.table): c.table for c in cursors if c.table is not None}
            tables, order, rows, base = {}, [], [], 0
            for t in keep.values():  # a block still being read starts the next chunk
                tables[id(t)] = (base, t)
                order.append(tables[id(t)])
                base += len(t)
    if rows:
        yield flush()


def _same_columns(blocks: list) -> list:
    """Arrow blocks of interleaved sources with different columns, each given the others'
    (null, of the type they have there): ``interleave_datasets`` gives the stream the union of
    its sources' features, and the formatting node above adds a row's missing columns as
    ``None`` and casts to those features, so the rows are the same."""
    import pyarrow as pa

    names = [list(b.columns) if isinstance(b, PyBlock) else b.column_names for b in blocks]
    if len({tuple(n) for n in names}) < 2:
        return blocks
    if any(isinstance(b, PyBlock) for b in blocks):  # Python values: missing ones are None
        union = list(dict.fromkeys(k for n in names for k in n))
        py = [b if isinstance(b, PyBlock) else PyBlock(b.to_pydict(), b.num_rows) for b in blocks]
        return [PyBlock({k: b.columns.get(k, [None] * b.n) for k in union}, b.n) for b in py]
    fields: dict = {}
    for b in blocks:
        for f in b.schema:
            fields.setdefault(f.name, f.type)
    out = []
    for b in blocks:
        for name in fields:
            if name not in b.column_names:
                b = b.append_column(name, pa.nulls(len(b), fields[name]))
        out.append(b.select(list(fields)))
    return out


def position_share(tables: Iterator, rank: int, world_size: int, drop_last: bool) -> Iterator:
    """Rows at positions ``rank, rank + world_size, ...`` of ``tables``, padded by wrapping
    around or truncated exactly as :func:`kuat.sources.stream.rank_share` does on rows."""
    head = None  # the stream's first world_size rows (padding)
    n = 0
    held, held_pos = None, 0  # with drop_last: this rank's row of a round not yet complete
    for t in tables:
        if head is None or len(head) < world_size:
            part = t.slice(0, world_size - (0 if head is None else len(head)))
            head = part if head is None else concat([head, part])
        first = (rank - n) % world_size  # (n + first) % world_size == rank
        idx = np.arange(first, len(t), world_size)  # (k,)
        end = n + len(t)
        if drop_last:  # only this rank's row of the last, maybe incomplete, round waits
            rows = take(t, idx)
            last = n + int(idx[-1]) if len(idx) else held_pos
            if held is not None:
                rows = concat([held, rows])
            complete = (end // world_size) * world_size  # rows of whole rounds seen
            waits = len(rows) > 0 and (last // world_size + 1) * world_size > complete
            ready = len(rows) - int(waits)
            if ready:
                yield rows.slice(0, ready)
            held, held_pos = (rows.slice(ready), last) if waits else (None, 0)
        elif len(idx):
            yield take(t, idx)
        n = end
    if drop_last or n == 0 or n % world_size == 0:
        return
    total = -(-n // world_size) * world_size
    pad = [(p - n) % len(head) for p in range(n, total) if p % world_size == rank]
    if pad:
        yield take(head, pad)


def batches_of(tables: Iterator, batch_size: int, drop_last: bool, worker: int = 0,
               num_workers: int = 1) -> Iterator:
    """Batches ``worker, worker + num_workers, ...`` of ``batch_size`` consecutive rows of
    ``tables`` (each a ``pyarrow.Table``); the last one shorter unless ``drop_last``. The other
    workers' rows are skipped without being read out of Arrow."""
    pending: list = []
    have = 0
    q = 0  # index of the batch being filled
    for t in tables:
        start = 0
        while start < len(t):
            take = min(batch_size - have, len(t) - start)
            if q % num_workers == worker:
                pending.append(t.slice(start, take))
            have += take
            start += take
            if have == batch_size:
                if pending:
                    yield concat(pending)
                pending, have, q = [], 0, q + 1
    if have and not drop_last and pending:
        yield concat(pending)
