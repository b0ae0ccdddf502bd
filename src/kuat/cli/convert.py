"""``kuat convert SRC... DST``: convert a dataset into the kuat format (see ``DESCRIPTION``,
which is also the command's ``--help`` text)."""

from __future__ import annotations

import argparse
import logging
import sys

from kuat.cli._remote import add_storage_options, storage_options

FORMATS = ("auto", "imagefolder", "hf", "parquet", "jsonl", "csv", "numpy", "webdataset")
_MAX_SHARD_BYTES = 1 << 30  # kuat.format.writer's limit, repeated so --help imports nothing

DESCRIPTION = """\
Convert a dataset into a kuat dataset directory (Arrow shards + manifest.json).

The source type is detected (--format forces it): a directory of class folders
(ImageFolder), a Hugging Face save_to_disk directory, .parquet / .jsonl / .json /
.csv / .tsv files, .npy / .npz arrays, or WebDataset .tar shards (files or globs).
When stderr is not a terminal (a log file, a batch job), a progress line is logged
every --progress-interval seconds instead of a progress bar.

examples:
  kuat convert imagenet/train train.kuat --workers 16
  kuat convert imagenet/train train256.kuat --resize-shorter 256 --quality 90
  kuat convert 'shards/*.tar' wds.kuat --on-error skip
  kuat convert data.parquet table.kuat --image-field picture
  kuat convert data.txt table.kuat --format csv --delimiter '|'
  kuat convert imagenet21k/train in21k.kuat --engine ray    (on the cluster RAY_ADDRESS names)
  kuat convert imagenet21k/train s3://bucket/in21k.kuat --engine ray
      (tasks write shards straight to the bucket; rerun the same command to resume)
"""


# the options of ConvertOptions that tokenizing text uses (the rest are image options)
_TEXT_OPTIONS = (
    "num_workers", "progress", "progress_interval_s", "overwrite", "on_error", "shard_bytes"
)  # fmt: skip


def _int_in(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            where = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {where}, got {value}")
        return value

    return parse


def _size(text: str) -> int:
    """``256M``, ``1G``, ``65536`` -> bytes (binary units)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 256M, 1G or 65536, got {text!r}"
        ) from None
    if not 1 <= value <= _MAX_SHARD_BYTES:
        raise argparse.ArgumentTypeError(f"must be between 1 byte and 1G, got {text!r}")
    return value


class _DropSkippedSummary(logging.Filter):
    """The command prints the skipped samples one per line; drop the library's one-line list."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("skipped %d unreadable")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "convert",
        help="convert ImageFolder / HF / Parquet / JSONL / CSV / NumPy / WebDataset to kuat",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", nargs="+", help="source directory, file(s) or glob(s)")
    p.add_argument("dst", help="the kuat dataset directory or URL (s3://...) to write")
    p.add_argument(
        "--format", choices=FORMATS, default="auto", help="source type (default: detect)"
    )
    p.add_argument(
        "--workers", type=_int_in(1), default=None, help="threads (default: one per core)"
    )
    p.add_argument(
        "--resize-shorter",
        type=_int_in(1),
        default=None,
        metavar="PX",
        help="re-encode images whose shorter side exceeds PX to exactly PX (default: keep bytes)",
    )
    p.add_argument(
        "--quality",
        type=_int_in(1, 100),
        default=90,
        help="JPEG quality of re-encoded images, 1-100 (default 90)",
    )
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="unreadable images: stop naming the file (raise), or skip and list them at the end",
    )
    p.add_argument(
        "--decode-check",
        action="store_true",
        help="fully decode each image (slower); truncated JPEG/PNG/WebP/BMP files are "
        "always caught by their end markers",
    )
    p.add_argument(
        "--shard-bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="target shard size, e.g. 256M (default 128M, at most 1G)",
    )
    p.add_argument(
        "--image-field",
        action="append",
        default=[],
        metavar="COLUMN",
        help="(tables) a column holding image bytes or paths; repeatable",
    )
    p.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local: this machine's threads (default); ray: Ray Data tasks on the cluster "
        "ray.init() finds (RAY_ADDRESS), writing shards into DST: a path every node mounts, or "
        "a URL (s3://...); a rerun resumes (ImageFolder, Parquet, JSONL, CSV; needs kuat[ray])",
    )
    p.add_argument(
        "--rows-per-task",
        type=_int_in(1),
        default=1000,
        metavar="N",
        help="(--engine ray, ImageFolder) images one Ray task converts (default 1000, about "
        "one 128M shard of ImageNet JPEGs); tables take one task per input file",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="(--engine ray) start over instead of resuming the parts an interrupted run of "
        "the same conversion finished",
    )
    p.add_argument("--split", default=None, help="(hf) the split of a DatasetDict")
    p.add_argument(
        "--delimiter",
        default=None,
        metavar="CHAR",
        help="(csv) the field separator (default: tab for .tsv/.tab, else comma)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="(text) tokenize JSONL/Parquet/.txt records at ingest with this tokenizer.json "
        "(or a local transformers tokenizer directory) into token sequences",
    )
    p.add_argument(
        "--text-field", default="text", help="(text) the field holding the text (default text)"
    )
    p.add_argument(
        "--eos-id",
        type=_int_in(0),
        default=None,
        help="(text) the eos token id appended to each document (default: the tokenizer's "
        "own, if it names one; else none)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at DST")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--progress-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds between progress lines when stderr is not a terminal (default 30)",
    )
    add_storage_options(p, "every URL among the sources and the destination")
    return p


def run(args) -> int:
    import kuat.convert
    from kuat.errors import KuatError

    options = dict(
        num_workers=args.workers,
        progress=not args.no_progress,
        progress_interval_s=args.progress_interval,
        overwrite=args.overwrite,
        on_error=args.on_error,
        resize_shorter=args.resize_shorter,
        quality=args.quality,
        decode_check=args.decode_check,
        shard_bytes=args.shard_bytes,
        storage_options=storage_options(args),
    )
    if args.engine != "local":  # only the converters with a Ray engine take these
        options.update(
            engine=args.engine, rows_per_task=args.rows_per_task, restart=args.restart
        )
    drop = _DropSkippedSummary()
    logging.getLogger("kuat.convert").addFilter(drop)
    try:
        if args.tokenizer is not None:
            from kuat.text.tokenize import load_tokenizer

            report = kuat.convert.from_text(
                args.src,
                args.dst,
                load_tokenizer(args.tokenizer),
                text_field=args.text_field,
                eos_id=args.eos_id,
                **{k: options[k] for k in _TEXT_OPTIONS},
            )
        else:
            report = kuat.convert.convert(
                args.src,
                args.dst,
                format=args.format,
                image_fields=args.image_field,
                split=args.split,
                delimiter=args.delimiter,
                **options,
            )
    except (KuatError, OSError, ValueError, TypeError) as e:  # unreadable input, existing DST...
        print(f"kuat convert: error: {e}", file=sys.stderr)
        return 1
    finally:
        logging.getLogger("kuat.convert").removeFilter(drop)
    rate = report.rows / report.seconds if report.seconds > 0 else float("inf")
    print(
        f"wrote {report.rows} rows to {report.path} in {report.seconds:.1f} s ({rate:.0f} rows/s)"
    )
    if report.skipped:
        print(f"skipped {len(report.skipped)} unreadable sample(s):")
        for where, why in report.skipped:
            print(f"  {why}" if str(where) in why else f"  {where}: {why}")
    return 0
