"""Turn a ``results.json`` of ``kuat bench`` into a Markdown report and a PNG bar chart.

:func:`markdown` is also what ``kuat bench --table RESULTS.json`` prints for the README:
machine (cores, CPU model), date, the version of every peer, then one table per workload.
"""

from __future__ import annotations

from pathlib import Path

TITLES = {
    "imagenet-jpeg": "imagenet-jpeg: demo JPEGs, RandomResizedCrop(224) + flip, uint8 "
    "(64, 3, 224, 224) out",
    "imagenet-jpeg-256": "imagenet-jpeg-256: kuat on the dataset converted with "
    "--resize-shorter 256 (torch reads the original files)",
    "tokens": "tokens: random windows of 1,025 uint16 tokens from one memmap, batch 32, int64 out",
    "hf-rows": "hf-rows: datasets.Dataset of variable-length int32 lists, padding collate, "
    "batch 64",
    "ingest": "ingest: converting the ImageFolder into each format",
}


# ingest rows name the writer, not the loader
INGEST_LABELS = {
    "kuat": "kuat convert (original bytes)",
    "kuat-ray": "kuat convert --engine ray, 1 local node (incl. Ray start-up)",
    "kuat-ray-2": "kuat convert --engine ray, 2 local nodes (incl. Ray start-up)",
    "ffcv": "FFCV DatasetWriter (re-encodes)",
    "streaming": "Mosaic MDSWriter",
    "litdata": "LitData optimize",
    "webdataset": "WebDataset ShardWriter",
}
CHART_TITLES = {
    "imagenet-jpeg": "imagenet-jpeg: RandomResizedCrop(224) + flip, uint8 out",
    "imagenet-jpeg-256": "imagenet-jpeg-256: kuat on --resize-shorter 256, torch on originals",
    "tokens": "tokens: random 1,025-token windows, batch 32",
    "hf-rows": "hf-rows: variable-length rows, padding collate, batch 64",
    "ingest": "ingest: ImageFolder into each format",
}


def _f(v, fmt: str = "{:.0f}") -> str:
    return "–" if v is None else fmt.format(v)


def _versions_line(results: dict) -> str:
    seen: dict[str, str] = {}
    for vs in results.get("versions", {}).values():
        for k, v in vs.items():
            seen.setdefault(k, str(v))
    return ", ".join(f"{k} {v}" for k, v in sorted(seen.items()))


def markdown(results: dict) -> str:
    """The whole report: header (machine, date, versions, run settings) and tables."""
    m, c = results["machine"], results["config"]
    labels = results.get("labels", {})
    lines = [
        "# kuat bench results",
        "",
        f"- Machine: {m['cpu_count']} cores, {m['cpu_model']}, {m['memory_gib']} GiB RAM, "
        f"{m['platform']}, Python {m['python']}",
        f"- Date: {results['started_utc']} to {results['finished_utc']} (UTC)",
        f"- Settings: {'quick' if c['quick'] else 'full'} run, {c['runs']} interleaved rounds, "
        f"{c['epochs']} epochs per run (first = warm-up, excluded from the rate), "
        f"{c['num_workers']} workers for every loader, {c['num_images']} images",
        f"- Versions: {_versions_line(results)}",
        "",
        'Rates are medians over rounds of the steady-state epochs; "vs torch" is the median '
        "of per-round ratios to torch's DataLoader in the same round. Memory is PSS summed over "
        "the loader's processes; \"added\" subtracts the process's PSS after imports.",
        "",
    ]
    for workload, rows in results["summary"].items():
        if not rows:
            continue
        lines += [f"## {TITLES.get(workload, workload)}", ""]
        if workload == "ingest":
            lines += [
                "| writer | images/s | kuat is N x faster | CPU s / 1k images | output MiB |",
                "|---|---:|---:|---:|---:|",
            ]
            for loader, r in rows.items():
                inv = (1.0 / r["ratio_to_baseline"]) if r.get("ratio_to_baseline") else None
                lines.append(
                    f"| {INGEST_LABELS.get(loader, loader)} | {_f(r['rate'])} | "
                    f"{_f(inv, '{:.2f}')} | "
                    f"{_f(r['cpu_s_per_1k'], '{:.1f}')} | {_f(r.get('output_mib'))} |"
                )
        else:
            unit = "samples/s" if workload in ("tokens", "hf-rows") else "images/s"
            lines += [
                f"| loader | {unit} | vs torch | CPU s / 1k | time to first batch s | "
                "set-up s | peak PSS MiB | added MiB |",
                "|---|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for loader, r in rows.items():
                lines.append(
                    f"| {labels.get(loader, loader)} | {_f(r['rate'])} | "
                    f"{_f(r['ratio_to_baseline'], '{:.2f}')} | "
                    f"{_f(r['cpu_s_per_1k'], '{:.2f}')} | {_f(r.get('ttfb_s'), '{:.2f}')} | "
                    f"{_f(r.get('setup_s'), '{:.2f}')} | {_f(r.get('peak_pss_mib'))} | "
                    f"{_f(r.get('added_pss_mib'))} |"
                )
            if workload == "imagenet-jpeg" and "decode-only" in rows and "kuat" in rows:
                lim, k = rows["decode-only"]["rate"], rows["kuat"]["rate"]
                if lim and k:
                    lines += [
                        "",
                        f"kuat (threads) reaches {100 * k / lim:.0f}% of the decode-only limit.",
                    ]
        failed = {ld: r["errors"] for ld, r in rows.items() if r.get("errors")}
        for loader, errs in failed.items():
            lines.append(f"\n{labels.get(loader, loader)} failed in some runs: {'; '.join(errs)}")
        lines.append("")
    if results.get("unavailable"):
        lines += ["## Not measured", "", "| loader | why |", "|---|---|"]
        for k, v in results["unavailable"].items():
            lines.append(f"| {k} | {str(v).splitlines()[0][:300].replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def chart(results: dict, path: Path) -> None:
    """A bar chart of each workload's rate relative to its baseline, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (w, rows)
        for w, rows in results["summary"].items()
        if rows and any(r.get("rate") for r in rows.values())
    ]
    if not panels:
        return
    labels = results.get("labels", {})
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(9, 2.2 + 0.45 * sum(len(r) for _, r in panels)), squeeze=False
    )
    for ax, (workload, rows) in zip(axes[:, 0], panels):
        names_of = INGEST_LABELS if workload == "ingest" else labels
        names = [names_of.get(k, k) for k, r in rows.items() if r.get("rate")]
        rates = [r["rate"] for r in rows.values() if r.get("rate")]
        colors = [
            "tab:orange" if n.startswith("kuat") else "tab:gray" if "decode" in n else "tab:blue"
            for n in names
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
