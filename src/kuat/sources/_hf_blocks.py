"""Blocks of rows for the Arrow reading of a Hugging Face stream (:mod:`kuat.sources._hf_arrow`).

A block is a ``pyarrow.Table`` (rows in the Python format are its values' ``as_py()``) or a
:class:`PyBlock` (what a batched ``map`` returned, kept as Python values column by column);
the stream only needs ``len``, ``slice``, ``take`` and :func:`concat` of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

__all__ = ["PyBlock", "Tables", "concat", "take"]

Tables = Callable[[], Iterator]  # () -> iterator of blocks (pyarrow.Table or PyBlock)


class PyBlock:
    """Rows held as Python values, column by column (``{name: list of n values}``): what a
    batched ``map`` returned where its values do not map exactly onto Arrow types. Offers the
    few ``pyarrow.Table`` operations the stream uses (``len``, ``slice``, ``take``)."""

    __slots__ = ("columns", "n")

    def __init__(self, columns: dict, n: int):
        self.columns, self.n = columns, n

    def __len__(self) -> int:
        return self.n

    @property
    def num_rows(self) -> int:
        return self.n

    def slice(self, start: int, length: int | None = None) -> PyBlock:
        stop = self.n if length is None else min(self.n, start + length)
        return PyBlock({k: v[start:stop] for k, v in self.columns.items()}, max(0, stop - start))

    def take(self, indices) -> PyBlock:
        idx = np.asarray(indices, dtype=np.int64).tolist()
        return PyBlock({k: [v[i] for i in idx] for k, v in self.columns.items()}, len(idx))

    def rows(self) -> list[dict]:
        keys = list(self.columns)
        return [dict(zip(keys, vals, strict=True)) for vals in zip(*self.columns.values(), strict=True)]


def _pyblock(block) -> PyBlock:
    if isinstance(block, PyBlock):
        return block
    return PyBlock(block.to_pydict(), block.num_rows)  # the Python format's values


def take(block, indices):
    """The rows ``indices`` of ``block`` (a ``pyarrow.Table`` or a :class:`PyBlock`)."""
    import pyarrow as pa

    if isinstance(block, PyBlock):
        return block.take(indices)
    return block.take(pa.array(np.asarray(indices, dtype=np.int64), pa.int64()))


def concat(blocks: list):
    """One block with the rows of ``blocks`` in order: Arrow when every block is Arrow of one
    schema, else a :class:`PyBlock` of each block's Python values (tables of other types,
    e.g. the files of a CSV or JSON stream typed one by one, keep their own values, as their
    rows do: no promotion of ints to floats)."""
    import pyarrow as pa

    if len(blocks) == 1:
        return blocks[0]
    if not any(isinstance(b, PyBlock) for b in blocks) and all(
            b.schema.equals(blocks[0].schema) for b in blocks[1:]):
        return pa.concat_tables(blocks)
    parts = [_pyblock(b) for b in blocks]
    keys = list(parts[0].columns)
    if any(list(p.columns) != keys for p in parts):
        raise ValueError(
            f"the stream's rows change columns between batches ({keys} vs "
            f"{next(list(p.columns) for p in parts if list(p.columns) != keys)}): they cannot "
            "be collated into one batch"
        )
    return PyBlock({k: [v for p in parts for v in p.columns[k]] for k in keys},
                   sum(p.n for p in parts))
