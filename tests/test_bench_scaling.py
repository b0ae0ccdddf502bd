"""``kuat bench --scaling``'s arithmetic, its py-spy parsing, one real point through the
child protocol, and the docs section generated from the committed ``benchmarks/scaling.json``.

No sweep runs here and nothing is timed: the assertions are on the arithmetic (efficiency
against linear, GIL microseconds per item, medians of per-round ratios), on what the child
and the parent hand each other, and on the files written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import scaling, scaling_report  # noqa: E402


def test_worker_counts_double_up_to_the_cores_and_end_on_them() -> None:
    assert scaling.worker_counts(1) == [1]
    assert scaling.worker_counts(2) == [1, 2]
    assert scaling.worker_counts(6) == [1, 2, 4, 6]
    assert scaling.worker_counts(16) == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="cores=0"):
        scaling.worker_counts(0)


def test_efficiency_against_linear_and_gil_per_item() -> None:
    assert scaling_report.efficiency(300.0, 100.0, 4) == pytest.approx(0.75)
    assert scaling_report.efficiency(100.0, 100.0, 1) == 1.0
    # 5% of wall at 2,500 images/s: 50 ms of GIL per second over 2,500 images = 20 us each
    assert scaling_report.gil_us_per_item(0.05, 2500.0) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="rate"):
        scaling_report.efficiency(1.0, 0.0, 2)
    with pytest.raises(ValueError, match="window_rate"):
        scaling_report.gil_us_per_item(0.1, 0.0)


def test_gil_samples_split_the_main_process_from_its_workers() -> None:
    raw = "\n".join([
        'process 10:"python -m x";<module> (x.py:3);run (x.py:9) 7',
        'process 10:"python -m x";Thread.run (threading.py:982);serve (t.py:5) 5',
        'process 10:"python -m x";process 11:"python -m x";_worker_loop (w.py:1) 4',
        'process 10:"python -m x";process 12:"python -m x";_worker_loop (w.py:1) 2',
        "",
        "not a sample line",
    ])  # fmt: skip
    assert scaling.parse_gil_samples(raw) == (12, 6)


def test_on_cpu_share_reads_this_process_threads() -> None:
    import os

    before = scaling.schedstat(os.getpid())
    x = 0
    for i in range(300_000):  # some CPU time, so that run time grows
        x += i
    after = scaling.schedstat(os.getpid())
    share = scaling.on_cpu_share(before, after)
    assert after[0] > before[0] and share is not None and 0.0 < share <= 1.0
    assert scaling.on_cpu_share((5, 5), (5, 5)) is None
    assert scaling.on_cpu_share((0, 0), (300, 100)) == pytest.approx(0.75)
    assert scaling.schedstat(2**30) == (0, 0)  # no such process


def _rec(loader, n, rnd, rate, gil_fraction=None, loop=False, **kw):
    rec = {"workload": "imagenet-jpeg", "loader": loader, "workers": n, "loop": loop,
           "round": rnd, "ok": True, "rate": rate, "cpu_us_per_item": 900.0}  # fmt: skip
    if gil_fraction is not None:
        rec["gil"] = {"fraction": gil_fraction,
                      "us_per_item": scaling_report.gil_us_per_item(gil_fraction, rate),
                      "workers_fraction": 0.0, "workers_us_per_item": 0.0,
                      "on_cpu_share": 0.5,
                      "us_per_item_on_cpu": 0.5 * scaling_report.gil_us_per_item(gil_fraction,
                                                                                  rate),
                      "window_rate": rate * 0.9, "window_s": 3.0, "instants": 300}  # fmt: skip
    rec.update(kw)
    return rec


def _records() -> list[dict]:
    return [
        # round 0: kuat 100 -> 150 (0.75 of linear); round 1: 200 -> 200 (0.5)
        _rec("kuat", 1, 0, 100.0, 0.01), _rec("kuat", 2, 0, 150.0, 0.03),
        _rec("kuat", 1, 1, 200.0, 0.02), _rec("kuat", 2, 1, 200.0, 0.04),
        _rec("torch", 1, 0, 50.0), _rec("torch", 1, 1, 60.0),
        {"workload": "imagenet-jpeg", "loader": "torch", "workers": 2, "loop": False,
         "round": 0, "ok": False, "error": "RuntimeError: worker died"},
        # the competing loop at 2 workers: 0.8x and 0.5x the same round's rate without it
        _rec("kuat", 2, 0, 120.0, 0.2, loop=True, loop_ms=12.0, loop_alone_ms=10.0),
        _rec("kuat", 2, 1, 100.0, 0.2, loop=True, loop_ms=15.0, loop_alone_ms=10.0),
    ]  # fmt: skip


def test_summary_takes_each_ratio_within_its_round() -> None:
    s = scaling_report.summarize(_records())["imagenet-jpeg"]
    rows = {(r["loader"], r["workers"]): r for r in s["rows"]}
    two = rows[("kuat", 2)]
    assert two["efficiency"]["median"] == pytest.approx(0.625)  # median of 0.75 and 0.5
    assert (two["efficiency"]["min"], two["efficiency"]["max"]) == pytest.approx((0.5, 0.75))
    assert rows[("kuat", 1)]["efficiency"]["median"] == 1.0
    assert two["rate"]["median"] == pytest.approx(175.0)
    # GIL us per item: 0.03 * 1e6 / 150 = 200 and 0.04 * 1e6 / 200 = 200
    assert two["gil_us"]["median"] == pytest.approx(200.0)
    assert two["gil_ceiling"] == pytest.approx(5000.0)
    assert two["gil_us_on_cpu"]["median"] == pytest.approx(100.0)
    assert two["sampled_rate_ratio"]["median"] == pytest.approx(0.9)
    failed = rows[("torch", 2)]
    assert failed["rate"] is None and failed["errors"] == ["RuntimeError: worker died"]
    assert rows[("torch", 1)]["gil_us"] is None  # no GIL window: no GIL number
    (comp,) = s["competing"]
    assert comp["rate_ratio"]["median"] == pytest.approx((120 / 150 + 100 / 200) / 2)
    assert comp["loop_slowdown"]["median"] == pytest.approx(1.35)
    assert comp["workers"] == 2


def test_the_loaders_own_gil_only_where_every_round_has_the_split() -> None:
    """The loader's own GIL (the loop thread's time in the bench's own code taken out) is a
    median over the same rounds as the whole, or absent: a round py-spy read (no phase word)
    would otherwise leave a part larger than the whole. The budget line then judges the
    whole; the wake-up line omits a factor it cannot compute."""
    def split(rec, loader_us):
        rec["gil"].update(loop_us_per_item=1.0, loop_next_us_per_item=0.3,
                          loop_free_us_per_item=0.2, loader_us_per_item=loader_us)
        return rec

    both = [split(_rec("kuat", 1, 0, 100.0, 0.0008), 7.5),
            split(_rec("kuat", 1, 1, 100.0, 0.0009), 8.5)]  # fmt: skip
    row = scaling_report.summarize(both)["imagenet-jpeg"]["rows"][0]
    assert row["loader_gil_us"]["median"] == pytest.approx(8.0) and row["loader_gil_us"]["n"] == 2
    assert "(the loader's own 8.0 (7.5-8.5), over it;" in scaling_report._budget([row])
    mixed = [both[0], _rec("kuat", 1, 1, 100.0, 0.0003)]  # round 1 read by py-spy: 3 us
    row = scaling_report.summarize(mixed)["imagenet-jpeg"]["rows"][0]
    assert row["loader_gil_us"] is None and row["gil_us"]["n"] == 2
    assert "loader's own" not in scaling_report._budget([row])
    assert "5.5 (3.0-8.0) us (over it;" in scaling_report._budget([row])  # by the whole
    probes = {"records": [{"wake_probe": {"after_wait_us": 90.0, "warm_us": 0.0,
                                          "wait_s": 0.03}}]}  # fmt: skip
    line = scaling_report._wake(probes)
    assert "90.0 us right after a 30 ms wait against 0.0 when run again at once:" in line
    assert scaling_report._wake({"records": [{}]}) == ""


def test_the_excess_over_the_floor_is_taken_within_each_round() -> None:
    """kuat's thread workers' GIL over the floor's (benchmarks/gil_floor.py) is their own less
    the floor's in the same round and at the same workers: a slow hour moves both. The floor
    and process workers (whose Python holds other GILs) have none."""
    def own(rec, us):
        rec["gil"].update(loop_us_per_item=1.0, loop_next_us_per_item=0.3,
                          loop_free_us_per_item=0.2, loader_us_per_item=us)
        return rec

    recs = [own(_rec("kuat", 1, 0, 100.0, 0.0008), 8.0), own(_rec("floor", 1, 0, 100.0, 0.0005), 4.0),
            own(_rec("kuat", 1, 1, 100.0, 0.0008), 6.0), own(_rec("floor", 1, 1, 100.0, 0.0005), 3.0),
            own(_rec("kuat", 2, 0, 100.0, 0.0008), 9.0),
            own(_rec("kuat-proc", 1, 0, 100.0, 0.0008), 7.0)]  # fmt: skip
    rows = {(r["loader"], r["workers"]): r
            for r in scaling_report.summarize(recs)["imagenet-jpeg"]["rows"]}  # fmt: skip
    over = rows[("kuat", 1)]["over_floor_gil_us"]
    assert (over["min"], over["max"], over["median"]) == pytest.approx((3.0, 4.0, 3.5))
    assert rows[("floor", 1)]["over_floor_gil_us"] is None
    assert rows[("kuat", 2)]["over_floor_gil_us"] is None  # no floor at 2 workers
    assert rows[("kuat-proc", 1)]["over_floor_gil_us"] is None
    line = scaling_report._budget(list(rows.values()))
    assert "3.5 (3.0-4.0) over the floor)" in line
    assert "held 3.5 (3.0-4.0) us at 1 workers of its own" in line
    # a round whose two records were not read alike (one without the reader's split: py-spy)
    # gives no excess, rather than the whole process's GIL less the floor's own
    mixed = [own(_rec("kuat", 1, 0, 100.0, 0.0008), 8.0), _rec("floor", 1, 0, 100.0, 0.0005)]
    row = scaling_report.summarize(mixed)["imagenet-jpeg"]["rows"][0]
    assert row["loader"] == "kuat" and row["over_floor_gil_us"] is None


def test_the_floor_returns_each_epoch_in_order_and_raises_a_failed_fetch(tmp_path) -> None:
    """benchmarks/gil_floor.py: the batches of a seeded permutation, in order, each what the
    dataset's own batch fetch gives for its indices; a fetch's error in the loop thread."""
    import torch

    import kuat
    import kuat.format as kf
    from benchmarks.gil_floor import Floor

    path = tmp_path / "rows.kuat"
    with kuat.Writer(path, {"x": kf.tensor((3,), "float32"), "label": kf.int64()}) as w:
        w.write_batch({"x": np.arange(300, dtype=np.float32).reshape(100, 3),
                       "label": np.arange(100)})  # fmt: skip
    ds = kuat.open(path)
    floor = Floor(ds, num_workers=2, batch_size=8, seed=3)
    try:
        rng = np.random.default_rng(3)
        for e in range(2):
            perm = rng.permutation(100)
            batches = list(floor.epoch(e))
            assert len(batches) == 12  # drop_last
            for k, b in enumerate(batches):
                want = ds.kuat_fetch_collated(perm[8 * k:8 * k + 8].tolist())
                assert b["label"].tolist() == want["label"].tolist() == perm[8 * k:8 * k + 8].tolist()
                assert torch.equal(b["x"], want["x"])
    finally:
        floor.close()

    class BrokenOnce:  # epoch 0 fails at its first batch; its batches in flight then arrive
        def __init__(self):
            self.broken = True

        def __len__(self):
            return 16

        def kuat_fetch_collated(self, indices):
            if self.broken and indices == first:
                raise ValueError(f"bad rows {indices[:2]}")
            return list(indices)

    first = np.random.default_rng(0).permutation(16)[:2].tolist()
    data = BrokenOnce()
    floor = Floor(data, num_workers=2, batch_size=2)
    try:
        with pytest.raises(ValueError, match="bad rows"):
            next(floor.epoch(0))
        data.broken = False
        rng = np.random.default_rng(0)
        rng.permutation(16)
        perm = rng.permutation(16).tolist()
        # epoch 1 is its own batches only, not epoch 0's that were still in flight
        assert list(floor.epoch(1)) == [perm[i:i + 2] for i in range(0, 16, 2)]
    finally:
        floor.close()


def _result(records: list[dict], counts: list[int], **config) -> dict:
    """A scaling result around ``records`` as :func:`benchmarks.scaling.run_scaling` writes it."""
    return {
        "machine": {"cpu_count": 2, "cpu_model": "Test CPU", "python": "3.11",
                    "load_avg_1min": 0.5},
        "load_avg_1min_end": 0.7, "started_utc": "2026-12-01T00:00:00+00:00",
        "finished_utc": "2026-12-01T00:10:00+00:00",
        "config": {"quick": True, "warmup_s": 1.0, "seconds": 3.0, "gil_seconds": 3.0,
                   **config},
        "worker_counts": counts, "torch_image_loader": "torch-decode-jpeg",
        "units": {"imagenet-jpeg": "images"}, "batch_sizes": {"imagenet-jpeg": 64},
        "records": records,
        "summary": scaling_report.summarize(records),
    }  # fmt: skip


def test_markdown_and_chart_show_every_row(tmp_path: Path) -> None:
    # (a result from before the reader: py-spy, no gil_sampler in its config)
    result = _result(_records(), [1, 2], runs=2, sample_hz=100, loop_ms=10.0)
    md = scaling_report.markdown(result, "img/scaling.png")
    assert "#### imagenet-jpeg: fused RandomResizedCrop(224) + flip, batch 64" in md
    assert "| kuat (threads) | 2 | 175 (150-200) | 0.62 (0.50-0.75) |" in md
    assert "| torch + decode_jpeg (processes) | 2 | failed: RuntimeError: worker died" in md
    assert "py-spy" in md and "![rate against workers](img/scaling.png)" in md
    assert "| kuat (threads) | 2 | 175 (150-200) | 110 (100-120) | 0.65x (0.50-0.80) |" in md
    pytest.importorskip("matplotlib")
    scaling_report.chart(result, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_method_text_states_the_readers_rate_not_a_count_it_did_not_get() -> None:
    records = [_rec("kuat", 1, 0, 1000.0, 0.003, samples=4)]  # 4 held readings: not hundreds
    result = _result(records, [1], runs=1, gil_sampler="reader", sample_hz=1000, loop_ms=0.0)
    md = scaling_report.markdown(result)
    assert "read by kuat's GIL reader" in md and "at 1,000 Hz" in md
    assert "every 1000 us" in md and "every 200 us" not in md
    assert "several hundred" not in md and "about 10x the held readings" in md


def test_config_validates_and_sizes_the_data_to_the_workers() -> None:
    with pytest.raises(ValueError, match="unknown workloads"):
        scaling.ScalingConfig(workloads=("nope",))
    with pytest.raises(ValueError, match="unknown loaders"):
        scaling.ScalingConfig(loaders=("spdl",))
    cfg = scaling.ScalingConfig(quick=True, max_workers=16)
    assert cfg.num_images == 8 * 64 * 16  # 8 batches per worker per epoch at 16 workers
    assert cfg.runs == 2
    big = scaling.ScalingConfig(quick=True, max_workers=2, image_batch=256)  # --batch-size
    assert big.num_images == 8 * 256 * 2 and big.batch_size("imagenet-jpeg") == 256
    assert big.batch_size("tabular") == scaling.BATCH["tabular"]
    with pytest.raises(ValueError, match="image_batch"):
        scaling.ScalingConfig(image_batch=0)


@pytest.mark.parametrize("loader", ["kuat", "floor"])
def test_one_point_through_the_child_protocol(tmp_path: Path, loader: str) -> None:
    """A real child: warm-up, an unsampled rate window, then a GIL window the parent samples
    with kuat's reader and ends through the pipe (kuat's loader, and the floor the bench
    compares it with)."""
    import kuat
    import kuat.format as kf

    path = tmp_path / "rows.kuat"
    rng = np.random.default_rng(0)
    with kuat.Writer(path, {"x": kf.tensor((4,), "float32"), "label": kf.int64()}) as w:
        w.write_batch({"x": rng.standard_normal((4096, 4), np.float32),
                       "label": rng.integers(0, 10, 4096)})  # fmt: skip
    cfg = scaling.ScalingConfig(
        quick=True, seconds=0.3, gil_seconds=1.0, warmup_s=0.2, timeout_s=60.0,
        cache_dir=tmp_path / "cache", out_dir=tmp_path,
    )  # fmt: skip
    spec = {"workload": "tabular", "loader": loader, "num_workers": 1, "batch_size": 256,
            "data": {"path": str(path)}, "warmup_s": 0.2, "seconds": 0.3, "loop_iters": 1000,
            "seed": 0, "round": 0, "gil_window_max_s": 30.0}  # fmt: skip
    res = scaling.run_point(sys.executable, spec, tmp_path, cfg)
    assert res["ok"], res.get("traceback") or res.get("error")
    assert res["rate_window"]["items"] % 256 == 0 and res["rate_window"]["rate"] > 0
    assert res["rate_window"]["loop_ms"] > 0 and res["loop_alone_ms"] > 0
    assert res["gil_window"]["items"] > 0
    rec = scaling_report.record(res, "tabular", loader, 1, True, 0)
    # the default sampler, kuat's GIL reader (no py-spy needed: CI installs none)
    assert "gil" in rec, rec.get("gil_error")
    g = rec["gil"]
    assert g["sampler"] == "reader" and not g["fallback"], g
    assert 0.0 <= g["fraction"] <= 1.0 and g["instants"] >= 50
    assert 0.0 <= g["loop_us_per_item"] <= g["us_per_item"]
    assert g["us_ci95"][0] <= g["us_per_item"] <= g["us_ci95"][1]
    # the loop thread's time told apart by the child's phase word: inside the loader's next()
    # and freeing batches are parts of it; the loader's own is the whole less the rest
    parts = g["loop_next_us_per_item"] + g["loop_free_us_per_item"]
    assert 0.0 <= parts <= g["loop_us_per_item"] + 1e-9
    assert g["loader_us_per_item"] == pytest.approx(
        g["us_per_item"] - g["loop_us_per_item"] + parts)
    # the competing loop (1,000 iterations a batch) is the loop thread's own code: with the
    # GIL held by it often, most of its readings fall outside the loader
    assert g["loop_us_per_item"] > parts
    probe = rec["wake_probe"]
    assert probe["after_wait_us"] > 0 and probe["warm_us"] > 0 and probe["wait_s"] == 0.03


def test_the_reader_falls_back_to_py_spy_and_says_why(tmp_path: Path, monkeypatch) -> None:
    """Where the child found no GIL struct, py-spy at its 100 Hz reads the window, with the
    reason recorded; without py-spy either, the record says why there is no reading.
    ``--gil-sampler py-spy`` never falls back (nothing to fall back from)."""
    cfg = scaling.ScalingConfig(quick=True, out_dir=tmp_path, cache_dir=tmp_path)
    located = tmp_path / "x.gil.json"
    located.write_text("null")  # the child's locate() found no GIL struct
    monkeypatch.setattr(scaling, "pyspy", lambda: None)
    assert "py-spy not installed" in scaling.gil_record(1, 1.0, 100, tmp_path / "p")["error"]
    assert "found no GIL struct" in scaling.sample_gil(1, located, cfg, tmp_path / "p")["error"]
    calls = []
    monkeypatch.setattr(scaling, "pyspy", lambda: "/bin/py-spy")
    monkeypatch.setattr(scaling, "gil_record",
                        lambda pid, s, hz, out: calls.append(hz) or {"main_fraction": 0.1})  # fmt: skip
    gil = scaling.sample_gil(1, tmp_path / "missing.json", cfg, tmp_path / "p")
    assert calls == [100] and "found no GIL struct" in gil["fallback"]
    pyspy_cfg = scaling.ScalingConfig(quick=True, gil_sampler="py-spy", out_dir=tmp_path,
                                      cache_dir=tmp_path)  # fmt: skip
    assert "fallback" not in scaling.sample_gil(1, located, pyspy_cfg, tmp_path / "p")


def test_docs_section_is_generated_from_the_committed_results() -> None:
    """docs/benchmarks.md's Scaling section is what ``python -m benchmarks.scaling_report``
    writes from the committed benchmarks/scaling.json, and the plot it links exists."""
    result = json.loads(scaling_report.RESULTS.read_text())
    text = scaling_report.DOC.read_text()
    assert scaling_report.update(text, scaling_report.section(result)) == text, (
        "stale: run python -m benchmarks.scaling_report"
    )
    assert scaling_report.CHART.is_file()
    assert f"]({'img/' + scaling_report.CHART.name})" in text
    with pytest.raises(ValueError, match="must hold"):
        scaling_report.update("no markers", "body")
