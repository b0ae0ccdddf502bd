"""``pad_collate``: batch variable-length sequences by padding them to the longest in the batch.

The usual way (a Python loop that copies each row into a padded tensor) costs a few microseconds
of interpreter work per row and per field. Here the common cases take one NumPy operation per
field and batch:

* **views of one buffer**: a source that gathers a batch in one go (kuat's Hugging Face source
  and kuat datasets) hands each sample a 1-d view of one batch buffer; the rows' positions in
  that buffer give the offsets, and one masked copy fills the ``(B, L)`` result;
* **Arrow tables**: samples that are one-row ``pyarrow.Table`` (a ``datasets.Dataset`` in the
  ``"arrow"`` format), or a whole batch as one table, are padded from the list columns' offsets
  and values;
* **Python lists of numbers** are flattened into one tensor, then padded the same way.

Anything else (separately allocated tensors or arrays, rows of shape ``(L, *F)``) is padded
row by row, with the same result. Outputs are exactly those of the per-row loop:
``torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_value)``.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

__all__ = ["pad_collate", "PadCollate", "Samples", "BatchColumn"]


class BatchColumn:
    """The batch-level data behind one field of a :class:`Samples` list.

    Attributes:
        values: ``(N,)`` tensor or NumPy array every sample's value is a view of.
        offsets: ``(B + 1,) int64`` NumPy array for a sequence field (sample ``i`` is
            ``values[offsets[i]:offsets[i + 1]]``), or ``None`` for a scalar field (sample ``i``
            is ``values[i]``, and ``N == B``).
        rows: the B per-sample objects handed out (checked by identity before use).
    """

    __slots__ = ("values", "offsets", "rows")

    def __init__(self, values, offsets, rows):
        self.values, self.offsets, self.rows = values, offsets, rows


class Samples(list):
    """A list of per-sample dicts (the ``__getitems__`` contract) that also carries, in
    ``kuat_columns`` (``{field: BatchColumn}``), the batch columns the samples' values are views
    of. :func:`pad_collate` then pads or collates those fields without touching each sample
    (after checking by identity that the samples still hold those views). Sources that gather a
    batch at once (kuat's Hugging Face source) return it; any other collate sees a plain list.
    """

    def __init__(self, samples=(), columns=None):
        super().__init__(samples)
        self.kuat_columns = columns or {}


_NUMPY_KINDS = "biuf"
_SIDES = ("right", "left")


class _PadSpec:
    """How rows are cut and padded: one value per field, the width, the side."""

    __slots__ = ("value", "max_length", "multiple", "side", "truncation_side")

    def __init__(
        self, value, max_length=None, multiple=None, side="right", truncation_side="right"
    ):
        self.value, self.max_length, self.multiple = value, max_length, multiple
        self.side, self.truncation_side = side, truncation_side

    def fill(self, dtype, name: str):
        """The pad value as written into rows of ``dtype`` (a torch or NumPy dtype).

        ``torch.nn.utils.rnn.pad_sequence``'s rule: a value the dtype cannot hold (``-100`` in
        ``uint16`` token ids, NaN or 1e10 in an integer field, 1e6 in ``float16``) is an error,
        never a wrapped-around number; a fractional value in an integer field is truncated.

        Raises:
            ValueError: the value does not fit ``dtype`` (names the field, value and dtype).
        """
        value = self.value
        t = dtype if isinstance(dtype, torch.dtype) else torch.from_numpy(np.empty(0, dtype)).dtype
        if t == torch.bool or t.is_complex:
            return value
        v = float(value)
        if t.is_floating_point:
            fits = not math.isfinite(v) or abs(v) <= torch.finfo(t).max
        else:
            info = torch.iinfo(t)
            fits = math.isfinite(v) and info.min <= int(value) <= info.max
        if not fits:
            raise ValueError(
                f"pad_collate: pad value {value!r} of {name!r} does not fit its dtype {t} "
                "(torch's pad_sequence refuses it too); pick a value in range, or cast the "
                "field to a wider signed dtype first (e.g. labels to int64 in a transform)"
            )
        return value

    def width(self, longest: int) -> int:
        """The padded length ``L`` for a batch whose longest (truncated) row has ``longest``."""
        if self.multiple is not None and longest % self.multiple:
            longest += self.multiple - longest % self.multiple
        return longest


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

    def _spec(self, key: str | None) -> _PadSpec:
        value = self.pad_value
        if isinstance(value, dict):
            value = value.get(key, 0)
        return _PadSpec(
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
            return _pad(list(batch), self._spec(None), "sample")
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
                    padded, lengths = _pad_offsets(flat, starts, lengths, self._spec(key), key)
                else:
                    padded, lengths = _pad(values, self._spec(key), key)
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
        out["attention_mask"] = _valid_mask(lengths.numpy(), width, self.padding_side)

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
                out[name], lengths = _pad_offsets(
                    values, offsets[:-1], np.diff(offsets), self._spec(name), name
                )
                self._put_lengths(out, table.column_names, name, lengths)
                padded.append(name)
            elif _numeric_arrow(t) and not col.null_count:
                out[name] = torch.from_numpy(col.to_numpy(zero_copy_only=False).copy())  # (B,)
            elif is_list and wanted:
                out[name], lengths = _pad(col.to_pylist(), self._spec(name), name)
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
        return value.ndim >= 1 and value.dtype.kind in _NUMPY_KINDS
    if isinstance(value, (list, tuple)):  # numbers, or rows of numbers ((L, F) boxes)
        return all(
            isinstance(v, (numbers.Number, np.generic)) or _is_sequence(v) for v in value[:8]
        )
    return False


def pad_rows(
    rows: list,
    pad_value=0,
    name: str = "field",
    *,
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
    padding_side: str = "right",
    truncation_side: str = "right",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad ``rows`` (B tensors, arrays or lists of shape ``(L_i, *F)``) to ``(B, L, *F)``.

    Returns ``(padded, lengths)``: the ``(B, L, *F)`` tensor and ``(B,) int64`` lengths (after
    truncation). The keywords are :func:`pad_collate`'s. Takes the one-op path when the rows
    are 1-d views of one buffer or Python lists of numbers.

    Raises:
        ValueError: non-empty rows with different trailing shapes or dtypes (each row's shape
            and dtype is listed).
    """
    spec = _PadSpec(pad_value, max_length, pad_to_multiple_of, padding_side, truncation_side)
    return _pad(rows, spec, name)


