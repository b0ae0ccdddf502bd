"""Turn a ``results.json`` of ``kuat bench`` into a Markdown report and a PNG bar chart.

:func:`markdown` is what ``kuat bench --table RESULTS.json`` prints and what
``python -m benchmarks.readme`` puts into docs/benchmarks.md: machine (cores, CPU model, load), date,
settings, the images measured and their statistics, the version of every peer, then one table
per workload, each ratio naming its baseline, and a headline against the strongest torch
configuration.
"""

from __future__ import annotations

from pathlib import Path

TITLES = {
    "imagenet-jpeg": "imagenet-jpeg: RandomResizedCrop(224) + flip, uint8 (64, 3, 224, 224) out",
    "smooth-jpeg": "smooth-jpeg: the same work on smooth JPEGs (no grain, about 0.19 bytes per "
    "pixel)",
    "imagenet-jpeg-256": "imagenet-jpeg-256: the corpus converted with --resize-shorter 256 "
    "(each row names the files it reads)",
    "tokens": "tokens: random windows of 1,025 uint16 tokens from one memmap, batch 32, int64 "
    "out, the same dataset for every loader",
    "hf-rows": "hf-rows: datasets.Dataset of variable-length int32 lists, padding collate, "
    "batch 64",
    "ingest": "ingest: converting the ImageFolder into each format",
    "overhead": "overhead: the loop's own cost on cheap samples, batch 256, us per batch",
    "remote": "remote: epoch throughput from an S3-compatible server (moto) against local disk",
    "hf-stream": "hf-stream: a streamed Hugging Face dataset of token lists (Parquet), rows/s",
}


# ingest rows name the writer, not the loader
INGEST_LABELS = {
    "kuat": "kuat convert (original bytes)",
    "kuat-ray": "kuat convert --engine ray, 1 local node (incl. Ray start-up)",
    "kuat-ray-2": "kuat convert --engine ray, 2 local nodes (incl. Ray start-up)",
    "ffcv": "FFCV DatasetWriter (re-encodes)",
    "streaming": "Mosaic MDSWriter",
    "mds": "Mosaic MDSWriter (original bytes)",
    "litdata": "LitData optimize",
    "webdataset": "WebDataset ShardWriter",
}
CHART_TITLES = {
    "imagenet-jpeg": "imagenet-jpeg: RandomResizedCrop(224) + flip, uint8 out",
    "smooth-jpeg": "smooth-jpeg: RandomResizedCrop(224) + flip on smooth JPEGs",
    "imagenet-jpeg-256": "imagenet-jpeg-256: --resize-shorter 256 files",
    "tokens": "tokens: random 1,025-token windows, batch 32",
    "hf-rows": "hf-rows: variable-length rows, padding collate, batch 64",
    "ingest": "ingest: ImageFolder into each format",
}


def _f(v, fmt: str = "{:.0f}") -> str:
    return "–" if v is None else fmt.format(v)


def _spread(median, lo, hi, fmt: str) -> str:
    """``median (min-max)``, or ``median`` alone when min == max (one round); a suffix after
    the last ``}`` of ``fmt`` (a unit) goes after the median only."""
    if median is None:
        return "–"
    head, unit = fmt.rsplit("}", 1)
    num = head + "}"
    if lo is None or hi is None or num.format(lo) == num.format(hi):
        return fmt.format(median)
    return f"{fmt.format(median)} ({num.format(lo)}-{num.format(hi)})"


def _ratio(r: dict, base: str, unit: str = "") -> str:
    """``median (min-max)`` of the per-round ratios to ``base``; ``unit`` follows the median."""
    v = r.get("vs", {}).get(base)
    return "–" if v is None else _spread(v["median"], v["min"], v["max"], "{:.2f}" + unit)


def label(results: dict, loader: str, workload: str) -> str:
    """The name a loader's row has in ``workload``'s table (``{workers}`` in a label is the
    run's worker count)."""
    per_workload = results.get("workload_labels", {}).get(loader, {})
    name = per_workload.get(workload) or results.get("labels", {}).get(loader, loader)
    return name.replace("{workers}", str(results.get("config", {}).get("num_workers", "?")))


def _versions_line(results: dict) -> str:
    seen: dict[str, str] = {}
    for vs in results.get("versions", {}).values():
        for k, v in vs.items():
            if k != "kuat ROI decoder":  # a build flag, reported on its own line
                seen.setdefault(k, str(v))
    return ", ".join(f"{k} {v}" for k, v in sorted(seen.items()))


