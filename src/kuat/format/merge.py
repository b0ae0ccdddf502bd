"""Merge kuat datasets into one without rewriting shard bytes: a new manifest whose shards
are hard links to the sources' shards, or references to them where a hard link is not
possible (another file system, no permission)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from kuat.errors import SchemaError
from kuat.format.manifest import MANIFEST_NAME, Manifest, ShardInfo, read_manifest, write_manifest
from kuat.format.writer import (
    _SHARD_RE,
    LOCK_NAME,
    _version,
    lock_directory,
    shard_name,
    unlock_directory,
)

__all__ = ["merge", "LINK_MODES"]

log = logging.getLogger("kuat.format.merge")

LINK_MODES = ("auto", "hardlink", "reference")


def merge(
    sources: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    link: str = "auto",
    overwrite: bool = False,
) -> Manifest:
    """Write a dataset at ``out`` holding the rows of ``sources`` in order.

    Args:
        sources: kuat dataset directories; their schemas (names, types, and field metadata
            such as class names) must be equal.
        out: the new dataset directory.
        link: ``"hardlink"`` links every shard into ``out`` (fails if impossible);
            ``"reference"`` records each shard's path relative to ``out`` in the manifest;
            ``"auto"`` (default) hard-links and falls back to a reference per shard.
        overwrite: replace a dataset at ``out``.

    The manifest keeps each shard's rows, bytes and checksum from its source (nothing is
    re-read) and the first source's metadata, plus ``merged_from``.

    Returns:
        the new :class:`Manifest`.

    Raises:
        kuat.SchemaError: the schemas differ; names the field and the dataset.
        kuat.FormatError: a source is not a valid dataset.
        FileExistsError: ``out`` is a dataset, or a non-empty directory, and ``overwrite``
            is False.
        ValueError: ``out`` holds shards of a source (it is one of them, or a source
            references shards in it): writing there would delete them.
        OSError: ``link="hardlink"`` and a shard cannot be linked.
    """
    if link not in LINK_MODES:
        raise ValueError(f"link={link!r} must be one of {LINK_MODES}")
    if not sources:
        raise ValueError("merge needs at least one source dataset")
    roots = [Path(s) for s in sources]
    manifests = [read_manifest(r) for r in roots]
    first = manifests[0]
    for root, m in zip(roots[1:], manifests[1:]):
        diff = first.schema.difference(m.schema)
        if diff is not None:
            raise SchemaError(f"cannot merge {roots[0]} and {root}: {diff}")
        for a, b in zip(first.schema, m.schema):
            if a.metadata != b.metadata:
                raise SchemaError(
                    f"cannot merge {roots[0]} and {root}: field {a.name!r} has different "
                    f"metadata ({a.metadata} vs {b.metadata}), e.g. other class names",
                    field=a.name,
                )
    out = Path(out)
    out_abs = out.resolve()
    sources_in_out = [
        root
        for root, m in zip(roots, manifests)
        if any((root / info.file).resolve().parent == out_abs for info in m.shards)
    ]
    if sources_in_out:
        # replacing out's shards would delete the very files the new manifest links to
        raise ValueError(
            f"cannot merge into {out}: it holds shards of {sources_in_out[0]}, which a merge "
            "there would delete; write the merged dataset to a new directory"
        )
    if (out / MANIFEST_NAME).exists() and not overwrite:
        raise FileExistsError(
            f"{out} is already a kuat dataset; pass overwrite=True (--overwrite) to replace it"
        )
    if out.is_dir() and not overwrite:
        others = [
            e.name for e in os.scandir(out) if not _SHARD_RE.match(e.name) and e.name != LOCK_NAME
        ]
        if others:
            raise FileExistsError(
                f"{out} is a non-empty directory that is not a kuat dataset ({others[0]!r}, "
                "...); pass overwrite=True (--overwrite) to write into it anyway"
            )
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_directory(out)  # a Writer busy in `out` would lose its shards to us
    try:
        return _merge_into(out, roots, manifests, link)
    finally:
        unlock_directory(out, lock)


def _merge_into(out: Path, roots: list[Path], manifests: list, link: str) -> Manifest:
    out_abs = out.resolve()
    if (out / MANIFEST_NAME).exists():
        (out / MANIFEST_NAME).unlink()
    for e in os.scandir(out):
        if _SHARD_RE.match(e.name) and e.is_file():
            os.unlink(e.path)
    shards = []
    linked = referenced = 0
    for root, m in zip(roots, manifests):
        for info in m.shards:
            src = (root / info.file).resolve()
            name = shard_name(len(shards))
            entry = None
            if link != "reference":
                try:
                    os.link(src, out / name)
                    entry = name
                    linked += 1
                except OSError as e:
                    if link == "hardlink":
                        raise
                    log.debug("cannot hard-link %s (%s); referencing it", src, e)
            if entry is None:
                entry = os.path.relpath(src, out_abs)
                referenced += 1
            shards.append(ShardInfo(entry, info.rows, info.bytes, info.checksum))
    first = manifests[0]
    metadata = dict(first.metadata)
    metadata["merged_from"] = [str(r) for r in roots]
    manifest = Manifest(
        schema=first.schema,
        shards=tuple(shards),
        metadata=metadata,
        created_by=f"kuat {_version()}",
    )
    write_manifest(out, manifest)
    log.debug(  # the CLI prints this summary
        "merged %d datasets into %s: %d rows, %d shards (%d hard-linked, %d referenced)",
        len(roots),
        out,
        manifest.num_rows,
        len(shards),
        linked,
        referenced,
    )
    return manifest
