"""On-disk kuat datasets: Arrow IPC shards and a JSON manifest (see ``docs/format.md``).

schema = kuat.Schema({"image": kuat.format.image(), "label": kuat.format.int64()})
with kuat.Writer("train.kuat", schema) as w:
    w.write({"image": jpeg_bytes, "label": 3})
ds = kuat.open("train.kuat")

Storage only: what is read here is rows and columns (:class:`Store`, ``read_batch``); the
dataset ``kuat.open`` returns, which decodes images and applies transforms, is a source
(:mod:`kuat.sources.dataset`). ``kuat.format.Dataset``, ``open`` and ``open_dataset`` still
resolve to it (lazily, so importing the format never imports the sources).
"""

from kuat.format.manifest import FORMAT_VERSION, Manifest, ShardInfo, read_manifest
from kuat.format.merge import merge
from kuat.format.schema import (
    EncodedImage,
    Field,
    FieldType,
    Schema,
    binary,
    bool_,
    float16,
    float32,
    float64,
    image,
    int8,
    int16,
    int32,
    int64,
    sequence,
    string,
    strings,
    tensor,
    uint8,
    uint16,
    uint32,
    uint64,
)
from kuat.format.store import ImageBatch, Store, open_store
from kuat.format.verify import VerifyReport, verify
from kuat.format.writer import DEFAULT_SHARD_BYTES, Writer

# names that moved to kuat.sources.dataset, kept importable here: name -> its name there
_MOVED = {"Dataset": "Dataset", "open": "open_dataset", "open_dataset": "open_dataset"}


def __getattr__(name: str):
    moved = _MOVED.get(name)
    if moved is None:
        raise AttributeError(f"module 'kuat.format' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module("kuat.sources.dataset"), moved)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_SHARD_BYTES",
    "FORMAT_VERSION",
    "Dataset",
    "EncodedImage",
    "Field",
    "FieldType",
    "ImageBatch",
    "Manifest",
    "Schema",
    "ShardInfo",
    "Store",
    "VerifyReport",
    "Writer",
    "binary",
    "bool_",
    "float16",
    "float32",
    "float64",
    "image",
    "int8",
    "merge",
    "int16",
    "int32",
    "int64",
    "open",
    "open_dataset",
    "open_store",
    "read_manifest",
    "sequence",
    "string",
    "strings",
    "tensor",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "verify",
]
