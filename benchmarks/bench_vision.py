"""Decode and fused-transform throughput of kuat.vision, in megapixels and images per second.

Not a test: prints a table. Run with ``.venv/bin/python benchmarks/bench_vision.py``.

Workload: the same ImageNet-like JPEGs as ``kuat bench`` (:func:`kuat.demo_data.make_jpeg`:
ImageNet's size and bytes per pixel, cut from the photographs shipped inside scikit-image,
scikit-learn and matplotlib, no download), held in memory. Megapixels are *source* pixels (stored width x height), so every
row is comparable: a row that decodes less (reduced DCT scale) shows as more Mpx/s.

Rows:
  decode-only (simplejpeg)   full-size decode, nothing else: a reference, not a limit (the
                             fused rows decode only the crop, at a reduced DCT scale)
  kuat decode_image          the same through kuat (header, EXIF orientation, checks)
  kuat fused RRC224+flip     Compose([RandomResizedCrop(224), RandomHorizontalFlip()])
                             .apply_encoded into a (B, 3, 224, 224) uint8 batch buffer slot
                             (default: the fused C resize writing the slot directly)
    same, exact_resize=True  the same with torch's resize kernel and a strided copy into
                             the slot (kuat's pixels before the fused kernel; equal in tests)
    same, ROI decoder off    the same with the optional ROI decoder disabled (simplejpeg:
                             full-size or DCT-scaled decode of the whole image)
  kuat fused, +resize-256    the same on the images pre-resized to shorter side 256
  torchvision PIL RRC224     PIL open + convert("RGB") + torchvision v2 RandomResizedCrop(224)
                             + RandomHorizontalFlip + PILToTensor (what ImageFolder workers do,
                             without the DataLoader around it)

Each row runs for ``--seconds`` with 1 and with 2 threads (the work releases the GIL).

``--breakdown-passes N`` (default 5, 0 skips) then splits the fused row's per-image CPU time on
one core into its stages, each timed alone over the same boxes ``apply_encoded`` draws
(torchvision's ``get_params`` algorithm, same generator seeds): region decode, the same region
at DCT scale 1/8 (entropy decoding plus a DC-only IDCT: an upper bound on the entropy
decoding's share), the antialiased resize of the decoded regions, the copy into the planar
``(3, H, W)`` slot with the flip, planning (header parse, box draw), and the remainder (Python
glue, allocation, tensor wrapping) as the whole minus the stages.
"""

from __future__ import annotations

import argparse
import io
import os
import threading
import time

import numpy as np


def make_corpus(n: int, seed: int = 0, grain: bool = True) -> list[tuple[bytes, int, int]]:
    """``n`` JPEGs as ``(bytes, width, height)``, the corpus ``kuat bench`` generates (same
    generator, so the same size and bytes-per-pixel distribution); ``grain=False``: the
    smooth-jpeg workload's corpus."""
    from PIL import Image

    from kuat.demo_data import load_source_photos, make_jpeg

    photos = load_source_photos()
    names = sorted(photos)
    seeds = np.random.SeedSequence(seed).generate_state(n, np.uint64)
    corpus = []
    for k in range(n):
        data, _ = make_jpeg(photos[names[k % len(names)]], int(seeds[k]), grain)
        with Image.open(io.BytesIO(data)) as im:
            corpus.append((data, im.width, im.height))
    return corpus


def resize_shorter(corpus, side: int = 256):
    from PIL import Image

    out = []
    for data, w, h in corpus:
        im = Image.open(io.BytesIO(data)).convert("RGB")
        s = side / min(w, h)
        im = im.resize((max(1, round(w * s)), max(1, round(h * s))), Image.BICUBIC)
        b = io.BytesIO()
        im.save(b, "JPEG", quality=90)
        out.append((b.getvalue(), im.width, im.height))
    return out


