"""Padding rows of shape ``(L_i, *F)`` into one ``(B, L, *F)`` tensor, and their lengths.

Rows that are 1-d views of one buffer (a tensor or NumPy array), or Python lists of numbers,
take one masked copy from the buffer's offsets (:func:`pad_offsets`); anything else is padded
row by row with the same result. :class:`PadSpec` holds what decides the output: the pad value
(checked against the rows' dtype, as ``torch.nn.utils.rnn.pad_sequence`` checks it), the
truncation to ``max_length``, the rounding of the width and the padding side.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

__all__ = ["NUMPY_KINDS", "PadSpec", "pad", "pad_offsets", "pad_rows", "valid_mask"]

NUMPY_KINDS = "biuf"


class PadSpec:
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
    spec = PadSpec(pad_value, max_length, pad_to_multiple_of, padding_side, truncation_side)
    return pad(rows, spec, name)


def pad(rows: list, spec: PadSpec, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    first = rows[0]
    if isinstance(first, torch.Tensor):
        fast = _views_of_one_tensor(rows)
        if fast is not None:
            return pad_offsets(*fast, spec, name)
    elif isinstance(first, np.ndarray):
        fast = _views_of_one_array(rows)
        if fast is not None:
            return pad_offsets(*fast, spec, name)
        # (read-only rows, as datasets' numpy format gives, are copied: torch warns on a
        # non-writable array even though padding only reads it)
        rows = [torch.from_numpy(np.ascontiguousarray(r) if r.flags.writeable else np.array(r))
                for r in rows]
    elif isinstance(first, (list, tuple)):
        if all(isinstance(r, (list, tuple)) for r in rows):
            lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
            flat = torch.tensor(list(itertools.chain.from_iterable(rows)))  # (N,) int64 | float32
            if flat.dim() == 1 and len(flat):
                offsets = np.zeros(len(rows), dtype=np.int64)
                np.cumsum(lengths[:-1], out=offsets[1:])
                return pad_offsets(flat.numpy(), offsets, lengths, spec, name)
        rows = [torch.as_tensor(r) for r in rows]
    else:
        rows = [torch.as_tensor(r) for r in rows]
    return _pad_loop(rows, spec, name)


def _pad_loop(rows: list[torch.Tensor], spec: PadSpec, name: str):
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
    if not isinstance(base, np.ndarray) or base.dtype.kind not in NUMPY_KINDS:
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


def valid_mask(lengths: np.ndarray, width: int, side: str) -> torch.Tensor:
    """``(B, L) int64``: 1 where row ``i`` holds data, 0 on its padding."""
    cols = np.arange(width)[None, :]  # (1, L)
    lengths = lengths[:, None]  # (B, 1)
    mask = cols < lengths if side == "right" else cols >= width - lengths  # (B, L) bool
    return torch.from_numpy(mask.astype(np.int64))


def pad_offsets(
    values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, spec: PadSpec, name: str
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
