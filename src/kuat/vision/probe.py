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
            width, height = im.size
            codec = (im.format or "unknown").lower()
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
