"""A kuat dataset's image fields: encoded bytes in, a sample's values or the collated batch out.

By the field's transform (``Dataset.with_transform``):

- none: :func:`kuat.vision.decode.decode_image` per sample, ``(H, W, 3)`` uint8 RGB;
- a fused image transform (:mod:`kuat.vision.protocol`, each hook found with its accessor
  there) gets the encoded bytes, the oriented widths and heights and the samples' generators
  (:class:`kuat.rng.BatchGenerators`):

  - one that decodes whole batches on a device (``apply_encoded_batch``): one call;
  - one with a fixed ``output_size()``, in a batch fetch: one ``(B, 3, H, W)`` uint8 buffer
    (:func:`kuat._buffers.new_batch_buffer`, the batch's own memory), filled in one call
    (``apply_encoded_many``) or slot by slot (``apply_encoded(..., out=buf[j])``). That buffer
    *is* the collated batch: :func:`image_batch` returns it as it is, :func:`image_values` its
    B views ``buf[j]``;
  - otherwise per sample, a ``(3, H, W)`` uint8 tensor each;
- any other callable: per sample, on the decoded ``(3, H, W)`` uint8 tensor.

Every call into a transform runs with its sample's index set (``kuat.rng.sample_context``), so
``kuat.sample_rng()`` works inside it. Thread-safe (as the dataset's reads).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kuat.format.gather import ImageRows
from kuat.format.store import ImageBatch
from kuat.rng import BatchGenerators, sample_context
from kuat.vision import protocol as vision_protocol

__all__ = ["fills_batch", "fill_batch", "image_batch", "image_values"]


def image_values(c: ImageBatch, index_list: list, sid: np.ndarray, paths: list, t,
                 batch_buffer: bool) -> list:
    """The B per-sample values of an image field.

    Args:
        c: the field's gathered column (B encoded images with their oriented sizes).
        index_list: the B sample indices; sid: ``(B,)`` each sample's shard, in ``paths``.
        t: the field's transform, or ``None``.
        batch_buffer: whether a fused transform of fixed output size writes into one
            ``(B, 3, H, W)`` buffer (a batch fetch) rather than a fresh array per sample.

    Raises:
        kuat.DecodeError: an image cannot be decoded (names its index and shard).
    """
    values = _fetch(c, index_list, sid, paths, t, batch_buffer)
    return values if type(values) is list else list(values.unbind(0))  # B views of the buffer


def image_batch(c: ImageBatch, index_list: list, sid: np.ndarray, paths: list, t):
    """The collated batch of an image field: ``kuat.default_collate`` of
    :func:`image_values` (``batch_buffer=True``), without the per-sample round trip where there
    is none to make: a fused transform's ``(B, 3, H, W)`` uint8 batch buffer is returned as it
    is (the batch's own memory, C-contiguous, as the collate of its B views returns it)."""
    values = _fetch(c, index_list, sid, paths, t, True)
    if type(values) is not list:
        return values  # (B, 3, H, W): the batch buffer, already the batch
    from kuat.collate import default_collate

    return default_collate(values)


def fills_batch(t) -> tuple[int, int] | None:
    """``(H, W)`` when :func:`fill_batch` takes transform ``t``'s batches (a fused transform
    of fixed output size that fills a CPU batch buffer in one call), else ``None``. Asked once
    per dataset view (``Dataset.kuat_fetch_collated`` keeps the answer), not per batch."""
    if t is None or not vision_protocol.is_fused(t) or vision_protocol.decodes_batches(t):
        return None
    if not vision_protocol.fills_buffers(t):
        return None
    global _new_batch_array  # torch is imported when first needed, not with kuat
    if _new_batch_array is None:
        from kuat._buffers import new_batch_array

        _new_batch_array = new_batch_array
    return vision_protocol.output_size(t)


_new_batch_array = None  # kuat._buffers.new_batch_array (fills_batch)


def fill_batch(c, idx: np.ndarray, sid: np.ndarray, paths: list, t, how):
    """:func:`image_batch` for a transform :func:`fills_batch` took, with nothing made per
    sample in Python: the batch buffer, and either one call of ``fill`` (``how``: ``(size,
    fill)``, ``size`` :func:`fills_batch`'s answer, ``fill`` the transform's rows path,
    :func:`kuat.vision._rows.rows_filler`, or ``None``) on the rows of ``c`` (an
    :class:`kuat.format.gather.ImageRows`) with the shard ``paths``, or, where that does not
    take the batch, one
    ``apply_encoded_many`` call given ``c``'s ``(B,)`` width and height arrays and the
    samples' generators (:class:`kuat.rng.BatchGenerators` of ``idx``, the ``(B,)`` int64
    checked indices). Indices and sources go as lazy sequences (made into ints and paths only
    for a sample an error or the per-image path names). Returns the ``(B, 3, H, W)`` uint8
    batch buffer.

    Raises:
        kuat.DecodeError: a sample cannot be decoded (the transform's, naming it).
    """
    (h, w), fill = how
    buf, out = _new_batch_array((len(idx), 3, h, w))  # (B, 3, H, W) uint8 tensor and array
    if fill is None or type(c) is not ImageRows or not fill(c, out, paths):
        t.apply_encoded_many(c.data, c.width, c.height, BatchGenerators(idx), out,
                             indices=_Indices(idx), sources=_Sources(sid, paths))
    return buf


class _Indices(Sequence):
    """The batch's sample indices as Python ints, ``(B,)`` int64 ``idx`` read on access."""

    __slots__ = ("_idx",)

    def __init__(self, idx: np.ndarray):
        self._idx = idx

    def __len__(self) -> int:
        return len(self._idx)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return self._idx[j].tolist()
        return int(self._idx[j])


class _Sources(Sequence):
    """The batch's shard paths, ``paths[sid[j]]``, looked up on access."""

    __slots__ = ("_sid", "_paths")

    def __init__(self, sid: np.ndarray, paths: list):
        self._sid, self._paths = sid, paths

    def __len__(self) -> int:
        return len(self._sid)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self._paths[k] for k in self._sid[j].tolist()]
        return self._paths[int(self._sid[j])]


