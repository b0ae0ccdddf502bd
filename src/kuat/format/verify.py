"""Check a kuat dataset's shards against its manifest: presence, size, checksum, schema, rows
and (optionally) every image's header against its stored width/height/codec, and that every
image is complete or fully decodes."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kuat.errors import DecodeError, FormatError
from kuat.format.cache import ShardCache
from kuat.format.fs import is_url, local_path, open_remote
from kuat.format.manifest import file_checksum, read_manifest
from kuat.format.members import check_regular_file, member_path
from kuat.format.shard import open_shard

__all__ = ["VerifyReport", "verify"]

log = logging.getLogger("kuat.format.verify")


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`.

    Attributes:
        path: the dataset directory.
        rows: rows the manifest records.
        shards: shards checked.
        bytes: bytes checked.
        errors: one :class:`kuat.FormatError` per bad shard (naming its path and, for an
            image that does not match, the row).
    """

    path: str
    rows: int = 0
    shards: int = 0
    bytes: int = 0
    errors: list[FormatError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_first(self) -> None:
        """Raise the first error, if any."""
        if self.errors:
            raise self.errors[0]


def _check_images(shard, manifest_schema, decode: bool = False) -> None:
    from kuat.vision.decode import decode_image
    from kuat.vision.probe import check_complete, probe_image

    for f in manifest_schema:
        if f.type.kind != "image":
            continue
        col = shard.columns[f.name]
        offs, data = col.bytes.offsets, col.bytes.mv
        coffs, cdata = col.codec.offsets, col.codec.data
        for row in range(shard.rows):
            image = data[offs[row] : offs[row + 1]]
            try:
                info = probe_image(image, source=shard.path)
                check_complete(image, info.codec, source=shard.path)
                if decode:
                    decode_image(image, index=row, source=shard.path)
            except DecodeError as e:
                raise FormatError(
                    f"shard {shard.path} row {row}: field {f.name!r}: {e}",
                    path=shard.path,
                    row=row,
                ) from e
            codec = cdata[coffs[row] : coffs[row + 1]].tobytes().decode()
            stored = (int(col.width[row]), int(col.height[row]), codec)
            if tuple(info) != stored:
                raise FormatError(
                    f"shard {shard.path} row {row}: field {f.name!r} records {stored} but the "
                    f"image header says {tuple(info)}",
                    path=shard.path,
                    row=row,
                )


def verify(
    path: str | os.PathLike,
    *,
    images: bool = False,
    decode: bool = False,
    on_shard: Callable[[int, str], None] | None = None,
    storage_options: Mapping | None = None,
) -> VerifyReport:
    """Re-check every shard of the dataset at ``path``.

    For each shard: it exists, its size and xxh3-64 checksum equal the manifest's, it opens
    as Arrow IPC with the manifest's schema and row count, without nulls. With ``images``,
    every image header is also probed and compared with the stored width/height/codec, and
    checked for completeness (``kuat.vision.probe.check_complete``: truncated files); with
    ``decode`` (implies ``images``), every image is also fully decoded, which finds any
    corruption a training run would hit. All shards are checked even after a failure; a bad
    image is reported with its shard and row.

    Args:
        on_shard: called as ``on_shard(k, shard_path)`` after each shard (progress).
        storage_options: fsspec options for a URL ``path``.

    A URL dataset is checked by downloading each shard (with retries) into a temporary
    directory, never from the shard cache (which could hide a changed object), one at a time.

    Raises:
        kuat.FormatError: the manifest itself is missing or invalid (shard problems are
            collected in the report instead).
    """
    if is_url(path):
        return _verify_remote(os.fspath(path), images, on_shard, storage_options)
    root = Path(local_path(path))
    manifest = read_manifest(root)
    schema, arrow_schema = manifest.schema, manifest.schema.to_arrow()
    report = VerifyReport(str(root), rows=manifest.num_rows)
    for k, info in enumerate(manifest.shards):
        shard_path = os.path.join(root, info.file)  # a name parse_manifest checked
        with _shard_checked(report, k, shard_path, info.bytes, on_shard):
            member_path(root, info.file, where=f"shard {k}: 'file'")  # no link out of root
            try:
                size = check_regular_file(shard_path, "shard").st_size
            except FileNotFoundError as e:
                raise FormatError(f"shard {shard_path} is missing", path=shard_path) from e
            if size != info.bytes:
                raise FormatError(
                    f"shard {shard_path} is {size} bytes but the manifest records {info.bytes}",
                    path=shard_path,
                )
            checksum = file_checksum(shard_path)
            if checksum != info.checksum:
                raise FormatError(
                    f"shard {shard_path} checksum mismatch: {checksum}, manifest records "
                    f"{info.checksum} (the file was modified or corrupted)",
                    path=shard_path,
                )
            shard = open_shard(shard_path, info, schema, arrow_schema)
            if images or decode:
                _check_images(shard, schema, decode=decode)
    return report


@contextlib.contextmanager
def _shard_checked(report: VerifyReport, k: int, where: str, nbytes: int, on_shard):
    """Check shard ``k`` (at path or URL ``where``) in the ``with`` body and count it.

    A :class:`~kuat.FormatError` or :class:`OSError` (a ``RemoteError`` after its retries
    included) raised in the body is recorded in ``report.errors``, the ``OSError`` wrapped
    in a ``FormatError`` that names ``where`` and chains it, and **not** re-raised: verify
    goes on to the next shard. Any other exception propagates uncounted. Then the shard
    is counted (``nbytes`` as the manifest records them) and ``on_shard(k, where)`` called.
    """
    try:
        yield
    except FormatError as e:
        log.debug("%s", e)
        report.errors.append(e)
    except OSError as e:
        err = FormatError(f"cannot read shard {where}: {e}", path=where)
        err.__cause__ = e
        report.errors.append(err)
    report.shards += 1
    report.bytes += nbytes
    if on_shard is not None:
        on_shard(k, where)


def _verify_remote(url, images, on_shard, storage_options) -> VerifyReport:
    remote = open_remote(url, storage_options)
    manifest = read_manifest(remote.url, storage_options=storage_options)
    schema, arrow_schema = manifest.schema, manifest.schema.to_arrow()
    report = VerifyReport(remote.url, rows=manifest.num_rows)
    stage = tempfile.mkdtemp(prefix="kuat-verify-")
    try:
        # a fresh cache per run: every shard is downloaded and checked on arrival
        cache = ShardCache(stage, limit_bytes=1)
        for k, info in enumerate(manifest.shards):
            shard_url = remote.url_of(info.file)
            with _shard_checked(report, k, shard_url, info.bytes, on_shard):
                member_path(remote.url, info.file, where=f"shard {k}: 'file'")
                try:
                    local = cache.get(remote, info.file, info)
                except FileNotFoundError as e:
                    raise FormatError(f"shard {shard_url} is missing", path=shard_url) from e
                try:
                    shard = open_shard(str(local), info, schema, arrow_schema)
                    shard.path = shard_url  # errors of the image check name the URL
                    if images:
                        _check_images(shard, schema)
                finally:
                    os.unlink(local)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return report
