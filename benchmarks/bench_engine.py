"""Loader engine throughput: torch's DataLoader vs kuat process workers vs kuat thread workers.

Not a test: prints a table. Run with ``.venv/bin/python benchmarks/bench_engine.py``.

Workloads:
  trivial   a map dataset whose ``__getitems__`` returns 64 rows of (300,) int64 (a (64, 300)
            int64 batch, 150 KiB): measures the engine's per-batch overhead (dispatch, transport,
            wake-ups), not the dataset. Unit: batches/s.
  imagefolder  unchanged ``torchvision.datasets.ImageFolder`` over the kuat demo ImageFolder with
            torchvision v2 ``PILToTensor + RandomResizedCrop(224) + RandomHorizontalFlip``, batch
            32, default collate, a ``RandomSampler`` of ``--images`` indices. Unit: images/s.

Each run builds a fresh loader and runs one epoch (workers not persistent). ``first`` is the time
from ``iter(loader)`` to the first batch (worker start-up included), ``rate`` counts the batches
after the first over the time after the first. Runs are interleaved (torch, kuat-proc,
kuat-thread, torch, ...) so that load from other processes on the machine hits every loader
alike; the table shows medians over ``--reps`` and kuat / torch ratios (rate: higher is better;
first batch: lower is better).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


class TrivialDataset(torch.utils.data.Dataset):
    """``n`` samples; sample i is a (width,) int64 row full of i. Batch fetch via __getitems__."""

    def __init__(self, n: int, width: int = 300):
        self.n, self.width = n, width

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.width,), i, dtype=torch.int64)

    def __getitems__(self, indices):
        # (B, width) int64 built at once, handed out as B row views
        rows = torch.tensor(indices, dtype=torch.int64).unsqueeze(1).expand(-1, self.width)
        return list(rows.contiguous())


def _imagefolder(root: str):
    from torchvision import datasets
    from torchvision.transforms import v2

    tf = v2.Compose([v2.PILToTensor(), v2.RandomResizedCrop(224, antialias=True),
                     v2.RandomHorizontalFlip()])
    return datasets.ImageFolder(root, transform=tf)


def _make(kind: str, ds, batch_size: int, workers: int, samples: int):
    # The same sampler type for every loader: ``samples`` random indices (an epoch shorter than
    # the dataset, without wrapping the dataset in a Subset, which would add __getitems__).
    sampler = torch.utils.data.RandomSampler(ds, num_samples=min(samples, len(ds)),
                                             generator=torch.Generator().manual_seed(0))
    if kind == "torch":
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=sampler,
                                           num_workers=workers)
    import kuat

    return kuat.DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers,
                           worker_type=kind.split("-")[1], seed=0)


def _run_once(kind: str, ds, batch_size: int, workers: int, unit_per_batch,
              samples: int) -> tuple[float, float]:
    loader = _make(kind, ds, batch_size, workers, samples)
    t0 = time.perf_counter()
    it = iter(loader)
    first = next(it)
    t1 = time.perf_counter()
    units = 0
    for b in it:
        units += unit_per_batch(b)
    t2 = time.perf_counter()
    del it, first
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return units / max(t2 - t1, 1e-9), t1 - t0


def _one(batch) -> int:
    return 1


def _labels(batch) -> int:
    return len(batch[1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="trivial,imagefolder")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    p.add_argument("--loaders", default="torch,kuat-process,kuat-thread")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--trivial-batches", type=int, default=200)
    p.add_argument("--images", type=int, default=512, help="images per imagefolder epoch")
    p.add_argument("--root", default="/tmp/kdemo/imagefolder-v1-n2000-s0",
                   help="an ImageFolder; build with kuat.demo_data.build_demo_imagefolder")
    args = p.parse_args(argv)
    loaders = args.loaders.split(",")
    rows = []
    for wl in args.workloads.split(","):
        if wl == "trivial":
            ds, bs, unit, per = TrivialDataset(64 * args.trivial_batches), 64, "batches/s", _one
            samples = len(ds)
        elif wl == "imagefolder":
            ds, bs, unit = _imagefolder(args.root), 32, "images/s"
            samples = args.images
            per = _labels
        else:
            raise SystemExit(f"unknown workload {wl!r}")
        for w in (int(x) for x in args.workers.split(",")):
            res = {k: ([], []) for k in loaders}
            for _ in range(args.reps):
                for k in loaders:
                    rate, first = _run_once(k, ds, bs, w, per, samples)
                    res[k][0].append(rate)
                    res[k][1].append(first)
            med = {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in res.items()}
            for k in loaders:
                rate, first = med[k]
                ref = med.get("torch")
                ratio = f"{rate / ref[0]:.2f}x" if ref and k != "torch" else ""
                fratio = f"{first / ref[1]:.2f}x" if ref and k != "torch" else ""
                rows.append((wl, w, k, f"{rate:.0f} {unit}", ratio, f"{first * 1000:.0f} ms", fratio))
            print(*(f"{c}" for c in rows[-len(loaders)]), "...", flush=True)
    hdr = ("workload", "workers", "loader", "rate (median)", "vs torch", "first batch", "vs torch")
    widths = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
    print()
    for r in [hdr] + rows:
        print("  ".join(str(c).ljust(wd) for c, wd in zip(r, widths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
