"""Remote datasets (issue #14): epoch throughput from an S3-compatible server against local disk.

Not a test: prints a table. ``kuat bench --workloads remote`` runs it (the runner calls
:func:`run_for_bench`), or directly: ``python -m benchmarks.bench_remote [--quick]``.

One dataset (``rows`` samples of a ``(1024,)`` float32 tensor plus an int64 label, 4 KiB a
row, in shards of ``shard_mib``) is written once on local disk and uploaded to moto's S3 server
(``moto.server``, the same server the remote tests use), which runs with a :class:`DelayProxy`
in front of it in a child process on 127.0.0.1 (``python -m benchmarks.bench_remote serve``;
started here, stopped at the end, bounded waits). Every cell reads one full epoch with
``kuat.DataLoader`` (``batch_size`` 256, ``num_workers`` thread workers, the shard-aware
``ShardShuffleSampler`` with blocks of ``block_shards`` shards, ``prefetch_shards`` twice that
so the next block downloads while this one is read), timed from building the loader to the
last batch (``kuat.open``, which reads the manifest once per training run, is timed apart):

- ``local disk``: the dataset directory, memory-mapped in place;
- ``S3, warm cache``: every shard already in the cache (one untimed epoch filled it);
- ``S3, cold cache``: an empty cache directory (a fresh one per measurement);
- ``S3, cold cache, +50 ms``: the same through the proxy, which holds each request 50 ms.

Rounds are interleaved, every cell once per round, in the order A B C D, then D C B A (so a
linear drift on a shared machine cancels over each pair of rounds, and the two cells of each
ratio run side by side); cells report the median samples/s over rounds with the min-max,
and a ratio is the median (min-max) of the per-round ratios. Targets (issue #14): warm cache
>= 0.95x local disk; cold cache with 50 ms >= 0.8x cold cache without. The machine's load
average at the start and the end is part of the result: the server, the proxy and the loader
share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROW_FLOATS = 1024  # (1024,) float32: 4 KiB per sample
BATCH = 256
DELAY_MS = 50
CELLS = ("local disk", "S3, warm cache", "S3, cold cache", f"S3, cold cache, +{DELAY_MS} ms")
RATIOS = (  # (label, numerator, denominator, target)
    ("warm cache / local disk", CELLS[1], CELLS[0], 0.95),
    (f"cold +{DELAY_MS} ms / cold", CELLS[3], CELLS[2], 0.8),
    ("cold cache / local disk", CELLS[2], CELLS[0], None),
)
_SERVER_START_S = 60.0  # the server child prints its ports within this, or the bench fails
_SERVER_STOP_S = 10.0
CREDENTIALS = {"key": "bench", "secret": "bench"}  # moto accepts any


# -- the server child ---------------------------------------------------------------------------
def serve(delay_ms: float) -> None:
    """Child: moto's S3 server and a :class:`DelayProxy` to it, both on 127.0.0.1; prints
    ``{"endpoint": url, "proxy": url}`` as one JSON line, then serves until stdin closes."""
    import logging

    from moto.server import ThreadedMotoServer

    from benchmarks.delay_proxy import DelayProxy

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # stdout: ours
    server.start()
    _, port = server.get_host_and_port()  # port 0: the one the OS chose
    proxy = DelayProxy(("127.0.0.1", port), delay_ms / 1000).start()
    print(json.dumps({"endpoint": f"http://127.0.0.1:{port}", "proxy": proxy.url}), flush=True)
    try:
        sys.stdin.read()  # until the parent closes our stdin (or dies)
    finally:
        proxy.close()
        server.stop()


class Servers:
    """The server child (:func:`serve`): ``endpoint`` (moto) and ``proxy`` URLs. Stops it on
    :meth:`close` (closing its stdin, then killing it after 10 s).

    Raises:
        RuntimeError: the child did not print its ports within 60 s (its output is included).
    """

    def __init__(self, delay_ms: float = DELAY_MS):
        repo = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe nobody drains
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_remote", "serve", "--delay-ms",
             str(delay_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env,
            text=True,
        )  # fmt: skip
        ready, _, _ = select.select([self.proc.stdout], [], [], _SERVER_START_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._stderr.seek(0)
            err = self._stderr.read().decode(errors="replace")[-2000:]
            self.close()
            raise RuntimeError(f"the S3 server child did not start within {_SERVER_START_S} s: {err}")
        urls = json.loads(line)
        self.endpoint, self.proxy = urls["endpoint"], urls["proxy"]

    def close(self) -> None:
        """Stop the child (idempotent)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(_SERVER_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self._stderr):
            f.close()  # idempotent

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the measured epochs --------------------------------------------------------------------------
def write_dataset(path: Path, rows: int, shard_mib: float) -> None:
    """``rows`` samples ``{"x": (1024,) float32, "y": int64}`` at ``path``, shards of about
    ``shard_mib`` MiB."""
    import kuat
    import kuat.format as kf

    schema = {"x": kf.tensor((ROW_FLOATS,), "float32"), "y": kf.int64()}
    rng = np.random.default_rng(0)
    with kuat.Writer(path, schema, shard_bytes=int(shard_mib * 2**20)) as w:
        for s in range(0, rows, 4096):
            n = min(4096, rows - s)
            x = rng.standard_normal((n, ROW_FLOATS), dtype=np.float32)  # (n, 1024) float32
            w.write_batch({"x": x, "y": np.arange(s, s + n, dtype=np.int64)})


