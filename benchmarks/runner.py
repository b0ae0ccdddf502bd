"""Parent side of ``kuat bench``: plan, prepare, run every (loader, workload) in its own
process, interleave rounds, aggregate. The CLI (``kuat.cli.bench``) only parses arguments
and calls :func:`run_bench`.

Method (see docs/benchmarks.md):

- each measurement is a fresh child process running the loader's own interpreter
  (:mod:`benchmarks.worker`), so memory starts clean and one peer's imports or start-method
  changes cannot affect another;
- the parent samples the PSS summed over the child and all its descendants every 50 ms
  (:class:`benchmarks.measure.PeakPssSampler`); "added" memory is that peak minus the
  child's own PSS after imports, before the loader is built;
- rounds are interleaved (round 1: A B C ..., round 2: A B C ...) so machine drift hits
  every loader alike; per-loader results are medians over rounds, and the ratio to torch is
  the median of the per-round ratios (each against torch in the same round).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import envs, measure, workloads
from benchmarks.adapters import LOADERS

REPO_ROOT = Path(__file__).resolve().parent.parent
BASELINE = {
    "imagenet-jpeg": "torch",
    "imagenet-jpeg-256": "torch",
    "tokens": "torch",
    "hf-rows": "torch",
    "ingest": "kuat",
}
DEFAULT_LOADERS = (
    "torch",
    "kuat",
    "kuat-proc",
    "kuat-ray",
    "kuat-ray-2",
    "torchdata-nodes",
    "spdl",
    "dali",
    "ffcv",
    "streaming",
    "litdata",
    "webdataset",
    "hf",
    "decode-only",
)


@dataclasses.dataclass
class BenchConfig:
    """What to run. ``quick`` shrinks the data and rounds and never creates environments."""

    out_dir: Path = Path("bench-results")
    quick: bool = False
    loaders: tuple[str, ...] = DEFAULT_LOADERS
    workloads: tuple[str, ...] = workloads.ALL
    runs: int | None = None  # interleaved rounds; default 3 (quick: 2)
    num_images: int | None = None  # default 2000 (quick: 512)
    epochs: int | None = None  # per run: 1 warm-up + steady; default 3 (quick: 2)
    num_tokens: int = 50_000_000
    token_windows: int | None = None  # samples per tokens epoch; default 65,536 (quick 16,384)
    hf_rows: int | None = None  # default 200,000 (quick 50,000)
    num_workers: int | None = None  # default os.cpu_count()
    setup_envs: bool | None = None  # create missing peer environments; default: not quick
    cache_dir: Path | None = None  # default ~/.cache/kuat/bench
    image_root: Path | None = None  # an existing ImageFolder instead of the demo images
    batch_sizes: dict[str, int] | None = None  # per-workload override of the batch size
    timeout_s: float = 900.0  # per child process
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [n for n in self.loaders if n not in LOADERS]
        if unknown:
            raise ValueError(f"unknown loaders={unknown}; known: {sorted(LOADERS)}")
        bad = [w for w in self.workloads if w not in workloads.ALL]
        if bad:
            raise ValueError(f"unknown workloads={bad}; known: {list(workloads.ALL)}")
        if self.runs is not None and self.runs < 1:
            raise ValueError(f"runs={self.runs} must be >= 1")
        if self.epochs is not None and self.epochs < 2:
            raise ValueError(f"epochs={self.epochs} must be >= 2 (one warm-up, then steady)")
        q = self.quick
        self.runs = self.runs or (2 if q else 3)
        self.num_images = self.num_images or (512 if q else 2000)
        self.epochs = self.epochs or (2 if q else 3)
        self.token_windows = self.token_windows or (16_384 if q else 65_536)
        self.hf_rows = self.hf_rows or (50_000 if q else 200_000)
        self.num_workers = self.num_workers or os.cpu_count() or 1
        self.setup_envs = (not q) if self.setup_envs is None else self.setup_envs
        self.cache_dir = Path(self.cache_dir or Path.home() / ".cache" / "kuat" / "bench").resolve()
        self.out_dir = Path(self.out_dir).resolve()  # children run in another directory
        self.batch_sizes = {**workloads.BATCH_SIZE, **(self.batch_sizes or {})}
        if self.image_root is not None:
            self.image_root = Path(self.image_root).resolve()
            if not self.image_root.is_dir():
                raise ValueError(f"image_root={str(self.image_root)!r} is not a directory")


def machine_info() -> dict:
    """Cores, CPU model, memory, OS and Python of this machine."""
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import psutil

    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_child(
    python: Path, spec: dict, work_dir: Path, timeout_s: float, sample_pss: bool = False
) -> dict:
    """Run ``benchmarks.worker`` under ``python`` with ``spec``; returns its result dict.

    The child gets its own session (so a timeout kills its whole tree), the repository root
    on ``PYTHONPATH`` and ``work_dir`` as working directory; its output goes to
    ``work_dir/<name>.log``. With ``sample_pss`` the result gains ``peak_pss_bytes``.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    name = f"{spec['mode']}-{spec['loader']}-{spec['workload']}-{spec.get('round', 0)}"
    spec_path, out_path = work_dir / f"{name}.spec.json", work_dir / f"{name}.out.json"
    log_path = work_dir / f"{name}.log"
    spec_path.write_text(json.dumps(spec, indent=1))
    out_path.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.setdefault("TQDM_DISABLE", "1")
    with open(log_path, "w") as log:
        t0 = measure.now()
        proc = subprocess.Popen(
            [str(python), "-m", "benchmarks.worker", str(spec_path), str(out_path)],
            cwd=work_dir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        sampler = measure.PeakPssSampler(proc.pid).start() if sample_pss else None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if sampler is not None:
                sampler.stop()
            _kill_tree(proc)  # stray workers a peer left behind
            proc.wait()
        wall = measure.now() - t0
    if rc is None:
        result = {"ok": False, "error": f"timed out after {timeout_s:.0f} s"}
    else:
        try:
            result = json.loads(out_path.read_text())
        except (OSError, ValueError):
            tail = log_path.read_text(errors="replace")[-2000:]
            result = {
                "ok": False,
                "error": f"child exited with status {rc} and no result",
                "log_tail": tail,
            }
    result["process_wall_s"] = wall
    result["log"] = str(log_path)
    if sampler is not None:
        result["peak_pss_bytes"] = sampler.peak_bytes
        result["pss_samples"] = sampler.samples
        base = result.get("baseline_pss_bytes")
        if base is not None and sampler.peak_bytes:
            result["added_pss_bytes"] = sampler.peak_bytes - base
    return result


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _metric(run: dict, workload: str) -> float | None:
    if workload == "ingest":
        return run.get("images_per_s")
    return (run.get("steady") or {}).get("samples_per_s")


def summarize(runs: list[dict], plan: dict[str, list[str]]) -> dict:
    """Medians per (workload, loader) and the median per-round ratio to the baseline."""
    out: dict[str, dict] = {}
    for workload, loaders in plan.items():
        rows: dict[str, dict] = {}
        base = BASELINE[workload]
        by_round: dict[int, dict[str, dict]] = {}
        for r in runs:
            if r["workload"] == workload:
                by_round.setdefault(r["round"], {})[r["loader"]] = r
        for loader in loaders:
            mine = [r for r in runs if r["workload"] == workload and r["loader"] == loader]
            ok = [r for r in mine if r.get("ok")]
            ratios = []
            for rnd in by_round.values():
                a, b = rnd.get(loader), rnd.get(base)
                if a and b and a.get("ok") and b.get("ok"):
                    ma, mb = _metric(a, workload), _metric(b, workload)
                    if ma and mb:
                        ratios.append(ma / mb)
            row = {
                "runs": len(mine),
                "ok_runs": len(ok),
                "rate": _median([_metric(r, workload) for r in ok]),
                "ratio_to_baseline": _median(ratios),
                "baseline": base,
                "cpu_s_per_1k": _median([(r.get("steady") or r).get("cpu_s_per_1k") for r in ok]),
            }
            if workload != "ingest":
                row.update(
                    setup_s=_median([r.get("setup_s") for r in ok]),
                    ttfb_s=_median([r.get("ttfb_s") for r in ok]),
                    first_epoch_s=_median([(r.get("epochs") or [{}])[0].get("wall_s") for r in ok]),
                    peak_pss_mib=_median([r.get("peak_pss_bytes", 0) / 2**20 for r in ok]),
                    added_pss_mib=_median([r.get("added_pss_bytes", 0) / 2**20 for r in ok]),
                    baseline_pss_mib=_median([r.get("baseline_pss_bytes", 0) / 2**20 for r in ok]),
                )
            else:
                row["output_mib"] = _median([r.get("output_bytes", 0) / 2**20 for r in ok])
            errors = sorted({r.get("error", "") for r in mine if not r.get("ok")})
            if errors:
                row["errors"] = errors
            rows[loader] = row
        out[workload] = rows
    return out


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Run the benchmark described by ``cfg``; write ``results.json``, ``results.md`` and
    ``results.png`` into ``cfg.out_dir`` and return the results dict.

    ``progress`` receives one human-readable line per step (the CLI prints them).
    Peers that cannot be set up or fail are recorded with the error, never given a number.
    """
    from benchmarks import report

    started = datetime.now(timezone.utc)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    cfg.cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kuat-bench-"))
    (cfg.out_dir / "runs.jsonl").unlink(missing_ok=True)
    logs = cfg.out_dir / "logs"
    logs.mkdir(exist_ok=True)
    unavailable: dict[str, str] = {}
    versions: dict[str, dict] = {}

    # 1. Interpreters: the running one for "main", the peer environments otherwise.
    pythons: dict[str, Path] = {}
    announced: set[str] = set()
    for loader in cfg.loaders:
        env = LOADERS[loader]["env"]
        if env == "main":
            pythons[loader] = Path(sys.executable)
            continue
        try:
            if env not in announced:
                announced.add(env)
                progress(f"environment {env}: {'creating or ' if cfg.setup_envs else ''}reusing")
            pythons[loader] = envs.ensure(
                env, create=cfg.setup_envs, log_path=logs / f"env-{env}.log"
            )
        except envs.EnvUnavailable as e:
            unavailable[loader] = str(e)

    # 2. Probe: import each loader in its interpreter, record versions or why it fails.
    import importlib

    plan: dict[str, list[str]] = {w: [] for w in cfg.workloads}
    for loader in cfg.loaders:
        if loader in unavailable:
            progress(f"skip {loader}: {unavailable[loader]}")
            continue
        if LOADERS[loader]["env"] == "main":
            res = _probe_here(loader)  # same interpreter: no need for a process
        else:
            spec = _spec(cfg, loader, "-", "probe")
            res = run_child(pythons[loader], spec, logs, timeout_s=300)
        if not res.get("ok"):
            env_err = (
                envs.step_error(LOADERS[loader]["env"])
                if LOADERS[loader]["env"] != "main"
                else None
            )
            unavailable[loader] = res.get("error", "?") + (f" [{env_err}]" if env_err else "")
            progress(f"skip {loader}: {unavailable[loader]}")
            continue
        versions[loader] = res["versions"]
        supported = importlib.import_module(
            f"benchmarks.adapters.{LOADERS[loader]['adapter']}"
        ).WORKLOADS
        for w in cfg.workloads:
            if w in supported and w not in LOADERS[loader].get("skip", ()):
                plan[w].append(loader)
        progress(f"{loader}: {res['versions']}")

    # 3. Data.
    data: dict[str, dict] = {}
    for w in cfg.workloads:
        if not plan[w]:
            continue
        try:
            if w in workloads.IMAGE_WORKLOADS:
                if cfg.image_root is not None:
                    data[w] = {"root": str(cfg.image_root)}
                else:
                    progress(f"data for {w}: demo ImageFolder of {cfg.num_images} JPEGs")
                    data[w] = workloads.imagenet_jpeg(cfg.num_images, progress=False)
            elif w == "tokens":
                progress(f"data for tokens: {cfg.num_tokens:,} uint16 tokens")
                data[w] = workloads.tokens(
                    cfg.cache_dir, cfg.num_tokens, cfg.token_windows, cfg.seed
                )
            elif w == "hf-rows":
                progress(f"data for hf-rows: {cfg.hf_rows:,} rows")
                data[w] = workloads.hf_rows(cfg.cache_dir, cfg.hf_rows)
        except Exception as e:  # a workload whose data cannot be made is reported, not run
            unavailable[f"workload:{w}"] = f"{type(e).__name__}: {e}"
            progress(f"skip workload {w}: {type(e).__name__}: {e}")
            plan[w] = []

    # 4. Per-peer preparation (conversion into the peer's format), cached, timed once.
    prepare_s: dict[str, dict[str, float]] = {}
    for w, loaders in plan.items():
        if w == "ingest":
            continue
        for loader in list(loaders):
            adapter = importlib.import_module(f"benchmarks.adapters.{LOADERS[loader]['adapter']}")
            if w not in getattr(adapter, "PREPARE", ()):
                continue
            progress(f"prepare {loader} for {w}")
            if LOADERS[loader]["env"] == "main":  # same interpreter: convert right here
                res = _prepare_here(adapter, w, data[w], cfg.cache_dir)
            else:
                spec = _spec(cfg, loader, w, "prepare", data[w])
                res = run_child(pythons[loader], spec, logs, cfg.timeout_s)
            if not res.get("ok"):
                unavailable[f"{loader}:{w}"] = res.get("error", "?")
                progress(f"skip {loader} on {w}: prepare failed: {res.get('error')}")
                loaders.remove(loader)
                continue
            prepare_s.setdefault(w, {})[loader] = res["prepare_s"]
            data.setdefault(f"{w}:{loader}", {}).update(res.get("data") or {})

    # 5. Rounds, interleaved.
    runs: list[dict] = []
    total = cfg.runs * sum(len(v) for v in plan.values())
    done = 0
    for rnd in range(cfg.runs):
        for w, loaders in plan.items():
            for loader in loaders:
                done += 1
                wdata = {**data[w], **data.get(f"{w}:{loader}", {})}
                if w == "ingest":
                    out_dir = work / f"ingest-{loader}-{rnd}"
                    spec = _spec(cfg, loader, w, "ingest", wdata, rnd, out_dir=str(out_dir))
                    res = run_child(pythons[loader], spec, logs, cfg.timeout_s)
                    shutil.rmtree(out_dir, ignore_errors=True)
                else:
                    spec = _spec(cfg, loader, w, "run", wdata, rnd)
                    res = run_child(pythons[loader], spec, logs, cfg.timeout_s, sample_pss=True)
                res.update(loader=loader, workload=w, round=rnd)
                runs.append(res)
                with open(cfg.out_dir / "runs.jsonl", "a") as f:  # survives an interrupted run
                    f.write(json.dumps(res, default=str) + "\n")
                progress(
                    f"[{done}/{total}] round {rnd + 1}/{cfg.runs} {w:<17} {loader:<16} "
                    + _one_line(res, w)
                )
    shutil.rmtree(work, ignore_errors=True)

    results = {
        "kind": "kuat-bench",
        "version": 1,
        "started_utc": started.isoformat(timespec="seconds"),
        "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()
        },
        "labels": {k: v["label"] for k, v in LOADERS.items()},
        "versions": versions,
        "unavailable": unavailable,
        "prepare_s": prepare_s,
        "summary": summarize(runs, plan),
        "runs": runs,
    }
    (cfg.out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (cfg.out_dir / "results.md").write_text(report.markdown(results))
    try:
        report.chart(results, cfg.out_dir / "results.png")
    except ImportError as e:  # matplotlib missing: the JSON and table still stand
        progress(f"no chart: {e}")
    return results


def _probe_here(loader: str) -> dict:
    """Import a main-environment adapter's peer in this process; the worker's probe result."""
    import importlib
    import traceback

    try:
        adapter = importlib.import_module(f"benchmarks.adapters.{LOADERS[loader]['adapter']}")
        return {"ok": True, "versions": adapter.versions()}
    except Exception as e:  # recorded as the reason the loader is not measured
        return {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }


def _prepare_here(adapter, workload: str, data: dict, cache_dir: Path) -> dict:
    """Run a main-environment adapter's ``prepare`` in this process; the worker's result."""
    import traceback

    t0 = measure.now()
    try:
        extra = adapter.prepare(workload, data, cache_dir)
    except Exception as e:  # recorded as the reason the loader is not measured on workload
        return {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }
    return {"ok": True, "data": extra or {}, "prepare_s": measure.now() - t0}


def _spec(
    cfg: BenchConfig,
    loader: str,
    workload: str,
    mode: str,
    data: dict | None = None,
    rnd: int = 0,
    **extra,
) -> dict:
    info = LOADERS[loader]
    return {
        "mode": mode,
        "loader": loader,
        "adapter": info["adapter"],
        "options": info.get("options", {}),
        "workload": workload,
        "data": data or {},
        "batch_size": cfg.batch_sizes.get(workload, 0),
        "num_workers": cfg.num_workers,
        "epochs": cfg.epochs,
        "seed": cfg.seed,
        "cache_dir": str(cfg.cache_dir),
        "round": rnd,
        **extra,
    }


def _one_line(res: dict, workload: str) -> str:
    if not res.get("ok"):
        return f"FAILED: {res.get('error')}"
    if workload == "ingest":
        return f"{res['images_per_s']:.0f} img/s"
    s = res["steady"]
    return (
        f"{s['samples_per_s']:.0f} samples/s, ttfb {res['ttfb_s']:.2f} s, "
        f"peak {res.get('peak_pss_bytes', 0) / 2**20:.0f} MiB "
        f"(+{res.get('added_pss_bytes', 0) / 2**20:.0f})"
    )
