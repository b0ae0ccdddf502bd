"""The torchvision-shaped transforms: ``RandomResizedCrop``, ``Resize``, ``CenterCrop``,
``RandomHorizontalFlip``, ``Normalize``, and their base :class:`Transform`.

Each geometric step *plans* (``_plan``): it updates a sample's :class:`kuat.vision.geometry.Plan`
from the image's size and the sample's generator, touching no pixel, so that
:class:`kuat.vision.compose.Compose` can fuse a chain of them into one reduced decode and one
resize. ``Normalize`` is the batch step: it runs once per batch, on the batch's device.

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
``torch.Tensor`` (returns a tensor) or an ``(H, W, 3)`` uint8 NumPy array (returns one): the
plan is run on the decoded pixels (:func:`run_plan`, scale 1).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kuat.vision.geometry import Plan, snap
from kuat.vision.resize import resize_tensor

__all__ = [
    "Transform",
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "RandomHorizontalFlip",
    "Normalize",
    "run_plan",
    "standalone_rng",
]


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


class Transform:
    """Base of kuat's vision transforms (``Compose`` fuses only these).

    A step defines ``_plan`` (its geometry on a :class:`Plan`), and may define ``_fixed_size``
    (its output size) and ``_apply`` (standalone, on a decoded tensor); ``Compose`` calls these
    three on its steps.
    """

    def _plan(self, plan: Plan, rng: np.random.Generator) -> None:
        raise NotImplementedError

    def _fixed_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
        """Output size given the input size (``None``: varies per image)."""
        return size

    def _apply(self, img: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        """Standalone: ``(..., 3, H, W)`` uint8 tensor -> transformed tensor."""
        plan = Plan(img.shape[-2], img.shape[-1])
        self._plan(plan, rng)
        return run_plan(img, plan)

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
            rng = standalone_rng()
        if isinstance(img, np.ndarray):
            if img.ndim != 3 or img.shape[2] != 3:
                raise ValueError(f"expected an (H, W, 3) array, got shape {img.shape}")
            t = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)  # (H,W,3)->(3,H,W)
            return np.ascontiguousarray(self._apply(t, rng).permute(1, 2, 0).numpy())
        if not isinstance(img, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor or numpy array, got {type(img).__name__}")
        return self._apply(img, rng)


def standalone_rng() -> np.random.Generator:
    """The generator a call given no ``rng`` draws from: the current sample's inside a kuat
    loader fetch (``kuat.sample_rng``), else a fresh unseeded one."""
    from kuat.rng import sample_rng

    try:
        return sample_rng().numpy
    except RuntimeError:
        return np.random.default_rng()


def run_plan(img: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Run a plan on a decoded ``(..., 3, H, W)`` tensor (the unfused path, scale 1)."""
    if not plan.fusable:
        raise RuntimeError("internal: run_plan on an unfusable plan")
    y0, y1 = snap(plan.top, plan.height, 1.0, img.shape[-2])
    x0, x1 = snap(plan.left, plan.width, 1.0, img.shape[-1])
    out = resize_tensor(img[..., y0:y1, x0:x1], (plan.res_h, plan.res_w))
    win = plan.window()
    if win is not None:
        out = out[..., win[0], win[1]]
    if plan.flip:
        out = out.flip(-1)
    return out


class RandomResizedCrop(Transform):
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

    @property
    def log_ratio(self) -> tuple[float, float]:
        """``(log ratio[0], log ratio[1])``: the range of the uniform log aspect-ratio draw
        (what ``Compose`` hands the C planner, which draws as :meth:`get_params` does)."""
        return self._log_ratio

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


class Resize(Transform):
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


class CenterCrop(Transform):
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


class RandomHorizontalFlip(Transform):
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


class Normalize(Transform):
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


def rrc_params(rrc, flips: tuple, max_pixels) -> tuple:
    """``_roijpeg.c``'s planner parameters ``(scale_lo, scale_hi, log_ratio_lo, log_ratio_hi,
    ratio_lo, ratio_hi, flip_ps, max_pixels)`` of ``RandomResizedCrop`` ``rrc`` and the flips'
    probabilities ``flips``, with ``max_pixels`` as ``_batch_job``'s ``w * h > max_pixels``
    reads any number: -1 none (``None``, inf, nan, or above any JPEG's size), 0 every image
    (negative: the per-image path raises for each)."""
    mp = max_pixels
    limit = -1 if mp is None or not mp < 2**62 else max(0, math.floor(mp))
    return (float(rrc.scale[0]), float(rrc.scale[1]), *rrc.log_ratio, float(rrc.ratio[0]),
            float(rrc.ratio[1]), flips, limit)  # fmt: skip
