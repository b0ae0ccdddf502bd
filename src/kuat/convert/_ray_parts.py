"""Where the parts of a Ray conversion live, and how a finished part is recognised.

A part is a directory of whole shards plus a *part manifest*, written last, whose metadata
(:data:`PART_RECORD`) is the part's record of being finished: the part's inputs and the
fingerprint of inputs and options (:func:`part_fingerprint`). :class:`Parts` is the folder (a
local destination: :func:`staging_dir`, beside it) or URL prefix (a URL destination: the
dataset's own prefix) holding them; :func:`clear_stale` and :func:`prepare_url` clear what an
earlier run left that this one cannot use. How the engine uses them:
:mod:`kuat.convert._ray_convert`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kuat.convert._driver import ConvertOptions
from kuat.errors import FormatError
from kuat.format import Schema
from kuat.format.fs import is_url, local_path, open_remote, retry
from kuat.format.manifest import MANIFEST_NAME, Manifest, member_path, read_manifest

__all__ = [
    "ABORTED",
    "PART_RE",
    "PART_RECORD",
    "Parts",
    "clear_stale",
    "part_fingerprint",
    "part_name",
    "part_spec",
    "prepare_url",
    "staging_dir",
]

# the key of a part manifest's metadata that makes it the part's record
PART_RECORD = "kuat.ray.part"

# written where the parts go once a task reports an unreadable sample (on_error="raise"):
# tasks not yet started return at once, so the driver's wait for the running ones is short
ABORTED = "ABORTED"
PART_RE = re.compile(r"^part-\d{5,}$")


def staging_dir(dst: str | os.PathLike) -> Path:
    """Where the tasks of a conversion into the local ``dst`` write their parts: a hidden
    sibling of ``dst`` (the same file system, so moving a shard into ``dst`` is a rename)."""
    dst = Path(dst).absolute()
    return dst.parent / f".{dst.name}.kuat-ray"


def part_name(k: int) -> str:
    """The name of part ``k``'s directory below the parts' root."""
    return f"part-{k:05d}"


# -- where the parts live -------------------------------------------------------------------
@dataclass(frozen=True)
class Parts:
    """The folder (local) or prefix (URL) holding the parts of one conversion, and its
    records. Plain data, so it pickles into the tasks; each process opens the file system
    itself."""

    root: str
    storage_options: Mapping | None = None

    @classmethod
    def of(cls, dst: str | os.PathLike, storage_options: Mapping | None) -> Parts:
        if is_url(os.fspath(dst)):
            return cls(os.fspath(dst).rstrip("/"), dict(storage_options or {}))
        return cls(str(staging_dir(local_path(dst))))  # file:// URLs are local paths

    @property
    def remote(self) -> bool:
        return is_url(self.root)

    def part(self, k: int) -> str:
        return f"{self.root}/{part_name(k)}"

    def filesystem(self):
        """``(fsspec file system, root path)`` of a URL root."""
        r = open_remote(self.root, self.storage_options)
        return r.fs, r.path.rstrip("/")

    def names(self) -> list[str]:
        """The entries directly below the root (none if it does not exist)."""
        if not self.remote:
            try:
                return sorted(os.listdir(self.root))
            except FileNotFoundError:
                return []
        fs, path = self.filesystem()

        def listing() -> list[str]:
            try:
                fs.invalidate_cache(path)
                return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
            except FileNotFoundError:
                return []

        return retry(listing, what="listing", url=self.root)

    def remove(self, name: str) -> None:
        """Delete the entry ``name`` (a part, recursively; or a marker), if there."""
        if not self.remote:
            p = os.path.join(self.root, name)
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            elif os.path.lexists(p):
                os.unlink(p)
            return
        fs, path = self.filesystem()

        def rm() -> None:
            try:
                fs.rm(f"{path}/{name}", recursive=True)
            except FileNotFoundError:
                pass

        retry(rm, what="deleting", url=f"{self.root}/{name}")

    def touch(self, name: str) -> None:
        if not self.remote:
            os.makedirs(self.root, exist_ok=True)
            Path(self.root, name).touch()
            return
        fs, path = self.filesystem()
        retry(
            lambda: fs.pipe_file(f"{path}/{name}", b""), what="writing", url=f"{self.root}/{name}"
        )

    def exists(self, name: str) -> bool:
        if not self.remote:
            return os.path.exists(os.path.join(self.root, name))
        fs, path = self.filesystem()
        return retry(
            lambda: fs.exists(f"{path}/{name}"), what="checking", url=f"{self.root}/{name}"
        )

    def finished(self, k: int, fingerprint: str) -> tuple[Manifest | None, str]:
        """``(part k's manifest, "")`` if it is a finished part of this conversion: its
        record carries ``fingerprint`` and every shard it lists is there with its recorded
        size. Otherwise ``(None, why)``: ``""`` when there is no record (never written, or
        interrupted before its manifest), else why it cannot be used (other inputs or
        options, shards moved away by an interrupted assembly)."""
        where = self.part(k)
        try:
            m = read_manifest(where, storage_options=self.storage_options or None)
        except FormatError:
            return None, ""
        record = m.metadata.get(PART_RECORD)
        if not isinstance(record, dict) or record.get("fingerprint") != fingerprint:
            return None, f"{where} was written from other inputs or options"
        if self.remote:
            fs, path = self.filesystem()
            prefix = f"{path}/{part_name(k)}"
            fs.invalidate_cache(prefix)
            sizes = {
                e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size")
                for e in retry(lambda: fs.ls(prefix, detail=True), what="listing", url=where)
            }
        else:
            sizes = {}
            for info in m.shards:
                try:
                    sizes[info.file] = os.path.getsize(os.path.join(where, info.file))
                except OSError:
                    pass
        missing = [s.file for s in m.shards if sizes.get(s.file) != s.bytes]
        if missing:
            return None, f"{where} lacks shard {missing[0]} (or its size differs)"
        return m, ""


def part_fingerprint(spec: bytes, inputs: Sequence[str]) -> str:
    """The fingerprint a part's record carries: SHA-256 over ``spec`` (what the driver
    decided: the part's description, the schema, the options that shape the shards) and each
    local input file's path, size and modification time (``st_mtime_ns``), so an edited
    input, other options or another cut of the input all change it. A URL input counts by
    its name only. Returns ``"sha256:<64 hex digits>"``."""
    h = hashlib.sha256(spec)
    for p in inputs:
        p = os.fspath(p)
        if is_url(p):
            h.update(f"{p}\0url\n".encode())
            continue
        try:
            st = os.stat(p)
        except OSError:
            h.update(f"{p}\0missing\n".encode())
            continue
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"sha256:{h.hexdigest()}"


def part_spec(payload: bytes, schema: Schema, opts: ConvertOptions) -> bytes:
    """The ``spec`` of :func:`part_fingerprint`: the part's description (``payload``, the part
    pickled), the schema and the options that shape the shards."""
    shaping = {
        "schema": schema.to_json(),
        "on_error": opts.on_error,
        "resize_shorter": opts.resize_shorter,
        "quality": opts.quality,
        "decode_check": opts.decode_check,
        "shard_bytes": opts.shard_bytes,
    }
    return payload + json.dumps(shaping, sort_keys=True).encode()


def clear_stale(store: Parts, n_parts: int, restart: bool) -> None:
    """Clear what an earlier run left that this one cannot use: every part with
    ``restart``, else the parts past this run's last and a stale abort marker."""
    for name in store.names():
        stale = name == ABORTED or (
            PART_RE.match(name) and (restart or int(name[len("part-") :]) >= n_parts)
        )
        if stale:
            store.remove(name)


