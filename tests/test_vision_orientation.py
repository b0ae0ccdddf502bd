"""EXIF orientation is applied exactly once, whatever format Pillow reads: decode, probe and
the fused transforms all equal ``ImageOps.exif_transpose(Image.open(...))`` (issue #18.1).

Pillow 12+ orients TIFFs itself (size on open, pixels on load); kuat must not rotate again.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageOps, features

from kuat.vision.decode import decode_image
from kuat.vision.probe import probe_image
from kuat.vision.transforms import CenterCrop, Compose

_LOSSLESS = ["TIFF", "PNG", "WEBP"] + (["AVIF"] if features.check("avif") else [])


def _pixels(h: int = 12, w: int = 20) -> np.ndarray:
    """(H, W, 3) uint8, asymmetric so that every orientation differs."""
    return np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _encode(a: np.ndarray, fmt: str, orientation: int, mode: str = "RGB") -> bytes:
    im = Image.fromarray(a).convert(mode)
    exif = Image.Exif()
    exif[0x0112] = orientation
    kw: dict = {"exif": exif.tobytes()}
    if fmt == "TIFF":
        kw = {"tiffinfo": {0x0112: orientation}}
    elif fmt == "WEBP":
        kw["lossless"] = True
    elif fmt == "AVIF":
        kw["quality"] = 100
    elif fmt == "JPEG":
        kw["quality"] = 95
    b = io.BytesIO()
    im.save(b, fmt, **kw)
    return b.getvalue()


def _reference(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(ImageOps.exif_transpose(im).convert("RGB"))  # (H, W, 3)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize(
    "fmt, mode", [(f, "RGB") for f in _LOSSLESS] + [("JPEG", "RGB"), ("JPEG", "CMYK")]
)
def test_orientation_once_in_decode_probe_and_fused(fmt, mode, orientation):
    data = _encode(_pixels(), fmt, orientation, mode)
    ref = _reference(data)
    h, w = ref.shape[:2]
    tol = 0 if fmt in _LOSSLESS else 3  # simplejpeg's IDCT vs Pillow's libjpeg: a few levels

    out = decode_image(data)
    assert out.shape == ref.shape, (fmt, orientation)
    assert np.abs(out.astype(int) - ref).max() <= tol

    info = probe_image(data)
    assert (info.height, info.width) == (h, w)

    fused = Compose([CenterCrop((h, w))]).apply_encoded(data, w, h, np.random.default_rng(0))
    assert fused.shape == (3, h, w)
    assert np.abs(fused.transpose(1, 2, 0).astype(int) - ref).max() <= tol


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_tiff_rows_store_the_oriented_size(tmp_path, orientation):
    """What a converter stores (probe) is what the loader decodes, for a TIFF too."""
    import kuat
    from kuat.convert import from_imagefolder

    root = tmp_path / "src" / "cls"
    root.mkdir(parents=True)
    data = _encode(_pixels(), "TIFF", orientation)
    (root / "a.tif").write_bytes(data)
    ref = _reference(data)
    from_imagefolder(tmp_path / "src", tmp_path / "ds", progress=False, num_workers=1)
    from kuat.format import verify

    assert verify(tmp_path / "ds", images=True).ok  # stored width/height == probe's
    img = kuat.open(tmp_path / "ds")[0]["image"]  # (H, W, 3) as the loader decodes it
    np.testing.assert_array_equal(np.asarray(img), ref)
