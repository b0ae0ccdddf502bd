"""Batch assembly: ``default_collate`` with torch's output structures and a zero-copy fast path.

``default_collate(samples)`` returns exactly what ``torch.utils.data.default_collate`` returns
(nested dicts, namedtuples, lists, NumPy arrays and Python numbers become tensors, strings stay
lists), with two differences in how tensors are stacked:

* **Zero-copy, only for kuat's own batch buffers**: when the B tensors of a field are
  consecutive, equal-shape, contiguous views of one storage that kuat allocated for this very
  batch (``buf[0], buf[1], ...`` as kuat datasets produce when they decode straight into a
  ``(B, C, H, W)`` buffer from :func:`new_batch_buffer`), the batch is that buffer's view, with
  no copy. Any other memory (a ``TensorDataset``'s tensors, NumPy views, read-only memory maps)
  is copied, as torch's collate copies it, so in-place edits of a batch never reach the data.
  A buffer counts as the batch's own only while a :func:`batch_scope` (the loader opens one
  around each batch's fetch and collate) is open in the thread that allocated it (both live in
  :mod:`kuat._buffers`, which says whose memory a buffer is).
* **Errors name every element**: when tensors cannot be stacked, the ``RuntimeError`` lists each
  element's shape and dtype (torch's message names only the first mismatch).

Unlike torch's collate inside a worker *process*, the output is never allocated in shared memory
here: kuat's process workers move batches through their own reused shared-memory pool.

Thread-safety: pure functions; safe to call from any number of threads.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping, Sequence

import torch
from torch.utils.data._utils.collate import collate as _torch_collate
from torch.utils.data._utils.collate import default_collate_fn_map as _torch_collate_map

# the batch's own buffers live in kuat._buffers; batch_scope, new_batch_buffer and
# own_batch_buffer are re-exported here, their import path before (the engine's, the sources')
from kuat._buffers import (
    batch_scope,
    has_batch_buffers,
    is_batch_buffer,
    new_batch_buffer,
    own_batch_buffer,
)

__all__ = [
    "default_collate", "describe_elements", "map_structure", "batch_scope", "new_batch_buffer",
    "own_batch_buffer",
]

_MAX_LISTED = 64


def describe_elements(batch: Sequence[object]) -> str:
    """One line per element: its position, type, and shape/dtype when it has them."""
    lines = []
    for i, x in enumerate(batch[:_MAX_LISTED]):
        shape = getattr(x, "shape", None)
        dtype = getattr(x, "dtype", None)
        if shape is not None:
            lines.append(f"  element {i}: shape {tuple(shape)} dtype {dtype} ({type(x).__name__})")
        else:
            lines.append(f"  element {i}: {type(x).__name__} {x!r:.60}")
    if len(batch) > _MAX_LISTED:
        lines.append(f"  ... and {len(batch) - _MAX_LISTED} more elements")
    return "\n".join(lines)


def _consecutive_view(batch: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``(B, *S)`` view of the batch buffer the B tensors of shape ``S`` come from, or None
    (also when the storage is not a buffer kuat allocated for this batch)."""
    if not has_batch_buffers():
        return None
    first = batch[0]
    if not first.is_contiguous() or first.layout != torch.strided or first.numel() == 0:
        return None
    numel, shape, dtype = first.numel(), first.shape, first.dtype
    ptr = first.untyped_storage().data_ptr()
    if not is_batch_buffer(ptr):
        return None
    off = first.storage_offset()
    for i, t in enumerate(batch):
        if (
            type(t) is not type(first)
            or t.shape != shape
            or t.dtype != dtype
            or t.device != first.device
            or t.requires_grad
            or t.storage_offset() != off + i * numel
            or t.untyped_storage().data_ptr() != ptr
            or not t.is_contiguous()
        ):
            return None
    if first.untyped_storage().nbytes() < (off + len(batch) * numel) * first.element_size():
        return None
    # (B, *S) with the element stride of the (contiguous) sample: no copy.
    return first.as_strided((len(batch), *shape), (numel, *first.stride()), off)