def run_threads(work, corpus, nthreads: int, seconds: float) -> tuple[float, float, float]:
    """Run ``work(k, thread_id)`` over the corpus round-robin in ``nthreads`` threads for
    ``seconds``; returns (images/s, source Mpx/s, CPU ms per image).

    CPU ms per image is summed thread CPU time (``time.thread_time``), which other processes
    on a busy machine disturb much less than wall-clock rates: ``cores / cpu_ms`` is what the
    row reaches with every core to itself.
    """
    counts = [0] * nthreads
    pixels = [0] * nthreads
    cpu = [0.0] * nthreads
    stop = time.perf_counter() + seconds
    n = len(corpus)

    def loop(t):
        k = t
        c0 = time.thread_time()
        while time.perf_counter() < stop:
            work(k % n, t)
            counts[t] += 1
            pixels[t] += corpus[k % n][1] * corpus[k % n][2]
            k += nthreads
        cpu[t] = time.thread_time() - c0

    threads = [threading.Thread(target=loop, args=(t,)) for t in range(nthreads)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.perf_counter() - t0
    return sum(counts) / dt, sum(pixels) / dt / 1e6, 1e3 * sum(cpu) / max(1, sum(counts))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--images", type=int, default=200, help="corpus size (default 200)")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per measurement")
    p.add_argument("--threads", default="1,2", help="thread counts, comma separated")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the median is shown")
    p.add_argument(
        "--smooth", action="store_true", help="the smooth-jpeg corpus (no grain, ~0.19 bytes/px)"
    )
    p.add_argument(
        "--passes", type=int, default=5, help="passes of the per-image CPU-time table (0: skip)"
    )
    p.add_argument(
        "--breakdown-passes",
        type=int,
        default=5,
        help="passes of the fused row's per-stage breakdown (0: skip)",
    )
    args = p.parse_args(argv)

    import simplejpeg
    import torch
    import torchvision.transforms.v2 as T2
    from PIL import Image

    from kuat.vision import Compose, RandomHorizontalFlip, RandomResizedCrop, decode_image
    from kuat.vision import decode as kdecode

    if kdecode._roi is None:
        print("note: the ROI decoder is not in use (not built, or no usable libjpeg-turbo)")
    else:
        print(f"ROI decoder on {kdecode._roi_libjpeg.describe()}")

    corpus = make_corpus(args.images, grain=not args.smooth)
    small = resize_shorter(corpus)
    fused = Compose([RandomResizedCrop(224), RandomHorizontalFlip()])
    fused_exact = Compose([RandomResizedCrop(224), RandomHorizontalFlip()], exact_resize=True)
    tv = T2.Compose([T2.RandomResizedCrop(224), T2.RandomHorizontalFlip(), T2.PILToTensor()])
    buffers = {}

    def slot(t):
        buf = buffers.get(threading.get_ident())
        if buf is None:
            torch.set_num_threads(1)  # as loader workers do
            buf = buffers[threading.get_ident()] = torch.empty((64, 3, 224, 224), dtype=torch.uint8)
        return buf

    def decode_only(k, t):
        simplejpeg.decode_jpeg(corpus[k][0])

    def kuat_decode(k, t):
        decode_image(corpus[k][0])

    def kuat_fused(k, t, corpus=corpus):
        data, w, h = corpus[k]
        buf = slot(t)
        fused.apply_encoded(data, w, h, np.random.default_rng(k), buf[k % 64].numpy())

    def kuat_fused_exact(k, t):
        data, w, h = corpus[k]
        buf = slot(t)
        fused_exact.apply_encoded(data, w, h, np.random.default_rng(k), buf[k % 64].numpy())

    def kuat_fused_small(k, t):
        kuat_fused(k, t, small)

    def kuat_fused_no_roi(k, t):
        roi, kdecode._roi = kdecode._roi, None  # this row runs alone: safe to toggle
        try:
            kuat_fused(k, t)
        finally:
            kdecode._roi = roi

    def torchvision_pil(k, t):
        slot(t)
        with Image.open(io.BytesIO(corpus[k][0])) as im:
            tv(im.convert("RGB"))

    rows = [
        ("decode-only (simplejpeg)", decode_only, corpus),
        ("kuat decode_image", kuat_decode, corpus),
        ("kuat fused RRC224+flip", kuat_fused, corpus),
        ("  same, exact_resize=True", kuat_fused_exact, corpus),
        ("  same, ROI decoder off", kuat_fused_no_roi, corpus),
        ("kuat fused, resize-256 data", kuat_fused_small, small),
        ("torchvision PIL RRC224+flip", torchvision_pil, corpus),
    ]
    threads = [int(v) for v in args.threads.split(",")]
    results: dict = {}
    for _ in range(args.rounds):  # interleave rows so machine drift spreads evenly
        for name, fn, data in rows:
            for nt in threads:
                results.setdefault((name, nt), []).append(run_threads(fn, data, nt, args.seconds))
    mpx = np.mean([w * h for _, w, h in corpus]) / 1e6
    print(
        f"corpus: {len(corpus)} JPEGs, mean {mpx:.3f} Mpx; {os.cpu_count()} CPUs; "
        f"median of {args.rounds} interleaved rounds of {args.seconds:g} s"
    )
    header = f"{'workload':30s}" + "".join(f" | {nt}thr img/s  Mpx/s" for nt in threads)
    header += " | CPU ms/img | % of decode-only"
    print(header)
    print("-" * len(header))
    med = {key: np.median(np.array(v), axis=0) for key, v in results.items()}
    base_cpu = np.median([med[(rows[0][0], nt)][2] for nt in threads])
    for name, _, _ in rows:
        line = f"{name:30s}"
        for nt in threads:
            ips, mps, _ = med[(name, nt)]
            line += f" | {ips:9.0f} {mps:6.1f}"
        cpu_ms = float(np.median([med[(name, nt)][2] for nt in threads]))
        line += f" | {cpu_ms:10.2f} | {100 * base_cpu / cpu_ms:15.0f}%"
        print(line)
    if args.passes > 0:
        _per_image_table(rows, args.passes)
    if args.breakdown_passes > 0 and kdecode._roi is not None:
        _breakdown(corpus, fused, args.breakdown_passes)
    return 0