def describe_images(stats: dict | None) -> str:
    """What the image workloads read, with size and bytes-per-pixel statistics."""
    if not stats:
        return "no image workload ran"
    mp, bpp = stats["megapixels"], stats["bytes_per_pixel"]
    corpus = stats.get("corpus", "ImageNet-like")
    if stats["source"] == "generated" and corpus == "ImageNet-like":
        what = (
            "the generated ImageNet-like corpus (`kuat.demo_data`: crops of photographs "
            "that installed packages ship, with grain, at ImageNet's size and bytes per pixel)"
        )
    elif stats["source"] == "generated" and corpus == "smooth":
        what = "the generated smooth corpus (the same crops and sizes without grain, quality 75-85)"
    elif corpus != "ImageNet-like":  # e.g. the --resize-shorter 256 export of the corpus
        what = f"{corpus} (kuat's stored bytes, exported once as files)"
    else:
        what = f"the user's ImageFolder `{stats['root']}`"
    return (
        f"{what}: {stats['images']:,} images in {stats['classes']} classes, "
        f"{stats['total_mib']:.0f} MiB; megapixels median {mp['median']:.3f} "
        f"(p10-p90 {mp['p10']:.3f}-{mp['p90']:.3f}); bytes per pixel median "
        f"{bpp['median']:.2f} (p10-p90 {bpp['p10']:.2f}-{bpp['p90']:.2f}); "
        f"{100 * stats['grayscale_fraction']:.1f}% grayscale. ImageNet-1k train: about "
        "0.11-0.18 megapixels at 0.6-0.8 bytes per pixel"
    )


def _header(results: dict) -> list[str]:
    m, c = results["machine"], results["config"]
    roi = {v.get("kuat ROI decoder") for v in results.get("versions", {}).values()} - {None}
    load = m.get("load_avg_1min")
    load_end = results.get("load_avg_1min_end")
    lines = [
        f"- Machine: {m['cpu_count']} cores, {m['cpu_model']}, {m['memory_gib']} GiB RAM, "
        f"{m['platform']}, Python {m['python']}",
    ]
    if load is not None:
        lines.append(
            f"- Load: 1-minute load average {load:.1f} at the start"
            + (f", {load_end:.1f} at the end" if load_end is not None else "")
            + f" on {m['cpu_count']} cores"
            + (
                " (a busy machine: compare the ratios, not the absolute rates)"
                if max(load, load_end or 0) > 0.5 * m["cpu_count"]
                else ""
            )
        )
    lines += [
        f"- Date: {results['started_utc']} to {results['finished_utc']} (UTC)",
        f"- Settings: {'quick' if c['quick'] else 'full'} run, {c['runs']} interleaved rounds, "
        f"{c['epochs']} epochs per run (the first a warm-up, excluded from the rate), "
        f"{c['num_workers']} workers for every loader unless its name says otherwise; memory "
        f"from {c.get('memory_runs', 0)} separate run(s) of {c.get('memory_epochs', '?')} "
        "epochs per loader",
        f"- Images: {describe_images(results.get('images'))}",
    ]
    if roi:
        lines.append(f"- kuat's region (ROI) JPEG decoder: {', '.join(sorted(roi))}")
    lines += [f"- Versions: {_versions_line(results)}", ""]
    return lines


def _headline(results: dict, workload: str, s: dict) -> list[str]:
    rows, strongest = s["rows"], s.get("strongest")
    out = []
    if strongest and not strongest.startswith("kuat"):  # ingest's baseline is kuat itself
        base = label(results, strongest, workload)
        for loader, r in rows.items():
            v = r.get("vs", {}).get(strongest)
            if loader.startswith("kuat") and v:
                out.append(
                    f"**{label(results, loader, workload)}: {_ratio(r, strongest, 'x')} the "
                    f"strongest torch configuration here, {base}.**"
                )
    ref = s.get("reference")
    if ref:
        for loader, r in rows.items():
            if loader.startswith("kuat") and r.get("vs", {}).get(ref):
                out.append(
                    f"{label(results, loader, workload)}: {_ratio(r, ref, 'x')} the "
                    f"{label(results, ref, workload)}. That row is a reference, not a limit: it "
                    "decodes every full image and does nothing else, while kuat decodes only "
                    "the crop, at a reduced DCT scale, and can exceed it."
                )
    return [*out, ""] if out else []


