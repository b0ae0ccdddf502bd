"""Image decoding and fused crop/resize/flip transforms.

* :func:`decode_image`: encoded bytes -> ``(H, W, 3)`` uint8 RGB, every real-world variant,
  EXIF orientation applied, optionally at a reduced JPEG DCT scale (``decode.py``).
* :func:`probe_image`: oriented size and codec from the header only (``probe.py``).
"""

from kuat.vision.decode import DEFAULT_MAX_PIXELS, decode_image
from kuat.vision.probe import ImageInfo, probe_image

__all__ = ["decode_image", "DEFAULT_MAX_PIXELS", "probe_image", "ImageInfo"]