def _best_us(fns, n: int, passes: int) -> dict[str, float]:
    """Mean over ``n`` images of the minimum thread CPU time (us) of ``fn(k)`` over ``passes``
    interleaved passes (order alternating), per name in ``fns``."""
    best = {name: np.full(n, np.inf) for name in fns}
    items = list(fns.items())
    for p in range(passes):
        for name, fn in items if p % 2 == 0 else items[::-1]:
            b = best[name]
            for k in range(n):
                c0 = time.thread_time_ns()
                fn(k)
                b[k] = min(b[k], time.thread_time_ns() - c0)
    return {name: float(b.mean()) / 1e3 for name, b in best.items()}


def _breakdown(corpus, fused, passes: int) -> None:
    """Where the fused RandomResizedCrop(224)+flip spends its per-image CPU time (1 thread)."""
    import simplejpeg
    import torch

    from kuat.vision import Compose, _exif
    from kuat.vision import decode as kdecode
    from kuat.vision.geometry import snap, stored_crop_box
    from kuat.vision.resize import resize_aa, taps

    torch.set_num_threads(1)
    n = len(corpus)
    boxes, crops, crops4, plans = [], [], [], []
    for k, (data, w, h) in enumerate(corpus):
        plan = fused.plan(w, h, np.random.default_rng(k))  # the boxes kuat_fused draws
        hdr = kdecode.roi_header(data)
        scale_num = kdecode.pick_scale(plan.min_scale())
        ph, pw = -(-hdr.height * scale_num // 8), -(-hdr.width * scale_num // 8)
        top, left, bh, bw = stored_crop_box(plan, hdr.orientation, hdr.height, hdr.width, w, h)
        y0, y1 = snap(top, bh, scale_num / 8, ph)
        x0, x1 = snap(left, bw, scale_num / 8, pw)
        boxes.append((scale_num, y0, y1, x0, x1))
        crops.append(kdecode.decode_jpeg_roi(data, *boxes[-1]).copy())  # (h, w, 3)
        crops4.append(kdecode.decode_jpeg_roi(data, *boxes[-1], 4).copy())  # (h, w, 4) RGBX
        plans.append(plan)
    out = np.empty((3, 224, 224), np.uint8)
    grids = [
        (p.res_w, p.res_h) if hdr.orientation in _exif.TRANSPOSED else (p.res_h, p.res_w)
        for p, hdr in zip(plans, (kdecode.roi_header(d) for d, _, _ in corpus))
    ]
    resized = [
        resize_aa(torch.from_numpy(c).permute(2, 0, 1).unsqueeze(0), g).numpy()[0]
        for c, g in zip(crops, grids)
    ]  # (3, 224, 224) channels_last strides, as in apply_encoded

    def eighth(k):
        s, y0, y1, x0, x1 = boxes[k]
        f = s  # scale s/8 -> 1/8: divide coordinates by s
        y0, x0 = y0 // f, x0 // f
        kdecode.decode_jpeg_roi(corpus[k][0], 1, y0, max(y0 + 1, y1 // f), x0, max(x0 + 1, x1 // f))

    def resize(k):
        src = torch.from_numpy(crops[k]).permute(2, 0, 1).unsqueeze(0)  # (1, 3, h, w) CL
        resize_aa(src, grids[k])

    def fused_resize(k):  # the default path: RGBX crop -> planar, flipped, into the slot
        c4 = crops4[k]
        kdecode.resize_rgbx_planar(
            c4, out, True, taps(c4.shape[1], grids[k][1]), taps(c4.shape[0], grids[k][0])
        )

    def copy_flip(k):
        res = resized[k].transpose(1, 2, 0)  # (224, 224, 3) view
        np.copyto(out.transpose(1, 2, 0)[:, ::-1], res)

    def plan_header(k):
        data, w, h = corpus[k]
        plan = fused.plan(w, h, np.random.default_rng(k))
        hdr = kdecode.roi_header(data)
        stored_crop_box(plan, hdr.orientation, hdr.height, hdr.width, w, h)

    def whole(k):
        data, w, h = corpus[k]
        fused.apply_encoded(data, w, h, np.random.default_rng(k), out)

    exact = Compose(fused.transforms, exact_resize=True)

    def whole_exact(k):
        data, w, h = corpus[k]
        exact.apply_encoded(data, w, h, np.random.default_rng(k), out)

    stages = {
        "full-size decode (reference)": lambda k: simplejpeg.decode_jpeg(corpus[k][0]),
        "region decode": lambda k: kdecode.decode_jpeg_roi(corpus[k][0], *boxes[k]),
        "  same region at 1/8 scale": eighth,
        "region decode, RGBX": lambda k: kdecode.decode_jpeg_roi(corpus[k][0], *boxes[k], 4),
        "exact: torch resize": resize,
        "exact: copy to (3,H,W) + flip": copy_flip,
        "fused resize into (3,H,W)": fused_resize,
        "plan + header + rng": plan_header,
        "whole, exact_resize=True": whole_exact,
        "whole, fused (default)": whole,
    }
    us = _best_us(stages, n, passes)
    scales = np.bincount([b[0] for b in boxes], minlength=9)
    side = np.sqrt([c.shape[0] * c.shape[1] for c in crops])
    print(
        f"\nfused RRC224+flip per-stage CPU time, 1 thread, min of {passes} passes over {n} "
        f"images; DCT scales used (k/8: count) "
        + ", ".join(f"{k}/8: {c}" for k, c in enumerate(scales) if c)
        + f"; decoded region side median {np.median(side):.0f} px "
        f"(range {side.min():.0f}-{side.max():.0f})"
    )
    whole_us = us["whole, exact_resize=True"]
    parts = ("region decode", "exact: torch resize", "exact: copy to (3,H,W) + flip")
    rest = whole_us - sum(us[p] for p in (*parts, "plan + header + rng"))
    fused_us = us["whole, fused (default)"]
    parts = ("region decode, RGBX", "fused resize into (3,H,W)", "plan + header + rng")
    rest_fused = fused_us - sum(us[p] for p in parts)
    print(f"{'stage':32s} | us/img | % of exact whole")
    rows = [
        *us.items(),
        ("rest (exact): Python, allocation", rest),
        ("rest (fused): Python, allocation", rest_fused),
    ]
    for name, v in rows:
        print(f"{name:32s} | {v:6.0f} | {100 * v / whole_us:15.0f}%")
    full = us["full-size decode (reference)"]
    print(
        f"fused / exact: {fused_us / whole_us:.3f}; per image vs full-size decode: "
        f"exact {whole_us / full:.2f}x, fused {fused_us / full:.2f}x its CPU time"
    )


def _per_image_table(rows, passes: int) -> None:
    """Per-image thread CPU time, minimum over ``passes`` passes (each pass runs every row
    over all images, rows in alternating order): robust against other processes on a busy
    machine, and each row measured in its own steady state (caches, allocator)."""
    n = min(len(data) for _, _, data in rows)
    best = {name: np.full(n, np.inf) for name, _, _ in rows}
    for p in range(passes):
        order = rows if p % 2 == 0 else rows[::-1]  # alternate, so no row always goes first
        for name, fn, _ in order:  # a whole pass per row: each row in its own steady state
            for k in range(n):
                c0 = time.thread_time_ns()
                fn(k, 0)
                best[name][k] = min(best[name][k], time.thread_time_ns() - c0)
    base = best[rows[0][0]].mean()
    torch_row = best[rows[-1][0]].mean()
    print(f"\nper-image CPU time, 1 thread, min of {passes} passes over {n} images")
    print(f"{'workload':30s} | mean us/img | % of decode-only | x torchvision PIL")
    for name, _, _ in rows:
        us = best[name].mean()
        print(f"{name:30s} | {us / 1e3:11.0f} | {100 * base / us:15.0f}% | {torch_row / us:8.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
