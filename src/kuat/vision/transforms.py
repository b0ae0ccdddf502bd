"""Image augmentations that run fused into the decode: plan the crop, decode only what it needs.

The import path for kuat's vision transforms (``from kuat.vision.transforms import Compose``,
or ``kuat.vision.Compose``). Each concept has its own module:

* :mod:`kuat.vision.steps`: the torchvision-shaped transforms ``RandomResizedCrop``, ``Resize``,
  ``CenterCrop``, ``RandomHorizontalFlip`` (each plans its geometry, touching no pixel) and
  ``Normalize`` (the batch step), with torchvision's geometry; each also runs standalone on a
  decoded tensor or array;
* :mod:`kuat.vision.compose`: ``Compose``, which fuses a chain of them into the decode
  (:class:`kuat.vision.protocol.FusedImageTransform`), and its batch path (boxes planned in C,
  one GIL-free decode-and-resize call per batch);
* :mod:`kuat.vision.fused`: one sample's fused path (reduced or region decode, one resize,
  orientation, window and flip into the batch slot), and what ``exact_resize`` changes;
* :mod:`kuat.vision.resize`: the resize kernels' Python side (torch's antialiased kernel, the
  fixed-point weights of kuat's C kernel);
* :mod:`kuat.vision.geometry`: a sample's plan and its box in the stored orientation.
"""

from __future__ import annotations

from kuat.vision.compose import Compose
from kuat.vision.steps import (
    CenterCrop,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)

__all__ = [
    "Compose",
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "RandomHorizontalFlip",
    "Normalize",
]
