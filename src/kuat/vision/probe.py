"""Read an encoded image's size and codec from its header, without decoding pixels."""

from __future__ import annotations

import io
from typing import NamedTuple

from kuat.errors import DecodeError

# EXIF orientations 5-8 are transposed: the displayed image has width and height swapped.
_TRANSPOSED_ORIENTATIONS = {5, 6, 7, 8}
_EXIF_ORIENTATION_TAG = 0x0112


class ImageInfo(NamedTuple):
    """Size of an image as ``decode_image`` returns it (after EXIF orientation), in pixels."""

    width: int
    height: int
    codec: str  # lower-case Pillow format name: "jpeg", "png", "webp", "bmp", "gif", "tiff"


def probe_image(data: bytes | memoryview, *, source: object = None) -> ImageInfo:
    """Width, height (after EXIF orientation) and codec of an encoded image.

    Reads only the header (Pillow's lazy open), so it costs microseconds, not a decode.
    Malformed EXIF is ignored (the stored size is returned).

    Raises:
        kuat.DecodeError: the bytes are not an image Pillow recognises; names ``source``.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
            codec = (im.format or "unknown").lower()
            try:
                orientation = im.getexif().get(_EXIF_ORIENTATION_TAG, 1)
            except Exception:  # malformed EXIF must not make an image unreadable
                orientation = 1
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        where = f" ({source})" if source is not None else ""
        raise DecodeError(f"not a readable image{where}: {e}", source=source) from e
    if orientation in _TRANSPOSED_ORIENTATIONS:
        width, height = height, width
    return ImageInfo(width, height, codec)
