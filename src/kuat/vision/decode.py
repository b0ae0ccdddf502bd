"""Decode encoded images (JPEG, PNG, WebP, BMP, GIF, TIFF) to ``(H, W, 3)`` uint8 RGB arrays.

JPEG goes through simplejpeg (libjpeg-turbo; the GIL is released during the decode), which can
decode at a reduced DCT scale (1/2, 1/4, 1/8) at a fraction of the cost: the fused crop path asks
for the smallest scale that still covers its crop at the output size. CMYK and YCCK JPEGs, which
libjpeg-turbo's RGB output cannot convert, and JPEGs that libjpeg-turbo rejects as slightly
malformed go through Pillow (which also releases the GIL while decoding). Everything else goes
through Pillow. The fused transforms can also decode just a crop's region with the optional ROI
decoder (``decode_jpeg_roi``, ``_roijpeg.c``), whose pixels equal a full decode's.

What every decode returns, whatever the variant (one rule, applied on every path):

* RGB, 8 bits per channel. Grayscale is replicated to three channels. CMYK and YCCK (including
  Adobe's inverted CMYK) are converted with Pillow's CMYK -> RGB conversion, the same pixels
  ``PIL.Image.open(f).convert("RGB")`` gives.
* Alpha is **dropped, not composited**: an RGBA, LA or palette-with-transparency image returns
  the colour channels as stored, whatever the alpha. This is exactly what torchvision's
  ``ImageFolder`` loader (``Image.convert("RGB")``) and ``torchvision.io.decode_image(...,
  ImageReadMode.RGB)`` give, so a model sees the same pixels as with the torch pipeline.
* 16-bit images are scaled to 8 bits by taking the high byte (``v >> 8``, so 65535 -> 255),
  the rule Pillow applies to 16-bit RGB PNGs; 16-bit grayscale follows the same rule instead of
  being clipped.
* EXIF orientation (tag 0x0112 of IFD0, values 1-8) is applied, including on reduced-scale
  decodes; XMP orientation is ignored; malformed EXIF or XMP is ignored (never an error).
* Animated GIF/WebP/TIFF: the first frame.
"""

from __future__ import annotations

import functools
import io
import logging
import threading
from typing import NamedTuple

import numpy as np

from kuat import _native, rng
from kuat.errors import DecodeError
from kuat.vision import _exif
from kuat.vision._libjpeg import load_roi
from kuat.vision.probe import describe_pil_error

__all__ = ["decode_image", "DEFAULT_MAX_PIXELS"]

logger = logging.getLogger("kuat.vision")

# Pillow's own limit for "this is an attack" (2 * Image.MAX_IMAGE_PIXELS): about 13k x 13k.
DEFAULT_MAX_PIXELS = 178_956_970

# DCT scales (numerator over 8) the reduced-scale path may use. libjpeg-turbo also offers
# 3/8, 5/8, 6/8 and 7/8, but those run through non-SIMD inverse DCTs and measured slower than
# the full-size decode, so only the power-of-two reductions are used.
_JPEG_SCALES = (1, 2, 4, 8)  # ascending; 8 means 8/8 = full size
_JPEG_SOI = b"\xff\xd8"
_PIL_JPEG_COLORSPACES = ("CMYK", "YCCK")  # simplejpeg cannot convert these to RGB

_local = threading.local()

# The optional ROI decoder (C; see _roijpeg.c) with the libjpeg-turbo _libjpeg chose for it
# (Pillow's bundled copy, the system's, or KUAT_LIBJPEG's); None: not built or no usable
# libjpeg, and JPEGs decode through simplejpeg only (full size or DCT-scaled).
_roi, _roi_libjpeg = load_roi()
if getattr(_roi, "sample_words", None) is not None:
    # the batch's sample seeds hashed in C (same values as kuat._seedseq's NumPy; tested)
    rng.use_native_words(_roi.sample_words, getattr(_roi, "derive_seed", None))
if getattr(_roi, "locate_rows", None) is not None:
    # a batch's fixed-size and batch-decoded image columns gathered in C (kuat.format.gather)
    from kuat.format import gather as _gather

    _gather.use_native(_roi.take_rows, _roi.image_rows, _roi.locate_rows)


