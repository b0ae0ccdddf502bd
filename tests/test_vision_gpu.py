"""GPU decode (decode_device="cuda"): nvJPEG batches with the CPU path's crop planning.

The nvJPEG tests run only where CUDA is present; the device-agnostic second half of the path
(plan, crop, resize, orient, flip on decoded tensors) is also checked on the CPU.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image

from kuat.errors import DecodeError, KuatError
from kuat.vision import (
    CenterCrop,
    Compose,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    _exif,
    decode_image,
)
from kuat.vision.decode import decode_stored
from kuat.vision.gpu import decode_batch_cuda, finish_batch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    import skimage.data

    base = Image.fromarray(skimage.data.astronaut()).resize((w, h), Image.BICUBIC)
    a = np.asarray(base).astype(np.int16)
    a = a + np.random.default_rng(seed).integers(-4, 5, size=a.shape)
    return np.clip(a, 0, 255).astype(np.uint8)


def _jpeg(a: np.ndarray, orientation: int = 1, mode: str = "RGB") -> bytes:
    b = io.BytesIO()
    kw = {}
    if orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif.tobytes()
    Image.fromarray(a).convert(mode).save(b, "JPEG", quality=92, **kw)
    return b.getvalue()


def _batch():
    datas, sizes = [], []
    for k, (h, w, o) in enumerate([(150, 200, 1), (120, 180, 6), (160, 140, 3), (90, 130, 8)]):
        data = _jpeg(_photo(h, w, k), o)
        datas.append(data)
        sizes.append((w, h) if o < 5 else (h, w))  # oriented (width, height)
    return datas, sizes


def _diff(a, b):
    d = (a.cpu().to(torch.int16) - b.cpu().to(torch.int16)).abs()
    return int(d.max()), float(d.float().mean())


def test_finish_batch_matches_cpu_fused_path():
    """The device-agnostic half, run on CPU tensors: same boxes and pixels as apply_encoded."""
    datas, sizes = _batch()
    c = Compose([RandomResizedCrop(64), RandomHorizontalFlip()])
    images, orientations = [], []
    for data in datas:
        d = decode_stored(data)
        images.append(torch.from_numpy(np.ascontiguousarray(d.pixels)).permute(2, 0, 1))
        orientations.append(d.orientation)
    rngs = [np.random.default_rng(k) for k in range(4)]
    out = finish_batch(
        c,
        images,
        orientations,
        [w for w, _ in sizes],
        [h for _, h in sizes],
        rngs,
        [0] * 4,
        [None] * 4,
    )
    assert out.shape == (4, 3, 64, 64) and out.dtype == torch.uint8
    for k, (data, (w, h)) in enumerate(zip(datas, sizes)):
        ref = c.apply_encoded(data, w, h, np.random.default_rng(k))
        mx, mean = _diff(out[k], torch.from_numpy(ref))  # float vs uint8 resize kernels
        assert mx <= 2 and mean < 0.3, (k, mx, mean)


def test_finish_batch_variable_size_returns_list():
    datas, sizes = _batch()
    c = Compose([Resize(32)])
    images = [
        torch.from_numpy(np.ascontiguousarray(decode_stored(d).pixels)).permute(2, 0, 1)
        for d in datas
    ]
    orientations = [_exif.jpeg_orientation(d) for d in datas]
    rngs = [np.random.default_rng(k) for k in range(4)]
    out = finish_batch(
        c,
        images,
        orientations,
        [w for w, _ in sizes],
        [h for _, h in sizes],
        rngs,
        [0] * 4,
        [None] * 4,
    )
    assert isinstance(out, list)
    for t, data in zip(out, datas):
        full = decode_image(data)  # (H, W, 3), oriented
        assert tuple(t.shape) == (3, *Resize(32).output_for(full.shape[0], full.shape[1]))
        ref = TF.resize(torch.from_numpy(full).permute(2, 0, 1), [32], antialias=True)
        assert _diff(t, ref)[1] < 0.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_without_cuda_raises_kuat_error():
    datas, sizes = _batch()
    c = Compose([RandomResizedCrop(64)])
    with pytest.raises(KuatError, match="CUDA"):
        decode_batch_cuda(c, datas, [1] * 4, [1] * 4, [None] * 4)
    with pytest.raises(KuatError, match="CUDA"):
        Compose([RandomResizedCrop(64)], decode_device="cuda")


@cuda
def test_cuda_batch_matches_reference_on_same_boxes():
    datas, sizes = _batch()
    c = Compose([RandomResizedCrop(64), RandomHorizontalFlip()], decode_device="cuda")
    rngs = [np.random.default_rng(k) for k in range(4)]
    out = c.apply_encoded_batch(datas, [w for w, _ in sizes], [h for _, h in sizes], rngs)
    assert out.shape == (4, 3, 64, 64) and out.dtype == torch.uint8 and out.is_cuda
    for k, (data, (w, h)) in enumerate(zip(datas, sizes)):
        # the same box on the CPU decode: nvJPEG and libjpeg-turbo differ only slightly
        plan = c.plan(w, h, np.random.default_rng(k))
        full = torch.from_numpy(decode_image(data)).permute(2, 0, 1)
        ref = TF.resized_crop(
            full,
            round(plan.top),
            round(plan.left),
            round(plan.height),
            round(plan.width),
            [64, 64],
            antialias=True,
        )
        ref = TF.horizontal_flip(ref) if plan.flip else ref
        mx, mean = _diff(out[k], ref)
        assert mean < 2.0 and mx <= 40, (k, mx, mean)


@cuda
def test_cuda_batch_falls_back_for_cmyk_and_png_and_reports_corrupt():
    src = _photo(100, 120)
    b = io.BytesIO()
    Image.fromarray(src).save(b, "PNG")
    datas = [_jpeg(src), _jpeg(src, mode="CMYK"), b.getvalue()]
    c = Compose([CenterCrop(64)], decode_device="cuda")
    rngs = [np.random.default_rng(k) for k in range(3)]
    out = c.apply_encoded_batch(datas, [120] * 3, [100] * 3, rngs)
    for k, data in enumerate(datas):
        ref = c.apply_encoded(data, 120, 100, np.random.default_rng(k))
        mx, mean = _diff(out[k], torch.from_numpy(ref))
        # k=0 went through nvJPEG, whose chroma upsampling differs from libjpeg-turbo's fancy
        # upsampling on this sharp synthetic photo (measured on an H200, CUDA 13: mean 2.42);
        # the CMYK JPEG and the PNG were decoded on the CPU by the same code as the reference
        bound = 3.0 if k == 0 else 0.5
        assert mean < bound, (k, mx, mean)
    bad = datas[0][: len(datas[0]) // 2]
    with pytest.raises(DecodeError) as ei:
        c.apply_encoded_batch([datas[0], bad], [120] * 2, [100] * 2, rngs[:2], indices=[10, 11])
    assert ei.value.index == 11


def _cpu_nvjpeg(monkeypatch, fail=False):
    """Stand-in for nvJPEG: torchvision's CPU JPEG decoder, so the batch path runs here."""
    import torchvision.io

    import kuat.vision.gpu as kgpu

    real = torchvision.io.decode_jpeg
    calls = []

    def fake(tensors, mode, device):
        calls.append(len(tensors))
        if fail:
            raise RuntimeError("nvjpeg: simulated failure")
        return real(tensors, mode=mode, device="cpu")  # stored orientation, like nvJPEG

    monkeypatch.setattr(torchvision.io, "decode_jpeg", fake)
    monkeypatch.setattr(kgpu, "check_cuda", lambda device="cuda": None)
    return calls


