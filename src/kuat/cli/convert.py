"""``kuat convert SRC... DST``: convert a dataset into the kuat format.

The source type is detected (``--format`` forces it): a directory of class folders
(ImageFolder), a Hugging Face ``save_to_disk`` directory, ``.parquet``/``.jsonl``/``.csv``
files, ``.npy``/``.npz`` arrays or WebDataset ``.tar`` shards (files or globs).

Examples::

    kuat convert imagenet/train train.kuat --workers 16
    kuat convert imagenet/train train256.kuat --resize-shorter 256 --quality 90
    kuat convert 'shards/*.tar' wds.kuat --on-error skip
    kuat convert data.parquet table.kuat --image-field picture
"""

from __future__ import annotations

import argparse
import sys

FORMATS = ("auto", "imagefolder", "hf", "parquet", "jsonl", "csv", "numpy", "webdataset")


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "convert",
        help="convert ImageFolder / HF / Parquet / JSONL / CSV / NumPy / WebDataset to kuat",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", nargs="+", help="source directory, file(s) or glob(s)")
    p.add_argument("dst", help="the kuat dataset directory to write")
    p.add_argument(
        "--format", choices=FORMATS, default="auto", help="source type (default: detect)"
    )
    p.add_argument("--workers", type=int, default=None, help="threads (default: one per core)")
    p.add_argument(
        "--resize-shorter",
        type=int,
        default=None,
        metavar="PX",
        help="re-encode images whose shorter side exceeds PX to exactly PX (default: keep bytes)",
    )
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded images")
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="unreadable images: stop naming the file (raise), or skip and list them at the end",
    )
    p.add_argument("--decode-check", action="store_true", help="fully decode each image (slower)")
    p.add_argument("--shard-bytes", type=_size, default=None, help="target shard size, e.g. 256M")
    p.add_argument(
        "--image-field",
        action="append",
        default=[],
        metavar="COLUMN",
        help="(tables) a column holding image bytes or paths; repeatable",
    )
    p.add_argument("--split", default=None, help="(hf) the split of a DatasetDict")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at DST")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args) -> int:
    import kuat.convert

    options = dict(
        num_workers=args.workers,
        progress=not args.no_progress,
        overwrite=args.overwrite,
        on_error=args.on_error,
        resize_shorter=args.resize_shorter,
        quality=args.quality,
        decode_check=args.decode_check,
        shard_bytes=args.shard_bytes,
    )
    try:
        report = kuat.convert.convert(
            args.src,
            args.dst,
            format=args.format,
            image_fields=args.image_field,
            split=args.split,
            **options,
        )
    except (FileExistsError, FileNotFoundError, ValueError, TypeError) as e:
        print(f"kuat convert: error: {e}", file=sys.stderr)
        return 1
    rate = report.rows / report.seconds if report.seconds > 0 else float("inf")
    print(
        f"wrote {report.rows} rows to {report.path} in {report.seconds:.1f} s ({rate:.0f} rows/s)"
    )
    if report.skipped:
        print(f"skipped {len(report.skipped)} unreadable sample(s):")
        for where, why in report.skipped:
            print(f"  {where}: {why}")
    return 0
