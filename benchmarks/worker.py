"""Child side of ``kuat bench``: one (loader, workload) measurement in a fresh process.

Run as ``python -m benchmarks.worker SPEC.json OUT.json`` with the repository root on
``PYTHONPATH`` and the peer's own interpreter. ``SPEC.json`` holds:

``adapter`` (module name under ``benchmarks.adapters``), ``options`` (adapter keywords,
e.g. kuat's ``worker_type``), ``kind`` (what the adapter runs: ``smooth-jpeg`` is
``imagenet-jpeg`` on other files; default ``workload``), ``mode``: ``probe`` (import the peer, report versions),
``prepare`` (convert the workload's data into the peer's format, cached), ``run`` (time the
loader; nothing samples memory meanwhile), ``memory`` (the same loop while the parent samples
the PSS of this process tree; its times are not reported as rates), ``ingest`` (time a fresh
conversion), plus ``loader``, ``workload``, ``data`` (paths from the parent), ``batch_size``,
``num_workers``, ``epochs``, ``seed`` and ``cache_dir``.

``OUT.json`` gets ``{"ok": true, ...}`` with the measurements, or ``{"ok": false, "error":
..., "traceback": ...}``; the exit status is 0 either way unless the process itself died.

What ``run`` measures (all wall times from ``time.perf_counter``):

- ``baseline_pss``: PSS of this process by kind (``pss``, ``anon``, ``file``, ``shmem``,
  bytes) and the machine's shared memory (``shm_system``: see :mod:`benchmarks.measure`) after importing the peer and before building the loader (in ``memory`` runs the
  parent samples the peak over the whole process tree and subtracts this);
- ``end_pss``: in ``memory`` runs, the tree's PSS by kind after the last epoch with the loader
  still open (the parent's peak includes it and the baseline, so a run shorter than one
  sampling period still has a peak);
- ``setup_s``: building the loader object (opening files, compiling pipelines where that
  happens at construction);
- ``ttfb_s``: from asking the first epoch for an iterator to holding the first batch;
- ``epochs[i]``: samples, wall seconds and process-tree CPU seconds of epoch ``i``;
- ``steady``: epochs after the first (the first carries worker start-up, JIT and cache
  warm-up): samples/s and CPU seconds per 1,000 samples.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path


def _load_adapter(name: str):
    return importlib.import_module(f"benchmarks.adapters.{name}")


def _count(batch) -> int:
    """Samples in a canonical batch: the leading dim of its first tensor field."""
    if isinstance(batch, dict):
        first = next(iter(batch.values()))
    elif isinstance(batch, (list, tuple)):
        first = batch[0]
    else:
        first = batch
    return int(first.shape[0])


def _run(adapter, spec: dict) -> dict:
    from benchmarks import checks, measure

    versions = adapter.versions()  # imports the peer: counted in the baseline
    baseline = measure.tree_pss(os.getpid())
    workload, data = spec.get("kind", spec["workload"]), spec["data"]
    t0 = measure.now()
    loader = adapter.build(workload, data, spec)
    setup_s = measure.now() - t0
    count = getattr(adapter, "count", _count)
    epochs, ttfb_s, checked = [], None, None
    try:
        for epoch in range(spec["epochs"]):
            cpu0, t_start = measure.tree_cpu_seconds(), measure.now()
            n = 0
            for batch in loader.epoch(epoch):
                if ttfb_s is None:
                    ttfb_s = measure.now() - t_start
                if checked is None:
                    checked = checks.check_batch(workload, batch, spec)
                n += count(batch)
            epochs.append(
                {
                    "samples": n,
                    "wall_s": measure.now() - t_start,
                    "cpu_s": measure.tree_cpu_seconds() - cpu0,
                }
            )
        # the tree's PSS with the loader still open: a run shorter than the parent's sampling
        # period could otherwise end between two samples (memory runs only; after the clock)
        end_pss = measure.tree_pss(os.getpid()) if spec["mode"] == "memory" else None
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    steady = epochs[1:] or epochs
    samples = sum(e["samples"] for e in steady)
    wall = sum(e["wall_s"] for e in steady)
    cpu = sum(e["cpu_s"] for e in steady)
    return {
        "versions": versions,
        "baseline_pss": baseline,
        "end_pss": end_pss,
        "setup_s": setup_s,
        "ttfb_s": ttfb_s,
        "epochs": epochs,
        "batch_check": checked,
        "steady": {
            "samples": samples,
            "wall_s": wall,
            "samples_per_s": samples / wall if wall > 0 else None,
            "cpu_s_per_1k": 1000.0 * cpu / samples if samples else None,
        },
    }


def _ingest(adapter, spec: dict) -> dict:
    from benchmarks import measure

    versions = adapter.versions()
    out_dir = Path(spec["out_dir"])
    cpu0, t0 = measure.tree_cpu_seconds(), measure.now()
    n = adapter.ingest(spec["data"], out_dir, spec["num_workers"])
    wall = measure.now() - t0
    cpu = measure.tree_cpu_seconds() - cpu0
    size = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    return {
        "versions": versions,
        "images": n,
        "wall_s": wall,
        "images_per_s": n / wall if wall > 0 else None,
        "cpu_s_per_1k": 1000.0 * cpu / n if n else None,
        "output_bytes": size,
    }


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    result: dict = {"ok": False, "pid": os.getpid(), "python": sys.executable}
    try:
        adapter = _load_adapter(spec["adapter"])
        mode = spec["mode"]
        if mode == "probe":
            result.update(versions=adapter.versions(), workloads=list(adapter.WORKLOADS))
        elif mode == "prepare":
            t0 = time.perf_counter()
            kind = spec.get("kind", spec["workload"])
            extra = adapter.prepare(kind, spec["data"], Path(spec["cache_dir"]))
            result.update(data=extra or {}, prepare_s=time.perf_counter() - t0)
        elif mode in ("run", "memory"):
            result.update(_run(adapter, spec))
        elif mode == "ingest":
            result.update(_ingest(adapter, spec))
        else:
            raise ValueError(f"unknown mode={mode!r}")
        result["ok"] = True
    except BaseException as e:  # reported to the parent, which records why the peer failed
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    out_path.write_text(json.dumps(result, indent=1, default=str))
    sys.stdout.flush()
    # Some peers leave non-daemon threads behind; the result is written, so leave now.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
