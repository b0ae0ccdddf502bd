"""The optional ROI JPEG decoder (kuat.vision._roijpeg): only the crop's rows and columns are
reconstructed, and the pixels are exactly those of a full decode at the same DCT scale.

The extension is built by the test itself (a C compiler; the libjpeg headers are vendored) when
it is not already importable; where it cannot be built the tests skip with the compiler's
reason. Which libjpeg it runs on is tested in test_vision_libjpeg.py.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import simplejpeg
from _roi import build_roi_module
from PIL import Image

from kuat.vision import Compose, RandomHorizontalFlip, RandomResizedCrop
from kuat.vision import decode as kdecode
from kuat.vision import fused as kfused
from kuat.vision import resize as kresize


@pytest.fixture(scope="module")
def roi(tmp_path_factory):
    if kdecode._roi is not None:  # built, with a libjpeg-turbo loaded at import
        return kdecode._roi
    from kuat.vision._libjpeg import load_into

    mod = build_roi_module(tmp_path_factory.mktemp("roijpeg"))
    if load_into(mod, None) is None:
        pytest.skip("no usable libjpeg-turbo for the ROI decoder here (see the warning)")
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
    monkeypatch.setattr(kfused, "ROI_CHANNELS", 4)  # RGBX into torch's resize
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


# --- the fused resize kernel (resize_planar) ------------------------------------------------


def _torch_resize(src: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """torch's uint8 antialiased bilinear resize (channels_last, the kernel torchvision v2
    uses for uint8 tensors): (h, w, 3) -> (3, H, W)."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(np.ascontiguousarray(src[:, :, :3])).permute(2, 0, 1).unsqueeze(0)
    y = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    return y[0].contiguous().numpy()  # (3, H, W)


def _simd_levels(roi) -> list[int]:
    """Every resize kernel level this CPU runs (0 C .. 3 AVX2; see ``simd`` in _roijpeg.c)."""
    simd = getattr(roi, "simd", None)
    return [None] if simd is None else list(range(simd() + 1))


@contextlib.contextmanager
def _at_level(roi, level):
    """Resize with kernel ``level`` inside (``None``: a build without levels, left as it is),
    then with the best one again."""
    if level is None:
        yield
        return
    try:
        roi.simd(level)
        yield
    finally:
        roi.simd(_simd_levels(roi)[-1])


@pytest.fixture
def simd_level(roi, request):
    """Run the test at one kernel level, then restore the best one."""
    with _at_level(roi, request.param):
        yield request.param


def _level_ids():
    roi = kdecode._roi
    return _simd_levels(roi) if roi is not None else [None]


@pytest.mark.parametrize("simd_level", _level_ids(), indirect=True)
def test_resize_planar_equals_torch_kernel(roi, simd_level):
    """Down- and upscales, identity axes, odd and even tap counts, RGB and RGBX, flipped or
    not, at every kernel level the CPU runs (C, SSE2, SSSE3, AVX2): the fused kernel's pixels
    are torch's (stated bound: 1 grey level; measured: 0)."""
    rng = np.random.default_rng(0)
    sizes = [(274, 274, 224, 224), (100, 130, 224, 224), (224, 500, 224, 224), (37, 23, 5, 61)]
    sizes += [(4, 4, 3, 3), (5, 9, 7, 2), (600, 40, 224, 224), (40, 900, 224, 223)]
    sizes += [tuple(int(v) for v in rng.integers(1, 400, 4)) for _ in range(60)]
    worst = 0
    for k, (h, w, oh, ow) in enumerate(sizes):
        channels, flip = (3, 4)[k % 2], k % 3 == 0
        src = rng.integers(0, 256, (h, w, channels), np.uint8)
        if k % 4 < 2:  # smooth content too: the rounding of near-equal sums
            src = np.cumsum(src, axis=1, dtype=np.uint8)
        out = np.empty((3, oh, ow), np.uint8)
        xs, xw, xt, xp = kresize.taps(w, ow)
        ys, yw, yt, yp = kresize.taps(h, oh)
        roi.resize_planar(
            src, h, w, channels, out, oh, ow, int(flip), xs, xw, xt, xp, ys, yw, yt, yp
        )
        ref = _torch_resize(src, (oh, ow))
        ref = ref[:, :, ::-1] if flip else ref
        d = int(np.abs(out.astype(np.int16) - ref).max())
        assert d <= 1, ((h, w, oh, ow), d)
        worst = max(worst, d)
    print(f"resize_planar (level {simd_level}) vs torch: max abs diff {worst} over {len(sizes)} sizes")


