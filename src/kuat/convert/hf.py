"""Hugging Face ``datasets`` -> kuat dataset (in memory, or a ``save_to_disk`` directory).

Feature mapping (anything else raises ``ValueError`` naming the column):

=========================================  ====================================================
``datasets`` feature                       kuat field
=========================================  ====================================================
``Image``                                  ``image`` (stored bytes, or the file at ``path``)
``ClassLabel(names)``                      ``int64`` with ``metadata={"names": names}``
``Value`` int*/uint*/float*/bool           the same scalar type
``Value`` string / binary                  ``string`` / ``bytes``
``List``/``Sequence`` of numbers, length -1 ``sequence[dtype]``
``List`` of numbers with fixed lengths     ``tensor[(lengths...), dtype]``
``Array2D``...``Array5D``                  ``tensor[shape, dtype]``
=========================================  ====================================================

The manifest keeps the full ``datasets`` features (``metadata["hf_features"]``).
"""

from __future__ import annotations

import os
import time

import numpy as np

from kuat.convert._driver import (
    ConvertOptions,
    ConvertReport,
    log_skipped,
    parallel_map,
    prepare_image,
)
from kuat.errors import DecodeError
from kuat.format import Field, FieldType, Schema, Writer
from kuat.format import schema as fs

__all__ = ["from_hf", "hf_field"]

_NUMERIC = set(fs.NUMERIC_DTYPES)


def hf_field(name: str, feature) -> Field:
    """The kuat :class:`Field` for a ``datasets`` feature (see the module table).

    Raises:
        ValueError: the feature has no kuat equivalent.
    """
    import datasets

    kind = type(feature).__name__
    if isinstance(feature, datasets.Image):
        return Field(name, fs.image())
    if isinstance(feature, datasets.ClassLabel):
        return Field(name, fs.int64(), {"names": list(feature.names)})
    if isinstance(feature, datasets.Value):
        dtype = feature.dtype
        if dtype in _NUMERIC:
            return Field(name, FieldType("scalar", dtype))
        if dtype == "bool":
            return Field(name, fs.bool_())
        if dtype in ("string", "large_string"):
            return Field(name, fs.string())
        if dtype in ("binary", "large_binary"):
            return Field(name, fs.binary())
        raise ValueError(f"column {name!r}: Value({dtype!r}) has no kuat field type")
    if kind.startswith("Array") and kind[5:6].isdigit():
        return Field(name, fs.tensor(tuple(feature.shape), feature.dtype))
    lists = (datasets.List, datasets.LargeList) if hasattr(datasets, "List") else ()
    if isinstance(feature, lists) or isinstance(feature, datasets.Sequence):
        lengths = []
        inner = feature
        while isinstance(inner, lists) or isinstance(inner, datasets.Sequence):
            lengths.append(getattr(inner, "length", -1))
            inner = inner.feature
        if isinstance(inner, datasets.Value) and inner.dtype in _NUMERIC:
            if lengths == [-1]:
                return Field(name, fs.sequence(inner.dtype))
            if all(n > 0 for n in lengths):
                return Field(name, fs.tensor(tuple(lengths), inner.dtype))
    raise ValueError(f"column {name!r}: feature {feature!r} has no kuat field type")


def _load(src, split: str | None):
    import datasets

    if isinstance(src, (str, os.PathLike)):
        src = datasets.load_from_disk(os.fspath(src))
    if isinstance(src, datasets.DatasetDict):
        if split is None:
            if len(src) != 1:
                raise ValueError(
                    f"the source holds splits {sorted(src)}; pass split=... (--split) to pick one"
                )
            split = next(iter(src))
        if split not in src:
            raise ValueError(f"no split {split!r} in the source; it holds {sorted(src)}")
        src = src[split]
    if not isinstance(src, datasets.Dataset):
        raise TypeError(
            f"from_hf takes a datasets.Dataset, DatasetDict or save_to_disk path, got {type(src).__name__}"
        )
    return src


