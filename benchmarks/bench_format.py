"""Format micro-benchmarks: batch gather speed and ImageFolder conversion rate.

    python benchmarks/bench_format.py [--rows 8192] [--shape 3 64 64] [--images 1000]

1. Gather: ``Dataset.read_batch`` of 64 random rows of a fixed-shape uint8 tensor field
   (one shard, and many small shards), in GB/s of payload, beside ``np.take`` on the same
   array in memory (the memory-copy bound), plus ``__getitems__`` (per-sample dicts).
2. Convert: ``kuat.convert.from_imagefolder`` of a synthetic JPEG tree without re-encoding,
   in images/s and MB/s, beside reading the same files (the I/O bound).

Prints a table; not a test (timings depend on the machine). The page cache is warm for both
gather and conversion (the files were just written), so these are CPU/memory-bound numbers.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import kuat  # noqa: E402
import kuat.convert  # noqa: E402
from kuat import format as kf  # noqa: E402


def _best(fn, repeat: int, inner: int) -> float:
    """Best mean seconds per call over ``repeat`` rounds of ``inner`` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def bench_gather(tmp: Path, rows: int, shape: tuple[int, ...], batch: int) -> list[tuple]:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 255, (rows, *shape), dtype=np.uint8)  # (N, *shape)
    row_bytes = data[0].nbytes
    results = []
    idx_sets = [rng.integers(0, rows, batch) for _ in range(64)]
    k = iter(range(10**9))

    def next_idx():
        return idx_sets[next(k) % len(idx_sets)]

    payload = batch * row_bytes
    t = _best(lambda: np.take(data, next_idx(), axis=0), 5, 200)
    results.append(("np.take, in-memory array", t * 1e6, payload / t / 1e9))
    for label, shard_bytes in (("1 shard", 1 << 30), ("many shards", max(row_bytes * 64, 1 << 20))):
        path = tmp / f"gather-{shard_bytes}"
        with kuat.Writer(path, {"x": kf.tensor(shape, "uint8")}, shard_bytes=shard_bytes) as w:
            for s in range(0, rows, 1024):
                w.write_batch({"x": data[s : s + 1024]})
        ds = kuat.open(path)
        ds.read_batch(np.arange(rows))  # map every shard first
        got = ds.read_batch(idx_sets[0])["x"]
        assert np.array_equal(got, data[idx_sets[0]])
        t = _best(lambda ds=ds: ds.read_batch(next_idx(), fields=["x"]), 5, 200)
        results.append((f"kuat read_batch, {label} ({ds.num_shards})", t * 1e6, payload / t / 1e9))
        t = _best(lambda ds=ds: ds.__getitems__(next_idx()), 5, 100)
        results.append((f"kuat __getitems__, {label}", t * 1e6, payload / t / 1e9))
    return results


def _jpeg_tree(root: Path, n: int, classes: int = 10) -> int:
    from PIL import Image

    rng = np.random.default_rng(0)
    total = 0
    # smooth images compress like photos (random noise would not)
    base = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    for i in range(n):
        c = root / f"class{i % classes:02d}"
        c.mkdir(parents=True, exist_ok=True)
        im = Image.fromarray(np.roll(base, i, axis=0)).resize((320, 240), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90)
        (c / f"{i:06d}.jpg").write_bytes(buf.getvalue())
        total += buf.tell()
    return total


def bench_convert(tmp: Path, n: int, workers: int) -> list[tuple]:
    import kuat.vision.decode  # noqa: F401  (import cost is not conversion time)
    import kuat.vision.probe  # noqa: F401

    root = tmp / "tree"
    total = _jpeg_tree(root, n)
    files = sorted(root.rglob("*.jpg"))
    t0 = time.perf_counter()
    for f in files:
        f.read_bytes()
    t_read = time.perf_counter() - t0
    results = [("read the files (1 thread)", n / t_read, total / t_read / 1e6)]
    for w in sorted({1, workers}):
        t0 = time.perf_counter()
        kuat.convert.from_imagefolder(
            root, tmp / f"conv{w}", num_workers=w, progress=False, overwrite=True
        )
        dt = time.perf_counter() - t0
        results.append((f"from_imagefolder, {w} thread(s)", n / dt, total / dt / 1e6))
    t0 = time.perf_counter()
    kuat.convert.from_imagefolder(
        root,
        tmp / "conv-resize",
        num_workers=workers,
        progress=False,
        resize_shorter=128,
        overwrite=True,
    )
    dt = time.perf_counter() - t0
    results.append(
        (f"from_imagefolder --resize-shorter 128, {workers} threads", n / dt, total / dt / 1e6)
    )
    return results


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--shape", type=int, nargs="+", default=[3, 64, 64])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--tmp", type=Path, default=None, help="scratch directory (default: system temp)"
    )
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kuat-bench-format-", dir=args.tmp))
    try:
        shape = tuple(args.shape)
        print(
            f"gather: {args.batch} random rows of uint8 {shape} ({np.prod(shape) * args.batch / 1e6:.2f} MB/batch)"
        )
        print(f"{'method':<44} {'us/batch':>10} {'GB/s':>8}")
        for name, us, gbs in bench_gather(tmp, args.rows, shape, args.batch):
            print(f"{name:<44} {us:>10.1f} {gbs:>8.2f}")
        print()
        print(
            f"convert: {args.images} JPEGs 320x240 in an ImageFolder tree, {os.cpu_count()} cores"
        )
        print(f"{'method':<56} {'images/s':>10} {'MB/s':>8}")
        for name, ips, mbs in bench_convert(tmp, args.images, args.workers):
            print(f"{name:<56} {ips:>10.0f} {mbs:>8.1f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
