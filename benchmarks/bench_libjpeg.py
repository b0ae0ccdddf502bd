"""Which libjpeg the ROI decoder runs on, and what the simplejpeg fallback costs.

Not a test: prints a table. Run with ``.venv/bin/python benchmarks/bench_libjpeg.py``.

CPU milliseconds per image (``time.thread_time``, one thread, so other load on the machine
barely moves it) of kuat's fused ``RandomResizedCrop(224)`` + flip
(:meth:`kuat.vision.Compose.apply_encoded` into a ``(3, 224, 224)`` uint8 slot) over the
ImageNet-like corpus of ``kuat bench`` (:func:`benchmarks.bench_vision.make_corpus`), the same
boxes every pass, in interleaved rounds:

- ``pillow``: the ROI decoder on Pillow's bundled libjpeg-turbo (kuat's default);
- ``system``: the same module on the system's ``libjpeg.so.62`` (where installed);
- ``off``: no ROI decoder (what a machine without a C compiler at install time gets):
  simplejpeg decodes the whole image at the smallest DCT scale that covers the crop.

The ROI decoder's library is swapped between rounds with ``_roijpeg.load`` (safe here: one
thread, nothing decoding meanwhile).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--images", type=int, default=300, help="corpus size (default 300)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    args = p.parse_args(argv)

    import torch

    from benchmarks.bench_vision import make_corpus
    from kuat.vision import Compose, RandomHorizontalFlip, RandomResizedCrop
    from kuat.vision import decode as kdecode

    roi, info = kdecode._roi, kdecode._roi_libjpeg
    if roi is None:
        print("the ROI decoder is not in use here (not built, or no usable libjpeg-turbo)")
        return 1
    libs = {"pillow": None, "system": "libjpeg.so.62"}
    libs["pillow"] = info.path if info.origin == "pillow" else None
    for name, path in list(libs.items()):
        try:
            if path is None:
                raise OSError("not found")
            roi.load(path)
        except OSError as e:
            print(f"{name}: not measured ({e})")
            del libs[name]
    torch.set_num_threads(1)  # as loader workers do
    corpus = make_corpus(args.images)
    fused = Compose([RandomResizedCrop(224), RandomHorizontalFlip()])
    slot = torch.empty((3, 224, 224), dtype=torch.uint8).numpy()

    def ms_per_image() -> float:
        c0 = time.thread_time()
        for k, (data, w, h) in enumerate(corpus):
            fused.apply_encoded(data, w, h, np.random.default_rng(k), slot)
        return 1e3 * (time.thread_time() - c0) / len(corpus)

    res: dict[str, list[float]] = {name: [] for name in [*libs, "off"]}
    try:
        ms_per_image()  # warm-up
        for _ in range(args.rounds):
            for name in res:
                kdecode._roi = None if name == "off" else roi
                if name != "off":
                    roi.load(libs[name])
                res[name].append(ms_per_image())
    finally:
        kdecode._roi = roi
        roi.load(info.path)
    print(f"{len(corpus)} images, {args.rounds} interleaved rounds, CPU ms per image, 1 thread")
    print(f"{'ROI decoder':40s} {'median':>7s} {'min-max':>13s} {'off / this':>16s}")
    for name, v in res.items():
        pil = os.path.basename(libs.get("pillow") or "")
        what = {"pillow": f"on Pillow's {pil}", "system": "on libjpeg.so.62"}
        ratios = [a / b for a, b in zip(res["off"], v)]
        print(
            f"{what.get(name, 'off (simplejpeg)')[:40]:40s} {statistics.median(v):7.3f} "
            f"{min(v):6.3f}-{max(v):6.3f} {statistics.median(ratios):7.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
