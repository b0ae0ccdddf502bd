"""EXIF orientation helpers: the box mapping is the exact inverse of the orientation view."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from kuat.vision import _exif


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_matches_pillow_exif_transpose(orientation):
    a = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)
    im = Image.fromarray(a)
    exif = im.getexif()
    exif[0x0112] = orientation
    b = io.BytesIO()
    im.save(b, "PNG", exif=exif.tobytes())
    with Image.open(io.BytesIO(b.getvalue())) as back:
        ref = np.asarray(ImageOps.exif_transpose(back))
    np.testing.assert_array_equal(_exif.orient(a, orientation), ref)


@settings(max_examples=300, deadline=None)
@given(
    orientation=st.integers(1, 8),
    hw=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    data=st.data(),
)
def test_stored_box_inverts_orient(orientation, hw, data):
    sh, sw = hw
    stored = np.arange(sh * sw).reshape(sh, sw)
    shown = _exif.orient(stored, orientation)
    H, W = shown.shape
    top = data.draw(st.integers(0, H - 1))
    left = data.draw(st.integers(0, W - 1))
    h = data.draw(st.integers(1, H - top))
    w = data.draw(st.integers(1, W - left))
    t, lft, bh, bw = (int(v) for v in _exif.stored_box(orientation, sh, sw, top, left, h, w))
    np.testing.assert_array_equal(
        _exif.orient(stored[t : t + bh, lft : lft + bw], orientation),
        shown[top : top + h, left : left + w],
    )


def test_orientation_readers_ignore_garbage():
    assert _exif.jpeg_orientation(b"") == 1
    assert _exif.jpeg_orientation(b"\xff\xd8\xff\xe1\x00") == 1
    assert _exif.jpeg_orientation(b"\xff\xd8\xff\xe1\x00\x01Exif\x00\x00") == 1
    assert _exif.tiff_orientation(b"Exif\x00\x00XX\x00*") == 1
    # a valid big-endian IFD with orientation 6
    ifd = (
        b"MM\x00*\x00\x00\x00\x08"
        + b"\x00\x01"
        + b"\x01\x12\x00\x03\x00\x00\x00\x01\x00\x06\x00\x00"
    )
    assert _exif.tiff_orientation(ifd) == 6
    assert (
        _exif.tiff_orientation(ifd.replace(b"\x00\x06\x00\x00", b"\x00\x09\x00\x00")) == 1
    )  # out of range
    seg = b"Exif\x00\x00" + ifd
    jpeg = b"\xff\xd8\xff\xe1" + (len(seg) + 2).to_bytes(2, "big") + seg + b"\xff\xda"
    assert _exif.jpeg_orientation(jpeg) == 6
    assert _exif.jpeg_orientation(memoryview(jpeg)) == 6
    assert _exif.jpeg_orientation(np.frombuffer(jpeg, np.uint8)) == 6
