"""Smoke test of the ``kuat bench`` plumbing: the torch baselines and kuat only, tiny data,
real processes; plus the summary's arithmetic, the shared tokens dataset, the memory split and
the README generator.

No peer is needed and nothing is timed: the assertions are on counts, shapes, the files
written, which runs sampled memory, and the arithmetic of the summary.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import headline, measure, readme, report, runner, workloads  # noqa: E402


def _imagefolder(root: Path, classes: int = 2, per_class: int = 8) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            h, w = int(rng.integers(40, 90)), int(rng.integers(40, 90))
            buf = io.BytesIO()
            pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
            image = Image.fromarray(pixels)
            (image.convert("L") if i == 0 else image).save(buf, "JPEG")  # one grayscale
            (root / f"class{c}" / f"{i}.jpg").write_bytes(buf.getvalue())
    return root


def test_warm_page_cache_reads_every_named_file_but_the_cache_root(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "peer").mkdir(parents=True)
    (cache / "peer" / "a.bin").write_bytes(b"x" * 5000)
    (cache / "peer" / "sub").mkdir()
    (cache / "peer" / "sub" / "b.bin").write_bytes(b"y" * 300)
    (cache / "other.bin").write_bytes(b"z" * 7)  # only under the skipped cache root
    tokens = tmp_path / "tokens.npy"
    tokens.write_bytes(b"t" * 1234)
    data = {
        "root": str(cache / "peer"),  # a directory: every file under it
        "tokens_path": str(tokens),  # a file
        "hf_cache": str(cache),  # the cache root a peer names: skipped, not read whole
        "parent": str(tmp_path),  # above the cache root: skipped too
        "missing": str(tmp_path / "nope"),
        "window": 1025,
        "name": "not-a-path",
    }
    assert runner.warm_page_cache(data, skip=cache) == 5000 + 300 + 1234
    assert runner.warm_page_cache({"root": str(cache)}) == 5000 + 300 + 7  # no skip given


def test_bench_rates_without_sampler_memory_apart_and_every_baseline(tmp_path: Path) -> None:
    images = _imagefolder(tmp_path / "images")
    cfg = runner.BenchConfig(
        out_dir=tmp_path / "out",
        quick=True,
        loaders=("torch-decode-jpeg", "torch-w0", "kuat"),
        workloads=("imagenet-jpeg", "tokens"),
        runs=1,
        epochs=2,
        memory_runs=1,
        memory_epochs=1,
        num_workers=1,
        num_tokens=20_000,
        token_windows=64,
        image_root=images,
        cache_dir=tmp_path / "cache",
        batch_sizes={"imagenet-jpeg": 4, "tokens": 8},
        timeout_s=240,
    )
    lines: list[str] = []
    results = runner.run_bench(cfg, lines.append)

    runs = {(r["mode"], r["workload"], r["loader"]): r for r in results["runs"]}
    plan = {"imagenet-jpeg": ("torch-decode-jpeg", "kuat"), "tokens": ("torch-w0", "kuat")}
    want = {(m, w, ld) for m in ("run", "memory") for w, lds in plan.items() for ld in lds}
    assert set(runs) == want, lines
    for (mode, workload, loader), r in runs.items():
        assert r["ok"], (mode, workload, loader, r.get("error"), r.get("traceback"))
        samples = 16 if workload == "imagenet-jpeg" else 64  # full batches per epoch
        if mode == "run":  # timed: nothing sampled memory meanwhile
            assert "peak_pss" not in r and "pss_samples" not in r
            assert [e["samples"] for e in r["epochs"]] == [samples, samples]
            assert r["steady"]["samples"] == samples  # the warm-up epoch is not counted
        else:
            assert [e["samples"] for e in r["epochs"]] == [samples]
            assert r["pss_samples"] >= 1
            assert set(r["added_pss"]) == set(measure.MEMORY_KINDS)
            assert r["peak_pss"]["pss"] >= r["baseline_pss"]["pss"] > 0
    # every run started with the files it reads just read (in the page cache), loaders alike
    folder_bytes = sum(f.stat().st_size for f in images.rglob("*") if f.is_file())
    for (_mode, workload, loader), r in runs.items():
        if workload == "imagenet-jpeg":
            assert r["page_cache_warmed"]["bytes"] >= folder_bytes, (loader, r["page_cache_warmed"])
    img = runs[("run", "imagenet-jpeg", "torch-decode-jpeg")]["batch_check"]
    assert img["image"] == "Tensor(4, 3, 224, 224):torch.uint8"
    # the same dataset for every tokens loader: the same fields, shapes and dtypes
    assert (
        runs[("run", "tokens", "torch-w0")]["batch_check"]
        == runs[("run", "tokens", "kuat")]["batch_check"]
        == {"tokens": "Tensor(8, 1025):torch.int64"}
    )
    roi = results["versions"]["kuat"]["kuat ROI decoder"]
    assert roi.startswith(("built, on ", "built, but no usable", "not built")), roi

    s = results["summary"]
    assert s["imagenet-jpeg"]["baselines"] == ["torch-decode-jpeg"]
    assert s["tokens"]["strongest"] == "torch-w0"
    for workload, base in (("imagenet-jpeg", "torch-decode-jpeg"), ("tokens", "torch-w0")):
        k, t = s[workload]["rows"]["kuat"], s[workload]["rows"][base]
        assert k["ratio_to_strongest"] == pytest.approx(k["rate"] / t["rate"])
        assert k["added_mib"]["pss"] == pytest.approx(
            runs[("memory", workload, "kuat")]["added_pss"]["pss"] / 2**20
        )

    assert results["images"]["source"] == "imagefolder"
    assert results["images"]["images"] == 16 and results["images"]["classes"] == 2
    out = tmp_path / "out"
    assert json.loads((out / "results.json").read_text())["kind"] == "kuat-bench"
    md = (out / "results.md").read_text()
    assert f"the user's ImageFolder `{images.resolve()}`: 16 images" in md
    assert "| torch + decode_jpeg + v2 on tensors |" in md and "| kuat (threads) |" in md
    assert "strongest torch configuration here, torch DataLoader, 0 workers." in md
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_tokens_dataset_gives_torch_and_kuat_the_same_batches(tmp_path: Path) -> None:
    import kuat

    data = workloads.tokens(tmp_path, num_tokens=5_000, num_windows=12, seed=3)
    ds = workloads.TokenWindows(data["tokens_path"], data["offsets_path"], data["window"])
    tokens = np.memmap(data["tokens_path"], dtype=np.uint16, mode="r")
    want = torch.stack(
        [torch.from_numpy(tokens[o : o + 1025].astype(np.int64)) for o in ds.offsets]
    )  # (12, 1025) int64, sliced per sample as nanoGPT reads it
    rows = ds.__getitems__([11, 0, 5])
    assert rows[0]["tokens"].untyped_storage().data_ptr() == (
        rows[2]["tokens"].untyped_storage().data_ptr()
    )  # one (B, T) buffer for the whole batch
    assert torch.equal(ds[4]["tokens"], want[4])
    torch_batches = list(torch.utils.data.DataLoader(ds, batch_size=4))
    kuat_batches = list(kuat.DataLoader(ds, batch_size=4, num_workers=0))
    assert len(torch_batches) == len(kuat_batches) == 3
    for i, (a, b) in enumerate(zip(torch_batches, kuat_batches)):
        assert a["tokens"].dtype == b["tokens"].dtype == torch.int64
        assert torch.equal(a["tokens"], want[4 * i : 4 * i + 4])
        assert torch.equal(b["tokens"], want[4 * i : 4 * i + 4])


def test_torchvision_decode_baseline_matches_pil(tmp_path: Path) -> None:
    from benchmarks.adapters import torch as torch_adapter

    root = _imagefolder(tmp_path / "images", classes=1, per_class=2)
    for path in sorted((root / "class0").iterdir()):  # 0.jpg is grayscale
        got = torch_adapter._tv_decode(str(path))  # (3, H, W) uint8
        with Image.open(path) as im:
            want = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)  # (3, H, W)
        assert got.dtype == torch.uint8 and got.shape == want.shape
        # both are libjpeg-turbo; IDCT/upsampling choices may differ by a grey level or two
        assert (got.int() - want.int()).abs().float().mean() < 2.0


def test_pss_breakdown_splits_anonymous_and_file_backed(tmp_path: Path) -> None:
    pid = os.getpid()
    before = measure.pss_breakdown(pid)
    assert before is not None and before["pss"] > 0
    assert abs(before["anon"] + before["file"] + before["shmem"] - before["pss"]) <= 8 * 1024
    anon = np.ones(64 * 2**20, dtype=np.uint8)  # 64 MiB, every page touched
    path = tmp_path / "blob"
    path.write_bytes(b"\1" * (32 * 2**20))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        checksum = sum(m[i] for i in range(0, len(m), 4096))  # touch every page
        after = measure.pss_breakdown(pid)
    assert checksum == 32 * 2**20 // 4096
    assert after["anon"] - before["anon"] >= 60 * 2**20
    # the 32 MiB mapping counts as file-backed, not anonymous; the bound is loose because PSS
    # splits a shared library's pages between its mappers, so another process loading torch
    # meanwhile lowers this process's file PSS (seen: +26.9 MiB while the suite ran beside
    # another Python)
    assert after["file"] - before["file"] >= 16 * 2**20
    assert after["anon"] - before["anon"] < (64 + 16) * 2**20
    del anon


def test_measure_script_prints_a_commands_peak_by_kind() -> None:
    import subprocess

    code = "import numpy as np, time; a = np.ones(48 * 2**20, np.uint8); time.sleep(0.5)"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.measure", "--", sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    anon = float(out.split("anonymous ")[1].split(",")[0])
    assert out.startswith("peak PSS ") and anon >= 48  # the 48 MiB array, touched


def _run(loader: str, rnd: int, rate: float | None, mode: str = "run", added: int = 0) -> dict:
    ok = rate is not None or mode == "memory"
    r = {
        "loader": loader,
        "workload": "imagenet-jpeg",
        "round": rnd,
        "mode": mode,
        "ok": ok,
        "steady": {"samples_per_s": rate, "cpu_s_per_1k": 2.0},
        "setup_s": 0.1,
        "ttfb_s": 0.2,
        "epochs": [{"wall_s": 1.0}],
        **({} if ok else {"error": "ImportError: no peer"}),
    }
    if mode == "memory":
        mib = 2**20
        r.update(
            baseline_pss={"pss": 100 * mib, "anon": 60 * mib, "file": 40 * mib, "shmem": 0,
                          "shm_system": 5 * mib, "anon_shared": 65 * mib},
            peak_pss={"pss": (100 + added) * mib, "anon": 70 * mib, "file": 90 * mib, "shmem": 0,
                      "shm_system": 9 * mib, "anon_shared": 79 * mib},
            added_pss={"pss": added * mib, "anon": 10 * mib, "file": 50 * mib, "shmem": 0,
                       "shm_system": 4 * mib, "anon_shared": 14 * mib},
        )
    return r


def _results(summary: dict) -> dict:
    return {
        "machine": {
            "cpu_count": 2,
            "cpu_model": "Test CPU",
            "memory_gib": 1.0,
            "platform": "linux",
            "python": "3.11",
            "load_avg_1min": 0.2,
        },
        "load_avg_1min_end": 3.5,
        "config": {
            "quick": False,
            "runs": 3,
            "epochs": 3,
            "num_workers": 2,
            "num_images": 2000,
            "memory_runs": 1,
            "memory_epochs": 2,
            "image_root": None,
        },
        "images": {
            "source": "generated",
            "root": "/cache/imagefolder-v2-n2000-s0",
            "images": 2000,
            "classes": 12,
            "total_mib": 190.0,
            "megapixels": {"mean": 0.15, "p10": 0.11, "median": 0.15, "p90": 0.2},
            "bytes_per_pixel": {"mean": 0.66, "p10": 0.53, "median": 0.64, "p90": 0.82},
            "long_side_px": {"mean": 450, "p10": 409, "median": 450, "p90": 492},
            "grayscale_fraction": 0.01,
        },
        "started_utc": "2026-01-01T00:00:00+00:00",
        "finished_utc": "2026-01-01T00:01:00+00:00",
        "labels": {
            "torch": "torch DataLoader, {workers} workers",
            "torch-decode-jpeg": "torch + decode_jpeg",
            "kuat": "kuat (threads)",
            "decode-only": "full-size decode reference",
        },
        "workload_labels": {"torch": {"imagenet-jpeg": "torch + PIL"}},
        "versions": {"torch": {"torch": "2.14.1"}, "kuat": {"kuat ROI decoder": "built"}},
        "unavailable": {"dali": "ModuleNotFoundError: No module named 'nvidia'"},
        "summary": summary,
    }


def test_summary_ratios_to_every_baseline_with_spread_and_memory_apart() -> None:
    rates = {
        "torch": (100.0, 50.0, 100.0),
        "torch-decode-jpeg": (200.0, 100.0, 250.0),
        "kuat": (300.0, 200.0, 250.0),
        "decode-only": (600.0, 400.0, 500.0),
        "ffcv": (None, None, None),
    }
    runs = [_run(ld, rnd, rs[rnd]) for rnd in range(3) for ld, rs in rates.items()]
    runs += [_run(ld, 0, None, mode="memory", added=5 * (i + 1)) for i, ld in enumerate(rates)]
    plan = {"imagenet-jpeg": list(rates)}
    s = runner.summarize(runs, plan)["imagenet-jpeg"]
    assert s["baselines"] == ["torch", "torch-decode-jpeg"]
    assert s["strongest"] == "torch-decode-jpeg"  # median 200 > 100
    assert s["reference"] == "decode-only"
    k = s["rows"]["kuat"]
    assert (k["rate"], k["rate_min"], k["rate_max"]) == (250.0, 200.0, 300.0)
    # per-round ratios: vs torch 3.0, 4.0, 2.5; vs decode_jpeg 1.5, 2.0, 1.0
    assert k["vs"]["torch"] == {"median": 3.0, "min": 2.5, "max": 4.0}
    assert k["vs"]["torch-decode-jpeg"] == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert k["ratio_to_strongest"] == 1.5
    assert k["vs"]["decode-only"]["median"] == pytest.approx(0.5)
    # memory comes from the memory run only, by kind
    assert k["added_mib"] == {"pss": 15.0, "anon": 10.0, "file": 50.0, "shmem": 0.0,
                              "shm_system": 4.0, "anon_shared": 14.0}
    assert k["memory_runs"] == 1 and k["runs"] == 3
    assert s["rows"]["ffcv"]["rate"] is None
    assert s["rows"]["ffcv"]["errors"] == ["ImportError: no peer"]

    md = report.markdown(_results({"imagenet-jpeg": s}))
    assert "2 cores, Test CPU" in md and "torch 2.14.1" in md
    assert "load average 0.2 at the start, 3.5 at the end on 2 cores (a busy machine" in md
    assert "region (ROI) JPEG decoder: built" in md
    assert "bytes per pixel median 0.64 (p10-p90 0.53-0.82)" in md
    assert "| vs torch + PIL | vs torch + decode_jpeg | vs full-size decode reference |" in md
    assert "| kuat (threads) | 250 (200-300) | 3.00 (2.50-4.00) | 1.50 (1.00-2.00) |" in md
    assert "**kuat (threads): 1.50x (1.00-2.00) the strongest torch configuration here, " in md
    assert "reference, not a limit" in md
    # added MiB: anonymous | shared (system-wide, mapped or not) | anonymous + shared | file
    assert "added anonymous MiB | added shared MiB | added anonymous + shared MiB |" in md
    assert "| 10 | 4 | 14 | 50 |" in md
    assert "| dali | ModuleNotFoundError: No module named 'nvidia' |" in md


def test_results_pages_and_chart_are_generated_from_the_committed_results() -> None:
    """docs/benchmarks.md's full results, the README's summary and the chart are what
    ``python -m benchmarks.readme`` writes from the committed results.json."""
    results = json.loads(readme.RESULTS.read_text())
    for path, text in readme.pages(results).items():
        assert path.read_text() == text, f"{path} is stale: run python -m benchmarks.readme"
    assert readme.stale(results) == [], "run: python -m benchmarks.readme"
    # the README shows the chart it links, and the headline table of the same run
    readme_text = readme.README.read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", readme_text)
    assert links == [readme.CHART.relative_to(REPO).as_posix()]
    assert (REPO / links[0]).is_file()
    assert headline.table(results) in readme_text
    busy = readme.section(_results({}))  # load average 3.5 on 2 cores
    assert "**Provisional numbers:** the machine was busy (1-minute load average up to 3.5" in busy
    assert "**Provisional numbers:** the machine was busy" in readme.summary(_results({}))
    with pytest.raises(ValueError, match="must hold"):
        readme.update("no markers here", "body")


def test_headline_rows_compare_kuat_with_the_strongest_torch_configuration() -> None:
    results = json.loads(readme.RESULTS.read_text())
    rows = {h["workload"]: h for h in headline.headlines(results)}
    assert "ingest" not in rows  # its baseline is kuat itself
    for workload, h in rows.items():
        s = results["summary"][workload]
        assert h["threads"] == s["rows"]["kuat"]["vs"][s["strongest"]]
        assert h["base"] == report.label(results, s["strongest"], workload)
        if h["peer"] is not None:  # the fastest loader that is neither kuat nor a baseline
            peers = [k for k in s["rows"] if not k.startswith("kuat")
                     and k not in s["baselines"] and k != s["reference"]]  # fmt: skip
            fastest = max(peers, key=lambda k: s["rows"][k]["rate"] or 0)
            assert h["peer"] == report.label(results, fastest, workload)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown loaders"):
        runner.BenchConfig(loaders=("nope",))
    with pytest.raises(ValueError, match="unknown workloads"):
        runner.BenchConfig(workloads=("nope",))
    with pytest.raises(ValueError, match="epochs=1"):
        runner.BenchConfig(epochs=1)
    with pytest.raises(ValueError, match="memory_runs=-1"):
        runner.BenchConfig(memory_runs=-1)
    with pytest.raises(ValueError, match="nothing to measure"):
        runner.BenchConfig(runs=0, memory_runs=0)
    assert runner.BenchConfig(runs=0).runs == 0  # memory runs only
    assert runner.BenchConfig(num_workers=0).num_workers == 0  # kept: the main process


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


def test_overlay_environment_extends_the_running_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``mds`` environment is an overlay: no torch of its own, the running interpreter,
    and its folder goes after the interpreter's own packages (nothing is shadowed) once its
    marker says it was set up. The ``mds`` row is the only MDSWriter ingest."""
    from benchmarks import envs
    from benchmarks.adapters import LOADERS

    monkeypatch.setenv("KUAT_BENCH_ENVS", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    r = envs.recipe("mds")
    assert r["base"] == [] and r["overlay"]
    assert "--no-deps" in r["steps"]["mds"]
    assert envs.python_path("mds") == Path(sys.executable)
    assert envs.recipe("streaming")["base"][0].startswith("torch==")  # a venv: the same torch
    assert not envs.use_overlay("mds")  # not set up: nothing added
    site = envs.overlay_dir("mds")
    site.mkdir(parents=True)
    (tmp_path / "mds" / "kuat-bench-env.json").write_text(json.dumps({"status": {}}))
    before = list(sys.path)
    assert envs.use_overlay("mds") and envs.use_overlay("mds")
    assert sys.path == [*before, str(site)]  # appended once, after everything else
    assert LOADERS["mds"]["env"] == "mds" and "ingest" in LOADERS["streaming"]["skip"]
    assert report.INGEST_LABELS["mds"].startswith("Mosaic MDSWriter")


def test_environments_share_the_running_torch_by_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer venv imports this interpreter's very torch and torchvision (same files, same
    version, visible to pip as installed, so ``torch==X`` downloads nothing), and a package the
    venv installs itself comes first on its ``sys.path``."""
    import subprocess

    from benchmarks import envs

    monkeypatch.setenv("KUAT_BENCH_ENVS", str(tmp_path / "envs"))
    shared = envs.shared_dir()
    assert envs.shared_dir() == shared  # created once, then reused
    assert (shared / "torch").resolve() == Path(torch.__file__).parent.resolve()
    for name in ("torch", "torchvision", "numpy"):  # numpy: torchvision's requirement
        from importlib import metadata

        assert any(shared.glob(f"{name}-{metadata.version(name)}.dist-info")), name
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    envs.share_torch(venv)
    probe = (
        "import importlib.metadata as m, json, torch, torchvision; print(json.dumps("
        "[torch.__file__, torch.__version__, torchvision.__version__, m.version('torch')]))"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True
    )
    torch_file, version, tv_version, dist_version = json.loads(out.stdout)
    assert Path(torch_file).resolve() == Path(torch.__file__).resolve()
    assert Path(torch_file).is_relative_to(shared)  # found through the shared folder
    import torchvision

    assert (version, tv_version) == (torch.__version__, torchvision.__version__)
    assert f"torch=={dist_version}" in envs.recipe("peers")["base"]  # the pin pip finds
    shadow = next((venv / "lib").glob("python*/site-packages"))
    (shadow / "numpy").mkdir()  # a package of the venv's own shadows the shared one
    (shadow / "numpy" / "__init__.py").write_text("OWN = True\n")
    own = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import numpy; print(numpy.OWN)"],
        capture_output=True,
        text=True,
    )
    assert own.stdout.strip() == "True", own.stderr


def test_smooth_corpus_keeps_the_crops_and_drops_the_grain(tmp_path: Path) -> None:
    from kuat.demo_data import build_demo_imagefolder, corpus_stats

    grainy = build_demo_imagefolder(tmp_path, num_images=24, progress=False)
    smooth = build_demo_imagefolder(tmp_path, num_images=24, progress=False, grain=False)
    assert smooth != grainy and smooth.name.endswith("-smooth")
    sizes = [
        sorted((f.name, Image.open(f).size) for f in root.glob("*/*.jpg"))
        for root in (grainy, smooth)
    ]
    assert sizes[0] == sizes[1]  # the same files, crops and sizes
    g, s = corpus_stats(grainy), corpus_stats(smooth)
    assert 0.12 < s["bytes_per_pixel"]["median"] < 0.26  # the smooth images: ~0.19
    assert g["bytes_per_pixel"]["median"] > 2 * s["bytes_per_pixel"]["median"]


def test_smooth_and_resized_workloads_compare_the_same_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """smooth-jpeg runs the imagenet-jpeg loaders on the smooth corpus; imagenet-jpeg-256 gives
    torch, torch + decode_jpeg and the full-size decode reference kuat's own resized bytes,
    and torch + PIL the original files."""
    from kuat.format import open_store

    monkeypatch.setenv("KUAT_CACHE", str(tmp_path / "kuat-cache"))  # the generated corpora
    cfg = runner.BenchConfig(
        out_dir=tmp_path / "out",
        quick=True,
        loaders=("torch-originals", "torch-decode-jpeg", "kuat", "decode-only"),
        workloads=("smooth-jpeg", "imagenet-jpeg-256"),
        runs=1,
        epochs=2,
        memory_runs=0,
        num_workers=1,
        num_images=24,
        cache_dir=tmp_path / "cache",
        batch_sizes={"smooth-jpeg": 4, "imagenet-jpeg-256": 4},
        timeout_s=240,
    )
    lines: list[str] = []
    results = runner.run_bench(cfg, lines.append)
    assert not results["unavailable"], results["unavailable"]
    runs = {(r["workload"], r["loader"]): r for r in results["runs"]}
    assert set(runs) == {
        ("smooth-jpeg", "torch-decode-jpeg"),
        ("smooth-jpeg", "kuat"),
        ("smooth-jpeg", "decode-only"),
        ("imagenet-jpeg-256", "torch-originals"),
        ("imagenet-jpeg-256", "torch-decode-jpeg"),
        ("imagenet-jpeg-256", "kuat"),
        ("imagenet-jpeg-256", "decode-only"),
    }, lines
    for key, r in runs.items():
        assert r["ok"], (key, r.get("error"), r.get("traceback"))
        assert r["epochs"][-1]["samples"] == 24, key  # every loader served every image
    smooth = results["workload_images"]["smooth-jpeg"]
    assert smooth["corpus"] == "smooth" and smooth["bytes_per_pixel"]["median"] < 0.3

    def data_of(loader: str) -> dict:  # what the child was given (its spec beside its log)
        log = Path(runs[("imagenet-jpeg-256", loader)]["log"])
        return json.loads(log.with_name(log.stem + ".spec.json").read_text())["data"]

    # imagenet-jpeg-256: the exported files are byte for byte what kuat decodes
    data = data_of("kuat")
    store = open_store(data["kuat_path"])
    stored = store.read_batch(list(range(store.num_rows)), ["image", "label"])
    exported = sorted(Path(data["root"]).glob("*/*.jpg"))
    assert len(exported) == store.num_rows == 24
    classes = sorted(p.name for p in Path(data["original_root"]).iterdir() if p.is_dir())
    resized = 0
    for f in exported:
        i = int(f.stem)
        assert f.read_bytes() == bytes(stored["image"].data[i])
        assert f.parent.name == classes[int(stored["label"][i])]
        assert min(Image.open(f).size) <= workloads.RESIZE_SHORTER
        resized += min(Image.open(f).size) == workloads.RESIZE_SHORTER
    assert resized > 0  # the corpus has images larger than that: the rows differ in files
    for loader in ("torch-decode-jpeg", "decode-only"):
        assert data_of(loader)["root"] == data["root"]  # the same resized files
    assert data_of("torch-originals")["original_root"] == data["original_root"]
    s256 = results["summary"]["imagenet-jpeg-256"]
    assert s256["baselines"] == ["torch-originals", "torch-decode-jpeg"]
    assert s256["reference"] == "decode-only"
    assert set(s256["rows"]["kuat"]["vs"]) == {
        "torch-originals",
        "torch-decode-jpeg",
        "decode-only",
    }
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| torch + PIL (original files) |" in md
    assert "| torch + decode_jpeg + v2 on tensors (same resized files) |" in md
    assert "| full-size decode reference (same resized files, simplejpeg) |" in md
    assert "Images: the generated smooth corpus" in md
    assert "Images: --resize-shorter 256 of the corpus above" in md
