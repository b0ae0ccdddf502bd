"""One sample through the fused path: a drawn plan in, its pixels in the batch slot out.

``Compose([RandomResizedCrop(224), RandomHorizontalFlip()])`` on a kuat dataset implements
:class:`kuat.vision.protocol.FusedImageTransform`. Per sample, ``apply_encoded``:

1. plans the geometry from the image's (oriented) width and height and the sample's
   generator: a source box resampled to a grid, an integer window of that grid, a flip
   (:class:`kuat.vision.geometry.Plan`, drawn by ``Compose.plan``), with no pixel touched yet;
2. picks the smallest DCT scale (1/8, 1/4, 1/2, 1) at which the box still has at least the
   grid's pixels, and snaps the box to that scale's pixel grid (``geometry.snap``: exact at scale 1;
   at scale ``1/k`` each edge moves by at most ``k/2`` source pixels);
3. decodes only that box: with the optional ROI decoder (``_roijpeg.c``, libjpeg-turbo's
   skip/crop scanlines) just its rows and columns are reconstructed and nothing below it is
   read; without it the whole image is decoded at that scale by simplejpeg into a per-thread
   scratch buffer and the box is a view. Either way the pixels are identical;
4. resizes the box once, bilinear with antialiasing, in the image's stored orientation;
5. applies EXIF orientation, the window and the flip as strided views while copying into
   ``out``, the sample's ``(3, H, W)`` slot of the batch buffer.

This module is steps 2-5 (:func:`write_planned`). Steps 4-5 have two implementations
(``Compose(..., exact_resize=...)``):

* fused (default, when the ROI decoder is built): one C pass (``_roijpeg.c``
  ``resize_planar``) resizes the RGBX crop and writes it planar, flipped, straight into
  ``out``. Its arithmetic is torch's uint8 antialiased kernel's (the one torchvision v2 uses
  for uint8 tensors, itself Pillow-SIMD's): the same filter weights, computed the same way in
  float64 and rounded to int16 with the same precision rule (:func:`kuat.vision.resize.taps`,
  cached per (input, output) size), a horizontal pass then a vertical one through a uint8
  intermediate, the same rounding and clamping. Bound: at most 1 grey level from
  ``exact_resize=True`` at any pixel (rounding of equal integer sums cannot differ more);
  measured: equal pixels (tests compare hundreds of sizes). Per image it saves the strided
  ``(H, W, 3) -> (3, H, W)`` copy and torch's call overhead (``benchmarks/bench_vision.py``
  measures it). Used for plans without a window (``RandomResizedCrop``) on images whose EXIF
  orientation is 1 or 2 (mirror) decoded by the ROI decoder; anything else takes the exact path.
* exact (``exact_resize=True``): torch's kernel (``_upsample_bilinear2d_aa`` on a
  channels-last tensor), then a strided copy into ``out``: kuat's pixels before the fused
  kernel existed.

So a sample costs one partial (and possibly reduced) decode, one resize and at most one small
copy. With the ROI decoder, damage to a JPEG below the crop goes unnoticed (those bytes are
never decoded); a crop that reaches it raises ``kuat.DecodeError``. A whole batch of such
samples goes through one C call instead (``Compose.apply_encoded_many``, the same pixels).

Thread-safety: every function may run in many threads at once (scratch buffers are per thread).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kuat.vision import _exif
from kuat.vision.decode import (
    check_pixels,
    decode_jpeg_roi,
    decode_stored,
    pick_scale,
    resize_rgbx_planar,
    roi_header,
)
from kuat.vision.geometry import snap, stored_crop_box
from kuat.vision.resize import resize_aa, taps

__all__ = ["ROI_CHANNELS", "UNFUSED_ORIENTATIONS", "decode_crop", "roi_region", "write_planned"]

logger = logging.getLogger("kuat.vision")
# RGB (3) or RGBX (4) from the ROI decoder. RGBX lets torch's uint8 resize skip its RGB ->
# RGBX unpacking, but measured per image in the whole fused path the two are equal, and RGB
# moves fewer bytes.
ROI_CHANNELS = 3
# EXIF orientations the fused resize leaves to the exact path (rotations, vertical flips,
# transposes); 1, 2 (a mirror, folded into the flip) and unknown values (no-ops) are fused.
UNFUSED_ORIENTATIONS = frozenset({3, 4, 5, 6, 7, 8})


def roi_region(plan, hdr, width, height) -> tuple[int, int, int, int, int]:
    """``(scale_num, y0, y1, x0, x1)``: the smallest sufficient DCT scale (``scale_num``/8)
    and the plan's box on that scaled grid in the stored orientation, for the ROI
    decoder (``hdr``: the JPEG's stored size and orientation; ``width``/``height``: its
    oriented size from the dataset's index)."""
    k = pick_scale(plan.min_scale())
    s = k / 8
    ph, pw = -(-hdr.height * k // 8), -(-hdr.width * k // 8)  # libjpeg's scaled size
    top, left, bh, bw = stored_crop_box(
        plan, hdr.orientation, hdr.height, hdr.width, width, height
    )
    y0, y1 = snap(top, bh, s, ph)
    x0, x1 = snap(left, bw, s, pw)
    return k, y0, y1, x0, x1


def write_planned(data, width, height, plan, out, index, source, *, max_pixels, exact_resize):
    """Steps 2-5 of the module docstring for a drawn, fusable ``plan``: decode its box, resize,
    orient, window and flip into ``out``.

    Args:
        data: the encoded image; width, height: its oriented size (the dataset's index).
        plan: the sample's drawn :class:`kuat.vision.geometry.Plan` (``plan.fusable``).
        out: ``(3, cur_h, cur_w)`` uint8 array (may be a strided view), or ``None``.
        index, source: for error messages only.
        max_pixels, exact_resize: the ``Compose``'s.

    Returns:
        ``(3, H, W)`` uint8 array: ``out`` itself when given.

    Raises:
        kuat.DecodeError: the bytes cannot be decoded or are above ``max_pixels``.
        ValueError: ``out`` has the wrong shape or dtype.
    """
    oh, ow = plan.cur_h, plan.cur_w
    if out is None:
        out = np.empty((3, oh, ow), np.uint8)
    elif out.shape != (3, oh, ow) or out.dtype != np.uint8:
        raise ValueError(f"out must be (3, {oh}, {ow}) uint8, got {out.shape} {out.dtype}")
    # RGBX from the ROI decoder for the fused kernel (4-byte pixels: one load each)
    channels = ROI_CHANNELS if exact_resize else 4
    crop, orientation = decode_crop(data, width, height, plan, index, source, max_pixels, channels)
    transposed = orientation in _exif.TRANSPOSED
    grid = (plan.res_w, plan.res_h) if transposed else (plan.res_h, plan.res_w)  # stored
    if (
        crop.shape[2] == 4  # the ROI decoder's contiguous RGBX crop
        and orientation not in UNFUSED_ORIENTATIONS
        and plan.window() is None
        and out.flags.c_contiguous
        and resize_rgbx_planar(
            crop,
            out,
            plan.flip != (orientation == 2),  # EXIF 2 is a mirror: one more flip
            taps(crop.shape[1], grid[1]),
            taps(crop.shape[0], grid[0]),
        )
    ):  # (h, w, 4) -> resized, planar, flipped: (3, H, W) in out, no copy
        return out
    if crop.shape[:2] == grid:
        crop = crop[:, :, :3]  # (h, w, 3) view (drops X if the ROI decoder gave RGBX)
    else:
        # (h, w, 3) -> (1, 3, h, w) channels_last, the layout of torch's AVX2 uint8 kernel
        # (the ROI crop already is; a view into a full decode is copied, NumPy's row copy
        # being ~2x faster than torch's .contiguous() for this)
        src = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1).unsqueeze(0)
        crop = resize_aa(src, grid).numpy()[0]  # (C, gh, gw), channels_last strides
        crop = crop.transpose(1, 2, 0)[:, :, :3]  # -> (gh, gw, 3) view
    res = _exif.orient(crop, orientation)  # (H, W, 3) view
    win = plan.window()
    if win is not None:
        res = res[win]
    dst = out.transpose(1, 2, 0)  # (H, W, 3) view of the (3, H, W) slot
    if plan.flip:
        dst = dst[:, ::-1]
    np.copyto(dst, res)
    return out


def decode_crop(data, width, height, plan, index, source, max_pixels, channels=ROI_CHANNELS):
    """The plan's box, decoded at the smallest sufficient DCT scale and snapped to its
    pixel grid: ``((h, w, C) uint8 view in stored orientation, EXIF orientation)``, with
    C = ``channels`` (3 RGB or 4 RGBX) from the ROI decoder, 3 (RGB) otherwise.

    With the ROI decoder only the box's rows and columns are reconstructed; otherwise
    the whole image is decoded (at that scale) and the box is a view into it.
    """
    hdr = roi_header(data)
    if hdr is not None:
        check_pixels(hdr.width, hdr.height, max_pixels, index, source)
        k, y0, y1, x0, x1 = roi_region(plan, hdr, width, height)
        try:
            return decode_jpeg_roi(data, k, y0, y1, x0, x1, channels), hdr.orientation
        except ValueError as e:  # corrupt or libjpeg warnings: the full path decides
            logger.debug("ROI decode failed (sample %s): %s; decoding in full", index, e)
    d = decode_stored(
        data,
        min_scale=plan.min_scale(),
        max_pixels=max_pixels,
        index=index,
        source=source,
        reuse_buffer=True,
    )
    top, left, bh, bw = stored_crop_box(plan, d.orientation, d.height, d.width, width, height)
    pixels = d.pixels  # (ph, pw, 3) at scale d.scale, stored orientation
    y0, y1 = snap(top, bh, d.scale, pixels.shape[0])  # box edges on the decoded grid
    x0, x1 = snap(left, bw, d.scale, pixels.shape[1])
    return pixels[y0:y1, x0:x1], d.orientation
