"""Image augmentations that run fused into the decode: plan the crop, decode only what it needs.

``Compose([RandomResizedCrop(224), RandomHorizontalFlip()])`` on a kuat dataset implements
:class:`kuat.vision.protocol.FusedImageTransform`. Per sample, ``apply_encoded``:

1. plans the geometry from the image's (oriented) width and height and the sample's
   generator: a source box resampled to a grid, an integer window of that grid, a flip
   (``_Plan``), with no pixel touched yet;
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

Steps 4-5 have two implementations (``Compose(..., exact_resize=...)``):

* fused (default, when the ROI decoder is built): one C pass (``_roijpeg.c``
  ``resize_planar``) resizes the RGBX crop and writes it planar, flipped, straight into
  ``out``. Its arithmetic is torch's uint8 antialiased kernel's (the one torchvision v2 uses
  for uint8 tensors, itself Pillow-SIMD's): the same filter weights, computed the same way in
  float64 and rounded to int16 with the same precision rule (:func:`_taps`, cached per
  (input, output) size), a horizontal pass then a vertical one through a uint8 intermediate,
  the same rounding and clamping. Bound: at most 1 grey level from ``exact_resize=True`` at
  any pixel (rounding of equal integer sums cannot differ more); measured: equal pixels
  (tests compare hundreds of sizes). Per image it saves the strided ``(H, W, 3) -> (3, H, W)``
  copy and torch's call overhead (``benchmarks/bench_vision.py`` measures it). Used for
  plans without a window (``RandomResizedCrop``) on images whose EXIF orientation is 1 or 2
  (mirror) decoded by the ROI decoder; anything else takes the exact path.
* exact (``exact_resize=True``): torch's kernel (``_upsample_bilinear2d_aa`` on a
  channels-last tensor), then a strided copy into ``out``: kuat's pixels before the fused
  kernel existed.

So a sample costs one partial (and possibly reduced) decode, one resize and at most one small
copy.
With the ROI decoder, damage to a JPEG below the crop goes unnoticed (those bytes are never
decoded); a crop that reaches it raises ``kuat.DecodeError``. ``Normalize`` is not
run per sample: ``batch_transform()`` returns it and the loader applies it to the collated
``(B, 3, H, W)`` uint8 batch on its device.

The geometry matches torchvision's transforms: ``RandomResizedCrop`` draws its box with
torchvision's ``RandomResizedCrop.get_params`` algorithm (same distribution; draws come from
the NumPy generator instead of torch's global one), ``Resize(int)`` resizes the shorter side
(``torchvision.transforms.functional._compute_resized_output_size``), ``CenterCrop`` rounds
its offsets as torchvision does. ``Resize(256), CenterCrop(224)`` resizes the whole image and
takes the window, exactly as torchvision does (equal pixels at full scale); a chain that
resizes twice (``Resize`` then ``RandomResizedCrop``) is fused into one resize of the combined
box, so its pixels differ slightly from torchvision's two resamplings, not its geometry. For the
same crop box at full scale the output equals torchvision's ``F.resized_crop(...,
antialias=True)`` on a uint8 tensor; at a reduced DCT scale it stays within a mean absolute
difference of about 0.4 (1/2) to 0.9 (1/4) grey levels of it (tests measure it).

Every transform also works on its own (``__call__``) on a decoded ``(..., 3, H, W)`` uint8
``torch.Tensor`` (returns a tensor) or an ``(H, W, 3)`` uint8 NumPy array (returns one).
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kuat import _native, _parallel
from kuat.vision import _exif
from kuat.vision import decode as _decode
from kuat.vision.decode import (
    DEFAULT_MAX_PIXELS,
    _check_pixels,
    _pick_scale,
    decode_image,
    decode_jpeg_roi,
    decode_resize_batch,
    decode_stored,
    resize_rgbx_planar,
    roi_batch_available,
    roi_header,
    shares_jobs,
)
from kuat.vision.geometry import snap, stored_crop_box

__all__ = [
    "Compose",
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "RandomHorizontalFlip",
    "Normalize",
]

logger = logging.getLogger("kuat.vision")
_local = threading.local()
# RGB (3) or RGBX (4) from the ROI decoder. RGBX lets torch's uint8 resize skip its RGB ->
# RGBX unpacking, but measured per image in the whole fused path the two are equal, and RGB
# moves fewer bytes.
_ROI_CHANNELS = 3
# EXIF orientations the fused resize leaves to the exact path (rotations, vertical flips,
# transposes); 1, 2 (a mirror, folded into the flip) and unknown values (no-ops) are fused.
_UNFUSED_ORIENTATIONS = frozenset({3, 4, 5, 6, 7, 8})
_upsample_aa = getattr(torch._C._nn, "_upsample_bilinear2d_aa", None)


def _resize_aa(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``F.interpolate(x, size, mode="bilinear", antialias=True, align_corners=False)`` for a
    ``(N, C, H, W)`` tensor, calling the ATen op directly when it exists (saves ~10 us of
    Python argument checks per sample; the op releases the GIL)."""
    t0 = time.perf_counter()
    if _upsample_aa is not None:
        y = _upsample_aa(x, size, False)
    else:
        y = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    _native.add(time.perf_counter() - t0)  # kernel seconds for stats()["busy_s"]["native"]
    return y