def _table(results: dict, workload: str, s: dict) -> list[str]:
    rows, baselines = s["rows"], s.get("baselines", [])
    ref = s.get("reference")
    if workload == "ingest":
        lines = [
            "| writer | images/s (min-max) | kuat is N x faster | CPU s / 1k images | output MiB |",
            "|---|---:|---:|---:|---:|",
        ]
        for loader, r in rows.items():
            v = r.get("vs", {}).get("kuat")
            inv = _spread(1 / v["median"], 1 / v["max"], 1 / v["min"], "{:.2f}") if v else "–"
            lines.append(
                f"| {INGEST_LABELS.get(loader, loader)} | "
                f"{_spread(r['rate'], r.get('rate_min'), r.get('rate_max'), '{:.0f}')} | {inv} | "
                f"{_f(r['cpu_s_per_1k'], '{:.1f}')} | {_f(r.get('output_mib'))} |"
            )
        return lines
    unit = "samples/s" if workload in ("tokens", "hf-rows") else "images/s"
    vs_cols = [*baselines, *([ref] if ref else [])]
    lines = [
        f"| loader | {unit} (min-max) | "
        + "".join(f"vs {label(results, b, workload)} | " for b in vs_cols)
        + "CPU s / 1k | first batch s | set-up s | added anonymous MiB | added shared MiB | "
        "added anonymous + shared MiB | added file-backed MiB | peak PSS MiB |",
        "|---|---:|" + "---:|" * len(vs_cols) + "---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for loader, r in rows.items():
        added = r.get("added_mib") or {}
        lines.append(
            f"| {label(results, loader, workload)} | "
            f"{_spread(r['rate'], r.get('rate_min'), r.get('rate_max'), '{:.0f}')} | "
            + "".join(f"{_ratio(r, b)} | " for b in vs_cols)
            + f"{_f(r['cpu_s_per_1k'], '{:.2f}')} | {_f(r.get('ttfb_s'), '{:.2f}')} | "
            f"{_f(r.get('setup_s'), '{:.2f}')} | {_f(added.get('anon'))} | "
            f"{_f(added.get('shm_system'))} | {_f(added.get('anon_shared'))} | "
            f"{_f(added.get('file'))} | {_f(r.get('peak_pss_mib'))} |"
        )
    return lines


def markdown(results: dict, title: str = "# kuat bench results") -> str:
    """The whole report: header (machine, load, date, settings, images, versions) and one
    table per workload; ``title`` is its first line (docs/benchmarks.md uses a lower heading)."""
    level = title.split(" ", 1)[0] + "#"  # workload headings one level below the title
    lines = [
        title,
        "",
        *_header(results),
        "Rates are medians over rounds of the steady-state epochs, with the lowest and highest "
        'round in brackets; "vs X" is the median (min-max) of the per-round ratios to X in the '
        "same round. Memory comes from separate runs (the sampler never runs while a loader is "
        "timed): PSS summed over the loader's processes, each kind's peak minus that kind "
        "after imports; file-backed pages (a memory-mapped shard) are page cache the kernel can "
        "reclaim. Shared is the machine's shared memory in RAM (`Shmem` of /proc/meminfo), "
        "mapped or not: torch's worker processes keep their prefetched batches in /dev/shm "
        "files that no process maps until the loop takes them, which no PSS shows. Anonymous "
        "+ shared (read together) is what the loader holds that the kernel cannot reclaim.",
        "",
    ]
    for workload, s in results["summary"].items():
        if not s["rows"]:
            continue
        lines += [f"{level} {TITLES.get(workload, workload)}", ""]
        own = (results.get("workload_images") or {}).get(workload)
        if own:  # a workload reading other files than the header's corpus
            lines += [f"Images: {describe_images(own)}.", ""]
        lines += _headline(results, workload, s)
        lines += _table(results, workload, s)
        for loader, r in s["rows"].items():
            errs = [*r.get("errors", []), *r.get("memory_errors", [])]
            if errs:
                lines.append(
                    f"\n{label(results, loader, workload)} failed in some runs: {'; '.join(errs)}"
                )
        lines.append("")
    for workload, table in (results.get("tables") or {}).items():  # e.g. bench_overhead
        import importlib

        from benchmarks.workloads import TABLE_WORKLOADS

        module = importlib.import_module(f"benchmarks.{TABLE_WORKLOADS[workload]}")
        lines += [f"{level} {TITLES.get(workload, workload)}", "", module.markdown(table)]
    if results.get("unavailable"):
        lines += [f"{level} Not measured", "", "| loader | why |", "|---|---|"]
        for k, v in results["unavailable"].items():
            lines.append(f"| {k} | {str(v).splitlines()[0][:300].replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def chart(results: dict, path: Path) -> None:
    """A bar chart of each workload's median rates, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (w, s["rows"])
        for w, s in results["summary"].items()
        if s["rows"] and any(r.get("rate") for r in s["rows"].values())
    ]
    if not panels:
        return
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(9, 2.2 + 0.45 * sum(len(r) for _, r in panels)), squeeze=False
    )
    for ax, (workload, rows) in zip(axes[:, 0], panels):
        kept = [(k, r) for k, r in rows.items() if r.get("rate")]
        names = [
            INGEST_LABELS.get(k, k) if workload == "ingest" else label(results, k, workload)
            for k, _ in kept
        ]
        rates = [r["rate"] for _, r in kept]
        colors = [
            "tab:orange"
            if k.startswith("kuat")
            else "tab:gray"
            if k == "decode-only"
            else "tab:blue"
            for k, _ in kept
        ]
        ax.barh(names[::-1], rates[::-1], color=colors[::-1])
        unit = "images/s" if workload != "tokens" and workload != "hf-rows" else "samples/s"
        ax.set_title(CHART_TITLES.get(workload, workload), fontsize=9)
        ax.set_xlabel(unit)
        for i, v in enumerate(rates[::-1]):
            ax.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    m = results["machine"]
    fig.suptitle(
        f"kuat bench, {m['cpu_count']} cores {m['cpu_model']}, {results['started_utc'][:10]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
