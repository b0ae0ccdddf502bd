"""``--storage-option KEY=VALUE``: fsspec storage options for URL arguments of the CLI."""

from __future__ import annotations

import argparse
import json


def _pair(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, json.loads(value)  # numbers, true/false, objects
    except ValueError:
        return key, value


def add_storage_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-option",
        metavar="KEY=VALUE",
        type=_pair,
        action="append",
        default=[],
        help="fsspec storage option for URL paths, repeatable (endpoint_url=http://..., "
        "anon=true); credentials also come from the backend's environment (AWS_*)",
    )


def storage_options(args) -> dict | None:
    """The ``--storage-option`` pairs as a dict, or ``None`` without any."""
    pairs = getattr(args, "storage_option", None) or []
    return dict(pairs) or None