def prepare_url(store: Parts, overwrite: bool) -> None:
    """Refuse or clear what is at the destination URL, as :class:`kuat.Writer` does: an old
    dataset loses its manifest first (so no reader sees a mix), then its shards; the parts of
    an earlier, unfinished run stay for resuming.

    Raises:
        FileExistsError: a dataset, or objects that are no parts, are there and ``overwrite``
            is False.
    """
    names = store.names()
    url = store.root
    if MANIFEST_NAME in names:
        if not overwrite:
            raise FileExistsError(
                f"{url} is already a kuat dataset; pass overwrite=True (--overwrite) to replace it"
            )
        try:
            old = [s.file for s in read_manifest(url, storage_options=store.storage_options).shards]
        except FormatError:
            old = []
        store.remove(MANIFEST_NAME)
        fs, path = store.filesystem()
        for name in old:
            key = member_path(url, name)  # never delete outside the dataset's prefix
            try:
                retry(lambda k=key: fs.rm_file(f"{path}/{k[len(url) + 1 :]}"),
                      what="deleting an old shard", url=key)  # fmt: skip
            except FileNotFoundError:
                pass
        names = [n for n in names if n != MANIFEST_NAME]
    others = [n for n in names if not PART_RE.match(n) and n != ABORTED]
    if others and not overwrite:
        raise FileExistsError(
            f"{url} is a non-empty prefix that is not a kuat dataset ({others[0]!r}, ...); "
            "pass overwrite=True (--overwrite) to write into it anyway"
        )
