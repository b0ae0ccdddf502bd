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
        kuat.DecodeError: the bytes are not an image Pillow recognises; names ``source``.
    """
    if bytes(data[:2]) == b"\xff\xd8":
        import simplejpeg

        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            pass  # let Pillow have a go (and report it)
        else:
            if _exif.jpeg_orientation(data) in _exif.TRANSPOSED:
                width, height = height, width
            return ImageInfo(width, height, "jpeg")

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = _exif.pil_stored_size(im)
            codec = (im.format or "unknown").lower()
            # before load(): a TIFF still carries its tag, also where Pillow will apply it
            orientation = _exif.pil_orientation(im, data)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        where = f" ({source})" if source is not None else ""
        raise DecodeError(
            f"not a readable image{where}: {describe_pil_error(e, data)}", source=source
        ) from e
    if orientation in _exif.TRANSPOSED:
        width, height = height, width
    return ImageInfo(width, height, codec)


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
_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # length 0, type, CRC: a constant 12 bytes


def _jpeg_scan_start(buf: bytes) -> int:
    """Offset of the first start-of-scan (SOS) marker of the main image, walking the marker
    segments (so an EXIF thumbnail inside APP1 is skipped); -1 if there is none."""
    n, pos = len(buf), 2
    while pos + 4 <= n:
        if buf[pos] != 0xFF:
            return -1
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # standalone markers
            pos += 2
            continue
        if marker == 0xDA:
            return pos
        if marker == 0xD9:
            return -1
        pos += 2 + ((buf[pos + 2] << 8) | buf[pos + 3])
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
            why = "no end-of-image marker (FF D9) after its scan"
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
        where = f" ({source})" if source is not None else ""
        raise DecodeError(f"truncated {codec} image{where}: {why}", source=source)
