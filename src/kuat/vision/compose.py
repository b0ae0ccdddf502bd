"""``Compose``: a chain of kuat transforms fused into the decode, and its batch path.

Per sample (``apply_encoded``): :meth:`Compose.plan` draws the geometry from the sample's
generator (each step's ``_plan`` on a :class:`kuat.vision.geometry.Plan`), then
:func:`kuat.vision.fused.write_planned` decodes only the box at a reduced DCT scale, resizes it
and writes it into the sample's slot (the steps are described there). A plan that needs padding
(``CenterCrop`` larger than the image) decodes in full and runs the steps one by one.

Per batch (``apply_encoded_many``, what kuat datasets call with a fixed output size):

1. the boxes: drawn in C from the samples' seeding words (``_roijpeg.c`` ``plan_rrc``, for
   ``RandomResizedCrop`` then flips on fresh :class:`kuat.rng.BatchGenerators`), else planned
   per sample in Python (:meth:`Compose.plan`, then ``_batch_job``);
2. one ``decode_resize_batch`` C call decodes and resizes every JPEG the ROI decoder takes into
   its slot with the GIL released once (:func:`_decode_resize_split` shares it among idle cores
   for an epoch's first batch, same pixels);
3. the rest (not a JPEG the ROI decoder takes, EXIF-rotated, a window, over ``max_pixels``, a
   failed decode) goes through the per-sample path, in sample order.

``Normalize`` is not run per sample: ``batch_transform()`` returns it and the loader applies it
to the collated ``(B, 3, H, W)`` uint8 batch on its device.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kuat import _parallel
from kuat.vision.decode import (
    DEFAULT_MAX_PIXELS,
    decode_image,
    decode_resize_batch,
    hashes_words,
    plan_decode_rrc,
    roi_batch_available,
    roi_function,
    roi_header,
    shares_jobs,
)
from kuat.vision.fused import UNFUSED_ORIENTATIONS, roi_region, write_planned
from kuat.vision.geometry import Plan
from kuat.vision.resize import single_threaded_torch, taps
from kuat.vision.steps import (
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Transform,
    rrc_params,
    run_plan,
    standalone_rng,
)

__all__ = ["Compose"]

logger = logging.getLogger("kuat.vision")


def _batch_job_of(data, box: tuple, slot: int, size: tuple[int, int]) -> tuple:
    """``decode_resize_batch``'s job: ``box`` ``(scale_num, y0, y1, x0, x1, flip)`` (what
    ``Compose._batch_job`` and the C planner ``plan_rrc`` give) decoded from ``data`` and
    resized to ``size`` ``(H, W)`` into batch slot ``slot``, with the resize weights."""
    k, y0, y1, x0, x1, flip = box
    return (data, k, y0, y1, x0, x1, slot, flip, *taps(x1 - x0, size[1]),
            *taps(y1 - y0, size[0]))


def _decode_resize_split(jobs: list[tuple], out: np.ndarray) -> list[tuple[int, str]]:
    """:func:`decode_resize_batch` over ``jobs``, shared by :func:`kuat._parallel.width`
    threads when the loader lets this fetch use idle cores (an epoch's first batch); same
    pixels at every width: each job writes only its own slot and draws nothing. Returns the
    failed jobs' indices into ``jobs`` (as ``decode_resize_batch``).

    The threads take jobs one by one from a shared counter in the C call, the costliest first
    (longest-processing-time-first), so the batch ends when the last job does, whichever
    thread is slower (the helper starts later, and shares a core with the loop). A build
    without the counter splits the batch into contiguous parts of about equal cost instead.
    """
    n = _parallel.width()
    if n <= 1 or len(jobs) < 2:
        return decode_resize_batch(jobs, out)
    # job: (data, scale_num, y0, y1, x0, x1, slot, flip, *taps), the box on the k/8 grid.
    # Cost proxy: entropy decoding (about the encoded bytes) plus the region's pixels.
    costs = [len(j[0]) + (j[3] - j[2]) * (j[5] - j[4]) // 4 for j in jobs]
    if shares_jobs():
        order = sorted(range(len(jobs)), key=costs.__getitem__, reverse=True)
        ordered = [jobs[k] for k in order]
        counter = np.zeros(1, np.int32)  # the next job of `ordered` to take
        parts = _parallel.run_parts(
            [lambda: decode_resize_batch(ordered, out, counter) for _ in range(min(n, len(jobs)))]
        )
        return sorted((order[k], reason) for part in parts for k, reason in part)
    ranges = _parallel.split_even(costs, n)
    parts = _parallel.run_parts(
        [lambda lo=lo, hi=hi: decode_resize_batch(jobs[lo:hi], out) for lo, hi in ranges]
    )
    return [(lo + k, reason) for (lo, _), failed in zip(ranges, parts) for k, reason in failed]


def _at(seq, j):
    """``seq[j]``, or ``None`` when ``seq`` is (an optional ``indices`` / ``sources``)."""
    return None if seq is None else seq[j]


class Compose(Transform):
    """A chain of kuat transforms, fused into the decode on kuat datasets.

    Implements :class:`kuat.vision.protocol.FusedImageTransform`. ``Normalize`` may only come
    last; it becomes the ``batch_transform()``. For arbitrary callables (torchvision v2
    transforms...) give those to the dataset directly instead: they run unfused per sample.

    Args:
        transforms: kuat transforms (RandomResizedCrop, Resize, CenterCrop,
            RandomHorizontalFlip, Normalize).
        decode_device: ``"cpu"`` (default) or ``"cuda"``/``"cuda:N"``: decode JPEG batches
            with nvJPEG through ``apply_encoded_batch`` (see ``kuat.vision.gpu``).
        max_pixels: decompression-bomb limit passed to the decoder.
        exact_resize: ``False`` (default): resize and write into the batch slot with kuat's
            fused C kernel where it applies (see :mod:`kuat.vision.fused`: torch's arithmetic,
            at most 1 grey level from the exact path, equal in tests). ``True``: always
            torch's kernel and a copy (the pixels of kuat before the fused kernel).

    Raises:
        TypeError: a step is not a kuat transform; ``exact_resize`` is not a bool.
        ValueError: ``Normalize`` is not last; bad ``decode_device``.
        kuat.KuatError: ``decode_device`` is CUDA and CUDA is not available.

    Thread-safety: stateless after construction; ``apply_encoded`` may run in many threads.
    """

    def __init__(
        self,
        transforms,
        *,
        decode_device: str = "cpu",
        max_pixels=DEFAULT_MAX_PIXELS,
        exact_resize: bool = False,
    ):
        if not isinstance(exact_resize, bool):
            raise TypeError(f"exact_resize must be a bool, got {exact_resize!r}")
        self.exact_resize = exact_resize
        transforms = list(transforms)
        for k, t in enumerate(transforms):
            if not isinstance(t, Transform) or isinstance(t, Compose):
                raise TypeError(
                    f"Compose step {k} ({t!r}) is not a kuat transform; kuat.vision.Compose fuses "
                    "only kuat.vision transforms. Give torchvision or other callables to the "
                    "dataset directly (e.g. torchvision.transforms.v2.Compose): they run per sample."
                )
        norms = [k for k, t in enumerate(transforms) if isinstance(t, Normalize)]
        if norms and norms != [len(transforms) - 1]:
            raise ValueError("Normalize must be the last step of Compose (it runs once per batch)")
        self.transforms = transforms
        self._geometric = [t for t in transforms if not isinstance(t, Normalize)]
        self._normalize = transforms[norms[0]] if norms else None
        self.max_pixels = max_pixels
        size = None
        for t in self._geometric:
            size = t._fixed_size(size)
        self._output_size = size
        self.decode_device = _check_decode_device(decode_device)
        # RandomResizedCrop then only flips (the ImageNet training recipe): the batch's boxes
        # can be drawn in C (_roijpeg.c plan_rrc), the Python planner's arithmetic exactly
        g = self._geometric
        self._c_plan = (
            (g[0], tuple(t.p for t in g[1:]))
            if g and type(g[0]) is RandomResizedCrop and len(g) <= 17
            and all(type(t) is RandomHorizontalFlip for t in g[1:])
            else None
        )  # fmt: skip

    # --- FusedImageTransform -------------------------------------------------------------

    def output_size(self) -> tuple[int, int] | None:
        """``(H, W)`` of every output, or ``None`` when it depends on the image size."""
        return self._output_size

    def batch_transform(self):
        """The ``Normalize`` step (callable on a ``(B, 3, H, W)`` uint8 batch), or ``None``."""
        return self._normalize

    @property
    def splits_batches(self) -> bool:
        """Whether :meth:`apply_encoded_many` can split a batch's decode over idle cores
        (:mod:`kuat._parallel`: an epoch's first batch): the fixed-size CPU path on the ROI
        decoder's one-call-per-batch kernel."""
        return (self._output_size is not None and not self.exact_resize
                and str(self.decode_device) == "cpu" and roi_batch_available())

    @property
    def advises_reads(self) -> bool:
        """Whether :meth:`apply_encoded_many` asks the kernel for the batch's pages itself
        (``_roijpeg.c``'s ``plan_decode_rrc`` and ``decode_resize_batch``, without the GIL):
        ``RandomResizedCrop`` then flips on the ROI decoder's one-call path."""
        return (self._c_plan is not None and self.splits_batches
                and roi_function("plan_decode_rrc") is not None)

    def plan(self, width: int, height: int, rng: np.random.Generator) -> Plan:
        """Draw this sample's geometry for an oriented ``width x height`` image."""
        plan = Plan(height, width)
        for t in self._geometric:
            t._plan(plan, rng)
            if not plan.fusable:
                break
        return plan

    def apply_encoded(self, data, width, height, rng, out=None, *, index=None, source=None):
        """Decode ``data`` at the smallest sufficient scale, crop, resize, flip into ``out``.

        Args:
            data: the encoded image (bytes-like).
            width, height: its size after EXIF orientation (as in the dataset's manifest).
                If the bytes decode to another size the box is scaled to it.
            rng: the sample's generator; all draws come from it (same seed, same pixels).
            out: ``(3, H, W)`` uint8 array (may be a strided view of the batch buffer), or
                ``None`` to allocate one.
            index, source: sample index and shard/file, for error messages only.

        Returns:
            ``(3, H, W)`` uint8 array: ``out`` itself when given.

        Raises:
            kuat.DecodeError: the bytes cannot be decoded (names ``index`` and ``source``).
            ValueError: ``out`` has the wrong shape or dtype.
        """
        single_threaded_torch()
        width, height = int(width), int(height)
        if width <= 0 or height <= 0:
            raise ValueError(f"width and height must be positive, got {width}x{height}")
        plan = self.plan(width, height, rng)
        return self._apply_planned(data, width, height, plan, rng, out, index, source)

    def apply_encoded_many(self, datas, widths, heights, rngs, out, *, indices=None, sources=None):
        """:meth:`apply_encoded` for a batch, into the batch buffer: ``out[j]`` gets sample
        ``j``'s pixels, the same as ``apply_encoded(datas[j], ..., rngs[j], out=out[j])``.

        The JPEGs the fused path takes (ROI decoder built, EXIF orientation 1 or 2, no padding
        window, ``exact_resize=False``) are decoded and resized in one C call that releases the
        GIL once for the whole batch: a thread worker then holds the GIL only while it plans the
        boxes, where one call per image made many decoding threads (16 on a GPU host) queue for
        it twice per image. The other samples, and any the batch call could not decode, go
        through :meth:`apply_encoded`'s per-image path, in sample order (so an error names the
        same sample it would name there). For ``RandomResizedCrop`` then flips, with ``rngs`` a
        :class:`kuat.rng.BatchGenerators` (what kuat datasets pass), the boxes are drawn in C
        from the generators' seeding words (:meth:`_plan_in_c`): the same draws and boxes,
        no generator made.

        Args:
            datas: B encoded images (bytes-like).
            widths, heights: B sizes after EXIF orientation (from the dataset's index).
            rngs: B ``numpy.random.Generator`` s, one per sample (as ``apply_encoded``'s): a
                list, or a :class:`kuat.rng.BatchGenerators`.
            out: ``(B, 3, H, W)`` uint8 NumPy array, C-contiguous, with ``(H, W) ==
                output_size()``.
            indices, sources: B sample indices and shards/files, for error messages only.

        Returns:
            ``out``.

        Raises:
            kuat.DecodeError: a sample cannot be decoded (the lowest such ``j``).
            ValueError: ``out`` has the wrong shape, dtype or layout, or the output size is
                not fixed.
        """
        single_threaded_torch()
        n = len(datas)
        size = self._output_size
        if size is None or out.shape != (n, 3, *size) or out.dtype != np.uint8:
            raise ValueError(
                f"out must be ({n}, 3, H, W) uint8 with (H, W) = output_size() = {size}, "
                f"got {out.shape} {out.dtype}"
            )
        # (indices and sources are read only for a sample the per-image path takes: no copy)
        batched = roi_batch_available() and not self.exact_resize and out.flags.c_contiguous
        draws = np.zeros(n, np.int64)  # (B,): the doubles the C planner drew per sample
        c_args = self._c_plan_args(widths, heights, rngs) if batched else None
        later = None  # (j, plan or None) for the per-image path; None: the planner draws it
        if c_args is not None and _parallel.width() <= 1:
            later = self._plan_decode_in_c(datas, c_args, out, draws, indices)
        if later is None:
            later = self._plan_then_decode(datas, widths, heights, rngs, out, c_args, draws,
                                           indices, batched)
        self._per_image(later, datas, widths, heights, rngs, out, indices, sources)
        return out

    def _per_image(self, later, datas, widths, heights, rngs, out, indices, sources) -> None:
        """Samples ``later`` (``[(j, plan or None)]``) through the per-image path into
        ``out[j]``, in sample order (a ``None`` plan is drawn from ``rngs[j]``)."""
        for j, plan in sorted(later, key=lambda jp: jp[0]):
            width, height = int(widths[j]), int(heights[j])
            if plan is None:
                plan = self.plan(width, height, rngs[j])  # a fresh generator: the same draws
            self._apply_planned(datas[j], width, height, plan, rngs[j], out[j],
                                _at(indices, j), _at(sources, j))

    def _plan_decode_in_c(self, datas, c_args, out, draws, indices) -> list | None:
        """The batch planned, decoded and resized in one C call (``plan_decode_rrc``: the boxes
        of :meth:`_plan_in_c`, the pixels of ``decode_resize_batch``, no per-image Python);
        returns the per-image path's ``[(j, None)]``, or ``None`` when the decoder's build
        predates that call (the caller plans and decodes apart)."""
        widths, heights, words, params, _, unhashed = c_args
        if unhashed is not None:  # the words hashed in the call, without the GIL
            words, unhashed = unhashed[2], unhashed[:2]
        done = plan_decode_rrc(datas, widths, heights, words, out, params, draws, unhashed)
        if done is None:
            return None
        unplanned, failed = done
        later = [(j, None) for j in unplanned]
        for j, reason in failed:
            logger.debug("batch decode skipped sample %s: %s", _at(indices, j), reason)
            later.append((j, None))
            draws[j] = 0  # planned again on the per-image path, from a fresh generator
        # the C-planned samples' generators continue after the plan's draws, as a list of
        # generators would (a caller drawing more from rngs afterwards gets new numbers)
        c_args[4]._drew(draws)
        return later

    def _plan_then_decode(self, datas, widths, heights, rngs, out, c_args, draws, indices,
                          batched: bool) -> list:
        """The boxes planned (in C with ``c_args``, else per sample in Python), then decoded
        by ``decode_resize_batch`` (shared by idle cores when the loader allows); returns the
        per-image path's ``[(j, plan or None)]``."""
        n, size = len(datas), self._output_size
        # jobs: decode_resize_batch's; job_samples[k]: job k's sample; later: (j, plan or None)
        # for the per-image path, None where the C planner drew the box (planned again there)
        jobs, job_samples, later = [], [], []
        planned = None
        if c_args is not None:
            words = c_args[4].pcg_words if c_args[2] is None else c_args[2]  # (B, 4): hashed now
            planned = roi_function("plan_rrc")(datas, *c_args[:2], words, *size, *c_args[3], draws)
        if planned is not None:
            for j, box in enumerate(planned):
                if box is None:
                    later.append((j, None))
                    continue
                jobs.append(_batch_job_of(datas[j], box, j, size))
                job_samples.append((j, None))
        else:
            for j in range(n):
                width, height = int(widths[j]), int(heights[j])
                if width <= 0 or height <= 0:
                    raise ValueError(f"width and height must be positive, got {width}x{height}")
                plan = self.plan(width, height, rngs[j])
                job = self._batch_job(datas[j], width, height, plan, j, size) if batched else None
                if job is None:
                    later.append((j, plan))
                else:
                    jobs.append(job)
                    job_samples.append((j, plan))
        if jobs:
            for k, reason in _decode_resize_split(jobs, out):
                logger.debug("batch decode skipped sample %s: %s",
                             _at(indices, job_samples[k][0]), reason)
                later.append(job_samples[k])
                draws[job_samples[k][0]] = 0  # planned again below, from a fresh generator
        if planned is not None:
            rngs._drew(draws)  # as in _plan_decode_in_c
        return later

    def _c_plan_args(self, widths, heights, rngs) -> tuple | None:
        """``(widths, heights, words, params, rngs, unhashed)`` for ``_roijpeg.c``'s planners
        (``plan_rrc``, ``plan_decode_rrc``): ``(B,)`` int64 sizes, ``(B, 4)`` uint64 PCG64
        words (``None`` with ``unhashed``: ``rngs``' ``(seed, epoch, indices)`` for
        ``plan_decode_rrc`` to hash, or ``rngs.pcg_words`` to hash them in Python), and ``(scale_lo, scale_hi, log_ratio_lo, log_ratio_hi, ratio_lo, ratio_hi,
        flip_ps, max_pixels)``. ``None`` (plan in Python) unless the transforms are
        ``RandomResizedCrop`` then flips, ``rngs`` carries the PCG64 seeding words
        (``kuat.rng.BatchGenerators``), the ROI decoder has the planner, every size is
        positive (the Python path raises for the others), and no stream has been drawn from
        yet (the caller's draws, or an earlier call with the same ``rngs``)."""
        fresh = getattr(rngs, "_fresh", False)
        if self._c_plan is None or roi_function("plan_rrc") is None or not fresh:
            return None
        # the words, or (seed, epoch, indices) for plan_decode_rrc to hash them without the GIL
        unhashed = getattr(rngs, "_unhashed", None) if hashes_words() else None
        words = None if unhashed is not None else getattr(rngs, "pcg_words", None)
        if words is None and unhashed is None:
            return None
        widths = np.ascontiguousarray(widths, np.int64)  # (B,): the planners read the buffer
        heights = np.ascontiguousarray(heights, np.int64)  # (an int32 column: one copy)
        # (the ufunc itself: ndarray.min's Python wrapper costs more, once per batch)
        if len(widths) and (np.minimum.reduce(widths) <= 0 or np.minimum.reduce(heights) <= 0):
            return None
        params = rrc_params(*self._c_plan, self.max_pixels)
        return widths, heights, words, params, rngs, unhashed

    def _plan_in_c(self, datas, widths, heights, rngs, size, draws=None) -> list | None:
        """The batch's ``(scale_num, y0, y1, x0, x1, flip)`` boxes (``None`` for a sample the
        per-image path must take) drawn by ``_roijpeg.c``'s ``plan_rrc``: what ``plan`` and
        ``_batch_job`` compute, without a generator, a Python header walk or box mapping per
        image (about 45 us of a smooth 224 crop's 550). ``None`` (plan in Python) where
        :meth:`_c_plan_args` says so. ``draws``: an optional ``(B,)`` int64 array, set to the
        doubles drawn for each planned sample."""
        c_args = self._c_plan_args(widths, heights, rngs)
        if c_args is None:
            return None
        words = rngs.pcg_words if c_args[2] is None else c_args[2]  # (B, 4): hashed now
        return roi_function("plan_rrc")(datas, *c_args[:2], words, size[0], size[1], *c_args[3],
                                        *(() if draws is None else (draws,)))

    def _batch_job(self, data, width, height, plan, slot, size) -> tuple | None:
        """``decode_resize_batch``'s job for one sample, or ``None`` when it needs the
        per-image path (not fusable, not a JPEG the ROI decoder takes, rotated by EXIF, a
        padding window, over ``max_pixels``: the per-image path raises that error)."""
        if not plan.fusable or plan.window() is not None or (plan.res_h, plan.res_w) != size:
            return None
        hdr = roi_header(data)
        if hdr is None or hdr.orientation in UNFUSED_ORIENTATIONS:
            return None
        if self.max_pixels is not None and hdr.width * hdr.height > self.max_pixels:
            return None
        flip = plan.flip != (hdr.orientation == 2)  # EXIF 2 is a mirror: one more flip
        box = (*roi_region(plan, hdr, width, height), int(flip))
        return _batch_job_of(data, box, slot, size)

    def _apply_planned(self, data, width, height, plan, rng, out, index, source):
        """:meth:`apply_encoded` after the plan is drawn."""
        if not plan.fusable:
            return self._apply_unfused(data, rng, out, index, source)
        return write_planned(data, width, height, plan, out, index, source,
                             max_pixels=self.max_pixels, exact_resize=self.exact_resize)

    def _apply_unfused(self, data, rng, out, index, source):
        """Full decode, then the transforms one by one (for plans that need padding)."""
        sub = np.random.Generator(np.random.PCG64(int(rng.integers(0, 2**63))))
        img = decode_image(data, max_pixels=self.max_pixels, index=index, source=source)
        t = torch.from_numpy(img).permute(2, 0, 1)  # (H, W, 3) -> (3, H, W) view
        for step in self._geometric:
            t = step._apply(t, sub)
        res = t.numpy()
        if out is None:
            return np.ascontiguousarray(res)
        if out.shape != res.shape or out.dtype != np.uint8:
            raise ValueError(f"out must be {res.shape} uint8, got {out.shape} {out.dtype}")
        np.copyto(out, res)
        return out

    def apply_encoded_batch(self, datas, widths, heights, rngs, *, indices=None, sources=None):
        """Decode a batch of JPEGs on ``decode_device`` (nvJPEG) with the same crop planning.

        Returns a ``(B, 3, H, W)`` uint8 tensor on that device. See
        :func:`kuat.vision.gpu.decode_batch_cuda`.
        """
        from kuat.vision.gpu import decode_batch_cuda

        return decode_batch_cuda(
            self,
            datas,
            widths,
            heights,
            rngs,
            device=self.decode_device,
            indices=indices,
            sources=sources,
        )

    # --- standalone -------------------------------------------------------------------------

    def _apply(self, img, rng):
        # The fused path's geometry (one crop, one resize), unless padding is needed.
        plan = self.plan(img.shape[-1], img.shape[-2], rng)
        if plan.fusable:
            img = run_plan(img, plan)
        else:
            sub = np.random.Generator(np.random.PCG64(int(rng.integers(0, 2**63))))
            for t in self._geometric:
                img = t._apply(img, sub)
        if self._normalize is not None:
            img = self._normalize(img)
        return img

    def __call__(self, img, rng=None):
        if rng is None:
            rng = standalone_rng()
        if self._normalize is not None and isinstance(img, np.ndarray):
            img = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)
        return super().__call__(img, rng)

    def __repr__(self):
        inner = ", ".join(repr(t) for t in self.transforms)
        return (
            f"Compose([{inner}], decode_device={self.decode_device!r}, "
            f"exact_resize={self.exact_resize})"
        )


def _check_decode_device(decode_device) -> str:
    dev = str(decode_device)
    if dev == "cpu":
        return dev
    if dev == "cuda" or dev.startswith("cuda:"):
        from kuat.vision.gpu import check_cuda

        check_cuda(dev)
        return dev
    raise ValueError(f"decode_device must be 'cpu', 'cuda' or 'cuda:N', got {decode_device!r}")
