"""The contract between kuat datasets and fused image transforms.

A kuat dataset stores each image's encoded bytes with its width and height, so a transform can
plan its crop before decoding. A transform that implements :class:`FusedImageTransform` is
handed the still-encoded bytes and writes its output straight into the sample's slot of the
batch buffer; any other callable gets a decoded ``(3, H, W)`` uint8 ``torch.Tensor`` instead.

What the kuat source (:mod:`kuat.sources.dataset`) relies on, and nothing else:

* ``apply_encoded`` (required: its presence makes a transform fused), called per sample with
  the keywords ``index=`` and ``source=`` when its signature accepts them (or ``**kwargs``),
  checked once per transform type;
* ``output_size()`` (optional): a fixed size gives the batch one ``(B, 3, H, W)`` buffer;
* ``batch_transform()`` (optional): the per-batch step the loader's device stage applies;
* :class:`BatchDecodingTransform` (optional): ``decode_device`` other than ``"cpu"`` and
  ``apply_encoded_batch``, called once per batch instead of ``apply_encoded`` per sample;
* :class:`BufferBatchTransform` (optional, with a fixed ``output_size()``):
  ``apply_encoded_many``, which fills the whole batch buffer in one call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch


@runtime_checkable
class FusedImageTransform(Protocol):
    """An image transform a kuat dataset hands encoded bytes to (see the module docstring).

    Thread-safety: ``apply_encoded`` runs in many worker threads at once, on one object.
    """

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
        *,
        index: int | None = None,
        source: str | None = None,
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
            index, source: the sample's index and its shard path or URL, for error messages
                only (optional: a transform may leave them out of its signature).

        Returns:
            ``(3, H, W)`` uint8 array (``out`` itself when given).

        Raises:
            kuat.DecodeError: the bytes cannot be decoded.
        """

    def batch_transform(self) -> Callable | None:
        """A per-batch step (such as ``Normalize``) that the loader applies to the collated
        ``(B, 3, H, W)`` uint8 tensor after moving it to the device, or ``None``."""


@runtime_checkable
class BatchDecodingTransform(FusedImageTransform, Protocol):
    """A fused transform that decodes a whole batch on a device (nvJPEG for
    ``Compose(decode_device="cuda")``), used when ``decode_device`` is not ``"cpu"``."""

    decode_device: str  # "cpu", "cuda" or "cuda:N"

    def apply_encoded_batch(
        self,
        datas: list,
        widths: list[int],
        heights: list[int],
        rngs: Sequence[np.random.Generator],
        *,
        indices: list[int] | None = None,
        sources: list[str] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Decode and transform B encoded images on ``decode_device``.

        Args:
            datas: B encoded images; widths, heights: their oriented sizes (B ints each);
            rngs: the B samples' generators, a sequence (kuat datasets pass a
                ``kuat.rng.BatchGenerators``: index it or iterate it, each generator is made
                on first access); indices, sources: for error messages.

        Returns:
            ``(B, 3, H, W)`` uint8 on ``decode_device`` when ``output_size()`` is fixed, else
            B ``(3, H_i, W_i)`` uint8 tensors there.

        Raises:
            kuat.DecodeError: an image cannot be decoded (names its index and source).
        """


@runtime_checkable
class BufferBatchTransform(FusedImageTransform, Protocol):
    """A fused transform that fills a whole ``(B, 3, H, W)`` batch buffer in one call (the
    CPU decode of ``kuat.vision.Compose``: one GIL-free C call per batch), used instead of
    ``apply_encoded`` per sample when ``output_size()`` is fixed."""

    @property
    def splits_batches(self) -> bool:
        """Whether ``apply_encoded_many`` splits a batch's GIL-free work into
        ``kuat._parallel.width()`` parts on idle cores when the loader grants more than one
        (an epoch's first batch), with the same pixels at every width."""

    def apply_encoded_many(
        self,
        datas: list,
        widths: list[int],
        heights: list[int],
        rngs: Sequence[np.random.Generator],
        out: np.ndarray,
        *,
        indices: list[int] | None = None,
        sources: list[str] | None = None,
    ) -> np.ndarray:
        """Write sample ``j``'s pixels into ``out[j]`` for every ``j``: the same pixels as
        ``apply_encoded(datas[j], widths[j], heights[j], rngs[j], out=out[j])``.

        Args:
            datas: B encoded images; widths, heights: their oriented sizes (B ints each);
            rngs: the B samples' generators, a sequence (kuat datasets pass a
                ``kuat.rng.BatchGenerators``: index it or iterate it, each generator is made
                on first access); indices, sources: for error messages.
            out: ``(B, 3, H, W)`` uint8, C-contiguous, ``(H, W) == output_size()``.

        Returns:
            ``out``.

        Raises:
            kuat.DecodeError: an image cannot be decoded (the first such sample, by position).
        """
