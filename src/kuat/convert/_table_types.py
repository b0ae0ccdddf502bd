"""Arrow column types over a whole input: one logical type per column, widened as values come.

* :func:`logical_type` folds Arrow's physical variants (``large_*``, ``*_view``,
  dictionary-encoded, extension types) to one logical type per column;
* :func:`unify` is the widening rule: null widens to any type, integers widen to wider integers
  and to float64, float32 to float64, list items likewise, as ``pyarrow.csv.read_csv`` and
  pandas infer over a whole file; anything else is a real conflict;
* :class:`TypeUnifier` applies it to every record batch of the input, and reports a conflict
  with the column, the file and the row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from kuat.errors import SchemaError
from kuat.format.arrow_views import values_view

__all__ = ["TypeUnifier", "is_image_struct", "is_list", "logical_type", "unify"]


def is_list(t: pa.DataType) -> bool:
    return (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_list_view(t)
        or (pa.types.is_large_list_view(t))
    )


def is_image_struct(t: pa.DataType) -> bool:
    """``struct<bytes, path>``: how Hugging Face stores ``Image`` features in Arrow/Parquet."""
    return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0


def logical_type(t: pa.DataType) -> pa.DataType:
    """``t`` with Arrow's physical variants folded: dictionary -> its value type,
    ``large_string``/``string_view`` -> ``string``, ``large_binary``/``binary_view`` ->
    ``binary``, ``large_list``/``list_view`` -> ``list``; extension types -> their storage.
    Nested types are folded recursively."""
    if isinstance(t, pa.ExtensionType):
        return logical_type(t.storage_type)
    if pa.types.is_dictionary(t):
        return logical_type(t.value_type)
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if is_list(t):
        return pa.list_(logical_type(t.value_type))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(logical_type(t.value_type), t.list_size)
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(logical_type(f.type)) for f in t])
    return t


def _widen_numbers(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    ints = pa.types.is_integer(a), pa.types.is_integer(b)
    floats = pa.types.is_floating(a), pa.types.is_floating(b)
    if all(ints):
        if pa.types.is_signed_integer(a) == pa.types.is_signed_integer(b):
            return a if a.bit_width >= b.bit_width else b
        s, u = (a, b) if pa.types.is_signed_integer(a) else (b, a)
        if s.bit_width > u.bit_width:
            return s
        return pa.int64() if u.bit_width < 64 else pa.float64()
    if all(floats):
        return a if a.bit_width >= b.bit_width else b
    if (ints[0] or floats[0]) and (ints[1] or floats[1]):
        return pa.float64()  # int and float: float64, as pandas and pyarrow infer
    return None


def unify(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The narrowest logical type holding values of both ``a`` and ``b``; ``None`` when they
    conflict (a string and a number, a list and a scalar, ...)."""
    if a == b:
        return a
    if pa.types.is_null(a):
        return b
    if pa.types.is_null(b):
        return a
    num = _widen_numbers(a, b)
    if num is not None:
        return num
    if pa.types.is_fixed_size_list(a) and pa.types.is_fixed_size_list(b):
        inner = unify(a.value_type, b.value_type)
        if inner is None:
            return None
        return pa.list_(inner, a.list_size) if a.list_size == b.list_size else pa.list_(inner)
    if (is_list(a) or pa.types.is_fixed_size_list(a)) and (
        is_list(b) or pa.types.is_fixed_size_list(b)
    ):
        inner = unify(a.value_type, b.value_type)
        return None if inner is None else pa.list_(inner)
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        names = [f.name for f in a] + [f.name for f in b if a.get_field_index(f.name) < 0]
        out = []
        for n in names:
            ta = a.field(n).type if a.get_field_index(n) >= 0 else pa.null()
            tb = b.field(n).type if b.get_field_index(n) >= 0 else pa.null()
            t = unify(ta, tb)
            if t is None:
                return None
            out.append(pa.field(n, t))
        return pa.struct(out)
    return None


def _first_valid_row(arr: pa.Array) -> int:
    valid = values_view(arr.is_valid())
    return int(np.argmax(valid)) if valid.any() else 0


@dataclass
class TypeUnifier:
    """Column types over the whole input, fed one record batch at a time.

    ``add(batch, path, first_row)`` folds the batch's columns into :attr:`types` (ordered by
    first appearance) and collects the categories of dictionary-encoded columns.

    Raises (from ``add``):
        kuat.SchemaError: a column whose values conflict (names the column, the file and the
            first row of the conflicting value, and the type it had so far and where from).
    """

    types: dict[str, pa.DataType] = field(default_factory=dict)
    seen_at: dict[str, str] = field(default_factory=dict)
    categories: dict[str, list] = field(default_factory=dict)

    def add(self, batch: pa.RecordBatch | pa.Table, path: str, first_row: int) -> None:
        names = batch.schema.names
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise SchemaError(
                f"{path} has the column(s) {dup} more than once (from row {first_row}); kuat "
                "columns need distinct names: rename them"
            )
        for name, arr in zip(names, batch.columns):
            if isinstance(arr, pa.ChunkedArray):
                arr = arr.combine_chunks()
            if pa.types.is_dictionary(arr.type):
                cats = self.categories.setdefault(name, [])
                known = set(cats)
                for v in arr.dictionary.to_pylist():
                    if v not in known:
                        known.add(v)
                        cats.append(v)
            t = logical_type(arr.type)
            if pa.types.is_null(t) or arr.null_count == len(arr):
                # no value to type here: only widens (and keeps the column known)
                self.types.setdefault(name, pa.null())
                continue
            self.add_type(name, t, f"{path} row {first_row + _first_valid_row(arr)}")

    def add_type(self, name: str, t: pa.DataType, at: str) -> None:
        """Fold one more type of column ``name`` (found at ``at``, for errors) in."""
        t = logical_type(t)
        old = self.types.get(name)
        if old is None or pa.types.is_null(old):
            self.types[name] = t
            if not pa.types.is_null(t):
                self.seen_at[name] = at
            return
        if pa.types.is_null(t):
            return
        new = unify(old, t)
        if new is None:
            raise SchemaError(
                f"column {name!r} holds {t} values at {at}, but {old} before (first at "
                f"{self.seen_at[name]}); kuat needs one type per column: fix the data, or "
                "convert the files separately",
                field=name,
            )
        self.types[name] = new

    def update(self, other: TypeUnifier) -> None:
        """Fold in the types another unifier found (e.g. over one file)."""
        for name, t in other.types.items():
            self.add_type(name, t, other.seen_at.get(name, "?"))
        for name, cats in other.categories.items():
            mine = self.categories.setdefault(name, [])
            known = set(mine)
            mine.extend(c for c in cats if c not in known)
