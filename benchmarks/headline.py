"""The headline of a ``kuat bench`` run: one row per loader workload, as the README shows it.

Each row is kuat against the strongest torch configuration measured in the same run (the
highest median rate among the workload's torch baselines, :data:`benchmarks.runner.BASELINES`),
as the median (min-max) of the per-round ratios: kuat with thread workers (the default),
with process workers, and the fastest other loader measured. :func:`table` writes the rows as
Markdown and :func:`chart` draws them as a PNG; both read only the run's ``results.json``
(``summary``, ``labels``, ``machine``), so neither can disagree with the full tables of
:func:`benchmarks.report.markdown`. Workloads without a torch baseline (``ingest``, the table
workloads) are left to the full report.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from benchmarks.report import label

# workload -> what it reads and does, for a reader who has not seen the full tables
WHAT = {
    "imagenet-jpeg": "ImageNet-like JPEGs, RandomResizedCrop(224) + flip",
    "smooth-jpeg": "the same on smooth JPEGs (about 0.19 bytes per pixel)",
    "imagenet-jpeg-256": "the same JPEGs stored with the shorter side at 256",
    "tokens": "random 1,025-token windows of a uint16 memmap",
    "hf-rows": "a Hugging Face `datasets.Dataset`, padding collate",
}
# the PNG's text chunk holding :func:`digest` of the results it was drawn from
DIGEST_KEY = "kuat-results-sha256"


def digest(results: dict) -> str:
    """SHA-256 of ``results`` as canonical JSON: the chart stores it, so a test can tell a
    chart drawn from other results."""
    return hashlib.sha256(json.dumps(results, sort_keys=True, default=str).encode()).hexdigest()


def _vs(row: dict | None, base: str) -> dict | None:
    return None if row is None else row.get("vs", {}).get(base)


def headlines(results: dict) -> list[dict]:
    """One dict per workload whose strongest baseline is a torch configuration and that kuat
    ran: ``workload``, ``unit`` (``images``/``samples``), ``rate`` (kuat threads, per second),
    ``base`` and ``base_rate`` (the strongest torch configuration's label and median rate),
    ``threads`` and ``processes`` (``{"median", "min", "max"}`` of the per-round ratios to
    ``base``; ``processes`` None when not run), ``peer`` (label of the fastest other loader
    with a ratio, or None) and ``peer_vs`` (its ratios)."""
    out = []
    for workload, s in results["summary"].items():
        strongest, rows = s.get("strongest"), s["rows"]
        if not strongest or strongest.startswith("kuat") or not _vs(rows.get("kuat"), strongest):
            continue
        others = [
            (r["rate"], loader)
            for loader, r in rows.items()
            if not loader.startswith("kuat")
            and loader not in s.get("baselines", ())
            and loader != s.get("reference")
            and r.get("rate")
            and _vs(r, strongest)
        ]
        peer = max(others)[1] if others else None
        out.append(
            {
                "workload": workload,
                "unit": "samples" if workload in ("tokens", "hf-rows") else "images",
                "rate": rows["kuat"]["rate"],
                "base": label(results, strongest, workload),
                "base_rate": rows[strongest]["rate"],
                "threads": _vs(rows["kuat"], strongest),
                "processes": _vs(rows.get("kuat-proc"), strongest),
                "peer": label(results, peer, workload) if peer else None,
                "peer_vs": _vs(rows.get(peer), strongest) if peer else None,
            }
        )
    return out


def _x(v: dict | None, bold: bool = False) -> str:
    """``1.98x (1.96-1.99)``; ``–`` when not measured."""
    if v is None:
        return "–"
    lo, hi = f"{v['min']:.2f}", f"{v['max']:.2f}"
    head = f"**{v['median']:.2f}x**" if bold else f"{v['median']:.2f}x"
    return head if lo == hi else f"{head} ({lo}-{hi})"


def table(results: dict) -> str:
    """The headline rows as a Markdown table (ratios: median (min-max) over rounds)."""
    lines = [
        "| workload | kuat (threads), per s | x torch's strongest | torch's strongest "
        "configuration, per s | kuat (processes), x the same | fastest other loader, "
        "x the same |",
        "|---|---:|---:|---|---:|---|",
    ]
    for h in headlines(results):
        peer = f"{h['peer']}: {_x(h['peer_vs'])}" if h["peer"] else "–"
        lines.append(
            f"| {h['workload']}: {WHAT.get(h['workload'], '')} | "
            f"{h['rate']:,.0f} {h['unit']} | {_x(h['threads'], bold=True)} | "
            f"{h['base']}: {h['base_rate']:,.0f} | {_x(h['processes'])} | {peer} |"
        )
    return "\n".join(lines)


def chart(results: dict, path: Path) -> None:
    """Draw the headline rows as a horizontal bar chart (PNG at ``path``): per workload, kuat
    with threads, with processes and the fastest other loader, as multiples of the strongest
    torch configuration (the line at 1), bars at the median, whiskers at the lowest and
    highest round. The PNG's text chunk :data:`DIGEST_KEY` holds :func:`digest` of
    ``results``. Needs matplotlib (``kuat[demo]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = headlines(results)
    series = [
        ("kuat (threads)", "threads", "tab:orange"),
        ("kuat (processes)", "processes", "#f5c48a"),
        ("fastest other loader", "peer_vs", "tab:gray"),
    ]
    height = 0.26
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.95 * len(rows)))
    top = max(
        (h[key]["max"] for h in rows for _, key, _ in series if h[key] is not None), default=1
    )
    labelled = set()
    for i, h in enumerate(rows):
        for j, (name, key, color) in enumerate(series):
            v = h[key]
            if v is None:
                continue
            y = i + (j - 1) * height
            ax.barh(
                y,
                v["median"],
                height,
                color=color,
                label=None if name in labelled else name,
                xerr=[[v["median"] - v["min"]], [v["max"] - v["median"]]],
                error_kw={"elinewidth": 0.8, "capsize": 2},
            )
            labelled.add(name)
            text = f" {v['median']:.2f}x" + (f"  {h['peer']}" if key == "peer_vs" else "")
            ax.text(
                v["max"] + 0.005 * top, y, text, va="center", fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3, "alpha": 0.8},
            )
    ax.axvline(1.0, color="black", linewidth=1, linestyle="--", label="torch's strongest (= 1)")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([h["workload"] for h in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first workload on top
    ax.set_xlim(0, top * 1.25)
    ax.set_xlabel(
        "samples per second as a multiple of torch's strongest configuration in the same round\n"
        "(bar: median over rounds; whisker: lowest to highest round)",
        fontsize=9,
    )
    ax.legend(loc="upper right", fontsize=8, frameon=False)
    m = results["machine"]
    ax.set_title(
        f"kuat against torch's strongest DataLoader configuration: kuat bench, "
        f"{m['cpu_count']} cores ({m['cpu_model']}), {results['started_utc'][:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={DIGEST_KEY: digest(results)})
    plt.close(fig)


def chart_digest(path: Path) -> str | None:
    """The :data:`DIGEST_KEY` a chart written by :func:`chart` carries (None if absent)."""
    from PIL import Image

    with Image.open(path) as im:
        return im.info.get(DIGEST_KEY)