def test_batch_path_with_stand_in_decoder(monkeypatch):
    """decode_batch_cuda end to end (nvJPEG replaced by torchvision's CPU decoder)."""
    calls = _cpu_nvjpeg(monkeypatch)
    datas, sizes = _batch()
    src = _photo(100, 120)
    b = io.BytesIO()
    Image.fromarray(src).save(b, "PNG")
    datas = datas + [_jpeg(src, mode="CMYK"), b.getvalue()]
    sizes = sizes + [(120, 100), (120, 100)]
    c = Compose([RandomResizedCrop(64), RandomHorizontalFlip()])
    rngs = [np.random.default_rng(k) for k in range(len(datas))]
    ws, hs = [w for w, _ in sizes], [h for _, h in sizes]
    out = decode_batch_cuda(c, datas, ws, hs, rngs, device="cpu")
    assert calls == [4]  # the 4 YCbCr JPEGs in one batch; CMYK and PNG on the CPU path
    assert out.shape == (6, 3, 64, 64) and out.dtype == torch.uint8
    for k, (data, (w, h)) in enumerate(zip(datas, sizes)):
        ref = c.apply_encoded(data, w, h, np.random.default_rng(k))
        mx, mean = _diff(out[k], torch.from_numpy(ref))
        assert mx <= 3 and mean < 0.5, (k, mx, mean)


def test_batch_path_failure_falls_back_and_names_the_bad_sample(monkeypatch):
    _cpu_nvjpeg(monkeypatch, fail=True)
    datas, sizes = _batch()
    c = Compose([CenterCrop(48)])
    rngs = [np.random.default_rng(k) for k in range(4)]
    ws, hs = [w for w, _ in sizes], [h for _, h in sizes]
    out = decode_batch_cuda(c, datas, ws, hs, rngs, device="cpu")  # all decoded on the CPU
    for k, (data, (w, h)) in enumerate(zip(datas, sizes)):
        ref = c.apply_encoded(data, w, h, np.random.default_rng(k))
        assert _diff(out[k], torch.from_numpy(ref))[0] <= 1
    bad = datas[:2] + [datas[2][:200]]
    with pytest.raises(DecodeError) as ei:
        decode_batch_cuda(
            c,
            bad,
            ws[:3],
            hs[:3],
            rngs[:3],
            device="cpu",
            indices=[7, 8, 9],
            sources=["a", "b", "c"],
        )
    assert ei.value.index == 9 and ei.value.source == "c"
    with pytest.raises(DecodeError, match="max_pixels"):
        decode_batch_cuda(
            Compose([CenterCrop(8)], max_pixels=100),
            datas[:1],
            ws[:1],
            hs[:1],
            rngs[:1],
            device="cpu",
        )
    with pytest.raises(ValueError, match="one entry per sample"):
        decode_batch_cuda(c, datas, ws[:2], hs, rngs, device="cpu")
