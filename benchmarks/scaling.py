"""``kuat bench --scaling``: how each loader's rate grows with worker count, and what it costs
the interpreter lock (issue 31).

For every workload (:data:`WORKLOADS`), loader (kuat's threads, kuat's processes, and torch's
strongest configuration) and worker count in 1, 2, 4, ... up to the machine's cores, one fresh
child process (:mod:`benchmarks.scaling_child`) measures:

- **rate**: items/s over a window with nothing sampling the process (``seconds`` long, after
  ``warmup_s`` of batches), and from it the **efficiency against linear**,
  ``rate(n) / (n * rate(1))``, each ratio within one round;
- **GIL-held time per item**, measured from outside the process: during a second window the
  parent reads the child's GIL (and each worker process's) from outside.
  The default sampler, ``gil_sampler="reader"`` (:mod:`benchmarks.gil_reader`), reads the
  interpreter's ``locked`` word with ``process_vm_readv`` every 200 us (5,000 instants a
  second) without stopping the process; the share of instants that find it set is the share of
  wall time the GIL was held, reported with its binomial 95% interval. ``gil_sampler="py-spy"``
  (https://github.com/benfred/py-spy, also the fallback where the reader cannot locate the
  word) runs ``py-spy record --gil --idle --subprocesses --rate R --duration D``: ``--gil``
  keeps only the samples taken while some thread holds the GIL, over ``R * D`` instants. At the
  fused image path's 0.3% of wall time, py-spy's 100 to 500 samples a second give a handful of
  held samples per window, and its reading moved 2-4x with its own rate and mode on unchanged
  code (docs/benchmarks.md); hence the reader. Times the window's wall seconds over its items,
  the share is microseconds of GIL per item. Thread workers share the main process's GIL,
  so for them it is the whole loader's cost; worker processes each have their own GIL, reported
  apart (summed over the workers); the main process's is what limits a training process.
  ``1e6 / (us per item)`` is the rate at which that GIL would be held all the time: the ceiling
  of one process whose training loop held it for nothing else. On a busy machine a thread the
  OS preempts while it holds the GIL still holds it, so that wall time grows with the load;
  the **on-CPU estimate** multiplies it by the share of their runnable time the main process's
  threads spent on a CPU during the window (``/proc/PID/task/*/schedstat``: run / (run + wait
  in the run queue)), what the same work would hold on an idle machine if the GIL holder
  waits for a core as often as the process's other runnable threads do.

With the reader, each held reading of the child's main thread (the training loop's, told by
the GIL's ``last_holder``) carries what that thread was doing, read in the same call from a
word the child sets (:data:`benchmarks.scaling_child.PHASE`): inside the loader's ``next()``,
freeing a batch, or its own code. The **loader's own** GIL per item is the main process's
less the loop thread's own code. Every child first runs
:func:`benchmarks.scaling_child.wake_probe`, how much slower the host runs a fixed snippet
right after a 30 ms wait than back to back: the loop thread runs its per-batch part of the
loader in that state whenever it waits for a batch, so GIL times per item compare across
hosts only with it.

A **competing training loop** case: the image path at the largest worker count with, after
each batch, ``loop_ms`` of pure-Python work in the consuming thread
(:func:`benchmarks.scaling_child.python_work`, a model's Python dispatch stand-in): the loader's
rate with and without it, and the loop's own time per step against the same work alone.

Rounds are interleaved (every point once per round), and every number is the median over rounds
with the min-max beside it. The table and plot come from :mod:`benchmarks.scaling_report`.
Torch's image configuration is the strongest torch baseline of the committed full run
(``benchmarks/results.json``; torch + ``decode_jpeg`` there); for tabular rows and packed text
it is torch's ``DataLoader`` with worker processes over the same dataset kuat reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import gil_reader
from benchmarks.scaling_child import IN_FREE, IN_NEXT

WORKLOADS = ("imagenet-jpeg", "tabular", "packed-text")
LOADERS = ("kuat", "kuat-proc", "torch", "floor")
# the loaders a workload has no configuration of (benchmarks/gil_floor.py: a reference)
SKIP = {"packed-text": ("floor",)}
UNITS = {"imagenet-jpeg": "images", "tabular": "rows", "packed-text": "packed rows"}
BATCH = {"imagenet-jpeg": 64, "tabular": 256, "packed-text": 8}
TABULAR_WIDTH = 32  # float32 features per row, plus an int64 label
GIL_SAMPLERS = {"reader": 5000, "py-spy": 100}  # each sampler's default readings a second
REPO = Path(__file__).resolve().parent.parent


def worker_counts(cores: int) -> list[int]:
    """1, 2, 4, ... up to ``cores``, and ``cores`` itself when it is not a power of two."""
    if cores < 1:
        raise ValueError(f"cores={cores} must be >= 1")
    out, n = [], 1
    while n <= cores:
        out.append(n)
        n *= 2
    if out[-1] != cores:
        out.append(cores)
    return out


@dataclasses.dataclass
class ScalingConfig:
    """What ``kuat bench --scaling`` runs; ``quick`` shrinks data, windows and rounds."""

    out_dir: Path = Path("bench-results")
    quick: bool = False
    workloads: tuple[str, ...] = WORKLOADS
    loaders: tuple[str, ...] = LOADERS
    max_workers: int | None = None  # default os.cpu_count()
    runs: int | None = None  # interleaved rounds; default 3 (quick 2)
    seconds: float | None = None  # rate window per point; default 10 (quick 3)
    gil_seconds: float | None = None  # GIL window; default 10 (quick 3)
    warmup_s: float | None = None  # default 3 (quick 1)
    gil_sampler: str = "reader"  # "reader" (benchmarks.gil_reader) or "py-spy"
    sample_hz: int | None = None  # readings a second; default 5,000 (reader), 100 (py-spy)
    loop_ms: float = 10.0  # the competing loop's Python per batch; 0: no competing case
    num_images: int | None = None  # default 2000 (quick 512), >= 8 batches per worker
    image_batch: int | None = None  # images per batch on the image path; default 64
    tabular_rows: int | None = None  # default 1,000,000 (quick 200,000)
    text_docs: int | None = None  # default 50,000 (quick 20,000), >= 10,000 per worker
    cache_dir: Path | None = None
    timeout_s: float = 300.0  # per child process

    def __post_init__(self) -> None:
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad:
            raise ValueError(f"scaling: unknown workloads={bad}; known: {list(WORKLOADS)}")
        bad = [x for x in self.loaders if x not in LOADERS]
        if bad:
            raise ValueError(f"scaling: unknown loaders={bad}; known: {list(LOADERS)}")
        if self.max_workers is not None and self.max_workers < 1:
            raise ValueError(f"max_workers={self.max_workers} must be >= 1")
        if self.runs is not None and self.runs < 1:
            raise ValueError(f"runs={self.runs} must be >= 1")
        if self.gil_sampler not in GIL_SAMPLERS:
            raise ValueError(f"gil_sampler={self.gil_sampler!r}: one of {list(GIL_SAMPLERS)}")
        if self.loop_ms < 0:
            raise ValueError(f"loop_ms={self.loop_ms} must be >= 0")
        if self.image_batch is not None and self.image_batch < 1:
            raise ValueError(f"image_batch={self.image_batch} must be >= 1")
        self.image_batch = self.image_batch or BATCH["imagenet-jpeg"]
        q = self.quick
        self.max_workers = self.max_workers or os.cpu_count() or 1
        self.runs = self.runs or (2 if q else 3)
        self.seconds = self.seconds or (3.0 if q else 10.0)
        self.gil_seconds = self.gil_seconds or (3.0 if q else 10.0)
        self.sample_hz = self.sample_hz or GIL_SAMPLERS[self.gil_sampler]
        self.warmup_s = self.warmup_s or (1.0 if q else 3.0)
        # enough data that every worker reads 8 or more batches per epoch at the largest
        # count: a short epoch leaves workers idle at its end and measures epoch turnover
        w = self.max_workers
        self.num_images = self.num_images or max(512 if q else 2000, 8 * self.image_batch * w)
        self.tabular_rows = self.tabular_rows or (200_000 if q else 1_000_000)
        self.text_docs = self.text_docs or max(20_000 if q else 50_000, 10_000 * w)
        if self.cache_dir is None:
            from kuat._dirs import cache_root

            self.cache_dir = cache_root() / "bench"
        self.cache_dir = Path(self.cache_dir).resolve()
        self.out_dir = Path(self.out_dir).resolve()

    def batch_size(self, workload: str) -> int:
        """Items per batch of ``workload``: :data:`BATCH`'s, the image path's ``image_batch``."""
        return self.image_batch if workload == "imagenet-jpeg" else BATCH[workload]


def torch_image_loader() -> str:
    """The strongest torch configuration of the committed full run on imagenet-jpeg
    (a :data:`benchmarks.adapters.LOADERS` name); torch + ``decode_jpeg`` without that file."""
    try:
        results = json.loads((REPO / "benchmarks" / "results.json").read_text())
        return results["summary"]["imagenet-jpeg"]["strongest"] or "torch-decode-jpeg"
    except (OSError, KeyError, ValueError):
        return "torch-decode-jpeg"


def pyspy() -> str | None:
    """The py-spy executable (beside this interpreter, else on PATH), or None."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def parse_gil_samples(raw: str) -> tuple[int, int]:
    """``(main, workers)``: samples of py-spy's raw output (``--subprocesses``) holding the
    main process's GIL, and holding any descendant's. Each line is ``frames count`` with
    ``;``-separated frames; ``process PID:"cmd"`` frames name the process, a child's after
    its parent's."""
    main = workers = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if len(frames) > 1 and frames[1].startswith("process "):
            workers += int(count)
        else:
            main += int(count)
    return main, workers