def test_resize_kernel_levels_give_the_same_pixels(roi):
    """Every kernel level writes the same bytes (integer sums: the order of the taps does not
    matter), also for the batch path, whose padded row buffer lets the AVX2 kernel take a
    crop's last rows; a level above the CPU's best is refused."""
    levels = _simd_levels(roi)
    if levels == [None]:
        pytest.skip("this ROI decoder build has no kernel levels")
    rng = np.random.default_rng(3)
    photo = (np.cumsum(rng.integers(0, 9, (333, 271, 3)), axis=1) % 256).astype(np.uint8)
    data = _jpeg(photo)
    jobs = []
    for slot, (y0, y1, x0, x1) in enumerate([(0, 333, 0, 271), (7, 120, 13, 261), (300, 333, 5, 9)]):
        h, w = y1 - y0, x1 - x0
        jobs.append((data, 8, y0, y1, x0, x1, slot, slot % 2, *kresize.taps(w, 61), *kresize.taps(h, 50)))
    outs = []
    for level in levels:
        with _at_level(roi, level):
            out = np.zeros((3, 3, 50, 61), np.uint8)
            assert roi.decode_resize_batch(jobs, out, 3, 50, 61) == []
            outs.append(out)
    for level, out in zip(levels, outs):
        assert np.array_equal(out, outs[0]), level
    with pytest.raises(ValueError, match="above what this CPU runs"):
        roi.simd(levels[-1] + 1)
    assert roi.simd() == levels[-1]  # the refused level changed nothing


def test_taps_windows_inside_the_image():
    for n_in, n_out in [(1, 7), (7, 1), (5, 5), (333, 224), (224, 333), (2, 3), (1000, 3)]:
        start, weights, taps, precision = kresize.taps(n_in, n_out)
        assert start.shape == (n_out,) and weights.shape == (n_out, taps)
        assert start.min() >= 0 and (start + taps).max() <= n_in
        sums = weights.astype(np.int64).sum(axis=1)  # each row: 1.0 in fixed point, +-rounding
        assert np.abs(sums - (1 << precision)).max() <= taps, (n_in, n_out)


def test_resize_planar_rejects_bad_arguments(roi):
    src = np.zeros((10, 12, 4), np.uint8)
    out = np.empty((3, 5, 6), np.uint8)
    xs, xw, xt, xp = kresize.taps(12, 6)
    ys, yw, yt, yp = kresize.taps(10, 5)
    with pytest.raises(ValueError, match="too small"):
        roi.resize_planar(src, 20, 12, 4, out, 5, 6, 0, xs, xw, xt, xp, ys, yw, yt, yp)
    with pytest.raises(ValueError, match="column tap window"):
        bad = np.array(xs) + 12
        roi.resize_planar(src, 10, 12, 4, out, 5, 6, 0, bad, xw, xt, xp, ys, yw, yt, yp)
    with pytest.raises(ValueError, match="sizes"):
        roi.resize_planar(src, 10, 12, 2, out, 5, 6, 0, xs, xw, xt, xp, ys, yw, yt, yp)


def _box_reference(data, plan, size, *, torchvision: bool):
    """The same box as the fused path at full scale (its integer box), resized by torch's
    channels_last uint8 kernel (``torchvision=False``: kuat's exact path) or by torchvision's
    ``resized_crop(..., antialias=True)``, flipped as planned: (3, H, W) uint8."""
    import torch
    import torchvision.transforms.v2.functional as TF

    from kuat.vision import decode_image

    full = decode_image(data)  # (H, W, 3), oriented
    i, j = round(plan.top), round(plan.left)
    h, w = round(plan.top + plan.height) - i, round(plan.left + plan.width) - j
    if torchvision:
        t = torch.from_numpy(full).permute(2, 0, 1)  # (3, H, W) view
        ref = TF.resized_crop(t, i, j, h, w, list(size), antialias=True).numpy()
    else:
        ref = _torch_resize(full[i : i + h, j : j + w], size)
    return ref[:, :, ::-1] if plan.flip else ref


