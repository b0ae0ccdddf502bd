"""Merge kuat datasets into one: a new manifest whose shards are hard links to the sources'
shards (no bytes rewritten), or copies where a hard link is impossible (another file system, no
permission).

The sources are untrusted (``docs/format.md``, "Trust"): each shard is located by
:func:`kuat.format.members.member_path`, so a source's manifest can never make merge link or
copy a file from outside that source into ``out`` (which its owner may then upload).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kuat.errors import FormatError, SchemaError
from kuat.format.fs import Remote, is_url, local_path, open_remote, retry
from kuat.format.layout import (
    check_writable,
    lock_directory,
    prepare_remote,
    remove_leftovers,
    shard_name,
    temporary_path,
    unlock_directory,
)
from kuat.format.manifest import (
    Manifest,
    ShardInfo,
    file_checksum,
    read_manifest,
    write_manifest,
    writer_name,
)
from kuat.format.members import MANIFEST_NAME, check_regular_file, member_path

__all__ = ["merge", "LINK_MODES"]

log = logging.getLogger("kuat.format.merge")

LINK_MODES = ("auto", "hardlink", "copy")


def merge(
    sources: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    link: str = "auto",
    overwrite: bool = False,
    on_shard: Callable[[int, str, str], None] | None = None,
    storage_options: Mapping | None = None,
) -> Manifest:
    """Write a dataset at ``out`` holding the rows of ``sources`` in order.

    Args:
        sources: kuat dataset directories; their schemas (names, types, and field metadata
            such as class names) must be equal.
        out: the new dataset directory.
        link: ``"hardlink"`` links every shard into ``out`` (fails if impossible);
            ``"copy"`` copies every shard's bytes; ``"auto"`` (default) hard-links and falls
            back to a copy per shard. A merged manifest only ever names files inside ``out``.
        overwrite: replace a dataset at ``out``.
        on_shard: called as ``on_shard(k, shard_path, how)`` after shard ``k`` of the output
            is in place, ``how`` being ``"hardlink"`` or ``"copy"`` (progress, counts).
        storage_options: fsspec options for every URL among ``sources`` and ``out``.

    Sources and ``out`` may be URLs (``s3://...``, see :mod:`kuat.format.fs`): shards are
    then copied (server-side within one file system, else downloaded and uploaded, with
    retries; a downloaded shard's checksum is checked), and ``out``'s manifest is written last.

    The manifest keeps each shard's rows, bytes and checksum from its source (a shard is not
    re-read, but its size must equal the recorded ``bytes``) and the first source's metadata,
    plus ``merged_from``.

    Returns:
        the new :class:`Manifest`.

    Raises:
        kuat.SchemaError: the schemas differ; names the field and the dataset.
        kuat.FormatError: a source is not a valid dataset, or a shard of it is missing, not a
            regular file, of another size than recorded, or a symbolic link out of its
            dataset (names the source and the shard).
        FileExistsError: ``out`` is a dataset, or a non-empty directory, and ``overwrite``
            is False.
        ValueError: ``out`` holds shards of a source (it is one of them): writing there would
            delete them.
        OSError: ``link="hardlink"`` and a shard cannot be linked, or a copy fails.
    """
    if link not in LINK_MODES:
        raise ValueError(f"link={link!r} must be one of {LINK_MODES}")
    if not sources:
        raise ValueError("merge needs at least one source dataset")
    remotes = {
        os.fspath(s): open_remote(os.fspath(s), storage_options) for s in sources if is_url(s)
    }
    roots = [remotes[os.fspath(s)].url if is_url(s) else Path(local_path(s)) for s in sources]
    manifests = [read_manifest(r, storage_options=storage_options) for r in roots]
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
    # every source shard is located and checked before anything in `out` changes
    sources = [
        [
            (_remote_shard(remotes[root], k, info) if isinstance(root, str) else
             _source_shard(root, k, info), info)  # fmt: skip
            for k, info in enumerate(m.shards)
        ]
        for root, m in zip(roots, manifests)
    ]
    if is_url(out):
        out_remote = open_remote(os.fspath(out), storage_options)
        if any(out_remote.url == r for r in roots):
            raise ValueError(f"cannot merge into {out_remote.url}: it is one of the sources")
        prepare_remote(out_remote, overwrite)
        return _merge_to_remote(out_remote, roots, manifests, sources, on_shard)
    out = Path(local_path(out))
    out_abs = out.resolve()
    sources_in_out = [
        root
        for root, shards in zip(roots, sources)
        if any(not isinstance(src, tuple) and Path(src).parent == out_abs for src, _ in shards)
    ]
    if sources_in_out:
        # replacing out's shards would delete the very files the new manifest links to
        raise ValueError(
            f"cannot merge into {out}: it holds shards of {sources_in_out[0]}, which a merge "
            "there would delete; write the merged dataset to a new directory"
        )
    check_writable(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_directory(out)  # a Writer busy in `out` would lose its shards to us
    try:
        return _merge_into(out, roots, manifests, sources, link, on_shard)
    finally:
        unlock_directory(out, lock)


def _source_shard(root: Path, k: int, info: ShardInfo) -> str:
    """The resolved path of shard ``k`` of the source at ``root``, checked to be a regular file
    inside ``root`` of the recorded size."""
    where = f"source {root}: shard {k} 'file'"
    path = os.path.realpath(member_path(root, info.file, where=where))
    try:
        size = check_regular_file(path, f"source {root}: shard")
    except FileNotFoundError as e:
        raise FormatError(f"source {root}: shard {path} is missing", path=path) from e
    if size.st_size != info.bytes:
        raise FormatError(
            f"source {root}: shard {path} is {size.st_size} bytes but its manifest records "
            f"{info.bytes} (run `kuat verify {root}`)",
            path=path,
        )
    return path


def _remote_shard(remote: Remote, k: int, info: ShardInfo) -> tuple[Remote, str]:
    """``(remote, name)`` of shard ``k`` of the source at ``remote``, checked to be a key
    below its prefix, present and of the recorded size."""
    member_path(remote.url, info.file, where=f"source {remote.url}: shard {k} 'file'")
    url = remote.url_of(info.file)
    try:
        size = retry(lambda: remote.fs.size(remote.path_of(info.file)), what="sizing", url=url)
    except FileNotFoundError as e:
        raise FormatError(f"source {remote.url}: shard {url} is missing", path=url) from e
    if size != info.bytes:
        raise FormatError(
            f"source {remote.url}: shard {url} is {size} bytes but its manifest records "
            f"{info.bytes} (run `kuat verify {remote.url}`)",
            path=url,
        )
    return remote, info.file


def _download(src: tuple[Remote, str], info: ShardInfo, dst: Path) -> None:
    """Download a remote shard to ``dst`` (temporary name, checksum checked, renamed)."""
    remote, name = src
    url = remote.url_of(name)
    tmp = temporary_path(dst)
    try:
        retry(lambda: remote.fs.get_file(remote.path_of(name), str(tmp)), what="downloading",
              url=url)  # fmt: skip
        checksum = file_checksum(tmp)
        if checksum != info.checksum:
            raise FormatError(
                f"shard {url} checksum mismatch: {checksum}, manifest records {info.checksum}",
                path=url,
            )
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def _merge_to_remote(
    out: Remote,
    roots: list,
    manifests: list[Manifest],
    sources: list[list[tuple[object, ShardInfo]]],
    on_shard: Callable[[int, str, str], None] | None,
) -> Manifest:
    """Copy every shard below ``out``'s prefix, then write the manifest."""
    shards = []
    with tempfile.TemporaryDirectory(prefix="kuat-merge-") as stage:
        for src_shards in sources:
            for src, info in src_shards:
                name = shard_name(len(shards))
                dst, url = out.path_of(name), out.url_of(name)
                if isinstance(src, tuple) and src[0].fs is out.fs:
                    remote = src[0]  # same store and credentials: a server-side copy
                    retry(lambda r=remote, n=src[1], d=dst: out.fs.copy(r.path_of(n), d),
                          what="copying a shard to", url=url)  # fmt: skip
                else:
                    local = src
                    if isinstance(src, tuple):
                        local = Path(stage) / name
                        _download(src, info, local)
                    retry(lambda p=str(local), d=dst: out.fs.put_file(p, d), what="uploading to",
                          url=url)  # fmt: skip
                    if isinstance(src, tuple):
                        os.unlink(local)
                shards.append(ShardInfo(name, info.rows, info.bytes, info.checksum))
                if on_shard is not None:
                    on_shard(len(shards) - 1, url, "copy")
    return _finish(out.url, roots, manifests, shards, 0, len(shards), out.storage_options)


def _copy(src: str, dst: Path) -> None:
    """Copy ``src`` to ``dst`` under a temporary name, fsynced, then renamed into place."""
    tmp = temporary_path(dst)
    try:
        shutil.copyfile(src, tmp)  # copy_file_range / sendfile where the kernel has them
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _merge_into(
    out: Path,
    roots: list[Path],
    manifests: list[Manifest],
    sources: list[list[tuple[str, ShardInfo]]],
    link: str,
    on_shard: Callable[[int, str, str], None] | None,
) -> Manifest:
    if (out / MANIFEST_NAME).exists():
        (out / MANIFEST_NAME).unlink()
    remove_leftovers(out)
    shards = []
    linked = copied = 0
    for src_shards in sources:
        for src, info in src_shards:
            name = shard_name(len(shards))
            how = "copy"
            if isinstance(src, tuple):  # a remote source: download it
                _download(src, info, out / name)
                copied += 1
                shards.append(ShardInfo(name, info.rows, info.bytes, info.checksum))
                if on_shard is not None:
                    on_shard(len(shards) - 1, str(out / name), how)
                continue
            if link != "copy":
                try:
                    os.link(src, out / name)  # src is resolved
                    how = "hardlink"
                except OSError as e:
                    if link == "hardlink":
                        raise
                    log.debug("cannot hard-link %s (%s); copying it", src, e)
            if how == "copy":
                _copy(src, out / name)
                copied += 1
            else:
                linked += 1
            shards.append(ShardInfo(name, info.rows, info.bytes, info.checksum))
            if on_shard is not None:
                on_shard(len(shards) - 1, str(out / name), how)
    return _finish(out, roots, manifests, shards, linked, copied, None)


def _finish(out, roots, manifests, shards, linked, copied, storage_options) -> Manifest:
    first = manifests[0]
    metadata = dict(first.metadata)
    metadata["merged_from"] = [str(r) for r in roots]
    manifest = Manifest(
        schema=first.schema,
        shards=tuple(shards),
        metadata=metadata,
        created_by=writer_name(),
    )
    write_manifest(out, manifest, storage_options=storage_options)
    log.debug(  # the CLI prints this summary
        "merged %d datasets into %s: %d rows, %d shards (%d hard-linked, %d copied)",
        len(roots),
        out,
        manifest.num_rows,
        len(shards),
        linked,
        copied,
    )
    return manifest
