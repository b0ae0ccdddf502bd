"""kuat verify PATH: re-check every shard's checksum, size, schema and row count; with
--images also every image header (and completeness), with --decode a full decode of every
image (finds truncated or corrupt images stored by an older convert).

Exit status 0 when all shards are intact, 1 otherwise (each bad shard is named).
"""

from __future__ import annotations

import argparse
import sys

from kuat.cli._remote import add_storage_options, storage_options


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "verify",
        help="re-check a kuat dataset's checksums and row counts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", help="the kuat dataset directory or URL")
    add_storage_options(p, "the URL PATH")
    p.add_argument(
        "--images",
        action="store_true",
        help="also probe every image header against its stored width/height/codec",
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help="also fully decode every image (slow; finds truncated or corrupt images)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args) -> int:
    from kuat.format import read_manifest, verify

    so = storage_options(args)
    total = len(read_manifest(args.path, storage_options=so).shards)
    bar = None
    if not args.no_progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, desc="verify", unit="shard")
    try:
        report = verify(
            args.path,
            images=args.images,
            decode=args.decode,
            on_shard=lambda k, p: bar and bar.update(),
            storage_options=so,
        )
    finally:
        if bar is not None:
            bar.close()
    for e in report.errors:
        msg = str(e).removeprefix(f"shard {e.path} ")  # the path is said once, up front
        print(f"BAD {e.path}: {msg}")
    if report.ok:
        shards = f"{report.shards} shard" + ("" if report.shards == 1 else "s")
        print(f"OK {report.path}: {report.rows} rows, {shards}, {report.bytes} bytes")
        return 0
    print(f"FAILED {report.path}: {len(report.errors)} of {report.shards} shards are bad")
    return 1
