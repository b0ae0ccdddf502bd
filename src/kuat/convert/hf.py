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
``Sequence(ClassLabel(names))`` (NER tags)  ``sequence[int64]`` with ``metadata={"names": names}``
``List`` of numbers with fixed lengths     ``tensor[(lengths...), dtype]``
``Array2D``...``Array5D``                  ``tensor[shape, dtype]``
anything else                              as its Arrow type maps
                                           (:func:`kuat.convert.tabular.arrow_field`), or a
                                           ``ValueError`` naming the column and what to do
=========================================  ====================================================

The rows are read as the dataset's underlying Arrow data through its indices mapping (after
``select``/``shuffle``/``filter``), whatever ``with_format``/``set_format`` presents, and go
through the same table path as Parquet (:mod:`kuat.convert._table`: the null rule at every
nesting level, images prepared on the thread pool). The manifest keeps the full ``datasets``
features (``metadata["hf_features"]``).
"""

from __future__ import annotations

import os

from kuat.convert._driver import ConvertOptions, ConvertReport, converting
from kuat.convert._table import TableBatch, write_batches
from kuat.convert._table_fields import arrow_field, hf_metadata
from kuat.convert._table_types import logical_type
from kuat.errors import require
from kuat.format import Field, FieldType, Schema
from kuat.format import schema as fs

__all__ = ["from_hf", "hf_field"]

_NUMERIC = set(fs.NUMERIC_DTYPES)


def hf_field(name: str, feature) -> Field:
    """The kuat :class:`Field` for a ``datasets`` feature (see the module table).

    Raises:
        ValueError: the feature has no kuat equivalent (names the column, says what to do).
    """
    import datasets
    from datasets.features.features import get_nested_type

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
        # string_view, null, timestamps...: as their Arrow type maps (or a clear refusal)
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
    md, _ = hf_metadata(datasets.Features({name: feature}).to_dict()[name])
    try:
        return arrow_field(name, get_nested_type(feature), metadata=md)
    except ValueError as e:
        raise ValueError(f"{e} (datasets feature {feature!r})") from e


def _load(src, split: str | None):
    datasets = require("datasets", extra="hf", needed_for="converting a Hugging Face dataset")

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
    batch_size: int = 256,
    **options,
) -> ConvertReport:
    """Convert a Hugging Face ``datasets.Dataset`` into a kuat dataset at ``dst``.

    Args:
        src: a ``datasets.Dataset``, a ``DatasetDict`` (with ``split``), or the directory
            written by ``save_to_disk``.
        split: the split of a ``DatasetDict`` (needed when it has several).
        batch_size: rows read from the source per Arrow slice.
        options: ``num_workers``, ``progress``, ``progress_interval_s``, ``overwrite``,
            ``on_error``, ``resize_shorter``, ``quality``, ``decode_check``,
            ``shard_bytes``: see :class:`kuat.convert.ConvertOptions`.

    Rows keep their order (after any ``select``/``shuffle`` on the source).

    Raises:
        ValueError: a feature has no kuat equivalent (names the column).
        kuat.DecodeError: an image is unreadable and ``on_error="raise"`` (names the row).
        kuat.MissingDependencyError: ``datasets`` is not installed (``pip install 'kuat[hf]'``).
    """
    opts = ConvertOptions(**options)
    ds = _load(src, split)
    features = ds.features
    arrow_schema = features.arrow_schema
    fields = [
        (hf_field(name, feat), logical_type(arrow_schema.field(name).type))
        for name, feat in features.items()
    ]
    metadata = {
        "source": "huggingface",
        "hf_features": features.to_dict(),
        "hf_fingerprint": getattr(ds, "_fingerprint", None),
    }
    base = os.fspath(src) if isinstance(src, (str, os.PathLike)) else None
    where = base or "the dataset"
    # the Arrow data itself, through the indices mapping: no torch/numpy presentation
    table_view = ds.with_format("arrow")

    def batches():
        row = 0
        for table in table_view.iter(batch_size=batch_size):
            for batch in table.to_batches():
                yield TableBatch(batch, where, row, base)
                row += batch.num_rows

    with converting(dst, Schema([f for f, _ in fields]), opts, metadata) as (w, report):
        write_batches(w, fields, batches(), opts, report, total=len(ds), desc="convert hf")
    return report
