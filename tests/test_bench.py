"""Smoke test of the ``kuat bench`` plumbing: torch and kuat only, tiny data, real processes.

No peer is needed and nothing is timed: the assertions are on counts, shapes, the files
written and the arithmetic of the summary.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import report, runner  # noqa: E402


def _imagefolder(root: Path, classes: int = 2, per_class: int = 8) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            h, w = int(rng.integers(40, 90)), int(rng.integers(40, 90))
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
            (root / f"class{c}" / f"{i}.jpg").write_bytes(buf.getvalue())
    return root


def test_quick_bench_torch_and_kuat(tmp_path: Path) -> None:
    images = _imagefolder(tmp_path / "images")
    cfg = runner.BenchConfig(
        out_dir=tmp_path / "out",
        quick=True,
        loaders=("torch", "kuat"),
        workloads=("imagenet-jpeg",),
        runs=1,
        epochs=2,
        num_workers=1,
        image_root=images,
        cache_dir=tmp_path / "cache",
        batch_sizes={"imagenet-jpeg": 4},
        timeout_s=240,
    )
    lines: list[str] = []
    results = runner.run_bench(cfg, lines.append)

    runs = {(r["workload"], r["loader"]): r for r in results["runs"]}
    assert set(runs) == {(w, ld) for w in cfg.workloads for ld in cfg.loaders}, lines
    for (workload, loader), r in runs.items():
        assert r["ok"], (workload, loader, r.get("error"), r.get("traceback"))
        assert [e["samples"] for e in r["epochs"]] == [16, 16]  # 4 full batches of 4 per epoch
        assert r["steady"]["samples"] == 16  # the first epoch is the warm-up, not counted
        assert r["peak_pss_bytes"] >= r["baseline_pss_bytes"] > 0
        assert r["ttfb_s"] is not None and r["ttfb_s"] >= 0
    img = runs[("imagenet-jpeg", "kuat")]["batch_check"]
    assert img["image"] == "Tensor(4, 3, 224, 224):torch.uint8"
    assert img["label"] == "Tensor(4,):torch.int64"

    summary = results["summary"]["imagenet-jpeg"]
    assert summary["torch"]["ratio_to_baseline"] == 1.0
    k, t = summary["kuat"], summary["torch"]
    assert k["ratio_to_baseline"] == pytest.approx(k["rate"] / t["rate"])
    assert set(results["versions"]) == {"torch", "kuat"}

    out = tmp_path / "out"
    assert json.loads((out / "results.json").read_text())["kind"] == "kuat-bench"
    md = (out / "results.md").read_text()
    assert "| torch DataLoader |" in md and "| kuat (threads) |" in md
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_token_windows_kuat_gather_equals_torch_slices(tmp_path: Path) -> None:
    from benchmarks import workloads
    from benchmarks.adapters import kuat as kuat_adapter
    from benchmarks.adapters import torch as torch_adapter

    data = workloads.tokens(tmp_path, num_tokens=5_000, num_windows=12, seed=3)
    args = (data["tokens_path"], data["offsets_path"], data["window"])
    per_sample, gathered = torch_adapter.TokenWindows(*args), kuat_adapter.TokenWindows(*args)
    tokens = np.memmap(data["tokens_path"], dtype=np.uint16, mode="r")
    assert len(per_sample) == len(gathered) == 12
    rows = gathered.__getitems__([11, 0, 5])
    for i, row in zip([11, 0, 5], rows):
        o = int(per_sample.offsets[i])
        assert row["tokens"].dtype == per_sample[i].dtype == torch.int64
        assert row["tokens"].tolist() == per_sample[i].tolist() == tokens[o : o + 1025].tolist()
    assert rows[0]["tokens"].untyped_storage().data_ptr() == (
        rows[2]["tokens"].untyped_storage().data_ptr()
    )  # one buffer for the whole batch


def _run(loader: str, rnd: int, rate: float | None) -> dict:
    ok = rate is not None
    return {
        "loader": loader,
        "workload": "imagenet-jpeg",
        "round": rnd,
        "ok": ok,
        "steady": {"samples_per_s": rate, "cpu_s_per_1k": 2.0},
        "setup_s": 0.1,
        "ttfb_s": 0.2,
        "epochs": [{"wall_s": 1.0}],
        "peak_pss_bytes": 3 * 2**20,
        "baseline_pss_bytes": 2**20,
        "added_pss_bytes": 2 * 2**20,
        **({} if ok else {"error": "ImportError: no peer"}),
    }


def test_summary_uses_per_round_ratios_and_records_failures() -> None:
    runs = [
        _run("torch", 0, 100.0),
        _run("kuat", 0, 300.0),
        _run("ffcv", 0, None),
        _run("torch", 1, 50.0),
        _run("kuat", 1, 200.0),
        _run("ffcv", 1, None),
        _run("torch", 2, 100.0),
        _run("kuat", 2, 250.0),
        _run("ffcv", 2, None),
    ]
    s = runner.summarize(runs, {"imagenet-jpeg": ["torch", "kuat", "ffcv"]})["imagenet-jpeg"]
    assert s["kuat"]["rate"] == 250.0  # median of 300, 200, 250
    assert s["kuat"]["ratio_to_baseline"] == 3.0  # median of 3.0, 4.0, 2.5 (same-round ratios)
    assert s["kuat"]["added_pss_mib"] == 2.0
    assert s["ffcv"]["rate"] is None and s["ffcv"]["errors"] == ["ImportError: no peer"]
    results = {
        "machine": {
            "cpu_count": 2,
            "cpu_model": "Test CPU",
            "memory_gib": 1.0,
            "platform": "linux",
            "python": "3.11",
        },
        "config": {"quick": True, "runs": 3, "epochs": 2, "num_workers": 2, "num_images": 16},
        "started_utc": "2026-01-01T00:00:00+00:00",
        "finished_utc": "2026-01-01T00:01:00+00:00",
        "labels": {"torch": "torch DataLoader"},
        "versions": {"torch": {"torch": "2.14.1"}},
        "unavailable": {"dali": "ModuleNotFoundError: No module named 'nvidia'"},
        "summary": {"imagenet-jpeg": s},
    }
    md = report.markdown(results)
    assert "2 cores, Test CPU" in md and "torch 2.14.1" in md
    assert "| kuat | 250 | 3.00 |" in md
    assert "| dali | ModuleNotFoundError: No module named 'nvidia' |" in md


def test_config_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown loaders"):
        runner.BenchConfig(loaders=("nope",))
    with pytest.raises(ValueError, match="unknown workloads"):
        runner.BenchConfig(workloads=("nope",))
    with pytest.raises(ValueError, match="epochs=1"):
        runner.BenchConfig(epochs=1)


def test_config_paths_are_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # children run in their own working directory, so a relative --out must not reach them
    monkeypatch.chdir(tmp_path)
    cfg = runner.BenchConfig(out_dir=Path("rel-out"), cache_dir=Path("rel-cache"))
    root = tmp_path.resolve()
    assert cfg.out_dir == root / "rel-out" and cfg.cache_dir == root / "rel-cache"


def test_overhead_table_measures_every_row_and_mode():
    from benchmarks import bench_overhead, runner

    assert "overhead" in runner.BenchConfig().workloads
    res = bench_overhead.run(n=256 * 4, rounds=1, warmup=1, batches=2)
    cols = [c[0] for c in bench_overhead.COLUMNS]
    assert [r["row"] for r in res["rows"]][0] == "`range(n)`, shuffle" and len(res["rows"]) == 4
    for row in res["rows"]:
        torch_only_absent = row["row"].startswith("same, `isolate_global_rng=False`")
        for col in cols:
            cell = row["cells"][col]
            if torch_only_absent and col.startswith("torch"):
                assert cell is None
            else:
                assert cell["median_us"] > 0 and len(cell["runs_us"]) == 1
    table = bench_overhead.markdown(res)
    assert table.count("\n| ") == 5 and "kuat, 2 processes" in table
