"""The manifest: ``manifest.json`` at the root of a kuat dataset (see ``docs/format.md``).

It is written last and renamed into place, so a directory without one is not a dataset.
Parsing validates every value and raises :class:`kuat.errors.FormatError` naming the manifest
and the field on anything unexpected (not JSON, wrong types, unknown version, row counts that do
not add up, a shard name that points outside the dataset).

Datasets are untrusted input: every shard name a manifest gives is checked when it is parsed,
by the rule :mod:`kuat.format.members` owns (``docs/format.md``, "Trust"); ``check_member_name``,
``member_path`` and ``check_regular_file`` are importable from here too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kuat.errors import FormatError
from kuat.format.fs import Remote, is_url, local_path, open_remote, retry
from kuat.format.members import (
    MANIFEST_NAME,
    check_member_name,
    check_regular_file,
    member_path,
)
from kuat.format.schema import Schema

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ShardInfo",
    "Manifest",
    "Checksum",
    "file_checksum",
    "check_member_name",
    "member_path",
    "read_manifest",
    "write_manifest",
    "writer_name",
]

FORMAT_NAME = "kuat"
FORMAT_VERSION = 1
CHECKSUM_ALGO = "xxh3_64"
_CHUNK = 8 << 20
# A manifest larger than this is refused before it is read into memory: 1 GiB is a million
# shards at about 1 KiB each, far beyond any real dataset (ImageNet: ~1.2 MB).
MAX_MANIFEST_BYTES = 1 << 30


@dataclass(frozen=True)
class ShardInfo:
    """One shard of a dataset.

    Attributes:
        file: name of the shard relative to the dataset root (``shard-00000.arrow``), as
            :func:`check_member_name` allows: never absolute, never ``..``, never a URL.
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


def writer_name() -> str:
    """``"kuat <version>"``: the ``created_by`` of a manifest this kuat writes."""
    from kuat import __version__

    return f"kuat {__version__}"


class Checksum:
    """A shard checksum computed incrementally: ``update`` with the file's bytes in order,
    then ``value()`` is ``"xxh3_64:<16 hex digits>"``, what :func:`file_checksum` gives for
    the whole file."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data) -> None:
        self._h.update(data)

    def value(self) -> str:
        return f"{CHECKSUM_ALGO}:{self._h.hexdigest()}"


def file_checksum(path: str | os.PathLike) -> str:
    """``"xxh3_64:<hex>"`` of a file's bytes, read in 8 MiB chunks."""
    h = Checksum()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.value()


_MAX_COUNT = 2**62  # rows and bytes are summed in int64
_CHECKSUM = re.compile(rf"{CHECKSUM_ALGO}:[0-9a-f]{{16}}")
_SHARD_KEYS = ("file", "rows", "bytes", "checksum")

# Known metadata keys (written by kuat's converters and merge) and the JSON type each must have;
# other keys are the user's and may hold any JSON value.
_METADATA_TYPES = {
    "source": "a string",
    "classes": "a list of strings",
    "class_to_idx": "an object of integers",
    "merged_from": "a list of strings",
    "hf_features": "an object",
}
_FIELD_METADATA_TYPES = {"names": "a list of strings"}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _has_type(value: object, kind: str) -> bool:
    if kind == "a string":
        return isinstance(value, str)
    if kind == "an object":
        return isinstance(value, dict)
    if kind == "a list of strings":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "an object of integers":
        return isinstance(value, dict) and all(_is_int(v) for v in value.values())
    raise AssertionError(kind)  # a typo in the tables above, not bad input


def _check_metadata(metadata: object, types: dict[str, str], where: str) -> dict:
    if not isinstance(metadata, dict):
        raise FormatError(f"{where} must be an object, got {type(metadata).__name__}")
    for key, kind in types.items():
        if key in metadata and not _has_type(metadata[key], kind):
            value = metadata[key]
            raise FormatError(
                f"{where}[{key!r}] must be {kind}, got {type(value).__name__} {value!r:.80}"
            )
    return metadata


def min_row_bits(schema: Schema) -> int:
    """The fewest bits a row of ``schema`` can take in a shard: Arrow stores fixed-size values
    back to back, booleans as bits, and an int32 offset per variable-length value (an image is
    a struct of two such columns and two int32s). Shards hold no validity bitmaps (no nulls).

    A manifest whose ``rows * min_row_bits > 8 * bytes`` for a shard states more rows than the
    file can hold: refused before anything (a sampler's ``randperm(len(dataset))``) allocates
    per stated row.
    """
    bits = 0
    for f in schema:
        t = f.type
        if t.kind in ("scalar", "tensor"):
            bits += 8 * t.np_dtype.itemsize * t.numel
        elif t.kind == "bool":
            bits += 1
        elif t.kind == "image":
            bits += 4 * 32  # bytes offsets, width, height, codec offsets
        else:
            bits += 32  # string / bytes / sequence offsets
    return bits


