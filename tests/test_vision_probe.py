"""``probe_complete`` (ingest's one-walk JPEG probe) gives what ``probe_image`` plus
``check_complete`` give, and both give Pillow's ``ImageOps.exif_transpose`` size, for every
common JPEG variant; unusual ones take the general path and still agree."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import simplejpeg
from PIL import Image, ImageOps

from kuat.errors import DecodeError
from kuat.vision import _exif
from kuat.vision.probe import (
    _jpeg_header,
    _jpeg_scan_start,
    check_complete,
    probe_complete,
    probe_image,
)


def _jpeg(mode: str = "RGB", size=(40, 24), **save) -> bytes:
    rng = np.random.default_rng(0)
    bands = {"L": 1, "RGB": 3, "CMYK": 4}[mode]
    arr = rng.integers(0, 256, (size[1], size[0], bands), np.uint8).squeeze()
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, "JPEG", **save)
    return buf.getvalue()


def _with_exif(data: bytes, orientation: int, thumbnail: bool = False) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    im = Image.open(io.BytesIO(data))
    buf = io.BytesIO()
    im.save(buf, "JPEG", exif=exif.tobytes(), quality=90)
    out = buf.getvalue()
    if thumbnail:  # an APP0 JFIF thumbnail and a COM segment before the frame: more markers
        com = b"\xff\xfe" + struct.pack(">H", 2 + 5) + b"hello"
        out = out[:2] + com + out[2:]
    return out


VARIANTS = {
    "baseline": _jpeg(),
    "progressive": _jpeg(progressive=True),
    "grayscale": _jpeg("L"),
    "cmyk": _jpeg("CMYK"),
    "subsampling 4:4:4": _jpeg(subsampling=0),
    "subsampling 4:2:2": _jpeg(subsampling=1),
    "restart markers": _jpeg(restart_marker_blocks=1),
    "optimized": _jpeg(optimize=True),
    **{f"orientation {o}": _with_exif(_jpeg(), o) for o in range(1, 9)},
    "orientation 6 + comment": _with_exif(_jpeg(), 6, thumbnail=True),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_one_walk_probe_agrees_with_pillow(name):
    data = VARIANTS[name]
    with Image.open(io.BytesIO(data)) as im:
        want = ImageOps.exif_transpose(im).size  # (W, H) after orientation
    assert _jpeg_header(data) is not None  # these are all ordinary: the fast path took them
    info = probe_complete(data)
    assert (info.width, info.height) == want
    assert info == probe_image(data)
    check_complete(data, "jpeg")


@pytest.mark.parametrize("name", ["baseline", "progressive", "orientation 6"])
def test_one_walk_probe_refuses_truncated_jpegs_as_check_complete_does(name):
    data = VARIANTS[name]
    cut = data[: len(data) - 40]  # the scan's tail and the end-of-image marker are gone
    with pytest.raises(DecodeError) as ref:
        check_complete(cut, "jpeg", source="x.jpg")
    with pytest.raises(DecodeError, match="x.jpg") as got:
        probe_complete(cut, source="x.jpg")
    assert str(got.value) == str(ref.value)


def test_unusual_jpegs_take_the_general_path():
    data = VARIANTS["baseline"]
    sof = data.index(b"\xff\xc0")
    lossless = data[:sof] + b"\xff\xc3" + data[sof + 2 :]  # a frame libjpeg-turbo can't decode
    assert _jpeg_header(lossless) is None
    no_frame = data[:sof] + b"\xff\xfe" + data[sof + 2 :]  # the frame header becomes a comment
    assert _jpeg_header(no_frame) is None
    with pytest.raises(DecodeError):  # neither libjpeg-turbo nor Pillow reads it
        probe_complete(no_frame, source="x.jpg")
    png = io.BytesIO()
    Image.new("RGB", (5, 3)).save(png, "PNG")
    assert tuple(probe_complete(png.getvalue())) == (5, 3, "png")


def _mutants(data: bytes) -> dict[str, bytes]:
    """Edge cases of the marker walk, each made from an ordinary JPEG ``data``."""
    dqt, sos = data.index(b"\xff\xdb"), data.index(b"\xff\xda")
    return {
        "as is": data,
        "fill bytes": data[:dqt] + b"\xff\xff\xff" + data[dqt:],  # legal before any marker
        "standalone marker": data[:dqt] + b"\xff\x01" + data[dqt:],  # TEM: no length field
        "first segment length 1": data[:4] + b"\x00\x01" + data[6:],  # before any EXIF
        "segment length 1": data[: dqt + 2] + b"\x00\x01" + data[dqt + 4 :],
        "segment past the end": data[: dqt + 2] + b"\xff\xf0" + data[dqt + 4 :],
        "end of image before the scan": data[:sos] + b"\xff\xd9",
        "junk where a marker belongs": data[:dqt] + b"\x00" + data[dqt + 1 :],
        "cut inside the header": data[: dqt + 3],
    }


@pytest.mark.parametrize("name", ["baseline", "orientation 6", "orientation 6 + comment"])
def test_the_marker_walks_agree_on_every_edge_case(name):
    # _jpeg_header writes the shared walk (_exif.jpeg_segments) out inline for speed; the
    # scan-start finder and jpeg_orientation call the shared one. They must not drift apart.
    orientation = _exif.jpeg_orientation(VARIANTS[name])
    assert orientation == (1 if name == "baseline" else 6)
    with Image.open(io.BytesIO(VARIANTS[name])) as im:
        want = ImageOps.exif_transpose(im).size  # (W, H) after orientation
    got = {}
    for case, data in _mutants(VARIANTS[name]).items():
        header, sos = _jpeg_header(data), _jpeg_scan_start(data)
        got[case] = (header is not None, sos >= 0, _exif.jpeg_orientation(data))
        if header is not None:
            assert header[2] == sos == data.index(b"\xff\xda"), case
            assert (header[0], header[1]) == probe_image(data)[:2] == want, case
            stored = simplejpeg.decode_jpeg(data).shape[:2]  # libjpeg-turbo reads it too
            assert sorted(stored) == sorted(want), case
    assert got == {
        "as is": (True, True, orientation),
        "fill bytes": (True, True, orientation),
        "standalone marker": (True, True, orientation),
        # a length under 2 stops the header walk and the orientation read, but the scan
        # finder steps over it (as it always has) and here lands on a non-marker byte
        "first segment length 1": (False, False, 1),
        "segment length 1": (False, False, orientation),
        "segment past the end": (False, False, orientation),
        "end of image before the scan": (False, False, orientation),
        "junk where a marker belongs": (False, False, orientation),
        "cut inside the header": (False, False, orientation),
    }
