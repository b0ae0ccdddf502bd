"""The contract between kuat datasets and fused image transforms.

A kuat dataset stores each image's encoded bytes with its width and height, so a transform can
plan its crop before decoding. A transform that implements :class:`FusedImageTransform` is
handed the still-encoded bytes and writes its output straight into the sample's slot of the
batch buffer; any other callable gets a decoded ``(3, H, W)`` uint8 ``torch.Tensor`` instead.

What the kuat source (:mod:`kuat.sources.dataset`) relies on, and nothing else. Only
``apply_encoded`` is required; the dataset finds every hook with the accessor named here (this
module is the one place that tests for them):

===========================  =========================  ========================================
hook                         protocol / accessor        what the dataset does with it
===========================  =========================  ========================================
``apply_encoded``            FusedImageTransform,       required (its presence makes a transform
                             :func:`is_fused`           fused): per sample, encoded bytes in
``index=``, ``source=``      :func:`takes_location`     passed to ``apply_encoded`` when its
                                                        signature accepts both (or ``**kwargs``),
                                                        checked once per transform type
``output_size()``            :func:`output_size`        fixed: one ``(B, 3, H, W)`` batch buffer,
                                                        which is the collated batch itself
``batch_transform()``        :func:`batch_transform`    the per-batch step the loader's device
                                                        stage applies
``decode_device``,           BatchDecodingTransform,    ``decode_device`` other than ``"cpu"``:
``apply_encoded_batch``      :func:`decodes_batches`    once per batch instead of per sample
``apply_encoded_many``       BufferBatchTransform,      with a fixed ``output_size()``: fills the
                             :func:`fills_buffers`      whole batch buffer in one call
``splits_batches``           BufferBatchTransform,      the loader gives an epoch's first batch
                             :func:`splits_batches`     all its workers' cores
===========================  =========================  ========================================

The accessors test exactly what the dataset has always tested (an attribute's presence, not
``isinstance``, so a transform with only ``apply_encoded`` is fused). :class:`PlannedTransform`
(``plan``, ``max_pixels``) is what the CUDA batch path (:mod:`kuat.vision.gpu`) reads of a
``Compose``; the dataset never does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch

    from kuat.vision.geometry import Plan

__all__ = [
    "BatchDecodingTransform",
    "BufferBatchTransform",
    "FusedImageTransform",
    "PlannedTransform",
    "batch_transform",
    "decodes_batches",
    "fills_buffers",
    "is_fused",
    "output_size",
    "splits_batches",
    "takes_location",
]


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

    @property
    def advises_reads(self) -> bool:
        """Whether ``apply_encoded_many`` asks the kernel for every image's pages itself, all
        at once (``madvise(MADV_WILLNEED)``, as ``kuat.format``'s gather does per row)."""

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


@runtime_checkable
class PlannedTransform(FusedImageTransform, Protocol):
    """A fused transform whose geometry can be drawn apart from the decode (``kuat.vision.Compose``):
    what :func:`kuat.vision.gpu.finish_batch` reads to crop images decoded on a device."""

    max_pixels: int | None  # decompression-bomb limit for the decoder (None: no limit)

    def plan(self, width: int, height: int, rng: np.random.Generator) -> Plan:
        """Draw one sample's geometry for an oriented ``width x height`` image, from ``rng``
        (the same draws as ``apply_encoded``'s)."""


# -- the accessors: the dataset's only tests for the hooks above ---------------------------------


def is_fused(t: object) -> bool:
    """Whether ``t`` is a fused image transform: it has ``apply_encoded`` (else it is a plain
    callable, given a decoded ``(3, H, W)`` uint8 tensor)."""
    return hasattr(t, "apply_encoded")


_LOCATION_KW: dict[type, bool] = {}


def takes_location(t: object) -> bool:
    """Whether ``t.apply_encoded`` accepts ``index=`` and ``source=`` (for error messages):
    both named, or ``**kwargs``. Read from its signature once per transform type."""
    key = type(t)
    ok = _LOCATION_KW.get(key)
    if ok is None:
        try:
            params = inspect.signature(t.apply_encoded).parameters
            ok = ("index" in params and "source" in params) or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
            )
        except (TypeError, ValueError):
            ok = False
        _LOCATION_KW[key] = ok
    return ok


def output_size(t: object) -> tuple[int, int] | None:
    """``t.output_size()`` when ``t`` has it (``(H, W)`` or ``None``), else ``None``."""
    return t.output_size() if hasattr(t, "output_size") else None


def batch_transform(t: object) -> Callable | None:
    """The per-batch step of fused transform ``t`` (``t.batch_transform()`` when it has one),
    else ``None`` (also for a transform that is not fused)."""
    return t.batch_transform() if is_fused(t) and hasattr(t, "batch_transform") else None


def decodes_batches(t: object) -> bool:
    """Whether ``t`` decodes whole batches on a device (:class:`BatchDecodingTransform`: it has
    ``apply_encoded_batch`` and its ``decode_device``, default ``"cpu"``, is not ``"cpu"``)."""
    return hasattr(t, "apply_encoded_batch") and str(getattr(t, "decode_device", "cpu")) != "cpu"


def fills_buffers(t: object) -> bool:
    """Whether ``t`` fills a whole batch buffer in one call (:class:`BufferBatchTransform`:
    ``apply_encoded_many`` is callable)."""
    return callable(getattr(t, "apply_encoded_many", None))


def advises_reads(t: object) -> bool:
    """Whether ``t`` fills batch buffers on the CPU (:func:`fills_buffers`) and says its
    ``advises_reads`` is ``True``: it asks the kernel for the encoded bytes' pages itself, for
    the whole batch at once and without the GIL, so the gather need not (a system call per
    row, ~4 us warm, under the worker's Python)."""
    return (fills_buffers(t) and not decodes_batches(t)
            and getattr(t, "advises_reads", False) is True)


def splits_batches(t: object) -> bool:
    """Whether ``t`` fills batch buffers on the CPU (:func:`fills_buffers`, not
    :func:`decodes_batches`) and says its ``splits_batches`` is ``True``."""
    return fills_buffers(t) and not decodes_batches(t) and getattr(t, "splits_batches", False) is True
