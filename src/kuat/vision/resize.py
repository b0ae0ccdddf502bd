"""The resize kernels' Python side: torch's antialiased bilinear resize, and the fixed-point
weights of kuat's fused C resize.

* :func:`resize_aa`: ``F.interpolate(..., mode="bilinear", antialias=True)`` on a uint8
  ``(N, C, H, W)`` tensor through the ATen op directly (the exact path of ``Compose``).
* :func:`taps`: per axis, the int16 weights that ``_roijpeg.c``'s ``resize_planar`` and
  ``decode_resize_batch`` apply: torch's own uint8 computation (:func:`taps_numpy` is the NumPy
  reference), so the fused kernel's pixels equal torch's.
* :func:`resize_tensor`: the standalone transforms' resize of any ``(..., C, H, W)`` tensor.
* :func:`single_threaded_torch`: torch's ops single-threaded in loader worker threads.

Thread-safety: every function may run in many threads at once.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch
import torch.nn.functional as F

from kuat import _native
from kuat.vision.decode import roi_function

__all__ = ["resize_aa", "resize_tensor", "single_threaded_torch", "taps", "taps_numpy"]

_local = threading.local()
_upsample_aa = getattr(torch._C._nn, "_upsample_bilinear2d_aa", None)


def resize_aa(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``F.interpolate(x, size, mode="bilinear", antialias=True, align_corners=False)`` for a
    ``(N, C, H, W)`` tensor, calling the ATen op directly when it exists (saves ~10 us of
    Python argument checks per sample; the op releases the GIL)."""
    t0 = _native.clock()
    if _upsample_aa is not None:
        y = _upsample_aa(x, size, False)
    else:
        y = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    _native.add_since(t0)  # kernel seconds for stats()["busy_s"]["native"]
    return y


@functools.lru_cache(maxsize=4096)
def taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Fixed-point weights of a bilinear antialiased resize of one axis, ``in_size`` ->
    ``out_size`` pixels: ``(start, weights, taps, precision)``.

    ``start`` ``(out_size,)`` int32 is the first source pixel of each output pixel and
    ``weights`` ``(out_size, taps)`` int16 its weights with ``precision`` fraction bits;
    every window ``[start, start + taps)`` lies inside ``[0, in_size)`` (windows at the far
    edge are moved left, their weights shifted right, zeros elsewhere).

    This is torch's computation for uint8 (``aten/src/ATen/native/UpSample.h``
    ``_compute_index_ranges_weights`` with the triangle filter, then
    ``_compute_index_ranges_int16_weights``), itself Pillow's ``precompute_coeffs``: scale
    ``in/out``, support ``max(scale, 1)``, centre ``scale * (i + 0.5)``, window
    ``[int(centre - support + 0.5), int(centre + support + 0.5))`` clipped to the image,
    weights ``1 - |(j - centre + 0.5) / max(scale, 1)|`` normalised to sum 1 in float64, then
    scaled by ``2**precision`` (the largest that keeps the biggest weight below 2**15) and
    rounded half away from zero. Cached: a corpus has few distinct crop sizes per output.
    With the ROI decoder built, computed in C (``_roijpeg.c`` ``taps``: the same float64
    operations in the same order, NumPy's pairwise sum included; equal over thousands of
    sizes in the tests): about 10x faster than this NumPy code, which mattered for the first
    batch and epoch, where most crop sizes are new (~100 misses in a first batch of 64).
    Thread-safety: safe (``lru_cache``; the arrays are read-only).
    """
    fast = roi_function("taps")  # the ROI decoder, when built
    if fast is not None:
        start_b, weights_b, ntaps, precision = fast(in_size, out_size)
        start = np.frombuffer(start_b, np.int32)  # (out,) read-only
        weights = np.frombuffer(weights_b, np.int16).reshape(out_size, ntaps)  # read-only
        return start, weights, ntaps, precision
    return taps_numpy(in_size, out_size)


def taps_numpy(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """:func:`taps` in NumPy (the reference, and the path without the ROI decoder)."""
    scale = in_size / out_size
    support = scale if scale >= 1.0 else 1.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)  # (out,)
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)  # trunc, as C's (int)
    xsize = np.minimum((center + support + 0.5).astype(np.int64), in_size) - xmin
    ntaps = int(xsize.max())
    j = np.arange(ntaps)
    w = 1.0 - np.abs((j[None, :] + xmin[:, None] - center[:, None] + 0.5) * invscale)
    w = np.where((j[None, :] < xsize[:, None]) & (w > 0.0), w, 0.0)  # (out, ntaps) float64
    total = w.sum(axis=1, keepdims=True)
    w = w / np.where(total == 0.0, 1.0, total)
    w_max = float(w.max())
    precision = 0
    while precision < 22 and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    q = np.floor(0.5 + w * (1 << precision)).astype(np.int16)  # w >= 0: half away from 0
    start = np.minimum(xmin, in_size - ntaps)  # keep every window inside the image
    shift = (xmin - start)[:, None]  # (out, 1): where the weights start in the window
    weights = np.zeros((out_size, ntaps), np.int16)
    cols = j[None, :] + shift  # (out, ntaps)
    keep = cols < ntaps  # the shifted-out entries are zero weights (beyond xsize)
    weights[np.nonzero(keep)[0], cols[keep]] = q[keep]
    start = start.astype(np.int32)
    start.flags.writeable = False
    weights.flags.writeable = False
    return start, weights, ntaps, precision


def resize_tensor(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear antialiased resize of ``(..., C, H, W)`` (uint8 stays uint8, like torchvision v2)."""
    if tuple(img.shape[-2:]) == size:
        return img
    lead = img.shape[:-3]
    x = img.reshape(-1, *img.shape[-3:])  # (N, C, H, W)
    if x.dtype == torch.uint8 and x.device.type == "cpu":
        x = x.contiguous(memory_format=torch.channels_last)  # the fast AVX2 uint8 kernel
        y = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    else:
        y = F.interpolate(
            x.float(), size=size, mode="bilinear", antialias=True, align_corners=False
        )
        if img.dtype == torch.uint8:
            y = y.round_().clamp_(0, 255).to(torch.uint8)
        else:
            y = y.to(img.dtype)
    return y.reshape(*lead, *y.shape[-3:])


def single_threaded_torch() -> None:
    """Run torch ops single-threaded in loader worker threads (once per thread).

    Several worker threads each spawning an OpenMP team oversubscribes the cores (measured:
    a 224x224 resize went from 0.5 ms to 5 ms with 2 threads on 2 busy cores). torch's own
    DataLoader workers call ``torch.set_num_threads(1)`` for the same reason. The main thread
    is left alone (with ``num_workers=0`` the user's setting applies).
    """
    if not getattr(_local, "single", False):
        _local.single = True
        if threading.current_thread() is not threading.main_thread():
            torch.set_num_threads(1)
