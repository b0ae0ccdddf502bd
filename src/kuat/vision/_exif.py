"""EXIF orientation: read it cheaply from the bytes and apply it as a NumPy view.

Only the EXIF ``Orientation`` tag (0x0112) of IFD0 counts, on every format. XMP
``tiff:Orientation`` is ignored (as libjpeg-based decoders and torchvision do), so that
``probe_image`` and ``decode_image`` always agree on the oriented size. Malformed EXIF of any
kind (truncated, wrong offsets, invalid bytes) reads as orientation 1: never an error.
"""

from __future__ import annotations

import struct

import numpy as np

ORIENTATION_TAG = 0x0112
# Orientations 5-8 swap width and height.
TRANSPOSED = frozenset({5, 6, 7, 8})
_MAX_IFD_ENTRIES = 512  # a sane IFD0 has a few dozen; bounds the loop on garbage


def tiff_orientation(buf, start: int = 0, end: int | None = None) -> int:
    """Orientation (1-8) from a TIFF-structured EXIF block in ``buf[start:end]``; 1 if absent.

    ``buf`` is bytes or a memoryview; a leading ``b"Exif\\0\\0"`` is skipped.
    """
    try:
        if end is None:
            end = len(buf)
        if bytes(buf[start : start + 6]) == b"Exif\x00\x00":
            start += 6
        order = bytes(buf[start : start + 2])
        if order == b"II":
            e = "<"
        elif order == b"MM":
            e = ">"
        else:
            return 1
        (ifd,) = struct.unpack_from(e + "I", buf, start + 4)
        p = start + ifd
        if p + 2 > end:
            return 1
        (count,) = struct.unpack_from(e + "H", buf, p)
        for k in range(min(count, _MAX_IFD_ENTRIES)):
            q = p + 2 + 12 * k
            if q + 12 > end:
                break
            tag, typ = struct.unpack_from(e + "HH", buf, q)
            if tag == ORIENTATION_TAG:
                if typ == 3:  # SHORT
                    (value,) = struct.unpack_from(e + "H", buf, q + 8)
                elif typ == 4:  # LONG (non-standard but seen)
                    (value,) = struct.unpack_from(e + "I", buf, q + 8)
                else:
                    return 1
                return value if 1 <= value <= 8 else 1
    except (struct.error, ValueError, TypeError, IndexError):
        return 1
    return 1


_APP1 = frozenset((0xE1,))


def jpeg_segments(buf, markers=frozenset()):
    """Walk a JPEG's marker segments, from just past SOI up to the first scan.

    Yields ``(marker, pos, seglen)`` for each segment whose marker is in ``markers``, for
    start-of-scan (``0xDA``, always yielded, and last), and for any segment whose length is
    broken (``seglen < 2``, or its end ``pos + 2 + seglen`` past ``len(buf)``), so that each
    caller applies its own rule to those. ``pos`` is the offset of the marker's ``FF`` byte
    and ``seglen`` the big-endian length field as stored (it counts itself, not the marker).
    Fill bytes and standalone markers (TEM, RST0-7, SOI) are skipped. The walk stops without
    yielding at end-of-image, at a byte where a marker should be and is not, or where fewer
    than 4 bytes remain: to every caller, a JPEG without a usable scan.

    Only the segments asked for are yielded, which keeps a walk to a few generator resumes.
    ``buf`` must index to ints (``bytes``, or a ``memoryview`` cast to ``"B"``). The marker
    walk behind :func:`jpeg_orientation` and :func:`kuat.vision.probe._jpeg_scan_start`;
    :func:`kuat.vision.probe._jpeg_header`, on ingest's hot path, writes it out inline.
    """
    n, pos = len(buf), 2
    while pos + 4 <= n:
        if buf[pos] != 0xFF:
            return
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # standalone markers
            pos += 2
            continue
        if marker == 0xD9:  # end of image before any scan
            return
        seglen = (buf[pos + 2] << 8) | buf[pos + 3]
        if marker == 0xDA:
            yield marker, pos, seglen
            return
        end = pos + 2 + seglen
        if marker in markers or seglen < 2 or end > n:
            yield marker, pos, seglen
        pos = end


