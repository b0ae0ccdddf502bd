"""A streamed Hugging Face dataset split by position *before* the per-row work.

:class:`kuat.sources.hf.HFIterableSource` with ``split="position"`` gives each rank and worker
its share of the epoch's stream (:mod:`kuat.sources.stream`). Read naively, every worker reads
the whole stream, turns every row into a Python dict and runs every ``map`` on it, then keeps
one row in ``num_workers``: with process workers the per-row Python of the unkept rows is paid
``num_workers`` times. Here the dataset's prepared examples iterable (``datasets``' own chain
of nodes, ``_prepare_ex_iterable_for_iteration``) is cut in two:

* the **tail**: the outermost nodes whose rows are, one for one, functions of their child's
  rows, read row by row: a ``map`` with ``batched=False`` (no ``with_indices``, not
  ``async``, not in a table format: ``rename_columns``, ``remove_columns`` and a user's
  per-row function are such maps), ``select_columns`` read as rows, a
  ``FormattedExamplesIterable`` over rows (features, ``with_format``) and the re-batching
  node over rows. Below the tail the number of rows and their order are fixed, so the share
  can be taken there. Nodes that keep rows by position (``split_dataset_by_node``'s node
  split, ``skip``, ``take``) above such nodes are moved under them, which changes nothing;
* the **prefix**: everything below (the shards, shuffles, interleaves, ``filter``, batched
  ``map``, ``take``/``skip``, ``split_dataset_by_node``...).

The share is taken on the prefix's rows, and only kept rows go through the tail: the tail's
nodes are shallow copies of ``datasets``' own, reading a feed of kept rows instead of their
child, so each kept sample is made by ``datasets``' own code. The prefix is read as blocks
the columnar path's way (:func:`kuat.sources._hf_arrow.arrow_tables`, the same code) when it
can be and decodes nothing (no ``Image``/``Audio``... feature below the tail, except in the
formatting node at the prefix's top, which then decodes the kept rows only): Arrow tables
from the shards, through shuffles, interleaves, ``take``/``skip`` and the node split, and a
``map(batched=True)`` applied by :mod:`kuat.sources._hf_map` (the function gets exactly the
dict of lists ``datasets`` gives it, once per batch; its output stays Python values column
by column, a :class:`kuat.sources._hf_blocks.PyBlock`). The share is then a slice of each
block, and rows of other workers never become Python dicts. A batched map may change the
number of rows and its output may depend on the whole batch, so its function runs on every
batch of the stream in every worker; only ``datasets``' per-row Python (rows to dicts to
batches to rows) is saved for the rows other workers keep. A prefix that cannot be read as
blocks (a ``filter``, a per-row map under a batched one, an async function, a table format)
is iterated row by row and only the tail is skipped. With neither (no tail, no Arrow prefix: a ``map`` then a ``filter``, a buffer
shuffle over a ``map``, a generator source) nothing is saved: :func:`owned_examples` returns
``None`` and the caller iterates the whole stream as before.

The rule that makes this exact: a per-row ``map`` function's output for a row depends on that
row only. ``datasets`` assumes it too (its own split across torch workers and nodes never calls
the function on another worker's rows), and so does torch's DataLoader reading the dataset. A
function with per-call state (a counter, an unseeded random draw) sees only this worker's rows,
in order, as it would in a torch worker; with 0 workers and one rank every row is kept, as
before.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

__all__ = ["owned_examples"]


def _row_node(node) -> bool:
    """Whether ``node``'s ``__iter__`` yields one row per row of ``iter(node.ex_iterable)``,
    a function of that row alone, reading its child row by row."""
    if type(node).__module__ != "datasets.iterable_dataset":
        return False
    name = type(node).__name__
    if name == "MappedExamplesIterable":  # exactly: FilteredExamplesIterable subclasses it
        import inspect

        table = node.formatting is not None and node.formatting.is_table
        return not (node.batched or node.with_indices or table
                    or inspect.iscoroutinefunction(node.function))
    if name == "FormattedExamplesIterable":
        return node.ex_iterable.iter_arrow is None  # else it formats its own Arrow tables
    return name in ("SelectColumnsIterable", "RebatchedArrowExamplesIterable")


def _plain_below(node) -> bool:
    """Whether no node under (and including) ``node`` decodes values (then the Python rows
    of its Arrow blocks are their values' ``as_py()``) or formats them otherwise."""
    from kuat.sources import hf_columnar

    if type(node).__name__ == "FormattedExamplesIterable":
        fmt = node.formatting
        if fmt is not None and fmt.format_type not in (None, "python"):
            return False
        if not hf_columnar.plain_features(node.features):
            return False
    kids = getattr(node, "ex_iterables", None) or (
        [node.ex_iterable] if hasattr(node, "ex_iterable") else [])
    return all(_plain_below(k) for k in kids)


_POSITION_NODES = ("StepExamplesIterable", "SkipExamplesIterable", "TakeExamplesIterable")


def _cut(ex) -> tuple[list, object]:
    """``(tail, prefix)`` of the examples iterable ``ex``: the tail's row nodes from the top
    down, and the node under them. Nodes that keep rows by position only (the node split of
    ``split_dataset_by_node``, ``skip``, ``take``) met among the tail's nodes are moved under
    them (copies, in the same order, over the prefix): keeping rows by position, then mapping
    each kept row, is mapping every row, then keeping by position (the tail maps each row by
    itself)."""
    tail, moved, node = [], [], ex
    while _row_node(node) or type(node).__name__ in _POSITION_NODES:
        (tail if _row_node(node) else moved).append(node)
        node = node.ex_iterable
    if not tail:
        return [], ex  # nothing to move under
    for pos in reversed(moved):
        clone = copy.copy(pos)
        clone._state_dict = None
        clone.ex_iterable = node
        node = clone
    return tail, node


class _Feed:
    """Stands for the prefix under the tail's lowest node: yields the kept ``(key, row)``
    pairs and answers what that node asks of its child."""

    iter_arrow = None  # the tail reads rows (_row_node)

    def __init__(self, pairs: Iterator, is_typed: bool, features):
        self._pairs = pairs
        self.is_typed = is_typed
        self.features = features
        self._state_dict = None

    def __iter__(self):
        return self._pairs


def _tail_over(tail: list, pairs: Iterator, prefix) -> Iterator:
    """``iter(tail[0])`` with ``pairs`` in place of ``iter(prefix)``: copies of the tail's
    nodes (their resume state cleared), each reading the next one."""
    child = _Feed(pairs, prefix.is_typed, getattr(prefix, "features", None))
    for node in reversed(tail):
        clone = copy.copy(node)
        clone._state_dict = None
        clone.ex_iterable = child
        child = clone
    return iter(child)


def _row_maker(node):
    """``block -> list of rows``: the prefix ``node``'s rows of one of its Arrow blocks
    (:func:`kuat.sources._hf_arrow.arrow_tables`) as its ``__iter__`` gives them, or None.

    Values decode to themselves when nothing below decodes (``_plain_below``): the rows are
    the Arrow values' ``as_py()``. A ``FormattedExamplesIterable`` over Arrow whose features
    decode (``Image``, ``Audio``...) formats its cast tables with ``datasets``' Python formatter,
    value by value: the same formatter on the kept rows' tables gives those rows, so other
    workers' images are not decoded either."""
    from kuat.sources._hf_blocks import PyBlock

    if _plain_below(node):
        return lambda block: block.rows() if isinstance(block, PyBlock) else block.to_pylist()
    fmt = getattr(node, "formatting", None)
    if (type(node).__name__ != "FormattedExamplesIterable" or node.ex_iterable.iter_arrow is None
            or (fmt is not None and fmt.format_type not in (None, "python"))
            or not _plain_below(node.ex_iterable)):
        return None
    from datasets.formatting import PythonFormatter
    from datasets.iterable_dataset import _batch_to_examples

    formatter = PythonFormatter(  # FormattedExamplesIterable.__iter__'s own
        features=node._features if not node.ex_iterable.is_typed else None,
        token_per_repo_id=node.token_per_repo_id)
    return lambda table: list(_batch_to_examples(formatter.format_batch(table)))


def _arrow_rows(blocks: Iterator, rows_of) -> Iterator:
    """``(key, row)`` pairs of the rows of ``blocks``, in order (``rows_of``: _row_maker)."""
    for block in blocks:
        for row in rows_of(block):
            yield None, row  # the tail passes keys through; samples() drops them


def owned_examples(stream, ds) -> Iterator | None:
    """This rank's and worker's examples of ``ds`` (the caller's own copy, at the epoch),
    exactly ``stream._share(stream.samples(epoch))``, with the tail applied to kept rows only
    (see the module docstring), or ``None`` when that would save nothing or cannot be exact
    (the caller then reads the whole stream).

    ``stream`` is the :class:`kuat.sources.hf.HFIterableSource` giving the split (rank, world
    size, batching, elastic start, ``torch.utils.data.get_worker_info()``)."""
    import torch

    from kuat.sources import _hf_arrow

    if _hf_arrow.resumed_inside(ds):
        return None  # datasets resumes inside its nodes: leave that to its own iteration
    ex = ds._prepare_ex_iterable_for_iteration()
    if ds._formatting and (ex.iter_arrow or ds._formatting.is_table):
        return None  # samples() reads this one as Arrow tables formatted row by row
    _hf_arrow.stateless(ex)
    tail, node = _cut(ex)
    rank, world_size = stream._rank_and_world()
    info = torch.utils.data.get_worker_info()
    workers = 1 if info is None else info.num_workers
    start = getattr(stream, "_start", None)
    resumed = start is not None and start[0] == stream._epoch
    if world_size == 1 and workers == 1 and not resumed:
        return None  # every row is kept: nothing to skip
    blocks = rows_of = None
    if not resumed:
        rows_of = _row_maker(node)
        blocks = None if rows_of is None else _hf_arrow.arrow_tables(node)
    if blocks is not None:
        tables = blocks()
        if world_size > 1:
            tables = _hf_arrow.position_share(tables, rank, world_size, stream._drop_last)
        if workers > 1:
            tables = _hf_arrow.batches_of(tables, stream._batch_size or 1, False, info.id,
                                          workers)
        pairs = _arrow_rows(tables, rows_of)
    elif tail:
        pairs = stream._share(iter(node))
    else:
        return None
    examples = _tail_over(tail, pairs, node) if tail else pairs
    return (example for _key, example in examples)
