"""hf-stream: a streamed Hugging Face dataset of token lists (issue 30), rows per second.

Data, generated locally (nothing is downloaded): 8 Parquet files of rows ``{"input_ids":
int32 list (32-255 long, uniform), "label": int64}``, 40,000 rows by default (``--rows
400000``: the issue's size), read with ``datasets.load_dataset("parquet", data_files=...,
streaming=True)``; batch 256. Three streams:

* ``stream``: the dataset as loaded;
* ``stream + map``: with a lazy batched ``.map`` (each row's ids truncated to 128 and a
  ``length`` column added, the kind of step a fine-tuning recipe applies): kuat's row path
  reads it as Arrow blocks and maps them in every worker (a batched map's output may depend
  on its batch), and makes only its kept rows into dicts (``kuat.sources._hf_split``);
* ``stream + arrow map``: the same step written for Arrow (``pyarrow.compute.list_slice``
  and ``list_value_length`` on the table ``datasets`` gives a map declared with its own API,
  ``ds.with_format("arrow").map(truncate_arrow, batched=True).with_format(None)``): the same
  rows as ``stream + map``. Its baseline (the ratios in its column) is torch's best
  configuration on ``stream + map``, the user's list map: the same result, the map rewritten
  for Arrow (torch's own rows on this stream are shown too). kuat's columnar path calls the
  function on Arrow tables (``kuat.sources._hf_map.table_mapped_blocks``): no Python rows;
* ``stream + row map``: the same step as a per-row ``.map`` (``batched=False``, as torchtune's
  transforms run): kuat's workers take their share before it (``kuat.sources._hf_split``);
* ``interleave``: ``datasets.interleave_datasets`` of two streams (files 0-3 and 4-7,
  probabilities 0.5/0.5, seed 0).

Loaders, each over every row of one epoch:

* torch ``DataLoader`` with 0 and with 2 worker processes (its best is the reference), the
  small per-row collate a training script writes (``pad_sequence`` of the ids, the labels);
* ``kuat.DataLoader``, 2 workers, the same collate: default worker type; ``worker_type=
  "process"``;
* ``kuat.DataLoader``, 0 and 2 workers, ``collate_fn=kuat.pad_collate()``: the columnar path
  (the stream read as Arrow record batches, batches built column by column; each worker reads
  the whole stream and keeps its batches, so a lazy map runs in every worker);
* ``datasets``' own iteration, no collate: ``ds.iter(batch_size=256)`` (dicts of lists) and
  ``ds.with_format("arrow").iter(batch_size=256)`` (Arrow tables).

``datasets``' 5 s sleep at the end of an interleaved Parquet stream (its thread-pool shutdown)
is switched off for every loader: a constant per epoch, not a rate. Cells run in interleaved
rounds; each reports the median rows/s, the spread (max - min) and
the ratio of medians to torch's best configuration for that stream. The padded ids of the
first batches of torch (0 workers) and kuat's columnar path are compared first (they must be
equal). Not a test; prints a table::

    .venv/bin/python -m benchmarks.bench_hf_stream --rows 400000 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

BATCH = 256
FILES = 8
MIN_LEN, MAX_LEN, VOCAB = 32, 255, 32000
TRUNCATE = 128
LOADERS = (  # (column label, kind, workers, worker_type)
    ("torch, 0 workers", "torch", 0, None),
    ("torch, 2 processes", "torch", 2, None),
    ("kuat, 2 workers (default type)", "kuat", 2, None),
    ('kuat, 2 workers, worker_type="process"', "kuat", 2, "process"),
    ("kuat columnar (pad_collate), 0 workers", "columnar", 0, None),
    ("kuat columnar (pad_collate), 2 workers", "columnar", 2, None),
    ("datasets .iter(batch_size=256)", "iter", 0, None),
    ('datasets .with_format("arrow").iter', "arrow", 0, None),
)
TORCH = ("torch, 0 workers", "torch, 2 processes")
CASES = ("stream", "stream + map", "stream + arrow map", "stream + row map", "interleave")
BASELINE = {"stream + arrow map": "stream + map"}  # whose torch rows a case is compared with


def write_parquet(n: int, out: Path, seed: int = 0) -> list[str]:
    """``FILES`` Parquet files holding ``n`` rows in all; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    paths = []
    for f, rows in enumerate(np.array_split(np.arange(n), FILES)):
        k = len(rows)
        lengths = rng.integers(MIN_LEN, MAX_LEN + 1, k)  # (k,)
        offsets = np.zeros(k + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        ids = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)  # (T,)
        table = pa.table({
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
            "label": pa.array(rng.integers(0, 10, k), pa.int64()),
        })
        path = out / f"part-{f:02d}.parquet"
        pq.write_table(table, path, row_group_size=2048)
        paths.append(str(path))
    return paths


