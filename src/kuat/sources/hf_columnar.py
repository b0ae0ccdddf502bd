"""The columnar path for Hugging Face datasets: batches built column by column from Arrow.

A batch of B rows of a ``datasets`` table, in the Python format (what iterating the dataset, or
indexing it without ``with_format``, gives: ``int``, ``float``, ``bool``, ``str``, ``list``...),
collated by :func:`kuat.default_collate` (torch's ``default_collate`` structures) or by a
:func:`kuat.pad_collate`, is built here from the Arrow columns without making the B row dicts:

==============================  ==========================================================
column (no nulls)               default collate: what ``default_collate`` gives the rows
==============================  ==========================================================
integers (not ``uint64``)       ``(B,) int64`` tensor
floating point                  ``(B,) float64`` tensor (Python floats)
booleans                        ``(B,) bool`` tensor
strings                         a list of B ``str``
lists of numbers, equal length  a list of L ``(B,)`` tensors (torch transposes sequences)
anything else                   ``default_collate`` of the column's Python values
==============================  ==========================================================

With ``pad_collate``, a list-of-numbers column it pads is padded straight from the Arrow
offsets and values (ints as ``int64``, floats as ``float32``, as ``torch.tensor`` makes them
from Python lists), every other column as above. Ragged lists under the default collate,
nulls, nested or struct columns go through the same collate on the column's Python values, so
the result is always exactly what the row path gives (errors included).

Used by :class:`kuat.sources.hf.HFIterableSource` (``kuat_iter_collated``) and
:class:`kuat.sources.hf.HFMapSource` (``kuat_fetch_collated``). Thread-safety: pure functions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["ColumnarCollate", "columnar_collate", "plain_features", "python_rows"]

_INT64_MAX = np.iinfo(np.int64).max


def python_rows(table) -> list[dict]:
    """The rows of ``table`` as ``datasets``' Python formatter gives them (plain types)."""
    return table.to_pylist()


def _numeric(t) -> str | None:
    """'i', 'f' or 'b' for an Arrow integer, floating or boolean type, else None."""
    import pyarrow.types as pat

    if pat.is_integer(t):
        return "i"
    if pat.is_floating(t):
        return "f"
    if pat.is_boolean(t):
        return "b"
    return None


def _list_type(t) -> bool:
    import pyarrow.types as pat

    return pat.is_list(t) or pat.is_large_list(t) or pat.is_fixed_size_list(t)


def _as_numpy(arr, kind: str, float_dtype) -> np.ndarray | None:
    """``(N,)`` values of a null-free numeric Arrow array as Python values would collate:
    int64, ``float_dtype`` or bool (a writable copy); None for uint64 values beyond int64."""
    a = arr.to_numpy(zero_copy_only=False)  # may be a read-only view of Arrow's buffer
    if kind == "i":
        if a.dtype == np.uint64 and len(a) and a.max() > _INT64_MAX:
            return None  # torch.tensor of such Python ints overflows: the row path decides
        return a.astype(np.int64)  # a copy: the batch owns its memory, as torch's collate
    return a.astype(float_dtype if kind == "f" else bool)


class _Column:
    """One Arrow column of a batch, readable as Python values or as flat numbers."""

    __slots__ = ("arr", "_values")

    def __init__(self, chunked):
        self.arr = chunked.combine_chunks() if hasattr(chunked, "combine_chunks") else chunked
        self._values = None

    def values(self) -> list:
        if self._values is None:
            self._values = self.arr.to_pylist()
        return self._values

    def first(self):
        return self.arr[0].as_py()

    def flat_list(self, float_dtype) -> tuple[np.ndarray, np.ndarray] | None:
        """``(values (N,), offsets (B + 1,) int64)`` of a null-free list-of-numbers column,
        offsets from 0; None for any other column."""
        arr = self.arr
        if not _list_type(arr.type) or arr.null_count:
            return None
        kind = _numeric(arr.type.value_type)
        if kind is None:
            return None
        flat = arr.flatten()  # (N,) only this slice's values
        if flat.null_count:
            return None
        if hasattr(arr, "offsets"):
            offsets = arr.offsets.to_numpy().astype(np.int64)  # (B + 1,)
            offsets = offsets - offsets[0]
        else:  # fixed-size lists
            offsets = np.arange(len(arr) + 1, dtype=np.int64) * arr.type.list_size
        values = _as_numpy(flat, kind, float_dtype)
        return None if values is None else (values, offsets)

    def default(self, fallback: Callable):
        """``default_collate`` of this column's B Python values (``fallback`` collates them
        where no columnar rule applies)."""
        arr = self.arr
        kind = _numeric(arr.type) if not arr.null_count else None
        if kind is not None:
            a = _as_numpy(arr, kind, np.float64)
            if a is not None:
                return torch.from_numpy(a)  # (B,)
        import pyarrow.types as pat

        if not arr.null_count and (pat.is_string(arr.type) or pat.is_large_string(arr.type)):
            return self.values()  # torch keeps strings as a list
        flat = self.flat_list(np.float64)
        if flat is not None:
            values, offsets = flat
            lengths = np.diff(offsets)  # (B,)
            if len(lengths) and (lengths == lengths[0]).all():
                width = int(lengths[0])
                grid = values.reshape(len(lengths), width)  # (B, L)
                return list(torch.from_numpy(np.ascontiguousarray(grid.T)).unbind(0))  # L x (B,)
        return fallback(self.values())  # ragged lists raise torch's own error here