@pytest.mark.parametrize("exact", [False, True])
def test_fused_resize_vs_torch_on_the_same_box(roi, monkeypatch, exact):
    """ImageNet-sized photographs at full DCT scale. Fast mode (default): mean absolute
    difference per channel vs torchvision's RandomResizedCrop (antialias=True) on the same
    box below 0.05 grey levels and no pixel off by more than 1. Exact mode: equal to torch's
    channels_last kernel on the box, i.e. kuat's pixels before the fused kernel."""
    from kuat.demo_data import load_source_photos, make_jpeg

    monkeypatch.setattr(kdecode, "_roi", roi)
    photos = load_source_photos()
    names = sorted(photos)
    c = Compose([RandomResizedCrop(224), RandomHorizontalFlip()], exact_resize=exact)
    mads = []
    for k in range(8):
        data, _ = make_jpeg(photos[names[k % len(names)]], 1000 + k)
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
        plan = c.plan(w, h, np.random.default_rng(k))
        assert plan.min_scale() > 0.5  # full scale: the box is below 2x the output
        out = c.apply_encoded(data, w, h, np.random.default_rng(k))
        ref_torch = _box_reference(data, plan, (224, 224), torchvision=False)
        ref_tv = _box_reference(data, plan, (224, 224), torchvision=True)
        d = np.abs(out.astype(np.int16) - ref_tv)
        mads.append(d.reshape(3, -1).mean(axis=1))  # (3,) per channel
        if exact:
            np.testing.assert_array_equal(out, ref_torch)
        assert d.max() <= 1, (k, int(d.max()))
    mad = np.max(mads, axis=0)
    print(f"exact={exact}: worst per-channel MAD vs torchvision {mad.round(4).tolist()}")
    assert (mad < 0.05).all(), mad


def test_fast_and_exact_modes_agree_across_orientations(roi, monkeypatch):
    """Every EXIF orientation (1 and 2 fused, the rest on the exact path) and reduced DCT
    scales: the two modes differ by at most 1 grey level."""
    monkeypatch.setattr(kdecode, "_roi", roi)
    fast = Compose([RandomResizedCrop((64, 48), scale=(0.2, 1.0)), RandomHorizontalFlip()])
    exact = Compose(
        [RandomResizedCrop((64, 48), scale=(0.2, 1.0)), RandomHorizontalFlip()], exact_resize=True
    )
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        src = _photo(480, 640, seed=orientation)
        data = _jpeg(src, quality=90, exif=exif.tobytes())
        w, h = (480, 640) if orientation >= 5 else (640, 480)
        for seed in range(4):
            a = fast.apply_encoded(data, w, h, np.random.default_rng(seed))
            b = exact.apply_encoded(data, w, h, np.random.default_rng(seed))
            assert np.abs(a.astype(np.int16) - b).max() <= 1, (orientation, seed)


def test_exact_resize_validated():
    with pytest.raises(TypeError, match="exact_resize"):
        Compose([RandomResizedCrop(8)], exact_resize=1)
    assert "exact_resize=True" in repr(Compose([RandomResizedCrop(8)], exact_resize=True))


# --- one call per batch (decode_resize_batch) -----------------------------------------------