class Decoded(NamedTuple):
    """A decode in the image's stored orientation (internal to kuat.vision).

    ``pixels`` is ``(h, w, 3)`` uint8, possibly reduced: pixel ``(y, x)`` covers stored
    full-size pixels ``[y / scale, (y + 1) / scale)``. ``height``/``width`` are the stored
    full size; ``orientation`` the EXIF orientation still to apply.
    """

    pixels: np.ndarray
    height: int
    width: int
    scale: float
    orientation: int


def _where(index, source) -> str:
    parts = []
    if index is not None:
        parts.append(f"sample {index}")
    if source is not None:
        parts.append(f"from {source}")
    return f" ({', '.join(parts)})" if parts else ""


def check_pixels(width: int, height: int, max_pixels, index, source) -> None:
    """Raise :class:`kuat.DecodeError` (naming ``index`` and ``source``) when a ``width`` x
    ``height`` image is above ``max_pixels`` (``None``: no limit). Internal to kuat.vision: every
    decode path checks the header's size with it before allocating the pixels."""
    if max_pixels is not None and width * height > max_pixels:
        raise DecodeError(
            f"image of {width}x{height} = {width * height} pixels is above "
            f"max_pixels={max_pixels}{_where(index, source)}; refusing to decode it "
            "(a decompression bomb?). Pass a larger max_pixels (or None) to allow it.",
            index=index,
            source=source,
        )


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread reusable uint8 buffer of at least ``nbytes`` (avoids page-faulting a fresh
    allocation per image). Only for decodes that do not outlive the caller's use."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), np.uint8)
        _local.buf = buf
    return buf


def pick_scale(min_scale: float) -> int:
    """Smallest numerator ``k`` in ``_JPEG_SCALES`` with ``k / 8 >= min_scale``: the DCT scale
    ``k / 8`` a reduced decode uses (here and in the fused transforms). Internal."""
    for k in _JPEG_SCALES:
        if k >= 8 * min_scale - 1e-9:
            return k
    return 8


