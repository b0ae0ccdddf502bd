"""kuat bench: kuat against torch's DataLoader and the peer loaders, side by side.

The harness lives in the repository's benchmarks/ folder (workloads, one adapter per
peer, the runner); this command finds it next to the src/ tree it was installed from
(pip install -e .) or at $KUAT_BENCHMARKS_DIR, and only parses arguments and calls
benchmarks.runner.run_bench. See docs/benchmarks.md for the method.

Examples:

    kuat bench --quick                      # only peers already installed: minutes alone, ~25 with all
    kuat bench --setup-envs                 # full run; creates the peer environments first
    kuat bench --setup-envs --update-readme # the same, then commit-ready results.json, README
                                            # summary, docs/benchmarks.md results and chart
    kuat bench --workloads imagenet-jpeg --loaders torch kuat decode-only
    kuat bench --workloads overhead --loaders torch   # the loop-cost table (issue 17)
    kuat bench --workloads remote --update-readme     # S3 (moto) vs local disk, its table
    kuat bench --table bench-results/results.json   # print the Markdown report again
    kuat bench --scaling --quick            # rate, efficiency and GIL us/item against workers
    kuat bench --scaling --update-readme    # the same, full; commits benchmarks/scaling.json,
                                            # docs/img/scaling.png, docs/benchmarks.md's section
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmark kuat against torch's DataLoader and peer loaders",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small data (512 images, 16k token windows, 50k HF rows), 2 epochs per "
        "run, and only peers whose environments already exist",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="output directory for results.json/.md/.png (default ./bench-results)",
    )
    p.add_argument(
        "--loaders",
        nargs="+",
        default=None,
        metavar="NAME",
        help="loaders to run (default: all; see --list); with --scaling: kuat kuat-proc torch "
        "floor (a reference, benchmarks/gil_floor.py)",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        default=None,
        metavar="NAME",
        help="imagenet-jpeg smooth-jpeg imagenet-jpeg-256 tokens hf-rows ingest overhead remote hf-stream "
        "(default: all); with --scaling: imagenet-jpeg tabular packed-text",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=None,
        help="interleaved timed rounds per loader (default 3; quick 2; 0 with --memory-runs: "
        "memory only)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="epochs per run, the first one a warm-up (default 3; quick 2)",
    )
    p.add_argument(
        "--memory-runs",
        type=int,
        default=None,
        help="separate memory-sampled runs per loader and workload, 2 epochs each; rates are "
        "never timed while memory is sampled (default 1; 0 skips memory)",
    )
    p.add_argument(
        "--num-images",
        type=int,
        default=None,
        help="images of the generated ImageNet-like corpus (default 2000; quick 512)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker threads/processes of every loader (default: all cores); with --scaling, "
        "the largest worker count of the sweep",
    )
    envs = p.add_mutually_exclusive_group()
    envs.add_argument(
        "--setup-envs",
        dest="setup_envs",
        action="store_true",
        default=None,
        help="create missing peer environments (apt + venv + pip); default for the full run",
    )
    envs.add_argument(
        "--no-setup-envs",
        dest="setup_envs",
        action="store_false",
        help="only use peer environments that already exist",
    )
    p.add_argument(
        "--imagefolder",
        type=Path,
        default=None,
        metavar="DIR",
        help="benchmark on this ImageFolder tree instead of the generated corpus (the report "
        "names it and gives its size and bytes-per-pixel statistics)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where converted copies and generated data are kept (default bench/ under kuat's "
        "cache root: $KUAT_CACHE, else $XDG_CACHE_HOME/kuat, else ~/.cache/kuat)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds one measured process may take (default 900)",
    )
    p.add_argument(
        "--table",
        type=Path,
        default=None,
        metavar="RESULTS_JSON",
        help="print the Markdown report of an earlier run and exit",
    )
    p.add_argument(
        "--update-readme",
        action="store_true",
        help="after the run, copy results.json to benchmarks/results.json and regenerate from "
        "it docs/benchmarks.md's results, the README's summary and its chart "
        "(python -m benchmarks.readme)",
    )
    p.add_argument("--list", action="store_true", help="list loaders and workloads and exit")
    p.add_argument(
        "--text",
        action="store_true",
        help="the text workloads instead (packing rate, padding waste, memory, resume): "
        "benchmarks/bench_text.py, with torchtune and TRL where they import",
    )
    p.add_argument(
        "--scaling",
        action="store_true",
        help="sweep worker counts 1, 2, 4, ... up to --workers (default: all cores) for kuat "
        "(threads, processes) and torch on images, tabular rows and packed text: rate, "
        "efficiency against linear, GIL-held us per item measured from outside the process, "
        "a competing training loop, a plot (benchmarks/scaling.py)",
    )
    p.add_argument(
        "--gil-sampler",
        choices=("reader", "py-spy"),
        default="reader",
        help="with --scaling: what reads the GIL from outside: kuat's reader of the GIL word "
        "(benchmarks/gil_reader.py, 5,000 readings/s, never stops the process; default) or "
        "py-spy --gil (100 samples/s)",
    )
    p.add_argument(
        "--loop-ms",
        type=float,
        default=10.0,
        help="with --scaling: pure-Python ms per batch of the competing training loop "
        "(default 10; 0 skips that case)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="with --scaling: images per batch on the image path (default 64; most of a "
        "loader's GIL time is per batch, so its GIL per image falls as the batch grows)",
    )
    return p


def _given(**options) -> dict:
    """The options the user gave (not None): the configs' own defaults apply to the rest."""
    return {k: v for k, v in options.items() if v is not None}


