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


def add_storage_options(p: argparse.ArgumentParser, applies_to: str = "the URL argument") -> None:
    """``--storage-option KEY=VALUE`` (repeatable). One set of options serves every URL of a
    command (``applies_to`` says which arguments, in ``--help``), as one ``storage_options``
    dict does in the library; local paths ignore it. URLs of stores that need different
    options (two endpoints, two sets of keys) take two commands, or each backend's own
    configuration (``AWS_*``/``~/.aws`` profiles for S3, ``gcloud`` credentials for GCS)."""
    p.add_argument(
        "--storage-option",
        metavar="KEY=VALUE",
        type=_pair,
        action="append",
        default=[],
        help=f"fsspec storage option, repeatable (endpoint_url=http://..., anon=true); one set "
        f"for {applies_to}, local paths ignore it; credentials also come from the backend's "
        "environment (AWS_*)",
    )


def storage_options(args) -> dict | None:
    """The ``--storage-option`` pairs as a dict, or ``None`` without any."""
    pairs = getattr(args, "storage_option", None) or []
    return dict(pairs) or None
