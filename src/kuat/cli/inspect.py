"""kuat inspect PATH: a kuat dataset's schema, rows, shards, bytes and a few sample rows.

Reads the manifest and only the shards holding the rows shown; images are not decoded. Text
from the dataset (field names, metadata, codecs) is printed with control characters escaped:
an untrusted dataset must not drive the terminal.
"""

from __future__ import annotations

import argparse
import json

from kuat.cli._remote import add_storage_options, storage_options


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inspect",
        help="show a kuat dataset's schema, size and sample rows",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", help="the kuat dataset directory or URL")
    add_storage_options(p, "the URL PATH")
    p.add_argument("-n", "--rows", type=int, default=3, help="sample rows to show (default 3)")
    p.add_argument("--json", action="store_true", help="print the manifest summary as JSON")
    return p


def _safe(text: object) -> str:
    """``str(text)`` with every non-printable character (ESC, CR, ...) as a Python escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _value(v) -> str:
    import numpy as np

    from kuat.format import EncodedImage

    if isinstance(v, EncodedImage):
        return f"<{_safe(v.codec)} {v.width}x{v.height}, {len(v.data):,} B>"
    if isinstance(v, np.ndarray):
        flat = v.reshape(-1)
        head = ", ".join(str(x) for x in flat[:6].tolist()) + (", ..." if flat.size > 6 else "")
        return f"<{v.dtype} {tuple(v.shape)}: {head}>"
    if isinstance(v, bytes):
        return f"<{len(v)} bytes: {v[:16]!r}{'...' if len(v) > 16 else ''}>"
    if isinstance(v, str):
        return repr(v if len(v) <= 60 else v[:57] + "...")
    return repr(v)


def _names(meta: dict) -> str:
    names = meta.get("names")
    if not isinstance(names, list):
        return ""
    head = ", ".join(map(_safe, names[:5])) + (", ..." if len(names) > 5 else "")
    return f"  ({len(names)} names: {head})"


def run(args) -> int:
    import kuat

    ds = kuat.open(args.path, storage_options=storage_options(args))
    m = ds.manifest
    if args.json:
        summary = {
            "path": str(ds.path),
            "version": m.version,
            "created_by": m.created_by,
            "rows": len(ds),
            "shards": len(m.shards),
            "bytes": m.num_bytes,
            "schema": m.schema.to_json(),
            "metadata_keys": sorted(m.metadata),
        }
        print(json.dumps(summary, indent=1))
        return 0
    n_shards = len(m.shards)
    mean = m.num_bytes // n_shards if n_shards else 0
    print(f"kuat dataset  {ds.path}")
    print(f"format        kuat v{m.version} (written by {_safe(m.created_by) or 'unknown'})")
    print(f"rows          {len(ds):,}")
    print(f"shards        {n_shards:,} ({_bytes(m.num_bytes)}; mean {_bytes(mean)} per shard)")
    print("schema")
    width = max(len(_safe(f.name)) for f in m.schema)
    for f in m.schema:
        print(f"  {_safe(f.name):<{width}}  {f.type.describe()}{_names(f.metadata)}")
    if m.metadata:
        parts = []
        for k, v in m.metadata.items():
            if isinstance(v, (list, dict)):
                parts.append(f"{_safe(k)}=[{len(v)}]")
            else:
                parts.append(f"{_safe(k)}={_safe(v)}")
        print(f"metadata      {', '.join(parts)}")
    shown = min(max(args.rows, 0), len(ds))
    if shown:
        print(f"sample rows (first {shown})")
        for i in range(shown):
            row = ds.raw(i)
            print(f"  [{i}] " + "  ".join(f"{_safe(k)}={_value(v)}" for k, v in row.items()))
    return 0