@functools.lru_cache(maxsize=4096)
def _taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Fixed-point weights of a bilinear antialiased resize of one axis, ``in_size`` ->
    ``out_size`` pixels: ``(start, weights, taps, precision)``.

    ``start`` ``(out_size,)`` int32 is the first source pixel of each output pixel and
    ``weights`` ``(out_size, taps)`` int16 its weights with ``precision`` fraction bits;
    every window ``[start, start + taps)`` lies inside ``[0, in_size)`` (windows at the far
    edge are moved left, their weights shifted right, zeros elsewhere).

    This is torch's computation for uint8 (``aten/src/ATen/native/UpSample.h``
    ``_compute_index_ranges_weights`` with the triangle filter, then
    ``_compute_index_ranges_int16_weights``), itself Pillow's ``precompute_coeffs``: scale
    ``in/out``, support ``max(scale, 1)``, centre ``scale * (i + 0.5)``, window
    ``[int(centre - support + 0.5), int(centre + support + 0.5))`` clipped to the image,
    weights ``1 - |(j - centre + 0.5) / max(scale, 1)|`` normalised to sum 1 in float64, then
    scaled by ``2**precision`` (the largest that keeps the biggest weight below 2**15) and
    rounded half away from zero. Cached: a corpus has few distinct crop sizes per output.
    With the ROI decoder built, computed in C (``_roijpeg.c`` ``taps``: the same float64
    operations in the same order, NumPy's pairwise sum included; equal over thousands of
    sizes in the tests): about 10x faster than this NumPy code, which mattered for the first
    batch and epoch, where most crop sizes are new (~100 misses in a first batch of 64).
    Thread-safety: safe (``lru_cache``; the arrays are read-only).
    """
    fast = getattr(_decode._roi, "taps", None)  # the ROI decoder, when built
    if fast is not None:
        start_b, weights_b, taps, precision = fast(in_size, out_size)
        start = np.frombuffer(start_b, np.int32)  # (out,) read-only
        return start, np.frombuffer(weights_b, np.int16).reshape(out_size, taps), taps, precision
    return _taps_numpy(in_size, out_size)


def _taps_numpy(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """:func:`_taps` in NumPy (the reference, and the path without the ROI decoder)."""
    scale = in_size / out_size
    support = scale if scale >= 1.0 else 1.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)  # (out,)
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)  # trunc, as C's (int)
    xsize = np.minimum((center + support + 0.5).astype(np.int64), in_size) - xmin
    taps = int(xsize.max())
    j = np.arange(taps)
    w = 1.0 - np.abs((j[None, :] + xmin[:, None] - center[:, None] + 0.5) * invscale)
    w = np.where((j[None, :] < xsize[:, None]) & (w > 0.0), w, 0.0)  # (out, taps) float64
    total = w.sum(axis=1, keepdims=True)
    w = w / np.where(total == 0.0, 1.0, total)
    w_max = float(w.max())
    precision = 0
    while precision < 22 and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    q = np.floor(0.5 + w * (1 << precision)).astype(np.int16)  # w >= 0: half away from 0
    start = np.minimum(xmin, in_size - taps)  # keep every window inside the image
    shift = (xmin - start)[:, None]  # (out, 1): where the weights start in the window
    weights = np.zeros((out_size, taps), np.int16)
    cols = j[None, :] + shift  # (out, taps)
    keep = cols < taps  # the shifted-out entries are zero weights (beyond xsize)
    weights[np.nonzero(keep)[0], cols[keep]] = q[keep]
    start = start.astype(np.int32)
    start.flags.writeable = False
    weights.flags.writeable = False
    return start, weights, taps, precision


def _single_threaded_torch() -> None:
    """Run torch ops single-threaded in loader worker threads (once per thread).

    Several worker threads each spawning an OpenMP team oversubscribes the cores (measured:
    a 224x224 resize went from 0.5 ms to 5 ms with 2 threads on 2 busy cores). torch's own
    DataLoader workers call ``torch.set_num_threads(1)`` for the same reason. The main thread
    is left alone (with ``num_workers=0`` the user's setting applies).
    """
    if not getattr(_local, "single", False):
        _local.single = True
        if threading.current_thread() is not threading.main_thread():
            torch.set_num_threads(1)


def _pair(size, name: str) -> tuple[int, int]:
    if isinstance(size, numbers.Integral) and not isinstance(size, bool):
        size = (int(size), int(size))
    elif (
        isinstance(size, Sequence)
        and len(size) == 2
        and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in size)
    ):
        size = (int(size[0]), int(size[1]))
    else:
        raise TypeError(f"{name} size must be an int or (height, width) ints, got {size!r}")
    if size[0] <= 0 or size[1] <= 0:
        raise ValueError(f"{name} size must be positive, got {size!r}")
    return size


class _Plan:
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


class _Transform:
    """Base of kuat's vision transforms (``Compose`` fuses only these)."""

    def _plan(self, plan: _Plan, rng: np.random.Generator) -> None:
        raise NotImplementedError

    def _fixed_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
        """Output size given the input size (``None``: varies per image)."""
        return size

    def _apply(self, img: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        """Standalone: ``(..., 3, H, W)`` uint8 tensor -> transformed tensor."""
        plan = _Plan(img.shape[-2], img.shape[-1])
        self._plan(plan, rng)
        return _execute(img, plan)

    def __call__(self, img, rng: np.random.Generator | None = None):
        """Transform a decoded image.

        Args:
            img: ``(..., 3, H, W)`` uint8 ``torch.Tensor`` or ``(H, W, 3)`` uint8 array.
            rng: the generator random draws come from; ``None`` uses the current sample's
                generator inside a kuat loader fetch, else a fresh unseeded one.

        Returns:
            the same kind as ``img``: a tensor ``(..., 3, H', W')`` or an array ``(H', W', 3)``.
        """
        if rng is None:
            rng = _default_rng()
        if isinstance(img, np.ndarray):
            if img.ndim != 3 or img.shape[2] != 3:
                raise ValueError(f"expected an (H, W, 3) array, got shape {img.shape}")
            t = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)  # (H,W,3)->(3,H,W)
            return np.ascontiguousarray(self._apply(t, rng).permute(1, 2, 0).numpy())
        if not isinstance(img, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor or numpy array, got {type(img).__name__}")
        return self._apply(img, rng)


def _default_rng() -> np.random.Generator:
    from kuat.rng import sample_rng

    try:
        return sample_rng().numpy
    except RuntimeError:
        return np.random.default_rng()


def _resize_tensor(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear antialiased resize of ``(..., C, H, W)`` (uint8 stays uint8, like torchvision v2)."""
    if tuple(img.shape[-2:]) == size:
        return img
    lead = img.shape[:-3]
    x = img.reshape(-1, *img.shape[-3:])  # (N, C, H, W)
    if x.dtype == torch.uint8 and x.device.type == "cpu":
        x = x.contiguous(memory_format=torch.channels_last)  # the fast AVX2 uint8 kernel
        y = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    else:
        y = F.interpolate(
            x.float(), size=size, mode="bilinear", antialias=True, align_corners=False
        )
        if img.dtype == torch.uint8:
            y = y.round_().clamp_(0, 255).to(torch.uint8)
        else:
            y = y.to(img.dtype)
    return y.reshape(*lead, *y.shape[-3:])


def _execute(img: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """Run a plan on a decoded ``(..., 3, H, W)`` tensor (the unfused path, scale 1)."""
    if not plan.fusable:
        raise RuntimeError("internal: _execute on an unfusable plan")
    y0, y1 = snap(plan.top, plan.height, 1.0, img.shape[-2])
    x0, x1 = snap(plan.left, plan.width, 1.0, img.shape[-1])
    out = _resize_tensor(img[..., y0:y1, x0:x1], (plan.res_h, plan.res_w))
    win = plan.window()
    if win is not None:
        out = out[..., win[0], win[1]]
    if plan.flip:
        out = out.flip(-1)
    return out


class RandomResizedCrop(_Transform):
    """Crop a random box of random area and aspect ratio, resize it to ``size``.

    The box distribution is torchvision's ``RandomResizedCrop.get_params``: up to 10 draws of
    an area fraction ``~ U(scale)`` and a log aspect ratio ``~ U(log ratio)``; the first box
    that fits is placed uniformly; else the central crop clamped to ``ratio``. Draws come from
    the sample's NumPy generator. Output ``(3, size[0], size[1])``; bilinear, antialiased.
    """

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0)):
        self.size = _pair(size, "RandomResizedCrop")
        scale = tuple(float(v) for v in scale)
        ratio = tuple(float(v) for v in ratio)
        if len(scale) != 2 or not 0 < scale[0] <= scale[1]:
            raise ValueError(f"scale must be (min, max) with 0 < min <= max, got {scale!r}")
        if len(ratio) != 2 or not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must be (min, max) with 0 < min <= max, got {ratio!r}")
        self.scale = scale
        self.ratio = ratio
        self._log_ratio = (math.log(ratio[0]), math.log(ratio[1]))

    def get_params(
        self, height: int, width: int, rng: np.random.Generator
    ) -> tuple[int, int, int, int]:
        """``(top, left, h, w)`` of a crop of a ``height x width`` image (torchvision's algorithm)."""
        area = height * width
        lo, hi = self._log_ratio
        s0, s1 = self.scale
        for _ in range(10):
            u_area, u_ratio = rng.random(2).tolist()  # one call: ~1 us instead of ~4
            target_area = area * (s0 + (s1 - s0) * u_area)
            aspect = math.exp(lo + (hi - lo) * u_ratio)
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                u_i, u_j = rng.random(2).tolist()
                # floor(u * n) is uniform on 0..n-1 (torch.randint(0, n) in torchvision)
                i = min(int(u_i * (height - h + 1)), height - h)
                j = min(int(u_j * (width - w + 1)), width - w)
                return i, j, h, w
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w = width
            h = max(1, int(round(w / self.ratio[0])))
        elif in_ratio > self.ratio[1]:
            h = height
            w = max(1, int(round(h * self.ratio[1])))
        else:
            w, h = width, height
        # max(1, ...): torchvision's box is empty there (a 1-pixel side times a ratio below
        # 1/2 rounds to 0) and its resize then fails; kuat takes the one pixel row or column
        return (height - h) // 2, (width - w) // 2, h, w

    def _plan(self, plan, rng):
        plan.crop(*self.get_params(plan.cur_h, plan.cur_w, rng))
        plan.resize(*self.size)

    def _fixed_size(self, size):
        return self.size

    def __repr__(self):
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio})"


class Resize(_Transform):
    """Resize, bilinear with antialiasing (torchvision's default).

    ``size`` an int: the shorter side becomes ``size``, the longer ``int(size * long / short)``
    (torchvision's rule). ``(height, width)``: exactly that.
    """

    def __init__(self, size):
        if isinstance(size, numbers.Integral) and not isinstance(size, bool):
            if size <= 0:
                raise ValueError(f"Resize size must be positive, got {size!r}")
            self.size: int | tuple[int, int] = int(size)
        else:
            self.size = _pair(size, "Resize")

    def output_for(self, height: int, width: int) -> tuple[int, int]:
        if isinstance(self.size, tuple):
            return self.size
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.size, int(self.size * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def _plan(self, plan, rng):
        plan.resize(*self.output_for(plan.cur_h, plan.cur_w))

    def _fixed_size(self, size):
        return self.size if isinstance(self.size, tuple) else None

    def __repr__(self):
        return f"Resize(size={self.size})"


class CenterCrop(_Transform):
    """Crop the centre ``size`` (offsets rounded as torchvision does). An image smaller than
    ``size`` is zero-padded around, as torchvision does (that case is not fused: it decodes at
    full size)."""

    def __init__(self, size):
        self.size = _pair(size, "CenterCrop")

    def _plan(self, plan, rng):
        th, tw = self.size
        if th > plan.cur_h or tw > plan.cur_w:
            plan.fusable = False
            return
        i = int(round((plan.cur_h - th) / 2.0))
        j = int(round((plan.cur_w - tw) / 2.0))
        plan.crop(i, j, th, tw)

    def _apply(self, img, rng):
        th, tw = self.size
        h, w = img.shape[-2:]
        if th > h or tw > w:  # torchvision pads with zeros: left/top get the floor half
            pad = [(tw - w) // 2 if tw > w else 0, (tw - w + 1) // 2 if tw > w else 0]
            pad += [(th - h) // 2 if th > h else 0, (th - h + 1) // 2 if th > h else 0]
            img = F.pad(img, pad)
            h, w = img.shape[-2:]
        i = int(round((h - th) / 2.0))
        j = int(round((w - tw) / 2.0))
        return img[..., i : i + th, j : j + tw]

    def _fixed_size(self, size):
        return self.size

    def __repr__(self):
        return f"CenterCrop(size={self.size})"


class RandomHorizontalFlip(_Transform):
    """Mirror left-right with probability ``p`` (one draw ``rng.random() < p`` per sample)."""

    def __init__(self, p: float = 0.5):
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"RandomHorizontalFlip p must be in [0, 1], got {p!r}")
        self.p = float(p)

    def _plan(self, plan, rng):
        if rng.random() < self.p:
            plan.flip = not plan.flip

    def _apply(self, img, rng):
        return img.flip(-1) if rng.random() < self.p else img

    def __repr__(self):
        return f"RandomHorizontalFlip(p={self.p})"


class Normalize(_Transform):
    """``(x / 255 - mean) / std`` per channel, once per batch, on the batch's device.

    ``mean`` and ``std`` are in [0, 1] units (torchvision's ImageNet constants work as is).
    Input: ``(B, 3, H, W)`` or ``(3, H, W)`` uint8 (scaled by 1/255 first) or floating
    (taken as already in [0, 1]), on any device. Output: ``dtype`` (float32 or bfloat16), same
    shape and device. Computed in float32 as one fused multiply-add, then cast.
    Thread-safety: safe; per-device constants are cached.
    """

    def __init__(self, mean, std, dtype: torch.dtype = torch.float32):
        mean = [float(v) for v in mean]
        std = [float(v) for v in std]
        if len(mean) != len(std) or not mean:
            raise ValueError(f"mean and std must have the same non-zero length, got {mean}, {std}")
        if any(s <= 0 for s in std):
            raise ValueError(f"std must be positive, got {std}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise TypeError(f"Normalize dtype must be a floating torch dtype, got {dtype!r}")
        self.mean, self.std, self.dtype = mean, std, dtype
        self._consts: dict = {}

    def _constants(self, device, uint8: bool):
        key = (str(device), uint8)
        c = self._consts.get(key)
        if c is None:
            scale = 255.0 if uint8 else 1.0
            mul = torch.tensor([1.0 / (scale * s) for s in self.std], device=device)
            add = torch.tensor([-m / s for m, s in zip(self.mean, self.std)], device=device)
            c = (mul.view(-1, 1, 1), add.view(-1, 1, 1))  # (C, 1, 1), broadcast over H, W
            self._consts[key] = c
        return c

    def __call__(self, img, rng=None):
        if isinstance(img, np.ndarray):
            img = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)
        if not isinstance(img, torch.Tensor):
            raise TypeError(f"Normalize expects a torch.Tensor, got {type(img).__name__}")
        if img.ndim < 3 or img.shape[-3] != len(self.mean):
            raise ValueError(
                f"Normalize expects (..., {len(self.mean)}, H, W), got shape {tuple(img.shape)}"
            )
        mul, add = self._constants(img.device, img.dtype == torch.uint8)
        out = torch.addcmul(add, img.to(torch.float32), mul)  # (B, C, H, W) float32
        return out if self.dtype == torch.float32 else out.to(self.dtype)

    def _plan(self, plan, rng):
        raise RuntimeError("internal: Normalize is a batch step, not planned")

    def __repr__(self):
        return f"Normalize(mean={self.mean}, std={self.std}, dtype={self.dtype})"


def _batch_job_of(data, box: tuple, slot: int, size: tuple[int, int]) -> tuple:
    """``decode_resize_batch``'s job: ``box`` ``(scale_num, y0, y1, x0, x1, flip)`` (what
    ``Compose._batch_job`` and the C planner ``plan_rrc`` give) decoded from ``data`` and
    resized to ``size`` ``(H, W)`` into batch slot ``slot``, with the resize weights."""
    k, y0, y1, x0, x1, flip = box
    return (data, k, y0, y1, x0, x1, slot, flip, *_taps(x1 - x0, size[1]),
            *_taps(y1 - y0, size[0]))


def _decode_resize_split(jobs: list[tuple], out: np.ndarray) -> list[tuple[int, str]]:
    """:func:`decode_resize_batch` over ``jobs``, shared by :func:`kuat._parallel.width`
    threads when the loader lets this fetch use idle cores (an epoch's first batch); same
    pixels at every width: each job writes only its own slot and draws nothing. Returns the
    failed jobs' indices into ``jobs`` (as ``decode_resize_batch``).

    The threads take jobs one by one from a shared counter in the C call, the costliest first
    (longest-processing-time-first), so the batch ends when the last job does, whichever
    thread is slower (the helper starts later, and shares a core with the loop). A build
    without the counter splits the batch into contiguous parts of about equal cost instead.
    """
    n = _parallel.width()
    if n <= 1 or len(jobs) < 2:
        return decode_resize_batch(jobs, out)
    # job: (data, scale_num, y0, y1, x0, x1, slot, flip, *taps), the box on the k/8 grid.
    # Cost proxy: entropy decoding (about the encoded bytes) plus the region's pixels.
    costs = [len(j[0]) + (j[3] - j[2]) * (j[5] - j[4]) // 4 for j in jobs]
    if shares_jobs():
        order = sorted(range(len(jobs)), key=costs.__getitem__, reverse=True)
        ordered = [jobs[k] for k in order]
        counter = np.zeros(1, np.int32)  # the next job of `ordered` to take
        parts = _parallel.run_parts(
            [lambda: decode_resize_batch(ordered, out, counter) for _ in range(min(n, len(jobs)))]
        )
        return sorted((order[k], reason) for part in parts for k, reason in part)
    ranges = _parallel.split_even(costs, n)
    parts = _parallel.run_parts(
        [lambda lo=lo, hi=hi: decode_resize_batch(jobs[lo:hi], out) for lo, hi in ranges]
    )
    return [(lo + k, reason) for (lo, _), failed in zip(ranges, parts) for k, reason in failed]


class Compose(_Transform):
    """A chain of kuat transforms, fused into the decode on kuat datasets.

    Implements :class:`kuat.vision.protocol.FusedImageTransform`. ``Normalize`` may only come
    last; it becomes the ``batch_transform()``. For arbitrary callables (torchvision v2
    transforms...) give those to the dataset directly instead: they run unfused per sample.

    Args:
        transforms: kuat transforms (RandomResizedCrop, Resize, CenterCrop,
            RandomHorizontalFlip, Normalize).
        decode_device: ``"cpu"`` (default) or ``"cuda"``/``"cuda:N"``: decode JPEG batches
            with nvJPEG through ``apply_encoded_batch`` (see ``kuat.vision.gpu``).
        max_pixels: decompression-bomb limit passed to the decoder.
        exact_resize: ``False`` (default): resize and write into the batch slot with kuat's
            fused C kernel where it applies (see the module docstring: torch's arithmetic,
            at most 1 grey level from the exact path, equal in tests). ``True``: always
            torch's kernel and a copy (the pixels of kuat before the fused kernel).

    Raises:
        TypeError: a step is not a kuat transform; ``exact_resize`` is not a bool.
        ValueError: ``Normalize`` is not last; bad ``decode_device``.
        kuat.KuatError: ``decode_device`` is CUDA and CUDA is not available.

    Thread-safety: stateless after construction; ``apply_encoded`` may run in many threads.
    """

    def __init__(
        self,
        transforms,
        *,
        decode_device: str = "cpu",
        max_pixels=DEFAULT_MAX_PIXELS,
        exact_resize: bool = False,
    ):
        if not isinstance(exact_resize, bool):
            raise TypeError(f"exact_resize must be a bool, got {exact_resize!r}")
        self.exact_resize = exact_resize
        transforms = list(transforms)
        for k, t in enumerate(transforms):
            if not isinstance(t, _Transform) or isinstance(t, Compose):
                raise TypeError(
                    f"Compose step {k} ({t!r}) is not a kuat transform; kuat.vision.Compose fuses "
                    "only kuat.vision transforms. Give torchvision or other callables to the "
                    "dataset directly (e.g. torchvision.transforms.v2.Compose): they run per sample."
                )
        norms = [k for k, t in enumerate(transforms) if isinstance(t, Normalize)]
        if norms and norms != [len(transforms) - 1]:
            raise ValueError("Normalize must be the last step of Compose (it runs once per batch)")
        self.transforms = transforms
        self._geometric = [t for t in transforms if not isinstance(t, Normalize)]
        self._normalize = transforms[norms[0]] if norms else None
        self.max_pixels = max_pixels
        size = None
        for t in self._geometric:
            size = t._fixed_size(size)
        self._output_size = size
        self.decode_device = _check_decode_device(decode_device)
        # RandomResizedCrop then only flips (the ImageNet training recipe): the batch's boxes
        # can be drawn in C (_roijpeg.c plan_rrc), the Python planner's arithmetic exactly
        g = self._geometric
        self._c_plan = (
            (g[0], tuple(t.p for t in g[1:]))
            if g and type(g[0]) is RandomResizedCrop and len(g) <= 17
            and all(type(t) is RandomHorizontalFlip for t in g[1:])
            else None
        )  # fmt: skip

    # --- FusedImageTransform -------------------------------------------------------------

    def output_size(self) -> tuple[int, int] | None:
        """``(H, W)`` of every output, or ``None`` when it depends on the image size."""
        return self._output_size

    def batch_transform(self):
        """The ``Normalize`` step (callable on a ``(B, 3, H, W)`` uint8 batch), or ``None``."""
        return self._normalize

    @property
    def splits_batches(self) -> bool:
        """Whether :meth:`apply_encoded_many` can split a batch's decode over idle cores
        (:mod:`kuat._parallel`: an epoch's first batch): the fixed-size CPU path on the ROI
        decoder's one-call-per-batch kernel."""
        return (self._output_size is not None and not self.exact_resize
                and str(self.decode_device) == "cpu" and roi_batch_available())

    def plan(self, width: int, height: int, rng: np.random.Generator) -> _Plan:
        """Draw this sample's geometry for an oriented ``width x height`` image."""
        plan = _Plan(height, width)
        for t in self._geometric:
            t._plan(plan, rng)
            if not plan.fusable:
                break
        return plan

    def apply_encoded(self, data, width, height, rng, out=None, *, index=None, source=None):
        """Decode ``data`` at the smallest sufficient scale, crop, resize, flip into ``out``.

        Args:
            data: the encoded image (bytes-like).
            width, height: its size after EXIF orientation (as in the dataset's manifest).
                If the bytes decode to another size the box is scaled to it.
            rng: the sample's generator; all draws come from it (same seed, same pixels).
            out: ``(3, H, W)`` uint8 array (may be a strided view of the batch buffer), or
                ``None`` to allocate one.
            index, source: sample index and shard/file, for error messages only.

        Returns:
            ``(3, H, W)`` uint8 array: ``out`` itself when given.

        Raises:
            kuat.DecodeError: the bytes cannot be decoded (names ``index`` and ``source``).
            ValueError: ``out`` has the wrong shape or dtype.
        """
        _single_threaded_torch()
        width, height = int(width), int(height)
        if width <= 0 or height <= 0:
            raise ValueError(f"width and height must be positive, got {width}x{height}")
        plan = self.plan(width, height, rng)
        return self._apply_planned(data, width, height, plan, rng, out, index, source)

    def apply_encoded_many(self, datas, widths, heights, rngs, out, *, indices=None, sources=None):
        """:meth:`apply_encoded` for a batch, into the batch buffer: ``out[j]`` gets sample
        ``j``'s pixels, the same as ``apply_encoded(datas[j], ..., rngs[j], out=out[j])``.

        The JPEGs the fused path takes (ROI decoder built, EXIF orientation 1 or 2, no padding
        window, ``exact_resize=False``) are decoded and resized in one C call that releases the
        GIL once for the whole batch: a thread worker then holds the GIL only while it plans the
        boxes, where one call per image made many decoding threads (16 on a GPU host) queue for
        it twice per image. The other samples, and any the batch call could not decode, go
        through :meth:`apply_encoded`'s per-image path, in sample order (so an error names the
        same sample it would name there). For ``RandomResizedCrop`` then flips, with ``rngs`` a
        :class:`kuat.rng.BatchGenerators` (what kuat datasets pass), the boxes are drawn in C
        from the generators' seeding words (:meth:`_plan_in_c`): the same draws and boxes,
        no generator made.

        Args:
            datas: B encoded images (bytes-like).
            widths, heights: B sizes after EXIF orientation (from the dataset's index).
            rngs: B ``numpy.random.Generator`` s, one per sample (as ``apply_encoded``'s): a
                list, or a :class:`kuat.rng.BatchGenerators`.
            out: ``(B, 3, H, W)`` uint8 NumPy array, C-contiguous, with ``(H, W) ==
                output_size()``.
            indices, sources: B sample indices and shards/files, for error messages only.

        Returns:
            ``out``.

        Raises:
            kuat.DecodeError: a sample cannot be decoded (the lowest such ``j``).
            ValueError: ``out`` has the wrong shape, dtype or layout, or the output size is
                not fixed.
        """
        _single_threaded_torch()
        n = len(datas)
        size = self._output_size
        if size is None or out.shape != (n, 3, *size) or out.dtype != np.uint8:
            raise ValueError(
                f"out must be ({n}, 3, H, W) uint8 with (H, W) = output_size() = {size}, "
                f"got {out.shape} {out.dtype}"
            )
        indices = list(indices) if indices is not None else [None] * n
        sources = list(sources) if sources is not None else [None] * n
        batched = roi_batch_available() and not self.exact_resize and out.flags.c_contiguous
        # jobs: decode_resize_batch's; job_samples[k]: job k's sample; later: (j, plan or None)
        # for the per-image path, None where the C planner drew the box (planned again there)
        jobs, job_samples, later = [], [], []
        draws = np.zeros(n, np.int64)  # (B,): the doubles the C planner drew per sample
        planned = self._plan_in_c(datas, widths, heights, rngs, size, draws) if batched else None
        if planned is not None:
            for j, box in enumerate(planned):
                if box is None:
                    later.append((j, None))
                    continue
                jobs.append(_batch_job_of(datas[j], box, j, size))
                job_samples.append((j, None))
        else:
            for j in range(n):
                width, height = int(widths[j]), int(heights[j])
                if width <= 0 or height <= 0:
                    raise ValueError(f"width and height must be positive, got {width}x{height}")
                plan = self.plan(width, height, rngs[j])
                job = self._batch_job(datas[j], width, height, plan, j, size) if batched else None
                if job is None:
                    later.append((j, plan))
                else:
                    jobs.append(job)
                    job_samples.append((j, plan))
        if jobs:
            for k, reason in _decode_resize_split(jobs, out):
                logger.debug("batch decode skipped sample %s: %s", indices[job_samples[k][0]], reason)
                later.append(job_samples[k])
                draws[job_samples[k][0]] = 0  # planned again below, from a fresh generator
        if planned is not None:
            # the C-planned samples' generators continue after the plan's draws, as a list of
            # generators would (a caller drawing more from rngs afterwards gets new numbers)
            rngs._drew(draws)
        for j, plan in sorted(later, key=lambda jp: jp[0]):
            width, height = int(widths[j]), int(heights[j])
            if plan is None:
                plan = self.plan(width, height, rngs[j])  # a fresh generator: the same draws
            self._apply_planned(
                datas[j], width, height, plan, rngs[j], out[j], indices[j], sources[j]
            )
        return out

    def _plan_in_c(self, datas, widths, heights, rngs, size, draws=None) -> list | None:
        """The batch's ``(scale_num, y0, y1, x0, x1, flip)`` boxes (``None`` for a sample the
        per-image path must take) drawn by ``_roijpeg.c``'s ``plan_rrc``: what ``plan`` and
        ``_batch_job`` compute, without a generator, a Python header walk or box mapping per
        image (about 45 us of a smooth 224 crop's 550). ``None`` (plan in Python) unless the
        transforms are ``RandomResizedCrop`` then flips, ``rngs`` carries the PCG64 seeding
        words (``kuat.rng.BatchGenerators``), the ROI decoder has the planner, and every size
        is positive (the Python path raises for the others), and no stream has been drawn from
        yet (the caller's draws, or an earlier call with the same ``rngs``). ``draws``: an
        optional ``(B,)`` int64 array, set to the doubles drawn for each planned sample."""
        words = getattr(rngs, "pcg_words", None)
        plan_rrc = getattr(_decode._roi, "plan_rrc", None)
        fresh = getattr(rngs, "_fresh", False)
        if self._c_plan is None or words is None or plan_rrc is None or not fresh:
            return None
        widths = np.ascontiguousarray(widths, np.int64)  # (B,): plan_rrc reads the buffer
        heights = np.ascontiguousarray(heights, np.int64)
        if len(widths) and (widths.min() <= 0 or heights.min() <= 0):
            return None
        rrc, flips = self._c_plan
        # the C limit as _batch_job's `w * h > max_pixels` reads any number: -1 none (None,
        # inf, nan, or above any JPEG's size), 0 every image (negative: the per-image path
        # raises for each)
        mp = self.max_pixels
        max_pixels = -1 if mp is None or not mp < 2**62 else max(0, math.floor(mp))
        return plan_rrc(
            datas, widths, heights, words, size[0], size[1], float(rrc.scale[0]),
            float(rrc.scale[1]), *rrc._log_ratio, float(rrc.ratio[0]), float(rrc.ratio[1]),
            flips, max_pixels, *(() if draws is None else (draws,)),
        )  # fmt: skip

    def _batch_job(self, data, width, height, plan, slot, size) -> tuple | None:
        """``decode_resize_batch``'s job for one sample, or ``None`` when it needs the
        per-image path (not fusable, not a JPEG the ROI decoder takes, rotated by EXIF, a
        padding window, over ``max_pixels``: the per-image path raises that error)."""
        if not plan.fusable or plan.window() is not None or (plan.res_h, plan.res_w) != size:
            return None
        hdr = roi_header(data)
        if hdr is None or hdr.orientation in _UNFUSED_ORIENTATIONS:
            return None
        if self.max_pixels is not None and hdr.width * hdr.height > self.max_pixels:
            return None
        flip = plan.flip != (hdr.orientation == 2)  # EXIF 2 is a mirror: one more flip
        box = (*self._roi_region(plan, hdr, width, height), int(flip))
        return _batch_job_of(data, box, slot, size)

    @staticmethod
    def _roi_region(plan, hdr, width, height) -> tuple[int, int, int, int, int]:
        """``(scale_num, y0, y1, x0, x1)``: the smallest sufficient DCT scale (``scale_num``/8)
        and the plan's box on that scaled grid in the stored orientation, for the ROI
        decoder (``hdr``: the JPEG's stored size and orientation; ``width``/``height``: its
        oriented size from the dataset's index)."""
        k = _pick_scale(plan.min_scale())
        s = k / 8
        ph, pw = -(-hdr.height * k // 8), -(-hdr.width * k // 8)  # libjpeg's scaled size
        top, left, bh, bw = stored_crop_box(
            plan, hdr.orientation, hdr.height, hdr.width, width, height
        )
        y0, y1 = snap(top, bh, s, ph)
        x0, x1 = snap(left, bw, s, pw)
        return k, y0, y1, x0, x1

    def _apply_planned(self, data, width, height, plan, rng, out, index, source):
        """:meth:`apply_encoded` after the plan is drawn."""
        if not plan.fusable:
            return self._apply_unfused(data, rng, out, index, source)
        oh, ow = plan.cur_h, plan.cur_w
        if out is None:
            out = np.empty((3, oh, ow), np.uint8)
        elif out.shape != (3, oh, ow) or out.dtype != np.uint8:
            raise ValueError(f"out must be (3, {oh}, {ow}) uint8, got {out.shape} {out.dtype}")
        # RGBX from the ROI decoder for the fused kernel (4-byte pixels: one load each)
        channels = _ROI_CHANNELS if self.exact_resize else 4
        crop, orientation = self._decode_crop(data, width, height, plan, index, source, channels)
        transposed = orientation in _exif.TRANSPOSED
        grid = (plan.res_w, plan.res_h) if transposed else (plan.res_h, plan.res_w)  # stored
        if (
            crop.shape[2] == 4  # the ROI decoder's contiguous RGBX crop
            and orientation not in _UNFUSED_ORIENTATIONS
            and plan.window() is None
            and out.flags.c_contiguous
            and resize_rgbx_planar(
                crop,
                out,
                plan.flip != (orientation == 2),  # EXIF 2 is a mirror: one more flip
                _taps(crop.shape[1], grid[1]),
                _taps(crop.shape[0], grid[0]),
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
            crop = _resize_aa(src, grid).numpy()[0]  # (C, gh, gw), channels_last strides
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

    def _decode_crop(self, data, width, height, plan, index, source, channels=_ROI_CHANNELS):
        """The plan's box, decoded at the smallest sufficient DCT scale and snapped to its
        pixel grid: ``((h, w, C) uint8 view in stored orientation, EXIF orientation)``, with
        C = ``channels`` (3 RGB or 4 RGBX) from the ROI decoder, 3 (RGB) otherwise.

        With the ROI decoder only the box's rows and columns are reconstructed; otherwise
        the whole image is decoded (at that scale) and the box is a view into it.
        """
        hdr = roi_header(data)
        if hdr is not None:
            _check_pixels(hdr.width, hdr.height, self.max_pixels, index, source)
            k, y0, y1, x0, x1 = self._roi_region(plan, hdr, width, height)
            try:
                return decode_jpeg_roi(data, k, y0, y1, x0, x1, channels), hdr.orientation
            except ValueError as e:  # corrupt or libjpeg warnings: the full path decides
                logger.debug("ROI decode failed (sample %s): %s; decoding in full", index, e)
        d = decode_stored(
            data,
            min_scale=plan.min_scale(),
            max_pixels=self.max_pixels,
            index=index,
            source=source,
            reuse_buffer=True,
        )
        top, left, bh, bw = stored_crop_box(plan, d.orientation, d.height, d.width, width, height)
        pixels = d.pixels  # (ph, pw, 3) at scale d.scale, stored orientation
        y0, y1 = snap(top, bh, d.scale, pixels.shape[0])  # box edges on the decoded grid
        x0, x1 = snap(left, bw, d.scale, pixels.shape[1])
        return pixels[y0:y1, x0:x1], d.orientation

    def _apply_unfused(self, data, rng, out, index, source):
        """Full decode, then the transforms one by one (for plans that need padding)."""
        sub = np.random.Generator(np.random.PCG64(int(rng.integers(0, 2**63))))
        img = decode_image(data, max_pixels=self.max_pixels, index=index, source=source)
        t = torch.from_numpy(img).permute(2, 0, 1)  # (H, W, 3) -> (3, H, W) view
        for step in self._geometric:
            t = step._apply(t, sub)
        res = t.numpy()
        if out is None:
            return np.ascontiguousarray(res)
        if out.shape != res.shape or out.dtype != np.uint8:
            raise ValueError(f"out must be {res.shape} uint8, got {out.shape} {out.dtype}")
        np.copyto(out, res)
        return out

    def apply_encoded_batch(self, datas, widths, heights, rngs, *, indices=None, sources=None):
        """Decode a batch of JPEGs on ``decode_device`` (nvJPEG) with the same crop planning.

        Returns a ``(B, 3, H, W)`` uint8 tensor on that device. See
        :func:`kuat.vision.gpu.decode_batch_cuda`.
        """
        from kuat.vision.gpu import decode_batch_cuda

        return decode_batch_cuda(
            self,
            datas,
            widths,
            heights,
            rngs,
            device=self.decode_device,
            indices=indices,
            sources=sources,
        )

    # --- standalone -------------------------------------------------------------------------

    def _apply(self, img, rng):
        # The fused path's geometry (one crop, one resize), unless padding is needed.
        plan = self.plan(img.shape[-1], img.shape[-2], rng)
        if plan.fusable:
            img = _execute(img, plan)
        else:
            sub = np.random.Generator(np.random.PCG64(int(rng.integers(0, 2**63))))
            for t in self._geometric:
                img = t._apply(img, sub)
        if self._normalize is not None:
            img = self._normalize(img)
        return img

    def __call__(self, img, rng=None):
        if rng is None:
            rng = _default_rng()
        if self._normalize is not None and isinstance(img, np.ndarray):
            img = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)
        return super().__call__(img, rng)

    def __repr__(self):
        inner = ", ".join(repr(t) for t in self.transforms)
        return (
            f"Compose([{inner}], decode_device={self.decode_device!r}, "
            f"exact_resize={self.exact_resize})"
        )


def _check_decode_device(decode_device) -> str:
    dev = str(decode_device)
    if dev == "cpu":
        return dev
    if dev == "cuda" or dev.startswith("cuda:"):
        from kuat.vision.gpu import check_cuda

        check_cuda(dev)
        return dev
    raise ValueError(f"decode_device must be 'cpu', 'cuda' or 'cuda:N', got {decode_device!r}")
