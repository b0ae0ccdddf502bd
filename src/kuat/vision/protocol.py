"""The contract between kuat datasets and fused image transforms.

A kuat dataset stores each image's encoded bytes with its width and height, so a transform can
plan its crop before decoding. A transform that implements :class:`FusedImageTransform` is
handed the still-encoded bytes and writes its output straight into the sample's slot of the
batch buffer; any other callable gets a decoded ``(3, H, W)`` uint8 ``torch.Tensor`` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class FusedImageTransform(Protocol):
    def output_size(self) -> tuple[int, int] | None:
        """``(H, W)`` of every output, or ``None`` when the size varies per sample.

        When it is fixed the dataset allocates one ``(B, 3, H, W)`` uint8 batch buffer and
        passes each sample's slot as ``out``.
        """

    def apply_encoded(
        self,
        data: bytes | memoryview,
        width: int,
        height: int,
        rng: np.random.Generator,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Decode ``data`` and transform it.

        ``width`` and ``height`` are the image's size as ``decode_image`` returns it, that is
        after EXIF orientation (``kuat.vision.probe.probe_image``); crop boxes are planned in
        those coordinates and mapped back to the stored orientation by the transform.

        Args:
            data: the encoded image (JPEG, PNG, ...).
            width, height: the oriented pixel size from the dataset's index.
            rng: the sample's generator (``kuat.sample_rng(index).numpy``); all random
                draws come from it.
            out: ``(3, H, W)`` uint8 array to write into (may be a strided view), or ``None``.

        Returns:
            ``(3, H, W)`` uint8 array (``out`` itself when given).

        Raises:
            kuat.DecodeError: the bytes cannot be decoded.
        """

    def batch_transform(self) -> Callable | None:
        """A per-batch step (such as ``Normalize``) that the loader applies to the collated
        ``(B, 3, H, W)`` uint8 tensor after moving it to the device, or ``None``."""