def upload(local: Path, url: str, storage_options: dict) -> None:
    """Copy the dataset directory ``local`` to ``url`` (a bucket is created), manifest last."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    fs.mkdir(root.split("/", 1)[0])
    names = sorted(p.name for p in local.iterdir() if p.name != "manifest.json")
    for name in [*names, "manifest.json"]:
        fs.put_file(str(local / name), f"{root}/{name}")


def epoch(path: str, *, storage_options: dict | None, cache_dir: str | None, num_workers: int,
          block_rows: int, prefetch_shards: int) -> dict:  # fmt: skip
    """Open the dataset and read one epoch: ``{"open_s", "epoch_s", "samples", "bytes"}``
    (``epoch_s``: from building the loader to the last batch; ``open_s``: ``kuat.open``,
    which reads the manifest, once per training run, not per epoch).

    Raises:
        RuntimeError: the epoch did not return every sample exactly once.
    """
    import kuat

    t0 = time.perf_counter()
    kw = {} if storage_options is None else {
        "storage_options": storage_options, "cache_dir": cache_dir,
        "prefetch_shards": prefetch_shards,
    }  # fmt: skip
    ds = kuat.open(path, **kw)
    t1 = time.perf_counter()
    sampler = kuat.ShardShuffleSampler(ds, block_size=block_rows, seed=0)
    dl = kuat.DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=num_workers, seed=0)
    seen = np.zeros(len(ds), np.int64)
    nbytes = 0
    for b in dl:
        seen[b["y"].numpy()] += 1  # (B,) int64 labels are the row ids
        nbytes += b["x"].numel() * b["x"].element_size()
    t2 = time.perf_counter()
    ds.close()
    if not (seen == 1).all():
        raise RuntimeError(f"{path}: an epoch returned {int(seen.sum())} samples, not each once")
    return {"open_s": t1 - t0, "epoch_s": t2 - t1, "samples": int(seen.sum()), "bytes": nbytes}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(rows: int = 65536, shard_mib: float = 4.0, rounds: int = 3, num_workers: int = 2,
        block_shards: int = 4, prefetch_shards: int | None = None, delay_ms: float = DELAY_MS,
        progress: Callable[[str], None] = lambda s: None) -> dict:  # fmt: skip
    """Measure every cell ``rounds`` times, interleaved (module docstring).

    Returns ``{"rows", "shards", "dataset_mib", ..., "machine": {"cpu_count",
    "load_avg_1min_start", "load_avg_1min_end"}, "cells": {cell: {"median", "min", "max",
    "runs"}} (samples/s), "ratios": {label: {"median", "min", "max", "target"}}}``.

    Raises:
        ValueError: a size or count is not positive.
        RuntimeError: the server child did not start, or an epoch lost samples.
    """
    import kuat

    if prefetch_shards is None:  # a block's shards are needed at once: fetch the next block's
        prefetch_shards = 2 * block_shards  # while this one is read
    for name, v in dict(rows=rows, shard_mib=shard_mib, rounds=rounds, block_shards=block_shards,
                        prefetch_shards=prefetch_shards).items():  # fmt: skip
        if v <= 0:
            raise ValueError(f"{name}={v!r} must be positive")
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kuat-bench-remote-") as tmp, Servers(delay_ms) as srv:
        tmp = Path(tmp)
        local = tmp / "local.kuat"
        progress(f"remote: writing {rows:,} rows and uploading them to {srv.endpoint}")
        write_dataset(local, rows, shard_mib)
        direct = {"endpoint_url": srv.endpoint, **CREDENTIALS}
        slow = {"endpoint_url": srv.proxy, **CREDENTIALS}
        url = "s3://kuat-bench/remote.kuat"
        upload(local, url, direct)
        manifest = kuat.open(local).manifest
        shards = len(manifest.shards)
        block_rows = max(1, block_shards * rows // shards)
        common = dict(num_workers=num_workers, block_rows=block_rows,
                      prefetch_shards=prefetch_shards)  # fmt: skip
        warm_dir = str(tmp / "warm-cache")
        cold_n = 0

        def measure(cell: str) -> dict:
            nonlocal cold_n
            if cell == CELLS[0]:
                return epoch(str(local), storage_options=None, cache_dir=None, **common)
            if cell == CELLS[1]:
                return epoch(url, storage_options=direct, cache_dir=warm_dir, **common)
            cold_n += 1
            cache = tmp / f"cold-cache-{cold_n}"
            try:
                so = direct if cell == CELLS[2] else slow
                return epoch(url, storage_options=so, cache_dir=str(cache), **common)
            finally:
                shutil.rmtree(cache, ignore_errors=True)

        for cell in CELLS:  # untimed: imports, page cache, the warm cache, moto's first calls
            measure(cell)
        runs: dict[str, list[float]] = {c: [] for c in CELLS}
        opens: dict[str, list[float]] = {c: [] for c in CELLS}
        for rnd in range(rounds):
            # A B C D, then D C B A: drift cancels over each pair of rounds, and the cells of
            # each ratio (local/warm, cold/cold + 50 ms) always run side by side
            for cell in CELLS if rnd % 2 == 0 else CELLS[::-1]:
                r = measure(cell)
                runs[cell].append(r["samples"] / r["epoch_s"])
                opens[cell].append(r["open_s"] * 1000)
            progress(
                f"remote: round {rnd + 1}/{rounds}: "
                + ", ".join(f"{c} {runs[c][-1]:,.0f}/s" for c in CELLS)
            )
    ratios = {
        label: {**_spread([a / b for a, b in zip(runs[num], runs[den])]), "target": target}
        for label, num, den, target in RATIOS
    }
    return {
        "rows": rows,
        "shards": shards,
        "dataset_mib": sum(s.bytes for s in manifest.shards) / 2**20,
        "batch_size": BATCH,
        "num_workers": num_workers,
        "block_rows": block_rows,
        "prefetch_shards": prefetch_shards,
        "delay_ms": delay_ms,
        "rounds": rounds,
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_avg_1min_start": load_start,
            "load_avg_1min_end": os.getloadavg()[0],
        },
        "cells": {
            c: {**_spread(v), "runs": v, "open_ms": statistics.median(opens[c])}
            for c, v in runs.items()
        },
        "ratios": ratios,
    }


def run_for_bench(quick: bool, rounds: int, progress: Callable[[str], None]) -> dict:
    """What ``kuat bench`` runs: 256 MiB in 64 shards (quick: 32 MiB in 16 shards)."""
    if quick:
        return run(rows=8192, shard_mib=2.0, rounds=rounds, progress=progress)
    return run(rounds=rounds, progress=progress)


def markdown(result: dict) -> str:
    """The table: median samples/s (min-max over rounds), MiB/s, and the ratios with targets."""
    m = result["machine"]
    mib_per_row = ROW_FLOATS * 4 / 2**20
    lines = [
        f"One epoch (from building the loader to its last batch; `kuat.open`, once per run, "
        f"apart), {result['rows']:,} rows of 4 KiB "
        f"({result['dataset_mib']:.0f} MiB in {result['shards']} shards), batch "
        f"{result['batch_size']}, {result['num_workers']} thread workers, `ShardShuffleSampler` "
        f"(blocks of {result['block_rows']:,} rows), `prefetch_shards={result['prefetch_shards']}`; "
        f"moto's S3 server on 127.0.0.1; median of {result['rounds']} interleaved rounds "
        f"(min-max). Load average {m['load_avg_1min_start']:.1f} at the start, "
        f"{m['load_avg_1min_end']:.1f} at the end, on {m['cpu_count']} cores (server, proxy and "
        "loader share them).",
        "",
        "| storage | epoch, samples/s | MiB/s | `kuat.open`, ms |",
        "|---|---:|---:|---:|",
    ]
    for cell, v in result["cells"].items():
        lines.append(
            f"| {cell} | {v['median']:,.0f} ({v['min']:,.0f}-{v['max']:,.0f}) | "
            f"{v['median'] * mib_per_row:,.0f} | {v['open_ms']:.1f} |"
        )
    lines += ["", "| ratio | median (min-max) | target |", "|---|---:|---:|"]
    for label, v in result["ratios"].items():
        target = "" if v["target"] is None else f">= {v['target']:.2f}"
        lines.append(f"| {label} | {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f}) | {target} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("serve", help="(internal) the server child")
    s.add_argument("--delay-ms", type=float, default=DELAY_MS)
    p.add_argument("--quick", action="store_true", help="32 MiB in 16 shards, 2 rounds")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--prefetch-shards", type=int, default=None, help="default: 2 blocks (8)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    if args.cmd == "serve":
        serve(args.delay_ms)
        return
    size = dict(rows=8192, shard_mib=2.0) if args.quick else {}
    rounds = args.rounds or (2 if args.quick else 3)
    res = run(**size, rounds=rounds, num_workers=args.workers,
              prefetch_shards=args.prefetch_shards, progress=lambda s: print(s, flush=True))  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))
    print(markdown(res))


if __name__ == "__main__":
    main()
