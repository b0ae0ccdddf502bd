"""GPU decode: JPEG batches through nvJPEG (``torchvision.io.decode_jpeg(..., device="cuda")``),
then the same crop planning as the CPU path, with the crop/resize/flip on the GPU.

Used by ``Compose(..., decode_device="cuda").apply_encoded_batch`` (a dataset calls it once per
batch instead of ``apply_encoded`` per sample). nvJPEG decodes at full size (no DCT scaling),
so the boxes are the CPU path's boxes at scale 1; images nvJPEG cannot take (non-JPEG, CMYK or
YCCK JPEGs) are decoded on the CPU with :func:`kuat.vision.decode_image` and uploaded, so every
variant gives the same pixels as the CPU path's rules (RGB, EXIF orientation applied).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from kuat._buffers import new_batch_buffer
from kuat.errors import DecodeError, KuatError
from kuat.vision import _exif
from kuat.vision.decode import check_pixels, decode_stored
from kuat.vision.geometry import snap, stored_crop_box

__all__ = ["check_cuda", "decode_batch_cuda"]

logger = logging.getLogger("kuat.vision")

_JPEG_SOI = b"\xff\xd8"


def check_cuda(device: str = "cuda") -> None:
    """Raise :class:`kuat.KuatError` unless ``device`` is a usable CUDA device."""
    if not torch.cuda.is_available():
        raise KuatError(
            f"decode_device={device!r} needs a CUDA device, but torch.cuda.is_available() is "
            "False (no GPU, or a CPU-only torch build). Use decode_device='cpu'."
        )
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise KuatError(
            f"decode_device={device!r}: only {torch.cuda.device_count()} CUDA device(s) visible"
        )


def _nvjpeg_ok(data, max_pixels, index, source) -> bool:
    """Baseline/progressive YCbCr or grayscale JPEG (nvJPEG's domain), size checked."""
    if bytes(data[:2]) != _JPEG_SOI:
        return False
    import simplejpeg

    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return False
    check_pixels(width, height, max_pixels, index, source)  # before nvJPEG allocates it
    return colorspace not in ("CMYK", "YCCK")


def decode_batch_cuda(
    transform,
    datas,
    widths,
    heights,
    rngs,
    *,
    device: str = "cuda",
    indices=None,
    sources=None,
) -> torch.Tensor | list[torch.Tensor]:
    """Decode, crop, resize and flip a batch on a CUDA device.

    Args:
        transform: a ``kuat.vision.Compose``, read as a
            :class:`kuat.vision.protocol.PlannedTransform` (its geometry is planned per sample
            exactly as on the CPU path; each ``rngs[k]`` gives the same box as
            ``apply_encoded`` would).
        datas: B encoded images (bytes-like).
        widths, heights: B oriented sizes from the dataset's index.
        rngs: B NumPy generators (``kuat.sample_rng(index).numpy``).
        device: ``"cuda"`` or ``"cuda:N"``.
        indices, sources: per-sample index and shard/file, for error messages.

    Returns:
        ``(B, 3, H, W)`` uint8 tensor on ``device`` when ``transform.output_size()`` is fixed,
        else a list of B ``(3, H_k, W_k)`` uint8 tensors.

    Raises:
        kuat.KuatError: CUDA is not available.
        kuat.DecodeError: an image cannot be decoded (names its index and source).
    """
    check_cuda(device)
    from torchvision.io import ImageReadMode, decode_jpeg

    n = len(datas)
    if not (len(widths) == len(heights) == len(rngs) == n):
        raise ValueError(
            f"datas, widths, heights and rngs must have one entry per sample, got lengths "
            f"{n}, {len(widths)}, {len(heights)}, {len(rngs)}"
        )
    indices = list(indices) if indices is not None else [None] * n
    sources = list(sources) if sources is not None else [None] * n
    dev = torch.device(device)

    # 1. decode: nvJPEG for the JPEGs it handles (stored orientation), the CPU for the rest
    images: list[torch.Tensor | None] = [None] * n  # (3, h, w) uint8 on dev, stored orientation
    orientations = [1] * n
    gpu_ks = []
    for k, data in enumerate(datas):
        if _nvjpeg_ok(data, transform.max_pixels, indices[k], sources[k]):
            gpu_ks.append(k)
            orientations[k] = _exif.jpeg_orientation(data)
    if gpu_ks:
        tensors = [torch.frombuffer(bytearray(datas[k]), dtype=torch.uint8) for k in gpu_ks]
        try:
            with warnings.catch_warnings():
                # torchvision 0.29 warns that its image I/O moves to TorchCodec; nvJPEG
                # through decode_jpeg is what this path is asked to use
                warnings.filterwarnings("ignore", message=".*deprecated.*")
                decoded = decode_jpeg(tensors, mode=ImageReadMode.RGB, device=dev)
        except RuntimeError as e:
            logger.debug("nvJPEG failed on the batch (%s); decoding it on the CPU", e)
            decoded = None
        if decoded is not None:
            for k, img in zip(gpu_ks, decoded):
                images[k] = img
    for k in range(n):
        if images[k] is None:
            d = decode_stored(
                datas[k], max_pixels=transform.max_pixels, index=indices[k], source=sources[k]
            )
            images[k] = torch.from_numpy(np.ascontiguousarray(d.pixels)).to(dev).permute(2, 0, 1)
            orientations[k] = d.orientation

    return finish_batch(transform, images, orientations, widths, heights, rngs, indices, sources)


def finish_batch(transform, images, orientations, widths, heights, rngs, indices, sources):
    """Plan, crop, resize (float, antialiased), orient and flip decoded images on their device.

    ``images``: B ``(3, h, w)`` uint8 tensors in their *stored* orientation, full size;
    ``orientations``: their EXIF orientations. Device-agnostic (the CPU tests use it too).
    Returns what :func:`decode_batch_cuda` returns.
    """
    n = len(images)
    dev = images[0].device if n else torch.device("cpu")
    size = transform.output_size()
    out = new_batch_buffer((n, 3, *size), torch.uint8, dev) if size is not None else None
    results = []
    for k in range(n):
        img, o = images[k], orientations[k]
        sh, sw = img.shape[-2:]
        transposed = o in _exif.TRANSPOSED
        full_w, full_h = (sh, sw) if transposed else (sw, sh)
        plan = transform.plan(int(widths[k]), int(heights[k]), rngs[k])
        if not plan.fusable:
            raise DecodeError(
                f"sample {indices[k]}: this Compose needs padding for a {full_w}x{full_h} image, "
                "which the CUDA decode path does not do; use decode_device='cpu'",
                index=indices[k],
                source=sources[k],
            )
        top, left, bh, bw = stored_crop_box(plan, o, sh, sw, int(widths[k]), int(heights[k]))
        y0, y1 = snap(top, bh, 1.0, sh)
        x0, x1 = snap(left, bw, 1.0, sw)
        grid = (plan.res_w, plan.res_h) if transposed else (plan.res_h, plan.res_w)  # stored
        crop = img[None, :, y0:y1, x0:x1]  # (1, 3, h, w)
        if crop.shape[-2:] != grid:
            crop = F.interpolate(
                crop.float(), size=grid, mode="bilinear", antialias=True, align_corners=False
            )
            crop = crop.round_().clamp_(0, 255).to(torch.uint8)
        res = _orient_chw(crop[0], o)
        win = plan.window()
        if win is not None:
            res = res[:, win[0], win[1]]
        if plan.flip:
            res = res.flip(-1)
        if out is not None:
            out[k].copy_(res)
        else:
            results.append(res.contiguous())
    return out if out is not None else results


def _orient_chw(t: torch.Tensor, orientation: int) -> torch.Tensor:
    """EXIF orientation of a ``(C, H, W)`` tensor (as :func:`kuat.vision._exif.orient`)."""
    if orientation == 2:
        return t.flip(-1)
    if orientation == 3:
        return t.flip(-2, -1)
    if orientation == 4:
        return t.flip(-2)
    if orientation in _exif.TRANSPOSED:
        t = t.transpose(-2, -1)
        if orientation == 6:
            return t.flip(-1)
        if orientation == 7:
            return t.flip(-2, -1)
        if orientation == 8:
            return t.flip(-2)
    return t
