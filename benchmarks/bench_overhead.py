"""The loader's own per-batch cost on cheap samples (issue #17): torch vs kuat, every mode.

Not a test: prints a table. ``kuat bench --workloads overhead`` runs it (the runner calls
:func:`run`), or directly: ``python -m benchmarks.bench_overhead [--rows N] [--rounds R]``.

Rows (batch 256, the dataset does almost nothing, so what is measured is the loop):

- ``range(n)``, shuffle: a Python ``range`` as a map-style dataset;
- the same with ``isolate_global_rng=False`` (kuat only: what global-RNG isolation costs);
- a NumPy array ``(n, 16)`` uint16 plus an int64 label, per-sample ``__getitem__``;
- the same data as a kuat dataset (``kuat.open``), read by torch's loader and by kuat's.

Columns: torch with 0 and 2 worker processes; kuat with 0 workers, 2 thread workers and 2
process workers. Unit: microseconds per batch in steady state (lower is better): each
measurement builds a loader, discards the first ``warmup`` batches (worker start-up,
first-touch page faults) and times the next ``batches``. Rounds are interleaved (every cell
once per round, in the same order), so drift on a shared machine hits every cell alike; the
table shows the median over rounds and, in parentheses, the spread (max - min).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

BATCH = 256
WIDTH = 16  # uint16 per row: 32 bytes, as in the issue

COLUMNS = (
    ("torch, 0 workers", "torch", 0, None),
    ("torch, 2 workers", "torch", 2, None),
    ("kuat, 0 workers", "kuat", 0, "thread"),
    ("kuat, 2 threads", "kuat", 2, "thread"),
    ("kuat, 2 processes", "kuat", 2, "process"),
)


class NumpyRows(torch.utils.data.Dataset):
    """``(x[i], y[i])``: a ``(16,)`` uint16 row and an int label, one sample at a time."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def _data(n: int, work: Path) -> dict:
    import kuat
    import kuat.format as kf

    rng = np.random.default_rng(0)
    x = rng.integers(0, 1 << 16, (n, WIDTH), dtype=np.uint16)  # (N, 16) uint16
    y = rng.integers(0, 1000, n, dtype=np.int64)  # (N,) int64
    path = work / "overhead.kuat"
    with kuat.Writer(path, {"x": kf.tensor((WIDTH,), "uint16"), "label": kf.int64()}) as w:
        for s in range(0, n, 65536):
            w.write_batch({"x": x[s : s + 65536], "label": y[s : s + 65536]})
    return {"range": range(n), "numpy": NumpyRows(x, y), "kuat": kuat.open(path)}


def _rows(data: dict) -> list[tuple[str, Callable[[], object], dict, set[str]]]:
    """``(row label, dataset factory, extra kuat kwargs, loaders measured)``."""
    return [
        ("`range(n)`, shuffle", lambda: data["range"], {}, {"torch", "kuat"}),
        ("same, `isolate_global_rng=False`", lambda: data["range"],
         {"isolate_global_rng": False}, {"kuat"}),
        ("NumPy (n x 16 uint16) + label, per-sample", lambda: data["numpy"], {}, {"torch", "kuat"}),
        ("the same data as a kuat dataset", lambda: data["kuat"], {}, {"torch", "kuat"}),
    ]


def _loader(which: str, ds, workers: int, worker_type: str | None, extra: dict):
    if which == "torch":
        return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers)
    import kuat

    kw = dict(extra)
    if workers:
        kw["worker_type"] = worker_type
    return kuat.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers, seed=0, **kw)


def measure_cell(dl, warmup: int, batches: int) -> float:
    """Microseconds per batch over ``batches`` batches after ``warmup`` ones."""
    it = iter(dl)
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    us = (time.perf_counter() - t0) / batches * 1e6
    del it
    return us


def run(n: int = 1_000_000, rounds: int = 3, warmup: int = 20, batches: int = 200,
        progress: Callable[[str], None] = lambda s: None) -> dict:
    """Measure every cell ``rounds`` times, interleaved. Returns ``{"rows": [...], ...}``:
    per row its label and per column ``{"median_us", "spread_us", "runs_us"}`` or ``None``."""
    if n < BATCH * (warmup + batches):
        raise ValueError(f"n={n} rows cannot hold warmup + batches = {warmup + batches} batches")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kuat-overhead-") as tmp:
        progress(f"overhead: writing {n:,} rows")
        data = _data(n, Path(tmp))
        rows = _rows(data)
        times: dict[tuple[int, int], list[float]] = {}
        for rnd in range(rounds):
            for r, (_label, make, extra, loaders) in enumerate(rows):
                for c, (_, which, workers, wtype) in enumerate(COLUMNS):
                    if which not in loaders:
                        continue
                    dl = _loader(which, make(), workers, wtype, extra)
                    times.setdefault((r, c), []).append(measure_cell(dl, warmup, batches))
                    del dl
            progress(f"overhead: round {rnd + 1}/{rounds} done")
        data["kuat"].close()
    out = []
    for r, (label, *_rest) in enumerate(rows):
        cells = {}
        for c, (col, *_x) in enumerate(COLUMNS):
            ts = times.get((r, c))
            cells[col] = None if ts is None else {
                "median_us": statistics.median(ts), "spread_us": max(ts) - min(ts), "runs_us": ts,
            }
        out.append({"row": label, "cells": cells})
    return {"batch_size": BATCH, "rows_n": n, "rounds": rounds, "warmup": warmup,
            "batches": batches, "rows": out}


def run_for_bench(quick: bool, rounds: int, progress: Callable[[str], None]) -> dict:
    """What ``kuat bench`` runs: 1M rows (quick: 200k and 100 timed batches)."""
    if quick:
        return run(200_000, rounds, batches=100, progress=progress)
    return run(1_000_000, rounds, progress=progress)


def markdown(result: dict) -> str:
    """The table: median microseconds per batch (spread over rounds in parentheses)."""
    cols = [c[0] for c in COLUMNS]
    lines = [
        f"Loop overhead, batch {result['batch_size']}, microseconds per batch (lower is better), "
        f"median of {result['rounds']} interleaved rounds (spread):",
        "",
        "| dataset | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for row in result["rows"]:
        cells = []
        for col in cols:
            v = row["cells"][col]
            cells.append("" if v is None else f"{v['median_us']:,.0f} ({v['spread_us']:,.0f})")
        lines.append(f"| {row['row']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="dataset rows (default 1M)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=200, help="timed batches per cell")
    args = p.parse_args(argv)
    res = run(args.rows, args.rounds, batches=args.batches, progress=lambda s: print(s, flush=True))
    print(markdown(res))


if __name__ == "__main__":
    main()
