"""hf-rows: a ``datasets.Dataset`` of variable-length token lists, padded per batch.

Workload (issue 6): 200,000 rows of ``input_ids`` (int32 lists, 64-511 long, uniform) plus an int
``label``; batch 64; shuffled (one fixed permutation, so both loaders read the same indices).

* **torch**: ``torch.utils.data.DataLoader(ds.with_format("torch"), collate_fn=pad_rows)``,
  where ``pad_rows`` is the usual per-row Python padding loop;
* **kuat**: ``kuat.DataLoader(ds.with_format("torch"), collate_fn=kuat.pad_collate())``, in
  thread and process mode, with the same number of workers.

The padded outputs of the first batches are compared (they must be identical), then rows/s is
measured over the rest. Not a test; prints a table::

    .venv/bin/python -m benchmarks.bench_hf --workers 0 2 --batches 400

``prepare(cache_dir, num_rows)`` builds the dataset once (cached on disk, memory-mapped like
any ``datasets`` cache) for the ``kuat bench`` harness too.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

BATCH_SIZE = 64
MIN_LEN, MAX_LEN = 64, 511
VOCAB = 32000


def prepare(cache_dir: Path, num_rows: int, seed: int = 0) -> dict:
    """Build (once) and return ``{"path", "num_rows"}`` of the hf-rows dataset on disk."""
    import datasets
    import pyarrow as pa

    path = Path(cache_dir) / f"hf-rows-{num_rows}-{seed}"
    if not (path / "dataset_info.json").exists():
        rng = np.random.default_rng(seed)
        lengths = rng.integers(MIN_LEN, MAX_LEN + 1, num_rows)  # (R,)
        offsets = np.zeros(num_rows + 1, dtype=np.int32)  # (R + 1,)
        np.cumsum(lengths, out=offsets[1:])
        values = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)  # (T,) token ids
        table = pa.table(
            {
                "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
                "label": pa.array(rng.integers(0, 10, num_rows), pa.int64()),
            }
        )
        features = datasets.Features(
            {"input_ids": datasets.List(datasets.Value("int32")), "label": datasets.Value("int64")}
        )
        tmp = path.with_name(path.name + ".tmp")
        datasets.Dataset(table, info=datasets.DatasetInfo(features=features)).save_to_disk(str(tmp))
        tmp.rename(path)
    return {"path": str(path), "num_rows": num_rows}


def pad_rows(samples: list[dict]) -> dict:
    """The usual per-row Python padding collate (what the torch baseline runs)."""
    lengths = [len(s["input_ids"]) for s in samples]
    out = torch.zeros(len(samples), max(lengths), dtype=samples[0]["input_ids"].dtype)  # (B, L)
    for i, s in enumerate(samples):
        out[i, : lengths[i]] = s["input_ids"]
    return {
        "input_ids": out,
        "input_ids_lengths": torch.tensor(lengths, dtype=torch.int64),  # (B,)
        "label": torch.stack([s["label"] for s in samples]),  # (B,)
    }


def order(num_rows: int, seed: int = 0) -> list[int]:
    """The shuffled sample order both loaders read."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()


def torch_loader(data: dict, num_workers: int, indices: list[int]):
    import datasets

    ds = datasets.load_from_disk(data["path"]).with_format("torch")
    return torch.utils.data.DataLoader(
        ds, batch_size=BATCH_SIZE, sampler=indices, num_workers=num_workers, collate_fn=pad_rows
    )


def kuat_loader(data: dict, num_workers: int, indices: list[int], worker_type: str = "thread"):
    import datasets

    import kuat

    ds = datasets.load_from_disk(data["path"]).with_format("torch")
    return kuat.DataLoader(
        ds,
        batch_size=BATCH_SIZE,
        sampler=indices,
        num_workers=num_workers,
        worker_type=worker_type,
        collate_fn=kuat.pad_collate(),
    )


def _measure(loader, check: list | None, check_batches: int, max_batches: int):
    """(rows/s over batches after the checked ones, batches checked)."""
    it = iter(loader)
    first = []
    for _ in range(check_batches):
        first.append(next(it))
    if check is not None:
        for k, (a, b) in enumerate(zip(first, check, strict=True)):
            for key in ("input_ids", "input_ids_lengths", "label"):
                if a[key].dtype != b[key].dtype or not torch.equal(a[key], b[key]):
                    raise AssertionError(f"batch {k}: {key!r} differs from the torch baseline")
    rows, t0 = 0, time.perf_counter()
    for n, batch in enumerate(it):
        rows += len(batch["label"])
        if n + 1 >= max_batches:
            break
    rate = rows / (time.perf_counter() - t0)
    del it
    return rate, first


def main(argv: list[str] | None = None) -> int:
    from kuat._dirs import cache_root  # kuat is imported lazily throughout this module

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--batches", type=int, default=400, help="timed batches per run")
    p.add_argument("--check", type=int, default=20, help="batches compared to the baseline")
    p.add_argument("--cache-dir", type=Path, default=cache_root() / "bench",
                   help="default: bench/ under kuat's cache root ($KUAT_CACHE, ...)")
    p.add_argument("--process", action="store_true", help="also run kuat in process mode")
    args = p.parse_args(argv)

    data = prepare(args.cache_dir, args.rows)
    indices = order(args.rows)
    print(f"hf-rows: {args.rows:,} rows, batch {BATCH_SIZE}, {args.batches} timed batches")
    print(f"{'loader':<16}{'workers':>8}{'rows/s':>12}{'vs torch':>10}  outputs")
    for w in args.workers:
        base, ref = _measure(torch_loader(data, w, indices), None, args.check, args.batches)
        print(f"{'torch':<16}{w:>8}{base:>12,.0f}{1.0:>10.2f}  reference")
        runs = [("kuat-thread", "thread")] + ([("kuat-process", "process")] if args.process else [])
        for label, kind in runs:
            if w == 0 and kind == "process":
                continue
            loader = kuat_loader(data, w, indices, kind)
            rate, _ = _measure(loader, ref, args.check, args.batches)
            loader.close()
            print(
                f"{label:<16}{w:>8}{rate:>12,.0f}{rate / base:>10.2f}  identical ({args.check} batches)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
