"""On-disk kuat datasets: Arrow IPC shards and a JSON manifest (see ``docs/format.md``).

schema = kuat.Schema({"image": kuat.format.image(), "label": kuat.format.int64()})
with kuat.Writer("train.kuat", schema) as w:
    w.write({"image": jpeg_bytes, "label": 3})
ds = kuat.open("train.kuat")

Storage only: what is read here is rows and columns (:class:`Store`, ``read_batch``); the
dataset ``kuat.open`` returns, which decodes images and applies transforms, is a source
(:mod:`kuat.sources.dataset`). ``kuat.format.Dataset``, ``open`` and ``open_dataset`` are
deprecated names of ``kuat.Dataset`` and ``kuat.open``: they still resolve, with a
``DeprecationWarning``, for one release (lazily, so importing the format never imports the
sources).

Modules: ``schema`` (field types), ``manifest`` (parse and write ``manifest.json``), ``members``
(what a manifest may name: the trust rule), ``layout`` (a dataset directory's names, lock and
clearing), ``builder`` (validate a field's values, build its Arrow column), ``writer``
(``Writer``), ``shard_file`` (a shard's bytes and checksum on their way to disk), ``merge``,
``fs`` (local paths and fsspec URLs), ``cache`` (remote shards cached locally), ``shard``
(map and check one shard), ``arrow_views``, ``store`` (``Store``: manifest plus lazily opened
shards), ``gather`` (a batch's column out of the shards), ``verify``.
"""

import warnings

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

# deprecated names of the kuat source (kuat.sources.dataset): name -> (its name there, the
# public name to use instead). Resolved on each access, so every use warns.
_MOVED = {
    "Dataset": ("Dataset", "kuat.Dataset"),
    "open": ("open_dataset", "kuat.open"),
    "open_dataset": ("open_dataset", "kuat.open"),
}


def __getattr__(name: str):
    moved = _MOVED.get(name)
    if moved is None:
        raise AttributeError(f"module 'kuat.format' has no attribute {name!r}")
    there, instead = moved
    warnings.warn(
        f"kuat.format.{name} is deprecated and will be removed in the next release; use "
        f"{instead} (the format is storage only)",
        DeprecationWarning,
        stacklevel=2,
    )
    import importlib

    return getattr(importlib.import_module("kuat.sources.dataset"), there)


__all__ = [
    "DEFAULT_SHARD_BYTES",
    "FORMAT_VERSION",
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
