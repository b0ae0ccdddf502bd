"""Parent side of ``kuat bench``: plan, prepare, run every (loader, workload) in its own
process, interleave rounds, aggregate. The CLI (``kuat.cli.bench``) only parses arguments
and calls :func:`run_bench`.

Method (see docs/benchmarks.md):

- each measurement is a fresh child process running the loader's own interpreter
  (:mod:`benchmarks.worker`), so memory starts clean and one peer's imports or start-method
  changes cannot affect another;
- every run starts with the files it reads in the page cache (:func:`warm_page_cache`, right
  before the child starts, for every loader alike, after one ``sync`` once the data is
  prepared): the time to the first batch then measures the loader, not which of its files
  the kernel happened to have evicted (with a cold page cache, kuat's first batch took
  0.3-1.7 s instead of 0.05 s before its gathers asked for their rows' pages at once, and
  still takes 0.1-0.2 s; ``benchmarks/first_batch.py --conditions cold``);
- rates come from runs that nothing else measures: no memory sampler runs while a loader
  is timed (sampling PSS over a process tree costs a quarter to half of a core);
- memory comes from runs of its own (``memory_runs`` per loader and workload, after the rate
  rounds, ``memory_epochs`` epochs each): the parent samples the PSS summed over the child
  and all its descendants every 50 ms (:class:`benchmarks.measure.PeakPssSampler`), by kind
  (anonymous, file-backed, shared memory); "added" memory is each kind's peak minus the
  child's own PSS of that kind after imports, before the loader is built;
- rounds are interleaved (round 1: A B C ..., round 2: A B C ...) so machine drift hits
  every loader alike; per-loader results are medians over rounds with the min-max next to
  them, and a ratio to a baseline is the median of the per-round ratios (each against that
  baseline in the same round);
- every workload has one or more baselines (:data:`BASELINES`: torch + PIL and torch +
  ``decode_jpeg`` for images, torch with all workers and with none for tokens); each ratio
  names its baseline and the headline ratio is against the strongest (highest median rate).
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
from benchmarks.workloads import TABLE_WORKLOADS

REPO_ROOT = Path(__file__).resolve().parent.parent
# workload -> the configurations every other loader is compared with; the first is the stock
# one, and the headline ratio is against whichever has the highest median rate in the run
BASELINES = {
    "imagenet-jpeg": ("torch", "torch-decode-jpeg"),
    "smooth-jpeg": ("torch", "torch-decode-jpeg"),
    # torch + PIL on the original files (what a user of torch reads without converting), then
    # torch + PIL and torch + decode_jpeg on the same resized files kuat decodes
    "imagenet-jpeg-256": ("torch-originals", "torch", "torch-decode-jpeg"),
    "tokens": ("torch", "torch-w0"),
    "hf-rows": ("torch", "torch-w0"),
    "ingest": ("kuat",),
}
# workload -> a row reported as a reference point, not a loader and not a limit
REFERENCE = {
    "imagenet-jpeg": "decode-only",
    "smooth-jpeg": "decode-only",
    "imagenet-jpeg-256": "decode-only",  # the same resized files, decoded at full size
}
# workload -> the only loaders that run it (others: every loader that supports it). The smooth
# corpus measures the smooth-image target: the torch baselines, kuat, the full-size
# decode reference and LitData (the strongest peer in the smooth-image measurement),
# not every peer again, which would add about as much time as imagenet-jpeg itself takes.
ONLY = {
    "smooth-jpeg": ("torch", "torch-decode-jpeg", "kuat", "kuat-proc", "decode-only", "litdata")
}
# workloads without memory runs: ingest (a writer, not a loader) and smooth-jpeg (the same
# loaders and buffers as imagenet-jpeg, whose memory runs already measure them)
NO_MEMORY_RUNS = ("ingest", "smooth-jpeg")
DEFAULT_LOADERS = (
    "torch",
    "torch-decode-jpeg",
    "torch-w0",
    "torch-originals",
    "kuat",
    "kuat-proc",
    "kuat-ray",
    "kuat-ray-2",
    "torchdata-nodes",
    "spdl",
    "dali",
    "ffcv",
    "streaming",
    "mds",
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
    workloads: tuple[str, ...] = workloads.ALL + tuple(TABLE_WORKLOADS)
    runs: int | None = None  # interleaved timed rounds; default 3 (quick: 2); 0: memory only
    num_images: int | None = None  # default 2000 (quick: 512)
    epochs: int | None = None  # per run: 1 warm-up + steady; default 3 (quick: 2)
    memory_runs: int = 1  # separate memory-sampled runs per (loader, workload); 0: none
    memory_epochs: int = 2  # epochs per memory run
    num_tokens: int = 50_000_000
    token_windows: int | None = None  # samples per tokens epoch; default 65,536 (quick 16,384)
    hf_rows: int | None = None  # default 200,000 (quick 50,000)
    num_workers: int | None = None  # default os.cpu_count()
    setup_envs: bool | None = None  # create missing peer environments; default: not quick
    cache_dir: Path | None = None  # default kuat._dirs.cache_root() / "bench"
    image_root: Path | None = None  # an existing ImageFolder instead of the demo images
    batch_sizes: dict[str, int] | None = None  # per-workload override of the batch size
    timeout_s: float = 900.0  # per child process
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [n for n in self.loaders if n not in LOADERS]
        if unknown:
            raise ValueError(f"unknown loaders={unknown}; known: {sorted(LOADERS)}")
        known = list(workloads.ALL) + list(TABLE_WORKLOADS)
        bad = [w for w in self.workloads if w not in known]
        if bad:
            raise ValueError(f"unknown workloads={bad}; known: {known}")
        if self.runs is not None and self.runs < 0:
            raise ValueError(f"runs={self.runs} must be >= 0 (0: memory runs only)")
        if self.epochs is not None and self.epochs < 2:
            raise ValueError(f"epochs={self.epochs} must be >= 2 (one warm-up, then steady)")
        if self.memory_runs < 0 or self.memory_epochs < 1:
            raise ValueError(
                f"memory_runs={self.memory_runs} must be >= 0 and "
                f"memory_epochs={self.memory_epochs} >= 1"
            )
        if self.runs == 0 and self.memory_runs == 0:
            raise ValueError("runs=0 and memory_runs=0: nothing to measure")
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"num_workers={self.num_workers} must be >= 0")
        q = self.quick
        if self.runs is None:
            self.runs = 2 if q else 3
        self.num_images = self.num_images or (512 if q else 2000)
        self.epochs = self.epochs or (2 if q else 3)
        self.token_windows = self.token_windows or (16_384 if q else 65_536)
        self.hf_rows = self.hf_rows or (50_000 if q else 200_000)
        if self.num_workers is None:
            self.num_workers = os.cpu_count() or 1
        self.setup_envs = (not q) if self.setup_envs is None else self.setup_envs
        if self.cache_dir is None:
            from kuat._dirs import cache_root

            self.cache_dir = cache_root() / "bench"
        self.cache_dir = Path(self.cache_dir).resolve()
        self.out_dir = Path(self.out_dir).resolve()  # children run in another directory
        self.batch_sizes = {**workloads.BATCH_SIZE, **(self.batch_sizes or {})}
        if self.image_root is not None:
            self.image_root = Path(self.image_root).resolve()
            if not self.image_root.is_dir():
                raise ValueError(f"image_root={str(self.image_root)!r} is not a directory")


def machine_info() -> dict:
    """Cores, CPU model, memory, OS, Python and the 1-minute load average of this machine."""
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
        "load_avg_1min": os.getloadavg()[0],
    }


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def child_env() -> dict[str, str]:
    """The environment of a measured child: this one, with the repository root first on
    ``PYTHONPATH`` (absolute entries: the child runs in another directory, where a relative
    ``PYTHONPATH=src`` would miss the checkout and import whatever kuat the interpreter has
    installed instead) and progress bars off."""
    env = dict(os.environ)
    inherited = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *inherited])
    env.setdefault("TQDM_DISABLE", "1")
    return env


def run_child(
    python: Path, spec: dict, work_dir: Path, timeout_s: float, sample_pss: bool = False
) -> dict:
    """Run ``benchmarks.worker`` under ``python`` with ``spec``; returns its result dict.

    The child gets its own session (so a timeout kills its whole tree), the repository root
    on ``PYTHONPATH`` and ``work_dir`` as working directory; its output goes to
    ``work_dir/<name>.log``. With ``sample_pss`` the parent samples the PSS of the child's
    process tree meanwhile, and the result gains ``peak_pss`` and ``added_pss`` (bytes by kind:
    ``pss``, ``anon``, ``file``, ``shmem``) and ``pss_samples``; never use it in a timed run.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    name = f"{spec['mode']}-{spec['loader']}-{spec['workload']}-{spec.get('round', 0)}"
    spec_path, out_path = work_dir / f"{name}.spec.json", work_dir / f"{name}.out.json"
    log_path = work_dir / f"{name}.log"
    spec_path.write_text(json.dumps(spec, indent=1))
    out_path.unlink(missing_ok=True)
    env = child_env()
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
        # the child's own readings (after imports, after the last epoch) count as samples too
        readings = [r for r in (result.get("baseline_pss"), result.get("end_pss")) if r]
        peak = {k: max([sampler.peak[k], *(r[k] for r in readings)]) for k in measure.MEMORY_KINDS}
        result["peak_pss"] = peak
        result["pss_samples"] = sampler.samples
        base = result.get("baseline_pss")
        if base is not None:
            result["added_pss"] = {k: peak[k] - base[k] for k in measure.MEMORY_KINDS}
    return result


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _metric(run: dict, workload: str) -> float | None:
    if workload == "ingest":
        return run.get("images_per_s")
    return (run.get("steady") or {}).get("samples_per_s")


