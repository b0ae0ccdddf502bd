"""kuat merge A B ... -o OUT: one dataset holding the rows of A, then B, ...

OUT's shards are hard links to the source shards (no bytes rewritten), or copies where a hard
link is impossible (another file system). OUT's manifest names only files inside OUT, and a
source whose manifest names a file outside itself is refused. The schemas must match;
otherwise the differing field is named.
"""

from __future__ import annotations

import argparse
import sys

from kuat.cli._remote import add_storage_options, storage_options


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "merge",
        help="merge kuat datasets (hard-linking shards where possible)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("sources", nargs="+", help="kuat dataset directories or URLs, in order")
    p.add_argument("-o", "--out", required=True, help="the merged dataset directory or URL")
    p.add_argument(
        "--link",
        choices=("auto", "hardlink", "copy"),
        default="auto",
        help="hard-link shards (falling back to copies: auto), or only one of them",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at OUT")
    add_storage_options(
        p,
        "every URL among SOURCES and --out (stores that need different options: merge in "
        "two steps)",
    )
    return p


def run(args) -> int:
    from kuat.format import merge

    copied = []
    try:
        m = merge(
            args.sources,
            args.out,
            link=args.link,
            overwrite=args.overwrite,
            on_shard=lambda k, path, how: copied.append(how == "copy"),
            storage_options=storage_options(args),
        )
    except (FileExistsError, ValueError, OSError) as e:
        print(f"kuat merge: error: {e}", file=sys.stderr)
        return 1
    print(
        f"merged {len(args.sources)} datasets into {args.out}: {m.num_rows} rows, "
        f"{len(m.shards)} shards ({len(m.shards) - sum(copied)} hard-linked, {sum(copied)} copied)"
    )
    return 0
