"""Crop geometry shared by the CPU path (``compose.py``, ``fused.py``) and the GPU path
(``gpu.py``): a sample's :class:`Plan`, its box in the stored orientation, its decoded pixels.

A fused transform plans its crop box in the image's *oriented* coordinates (what
``decode_image`` returns, as the dataset's index records width and height) and decodes the
*stored* bytes, so both paths map the planned box to the stored orientation
(:func:`stored_crop_box`) and then to whole pixels of the decoded grid (:func:`snap`). One
definition keeps the two paths' boxes identical: the GPU path is the CPU path at scale 1.

Numbers only: no torch, no NumPy. The functions are pure and thread-safe; a :class:`Plan` is
one sample's, built and read in one thread.
"""

from __future__ import annotations

from kuat.vision import _exif

__all__ = ["Plan", "snap", "stored_crop_box"]


class Plan:
    """The geometry of one sample: resample a source box to a grid, take a window, flip.

    The output is ``resample(source[box] -> (res_h, res_w))[win_i : win_i + cur_h,
    win_j : win_j + cur_w]``, mirrored when ``flip``. ``top, left, height, width`` (floats)
    are the box in the oriented source image. Keeping the window separate from the box makes
    ``Resize(256), CenterCrop(224)`` exactly torchvision's resize-then-crop (integer window in
    the resized grid), while ``RandomResizedCrop`` is one integer box resampled once.
    """

    __slots__ = (
        "top", "left", "height", "width", "res_h", "res_w",
        "win_i", "win_j", "cur_h", "cur_w", "flip", "fusable",
    )  # fmt: skip

    def __init__(self, height: int, width: int):
        self.top = 0.0
        self.left = 0.0
        self.height = float(height)
        self.width = float(width)
        self.res_h, self.res_w = height, width
        self.win_i = self.win_j = 0
        self.cur_h, self.cur_w = height, width
        self.flip = False
        self.fusable = True

    def crop(self, i: int, j: int, h: int, w: int) -> None:
        """Crop rows ``i:i+h``, columns ``j:j+w`` of the current image."""
        if self.flip:  # the current image is mirrored: map the box back
            j = self.cur_w - j - w
        self.win_i += i
        self.win_j += j
        self.cur_h, self.cur_w = h, w

    def resize(self, h: int, w: int) -> None:
        """Resize the current image to ``h x w``: the window becomes the box to resample."""
        if (self.win_i, self.win_j, self.cur_h, self.cur_w) != (0, 0, self.res_h, self.res_w):
            sy = self.height / self.res_h
            sx = self.width / self.res_w
            self.top += self.win_i * sy
            self.left += self.win_j * sx
            self.height = self.cur_h * sy
            self.width = self.cur_w * sx
        self.res_h, self.res_w = h, w
        self.win_i = self.win_j = 0
        self.cur_h, self.cur_w = h, w

    def min_scale(self) -> float:
        """Smallest decode scale at which the box still has at least the grid's pixels."""
        return min(1.0, max(self.res_h / self.height, self.res_w / self.width))

    def window(self) -> tuple[slice, slice] | None:
        """Row and column slices of the window in the grid, or None for the whole grid."""
        if (self.win_i, self.win_j, self.cur_h, self.cur_w) == (0, 0, self.res_h, self.res_w):
            return None
        return (
            slice(self.win_i, self.win_i + self.cur_h),
            slice(self.win_j, self.win_j + self.cur_w),
        )


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