def _spread(values: list) -> dict | None:
    """``{"median", "min", "max"}`` of the values that are not None; None if there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _memory(mem_runs: list[dict]) -> dict:
    """Median peak and added PSS (MiB, by kind) over the memory runs that succeeded."""
    ok = [r for r in mem_runs if r.get("ok") and r.get("added_pss")]
    out: dict = {"memory_runs": len(mem_runs), "memory_ok_runs": len(ok)}
    if ok:
        out["peak_pss_mib"] = _median([r["peak_pss"]["pss"] / 2**20 for r in ok])
        out["baseline_pss_mib"] = _median([r["baseline_pss"]["pss"] / 2**20 for r in ok])
        out["added_mib"] = {
            # kinds a run lacks (results of an older harness) stay None
            k: _median([r["added_pss"][k] / 2**20 if k in r["added_pss"] else None for r in ok])
            for k in measure.MEMORY_KINDS
        }
    errors = sorted({r.get("error", "") for r in mem_runs if not r.get("ok")})
    if errors:
        out["memory_errors"] = errors
    return out


def summarize(runs: list[dict], plan: dict[str, list[str]]) -> dict:
    """Per workload: the baselines measured, the strongest of them, and per loader the median
    rate with its min-max over rounds, the per-round ratio to each baseline (median, min, max)
    and the memory of its separate memory runs.

    Returns ``{workload: {"baselines": [...], "strongest": name | None, "reference": name |
    None, "rows": {loader: row}}}``. Runs carry ``mode``: ``run``/``ingest`` runs give rates,
    ``memory`` runs give memory only.
    """
    out: dict[str, dict] = {}
    for workload, loaders in plan.items():
        timed = [r for r in runs if r["workload"] == workload and r.get("mode", "run") != "memory"]
        by_round: dict[int, dict[str, dict]] = {}
        for r in timed:
            by_round.setdefault(r["round"], {})[r["loader"]] = r
        rows: dict[str, dict] = {}
        for loader in loaders:
            mine = [r for r in timed if r["loader"] == loader]
            ok = [r for r in mine if r.get("ok")]
            rate = _spread([_metric(r, workload) for r in ok])
            row = {
                "runs": len(mine),
                "ok_runs": len(ok),
                "rate": rate and rate["median"],
                "rate_min": rate and rate["min"],
                "rate_max": rate and rate["max"],
                "cpu_s_per_1k": _median([(r.get("steady") or r).get("cpu_s_per_1k") for r in ok]),
                "vs": {},
            }
            ref = REFERENCE.get(workload)
            for base in (*BASELINES[workload], *([ref] if ref else [])):
                ratios = []
                for rnd in by_round.values():
                    a, b = rnd.get(loader), rnd.get(base)
                    if a and b and a.get("ok") and b.get("ok"):
                        ma, mb = _metric(a, workload), _metric(b, workload)
                        if ma and mb:
                            ratios.append(ma / mb)
                spread = _spread(ratios)
                if spread is not None:
                    row["vs"][base] = spread
            if workload != "ingest":
                row.update(
                    setup_s=_median([r.get("setup_s") for r in ok]),
                    ttfb_s=_median([r.get("ttfb_s") for r in ok]),
                    first_epoch_s=_median([(r.get("epochs") or [{}])[0].get("wall_s") for r in ok]),
                )
                row.update(
                    _memory(
                        [
                            r
                            for r in runs
                            if r["workload"] == workload
                            and r["loader"] == loader
                            and r.get("mode") == "memory"
                        ]
                    )
                )
            else:
                row["output_mib"] = _median([r.get("output_bytes", 0) / 2**20 for r in ok])
            errors = sorted({r.get("error", "") for r in mine if not r.get("ok")})
            if errors:
                row["errors"] = errors
            rows[loader] = row
        measured = [b for b in BASELINES[workload] if rows.get(b, {}).get("rate")]
        strongest = max(measured, key=lambda b: rows[b]["rate"]) if measured else None
        for row in rows.values():
            row["ratio_to_strongest"] = (row["vs"].get(strongest) or {}).get("median")
        ref = REFERENCE.get(workload)
        out[workload] = {
            "baselines": measured,
            "strongest": strongest,
            "reference": ref if ref in rows else None,
            "rows": rows,
        }
    return out


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Run the benchmark described by ``cfg``; write ``results.json``, ``results.md`` and
    ``results.png`` into ``cfg.out_dir`` and return the results dict.

    ``progress`` receives one human-readable line per step (the CLI prints them).
    Peers that cannot be set up or fail are recorded with the error, never given a number.
    """
    from benchmarks import report

    started = datetime.now(timezone.utc)
    machine = machine_info()  # load average before the first measurement
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
    # table workloads alone (overhead, remote) measure in this process: no peer is needed
    run_loaders = () if all(w in TABLE_WORKLOADS for w in cfg.workloads) else cfg.loaders
    for loader in run_loaders:
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

    plan: dict[str, list[str]] = {w: [] for w in cfg.workloads if w not in TABLE_WORKLOADS}
    for loader in run_loaders:
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
        for w in plan:
            if (
                workloads.kind(w) in supported
                and w not in LOADERS[loader].get("skip", ())
                and loader in ONLY.get(w, (loader,))
            ):
                plan[w].append(loader)
        progress(f"{loader}: {res['versions']}")

    # 3. Data.
    data: dict[str, dict] = {}
    image_data: dict | None = None  # the main corpus (imagenet-jpeg, ingest)
    workload_images: dict[str, dict] = {}  # workloads that read other files: their statistics
    for w in plan:
        if not plan[w]:
            continue
        try:
            if w == "smooth-jpeg":
                if cfg.image_root is not None:
                    raise ValueError(
                        "smooth-jpeg measures a generated corpus; with --imagefolder the image "
                        "workloads read the user's files instead"
                    )
                progress(f"data for {w}: smooth ImageFolder of {cfg.num_images} JPEGs")
                data[w] = workloads.smooth_jpeg(cfg.num_images, progress=False)
                workload_images[w] = workloads.image_stats(data[w]["root"], True, "smooth")
                progress(f"images for {w}: " + report.describe_images(workload_images[w]))
            elif w in workloads.IMAGE_WORKLOADS:
                if cfg.image_root is not None:
                    data[w] = {"root": str(cfg.image_root)}
                else:
                    progress(f"data for {w}: ImageNet-like ImageFolder of {cfg.num_images} JPEGs")
                    data[w] = workloads.imagenet_jpeg(cfg.num_images, progress=False)
                if image_data is None:
                    image_data = workloads.image_stats(
                        data[w]["root"], generated=cfg.image_root is None
                    )
                    progress("images: " + report.describe_images(image_data))
                if w == "imagenet-jpeg-256":  # every loader but torch-originals: kuat's bytes
                    progress(f"data for {w}: kuat --resize-shorter 256, exported as files")
                    data[w] = workloads.resized_imagefolder(data[w]["root"], cfg.cache_dir)
                    workload_images[w] = workloads.image_stats(
                        data[w]["root"],
                        cfg.image_root is None,
                        f"--resize-shorter {workloads.RESIZE_SHORTER} of the corpus above",
                    )
                    progress(f"images for {w}: " + report.describe_images(workload_images[w]))
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
            if workloads.kind(w) not in getattr(adapter, "PREPARE", ()):
                continue
            progress(f"prepare {loader} for {w}")
            if LOADERS[loader]["env"] == "main":  # same interpreter: convert right here
                res = _prepare_here(adapter, workloads.kind(w), data[w], cfg.cache_dir)
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

    # 5a. Workloads with their own table, measured in this process (before the peers' runs).
    tables: dict[str, dict] = {}
    for w in cfg.workloads:
        if w in TABLE_WORKLOADS and cfg.runs:
            module = importlib.import_module(f"benchmarks.{TABLE_WORKLOADS[w]}")
            try:
                tables[w] = module.run_for_bench(cfg.quick, cfg.runs, progress)
            except Exception as e:  # moto or s3fs missing, a server that did not start: the
                # table is reported as not measured, as a workload whose data cannot be made is
                unavailable[f"workload:{w}"] = f"{type(e).__name__}: {e}"
                progress(f"skip workload {w}: {type(e).__name__}: {e}")

    # 5. Rate rounds, interleaved, nothing sampling memory; then the memory runs.
    schedule = [
        (mode, rnd, w, loader)
        for mode, rounds in (("run", cfg.runs), ("memory", cfg.memory_runs))
        for rnd in range(rounds)
        for w, loaders in plan.items()
        for loader in loaders
        if not (mode == "memory" and w in NO_MEMORY_RUNS)
    ]
    os.sync()  # the prepared data written back before any timed run, not during one
    runs: list[dict] = []
    for done, (mode, rnd, w, loader) in enumerate(schedule, 1):
        wdata = {**data[w], **data.get(f"{w}:{loader}", {})}
        t_warm = measure.now()
        warmed = warm_page_cache(wdata, skip=cfg.cache_dir)
        warm = {"bytes": warmed, "s": measure.now() - t_warm}
        if w == "ingest":
            out_dir = work / f"ingest-{loader}-{rnd}"
            spec = _spec(cfg, loader, w, "ingest", wdata, rnd, out_dir=str(out_dir))
            res = run_child(pythons[loader], spec, logs, cfg.timeout_s)
            shutil.rmtree(out_dir, ignore_errors=True)
        elif mode == "run":
            spec = _spec(cfg, loader, w, "run", wdata, rnd)
            res = run_child(pythons[loader], spec, logs, cfg.timeout_s)
        else:
            spec = _spec(cfg, loader, w, "memory", wdata, rnd, epochs=cfg.memory_epochs)
            res = run_child(pythons[loader], spec, logs, cfg.timeout_s, sample_pss=True)
        res.update(loader=loader, workload=w, round=rnd, mode="ingest" if w == "ingest" else mode,
                   page_cache_warmed=warm)
        runs.append(res)
        with open(cfg.out_dir / "runs.jsonl", "a") as f:  # survives an interrupted run
            f.write(json.dumps(res, default=str) + "\n")
        what = f"round {rnd + 1}/{cfg.runs}" if mode == "run" else "memory"
        progress(f"[{done}/{len(schedule)}] {what} {w:<17} {loader:<18} " + _one_line(res, w))
    shutil.rmtree(work, ignore_errors=True)

    results = {
        "kind": "kuat-bench",
        "version": 1,
        "started_utc": started.isoformat(timespec="seconds"),
        "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "load_avg_1min_end": os.getloadavg()[0],
        "config": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()
        },
        "images": image_data,
        "workload_images": workload_images,
        "labels": {k: v["label"] for k, v in LOADERS.items()},
        "workload_labels": {
            k: v["workload_labels"] for k, v in LOADERS.items() if v.get("workload_labels")
        },
        "versions": versions,
        "unavailable": unavailable,
        "prepare_s": prepare_s,
        "summary": summarize(runs, plan),
        "tables": tables,
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