def gil_record(pid: int, seconds: float, hz: int, out: Path) -> dict:
    """Run py-spy on ``pid`` (and its descendants) for ``seconds``; ``{"main_fraction",
    "workers_fraction", "instants", "errors", ...}`` or ``{"error"}``."""
    exe = pyspy()
    if exe is None:
        return {"error": "py-spy not installed (pip install 'kuat[bench]')"}
    duration = max(1, int(round(seconds)))  # (py-spy takes whole seconds)
    cmd = [exe, "record", "--pid", str(pid), "--gil", "--idle", "--subprocesses",
           "--rate", str(hz), "--duration", str(duration), "--format", "raw",
           "--output", str(out)]  # fmt: skip
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    except subprocess.TimeoutExpired:
        return {"error": f"py-spy did not finish in {seconds + 60:.0f} s"}
    log = (p.stdout + p.stderr).strip()
    if p.returncode != 0 or not out.exists():
        return {"error": f"py-spy exited with {p.returncode}: {log[-300:]}"}
    main, workers = parse_gil_samples(out.read_text())
    errors = 0
    for word in log.split("Errors:")[1:2]:
        errors = int(word.split()[0]) if word.split() and word.split()[0].isdigit() else 0
    # py-spy samples at fixed instants and catches up when late, so the instants are rate x
    # duration; a failed sample is not one of them
    instants = max(1, duration * hz - errors)
    return {"sampler": "py-spy", "main_samples": main, "workers_samples": workers,
            "instants": instants, "errors": errors, "main_fraction": main / instants,
            "workers_fraction": workers / instants,
            "main_ci95": gil_reader.binomial_ci95(min(main, instants), instants),
            "behind": "behind in sampling" in log}  # fmt: skip


