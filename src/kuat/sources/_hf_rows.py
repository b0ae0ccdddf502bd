"""Samples of a formatted ``datasets.Dataset`` batch, and when a ``datasets.Dataset``'s format
changed in place.

:func:`split_rows` turns what ``datasets`` formats for a batch of B indices into B samples,
as ``dataset[i]`` or ``dataset.__getitems__`` gives them (what torch's DataLoader reads).
:func:`format_key` / :func:`same_format` tell :class:`kuat.sources.hf.HFMapSource` that its
read plan is stale: ``Dataset.set_format``, ``set_transform`` and ``reset_format`` change the
dataset in place, and torch's DataLoader, reading it live, sees the new format at once.

Thread-safety: pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def split_rows(batch, n: int, dataset, indices, single: bool) -> list:
    """Per-sample values of a formatted batch of ``n`` rows: ``dataset[i]``'s (``single``) or
    ``dataset.__getitems__``' (a dict per row: ``{column: batch[column][i]}``)."""
    import pyarrow as pa

    if isinstance(batch, Mapping):  # python / numpy / torch / custom transform
        keys = list(batch)
        if not keys:
            return [{} for _ in range(n)]
        n = len(batch[keys[0]])  # as datasets: a transform may return another number of rows
        return [{k: batch[k][i] for k in keys} for i in range(n)]
    if isinstance(batch, pa.Table):  # "arrow": a one-row table per sample, zero-copy slices
        return [batch.slice(i, 1) for i in range(n)]
    if hasattr(batch, "iloc") and single:  # "pandas": one-row frames indexed from 0 (dataset[i])
        return [batch.iloc[i : i + 1].reset_index(drop=True) for i in range(n)]
    if hasattr(batch, "iloc"):  # datasets.Dataset.__getitems__ (torch's DataLoader reads it)
        return [{col: array[i] for col, array in batch.items()} for i in range(len(batch))]
    # Other formats (jax, tensorflow, polars): index the dataset row by row.
    return [dataset[int(i)] for i in np.asarray(indices).reshape(-1)]


def format_key(ds) -> tuple:
    """What a read plan of ``ds`` depends on that can change in place: format type, columns,
    ``output_all_columns``, format kwargs (a transform is one), indices mapping and table."""
    columns = None if ds._format_columns is None else list(ds._format_columns)
    return (ds._format_type, columns, ds._output_all_columns, dict(ds._format_kwargs or {}),
            ds._indices, ds._data)


def same_format(a: tuple, b: tuple) -> bool:
    """Whether two :func:`format_key` s are the same (objects compared by identity)."""
    return (a[:3] == b[:3] and a[3].keys() == b[3].keys()
            and all(a[3][k] is b[3][k] for k in a[3]) and a[4] is b[4] and a[5] is b[5])
