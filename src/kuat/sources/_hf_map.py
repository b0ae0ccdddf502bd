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
  columns are dropped;
* ``batched=True`` in a table format (a function written for Arrow, declared with
  ``datasets``' own API: ``ds.with_format("arrow").map(fn, batched=True)``; also ``"pandas"``):
  :func:`table_mapped_blocks`, ``MappedExamplesIterable._iter_arrow``: the function gets
  exactly the table ``datasets`` gives it (the same rows per call, ``input_columns`` as
  ``ChunkedArray`` s, ``with_indices``, ``fn_kwargs``), its output table (``remove_columns``
  dropped, input columns not merged, as there) is the block, never Python rows.

A function applied row by row (``batched=False``) needs rows: ``None``, the row path; so do a
numpy/torch-formatted map (the function gets tensors) and an ``async`` function. An exception
raised by a batched function gets a note naming the rows of the map's input it was called on
(the positions ``with_indices`` would give them). :func:`formatted_blocks` applies a
``FormattedExamplesIterable``'s feature types above such a map, per row, as ``datasets`` does
there.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

from kuat.sources._hf_blocks import PyBlock, Tables, concat

__all__ = ["formatted_blocks", "mapped_blocks", "python_format", "table_format",
           "table_mapped_blocks", "to_block"]

_REBATCHED = "RebatchedArrowExamplesIterable"

def to_block(columns: dict, n: int) -> PyBlock:
    """A :class:`PyBlock` of ``columns`` (``{name: sequence of n values}``): each row's value
    is ``column[i]``, as ``datasets``' ``_batch_to_examples`` gives it (Python lists are kept
    as they are: turning them into Arrow would cost a type check per value, more than the
    collate of the Python values, which is the row path's own)."""
    return PyBlock({k: v if isinstance(v, list) else [v[i] for i in range(n)]
                    for k, v in columns.items()}, n)


def python_format(formatting) -> bool:
    """Whether a node with ``formatting`` (a ``FormattingConfig`` or None) gives its rows as
    Python values: no format, ``"python"``, or a table format (whose rows, read one by one,
    ``datasets`` formats with its ``PythonFormatter``; a map in a table format gets tables)."""
    return formatting is None or formatting.format_type in (None, "python") or table_format(
        formatting)


def table_format(formatting) -> bool:
    """Whether ``formatting`` (a ``FormattingConfig`` or None) is a table format (``"arrow"``,
    ``"pandas"``, ``"polars"``): a ``map`` in it gets tables."""
    return formatting is not None and bool(getattr(formatting, "is_table", False))


def _columns(block) -> dict:
    return dict(block.columns) if isinstance(block, PyBlock) else block.to_pydict()


def mapped_blocks(node, child: Tables) -> Tables | None:
    """``() -> iterator of blocks`` of ``node`` (a ``MappedExamplesIterable``) over its
    child's blocks, or None when the map needs rows (see the module docstring)."""
    from datasets.iterable_dataset import identity_func

    if node.formatting is not None and node.formatting.format_type not in (None, "python"):
        return None  # a table format: table_mapped_blocks; tensors: rows
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


def _batches(batch_size, drop_last: bool, child: Tables) -> Iterator:
    """The child's rows in blocks of ``batch_size`` (all rows when it is None or <= 0); the
    last one dropped if shorter and ``drop_last``."""
    size = batch_size if batch_size is not None and batch_size > 0 else None
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
    if have and not (drop_last and size is not None):
        yield concat(pending)


def _batched(node, child: Tables) -> Iterator:
    """``MappedExamplesIterable._iter`` with ``batched=True``, a block per batch."""
    current = 0
    for block in _batches(node.batch_size, node.drop_last_batch, child):
        batch = _columns(block)  # the dict of lists datasets builds (_examples_to_batch)
        inputs = dict(batch)
        args = [batch] if node.input_columns is None else [batch[c] for c in node.input_columns]
        if node.with_indices:
            args.append(list(range(current, current + len(block))))
        out = _call(node.function, args, node.fn_kwargs, current, len(block))
        current += len(block)
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


def _call(function, args: list, kwargs: dict, first: int, n: int):
    """``function(*args, **kwargs)``; an exception it raises gets a note naming the rows."""
    try:
        return function(*args, **kwargs)
    except Exception as e:
        note = (f"kuat: raised by the function of IterableDataset.map(batched=True) called on "
                f"rows {first}..{first + n - 1} of the map's input this epoch (the positions "
                "with_indices gives them)")
        try:
            if hasattr(e, "add_note"):
                e.add_note(note)
            else:  # Python 3.10: kept where 3.11 keeps notes
                e.__notes__ = [*getattr(e, "__notes__", ()), note]
        except Exception:  # an exception without a __dict__ or with odd __notes__
            pass
        raise


def table_mapped_blocks(node, inputs: Tables | None) -> Tables | None:
    """``() -> iterator of pyarrow.Table`` of ``node``, a ``MappedExamplesIterable`` in a
    table format (``with_format("arrow")`` before ``map(fn, batched=True)``), as its
    ``_iter_arrow`` yields them; or None (not batched, an ``async`` function, ``datasets``'
    own accumulating function, a child that is not the ``RebatchedArrowExamplesIterable``
    ``map`` puts there, or rows it converts from Python: ``inputs`` None).

    ``inputs``: blocks whose rows are those of the child's child's ``iter_arrow()``, in that
    order (what the child re-cuts into the function's batches).

    Raises what ``datasets`` raises: ``TypeError`` when the function returns something other
    than a table (a ``pandas``/``polars`` frame is converted, as there);
    ``pyarrow.ArrowInvalid`` (a ``ValueError``) when the stream's tables change types where two
    of them meet in one batch (``datasets`` cannot join them either)."""
    from datasets import iterable_dataset as hf_iter

    if (not node.batched or inputs is None or inspect.iscoroutinefunction(node.function)
            or getattr(node, "is_batch_accumulate_arrow_table_function", False)
            or type(node.ex_iterable).__name__ != _REBATCHED
            or not hasattr(hf_iter, "_table_output_to_arrow")):
        return None
    rebatched = node.ex_iterable
    return lambda: _table_batched(node, _batches(
        rebatched.batch_size, rebatched.drop_last_batch or node.drop_last_batch, inputs))


def _table_batched(node, batches: Iterator) -> Iterator:
    """``MappedExamplesIterable._iter_arrow`` (``max_chunksize=None``) over ``batches``."""
    import pyarrow as pa
    from datasets.formatting import get_formatter
    from datasets.iterable_dataset import _table_output_to_arrow

    formatter = get_formatter(node.formatting.format_type)
    current = 0
    for table in batches:
        if not isinstance(table, pa.Table):
            raise pa.ArrowInvalid(  # a ValueError, as datasets' own (pa.Table.from_batches)
                "an Arrow-formatted map's batch joins tables of the stream with different "
                "column types, which datasets cannot join either: give the stream one schema "
                "(IterableDataset.cast(features)) before with_format(\"arrow\").map(...)")
        args = ([formatter.format_batch(table)] if node.input_columns is None
                else [table[c] for c in node.input_columns])
        if node.with_indices:
            args.append([current + i for i in range(len(table))])
        output = _call(node.function, args, node.fn_kwargs.copy(), current, len(table))
        current += len(table)
        out = _table_output_to_arrow(output)
        if not isinstance(out, pa.Table):
            raise TypeError(
                f"Provided `function` which is applied to {formatter.table_type} returns a "
                f"variable of type {type(output)}. Make sure provided `function` returns a "
                f"{formatter.table_type} to update the dataset.")
        for c in node.remove_columns or ():
            if c in out.column_names:
                out = out.remove_column(out.column_names.index(c))
        if len(out):
            yield out


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

    if not python_format(node.formatting):
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