def _mixed_batch():
    """JPEGs of every kind the batch call takes or hands back: ImageNet-like photos, 4:4:4,
    progressive, grayscale, EXIF mirror (2, batched) and rotation (6, per image), a CMYK JPEG,
    a PNG, small images a 224 crop upsamples, and one a 1/2-scale decode covers."""
    from kuat.demo_data import load_source_photos, make_jpeg

    photos = load_source_photos()
    names = sorted(photos)
    items = []
    for k in range(6):
        data, _ = make_jpeg(photos[names[k % len(names)]], 2000 + k)
        with Image.open(io.BytesIO(data)) as im:
            items.append((data, *im.size))
    src = _photo(300, 400, seed=5)
    items.append((_jpeg(src, quality=90, subsampling=0), 400, 300))
    items.append((_jpeg(src, quality=85, progressive=True), 400, 300))
    items.append((_jpeg(np.asarray(Image.fromarray(src).convert("L")), quality=85), 400, 300))
    for orientation, (w, h) in ((2, (400, 300)), (6, (300, 400))):
        exif = Image.Exif()
        exif[0x0112] = orientation
        items.append((_jpeg(src, quality=90, exif=exif.tobytes()), w, h))
    b = io.BytesIO()
    Image.fromarray(src).convert("CMYK").save(b, "JPEG", quality=90)
    items.append((b.getvalue(), 400, 300))
    b = io.BytesIO()
    Image.fromarray(src).save(b, "PNG")
    items.append((b.getvalue(), 400, 300))
    items.append((_jpeg(_photo(90, 120, seed=7), quality=90), 120, 90))
    items.append((_jpeg(_photo(1200, 1600, seed=8), quality=90), 1600, 1200))
    return items


@pytest.mark.parametrize("exact", [False, True])
def test_batch_call_equals_per_image_calls(roi, monkeypatch, exact):
    """apply_encoded_many == apply_encoded per sample, pixel for pixel, for every kind of
    image (batched, handed back, per image), flips, scales, and exact mode (all per image)."""
    monkeypatch.setattr(kdecode, "_roi", roi)
    items = _mixed_batch() * 2
    c = Compose([RandomResizedCrop(96), RandomHorizontalFlip()], exact_resize=exact)
    datas, widths, heights = zip(*items)
    out = np.full((len(items), 3, 96, 96), 7, np.uint8)
    calls = []
    real = roi.decode_resize_batch

    def counted(jobs, *a):
        calls.append(len(jobs))
        return real(jobs, *a)

    monkeypatch.setattr(roi, "decode_resize_batch", counted, raising=False)
    rngs = [np.random.default_rng(k) for k in range(len(items))]
    c.apply_encoded_many(datas, widths, heights, rngs, out)
    for k, (d, w, h) in enumerate(items):
        ref = c.apply_encoded(d, w, h, np.random.default_rng(k))
        np.testing.assert_array_equal(out[k], ref, err_msg=f"sample {k}")
    # fast mode: one call for all batchable samples (not the CMYK, PNG or rotated ones)
    assert calls == ([] if exact else [len(items) - 3 * 2])


