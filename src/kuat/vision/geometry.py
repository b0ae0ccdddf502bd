"""Crop geometry shared by the CPU path (``transforms.py``) and the GPU path (``gpu.py``).

A fused transform plans its crop box in the image's *oriented* coordinates (what
``decode_image`` returns, as the dataset's index records width and height) and decodes the
*stored* bytes, so both paths map the planned box to the stored orientation
(:func:`stored_crop_box`) and then to whole pixels of the decoded grid (:func:`snap`). One
definition keeps the two paths' boxes identical: the GPU path is the CPU path at scale 1.

Pure functions of numbers; thread-safe; no torch, no NumPy.
"""

from __future__ import annotations

from kuat.vision import _exif

__all__ = ["snap", "stored_crop_box"]


def snap(start: float, length: float, scale: float, size: int) -> tuple[int, int]:
    """Rows (or columns) ``[a, b)`` of a decode at ``scale`` that the source span
    ``[start, start + length)`` covers: each edge rounded to the nearest decoded pixel edge.

    At scale 1 this is torchvision's integer box. At a reduced scale ``1/k`` it moves each
    edge of the box by at most ``k/2`` source pixels (the crop is then at least ``k`` times the
    output, so < 1/4 of an output pixel): cheaper than a sub-pixel resampler, and the pixels
    equal torchvision's ``resized_crop`` of that snapped box (same filter, same quality).
    ``size`` is the decoded grid's length (pixels); ``0 <= a < b <= size``.
    """
    a = min(max(round(start * scale), 0), size - 1)
    b = min(max(round((start + length) * scale), a + 1), size)
    return a, b


def stored_crop_box(
    plan, orientation: int, stored_h: int, stored_w: int, width: int, height: int
) -> tuple[float, float, float, float]:
    """The planned box ``(top, left, height, width)`` in the stored orientation, full size.

    Args:
        plan: the sample's plan (``top``, ``left``, ``height``, ``width`` in oriented pixels of
            a ``width`` x ``height`` image).
        orientation: the bytes' EXIF orientation (1-8).
        stored_h, stored_w: the size of the bytes as stored (before orientation), pixels.
        width, height: the oriented size the plan was drawn for (the dataset's index). If the
            bytes disagree with it, the box keeps its position relative to the image.

    Returns:
        ``(top, left, h, w)`` in stored pixels (floats), for :func:`snap`.
    """
    transposed = orientation in _exif.TRANSPOSED
    full_w, full_h = (stored_h, stored_w) if transposed else (stored_w, stored_h)
    top, left, bh, bw = plan.top, plan.left, plan.height, plan.width
    if (full_w, full_h) != (width, height):  # the index disagrees: keep the relative box
        fy, fx = full_h / height, full_w / width
        top, left, bh, bw = top * fy, left * fx, bh * fy, bw * fx
    return _exif.stored_box(orientation, stored_h, stored_w, top, left, bh, bw)
