"""A kuat dataset's image rows to a finished batch in one C call (``Compose``'s rows path).

What ``Dataset.kuat_fetch_collated`` runs for an image field whose transform is a
:class:`kuat.vision.Compose` of ``RandomResizedCrop`` then flips (the ImageNet training
recipe) with a fixed output size: ``_roijpeg.c``'s ``plan_decode_rows`` takes the batch as
rows of the stored column (:class:`kuat.format.gather.ImageRows`: the shards' tables, each
row's shard and row in it, the sample indices) and, with the GIL released once, reads each
row's bytes and oriented size, hashes its seeding words, draws its box and decodes and resizes
it into its slot. No per-row view, no ``(B,)`` size, word or draw array and no generator is
made: the same pixels as ``Compose.apply_encoded_many`` on the gathered views (what the batch
takes when this path does not: an epoch's first batch split over idle cores, a shard of the
batch not mapped, ``exact_resize``, another chain of steps). Samples the C call leaves (not a
JPEG the ROI decoder takes, EXIF-rotated, over ``max_pixels``, a failed decode) go through the
per-image path afterwards, in sample order, from fresh generators (the C planner drew nothing
from their streams), as ``apply_encoded_many`` takes them.
"""

from __future__ import annotations

import functools
import logging
import time

from kuat import _native, _parallel
from kuat.rng import BatchGenerators, current_epoch
from kuat.vision.compose import Compose
from kuat.vision.decode import roi_function
from kuat.vision.steps import rrc_params

__all__ = ["rows_filler"]

logger = logging.getLogger("kuat.vision")
_MASK64 = (1 << 64) - 1


def rows_filler(t):
    """``fill(rows, out, paths) -> bool`` for transform ``t`` when it can take a
    batch's rows in one C call (a :class:`kuat.vision.Compose` of ``RandomResizedCrop`` then
    flips, with the ROI decoder's ``plan_decode_rows``), else ``None``. Asked once per dataset
    view (its transforms are fixed when it is made)."""
    if type(t) is not Compose or t._c_plan is None or roi_function("plan_decode_rows") is None:
        return None
    return functools.partial(_fill, t)  # fill(rows, out, paths) (no Python frame of its own)


def _fill(t, rows, out, paths: list) -> bool:
    """Sample ``j``'s pixels into ``out[j]`` (``(B, 3, H, W)`` uint8, C-contiguous) for the
    ``rows`` (:class:`kuat.format.gather.ImageRows`) of a batch, as
    ``t.apply_encoded_many(rows.data, rows.width, rows.height, BatchGenerators(rows.idx),
    out, indices=..., sources=...)`` fills it, the sample indices and shard paths (``paths``:
    the store's, by shard id) named only in a sample's error. Returns ``False`` with nothing
    written when this path does not take the batch (the caller calls that), else ``True``.

    Raises:
        kuat.DecodeError: a sample cannot be decoded (the lowest such ``j``).
        ValueError: a sample's stored size is not positive (the lowest such ``j``, before any
            per-image decode, as the Python planner raises), or the rows do not fit their
            shards' columns.
    """
    size = t._output_size
    if (t.exact_resize or _parallel.width() > 1 or out.shape != (len(rows.sid), 3, *size)
            or not out.flags.c_contiguous):
        return False  # (split over idle cores, or a layout apply_encoded_many reports)
    rrc, flips = t._c_plan
    seed, epoch = current_epoch()
    t0 = time.perf_counter(), time.thread_time()  # (_native.clock(), inlined)
    res = roi_function("plan_decode_rows")(
        rows.table, rows.sid, rows.local, rows.idx, out, *size,
        *rrc_params(rrc, flips, t.max_pixels), seed & _MASK64, epoch & _MASK64)
    _native.add_since(t0)  # kernel seconds for stats()["busy_s"]["native"]
    if type(res) is int:  # a shard of the batch not mapped: the gathered views' path maps it
        return False
    unplanned, failed = res
    if unplanned or failed:
        _rest(t, rows, out, unplanned, failed, paths)
    return True


def _rest(t, rows, out, unplanned: list, failed: list, paths: list) -> None:
    """The samples ``plan_decode_rows`` left, through ``t``'s per-image path in sample order."""
    idx, sid = rows.idx.tolist(), rows.sid.tolist()  # (B,) int64 -> ints
    from kuat.vision.resize import single_threaded_torch

    single_threaded_torch()
    for j, reason in failed:
        logger.debug("batch decode skipped sample %s: %s", idx[j], reason)
    later = sorted([*unplanned, *(j for j, _ in failed)])
    widths, heights = rows.width, rows.height  # (B,) int32, gathered now
    for j in later:  # the Python planner raises for the first such sample, before any decode
        if widths[j] <= 0 or heights[j] <= 0:
            raise ValueError(f"width and height must be positive, got {widths[j]}x{heights[j]}")
    # fresh generators (no stream drawn from); the samples' shard paths for their errors
    t._per_image([(j, None) for j in later], rows.data, widths, heights,
                 BatchGenerators(rows.idx), out, idx, [paths[s] for s in sid])
