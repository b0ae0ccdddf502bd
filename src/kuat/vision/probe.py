"""Read an encoded image's size and codec from its header, without decoding pixels."""

from __future__ import annotations

import io
from typing import NamedTuple

from kuat.errors import DecodeError
from kuat.vision import _exif


class ImageInfo(NamedTuple):
    """Size of an image as ``decode_image`` returns it (after EXIF orientation), in pixels."""

    width: int
    height: int
    codec: str  # lower-case Pillow format name: "jpeg", "png", "webp", "bmp", "gif", "tiff"


def probe_image(data: bytes | memoryview, *, source: object = None) -> ImageInfo:
    """Width, height (after EXIF orientation) and codec of an encoded image.

    Reads only the header (libjpeg-turbo's header parser for JPEG, Pillow's lazy open for
    the rest), so it costs microseconds, not a decode. Orientation comes from EXIF only (XMP
    is ignored) and malformed EXIF/XMP is ignored (the stored size is returned): exactly the
    rule ``kuat.vision.decode_image`` applies, so the two always agree on the size.

    Raises:
        kuat.DecodeError: the bytes are not an image Pillow recognises, or Pillow refuses them
            (any of its exceptions, e.g. ``DecompressionBombError`` above its pixel limit,
            chained); names ``source``.
    """
    if bytes(data[:2]) == b"\xff\xd8":
        import simplejpeg

        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except Exception:  # noqa: BLE001 (ValueError, or anything: Pillow has a go and reports)
            pass
        else:
            if _exif.jpeg_orientation(data) in _exif.TRANSPOSED:
                width, height = height, width
            return ImageInfo(width, height, "jpeg")

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = _exif.pil_stored_size(im)
            codec = (im.format or "unknown").lower()
            # before load(): a TIFF still carries its tag, also where Pillow will apply it
            orientation = _exif.pil_orientation(im, data)
    except Exception as e:  # noqa: BLE001 (any refusal: OSError, SyntaxError, ValueError, and
        # types of Pillow's own such as DecompressionBombError, which is no OSError)
        where = f" ({source})" if source is not None else ""
        raise DecodeError(
            f"not a readable image{where}: {describe_pil_error(e, data)}", source=source
        ) from e
    if orientation in _exif.TRANSPOSED:
        width, height = height, width
    return ImageInfo(width, height, codec)


# Start-of-frame markers of the JPEGs libjpeg-turbo decodes: baseline, extended sequential and
# progressive, Huffman-coded. Others (lossless, arithmetic, hierarchical) take the general path.
_TURBO_SOF = (0xC0, 0xC1, 0xC2)


def _jpeg_header(buf: bytes) -> tuple[int, int, int] | None:
    """``(width, height, start of scan)`` of an ordinary JPEG, its EXIF orientation applied,
    from one walk over its marker segments; ``None`` for anything unusual (another frame
    type, a missing or odd frame header, broken segments), which then takes the general path.

    The walk reads the same bytes as libjpeg-turbo's header parser and
    :func:`kuat.vision._exif.jpeg_orientation` (the first EXIF APP1 segment) together, at a
    third of their cost: on an ingest of original bytes, probing was as costly as reading
    the file.

    The walk is :func:`kuat.vision._exif.jpeg_segments` written out inline: on this, ingest's
    hot path (~3 us per image), calling the shared generator cost 14-40% more (medians of 41
    interleaved runs over 300 demo JPEGs), so this copy stays and must keep its rules.
    """
    n, pos = len(buf), 2
    size = None
    orientation = 1
    exif_seen = False
    while pos + 4 <= n:
        if buf[pos] != 0xFF:
            return None
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # standalone markers
            pos += 2
            continue
        if marker == 0xDA:
            if size is None:
                return None
            width, height = size
            if orientation in _exif.TRANSPOSED:
                width, height = height, width
            return width, height, pos
        if marker == 0xD9:
            return None
        seglen = (buf[pos + 2] << 8) | buf[pos + 3]
        end = pos + 2 + seglen
        if seglen < 2 or end > n:
            return None
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a frame header
            if size is not None or marker not in _TURBO_SOF or seglen < 8:
                return None
            precision, components = buf[pos + 4], buf[pos + 9]
            height = (buf[pos + 5] << 8) | buf[pos + 6]
            width = (buf[pos + 7] << 8) | buf[pos + 8]
            if precision != 8 or components not in (1, 3, 4) or not (width and height):
                return None
            size = (width, height)
        elif marker == 0xE1 and not exif_seen and buf[pos + 4 : pos + 10] == b"Exif\x00\x00":
            exif_seen = True
            orientation = _exif.tiff_orientation(buf, pos + 10, end)
        pos = end
    return None


