"""A lazy ``IterableDataset.map`` run on blocks of rows instead of one row at a time.

Part of the Arrow reading of a Hugging Face stream (:mod:`kuat.sources._hf_arrow`).
:func:`mapped_blocks` handles ``datasets``' ``MappedExamplesIterable`` when the result does not
need rows:

* ``batched=True`` (synchronous function, Python format): the function gets exactly the
  dict of lists ``datasets`` gives it (its ``batch_size`` rows, ``input_columns``,
  ``with_indices``, ``fn_kwargs``, ``remove_columns``, ``drop_last_batch``), once per batch, as
  in ``MappedExamplesIterable._iter``; its output stays Python values, column by column
  (:class:`kuat.sources._hf_blocks.PyBlock`), so the values the collate sees are the row
  path's, value for value, without the B row dicts;
* ``map(remove_columns=...)`` without a function (``IterableDataset.remove_columns``): the
  columns are dropped.

A function applied row by row (``batched=False``) needs rows: ``None``, the row path.
:func:`formatted_blocks` applies a ``FormattedExamplesIterable``'s feature types above such a
map, per row, as ``datasets`` does there.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

from kuat.sources._hf_blocks import PyBlock, Tables, concat

__all__ = ["formatted_blocks", "mapped_blocks", "to_block"]

def to_block(columns: dict, n: int) -> PyBlock:
    """A :class:`PyBlock` of ``columns`` (``{name: sequence of n values}``): each row's value
    is ``column[i]``, as ``datasets``' ``_batch_to_examples`` gives it (Python lists are kept
    as they are: turning them into Arrow would cost a type check per value, more than the
    collate of the Python values, which is the row path's own)."""
    return PyBlock({k: v if isinstance(v, list) else [v[i] for i in range(n)]
                    for k, v in columns.items()}, n)


def _columns(block) -> dict:
    return dict(block.columns) if isinstance(block, PyBlock) else block.to_pydict()


def mapped_blocks(node, child: Tables) -> Tables | None:
    """``() -> iterator of blocks`` of ``node`` (a ``MappedExamplesIterable``) over its
    child's blocks, or None when the map needs rows (see the module docstring)."""
    from datasets.iterable_dataset import identity_func

    if node.formatting is not None and node.formatting.format_type not in (None, "python"):
        return None
    if inspect.iscoroutinefunction(node.function):
        return None
    if not node.batched:
        if node.function is not identity_func or node.input_columns or node.with_indices:
            return None
        removed = set(node.remove_columns or ())
        return lambda: (_drop(b, removed) for b in child())
    return lambda: _batched(node, child)


def _drop(block, removed: set):
    if isinstance(block, PyBlock):
        return PyBlock({k: v for k, v in block.columns.items() if k not in removed}, block.n)
    return block.drop_columns([c for c in block.column_names if c in removed])


def _batches(node, child: Tables) -> Iterator:
    """The child's rows in blocks of the map's ``batch_size`` (all rows when it is None or
    <= 0); the last one dropped if shorter and ``drop_last_batch``."""
    size = node.batch_size if node.batch_size is not None and node.batch_size > 0 else None
    pending: list = []
    have = 0
    for block in child():
        pending.append(block)
        have += len(block)
        while size is not None and have >= size:
            whole = concat(pending)
            yield whole.slice(0, size)
            rest = whole.slice(size)
            pending, have = ([rest] if len(rest) else []), len(rest)
    if have and not (node.drop_last_batch and size is not None):
        yield concat(pending)


def _batched(node, child: Tables) -> Iterator:
    """``MappedExamplesIterable._iter`` with ``batched=True``, a block per batch."""
    current = 0
    for block in _batches(node, child):
        batch = _columns(block)  # the dict of lists datasets builds (_examples_to_batch)
        inputs = dict(batch)
        args = [batch] if node.input_columns is None else [batch[c] for c in node.input_columns]
        if node.with_indices:
            args.append(list(range(current, current + len(block))))
        current += len(block)
        out = node.function(*args, **node.fn_kwargs)
        _check_lengths(out)
        if node.remove_columns:
            for c in node.remove_columns:
                inputs.pop(c, None)
                if out is batch and c in out:
                    del out[c]
        if out:
            first = next(iter(out))
            n = len(out[first])
            bad = [c for c in inputs if c not in out and len(inputs[c]) != n]
            if bad:
                raise ValueError(
                    f"Column lengths mismatch: columns {bad} have length "
                    f"{[len(inputs[c]) for c in bad]} while {first} has length {n}. Make sure "
                    "the mapped function returns all columns at the same length, or drop the "
                    "offending input columns with `remove_columns`."
                )
        merged = {**inputs, **out}
        n = len(merged[next(iter(merged))]) if merged else 0
        if n:
            yield to_block(merged, n)


def _check_lengths(out) -> None:
    """``datasets``' ``validate_function_output`` for a batched function."""
    if not out:
        return
    first = next(iter(out))
    bad = [c for c in out if len(out[c]) != len(out[first])]
    if bad:
        raise ValueError(
            f"Column lengths mismatch: columns {bad} have length {[len(out[c]) for c in bad]} "
            f"while {first} has length {len(out[first])}."
        )


def formatted_blocks(node, child: Tables) -> Tables | None:
    """A ``FormattedExamplesIterable`` over blocks that came through a ``map``: its row path
    (``_apply_feature_types_on_example`` on each row when it has features the child lacks),
    or None for a tensor/table format."""
    from datasets.iterable_dataset import _apply_feature_types_on_example

    if node.formatting is not None and node.formatting.format_type not in (None, "python"):
        return None
    features = node.features
    if not features or node.ex_iterable.is_typed:
        return child

    schema = features.arrow_schema

    def gen():
        for block in child():
            if _same_values(block, schema):  # encoding plain values gives them back
                names = list(features) + [c for c in block.column_names if c not in features]
                yield block.select(names)  # the row path's key order: the features' first
                continue
            rows = (block.rows() if isinstance(block, PyBlock) else block.to_pylist())
            rows = [_apply_feature_types_on_example(r, features, node.token_per_repo_id)
                    for r in rows]
            keys = list(rows[0])
            if any(list(r) != keys for r in rows):
                raise ValueError("rows with different columns cannot be collated into a batch")
            yield to_block({k: [r[k] for r in rows] for k in keys}, len(rows))

    return gen


def _kind(t):
    """What ``as_py()`` makes of Arrow type ``t``: 'i', 'f', 'b', 's', ('l', inner) or None."""
    import pyarrow.types as pat

    for test, kind in ((pat.is_integer, "i"), (pat.is_floating, "f"), (pat.is_boolean, "b"),
                       (pat.is_string, "s"), (pat.is_large_string, "s")):
        if test(t):
            return kind
    if pat.is_list(t) or pat.is_large_list(t):
        inner = _kind(t.value_type)
        return None if inner is None or isinstance(inner, tuple) else ("l", inner)
    return None


def _same_values(block, schema) -> bool:
    """Whether ``features.encode_example`` then ``decode_example`` give each row of the Arrow
    ``block`` back unchanged: every feature column present, of plain values of the same kind
    (``Value.encode_example`` is ``int()``/``float()``/``bool()``/``str()`` of the value)."""
    if isinstance(block, PyBlock):
        return False
    have = block.schema
    for field in schema:
        i = have.get_field_index(field.name)
        if i < 0 or block.column(i).null_count:
            return False
        kind = _kind(field.type)
        if kind is None or _kind(have.field(i).type) != kind:
            return False
    return True
