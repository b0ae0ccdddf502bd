"""Image decoding and fused crop/resize/flip transforms.

* ``decode.py``: :func:`decode_image`, encoded bytes -> ``(H, W, 3)`` uint8 RGB, every
  real-world variant, EXIF orientation applied, optionally at a reduced JPEG DCT scale.
* ``probe.py``: :func:`probe_image`, oriented size and codec from the header only.
* ``transforms.py``: ``Compose``, ``RandomResizedCrop``, ``Resize``, ``CenterCrop``,
  ``RandomHorizontalFlip``, ``Normalize``; a ``Compose`` fuses plan -> reduced decode -> crop ->
  resize -> flip straight into the batch buffer (``protocol.FusedImageTransform``).
* ``_roijpeg.c`` (optional, built by ``python -m kuat.vision._build_roijpeg``): decodes only
  a crop's rows and columns (libjpeg-turbo skip/crop scanlines), used by the fused path.
* ``gpu.py``: nvJPEG batch decode for ``Compose(..., decode_device="cuda")``.
* ``_exif.py``: EXIF orientation read from the bytes and applied as views.
"""

from kuat.vision.decode import DEFAULT_MAX_PIXELS, decode_image
from kuat.vision.probe import ImageInfo, probe_image
from kuat.vision.protocol import FusedImageTransform
from kuat.vision.transforms import (
    CenterCrop,
    Compose,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)

__all__ = [
    "decode_image",
    "DEFAULT_MAX_PIXELS",
    "probe_image",
    "ImageInfo",
    "FusedImageTransform",
    "Compose",
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "RandomHorizontalFlip",
    "Normalize",
]