def reader_record(pid: int, where: dict | None, seconds: float, hz: int) -> dict:
    """Read the GIL of ``pid`` and of its worker processes with :mod:`benchmarks.gil_reader`
    for ``seconds`` at ``hz``; the same keys as :func:`gil_record` (``main_fraction``,
    ``workers_fraction``, ``instants``, ...) plus ``loop_fraction`` (the child's main thread,
    the training loop's, holding it), of that ``loop_next_fraction`` and
    ``loop_free_fraction`` (while it was inside the loader's ``next()``, and freeing a batch:
    :data:`benchmarks.scaling_child.PHASE`), ``sampler_cpu_s`` (the reader's own CPU seconds)
    and ``workers`` (processes read), or ``{"error"}``."""
    if where is None:
        return {"error": "the GIL reader found no GIL struct in the child (not Linux, or a "
                         "CPython build it does not know)"}
    targets = {pid: gil_reader.address_in(pid, where)}
    for child in gil_reader.descendants(pid):
        addr = gil_reader.address_in(child, where)
        if addr is not None:  # (a process running another program has no such word)
            targets[child] = addr
    if targets[pid] is None:
        return {"error": f"the GIL reader found no {where['path']} in process {pid}"}
    try:
        r = gil_reader.sample(targets, seconds, 1.0 / hz, thread=(pid, where["main_thread"]),
                              phase=where.get("phase"))  # fmt: skip
    except OSError as e:
        return {"error": f"the GIL reader cannot read process {pid}: {e}"}
    # the main process's share over its readings that succeeded (a failed one, the child
    # exiting, says nothing); the workers' over all instants (one that exits holds nothing)
    n = max(1, r["readings"] - r["errors"][pid])
    main = r["held"][pid]
    workers = sum(v for k, v in r["held"].items() if k != pid)
    return {"sampler": "reader", "main_samples": main, "workers_samples": workers,
            "instants": r["readings"], "errors": sum(r["errors"].values()),
            "main_fraction": main / n, "workers_fraction": workers / max(1, r["readings"]),
            "loop_fraction": r["thread_held"] / n,
            # of it, the loop thread inside the loader's next() and freeing its batches
            # (scaling_child.PHASE), where the child said
            **({"loop_next_fraction": r["thread_held_by_phase"].get(IN_NEXT, 0) / n,
                "loop_free_fraction": r["thread_held_by_phase"].get(IN_FREE, 0) / n}
               if where.get("phase") else {}),
            "main_ci95": gil_reader.binomial_ci95(main, n), "workers": len(targets) - 1,
            "sampler_cpu_s": r["cpu_s"], "behind": False}  # fmt: skip


