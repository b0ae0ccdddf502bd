"""kuat merge A B ... -o OUT: one dataset holding the rows of A, then B, ...

Shard bytes are never rewritten: OUT's manifest lists hard links to the source shards, or
references to them (paths relative to OUT) where hard links are impossible. The schemas
must match; otherwise the differing field is named.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "merge",
        help="merge kuat datasets without copying shards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("sources", nargs="+", help="kuat dataset directories, in order")
    p.add_argument("-o", "--out", required=True, help="the merged dataset directory")
    p.add_argument(
        "--link",
        choices=("auto", "hardlink", "reference"),
        default="auto",
        help="hard-link shards (falling back to references: auto), or only one of them",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at OUT")
    return p


def run(args) -> int:
    from kuat.format import merge

    try:
        m = merge(args.sources, args.out, link=args.link, overwrite=args.overwrite)
    except (FileExistsError, ValueError, OSError) as e:
        print(f"kuat merge: error: {e}", file=sys.stderr)
        return 1
    refs = sum(1 for s in m.shards if "/" in s.file)
    print(
        f"merged {len(args.sources)} datasets into {args.out}: {m.num_rows} rows, "
        f"{len(m.shards)} shards ({len(m.shards) - refs} hard-linked, {refs} referenced)"
    )
    return 0