def warm_page_cache(data: dict, skip: Path | None = None) -> int:
    """Read once every file that the values of ``data`` name (files, or directories
    recursively), so that a run finds them in the page cache; returns the bytes read.

    Values that are not existing paths are ignored, and so are ``skip`` (the bench's cache
    directory, which a peer names as the root of its own caches) and the directories above it.
    """
    total, buf = 0, bytearray(1 << 20)
    for value in data.values():
        if not isinstance(value, str) or not os.path.isabs(value):
            continue
        path = Path(value)
        if not path.exists() or (skip is not None and skip.resolve().is_relative_to(path.resolve())):
            continue
        files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    total += n
    return total


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
        "kind": workloads.kind(workload),  # what the adapter runs (smooth-jpeg: imagenet-jpeg)
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
    if res.get("mode") == "memory":
        added = {k: v / 2**20 for k, v in (res.get("added_pss") or {}).items()}
        return (
            f"added PSS {added.get('pss', 0):.0f} MiB: anonymous {added.get('anon', 0):.0f}, "
            f"file-backed {added.get('file', 0):.0f}, shared {added.get('shmem', 0):.0f}"
        )
    s = res["steady"]
    return f"{s['samples_per_s']:.0f} samples/s, first batch {res['ttfb_s']:.2f} s"
