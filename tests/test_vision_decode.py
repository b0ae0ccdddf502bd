"""decode_image on a fixture set the tests build themselves: every real-world variant -> right RGB."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from kuat.errors import DecodeError
from kuat.vision import decode as kdecode
from kuat.vision import decode_image, probe_image


def _smooth_rgb(h: int = 48, w: int = 64) -> np.ndarray:
    """(H, W, 3) uint8, smooth (JPEG keeps it close) and asymmetric (orientation is visible)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 255 * x / (w - 1)
    g = 255 * y / (h - 1)
    b = 128 + 100 * np.sin(x / 9.0) * np.cos(y / 7.0)
    a = np.stack([r, g, b], axis=2)
    a[: h // 4, : w // 4] = (250, 20, 20)  # a red block in the top-left corner
    return np.clip(a, 0, 255).astype(np.uint8)


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    im.save(b, fmt, **kw)
    return b.getvalue()


def _pil_rgb(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def _diff(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return int(d.max()), float(d.mean())


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))
        + kind
        + payload
        + struct.pack(">I", zlib.crc32(kind + payload))
    )


def _png16_rgb(a16: np.ndarray) -> bytes:
    """A 16-bit-per-channel RGB PNG (Pillow cannot write one), from (H, W, 3) uint16."""
    h, w, _ = a16.shape
    raw = b"".join(b"\x00" + a16[y].astype(">u2").tobytes() for y in range(h))
    ihdr = struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(raw))
        + _png_chunk(b"IEND", b"")
    )


def _insert_app_segment(jpeg: bytes, marker: int, payload: bytes) -> bytes:
    seg = bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload
    return jpeg[:2] + seg + jpeg[2:]


