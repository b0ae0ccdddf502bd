"""WebDataset ``.tar`` shards -> kuat dataset.

Members are grouped into samples as the ``webdataset`` library does: consecutive members
sharing a key, where the key is the member path up to the first ``.`` of its file name and
the rest (lower-cased) is the extension. Each extension becomes a field of that name:

==========================================  ==============================================
extension                                   kuat field
==========================================  ==============================================
jpg jpeg png webp bmp ppm pgm tif tiff      ``image`` (original bytes unless resized)
cls cls2 index idx label target             ``int64`` (the decimal text)
txt text caption                            ``string`` (UTF-8)
json                                        ``string`` (the JSON text, validated)
npy                                         ``tensor`` (shape and dtype of the first sample)
anything else                               ``bytes``
==========================================  ==============================================

plus ``__key__`` (string). The first sample fixes the fields; a later sample with other
extensions, or with a member that appears twice (``s001.cls`` twice: which one is the label?),
is an error naming ``tar:key.ext`` (or the sample is skipped with ``on_error="skip"``). Tar files may be compressed
(``.tar.gz``); they are read as streams, so remote-style sequential reading is enough.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator

import numpy as np

from kuat.convert._driver import (
    CHUNK_ITEMS,
    ConvertOptions,
    ConvertReport,
    converting,
    not_utf8,
    parallel_map,
    prepare_image,
    refuse_not_utf8,
)
from kuat.convert._inputs import expand_paths
from kuat.errors import FormatError, SchemaError
from kuat.format import Field, Schema
from kuat.format import schema as fs

__all__ = ["from_webdataset", "IMAGE_EXTS", "INT_EXTS", "TEXT_EXTS"]

IMAGE_EXTS = {"jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff"}
INT_EXTS = {"cls", "cls2", "index", "idx", "label", "target"}
TEXT_EXTS = {"txt", "text", "caption", "json"}


def _split(name: str) -> tuple[str, str]:
    d, base = os.path.split(name)
    if "." not in base:
        return name, ""
    stem, ext = base.split(".", 1)
    return os.path.join(d, stem), ext.lower()


_DUPLICATES = "__duplicates__"  # sample key: extensions whose member appears twice


def _samples(paths: list[str]) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(where, {"__key__": key, ext: bytes})`` for each sample of the tar files; a sample
    with a repeated member also holds ``_DUPLICATES: [ext, ...]`` (the caller refuses it)."""
    for path in paths:
        try:
            with tarfile.open(path, "r|*") as tar:
                key, sample = None, {}
                for member in tar:
                    if not member.isfile():
                        continue
                    k, ext = _split(member.name)
                    if not ext or os.path.basename(member.name).startswith("."):
                        continue
                    if k != key and sample:
                        yield f"{path}:{key}", {"__key__": key, **sample}
                        sample = {}
                    key = k
                    f = tar.extractfile(member)
                    data = f.read() if f is not None else b""
                    if ext in sample:
                        sample.setdefault(_DUPLICATES, []).append(ext)
                        continue
                    sample[ext] = data
                if sample:
                    yield f"{path}:{key}", {"__key__": key, **sample}
        except (tarfile.TarError, EOFError) as e:
            raise FormatError(f"{path} is not a readable tar file: {e}", path=path) from e


def _ext_field(ext: str, value: bytes, where: str) -> Field:
    if ext in IMAGE_EXTS or ext.rsplit(".", 1)[-1] in IMAGE_EXTS:
        return Field(ext, fs.image())
    if ext in INT_EXTS:
        return Field(ext, fs.int64())
    if ext in TEXT_EXTS:
        return Field(ext, fs.string())
    if ext == "npy":
        try:
            arr = np.load(io.BytesIO(value), allow_pickle=False)
            if arr.ndim == 0:
                return Field(ext, fs.FieldType("scalar", arr.dtype.name))
            return Field(ext, fs.tensor(arr.shape, arr.dtype))
        except (ValueError, OSError, EOFError) as e:  # not .npy, pickled, bool, complex, empty
            raise SchemaError(
                f"{where}.{ext}: the first sample's .npy gives no kuat field type: {e}", field=ext
            ) from e
    return Field(ext, fs.binary())