def _collate_tensors(batch, *, collate_fn_map=None):
    elem = batch[0]
    if elem.is_nested:
        raise RuntimeError(
            "Batches of nested tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )
    if elem.layout in {
        torch.sparse_coo,
        torch.sparse_csr,
        torch.sparse_bsr,
        torch.sparse_csc,
        torch.sparse_bsc,
    }:
        raise RuntimeError(
            "Batches of sparse tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )
    view = _consecutive_view(batch)
    if view is not None:
        return view
    try:
        return torch.stack(batch, 0)  # B x (*S) -> (B, *S)
    except (RuntimeError, TypeError) as e:
        raise type(e)(
            f"default_collate cannot stack {len(batch)} tensors into one batch "
            f"({e}). The elements are:\n{describe_elements(batch)}"
        ) from e


_COLLATE_MAP = dict(_torch_collate_map)
_COLLATE_MAP[torch.Tensor] = _collate_tensors


def default_collate(batch: Sequence[object]):
    """Assemble a list of B samples into a batch, with torch's ``default_collate`` structures.

    Args:
        batch: B samples (tensors, NumPy arrays, numbers, strings, or nested dicts, lists,
            tuples and namedtuples of them, the same structure in every sample).

    Returns:
        The same structure with a leading batch dimension ``B`` on every tensor: tensors of
        shape ``S`` become ``(B, *S)`` (a view without copy only when the samples are
        consecutive views of one buffer kuat allocated for this batch; otherwise a copy, as
        torch's), NumPy arrays become tensors, Python floats become ``float64``
        tensors of shape ``(B,)``, ints ``int64``, strings stay a list of B strings.

    Raises:
        RuntimeError: tensors of different shapes (the message lists every element's shape and
            dtype).
        TypeError: an element type torch's ``default_collate`` does not handle.
    """
    elem = batch[0] if len(batch) else None
    # the two commonest batches, without torch's walk over its type map and abstract base
    # classes (4-5 us of a 20 us collate of 32 samples): B tensors, B dicts of tensors
    if type(elem) is torch.Tensor:
        return _collate_tensors(batch)
    if type(elem) is dict and all(type(v) is torch.Tensor for v in elem.values()):
        try:
            return {key: _collate_tensors([d[key] for d in batch]) for key in elem}
        except (KeyError, TypeError):
            pass  # not every sample a dict of tensors with these keys: torch's walk decides
    return _torch_collate(batch, collate_fn_map=_COLLATE_MAP)


def map_structure(fn, data):
    """Apply ``fn`` to every leaf of nested mappings, tuples, namedtuples and lists.

    Containers are rebuilt with the same types as ``torch.utils.data._utils.pin_memory``
    rebuilds them (mutable mappings and sequences are copied and updated; others are rebuilt
    from their items, falling back to ``dict``/``list`` when the type cannot be rebuilt).
    Strings and bytes are leaves.
    """
    if isinstance(data, (str, bytes, torch.Tensor)):
        return fn(data)
    if isinstance(data, Mapping):
        items = {k: map_structure(fn, v) for k, v in data.items()}
        try:
            if isinstance(data, MutableMapping):
                clone = copy.copy(data)
                clone.update(items)
                return clone
            return type(data)(items)
        except TypeError:
            return items
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*(map_structure(fn, x) for x in data))
        try:
            return type(data)(map_structure(fn, x) for x in data)
        except TypeError:
            return tuple(map_structure(fn, x) for x in data)
    if isinstance(data, list):
        items = [map_structure(fn, x) for x in data]
        if type(data) is list:
            return items
        try:
            clone = copy.copy(data)
            clone[:] = items
            return clone
        except TypeError:
            return items
    return fn(data)
