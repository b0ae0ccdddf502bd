"""On-disk kuat datasets: Arrow IPC shards and a JSON manifest (see ``docs/format.md``).

schema = kuat.Schema({"image": kuat.format.image(), "label": kuat.format.int64()})
with kuat.Writer("train.kuat", schema) as w:
    w.write({"image": jpeg_bytes, "label": 3})
ds = kuat.open("train.kuat")
"""

from kuat.format.dataset import Dataset, ImageBatch, open_dataset
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
from kuat.format.verify import VerifyReport, verify
from kuat.format.writer import DEFAULT_SHARD_BYTES, Writer

open = open_dataset  # noqa: A001 - kuat.open(path), like the builtin for files

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