def _convert(field: Field, value: bytes, where: str) -> object:
    kind = field.type.kind
    try:
        if kind == "scalar" and field.name in INT_EXTS:
            return int(value.decode().strip())
        if kind == "string":
            text = value.decode("utf-8")
            if field.name == "json":
                json.loads(text)
            return text
        if kind in ("tensor", "scalar"):
            arr = np.load(io.BytesIO(value), allow_pickle=False)
        else:
            return value
    except (ValueError, UnicodeDecodeError, OSError, EOFError) as e:
        raise SchemaError(
            f"{where}.{field.name}: cannot parse as {field.type.describe()}: {e}", field=field.name
        ) from e
    # checked here, in the worker, so that on_error="skip" can leave the sample out
    want = field.type
    if arr.shape != (want.shape or ()) or not np.can_cast(arr.dtype, want.np_dtype, "safe"):
        raise SchemaError(
            f"{where}.{field.name}: {arr.dtype} array of shape {arr.shape} where the first "
            f"sample fixed {want.describe()}",
            field=field.name,
        )
    return arr if kind == "tensor" else arr.item()


def from_webdataset(
    paths,
    dst: str | os.PathLike,
    **options,
) -> ConvertReport:
    """Convert WebDataset tar shard(s) into a kuat dataset at ``dst``.

    Args:
        paths: a ``.tar`` file, a glob (``"shards/*.tar"``) or a list; read in sorted order.
        options: ``num_workers``, ``progress``, ``progress_interval_s``, ``overwrite``,
            ``on_error``, ``resize_shorter``, ``quality``, ``decode_check``,
            ``shard_bytes``: see :class:`kuat.convert.ConvertOptions`.

    Raises:
        FileNotFoundError: no tar file.
        kuat.FormatError: a tar file is corrupt (names it).
        kuat.SchemaError: a sample's extensions differ from the first sample's, a member
            appears twice in a sample, a value does not parse, or the key is not valid UTF-8
            (names ``tar:key.ext``); skipped instead with ``on_error="skip"``.
        ValueError: a tar file name or the first sample's extension is not valid UTF-8
            (both are stored), before anything is written.
        kuat.DecodeError: an unreadable image with ``on_error="raise"``.
    """
    opts = ConvertOptions(**options)
    files = expand_paths(paths)
    it = _samples(files)
    first = next(it, None)
    if first is None:
        raise ValueError(f"no samples in {files}")
    where0, sample0 = first
    for ext in sample0:  # each extension becomes a field name: UTF-8 text
        if not_utf8(ext) is not None:
            refuse_not_utf8(ext, f"{where0}: the extension (a field name)")
    fields = [Field("__key__", fs.string())] + [
        _ext_field(ext, value, where0)
        for ext, value in sample0.items()
        if ext not in ("__key__", _DUPLICATES)
    ]
    schema = Schema(fields)
    exts = set(schema.names)

    def all_samples():
        yield first
        yield from it

    def prepare(item):
        where, sample = item
        if _DUPLICATES in sample:
            dups = ", ".join(f"{where}.{ext}" for ext in sample[_DUPLICATES])
            raise SchemaError(
                f"{dups}: the member appears more than once in the sample; kuat keeps no "
                "silent winner: give every member of a sample its own extension"
            )
        if set(sample) != exts:
            raise SchemaError(
                f"{where}: extensions {sorted(set(sample) - {'__key__'})} differ from the first "
                f"sample's {sorted(exts - {'__key__'})}"
            )
        raw = not_utf8(sample["__key__"])
        if raw is not None:  # the key is stored as a string: UTF-8 only
            raise SchemaError(f"{where}: the sample key {raw!r} is not valid UTF-8 (kuat stores "
                              "__key__ as UTF-8 text); rename the tar members", field="__key__")
        row = {"__key__": sample["__key__"]}
        for f in fields[1:]:
            value = sample[f.name]
            if f.type.kind == "image":
                row[f.name] = prepare_image(value, f"{where}.{f.name}", opts)
            else:
                row[f.name] = _convert(f, value, where)
        return row

    metadata = {"source": "webdataset", "files": [os.path.basename(f) for f in files]}
    with converting(dst, schema, opts, metadata) as (w, report):
        for row in parallel_map(
            prepare,
            all_samples(),
            opts,
            desc="convert webdataset",
            source_of=lambda item: item[0],
            report=report,
            chunk_size=CHUNK_ITEMS,
        ):
            w.write(row)
    return report