def decode_stored(
    data,
    *,
    min_scale: float = 1.0,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    index: int | None = None,
    source: object = None,
    reuse_buffer: bool = False,
) -> Decoded:
    """Decode at the smallest JPEG DCT scale ``>= min_scale`` (non-JPEG: full size), without
    applying the EXIF orientation. Internal to kuat.vision (the fused transforms use it).

    ``reuse_buffer=True`` decodes JPEGs into a per-thread scratch buffer: the result is only
    valid until the next decode in the same thread.

    Raises:
        kuat.DecodeError: corrupt, truncated, not an image, or above ``max_pixels``.
    """
    import simplejpeg

    if bytes(data[:2]) == _JPEG_SOI:
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except Exception:  # noqa: BLE001 (ValueError or another refusal: Pillow reports it)
            colorspace = None  # let Pillow report (or recover) it
        if colorspace is not None and colorspace not in _PIL_JPEG_COLORSPACES:
            check_pixels(width, height, max_pixels, index, source)
            k = pick_scale(min_scale) if min_scale < 1.0 else 8
            min_w = -(-width * k // 8)  # ceil: libjpeg's scaled size, so simplejpeg picks k/8
            min_h = -(-height * k // 8)
            try:
                t0 = _native.clock()
                if reuse_buffer:
                    out = _scratch(min_w * min_h * 3)
                    pixels = simplejpeg.decode_jpeg(
                        data, min_width=min_w, min_height=min_h, buffer=out
                    )
                else:
                    pixels = simplejpeg.decode_jpeg(data, min_width=min_w, min_height=min_h)
                _native.add_since(t0)
                return Decoded(pixels, height, width, k / 8, _exif.jpeg_orientation(data))
            except Exception as e:  # noqa: BLE001 (ValueError, or any other refusal)
                # Truncated files fail again in Pillow (and are reported there); files with
                # recoverable defects (extraneous bytes, bad markers) decode there, as they do
                # for torchvision's PIL loader.
                logger.debug(
                    "simplejpeg failed%s: %s; retrying with Pillow", _where(index, source), e
                )
    return _decode_pil(data, min_scale, max_pixels, index, source)


class JpegHeader(NamedTuple):
    """What the ROI path needs before decoding: stored size and EXIF orientation."""

    height: int
    width: int
    orientation: int


def roi_header(data) -> JpegHeader | None:
    """Header of a JPEG the ROI decoder can take (YCbCr/grayscale/RGB, header readable, the
    decoder built), else ``None`` (the caller uses :func:`decode_stored`). Internal."""
    if _roi is None or bytes(data[:2]) != _JPEG_SOI:
        return None
    import simplejpeg

    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except Exception:  # noqa: BLE001 (decode_stored takes it and reports)
        return None
    if colorspace in _PIL_JPEG_COLORSPACES:
        return None
    return JpegHeader(height, width, _exif.jpeg_orientation(data))


def decode_jpeg_roi(
    data, scale_num: int, y0: int, y1: int, x0: int, x1: int, channels: int = 3
) -> np.ndarray:
    """Rows ``[y0, y1)`` and columns ``[x0, x1)`` of the JPEG decoded at ``scale_num / 8``
    (stored orientation), decoding only what they need: ``(y1 - y0, x1 - x0, channels)``
    uint8 C-contiguous view into a per-thread scratch buffer (valid until the next decode in
    this thread). ``channels=4`` gives RGBX (X = 255). Pixels equal the same region of a full
    decode at that scale. Internal.

    Raises:
        ValueError: corrupt or truncated above ``y1`` (the caller falls back to
            :func:`decode_stored`, which reports it as a DecodeError).
    """
    n = (y1 - y0) * (x1 - x0) * channels
    buf = _scratch(n)
    t0 = _native.clock()
    _roi.decode_crop(data, scale_num, y0, y1, x0, x1, buf, channels)
    _native.add_since(t0)
    return buf[:n].reshape(y1 - y0, x1 - x0, channels)  # (rows, cols, channels)


def resize_rgbx_planar(src: np.ndarray, out: np.ndarray, flip: bool, x_taps, y_taps) -> bool:
    """Resize ``src`` ``(h, w, 4)`` RGBX uint8 (C-contiguous) into ``out`` ``(3, H, W)`` uint8
    (C-contiguous, planar), mirrored left-right when ``flip``, with the ROI decoder's fused
    kernel; ``x_taps``/``y_taps``: ``(start, weights, taps, precision)`` per axis (see
    ``kuat.vision.resize.taps``). Returns False (nothing written) when the ROI decoder
    is not built or predates the kernel. Releases the GIL. Internal.

    Raises:
        ValueError: sizes, buffers or taps are inconsistent.
    """
    fn = getattr(_roi, "resize_planar", None)
    if fn is None:
        return False
    h, w = src.shape[:2]
    t0 = _native.clock()
    fn(src, h, w, 4, out, out.shape[1], out.shape[2], int(flip), *x_taps, *y_taps)
    _native.add_since(t0)
    return True


def roi_function(name: str):
    """The ROI decoder's C function ``name`` (``"taps"``, ``"plan_rrc"``, ...), or ``None`` when
    the decoder is not built or its build predates that function. Looked up per call, so a
    test that swaps the decoder (``_roi``) sees the swap. Internal."""
    return getattr(_roi, name, None)


def roi_batch_available() -> bool:
    """Whether the ROI decoder can decode and resize a whole batch in one call
    (:func:`decode_resize_batch`). Internal."""
    return getattr(_roi, "decode_resize_batch", None) is not None


@functools.cache
def shares_jobs() -> bool:
    """Whether :func:`decode_resize_batch` takes a ``counter`` (calls on several threads
    sharing one batch job by job): asked once by a call with no jobs, which a build that
    predates the counter refuses with TypeError. Internal."""
    if not roi_batch_available():
        return False
    try:
        _roi.decode_resize_batch([], np.empty((0, 3, 1, 1), np.uint8), 0, 1, 1,
                                 np.zeros(1, np.int32))
    except TypeError:
        return False
    return True


def decode_resize_batch(
    jobs: list[tuple], out: np.ndarray, counter: np.ndarray | None = None
) -> list[tuple[int, str]]:
    """Decode and resize every job into its slot of ``out`` in one C call, the GIL released
    once for the whole batch (see ``decode_resize_batch`` in ``_roijpeg.c``).

    Args:
        jobs: per image ``(data, scale_num, y0, y1, x0, x1, slot, flip, *x_taps, *y_taps)``:
            :func:`decode_jpeg_roi`'s region (RGBX) and :func:`resize_rgbx_planar`'s taps.
        out: ``(B, 3, H, W)`` uint8, C-contiguous: the batch buffer; job ``k`` writes
            ``out[slot]`` only.
        counter: ``None``, or a ``(1,)`` int32 array, 0 at first, shared by calls on several
            threads with the same ``jobs``: each call then takes the next job no call has
            taken until none is left, and reports only the jobs it took (needs
            :func:`shares_jobs`).

    Returns:
        ``(job_index, reason)`` for each job that could not be decoded (corrupt data,
        libjpeg warnings): its slot is left as it was, for the caller's per-image path.

    Raises:
        ValueError: a malformed job (slot, box or taps out of range), before any decode.
    """
    b, c, h, w = out.shape
    if c != 3 or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous (B, 3, H, W) uint8, got {out.shape} {out.dtype}")
    t0 = _native.clock()
    if counter is None:
        failed = _roi.decode_resize_batch(jobs, out, b, h, w)
    else:
        failed = _roi.decode_resize_batch(jobs, out, b, h, w, counter)
    _native.add_since(t0)  # kernel seconds for stats()["busy_s"]["native"]
    return failed


def plan_decode_rrc(datas, widths, heights, words, out, params: tuple, draws: np.ndarray,
                    unhashed: tuple[int, int] | None = None):
    """``_roijpeg.c``'s ``plan_decode_rrc``: a ``RandomResizedCrop`` + flips batch planned
    (as ``plan_rrc``), decoded and resized into ``out[j]`` (as :func:`decode_resize_batch`)
    in one C call that releases the GIL once, with no per-image Python object.

    Args:
        datas: B encoded images; widths, heights: ``(B,)`` int64 (after EXIF orientation);
        words: ``(B, 4)`` uint64 PCG64 seeding words (``kuat.rng.BatchGenerators``).
        out: ``(B, 3, H, W)`` uint8, C-contiguous; sample ``j`` writes ``out[j]`` only.
        params: ``plan_rrc``'s ``(scale_lo, scale_hi, log_ratio_lo, log_ratio_hi, ratio_lo,
            ratio_hi, flip_ps, max_pixels)``.
        draws: ``(B,)`` int64, set to the doubles drawn per planned sample (0 elsewhere).
        unhashed: ``(seed, epoch)`` (64-bit): ``words`` is then the ``(B,)`` int64 sample
            indices and the C call hashes each sample's words itself, without the GIL
            (``kuat.rng.BatchGenerators._unhashed``; only with :func:`hashes_words`).

    Returns:
        ``(unplanned, failed)``: the ``j`` the per-image path must plan and take, and
        ``(j, reason)`` for each planned sample the decoder could not decode. ``None`` when
        the ROI decoder is not built or predates the function. Internal.
    """
    fn = getattr(_roi, "plan_decode_rrc", None)
    if fn is None:
        return None
    b, _, h, w = out.shape
    t0 = _native.clock()
    if unhashed is None:
        res = fn(datas, widths, heights, words, out, h, w, *params, draws)
    else:
        res = fn(datas, widths, heights, words, out, h, w, *params, draws, unhashed)
    _native.add_since(t0)  # kernel seconds for stats()["busy_s"]["native"]
    return res


def hashes_words() -> bool:
    """Whether :func:`plan_decode_rrc` takes ``unhashed`` (a build of ``_roijpeg.c`` that has
    ``locate_rows`` has it too). Internal."""
    return getattr(_roi, "locate_rows", None) is not None


def _decode_pil(data, min_scale, max_pixels, index, source) -> Decoded:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
            check_pixels(width, height, max_pixels, index, source)
            scale = 1.0
            if im.format == "JPEG" and min_scale < 1.0:
                k = pick_scale(min_scale)
                if k < 8:
                    im.draft(im.mode, (-(-width * k // 8), -(-height * k // 8)))
                    # draft picked 1/1, 1/2, 1/4 or 1/8 (size = ceil(size / r)) covering it
                    for r in (8, 4, 2, 1):
                        if im.size == (-(-width // r), -(-height // r)):
                            scale = 1.0 / r
                            break
            im.load()
            # after load(): what Pillow has not applied itself (it orients TIFFs on load)
            orientation = _exif.pil_orientation(im, data)
            if scale == 1.0:
                width, height = im.size  # the pixels' own frame (a TIFF's is oriented)
            pixels = _to_rgb(im)
    except DecodeError:
        raise
    except Exception as e:  # Pillow raises many types (OSError, SyntaxError, ValueError, ...)
        raise DecodeError(
            f"cannot decode image{_where(index, source)}: {describe_pil_error(e, data)}",
            index=index,
            source=source,
        ) from e
    return Decoded(pixels, height, width, scale, orientation)


def _to_rgb(im) -> np.ndarray:
    """``(H, W, 3)`` uint8 RGB, C-contiguous and writable, from a Pillow image of any mode
    (alpha dropped, 16-bit -> 8-bit by the high byte)."""
    mode = im.mode
    if mode == "RGB":
        return np.array(im)  # a writable copy (np.asarray of a Pillow image is read-only)
    if mode.startswith("I;16") or mode == "I":
        a = np.asarray(im)  # (H, W) uint16 or int32
        a8 = (np.clip(a, 0, 65535) >> 8).astype(np.uint8)  # 16 -> 8 bits: high byte
        return np.repeat(a8[:, :, None], 3, axis=2)  # (H, W) -> (H, W, 3)
    if mode == "F":
        a8 = np.clip(np.rint(np.asarray(im)), 0, 255).astype(np.uint8)
        return np.repeat(a8[:, :, None], 3, axis=2)
    if mode == "PA" or (mode == "P" and "transparency" in im.info):
        # Via RGBA so Pillow does not warn; the colours are the palette's, alpha dropped.
        return np.ascontiguousarray(np.asarray(im.convert("RGBA"))[:, :, :3])
    return np.array(im.convert("RGB"))


def decode_image(
    data,
    *,
    min_size: tuple[int, int] | int | None = None,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    index: int | None = None,
    source: object = None,
) -> np.ndarray:
    """Decode an encoded image to RGB pixels, EXIF orientation applied.

    See the module docstring for how every variant (grayscale, CMYK/YCCK, alpha, palette,
    16-bit, orientation) maps to RGB.

    Args:
        data: the encoded bytes (``bytes``, ``bytearray``, ``memoryview`` or 1-D uint8 array).
        min_size: ``(min_height, min_width)`` (an int means both), in displayed (oriented)
            pixels. A JPEG is then decoded at the smallest DCT scale (1/8, 1/4, 1/2 or 1)
            whose result is at least that large (never smaller than the image is); other
            formats are always decoded at full size. ``None``: full size.
        max_pixels: refuse images whose stored width * height exceeds this (decompression
            bombs); ``None`` disables the check (Pillow's own limit still applies to
            non-JPEG formats).
        index, source: the sample index and the file or shard the bytes came from; they only
            appear in error messages and on the raised error.

    Returns:
        ``(H, W, 3)`` uint8 C-contiguous array, RGB, a new array owned by the caller.

    Raises:
        kuat.DecodeError: truncated or corrupt data, not an image, or more than
            ``max_pixels`` pixels; names ``index`` and ``source``.
        TypeError, ValueError: ``min_size`` or ``max_pixels`` is not valid.

    Thread-safety: thread-safe; the decode itself releases the GIL, so threads decode in
    parallel.
    """
    min_scale = 1.0
    if min_size is not None:
        if isinstance(min_size, int):
            min_size = (min_size, min_size)
        try:
            min_h, min_w = (int(v) for v in min_size)
        except (TypeError, ValueError):
            raise TypeError(
                f"min_size must be an int or (height, width), got {min_size!r}"
            ) from None
        if min_h < 0 or min_w < 0:
            raise ValueError(f"min_size must be non-negative, got {min_size!r}")
        min_scale = _min_scale_for(data, min_h, min_w)
    if max_pixels is not None and (not isinstance(max_pixels, int) or max_pixels <= 0):
        raise ValueError(f"max_pixels must be a positive int or None, got {max_pixels!r}")
    d = decode_stored(data, min_scale=min_scale, max_pixels=max_pixels, index=index, source=source)
    if d.orientation == 1:
        return d.pixels
    return np.ascontiguousarray(_exif.orient(d.pixels, d.orientation))


def _min_scale_for(data, min_h: int, min_w: int) -> float:
    """The smallest scale whose decode is at least ``(min_h, min_w)`` displayed pixels."""
    if bytes(data[:2]) != _JPEG_SOI:
        return 1.0
    import simplejpeg

    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    except Exception:  # noqa: BLE001 (the decode reports it)
        return 1.0
    if _exif.jpeg_orientation(data) in _exif.TRANSPOSED:
        min_h, min_w = min_w, min_h
    # scaled size is ceil(size * k / 8) >= size * k / 8, so this scale is sufficient
    return min(1.0, max(min_h / height, min_w / width, 0.0))