def parse_manifest(obj: object, path: str) -> Manifest:
    """Validate a decoded manifest JSON object.

    Every field is checked (``docs/format.md`` sections 1-2 and "Trust"): types and ranges,
    the known metadata keys' types (``"names"`` of a field is a list of strings), each shard
    ``file`` by :func:`check_member_name` (a file may be listed twice), and each shard's ``rows`` no
    more than its ``bytes`` can hold for this schema (:func:`min_row_bits`).

    Raises:
        kuat.FormatError: naming ``path`` and the field (``shards[3].file``) on anything wrong.
    """

    def bad(msg: str) -> FormatError:
        return FormatError(f"bad manifest {path}: {msg}", path=path)

    if not isinstance(obj, Mapping):
        raise bad(f"expected a JSON object, got {type(obj).__name__}")
    if obj.get("format") != FORMAT_NAME:
        raise bad(f"'format' is {obj.get('format')!r:.80}, expected {FORMAT_NAME!r}")
    version = obj.get("version")
    if not _is_int(version):
        raise bad(f"'version' must be an integer, got {version!r:.80}")
    if version != FORMAT_VERSION:
        raise FormatError(
            f"unknown kuat format version {version} in {path} (this kuat reads version "
            f"{FORMAT_VERSION}); upgrade kuat to read it",
            path=path,
        )
    created_by = obj.get("created_by", "")
    if not isinstance(created_by, str):
        raise bad(f"'created_by' must be a string, got {type(created_by).__name__}")
    try:
        schema = Schema.from_json(obj.get("schema"))
        for f in schema:
            _check_metadata(f.metadata, _FIELD_METADATA_TYPES, f"field {f.name!r}: 'metadata'")
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, FormatError) as e:
        raise bad(f"invalid schema: {e}") from e
    try:
        metadata = _check_metadata(obj.get("metadata", {}), _METADATA_TYPES, "'metadata'")
    except FormatError as e:
        raise bad(str(e)) from None
    shards_obj = obj.get("shards")
    if not isinstance(shards_obj, list):
        raise bad("'shards' must be a list")
    row_bits = min_row_bits(schema)
    shards = []
    for i, s in enumerate(shards_obj):
        if not isinstance(s, Mapping):
            raise bad(f"shard {i} must be an object")
        file, rows, size, checksum = (s.get(k) for k in _SHARD_KEYS)
        try:
            check_member_name(file, where=f"shard {i}: 'file'")
        except FormatError as e:
            raise bad(str(e)) from None
        for key, value in (("rows", rows), ("bytes", size)):
            if not (_is_int(value) and 0 <= value < _MAX_COUNT):
                raise bad(
                    f"shard {i} ({file}): {key!r} must be an integer in [0, 2**62), "
                    f"got {value!r:.80}"
                )
        if rows * row_bits > 8 * size:
            raise bad(
                f"shard {i} ({file}): 'rows' is {rows} but {size} bytes cannot hold more than "
                f"{8 * size // row_bits} rows of this schema (at least {row_bits} bits each)"
            )
        if not isinstance(checksum, str) or not _CHECKSUM.fullmatch(checksum):
            raise bad(
                f"shard {i} ({file}): 'checksum' must be '{CHECKSUM_ALGO}:' and 16 lower-case "
                f"hex digits, got {checksum!r:.80}"
            )
        shards.append(ShardInfo(file, rows, size, checksum))
    manifest = Manifest(
        schema=schema,
        shards=tuple(shards),
        metadata=metadata,
        created_by=created_by,
        version=version,
    )
    num_rows = obj.get("num_rows", manifest.num_rows)
    if manifest.num_rows >= _MAX_COUNT:
        raise bad(f"the shards hold {manifest.num_rows} rows, more than 2**62")
    if manifest.num_bytes >= _MAX_COUNT:
        raise bad(f"the shards hold {manifest.num_bytes} bytes, more than 2**62")
    if not _is_int(num_rows) or num_rows != manifest.num_rows:
        raise bad(f"'num_rows' is {num_rows!r:.80} but the shards hold {manifest.num_rows} rows")
    return manifest