def _pad(rows: list, spec: _PadSpec, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    first = rows[0]
    if isinstance(first, torch.Tensor):
        fast = _views_of_one_tensor(rows)
        if fast is not None:
            return _pad_offsets(*fast, spec, name)
    elif isinstance(first, np.ndarray):
        fast = _views_of_one_array(rows)
        if fast is not None:
            return _pad_offsets(*fast, spec, name)
        rows = [torch.from_numpy(np.ascontiguousarray(r)) for r in rows]
    elif isinstance(first, (list, tuple)):
        if all(isinstance(r, (list, tuple)) for r in rows):
            lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
            flat = torch.tensor(list(itertools.chain.from_iterable(rows)))  # (N,) int64 | float32
            if flat.dim() == 1 and len(flat):
                offsets = np.zeros(len(rows), dtype=np.int64)
                np.cumsum(lengths[:-1], out=offsets[1:])
                return _pad_offsets(flat.numpy(), offsets, lengths, spec, name)
        rows = [torch.as_tensor(r) for r in rows]
    else:
        rows = [torch.as_tensor(r) for r in rows]
    return _pad_loop(rows, spec, name)


def _pad_loop(rows: list[torch.Tensor], spec: _PadSpec, name: str):
    """Row by row, for what the one-op paths do not cover (rows ``(L_i, *F)``, empty ones)."""
    rows = [torch.as_tensor(r) for r in rows]
    # An empty row ([] from JSON, a (0,) tensor) says nothing of F or the dtype: take the others'.
    shaped = [r for r in rows if r.dim() >= 1 and r.shape[0] > 0] or rows
    trailing, dtype = shaped[0].shape[1:], shaped[0].dtype
    if any(
        r.dim() == 0 or (r.shape[0] > 0 and (r.shape[1:] != trailing or r.dtype != dtype))
        for r in rows
    ):
        listing = ", ".join(f"{i}: {tuple(r.shape)} {r.dtype}" for i, r in enumerate(rows))
        raise ValueError(
            f"pad_collate: the rows of {name!r} must share their trailing shape and dtype "
            f"to be padded along their first dimension; got {listing}"
        )
    if spec.max_length is not None:
        keep = spec.max_length
        rows = [
            r[:keep] if spec.truncation_side == "right" else r[max(0, len(r) - keep) :]
            for r in rows
        ]
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)  # (B,)
    width = spec.width(int(lengths.max()) if len(rows) else 0)
    value = spec.fill(dtype, name)
    out = torch.full((len(rows), width, *trailing), value, dtype=dtype)  # (B, L, *F)
    for i, r in enumerate(rows):
        n = r.shape[0]
        if n:
            if spec.side == "right":
                out[i, :n] = r
            else:
                out[i, width - n :] = r
    return out, lengths


