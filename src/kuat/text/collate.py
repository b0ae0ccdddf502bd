"""Batches of packed rows: ``cu_seqlens`` for variable-length attention, document masks.

:func:`pack_collate` stacks rows of :func:`kuat.pack` and adds what attention kernels need to
keep documents apart:

* ``cu_seqlens (S + 1,) int32`` and ``max_seqlen`` (int): the segment boundaries over the
  flattened ``B * L`` tokens, the arguments of ``flash_attn_varlen_func`` and of PyTorch's
  variable-length attention (a row's padding is a segment of its own, so the boundaries cover
  every token);
* ``document_ids (B, L) int32``: the segment each token belongs to (numbered over the batch);
  the input of :func:`document_mask` (dense, for ``scaled_dot_product_attention``) and
  :func:`flex_block_mask` (a flex-attention ``BlockMask``), both built on whatever device the
  ids are on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

__all__ = ["pack_collate", "PackCollate", "document_mask", "flex_block_mask"]

_ROW_FIELDS = ("input_ids", "labels", "position_ids")


def pack_collate(*, padding_free: bool = False, document_mask: bool = False) -> PackCollate:
    """A collate function for rows of :func:`kuat.pack`.

    For B rows of length L it returns a dict:

    * ``input_ids``, ``labels``, ``position_ids``: ``(B, L) int64``; with ``padding_free``,
      the rows' documents concatenated into one row, padding removed: ``(1, T) int64``,
      ``T`` the batch's real tokens (Hugging Face's ``DataCollatorWithFlattening`` layout);
    * ``cu_seqlens (S + 1,) int32``, ``max_seqlen`` (int), ``document_ids (B, L) int32`` (or
      ``(1, T)``): see the module docstring; ``cu_seqlens[-1]`` is ``B * L`` (or ``T``);
    * ``document_lengths (S,) int32``: the segments' lengths (``diff(cu_seqlens)``);
    * with ``document_mask``, ``attention_mask (B, 1, L, L) bool``: :func:`document_mask` of the
      ids (True where a query may attend a key). It holds ``B * L * L`` bytes: for long rows
      build :func:`flex_block_mask` on the device instead.

    Returns:
        A picklable callable, safe to call from several threads.

    Raises (when called):
        ValueError: an empty batch, rows of different lengths (each row's length is listed), or a
            row whose ``document_lengths`` sum past its length.
        KeyError: a row without one of ``input_ids``, ``labels``, ``position_ids``,
            ``document_lengths``.
    """
    return PackCollate(bool(padding_free), bool(document_mask))


class PackCollate:
    """The callable :func:`pack_collate` returns."""

    def __init__(self, padding_free: bool, document_mask: bool):
        self.padding_free = padding_free
        self.document_mask = document_mask

    def __repr__(self) -> str:
        return f"pack_collate(padding_free={self.padding_free}, document_mask={self.document_mask})"

    def __call__(self, rows: Sequence[Mapping]) -> dict:
        if len(rows) == 0:
            raise ValueError("pack_collate got an empty batch")
        for i, row in enumerate(rows):
            for key in (*_ROW_FIELDS, "document_lengths"):
                if key not in row:
                    raise KeyError(f"pack_collate: row {i} has no {key!r} (keys {list(row)})")
        widths = [len(r["input_ids"]) for r in rows]
        if len(set(widths)) > 1:
            raise ValueError(f"pack_collate: rows of different lengths {widths}")
        width = widths[0]
        docs = [torch.as_tensor(r["document_lengths"], dtype=torch.int64) for r in rows]
        used = [int(d.sum()) for d in docs]
        for i, n in enumerate(used):
            if n > width:
                raise ValueError(
                    f"pack_collate: row {i}'s document_lengths sum to {n} > its length {width}"
                )
        out = {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in _ROW_FIELDS}
        if self.padding_free:
            keep = torch.arange(width)[None, :] < torch.tensor(used)[:, None]  # (B, L) bool
            out = {k: v[keep][None, :] for k, v in out.items()}  # (B, L) -> (1, T)
            segments = torch.cat(docs)  # (S,)
        else:
            parts = []
            for d, n in zip(docs, used, strict=True):
                parts.append(d)
                if n < width:
                    parts.append(torch.tensor([width - n]))  # the padding: its own segment
            segments = torch.cat(parts)  # (S,)
        segments = segments[segments > 0]
        cu = torch.zeros(len(segments) + 1, dtype=torch.int32)  # (S + 1,)
        torch.cumsum(segments, 0, out=cu[1:])
        shape = out["input_ids"].shape
        if segments.device.type == "cpu":
            # NumPy, not torch.repeat_interleave: torch splits these ~B * L elements over its
            # intra-op threads, and on a busy machine their barrier cost 16 ms a batch, not
            # 0.01 ms (B = 8, L = 2048, 2 threads, 2 loaded cores; 0.04 ms with one thread)
            index = np.arange(len(segments), dtype=np.int32)  # (S,)
            ids = torch.from_numpy(np.repeat(index, segments.numpy()))  # (B * L,) int32
        else:
            ids = torch.repeat_interleave(
                torch.arange(len(segments), dtype=torch.int32, device=segments.device), segments
            )
        out["cu_seqlens"] = cu
        out["max_seqlen"] = int(segments.max()) if len(segments) else 0
        out["document_ids"] = ids.reshape(shape)  # (B * L,) -> (B, L) int32
        out["document_lengths"] = segments.to(torch.int32)  # (S,)
        if self.document_mask:
            out["attention_mask"] = document_mask(out["document_ids"])
        return out


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The block-causal document mask: ``(B, L) -> (B, 1, L, L) bool``, True where query ``q``
    may attend key ``k``: same document and ``k <= q`` (``scaled_dot_product_attention``'s
    boolean ``attn_mask`` convention). On the ids' device.

    Raises:
        ValueError: ``document_ids`` is not 2-d.
    """
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids should be (B, L), got shape {tuple(document_ids.shape)}")
    length = document_ids.shape[1]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, L, L)
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril_()
    return (same & causal)[:, None]  # (B, 1, L, L)


def flex_block_mask(document_ids: torch.Tensor, *, block_size: int = 128):
    """The same mask as :func:`document_mask`, as a flex-attention ``BlockMask`` built on the
    ids' device (no dense ``L x L`` tensor; blocks that no query of a document reaches are
    skipped by ``torch.nn.attention.flex_attention.flex_attention``).

    Args:
        document_ids: ``(B, L)`` int, from :func:`pack_collate` (move it to the device first).
        block_size: the mask's block size (flex attention's default, 128).

    Raises:
        ValueError: ``document_ids`` is not 2-d.
        RuntimeError: this torch has no flex attention (it came in torch 2.5).
    """
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids should be (B, L), got shape {tuple(document_ids.shape)}")
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError as e:
        raise RuntimeError(f"flex attention needs torch >= 2.5, this is {torch.__version__}") from e
    ids = document_ids

    def mask_mod(b, h, q, k):
        return (ids[b, q] == ids[b, k]) & (k <= q)

    batch, length = ids.shape
    return create_block_mask(
        mask_mod, batch, None, length, length, device=ids.device, BLOCK_SIZE=block_size
    )