def jpeg_orientation(buf) -> int:
    """EXIF orientation of a JPEG by walking its marker segments up to the first scan.

    Costs a few microseconds (no decode, no Pillow). Returns 1 when there is no EXIF APP1
    segment or when it is malformed.
    """
    try:
        buf = memoryview(buf).cast("B")  # ints on indexing, whatever the buffer type
        n = len(buf)
        if n < 4 or buf[0] != 0xFF or buf[1] != 0xD8:
            return 1
        for marker, pos, seglen in jpeg_segments(buf, _APP1):
            if marker == 0xDA or seglen < 2:  # no metadata after the scan starts
                return 1
            if marker == 0xE1 and bytes(buf[pos + 4 : pos + 10]) == b"Exif\x00\x00":
                return tiff_orientation(buf, pos + 10, min(n, pos + 2 + seglen))
    except (IndexError, TypeError, ValueError):
        return 1
    return 1


def pil_orientation(im, data=None) -> int:
    """EXIF orientation still to apply to the pixels Pillow gives for ``im`` (EXIF only,
    never XMP). Malformed EXIF reads as 1.

    Pillow's TIFF plugin (since Pillow 12) applies the Orientation tag itself: on open it
    reports the oriented size, on load it rotates the pixels and deletes the tag. So for a
    TIFF, call this **after** ``im.load()``: it reads the tag as Pillow left it (1 once Pillow
    has applied it, the tag on Pillow versions that do not). :func:`pil_stored_size` gives the
    size as stored, whichever Pillow opened it.

    ``data`` (the encoded bytes) lets a PNG without an ``eXIf`` chunk skip loading pixels.
    """
    try:
        fmt = im.format
        if fmt == "JPEG" and data is not None:
            return jpeg_orientation(data)
        if fmt == "TIFF":
            value = im.tag_v2.get(ORIENTATION_TAG, 1)
            return value if isinstance(value, int) and 1 <= value <= 8 else 1
        raw = im.info.get("exif")
        if raw is None and fmt == "PNG":
            # Pillow finds an eXIf chunk that follows the pixel data only after load().
            if data is not None and bytes(data).find(b"eXIf") < 0:
                return 1
            im.load()
            raw = im.info.get("exif")
        if not isinstance(raw, (bytes, bytearray)):
            return 1
        return tiff_orientation(raw)
    except Exception:  # malformed metadata must never make an image unreadable
        return 1


def pil_stored_size(im) -> tuple[int, int]:
    """``(width, height)`` of the pixels as stored in the file, before any orientation,
    for an opened (not loaded) Pillow image: a TIFF's ImageWidth/ImageLength tags (Pillow
    12+ reports a TIFF's oriented size as ``im.size``), else ``im.size``."""
    if im.format == "TIFF":
        try:
            w, h = im.tag_v2[256], im.tag_v2[257]
            if isinstance(w, int) and isinstance(h, int):
                return w, h
        except (KeyError, AttributeError):
            pass
    return im.size


def orient(a: np.ndarray, orientation: int) -> np.ndarray:
    """View of ``a`` ``(H, W, ...)`` as displayed under EXIF ``orientation`` (no copy).

    Matches ``PIL.ImageOps.exif_transpose``: 2 mirror, 3 rotate 180, 4 flip vertically,
    5 transpose, 6 rotate 90 clockwise, 7 transverse, 8 rotate 90 counter-clockwise.
    """
    if orientation == 1:
        return a
    if orientation == 2:
        return a[:, ::-1]
    if orientation == 3:
        return a[::-1, ::-1]
    if orientation == 4:
        return a[::-1]
    t = a.swapaxes(0, 1)
    if orientation == 5:
        return t
    if orientation == 6:
        return t[:, ::-1]
    if orientation == 7:
        return t[::-1, ::-1]
    if orientation == 8:
        return t[::-1]
    return a


def stored_box(
    orientation: int, stored_h: int, stored_w: int, top: float, left: float, h: float, w: float
) -> tuple[float, float, float, float]:
    """Map a box ``(top, left, h, w)`` in displayed coordinates to stored coordinates.

    The inverse of :func:`orient` for rectangles: ``orient(stored[box'], o) == orient(stored, o)[box]``.
    """
    if orientation == 2:
        return top, stored_w - left - w, h, w
    if orientation == 3:
        return stored_h - top - h, stored_w - left - w, h, w
    if orientation == 4:
        return stored_h - top - h, left, h, w
    if orientation == 5:
        return left, top, w, h
    if orientation == 6:
        return stored_h - left - w, top, w, h
    if orientation == 7:
        return stored_h - left - w, stored_w - top - h, w, h
    if orientation == 8:
        return left, stored_w - top - h, w, h
    return top, left, h, w