def probe_complete(data: bytes | memoryview, *, source: object = None) -> ImageInfo:
    """:func:`probe_image` and :func:`check_complete` in one: what ingest checks of every
    image. An ordinary JPEG costs one walk over its marker segments; others, both calls.

    Raises:
        kuat.DecodeError: not a readable image, or truncated; names ``source``.
    """
    buf = data if isinstance(data, bytes) else bytes(data)
    if buf[:2] == b"\xff\xd8":
        header = _jpeg_header(buf)
        if header is not None:
            width, height, sos = header
            if buf.rfind(_JPEG_EOI) < sos:
                _truncated("jpeg", _NO_EOI, source)
            return ImageInfo(width, height, "jpeg")
    info = probe_image(buf, source=source)
    check_complete(buf, info.codec, source=source)
    return info


def describe_pil_error(e: BaseException, data: bytes | memoryview) -> str:
    """Pillow's error message, without the address of the in-memory file it was handed.

    Pillow's ``UnidentifiedImageError`` reads "cannot identify image file <_io.BytesIO object
    at 0x...>", which tells a user nothing; say what the bytes start with instead.
    """
    from PIL import UnidentifiedImageError

    if isinstance(e, UnidentifiedImageError):
        head = bytes(data[:8])
        return f"not a known image format ({len(data)} bytes starting {head!r})"
    return f"{type(e).__name__}: {e}"


_JPEG_EOI = b"\xff\xd9"
_NO_EOI = "no end-of-image marker (FF D9) after its scan"
_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # length 0, type, CRC: a constant 12 bytes


def _jpeg_scan_start(buf: bytes) -> int:
    """Offset of the first start-of-scan (SOS) marker of the main image, walking the marker
    segments (so an EXIF thumbnail inside APP1 is skipped); -1 if there is none."""
    for marker, pos, _ in _exif.jpeg_segments(buf):
        if marker == 0xDA:
            return pos
    return -1


def check_complete(data: bytes | memoryview, codec: str, *, source: object = None) -> None:
    """Cheap completeness checks that catch truncated files without decoding.

    * JPEG: an end-of-image marker (``FF D9``) after the first scan starts. Inside
      entropy-coded data ``FF`` is always followed by ``00`` or a restart marker, so the
      marker cannot occur by chance; bytes after it (padding, trailers) are allowed.
    * PNG: the ``IEND`` chunk.
    * WebP: as many bytes as the RIFF header declares; BMP: as many as its file header.

    Other codecs are not checked (a full decode, ``decode_check``, catches them).

    Raises:
        kuat.DecodeError: the image is truncated; names ``source``.
    """
    buf = bytes(data)
    why = None
    if codec == "jpeg":
        sos = _jpeg_scan_start(buf)
        if sos < 0 or buf.rfind(_JPEG_EOI) < sos:
            why = _NO_EOI
    elif codec == "png":
        if buf.rfind(_PNG_IEND) < 8:
            why = "no IEND chunk"
    elif codec == "webp" and buf[:4] == b"RIFF":
        declared = 8 + int.from_bytes(buf[4:8], "little")
        if len(buf) < declared:
            why = f"{len(buf)} bytes where its RIFF header declares {declared}"
    elif codec == "bmp" and buf[:2] == b"BM":
        declared = int.from_bytes(buf[2:6], "little")
        if len(buf) < declared:
            why = f"{len(buf)} bytes where its file header declares {declared}"
    if why is not None:
        _truncated(codec, why, source)


def _truncated(codec: str, why: str, source: object) -> None:
    where = f" ({source})" if source is not None else ""
    raise DecodeError(f"truncated {codec} image{where}: {why}", source=source)
