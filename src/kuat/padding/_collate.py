"""``pad_collate(...)``: the collate function that pads a batch's sequence fields.

:func:`pad_collate` checks its arguments and returns a :class:`PadCollate`; called on a batch,
that decides per field what is padded (by :mod:`kuat.padding._rows`) and what is collated
(:func:`kuat.default_collate`, or the given ``collate_fn``): batches of mappings, of
sequences, of one-row Arrow tables, or one Arrow table; a :class:`kuat.padding.Samples` batch
is padded straight from the buffers its samples are views of.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from kuat.padding._rows import NUMPY_KINDS, PadSpec, pad, pad_offsets, valid_mask

__all__ = ["pad_collate", "PadCollate"]

_SIDES = ("right", "left")


def pad_collate(
    pad_value: float | Mapping[str, float] = 0,
    *,
    fields: Sequence[str] | None = None,
    lengths_suffix: str = "_lengths",
    collate_fn: Callable | None = None,
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
    padding_side: str = "right",
    truncation_side: str = "right",
    return_attention_mask: bool = False,
) -> PadCollate:
    """A collate function that pads variable-length sequence fields to the batch's longest.

    For a batch of B samples that are mappings (dicts), every sequence field ``f`` (rows of
    shape ``(L_i, *F)``) becomes:

    * ``out[f]``: a ``(B, L, *F)`` tensor, ``L`` the longest row of the batch (after truncation
      to ``max_length``, rounded up to a multiple of ``pad_to_multiple_of``), each row padded
      after its end (``padding_side="right"``) or before its start (``"left"``, for generation)
      with that field's pad value; dtype that of the rows (Python ints -> int64, floats ->
      float32, as ``torch.tensor``). Empty rows (``L_i == 0``) take the trailing shape ``F``
      and dtype of the others: rows ``(2, 4), (0, 4), (1, 4)`` give ``(3, 2, 4)``.
    * ``out[f + lengths_suffix]``: ``(B,) int64``, each row's length after truncation, before
      padding.
    * with ``return_attention_mask``, ``out["attention_mask"]``: ``(B, L) int64``, 1 on real
      tokens and 0 on padding (Hugging Face's convention), from the lengths of
      ``"input_ids"`` (or of the first padded field). A field already called
      ``attention_mask`` is padded like the others instead (give it pad value 0).

    Other fields are collated by ``collate_fn`` (default :func:`kuat.default_collate`, torch's
    structures). Samples that are themselves sequences give ``(padded (B, L, *F), lengths
    (B,))``. Right-padded results equal ``torch.nn.utils.rnn.pad_sequence(rows,
    batch_first=True, padding_value=v)``; left-padded ones equal its
    ``padding_side="left"``.

    Args:
        pad_value: the value written in the padding: one number for every field, or a mapping
            ``{field: value}`` such as ``{"input_ids": 0, "labels": -100}`` (fields it does not
            name are padded with 0).
        fields: the field names to pad. ``None`` pads every field whose value in the first
            sample is a tensor or NumPy array with at least one dimension, or a (nested)
            list/tuple of numbers.
        lengths_suffix: appended to a field's name to name its lengths.
        collate_fn: collates the fields that are not padded.
        max_length: rows longer than this many elements (along their first dimension) are cut
            to it; ``None`` keeps every row whole.
        pad_to_multiple_of: ``L`` is rounded up to a multiple of this (tensor-core friendly
            shapes; fewer distinct shapes for compiled models).
        padding_side: ``"right"`` (pad after the row) or ``"left"`` (pad before it).
        truncation_side: which end ``max_length`` cuts: ``"right"`` keeps a row's first
            ``max_length`` elements, ``"left"`` its last ones.
        return_attention_mask: also return ``attention_mask`` (see above).

    Returns:
        A picklable callable ``collate(batch) -> dict`` (safe to call from several threads).

    Raises:
        TypeError: (now) ``pad_value`` is not a number or a mapping of field names to numbers;
            ``fields`` is not a sequence of names.
        ValueError: (now) ``max_length`` or ``pad_to_multiple_of`` is not an int >= 1; a side
            other than ``"right"``/``"left"``. When called: an empty batch; non-empty rows of
            one field with different trailing shapes or dtypes (the message lists each row's
            shape and dtype); a lengths key that clashes with a field; a pad value the field's
            dtype cannot hold (``-100`` in ``uint16`` ids: ``pad_sequence`` refuses it too).
        KeyError: (when called) a name in ``fields`` missing from a sample.
    """
    if isinstance(pad_value, Mapping):
        bad = {k: v for k, v in pad_value.items() if not isinstance(k, str) or not _is_number(v)}
        if bad:
            raise TypeError(f"pad_value should map field names to numbers, got {bad!r}")
        pad_value = dict(pad_value)
    elif not _is_number(pad_value):
        raise TypeError(
            f"pad_value must be a number or a mapping {{field: number}}, got {pad_value!r}"
        )
    if fields is not None and (
        isinstance(fields, str) or not all(isinstance(f, str) for f in fields)
    ):
        raise TypeError(f"fields must be a sequence of field names, got {fields!r}")
    if not isinstance(lengths_suffix, str) or not lengths_suffix:
        raise ValueError(f"lengths_suffix must be a non-empty string, got {lengths_suffix!r}")
    for name, v in (("max_length", max_length), ("pad_to_multiple_of", pad_to_multiple_of)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ValueError(f"{name} should be None or an int >= 1, got {v!r}")
    for name, v in (("padding_side", padding_side), ("truncation_side", truncation_side)):
        if v not in _SIDES:
            raise ValueError(f"{name} should be 'right' or 'left', got {v!r}")
    return PadCollate(
        pad_value,
        None if fields is None else tuple(fields),
        lengths_suffix,
        collate_fn,
        max_length=None if max_length is None else int(max_length),
        pad_to_multiple_of=None if pad_to_multiple_of is None else int(pad_to_multiple_of),
        padding_side=padding_side,
        truncation_side=truncation_side,
        return_attention_mask=bool(return_attention_mask),
    )


def _is_number(v) -> bool:
    return isinstance(v, (numbers.Number, np.generic)) and not isinstance(v, (str, bytes))


class PadCollate:
    """The callable :func:`pad_collate` returns (see there)."""

    def __init__(
        self,
        pad_value,
        fields,
        lengths_suffix,
        collate_fn,
        *,
        max_length=None,
        pad_to_multiple_of=None,
        padding_side="right",
        truncation_side="right",
        return_attention_mask=False,
    ):
        self.pad_value = pad_value
        self.fields = fields
        self.lengths_suffix = lengths_suffix
        self.collate_fn = collate_fn
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding_side = padding_side
        self.truncation_side = truncation_side
        self.return_attention_mask = return_attention_mask

    def __repr__(self) -> str:
        return (
            f"pad_collate(pad_value={self.pad_value!r}, fields={self.fields!r}, "
            f"lengths_suffix={self.lengths_suffix!r}, max_length={self.max_length!r}, "
            f"pad_to_multiple_of={self.pad_to_multiple_of!r}, "
            f"padding_side={self.padding_side!r}, truncation_side={self.truncation_side!r}, "
            f"return_attention_mask={self.return_attention_mask!r})"
        )

    def _spec(self, key: str | None) -> PadSpec:
        value = self.pad_value
        if isinstance(value, dict):
            value = value.get(key, 0)
        return PadSpec(
            value,
            self.max_length,
            self.pad_to_multiple_of,
            self.padding_side,
            self.truncation_side,
        )

    def _collate_rest(self, values: list):
        fn = self.collate_fn
        if fn is None:
            from kuat.collate import default_collate as fn
        return fn(values)

    def __call__(self, batch):
        import pyarrow as pa

        if isinstance(batch, pa.Table):
            return self._collate_table(batch)
        if len(batch) == 0:
            raise ValueError("pad_collate got an empty batch")
        first = batch[0]
        if isinstance(first, pa.Table):
            return self._collate_table(pa.concat_tables(batch))
        if not isinstance(first, Mapping):
            if not _is_sequence(first):
                raise TypeError(
                    "pad_collate expects samples that are mappings (dicts) or sequences, "
                    f"got {type(first).__name__}"
                )
            return pad(list(batch), self._spec(None), "sample")
        names = (
            self.fields if self.fields is not None else [k for k in first if _is_sequence(first[k])]
        )
        for key in names:
            if key not in first:
                raise KeyError(
                    f"pad_collate: field {key!r} is not in the samples (keys {list(first)})"
                )
        columns = getattr(batch, "kuat_columns", None) or {}
        out = {}
        for key in first:
            values = [s[key] for s in batch]
            col = columns.get(key)
            if col is not None and not _same_objects(col.rows, values):
                col = None  # the samples were changed after the source made them
            if key in names:
                if col is not None and col.offsets is not None:
                    flat = col.values
                    flat = flat.numpy() if isinstance(flat, torch.Tensor) else flat  # (N,)
                    starts, lengths = col.offsets[:-1], np.diff(col.offsets)  # (B,), (B,)
                    padded, lengths = pad_offsets(flat, starts, lengths, self._spec(key), key)
                else:
                    padded, lengths = pad(values, self._spec(key), key)
                out[key] = padded
                self._put_lengths(out, first, key, lengths)
            elif (
                col is not None
                and col.offsets is None
                and self.collate_fn is None
                and isinstance(col.values, torch.Tensor)
            ):
                out[key] = col.values  # (B,): what stacking the samples' 0-d views gives
            else:
                out[key] = self._collate_rest(values)
        self._put_attention_mask(out, names)
        return out

    def collate_columns(self, columns: Mapping) -> dict:
        """What calling this collate on B mapping samples gives, from the batch's columns.

        ``columns`` maps each field, in the samples' key order, to a column object with
        ``values()`` (the B Python values), ``first()`` (the first sample's value),
        ``flat_list(float_dtype)`` (``(values (N,), offsets (B + 1,))`` of a list-of-numbers
        column, ints as int64 and floats as ``float_dtype``, or None) and
        ``default(fallback)`` (``default_collate`` of its values). Used by the columnar path
        for Hugging Face datasets (:mod:`kuat.sources.hf_columnar`); raises what ``__call__``
        raises on the same samples.
        """
        keys = list(columns)
        if self.fields is not None:
            names = self.fields
            missing = [k for k in names if k not in columns]
            if missing:
                raise KeyError(
                    f"pad_collate: field {missing[0]!r} is not in the samples (keys {keys})"
                )
        else:
            names = [k for k in keys if _is_sequence(columns[k].first())]
        out = {}
        for key in keys:
            col = columns[key]
            if key in names:
                flat = col.flat_list(np.float32)  # torch.tensor(floats) is float32
                if flat is not None and len(flat[0]):
                    values, offsets = flat  # (N,), (B + 1,)
                    padded, lengths = pad_offsets(
                        values, offsets[:-1], np.diff(offsets), self._spec(key), key
                    )
                else:
                    padded, lengths = pad(col.values(), self._spec(key), key)
                out[key] = padded
                self._put_lengths(out, keys, key, lengths)
            elif self.collate_fn is None:
                from kuat.collate import default_collate

                out[key] = col.default(default_collate)
            else:
                out[key] = self._collate_rest(col.values())
        self._put_attention_mask(out, names)
        return out

    def _put_lengths(self, out: dict, keys, key: str, lengths: torch.Tensor) -> None:
        name = key + self.lengths_suffix
        if name in keys:
            raise ValueError(
                f"pad_collate: the lengths of {key!r} would be stored as {name!r}, which is "
                "already a field; pass another lengths_suffix"
            )
        out[name] = lengths

    def _put_attention_mask(self, out: dict, padded: Sequence[str]) -> None:
        if not self.return_attention_mask or "attention_mask" in out or not padded:
            return
        key = "input_ids" if "input_ids" in padded else padded[0]
        lengths = out[key + self.lengths_suffix]  # (B,)
        width = out[key].shape[1]
        out["attention_mask"] = valid_mask(lengths.numpy(), width, self.padding_side)

    def _collate_table(self, table) -> dict:
        """Columns of an Arrow table: list columns padded, others as tensors or lists."""
        import pyarrow.types as pat

        out = {}
        padded = []
        for name in table.column_names:
            col = table.column(name).combine_chunks()  # one array for the batch
            t = col.type
            is_list = pat.is_list(t) or pat.is_large_list(t)
            wanted = self.fields is None or name in self.fields
            if (
                is_list
                and wanted
                and _numeric_arrow(t.value_type)
                and not col.null_count
                and not col.values.null_count
            ):
                offsets = col.offsets.to_numpy().astype(np.int64)  # (B + 1,)
                values = col.values.to_numpy(zero_copy_only=False)  # (n,) at least offsets[-1]
                out[name], lengths = pad_offsets(
                    values, offsets[:-1], np.diff(offsets), self._spec(name), name
                )
                self._put_lengths(out, table.column_names, name, lengths)
                padded.append(name)
            elif _numeric_arrow(t) and not col.null_count:
                out[name] = torch.from_numpy(col.to_numpy(zero_copy_only=False).copy())  # (B,)
            elif is_list and wanted:
                out[name], lengths = pad(col.to_pylist(), self._spec(name), name)
                self._put_lengths(out, table.column_names, name, lengths)
                padded.append(name)
            else:
                out[name] = self._collate_rest(col.to_pylist())
        if self.fields is not None:
            for key in self.fields:
                if key not in table.column_names:
                    raise KeyError(
                        f"pad_collate: field {key!r} is not a column ({table.column_names})"
                    )
        self._put_attention_mask(out, padded)
        return out


def _same_objects(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _numeric_arrow(t) -> bool:
    import pyarrow.types as pat

    return pat.is_integer(t) or pat.is_floating(t) or pat.is_boolean(t)


def _is_sequence(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() >= 1
    if isinstance(value, np.ndarray):
        return value.ndim >= 1 and value.dtype.kind in NUMPY_KINDS
    if isinstance(value, (list, tuple)):  # numbers, or rows of numbers ((L, F) boxes)
        return all(
            isinstance(v, (numbers.Number, np.generic)) or _is_sequence(v) for v in value[:8]
        )
    return False
