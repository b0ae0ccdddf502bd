"""The manifest: ``manifest.json`` at the root of a kuat dataset (see ``docs/format.md``).

It is written last and renamed into place, so a directory without one is not a dataset.
Parsing validates every value and raises :class:`kuat.errors.FormatError` naming the path on
anything unexpected (not JSON, wrong types, unknown version, row counts that do not add up).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kuat.errors import FormatError
from kuat.format.schema import Schema

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ShardInfo",
    "Manifest",
    "file_checksum",
    "read_manifest",
    "write_manifest",
]

FORMAT_NAME = "kuat"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGO = "xxh3_64"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class ShardInfo:
    """One shard of a dataset.

    Attributes:
        file: path of the shard relative to the dataset directory (``shard-00000.arrow``), or
            a relative/absolute path to another directory's shard after ``merge`` by reference.
        rows: number of rows.
        bytes: file size in bytes.
        checksum: ``"xxh3_64:<16 hex digits>"`` of the whole file.
    """

    file: str
    rows: int
    bytes: int
    checksum: str

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "rows": self.rows,
            "bytes": self.bytes,
            "checksum": self.checksum,
        }


@dataclass(frozen=True)
class Manifest:
    """The parsed manifest of a kuat dataset."""

    schema: Schema
    shards: tuple[ShardInfo, ...]
    metadata: dict = field(default_factory=dict)
    created_by: str = ""
    version: int = FORMAT_VERSION

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def to_json(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "created_by": self.created_by,
            "num_rows": self.num_rows,
            "schema": self.schema.to_json(),
            "shards": [s.to_json() for s in self.shards],
            "metadata": self.metadata,
        }


def check_regular_file(path: str, what: str) -> os.stat_result:
    """``os.stat(path)``, refusing anything but a regular file: opening a FIFO named by a
    (corrupt or crafted) manifest would block forever, a directory or device is no shard.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        OSError: it cannot be stat'ed.
        kuat.FormatError: it is not a regular file (names it).
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{what} {path} is not a regular file", path=path)
    return st


def file_checksum(path: str | os.PathLike) -> str:
    """``"xxh3_64:<hex>"`` of a file's bytes, read in 8 MiB chunks."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


_MAX_COUNT = 2**62  # rows and bytes are summed in int64


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_manifest(obj: object, path: str) -> Manifest:
    """Validate a decoded manifest JSON object. Raises ``FormatError`` naming ``path``."""

    def bad(msg: str) -> FormatError:
        return FormatError(f"bad manifest {path}: {msg}", path=path)

    if not isinstance(obj, Mapping):
        raise bad(f"expected a JSON object, got {type(obj).__name__}")
    if obj.get("format") != FORMAT_NAME:
        raise bad(f"'format' is {obj.get('format')!r}, expected {FORMAT_NAME!r}")
    version = obj.get("version")
    if not _is_int(version):
        raise bad(f"'version' must be an integer, got {version!r}")
    if version != FORMAT_VERSION:
        raise FormatError(
            f"unknown kuat format version {version} in {path} (this kuat reads version "
            f"{FORMAT_VERSION}); upgrade kuat to read it",
            path=path,
        )
    try:
        schema = Schema.from_json(obj.get("schema"))
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise bad(f"invalid schema: {e}") from e
    shards_obj = obj.get("shards")
    if not isinstance(shards_obj, list):
        raise bad("'shards' must be a list")
    shards = []
    for i, s in enumerate(shards_obj):
        if not isinstance(s, Mapping):
            raise bad(f"shard {i} must be an object")
        file, rows, size, checksum = (s.get(k) for k in ("file", "rows", "bytes", "checksum"))
        if not isinstance(file, str) or not file or "\x00" in file:
            raise bad(f"shard {i}: 'file' must be a non-empty path string, got {file!r}")
        if not (
            _is_int(rows) and _is_int(size) and 0 <= rows < _MAX_COUNT and 0 <= size < _MAX_COUNT
        ):
            raise bad(f"shard {i} ({file}): 'rows' and 'bytes' must be integers in [0, 2**62)")
        if not isinstance(checksum, str) or not checksum.startswith(f"{CHECKSUM_ALGO}:"):
            raise bad(f"shard {i} ({file}): 'checksum' must be '{CHECKSUM_ALGO}:<hex>'")
        shards.append(ShardInfo(file, rows, size, checksum))
    manifest = Manifest(
        schema=schema,
        shards=tuple(shards),
        metadata=obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {},
        created_by=str(obj.get("created_by", "")),
        version=version,
    )
    num_rows = obj.get("num_rows", manifest.num_rows)
    if manifest.num_rows >= _MAX_COUNT:
        raise bad(f"the shards hold {manifest.num_rows} rows, more than 2**62")
    if num_rows != manifest.num_rows:
        raise bad(f"'num_rows' is {num_rows!r} but the shards hold {manifest.num_rows} rows")
    return manifest


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Read and validate ``<directory>/manifest.json``.

    Raises:
        FormatError: the directory or manifest is missing, is not JSON, or is invalid.
    """
    path = os.path.join(os.fspath(directory), MANIFEST_NAME)
    try:
        check_regular_file(path, "manifest")
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError as e:
        where = "directory does not exist" if not os.path.isdir(directory) else "no manifest"
        raise FormatError(
            f"not a kuat dataset: {path} not found ({where}; an interrupted write leaves no "
            "manifest)",
            path=path,
        ) from e
    except OSError as e:
        raise FormatError(f"cannot read manifest {path}: {e}", path=path) from e
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError
        raise FormatError(f"manifest {path} is not valid JSON: {e}", path=path) from e
    return parse_manifest(obj, path)


def write_manifest(directory: str | os.PathLike, manifest: Manifest) -> Path:
    """Write ``manifest.json`` atomically (temporary name, fsync, rename)."""
    directory = Path(directory)
    final = directory / MANIFEST_NAME
    tmp = directory / f".{MANIFEST_NAME}.tmp-{os.getpid()}"
    data = json.dumps(manifest.to_json(), indent=1, ensure_ascii=False).encode()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final