def schedstat(pid: int) -> tuple[int, int]:
    """``(run_ns, wait_ns)`` summed over the threads of ``pid``: nanoseconds on a CPU, and
    nanoseconds runnable but waiting for one (``/proc/PID/task/*/schedstat``'s first two
    fields); ``(0, 0)`` where the kernel does not report them."""
    run = wait = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0
    for tid in tasks:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except OSError:  # a thread that ended meanwhile
            continue
        run, wait = run + int(fields[0]), wait + int(fields[1])
    return run, wait


def on_cpu_share(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The share of the runnable time the process's threads spent on a CPU between two
    :func:`schedstat` readings: 1.0 on an idle machine, lower when threads wait for a core."""
    run, wait = after[0] - before[0], after[1] - before[1]
    return run / (run + wait) if run + wait > 0 else None


def run_point(python: str, spec: dict, work: Path, cfg: ScalingConfig) -> dict:
    """One child: its rate window unsampled, then its GIL window under py-spy. Returns the
    child's result plus ``gil`` (:func:`gil_record`) and ``process_wall_s``."""
    from benchmarks.runner import child_env

    name = f"{spec['workload']}-{spec['loader']}-w{spec['num_workers']}-" \
           f"{'loop-' if spec['loop_iters'] else ''}r{spec['round']}"  # fmt: skip
    r_ready, w_ready = os.pipe()
    r_done, w_done = os.pipe()
    located = work / f"{name}.gil.json"
    located.unlink(missing_ok=True)
    spec = {**spec, "ready_fd": w_ready, "done_fd": r_done}
    if cfg.gil_sampler == "reader":
        spec["locate_path"] = str(located)
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(
            [python, "-m", "benchmarks.scaling_child", str(spec_path), str(out_path)],
            cwd=work, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, pass_fds=(w_ready, r_done), start_new_session=True,
        )  # fmt: skip
    os.close(w_ready)
    os.close(r_done)
    gil: dict = {"error": "the child ended before its GIL window"}
    try:
        ready = select.select([r_ready], [], [], cfg.timeout_s)[0]
        if ready and os.read(r_ready, 1) == b"1":
            before = schedstat(proc.pid)
            gil = sample_gil(proc.pid, located, cfg, work / f"{name}.pyspy")
            gil["on_cpu_share"] = on_cpu_share(before, schedstat(proc.pid))
        os.write(w_done, b"1")
    except BrokenPipeError:  # the child died; its result (or its absence) says why
        pass
    finally:
        os.close(r_ready)
        os.close(w_done)
    try:
        proc.wait(timeout=cfg.timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        try:
            os.killpg(proc.pid, 9)  # stray workers
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    try:
        res = json.loads(out_path.read_text())
    except (OSError, ValueError):
        tail = (work / f"{name}.log").read_text(errors="replace")[-1500:]
        res = {"ok": False, "error": f"child exited with {proc.returncode}, no result: {tail}"}
    res["gil"] = gil
    res["process_wall_s"] = time.perf_counter() - t0
    return res


def sample_gil(pid: int, located: Path, cfg: ScalingConfig, pyspy_out: Path) -> dict:
    """The GIL window's record by ``cfg.gil_sampler``; where the reader cannot run (its
    ``located`` file says where the child's GIL is, or that it found none), py-spy at its
    default rate, with ``fallback`` saying why."""
    if cfg.gil_sampler == "py-spy":
        return gil_record(pid, cfg.gil_seconds, cfg.sample_hz, pyspy_out)
    try:
        where = json.loads(located.read_text())
    except (OSError, ValueError):
        where = None
    gil = reader_record(pid, where, cfg.gil_seconds, cfg.sample_hz)
    if "error" in gil and pyspy() is not None:
        why = gil["error"]
        gil = gil_record(pid, cfg.gil_seconds, GIL_SAMPLERS["py-spy"], pyspy_out)
        gil["fallback"] = why
    return gil


def calibrate_loop(loop_ms: float) -> int:
    """Iterations of :func:`benchmarks.scaling_child.python_work` that take ``loop_ms`` here."""
    from benchmarks.scaling_child import loop_alone_ms

    probe = 200_000
    per_iter_ms = min(loop_alone_ms(probe, steps=5) for _ in range(3)) / probe
    return max(1, int(loop_ms / per_iter_ms))


def prepare(cfg: ScalingConfig, progress: Callable[[str], None]) -> dict:
    """Each workload's data (built once, reused from the cache): ``{workload: data}``."""
    import numpy as np

    from benchmarks import workloads

    data: dict[str, dict] = {}
    if "imagenet-jpeg" in cfg.workloads:
        progress(f"data for imagenet-jpeg: {cfg.num_images} ImageNet-like JPEGs")
        img = workloads.imagenet_jpeg(cfg.num_images, progress=False)
        data["imagenet-jpeg"] = {**img, "kuat_path": workloads.kuat_copy(img["root"], cfg.cache_dir)}
    if "tabular" in cfg.workloads:
        import kuat
        import kuat.format as kf

        path = cfg.cache_dir / "scaling" / f"tabular-{cfg.tabular_rows}x{TABULAR_WIDTH}.kuat"
        if not (path / "manifest.json").exists():
            progress(f"data for tabular: {cfg.tabular_rows:,} rows")
            rng = np.random.default_rng(0)
            schema = {"x": kf.tensor((TABULAR_WIDTH,), "float32"), "label": kf.int64()}
            with kuat.Writer(path, schema, overwrite=True) as w:
                for s in range(0, cfg.tabular_rows, 65536):
                    n = min(65536, cfg.tabular_rows - s)
                    w.write_batch({"x": rng.standard_normal((n, TABULAR_WIDTH), np.float32),
                                   "label": rng.integers(0, 1000, n)})  # fmt: skip
        data["tabular"] = {"path": str(path), "rows": cfg.tabular_rows}
    if "packed-text" in cfg.workloads:
        from benchmarks import bench_text

        progress(f"data for packed-text: {cfg.text_docs:,} tokenized documents")
        text = bench_text.prepare(cfg.cache_dir / "scaling", cfg.text_docs)
        data["packed-text"] = {"path": str(text["path"]), "docs": cfg.text_docs}
    return data


def run_scaling(cfg: ScalingConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Run the sweep; write ``scaling.json``, ``scaling.md`` and ``scaling.png`` into
    ``cfg.out_dir`` and return the results."""
    from benchmarks import runner, scaling_report

    started = datetime.now(timezone.utc)
    machine = runner.machine_info()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    work = cfg.out_dir / "scaling-logs"
    work.mkdir(exist_ok=True)
    (cfg.out_dir / "scaling-runs.jsonl").unlink(missing_ok=True)
    data = prepare(cfg, progress)
    counts = worker_counts(cfg.max_workers)
    torch_image = torch_image_loader()
    iters = calibrate_loop(cfg.loop_ms) if cfg.loop_ms and "imagenet-jpeg" in data else 0
    progress(f"worker counts {counts}; torch on images: {torch_image}; competing loop "
             f"{cfg.loop_ms:g} ms = {iters:,} iterations; GIL sampler: {cfg.gil_sampler} at "
             f"{cfg.sample_hz} Hz (py-spy: {pyspy() or 'not installed'})")

    def points():
        for w in cfg.workloads:
            for n in counts:
                for loader in cfg.loaders:
                    if loader not in SKIP.get(w, ()):
                        yield w, loader, n, 0
        if iters:
            for loader in cfg.loaders:  # the competing loop: image path, most workers
                yield "imagenet-jpeg", loader, counts[-1], iters

    schedule = [(rnd, *p) for rnd in range(cfg.runs) for p in points()]
    records: list[dict] = []
    for done, (rnd, w, loader, n, loop) in enumerate(schedule, 1):
        real = torch_image if (w == "imagenet-jpeg" and loader == "torch") else loader
        spec = {"workload": w, "loader": real, "num_workers": n, "batch_size": cfg.batch_size(w),
                "data": data[w], "warmup_s": cfg.warmup_s, "seconds": cfg.seconds,
                "loop_iters": loop, "seed": 0, "round": rnd,
                "gil_window_max_s": cfg.gil_seconds + 120}  # fmt: skip
        runner.warm_page_cache(data[w], skip=cfg.cache_dir)
        res = run_point(sys.executable, spec, work, cfg)
        rec = scaling_report.record(res, w, loader, n, bool(loop), rnd)
        rec["configuration"] = real
        rec["load_avg_1min"] = os.getloadavg()[0]  # right after the point: how busy it ran
        records.append(rec)
        with open(cfg.out_dir / "scaling-runs.jsonl", "a") as f:  # survives an interruption
            f.write(json.dumps(rec, default=str) + "\n")
        progress(f"[{done}/{len(schedule)}] round {rnd + 1}/{cfg.runs} {w:<13} {loader:<9} "
                 f"{n:>3} workers{' + loop' if loop else ''}: {scaling_report.one_line(rec)}")
    result = {
        "kind": "kuat-bench-scaling",
        "version": 1,
        "started_utc": started.isoformat(timespec="seconds"),
        "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "load_avg_1min_end": os.getloadavg()[0],
        "config": {k: (str(v) if isinstance(v, Path) else v)
                   for k, v in dataclasses.asdict(cfg).items()},  # fmt: skip
        "worker_counts": counts,
        "torch_image_loader": torch_image,
        "loop_iters": iters,
        "units": {w: UNITS[w] for w in cfg.workloads},
        "batch_sizes": {w: cfg.batch_size(w) for w in cfg.workloads},
        "records": records,
    }
    result["summary"] = scaling_report.summarize(records)
    (cfg.out_dir / "scaling.json").write_text(json.dumps(result, indent=1, default=str))
    (cfg.out_dir / "scaling.md").write_text(scaling_report.markdown(result, "scaling.png"))
    try:
        scaling_report.chart(result, cfg.out_dir / "scaling.png")
    except ImportError as e:  # matplotlib missing: the JSON and table still stand
        progress(f"no plot: {e}")
    return result