class _PyColumn:
    """A column of Python values (what a batched ``map`` returned): collated as the rows'."""

    __slots__ = ("_values",)

    def __init__(self, values: list):
        self._values = values

    def values(self) -> list:
        return self._values

    def first(self):
        return self._values[0]

    def flat_list(self, float_dtype):
        """``(values (N,), offsets (B + 1,))`` when every value is a list of Python numbers of
        one type (ints as int64, floats as ``float_dtype``, bools): what ``torch.tensor`` of
        the chained values gives; None otherwise."""
        rows = self._values
        if set(map(type, rows)) != {list}:
            return None
        chained = itertools.chain.from_iterable
        kinds = set(map(type, chained(rows)))
        if len(kinds) != 1 or next(iter(kinds)) not in _PY_DTYPES:
            return None
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))  # (B,)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        kind = next(iter(kinds))
        dtype = float_dtype if kind is float else _PY_DTYPES[kind]
        try:
            values = np.fromiter(chained(rows), dtype=dtype, count=int(offsets[-1]))  # (N,)
        except OverflowError:  # ints beyond int64: torch.tensor decides
            return None
        return values, offsets

    def default(self, fallback: Callable):
        return fallback(self._values)


_PY_DTYPES = {int: np.int64, bool: np.bool_, float: None}


class ColumnarCollate:
    """``collate(block) -> batch``: what ``collate_fn`` of the block's rows returns, built
    from its columns (see the module docstring): a ``pyarrow.Table`` (rows in the Python
    format) or a :class:`kuat.sources._hf_blocks.PyBlock`. Built by :func:`columnar_collate`."""

    def __init__(self, collate_fn, pad):
        self.collate_fn = collate_fn
        self._pad = pad  # the PadCollate, or None for the default collate

    def __call__(self, table):
        from kuat.sources._hf_blocks import PyBlock

        if isinstance(table, PyBlock):
            if table.n == 0 or not table.columns:
                return self.collate_fn(table.rows())
            columns = {name: _PyColumn(v) for name, v in table.columns.items()}
        elif table.num_rows == 0 or not table.column_names:
            return self.collate_fn(python_rows(table))
        else:
            columns = {name: _Column(table.column(name)) for name in table.column_names}
        if self._pad is None:
            from kuat.collate import default_collate

            return {name: col.default(default_collate) for name, col in columns.items()}
        return self._pad.collate_columns(columns)


def columnar_collate(collate_fn) -> ColumnarCollate | None:
    """A :class:`ColumnarCollate` for ``collate_fn`` when it is :func:`kuat.default_collate`,
    torch's ``default_collate`` or a :func:`kuat.pad_collate`; ``None`` for any other."""
    from torch.utils.data._utils.collate import default_collate as torch_default

    from kuat.collate import default_collate
    from kuat.padding import PadCollate

    if collate_fn is default_collate or collate_fn is torch_default:
        return ColumnarCollate(default_collate, None)
    if type(collate_fn) is PadCollate:
        rest = collate_fn.collate_fn
        if rest is not None and rest is not default_collate and rest is not torch_default:
            return None  # its own collate for the other fields: it sees the Python values
        return ColumnarCollate(collate_fn, collate_fn)
    return None


def plain_features(features) -> bool:
    """Whether ``features`` (a ``datasets.Features`` or None) decode nothing: the Python
    format of its rows is then the Arrow values' ``as_py()``."""
    if features is None:
        return True
    from datasets.features.features import require_decoding

    return not any(require_decoding(f) for f in features.values())