def read_manifest(
    directory: str | os.PathLike, *, storage_options: Mapping | None = None
) -> Manifest:
    """Read and validate ``<directory>/manifest.json``; ``directory`` may be a URL
    (``s3://bucket/train.kuat``, read directly with retries; see :mod:`kuat.format.fs`).

    Raises:
        FormatError: the directory or manifest is missing, larger than ``MAX_MANIFEST_BYTES``,
            not JSON, or invalid (see :func:`parse_manifest`).
        kuat.format.fs.RemoteError: a remote manifest could not be read after retries.
        ImportError: the URL's fsspec backend is not installed (names the package).
    """
    if is_url(directory):
        return _read_remote_manifest(open_remote(directory, storage_options))
    directory = local_path(directory)
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        size = check_regular_file(path, "manifest").st_size
        if size > MAX_MANIFEST_BYTES:
            raise FormatError(
                f"manifest {path} is {size} bytes, more than the {MAX_MANIFEST_BYTES} a kuat "
                "manifest may have; refusing to read it into memory",
                path=path,
            )
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError as e:
        if not os.path.isdir(directory):
            raise FormatError(f"not a kuat dataset: {directory} does not exist", path=path) from e
        # a folder of raw data (an ImageFolder, Parquet files ...) is the usual mistake
        raise FormatError(
            f"not a kuat dataset: {path} not found (no manifest: kuat.open reads a dataset "
            "written by kuat; convert raw data first with `kuat convert SRC DST.kuat` or "
            "kuat.convert.from_*; an interrupted write leaves no manifest)",
            path=path,
        ) from e
    except NotADirectoryError as e:
        raise FormatError(
            f"not a kuat dataset: {directory} is a file; a kuat dataset is a directory holding "
            "manifest.json and its shards (convert raw data with `kuat convert SRC DST.kuat`)",
            path=path,
        ) from e
    except OSError as e:
        raise FormatError(f"cannot read manifest {path}: {e}", path=path) from e
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError
        raise FormatError(f"manifest {path} is not valid JSON: {e}", path=path) from e
    return parse_manifest(obj, path)


def _read_remote_manifest(remote: Remote) -> Manifest:
    url = remote.url_of(MANIFEST_NAME)
    path = remote.path_of(MANIFEST_NAME)

    def fetch() -> bytes:
        # one ranged GET, at most one byte past the limit: no HEAD first (a plain cat_file
        # costs s3fs a HEAD, and a size check another), so opening costs one round trip
        try:
            return remote.fs.cat_file(path, start=0, end=MAX_MANIFEST_BYTES + 1)
        except OSError as e:
            if isinstance(e, (FileNotFoundError, PermissionError)) or remote.fs.size(path):
                raise
            return b""  # an empty object, whose every byte range is refused (HTTP 416)

    try:
        raw = retry(fetch, what="reading manifest", url=url)
    except FileNotFoundError as e:
        raise FormatError(
            f"not a kuat dataset: {url} not found (an interrupted write leaves no manifest)",
            path=url,
        ) from e
    except PermissionError as e:
        raise FormatError(f"cannot read manifest {url}: {e}", path=url) from e
    if len(raw) > MAX_MANIFEST_BYTES:
        raise FormatError(
            f"manifest {url} is larger than the {MAX_MANIFEST_BYTES} bytes a kuat manifest may "
            "have; refusing to read it into memory",
            path=url,
        )
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"manifest {url} is not valid JSON: {e}", path=url) from e
    return parse_manifest(obj, url)


def write_manifest(
    directory: str | os.PathLike,
    manifest: Manifest,
    *,
    storage_options: Mapping | None = None,
) -> Path | str:
    """Write ``manifest.json`` atomically (temporary name, fsync, rename); at a URL, one
    whole-object write with retries (object stores make a PUT visible whole or not at all).

    Returns:
        the manifest's path, or its URL.
    """
    data = json.dumps(manifest.to_json(), indent=1, ensure_ascii=False).encode()
    if is_url(directory):
        remote = open_remote(directory, storage_options)
        url = remote.url_of(MANIFEST_NAME)
        retry(
            lambda: remote.fs.pipe_file(remote.path_of(MANIFEST_NAME), data),
            what="writing manifest",
            url=url,
        )
        return url
    directory = Path(local_path(directory))
    final = directory / MANIFEST_NAME
    tmp = directory / f".{MANIFEST_NAME}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final