def test_batch_call_reports_the_first_bad_sample_as_the_per_image_path_does(roi, monkeypatch):
    from kuat.errors import DecodeError

    monkeypatch.setattr(kdecode, "_roi", roi)
    good = _jpeg(_photo(200, 300), quality=90)
    truncated = good[: len(good) // 3]
    sos = good.index(b"\xff\xda")
    recoverable = good[:sos] + b"\x00\x00" + good[sos:]  # libjpeg warns: Pillow decodes it
    c = Compose([RandomResizedCrop(64)])
    datas = [good, recoverable, good, truncated, b"not an image", good]
    out = np.zeros((len(datas), 3, 64, 64), np.uint8)
    rngs = [np.random.default_rng(k) for k in range(len(datas))]
    with pytest.raises(DecodeError) as ei:
        c.apply_encoded_many(datas, [300] * 6, [200] * 6, rngs, out, indices=range(10, 16))
    assert ei.value.index == 13
    # without the bad ones, the recoverable JPEG takes the per-image path's Pillow fallback
    datas = [good, recoverable, good]
    out = np.zeros((3, 3, 64, 64), np.uint8)
    c.apply_encoded_many(datas, [300] * 3, [200] * 3, [np.random.default_rng(k) for k in range(3)], out)
    for k, d in enumerate(datas):
        np.testing.assert_array_equal(out[k], c.apply_encoded(d, 300, 200, np.random.default_rng(k)))


def test_batch_call_validates_out_and_jobs(roi, monkeypatch):
    monkeypatch.setattr(kdecode, "_roi", roi)
    c = Compose([RandomResizedCrop(32)])
    data = _jpeg(_photo(100, 120), quality=90)
    with pytest.raises(ValueError, match="out must be"):
        c.apply_encoded_many([data], [120], [100], [np.random.default_rng(0)], np.zeros((1, 3, 16, 16), np.uint8))
    out = np.zeros((1, 3, 32, 32), np.uint8)
    taps = kresize.taps(64, 32)
    with pytest.raises(ValueError, match="slot"):
        roi.decode_resize_batch([(data, 8, 0, 64, 0, 64, 1, 0, *taps, *taps)], out, 1, 32, 32)
    with pytest.raises(ValueError, match="tap window|taps"):
        roi.decode_resize_batch([(data, 8, 0, 16, 0, 64, 0, 0, *taps, *taps)], out, 1, 32, 32)
    with pytest.raises(ValueError, match="cannot hold"):
        roi.decode_resize_batch([], out, 2, 32, 32)
    assert roi.decode_resize_batch([], out, 1, 32, 32) == []


@pytest.mark.parametrize("variant", sorted(VARIANTS) + ["restart"])
def test_batch_rows_equal_crop_then_resize(roi, variant):
    """decode_resize_batch hands the decoded rows to the horizontal pass as libjpeg gives them
    (2 rows a call with 2x2 chroma subsampling, 1 with none, a partial group at a box's
    edges); its slots equal decode_crop + resize_planar of the same box, byte for byte, for
    every subsampling, progressive and restart-marker JPEGs, every DCT scale, boxes touching
    every edge, up- and downscales, flipped or not, at every kernel level."""
    rng = np.random.default_rng([*sorted(VARIANTS), "restart"].index(variant))
    photo = _photo(203, 317, seed=4)
    if variant == "gray":
        photo = np.repeat(np.asarray(Image.fromarray(photo).convert("L"))[:, :, None], 3, axis=2)
        data = _jpeg(photo[:, :, 0], quality=85)
    elif variant == "restart":
        b = io.BytesIO()
        Image.fromarray(photo).save(b, "JPEG", quality=85, restart_marker_rows=1)
        data = b.getvalue()
    else:
        data = _jpeg(photo, **VARIANTS[variant])
    out_h, out_w = 37, 53
    jobs = []
    for slot in range(24):
        k = (8, 4, 2, 1)[slot % 4]
        ph, pw = -(-203 * k // 8), -(-317 * k // 8)
        y0, y1 = sorted(int(v) for v in rng.choice(ph + 1, 2, replace=False))
        x0, x1 = sorted(int(v) for v in rng.choice(pw + 1, 2, replace=False))
        if slot % 6 == 1:
            y0, x1 = 0, pw  # top-right corner
        elif slot % 6 == 2:
            y1, x0 = ph, 0  # bottom-left corner
        elif slot % 6 == 3:
            y0, y1, x0, x1 = 0, ph, 0, pw  # the whole image
        h, w = y1 - y0, x1 - x0
        jobs.append(
            (data, k, y0, y1, x0, x1, slot, slot % 2, *kresize.taps(w, out_w), *kresize.taps(h, out_h))
        )
    for level in _simd_levels(roi):
        with _at_level(roi, level):
            out = np.zeros((len(jobs), 3, out_h, out_w), np.uint8)
            assert roi.decode_resize_batch(jobs, out, len(jobs), out_h, out_w) == []
            for job in jobs:
                _, k, y0, y1, x0, x1, slot, flip = job[:8]
                crop = np.empty((y1 - y0, x1 - x0, 4), np.uint8)
                roi.decode_crop(data, k, y0, y1, x0, x1, crop, 4)
                ref = np.empty((3, out_h, out_w), np.uint8)
                roi.resize_planar(crop, y1 - y0, x1 - x0, 4, ref, out_h, out_w, flip, *job[8:])
                assert np.array_equal(out[slot], ref), (level, variant, job[1:8])
