"""Encoded test images, and a kuat dataset of JPEGs with truncated ones, for the tests that
need them (converters, the vision batch path, error transport).

``noise_image``: uniform noise, the cheapest image every decoder must handle exactly (nothing
to predict, so no encoder shortcut hides a decoding error). ``photo_jpeg``: smooth gradients
plus grain at a photograph's size, for the region decoder's batch kernel and the split first
batch (parts of a batch must take comparable time).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

import kuat
import kuat.format as kf


def noise_image(w: int, h: int, seed: int, format: str = "JPEG", **save) -> bytes:
    """A ``w`` x ``h`` RGB image of uniform noise drawn from ``seed``, encoded by Pillow as
    ``format`` with Pillow's ``save`` options (``quality=90``, ``exif=...``)."""
    hwc = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)  # (H, W, 3)
    out = io.BytesIO()
    Image.fromarray(hwc).save(out, format, **save)
    return out.getvalue()


def photo_jpeg(seed: int, quality: int = 88) -> bytes:
    """A JPEG of 120-199 x 140-259 pixels (drawn from ``seed``): gradients plus grain."""
    g = np.random.default_rng(seed)
    h, w = int(g.integers(120, 200)), int(g.integers(140, 260))
    y, x = np.mgrid[0:h, 0:w]
    hwc = np.stack([(x * 255 // w), (y * 255 // h), ((x + y) * 3) % 256], -1)  # (H, W, 3)
    hwc = np.clip(hwc + g.normal(0, 12, hwc.shape), 0, 255).astype(np.uint8)  # grain
    out = io.BytesIO()
    Image.fromarray(hwc).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def jpeg_dataset(path: Path, images: Sequence[bytes], truncated: Iterable[int] = ()) -> Path:
    """Write a kuat dataset at ``path``: ``image`` (``images``, those at the ``truncated``
    indices cut to a quarter of their bytes, so that decoding them raises) and ``label``
    (the row index, int64). Returns ``path``."""
    images = list(images)
    for i in truncated:
        images[i] = images[i][: len(images[i]) // 4]
    with kuat.Writer(path, {"image": kf.image(), "label": kf.int64()}) as w:
        w.write_batch({"image": images, "label": np.arange(len(images))})
    return path


def exif(orientation: int) -> bytes:
    """An EXIF block whose Orientation tag (0x0112) is ``orientation`` (Pillow's ``exif=``)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def planner_images() -> list[bytes]:
    """14 photo-like JPEGs the C planner decodes, then one of each kind it leaves to the
    per-image path: a PNG, a JPEG rotated and one mirrored by EXIF, a progressive JPEG, a CMYK
    JPEG (indices 14-18)."""
    cmyk = io.BytesIO()
    Image.new("CMYK", (70, 50), (10, 20, 30, 40)).save(cmyk, "JPEG")
    return [*(photo_jpeg(k) for k in range(14)),
            noise_image(90, 60, 1, "PNG"),  # not a JPEG
            noise_image(160, 120, 2, "JPEG", quality=90, exif=exif(6)),  # rotated by EXIF
            noise_image(160, 120, 3, "JPEG", quality=90, exif=exif(2)),  # mirrored by EXIF
            noise_image(120, 90, 4, "JPEG", quality=90, progressive=True),
            cmyk.getvalue()]  # fmt: skip


def rrc_transforms() -> list:
    """``RandomResizedCrop`` + flips chains the C planner takes: the recipe, the fallback box
    with two flips, a non-square output."""
    from kuat.vision import Compose, RandomHorizontalFlip, RandomResizedCrop

    return [
        Compose([RandomResizedCrop(48), RandomHorizontalFlip()]),
        Compose([RandomResizedCrop(32, scale=(0.9, 1.0), ratio=(0.1, 0.2)),  # the fallback box
                 RandomHorizontalFlip(0.3), RandomHorizontalFlip(0.8)]),
        Compose([RandomResizedCrop((24, 40))]),
    ]