def _views_of_one_tensor(rows: list[torch.Tensor]):
    """``(values, starts, lengths)`` when every row is a stride-1 1-d view of one CPU tensor,
    in that tensor's dtype."""
    base = rows[0]._base
    if base is None or base.device.type != "cpu" or not base.is_contiguous():
        return None
    for r in rows:
        if r._base is not base or r.dim() != 1 or r.dtype != base.dtype:
            return None
        if r.stride(0) != 1 and r.shape[0] > 1:
            return None
    try:
        values = base.reshape(-1).numpy()  # the whole buffer, zero-copy
    except (TypeError, RuntimeError):  # bfloat16 and other dtypes NumPy lacks; requires_grad
        return None
    origin = base.storage_offset()
    starts = np.fromiter((r.storage_offset() - origin for r in rows), np.int64, len(rows))
    lengths = np.fromiter((r.shape[0] for r in rows), np.int64, len(rows))
    return values, starts, lengths


def _views_of_one_array(rows: list[np.ndarray]):
    """``(values, starts, lengths)`` when every row is a contiguous 1-d view of one array, in
    that array's dtype."""
    base = rows[0].base
    if not isinstance(base, np.ndarray) or base.dtype.kind not in _NUMPY_KINDS:
        return None
    if not base.flags.c_contiguous or base.dtype != rows[0].dtype:
        return None
    item = base.itemsize
    origin = base.ctypes.data
    starts = np.empty(len(rows), dtype=np.int64)
    for i, r in enumerate(rows):
        if r.base is not base or r.ndim != 1 or r.dtype != base.dtype:
            return None  # another dtype's view of the buffer: its offsets are not in our units
        if r.strides[0] != item and r.shape[0] > 1:
            return None
        starts[i] = (r.ctypes.data - origin) // item
    lengths = np.fromiter((r.shape[0] for r in rows), np.int64, len(rows))
    return base.reshape(-1), starts, lengths


def _valid_mask(lengths: np.ndarray, width: int, side: str) -> torch.Tensor:
    """``(B, L) int64``: 1 where row ``i`` holds data, 0 on its padding."""
    cols = np.arange(width)[None, :]  # (1, L)
    lengths = lengths[:, None]  # (B, 1)
    mask = cols < lengths if side == "right" else cols >= width - lengths  # (B, L) bool
    return torch.from_numpy(mask.astype(np.int64))


def _pad_offsets(
    values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, spec: _PadSpec, name: str
):
    """Rows ``values[starts[i] : starts[i] + lengths[i]]`` padded into ``(B, L)``, one copy."""
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    if spec.max_length is not None and len(lengths) and lengths.max() > spec.max_length:
        cut = np.minimum(lengths, spec.max_length)  # (B,)
        if spec.truncation_side == "left":
            starts = starts + (lengths - cut)  # keep each row's last max_length values
        lengths = cut
    batch = len(lengths)
    width = spec.width(int(lengths.max()) if batch else 0)
    out = np.full((batch, width), spec.fill(values.dtype, name), dtype=values.dtype)  # (B, L)
    cols = np.arange(width)[None, :]  # (1, L)
    shift = np.zeros(batch, np.int64) if spec.side == "right" else width - lengths  # (B,)
    mask = (cols >= shift[:, None]) & (cols < (shift + lengths)[:, None])  # (B, L) bool
    total = int(lengths.sum())
    if batch and np.array_equal(starts[1:], starts[:-1] + lengths[:-1]):
        out[mask] = values[starts[0] : starts[0] + total]  # rows are back to back: one slice
    else:
        positions = starts[:, None] + cols - shift[:, None]  # (B, L)
        out[mask] = values[positions[mask]]
    return torch.from_numpy(out), torch.from_numpy(lengths.copy())
