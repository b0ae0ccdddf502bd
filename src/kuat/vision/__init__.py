"""Image decoding and fused crop/resize/flip transforms.

* ``decode.py``: :func:`decode_image`, encoded bytes -> ``(H, W, 3)`` uint8 RGB, every
  real-world variant, EXIF orientation applied, optionally at a reduced JPEG DCT scale.
* ``probe.py``: :func:`probe_image`, oriented size and codec from the header only.
* ``transforms.py``: the transforms' import path (``Compose``, ``RandomResizedCrop``,
  ``Resize``, ``CenterCrop``, ``RandomHorizontalFlip``, ``Normalize``), defined in
  ``steps.py`` (the torchvision-shaped steps) and ``compose.py`` (``Compose`` and its batch
  path): a ``Compose`` fuses plan -> reduced decode -> crop -> resize -> flip straight into the
  batch buffer (``protocol.FusedImageTransform``); ``fused.py`` is one sample's fused path,
  ``resize.py`` the resize kernels' Python side, ``geometry.py`` the crop plan and boxes.
* ``protocol.py``: what a kuat dataset asks of a fused image transform.
* ``_roijpeg.c`` (optional, built by pip or ``python -m kuat.vision._build_roijpeg`` against
  the headers vendored in ``_libjpeg_turbo/``): decodes only a crop's rows and columns
  (libjpeg-turbo skip/crop scanlines), used by the fused path. ``_libjpeg.py`` loads the
  libjpeg-turbo it runs on at import (Pillow's bundled copy, else the system's).
* ``gpu.py``: nvJPEG batch decode for ``Compose(..., decode_device="cuda")``.
* ``_exif.py``: EXIF orientation read from the bytes and applied as views.

Names are loaded lazily: ``decode_image`` and ``probe_image`` do not import torch (the
converter and ``kuat inspect`` stay cheap); the transforms do.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "decode_image": "kuat.vision.decode",
    "DEFAULT_MAX_PIXELS": "kuat.vision.decode",
    "probe_image": "kuat.vision.probe",
    "ImageInfo": "kuat.vision.probe",
    "FusedImageTransform": "kuat.vision.protocol",
    "Compose": "kuat.vision.transforms",
    "RandomResizedCrop": "kuat.vision.transforms",
    "Resize": "kuat.vision.transforms",
    "CenterCrop": "kuat.vision.transforms",
    "RandomHorizontalFlip": "kuat.vision.transforms",
    "Normalize": "kuat.vision.transforms",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'kuat.vision' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(__all__) | set(globals()))