def from_hf(
    src,
    dst: str | os.PathLike,
    *,
    split: str | None = None,
    num_workers: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
    on_error: str = "raise",
    resize_shorter: int | None = None,
    quality: int = 90,
    decode_check: bool = False,
    shard_bytes: int | None = None,
    batch_size: int = 256,
) -> ConvertReport:
    """Convert a Hugging Face ``datasets.Dataset`` into a kuat dataset at ``dst``.

    Args:
        src: a ``datasets.Dataset``, a ``DatasetDict`` (with ``split``), or the directory
            written by ``save_to_disk``.
        split: the split of a ``DatasetDict`` (needed when it has several).
        batch_size: rows read from the source per Arrow slice.
        num_workers, progress, overwrite, on_error, resize_shorter, quality, decode_check,
            shard_bytes: see :class:`kuat.convert.ConvertOptions`.

    Rows keep their order (after any ``select``/``shuffle`` on the source).

    Raises:
        ValueError: a feature has no kuat equivalent (names the column).
        kuat.DecodeError: an image is unreadable and ``on_error="raise"`` (names the row).
    """
    import datasets

    opts = ConvertOptions(
        num_workers=num_workers,
        progress=progress,
        on_error=on_error,
        resize_shorter=resize_shorter,
        quality=quality,
        decode_check=decode_check,
        shard_bytes=shard_bytes,
        overwrite=overwrite,
    )
    t0 = time.perf_counter()
    ds = _load(src, split)
    features = ds.features
    fields = [hf_field(name, feat) for name, feat in features.items()]
    schema = Schema(fields)
    image_names = [f.name for f in fields if f.type.kind == "image"]
    for name in image_names:
        ds = ds.cast_column(name, datasets.Image(decode=False))
    tensor_names = [f.name for f in fields if f.type.kind == "tensor"]
    seq_names = [f.name for f in fields if f.type.kind == "sequence"]
    metadata = {
        "source": "huggingface",
        "hf_features": features.to_dict(),
        "hf_fingerprint": getattr(ds, "_fingerprint", None),
    }
    report = ConvertReport(str(dst))
    base = os.fspath(src) if isinstance(src, (str, os.PathLike)) else None

    def rows():
        i = 0
        for batch in ds.iter(batch_size=batch_size):
            n = len(next(iter(batch.values())))
            for j in range(n):
                yield i, {name: batch[name][j] for name in schema.names}
                i += 1

    def prepare(item):
        i, row = item
        for name in image_names:
            value = row[name]
            where = f"row {i} field {name!r}"
            if not isinstance(value, dict):
                raise DecodeError(
                    f"{where}: expected an image, got {type(value).__name__}", index=i
                )
            data = value.get("bytes")
            if data is None and value.get("path"):
                path = value["path"]
                if base is not None and not os.path.isabs(path):
                    path = (
                        os.path.join(base, path)
                        if os.path.exists(os.path.join(base, path))
                        else path
                    )
                with open(path, "rb") as f:
                    data = f.read()
                where = path
            if data is None:
                raise DecodeError(f"{where}: the image has neither bytes nor a path", index=i)
            row[name] = prepare_image(data, where, opts)
        for name in tensor_names:
            row[name] = np.asarray(row[name], dtype=schema[name].type.np_dtype)
        for name in seq_names:
            row[name] = np.asarray(row[name], dtype=schema[name].type.np_dtype)
        return row

    with Writer(dst, schema, metadata=metadata, **opts.writer_kwargs()) as w:
        for row in parallel_map(
            prepare,
            rows(),
            opts,
            total=len(ds),
            desc="convert hf",
            source_of=lambda item: f"row {item[0]}",
            report=report,
        ):
            w.write(row)
        report.rows = w.num_rows
    report.seconds = time.perf_counter() - t0
    log_skipped(report)
    return report