def _decode(data, index: int, source: str) -> np.ndarray:
    """Encoded image -> ``(H, W, 3)`` uint8 RGB (``kuat.vision.decode.decode_image``)."""
    from kuat.vision.decode import decode_image

    return decode_image(data, index=index, source=source)


def _fetch(c: ImageBatch, index_list, sid, paths, t, batch_buffer: bool):
    """B values, or the filled ``(B, 3, H, W)`` batch buffer (a tensor, not a list)."""
    sources = [paths[k] for k in sid.tolist()]
    if t is None:
        return [_decode(d, i, s) for d, i, s in zip(c.data, index_list, sources)]
    import torch

    if not vision_protocol.is_fused(t):
        values = []
        for d, i, s in zip(c.data, index_list, sources):
            hwc = _decode(d, i, s)  # (H, W, 3) uint8
            if not hwc.flags.writeable:  # torch tensors must own writable memory
                hwc = hwc.copy()
            chw = torch.from_numpy(hwc).permute(2, 0, 1)  # -> (3, H, W) view
            with sample_context(i):
                values.append(t(chw))
        return values
    widths, heights = c.width.tolist(), c.height.tolist()
    # the batch's generators, both SeedSequence hashes done at once, each generator made when
    # first asked for (kuat.rng.BatchGenerators)
    rngs = BatchGenerators(index_list)
    if vision_protocol.decodes_batches(t):  # e.g. Compose(decode_device="cuda"): nvJPEG, one call
        out = t.apply_encoded_batch(c.data, widths, heights, rngs, indices=index_list,
                                    sources=sources)
        return list(out)  # (B, 3, H, W) on the device -> B views, or B tensors
    loc = vision_protocol.takes_location(t)
    size = vision_protocol.output_size(t)
    if size is not None and batch_buffer:
        from kuat._buffers import new_batch_buffer

        h, w = size
        buf = new_batch_buffer((len(index_list), 3, h, w), torch.uint8)  # (B, 3, H, W)
        slots = buf.numpy()  # (B, 3, H, W) array view: slots[j] costs no tensor op
        if vision_protocol.fills_buffers(t):  # the whole batch in one call (GIL released once)
            t.apply_encoded_many(c.data, widths, heights, rngs, slots, indices=index_list,
                                 sources=sources)
            return buf
        for j, (d, wd, ht, i, s) in enumerate(zip(c.data, widths, heights, index_list, sources)):
            kw = {"index": i, "source": s} if loc else {}
            with sample_context(i):
                t.apply_encoded(d, wd, ht, rngs[j], out=slots[j], **kw)
        return buf
    values = []
    for j, (d, wd, ht, i, s) in enumerate(zip(c.data, widths, heights, index_list, sources)):
        kw = {"index": i, "source": s} if loc else {}
        with sample_context(i):
            arr = t.apply_encoded(d, wd, ht, rngs[j], **kw)
        values.append(torch.from_numpy(np.ascontiguousarray(arr)))  # (3, H, W) uint8
    return values