def _exif_bytes(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


# --- JPEG colour variants -------------------------------------------------------------------


def test_rgb_jpeg_matches_pillow_and_source():
    src = _smooth_rgb()
    data = _encode(Image.fromarray(src), "JPEG", quality=95)
    out = decode_image(data)
    assert out.shape == (48, 64, 3) and out.dtype == np.uint8 and out.flags.c_contiguous
    mx, mean = _diff(out, _pil_rgb(data))
    assert mx <= 2 and mean < 0.5
    mx, mean = _diff(out, src)
    assert mean < 3.0


def test_input_buffer_types():
    data = _encode(Image.fromarray(_smooth_rgb()), "JPEG")
    ref = decode_image(data)
    for buf in (bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        np.testing.assert_array_equal(decode_image(buf), ref)
    png = _encode(Image.fromarray(_smooth_rgb()), "PNG")
    np.testing.assert_array_equal(decode_image(memoryview(png)), _smooth_rgb())


def test_grayscale_jpeg_replicated_to_rgb():
    gray = np.asarray(Image.fromarray(_smooth_rgb()).convert("L"))
    data = _encode(Image.fromarray(gray), "JPEG", quality=95)
    out = decode_image(data)
    assert out.shape == (48, 64, 3)
    np.testing.assert_array_equal(out[:, :, 0], out[:, :, 1])
    np.testing.assert_array_equal(out[:, :, 0], out[:, :, 2])
    assert _diff(out[:, :, 0], gray)[1] < 2.0


def test_cmyk_jpeg_not_inverted():
    src = _smooth_rgb()
    data = _encode(Image.fromarray(src).convert("CMYK"), "JPEG", quality=95)
    assert b"Adobe" in data  # Pillow writes Adobe's inverted CMYK
    out = decode_image(data)
    mx, mean = _diff(out, _pil_rgb(data))
    assert mx == 0  # the reference conversion itself
    assert _diff(out, src)[1] < 3.0
    assert tuple(out[2, 2]) > (200,) and out[2, 2, 1] < 60 and out[2, 2, 2] < 60  # red stays red


def _ycck_jpeg(src: np.ndarray) -> bytes:
    """A YCCK JPEG (Adobe transform 2): Pillow cannot write one, so write CMYK and relabel.

    libjpeg turns YCCK into CMYK as ``C = 255 - R(YCC)``; Pillow stores CMYK inverted, so
    storing ``YCbCr(c, m, y)`` and ``255 - k`` yields the CMYK of ``src`` on decode.
    """
    c, m, y, k = Image.fromarray(src).convert("CMYK").split()
    ycc = Image.merge("RGB", (c, m, y)).convert("YCbCr")
    stored = [np.asarray(ch) for ch in ycc.split()] + [255 - np.asarray(k)]
    inv = Image.merge("CMYK", [Image.fromarray(255 - s) for s in stored])  # Pillow inverts on save
    data = bytearray(_encode(inv, "JPEG", quality=95))
    at = data.index(b"Adobe")
    assert data[at + 11] == 0  # transform flag: 0 = CMYK
    data[at + 11] = 2  # 2 = YCCK
    return bytes(data)


def test_ycck_jpeg():
    import simplejpeg

    src = _smooth_rgb()
    data = _ycck_jpeg(src)
    assert simplejpeg.decode_jpeg_header(data)[2] == "YCCK"
    out = decode_image(data)
    assert _diff(out, _pil_rgb(data))[0] == 0
    assert _diff(out, src)[1] < 3.0


# --- PNG and other formats ------------------------------------------------------------------


def test_rgba_png_alpha_dropped():
    src = _smooth_rgb()
    alpha = np.tile(np.linspace(0, 255, 64).astype(np.uint8), (48, 1))
    rgba = np.dstack([src, alpha])
    out = decode_image(_encode(Image.fromarray(rgba, "RGBA"), "PNG"))
    np.testing.assert_array_equal(out, src)
    assert out.flags.c_contiguous and out.flags.writeable


def test_la_png_alpha_dropped():
    gray = np.asarray(Image.fromarray(_smooth_rgb()).convert("L"))
    la = Image.merge("LA", (Image.fromarray(gray), Image.fromarray(255 - gray)))
    out = decode_image(_encode(la, "PNG"))
    np.testing.assert_array_equal(out, np.repeat(gray[:, :, None], 3, axis=2))


def test_palette_png_with_transparency():
    palette = [0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * (256 * 3 - 12)
    idx = (np.arange(48 * 64).reshape(48, 64) % 4).astype(np.uint8)
    im = Image.fromarray(idx, "P")
    im.putpalette(palette)
    data = _encode(im, "PNG", transparency=1)  # index 1 (red) is fully transparent
    with Image.open(io.BytesIO(data)) as check:
        assert check.mode == "P" and "transparency" in check.info
    out = decode_image(data)
    expected = np.array(palette[:12], np.uint8).reshape(4, 3)[idx]
    np.testing.assert_array_equal(out, expected)


def test_png16_gray_scaled_not_clipped():
    v = (np.arange(48 * 64).reshape(48, 64) * 21).astype(np.uint16)  # 0 .. 64491
    data = _encode(Image.fromarray(v), "PNG")
    out = decode_image(data)
    np.testing.assert_array_equal(out[:, :, 0], (v >> 8).astype(np.uint8))
    np.testing.assert_array_equal(out[:, :, 2], out[:, :, 0])
    assert out.max() == 251 and out.min() == 0


def test_png16_rgb():
    rng = np.random.default_rng(0)
    a16 = rng.integers(0, 65536, size=(12, 10, 3), dtype=np.uint16)
    a16[0, 0] = (65535, 0, 257)
    out = decode_image(_png16_rgb(a16))
    np.testing.assert_array_equal(out, (a16 >> 8).astype(np.uint8))
    assert tuple(out[0, 0]) == (255, 0, 1)


@pytest.mark.parametrize("fmt", ["WEBP", "BMP", "TIFF"])
def test_other_formats_lossless(fmt):
    src = _smooth_rgb()
    kw = {"lossless": True} if fmt == "WEBP" else {}
    np.testing.assert_array_equal(decode_image(_encode(Image.fromarray(src), fmt, **kw)), src)


def test_gif_first_frame():
    frames = [Image.new("RGB", (16, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    data = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    out = decode_image(data)
    assert out.shape == (8, 16, 3)
    assert tuple(out[4, 4]) == (255, 0, 0)


# --- EXIF orientation -----------------------------------------------------------------------


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_exif_orientation(fmt, orientation):
    src = _smooth_rgb()
    kw = {"quality": 95} if fmt == "JPEG" else ({"lossless": True} if fmt == "WEBP" else {})
    data = _encode(Image.fromarray(src), fmt, exif=_exif_bytes(orientation), **kw)
    with Image.open(io.BytesIO(data)) as im:
        ref = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    out = decode_image(data)
    assert out.shape == ref.shape
    assert out.flags.c_contiguous and out.flags.writeable
    assert (out.shape[0] == 64) == (orientation >= 5)
    assert _diff(out, ref)[0] <= 2
    info = probe_image(data)
    assert (info.height, info.width) == out.shape[:2]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_reduced_scale(orientation):
    src = np.asarray(Image.fromarray(_smooth_rgb()).resize((256, 192)))
    data = _encode(Image.fromarray(src), "JPEG", quality=95, exif=_exif_bytes(orientation))
    want = (40, 60) if orientation < 5 else (60, 40)  # displayed (h, w)
    out = decode_image(data, min_size=want)
    with Image.open(io.BytesIO(data)) as im:
        im.draft("RGB", (64, 48))  # stored orientation: 1/4 scale
        ref = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    assert out.shape == ref.shape == ((48, 64, 3) if orientation < 5 else (64, 48, 3))
    assert _diff(out, ref)[0] <= 2


def test_min_size_picks_smallest_covering_scale():
    data = _encode(Image.fromarray(_smooth_rgb(200, 320)), "JPEG")
    assert decode_image(data, min_size=None).shape == (200, 320, 3)
    assert decode_image(data, min_size=(100, 160)).shape == (100, 160, 3)
    assert decode_image(data, min_size=(101, 10)).shape == (200, 320, 3)
    assert decode_image(data, min_size=(26, 40)).shape == (50, 80, 3)
    assert decode_image(data, min_size=(25, 40)).shape == (25, 40, 3)
    assert decode_image(data, min_size=1).shape == (25, 40, 3)
    png = _encode(Image.fromarray(_smooth_rgb(200, 320)), "PNG")
    assert decode_image(png, min_size=(25, 40)).shape == (200, 320, 3)  # never reduced


def test_cmyk_reduced_scale_through_pillow():
    src = _smooth_rgb(200, 320)
    data = _encode(Image.fromarray(src).convert("CMYK"), "JPEG", quality=95)
    out = decode_image(data, min_size=(50, 80))
    assert out.shape == (50, 80, 3)
    ref = np.asarray(Image.fromarray(src).resize((80, 50), Image.BOX))
    assert _diff(out, ref)[1] < 6.0


def test_malformed_exif_and_bad_xmp_ignored():
    src = _smooth_rgb()
    base = _encode(Image.fromarray(src), "JPEG", quality=95)
    ref = decode_image(base)
    bad_exif = b"Exif\x00\x00MM\x00\x2a\xff\xff\xff\xf0garbage"  # IFD offset past the end
    bad_xmp = (
        b'http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta tiff:Orientation="6">'
        b"\xc3\x28\xff\xfe invalid utf-8 </x:xmpmeta>"
    )
    for payload in (bad_exif, bad_xmp, b"Exif\x00\x00II*\x00\x08\x00\x00\x00\xff\xff"):
        data = _insert_app_segment(base, 0xE1, payload)
        np.testing.assert_array_equal(decode_image(data), ref)
        assert probe_image(data)[:2] == (64, 48)
    # a PNG whose XMP text chunk is not valid UTF-8
    png = _encode(Image.fromarray(src), "PNG")
    itxt = b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + b'tiff:Orientation="6" \xc3\x28\xff'
    at = png.index(b"IDAT") - 4
    png = png[:at] + _png_chunk(b"iTXt", itxt) + png[at:]
    np.testing.assert_array_equal(decode_image(png), src)
    assert probe_image(png)[:2] == (64, 48)


# --- errors ---------------------------------------------------------------------------------


def test_truncated_jpeg_raises_decode_error_with_location():
    data = _encode(Image.fromarray(_smooth_rgb()), "JPEG")
    with pytest.raises(DecodeError) as ei:
        decode_image(data[: len(data) // 2], index=17, source="shard-00003.arrow")
    assert ei.value.index == 17 and ei.value.source == "shard-00003.arrow"
    assert "17" in str(ei.value) and "shard-00003.arrow" in str(ei.value)
    assert ei.value.__cause__ is not None


def test_truncated_png_raises():
    data = _encode(Image.fromarray(_smooth_rgb()), "PNG")
    with pytest.raises(DecodeError):
        decode_image(data[: len(data) // 2], index=3)


@pytest.mark.parametrize("data", [b"", b"not an image at all", b"\xff\xd8\xff garbage" * 10])
def test_not_an_image(data):
    with pytest.raises(DecodeError) as ei:
        decode_image(data, index=5, source="x.jpg")
    assert "sample 5" in str(ei.value) and "x.jpg" in str(ei.value)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_decompression_bomb_refused(fmt):
    data = _encode(Image.fromarray(_smooth_rgb()), fmt)
    with pytest.raises(DecodeError, match="max_pixels=1000") as ei:
        decode_image(data, max_pixels=1000, index=9)
    assert ei.value.index == 9
    assert decode_image(data, max_pixels=48 * 64).shape == (48, 64, 3)
    assert decode_image(data, max_pixels=None).shape == (48, 64, 3)


def test_bad_arguments():
    data = _encode(Image.fromarray(_smooth_rgb()), "JPEG")
    with pytest.raises(ValueError):
        decode_image(data, max_pixels=0)
    with pytest.raises(ValueError):
        decode_image(data, min_size=(-1, 3))
    with pytest.raises(TypeError):
        decode_image(data, min_size="big")


def test_recoverable_jpeg_defect_decodes_through_pillow():
    """Extraneous bytes before a marker: libjpeg warns; strict simplejpeg fails; Pillow decodes."""
    data = _encode(Image.fromarray(_smooth_rgb()), "JPEG", quality=95)
    sos = data.index(b"\xff\xda")
    broken = data[:sos] + b"\x00\x00" + data[sos:]
    out = decode_image(broken)
    assert _diff(out, _pil_rgb(data))[0] <= 2


def test_reused_buffer_is_per_thread():
    data = _encode(Image.fromarray(_smooth_rgb()), "JPEG")
    d1 = kdecode.decode_stored(data, reuse_buffer=True)
    assert d1.pixels.shape == (48, 64, 3) and d1.scale == 1.0 and d1.orientation == 1
    fresh = decode_image(data)
    assert not np.shares_memory(fresh, d1.pixels)


# --- the fused transform on every fixture variant -------------------------------------------


def _fixture_set() -> dict[str, bytes]:
    """Every variant, at a size where the fused path decodes at full scale."""
    src = np.asarray(Image.fromarray(_smooth_rgb()).resize((160, 120)))
    gray = np.asarray(Image.fromarray(src).convert("L"))
    rgba = np.dstack([src, np.full(src.shape[:2], 90, np.uint8)])
    idx = (np.arange(120 * 160).reshape(120, 160) // 7 % 4).astype(np.uint8)
    pal = Image.fromarray(idx, "P")
    pal.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * (256 * 3 - 12))
    a16 = src.astype(np.uint16) * 257
    return {
        "rgb": _encode(Image.fromarray(src), "JPEG", quality=95),
        "gray": _encode(Image.fromarray(gray), "JPEG", quality=95),
        "cmyk": _encode(Image.fromarray(src).convert("CMYK"), "JPEG", quality=95),
        "ycck": _ycck_jpeg(src),
        "rgba_png": _encode(Image.fromarray(rgba, "RGBA"), "PNG"),
        "palette_png": _encode(pal, "PNG", transparency=1),
        "png16": _png16_rgb(a16),
        "webp": _encode(Image.fromarray(src), "WEBP", lossless=True),
        "exif6": _encode(Image.fromarray(src), "JPEG", quality=95, exif=_exif_bytes(6)),
        "exif7_png": _encode(Image.fromarray(src), "PNG", exif=_exif_bytes(7)),
        "bad_xmp": _insert_app_segment(
            _encode(Image.fromarray(src), "JPEG", quality=95),
            0xE1,
            b"http://ns.adobe.com/xap/1.0/\x00\xc3\x28\xff not utf-8",
        ),
    }


@pytest.mark.parametrize("kind", sorted(_fixture_set()))
def test_fused_matches_unfused_reference_on_every_variant(kind):
    """decode full -> crop -> torchvision resize -> flip, against the fused one-pass path."""
    import torch
    import torchvision.transforms.v2.functional as TF

    from kuat.vision import Compose, RandomHorizontalFlip, RandomResizedCrop

    data = _fixture_set()[kind]
    full = decode_image(data)  # (H, W, 3) oriented
    info = probe_image(data)
    assert (info.height, info.width) == full.shape[:2]
    c = Compose([RandomResizedCrop((96, 80)), RandomHorizontalFlip()])
    ref_img = torch.from_numpy(full).permute(2, 0, 1)
    for seed in range(4):
        plan = c.plan(info.width, info.height, np.random.default_rng(seed))
        assert plan.min_scale() > 0.5  # full-scale decode: the box is torchvision's exactly
        out = c.apply_encoded(data, info.width, info.height, np.random.default_rng(seed))
        i, j, h, w = round(plan.top), round(plan.left), round(plan.height), round(plan.width)
        ref = TF.resized_crop(ref_img, i, j, h, w, [96, 80], antialias=True)
        ref = TF.horizontal_flip(ref) if plan.flip else ref
        mx, mean = _diff(out, ref.numpy())
        # transposed EXIF orientations resize in stored orientation (rounding differs by 1)
        assert mx <= 1 and mean < 0.3, (kind, seed, mx, mean)


def test_not_an_image_through_fused_path():
    from kuat.vision import Compose, RandomResizedCrop

    with pytest.raises(DecodeError) as ei:
        Compose([RandomResizedCrop(8)]).apply_encoded(
            b"GIF89a garbage", 10, 10, np.random.default_rng(0), index=4, source="a.arrow"
        )
    assert ei.value.index == 4 and ei.value.source == "a.arrow"


def test_unknown_format_error_says_what_the_bytes_are_not_where_they_live():
    from kuat.errors import DecodeError
    from kuat.vision import decode_image, probe_image

    for call in (
        lambda: decode_image(b"hello", index=3, source="x.jpg"),
        lambda: probe_image(b"hello", source="x.jpg"),
    ):
        with pytest.raises(DecodeError) as info:
            call()
        message = str(info.value)
        assert "x.jpg" in message and "b'hello'" in message
        assert "object at 0x" not in message