def _scaling(args: argparse.Namespace) -> int:
    import json

    from benchmarks import scaling, scaling_report

    if args.table is not None:
        print(scaling_report.markdown(json.loads(args.table.read_text())))
        return 0
    kw = _given(
        workloads=tuple(args.workloads) if args.workloads else None,
        loaders=tuple(args.loaders) if args.loaders else None,
        max_workers=args.workers,
        runs=args.runs,
        num_images=args.num_images,
        cache_dir=args.cache_dir,
        image_batch=args.batch_size,
    )
    try:
        cfg = scaling.ScalingConfig(
            out_dir=args.out, quick=args.quick, loop_ms=args.loop_ms,
            gil_sampler=args.gil_sampler, timeout_s=min(args.timeout, 600.0), **kw,
        )  # fmt: skip
    except ValueError as e:
        print(f"kuat bench: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = scaling.run_scaling(
        cfg, lambda line: print(f"[{time.perf_counter() - t0:7.1f} s] {line}", flush=True)
    )
    print()
    print(scaling_report.markdown(result))
    png = cfg.out_dir / "scaling.png"
    print(f"wrote {cfg.out_dir / 'scaling.json'}, scaling.md; plot: {png}")
    ok = any(r["ok"] for r in result["records"])
    if args.update_readme and ok:
        scaling_report.main([str(cfg.out_dir / "scaling.json")])
    return 0 if ok else 1


def _import_harness():
    root = os.environ.get("KUAT_BENCHMARKS_DIR")
    candidates = [Path(root).parent] if root else []
    candidates.append(Path(__file__).resolve().parents[3])  # src/kuat/cli/bench.py -> repo
    for repo in candidates:
        if (repo / "benchmarks" / "runner.py").exists():
            if str(repo) not in sys.path:
                sys.path.insert(0, str(repo))
            import benchmarks.runner

            return benchmarks.runner
    raise SystemExit(
        "kuat bench: the benchmarks/ folder was not found; run it from a source checkout "
        "installed with `pip install -e .[bench]`, or set KUAT_BENCHMARKS_DIR"
    )


def run(args: argparse.Namespace) -> int:
    runner = _import_harness()
    if args.scaling:
        return _scaling(args)
    if args.text:
        from benchmarks import bench_text

        text_args = ["--json", str(Path(args.out) / "text.json")] if args.out else []
        if args.cache_dir is not None:
            text_args += ["--cache-dir", str(args.cache_dir)]
        quick = ["--docs", "2000", "--repeats", "1"] if args.quick else []
        if args.setup_envs or (args.setup_envs is None and not args.quick):
            text_args.append("--setup-envs")  # torchtune and TRL in their own environment
        return bench_text.main(text_args + quick)
    from benchmarks import report
    from benchmarks.adapters import LOADERS

    if args.list:
        for name, info in LOADERS.items():
            name_label = info["label"].replace("{workers}", "all")
            print(f"{name:<18} env={info['env']:<10} {name_label}")
        print("workloads:", " ".join(runner.workloads.ALL + tuple(runner.TABLE_WORKLOADS)))
        return 0
    if args.table is not None:
        import json

        print(report.markdown(json.loads(args.table.read_text())))
        return 0
    kw = _given(
        loaders=tuple(args.loaders) if args.loaders else None,
        workloads=tuple(args.workloads) if args.workloads else None,
        runs=args.runs,
        epochs=args.epochs,
        num_images=args.num_images,
        memory_runs=args.memory_runs,
        num_workers=args.workers,
        setup_envs=args.setup_envs,
        image_root=args.imagefolder,
        cache_dir=args.cache_dir,
    )
    try:
        cfg = runner.BenchConfig(out_dir=args.out, quick=args.quick, timeout_s=args.timeout, **kw)
    except ValueError as e:
        print(f"kuat bench: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {line}", flush=True)

    results = runner.run_bench(cfg, progress)
    print()
    print(report.markdown(results))
    print(f"wrote {cfg.out_dir / 'results.json'}, results.md, results.png")
    ok = any(r.get("ok") for r in results["runs"]) or bool(results.get("tables"))
    if args.update_readme and ok:
        from benchmarks import readme

        readme.main([str(cfg.out_dir / "results.json")])
    return 0 if ok else 1