def truncate(batch: dict) -> dict:
    """The lazy map: ids cut to ``TRUNCATE``, a ``length`` column (batched, Python lists)."""
    ids = [row[:TRUNCATE] for row in batch["input_ids"]]
    return {"input_ids": ids, "length": [len(r) for r in ids]}


def truncate_arrow(table):
    """The same step written for Arrow: ``table`` is the ``pyarrow.Table`` of the map's
    batch (``with_format("arrow")``); returns it with ids cut and the ``length`` column."""
    import pyarrow.compute as pc

    ids = pc.list_slice(table["input_ids"], 0, TRUNCATE)
    table = table.set_column(table.column_names.index("input_ids"), "input_ids", ids)
    return table.append_column("length", pc.list_value_length(ids))


def truncate_row(row: dict) -> dict:
    """The same step on one row (a per-row map)."""
    ids = row["input_ids"][:TRUNCATE]
    return {"input_ids": ids, "length": len(ids)}


def small_collate(rows: list[dict]) -> dict:
    """A training script's collate: ids padded with 0 to the longest, labels stacked."""
    ids = [torch.tensor(r["input_ids"]) for r in rows]
    return {
        "input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True),  # (B, L) int64
        "label": torch.tensor([r["label"] for r in rows]),  # (B,) int64
    }


