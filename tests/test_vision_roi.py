"""The optional ROI JPEG decoder (kuat.vision._roijpeg): only the crop's rows and columns are
reconstructed, and the pixels are exactly those of a full decode at the same DCT scale.

The extension is built by the test itself (C compiler + libjpeg-turbo headers) when it is not
already importable; where it cannot be built the tests skip with the compiler's reason.
"""

from __future__ import annotations

import importlib.util
import io

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from kuat.vision import Compose, RandomHorizontalFlip, RandomResizedCrop
from kuat.vision import decode as kdecode
from kuat.vision import transforms as kt


@pytest.fixture(scope="module")
def roi(tmp_path_factory):
    try:
        from kuat.vision import _roijpeg

        return _roijpeg
    except ImportError:
        pass
    from kuat.vision._build_roijpeg import build

    try:
        path = build(tmp_path_factory.mktemp("roijpeg"))
    except RuntimeError as e:
        pytest.skip(f"cannot build the optional ROI decoder here: {e}")
    spec = importlib.util.spec_from_file_location("_roijpeg", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    import skimage.data

    base = Image.fromarray(skimage.data.coffee()).resize((w, h), Image.BICUBIC)
    a = np.asarray(base).astype(np.int16)
    a = a + np.random.default_rng(seed).integers(-8, 9, size=a.shape)
    return np.clip(a, 0, 255).astype(np.uint8)


def _jpeg(a, **kw) -> bytes:
    b = io.BytesIO()
    Image.fromarray(a).save(b, "JPEG", **kw)
    return b.getvalue()


VARIANTS = {
    "420": dict(quality=85),
    "444": dict(quality=90, subsampling=0),
    "422": dict(quality=90, subsampling=1),
    "progressive": dict(quality=85, progressive=True),
    "gray": dict(quality=85),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("scale_num", [8, 4, 2, 1])
def test_roi_pixels_equal_full_decode(roi, variant, scale_num):
    src = _photo(203, 311, seed=scale_num)
    if variant == "gray":
        src = np.asarray(Image.fromarray(src).convert("L"))
    data = _jpeg(src, **VARIANTS[variant])
    h, w = src.shape[:2]
    full = simplejpeg.decode_jpeg(
        data, min_width=-(-w * scale_num // 8), min_height=-(-h * scale_num // 8)
    )
    ph, pw = full.shape[:2]
    rng = np.random.default_rng(0)
    buf = np.empty(ph * (pw + 16) * 3, np.uint8)
    for _ in range(60):
        y0 = int(rng.integers(0, ph - 1))
        y1 = int(rng.integers(y0 + 1, ph + 1))
        x0 = int(rng.integers(0, pw - 1))
        x1 = int(rng.integers(x0 + 1, pw + 1))
        assert roi.decode_crop(data, scale_num, y0, y1, x0, x1, buf) is None
        got = buf[: (y1 - y0) * (x1 - x0) * 3].reshape(y1 - y0, x1 - x0, 3)
        np.testing.assert_array_equal(got, full[y0:y1, x0:x1], err_msg=f"{(y0, y1, x0, x1)}")
        roi.decode_crop(data, scale_num, y0, y1, x0, x1, buf, 4)  # RGBX
        got4 = buf[: (y1 - y0) * (x1 - x0) * 4].reshape(y1 - y0, x1 - x0, 4)
        np.testing.assert_array_equal(got4[:, :, :3], full[y0:y1, x0:x1])
        assert (got4[:, :, 3] == 255).all()


def test_roi_errors(roi):
    data = _jpeg(_photo(64, 96))
    buf = np.empty(64 * 112 * 3, np.uint8)
    with pytest.raises(ValueError, match="outside"):
        roi.decode_crop(data, 8, 0, 65, 0, 10, buf)
    with pytest.raises(ValueError, match="smaller"):
        roi.decode_crop(data, 8, 0, 64, 0, 96, np.empty(10, np.uint8))
    with pytest.raises(ValueError):
        roi.decode_crop(b"\xff\xd8 not a jpeg", 8, 0, 1, 0, 1, buf)
    with pytest.raises(ValueError, match="channels"):
        roi.decode_crop(data, 8, 0, 1, 0, 1, buf, 2)
    with pytest.raises(ValueError):  # rows past the end of a truncated file
        roi.decode_crop(data[: len(data) // 2], 8, 0, 64, 0, 96, buf)
    cmyk = io.BytesIO()
    Image.fromarray(_photo(64, 96)).convert("CMYK").save(cmyk, "JPEG")
    with pytest.raises(ValueError, match="colour space"):
        roi.decode_crop(cmyk.getvalue(), 8, 0, 1, 0, 1, buf)


def test_fused_path_identical_with_and_without_roi(roi, monkeypatch):
    datas = [
        (_jpeg(_photo(h, w, seed=h), quality=88), w, h)
        for h, w in [(375, 500), (600, 800), (280, 190)]
    ]
    c = Compose([RandomResizedCrop(224), RandomHorizontalFlip()])
    monkeypatch.setattr(kdecode, "_roi", roi)
    with_roi = [
        c.apply_encoded(d, w, h, np.random.default_rng(k)) for k, (d, w, h) in enumerate(datas * 4)
    ]
    monkeypatch.setattr(kt, "_ROI_CHANNELS", 4)  # RGBX into torch's resize
    rgbx = [
        c.apply_encoded(d, w, h, np.random.default_rng(k)) for k, (d, w, h) in enumerate(datas * 4)
    ]
    monkeypatch.setattr(kdecode, "_roi", None)
    without = [
        c.apply_encoded(d, w, h, np.random.default_rng(k)) for k, (d, w, h) in enumerate(datas * 4)
    ]
    for a, b, x in zip(with_roi, without, rgbx):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(x, b)


def test_fused_roi_falls_back_on_truncated_and_recoverable(roi, monkeypatch):
    from kuat.errors import DecodeError

    monkeypatch.setattr(kdecode, "_roi", roi)
    data = _jpeg(_photo(200, 300), quality=90)
    c = Compose([RandomResizedCrop(64)])
    with pytest.raises(DecodeError) as ei:
        c.apply_encoded(data[: len(data) // 3], 300, 200, np.random.default_rng(1), index=3)
    assert ei.value.index == 3
    sos = data.index(b"\xff\xda")
    recoverable = data[:sos] + b"\x00\x00" + data[sos:]  # libjpeg warns: Pillow decodes it
    out = c.apply_encoded(recoverable, 300, 200, np.random.default_rng(1))
    ref = c.apply_encoded(data, 300, 200, np.random.default_rng(1))
    assert np.abs(out.astype(int) - ref).max() <= 2