def streams(files: list[str]) -> dict[str, Callable[[], object]]:
    import datasets

    def load(fs):
        return datasets.load_dataset("parquet", data_files=fs, split="train", streaming=True)

    return {
        "stream": lambda: load(files),
        "stream + map": lambda: load(files).map(truncate, batched=True),
        "stream + arrow map": lambda: load(files).with_format("arrow").map(
            truncate_arrow, batched=True).with_format(None),
        "stream + row map": lambda: load(files).map(truncate_row),
        "interleave": lambda: datasets.interleave_datasets(
            [load(files[: FILES // 2]), load(files[FILES // 2 :])],
            probabilities=[0.5, 0.5], seed=0),
    }


def _batches(kind: str, ds, workers: int, worker_type: str | None):
    import kuat

    if kind == "torch":
        return torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers,
                                           collate_fn=small_collate)
    if kind == "kuat":
        return kuat.DataLoader(ds, batch_size=BATCH, num_workers=workers,
                               worker_type=worker_type, collate_fn=small_collate)
    if kind == "columnar":
        return kuat.DataLoader(ds, batch_size=BATCH, num_workers=workers,
                               collate_fn=kuat.pad_collate())
    if kind == "iter":
        return ds.iter(batch_size=BATCH)
    return ds.with_format("arrow").iter(batch_size=BATCH)


def _rows(batch) -> int:
    if hasattr(batch, "num_rows"):
        return batch.num_rows
    first = batch["input_ids"]
    return len(first)


def measure_cell(kind: str, make, workers: int, worker_type: str | None) -> float:
    """Rows per second over one epoch (loader start included, as a training epoch pays it)."""
    ds = make()
    t0 = time.perf_counter()
    n = sum(_rows(b) for b in _batches(kind, ds, workers, worker_type))
    return n / (time.perf_counter() - t0)


def check_equal(make, reference=None) -> None:
    """The columnar path's first padded batches equal torch's (0 workers, same order) on
    ``reference`` (default: the same stream)."""
    a = iter(_batches("torch", (reference or make)(), 0, None))
    b = iter(_batches("columnar", make(), 0, None))
    for _ in range(3):
        x, y = next(a), next(b)
        if not (torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["label"], y["label"])):
            raise AssertionError("kuat's columnar batches differ from torch's")


def run(n: int = 40_000, rounds: int = 3, progress: Callable[[str], None] = lambda s: None,
        cases: tuple[str, ...] = CASES) -> dict:
    """Every (stream, loader) cell ``rounds`` times, interleaved. Returns ``{"rows": [...]}``:
    per loader its label and per stream ``{"median", "spread", "runs", "vs_torch"}``."""
    import datasets

    load_start = os.getloadavg()[0]
    torch.set_num_threads(1)
    # datasets sleeps 5 s when an interleave of Parquet streams ends (its thread-pool shutdown,
    # SLEEP_TIME_ON_THREADS_SHUTDOWN): a constant per epoch and loader, left out of the rates
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    with tempfile.TemporaryDirectory(prefix="kuat-hf-stream-") as tmp:
        progress(f"hf-stream: writing {n:,} rows in {FILES} Parquet files")
        files = write_parquet(n, Path(tmp))
        made = streams(files)
        cases = tuple(dict.fromkeys(  # a case's baseline stream is measured too
            [c for case in cases for c in ((BASELINE[case],) if case in BASELINE else ())
             + (case,)]))
        for case in cases:
            check_equal(made[case], made.get(BASELINE.get(case)))
        rates: dict[tuple[str, str], list[float]] = {}
        for rnd in range(rounds):
            for case in cases:
                for label, kind, workers, wtype in LOADERS:
                    rate = measure_cell(kind, made[case], workers, wtype)
                    rates.setdefault((case, label), []).append(rate)
            progress(f"hf-stream: round {rnd + 1}/{rounds} done")
    best = {c: max(statistics.median(rates[(BASELINE.get(c, c), t)]) for t in TORCH)
            for c in cases}
    out = []
    for label, *_ in LOADERS:
        cells = {}
        for c in cases:
            rs = rates[(c, label)]
            med = statistics.median(rs)
            cells[c] = {"median": med, "spread": max(rs) - min(rs), "runs": rs,
                        "vs_torch": med / best[c]}
        out.append({"loader": label, "cells": cells})
    return {"rows_n": n, "files": FILES, "batch_size": BATCH, "rounds": rounds,
            "cases": list(cases), "rows": out, "cores": os.cpu_count(),
            "load_avg": [load_start, os.getloadavg()[0]]}


def run_for_bench(quick: bool, rounds: int, progress: Callable[[str], None]) -> dict:
    """What ``kuat bench --workloads hf-stream`` runs: 40,000 rows (quick: 16,000)."""
    return run(16_000 if quick else 40_000, rounds, progress=progress)


def markdown(result: dict) -> str:
    """The table: median rows/s (spread), and the ratio to torch's best configuration."""
    cases = result["cases"]
    lines = [
        f"{result['rows_n']:,} rows of token lists in {result['files']} Parquet files, "
        f"streamed (`datasets` streaming), batch {result['batch_size']}; rows/s over one epoch, "
        f"median of {result['rounds']} interleaved rounds (spread), and the ratio to torch's "
        "best configuration for that stream (`datasets`' own iteration collates nothing"
        + "".join(f"; {c}: torch's best on {BASELINE[c]}, the same result with the map "
                  "rewritten for Arrow" for c in cases if c in BASELINE)
        + ")" + _load(result) + ":",
        "",
        "| loader | " + " | ".join(
            f"{c} (vs torch on {BASELINE[c]})" if c in BASELINE else c for c in cases) + " |",
        "|---|" + "---:|" * len(cases),
    ]
    for row in result["rows"]:
        cells = []
        for c in cases:
            v = row["cells"][c]
            cells.append(f"{v['median']:,.0f} ({v['spread']:,.0f}) **{v['vs_torch']:.2f}x**")
        lines.append(f"| {row['loader']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _load(result: dict) -> str:
    load = result.get("load_avg")
    if not load:
        return ""
    return (f"; 1-minute load average {load[0]:.1f} at the start and {load[1]:.1f} at the end "
            f"on {result.get('cores')} cores")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=40_000, help="rows in all (the issue: 400000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    res = run(args.rows, args.rounds, progress=lambda s: print(s, flush=True),
              cases=tuple(args.cases))
    if args.json:
        import json

        args.json.write_text(json.dumps(res, indent=1))
    print(markdown(res))


if __name__ == "__main__":
    main()
