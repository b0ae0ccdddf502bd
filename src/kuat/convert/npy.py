"""NumPy arrays (``.npy`` / ``.npz`` files, or arrays in memory) -> kuat dataset.

Every array is one field and its first axis is the row axis: an ``(N,)`` array becomes a
scalar (or bool) field, an ``(N, *shape)`` array a ``tensor[shape, dtype]`` field. All arrays
must have the same N. ``.npy`` files are memory-mapped and copied in shard-sized slices, so
arrays larger than memory convert.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from kuat.convert._driver import ConvertOptions, ConvertReport, Progress, converting
from kuat.convert._inputs import expand_paths
from kuat.errors import FormatError
from kuat.format import DEFAULT_SHARD_BYTES, Field, Schema
from kuat.format import schema as fs

__all__ = ["from_numpy"]


def _field(name: str, arr: np.ndarray) -> Field:
    if arr.ndim == 0:
        raise ValueError(f"array {name!r} is 0-d; the first axis must index rows")
    if arr.dtype.kind == "b" and arr.ndim == 1:
        return Field(name, fs.bool_())
    if arr.dtype.name not in fs.NUMERIC_DTYPES:
        raise ValueError(
            f"array {name!r} has dtype {arr.dtype}; kuat stores {', '.join(fs.NUMERIC_DTYPES)}"
            + (" (store boolean tensors as uint8)" if arr.dtype.kind == "b" else "")
        )
    if arr.ndim == 1:
        return Field(name, fs.FieldType("scalar", arr.dtype.name))
    if 0 in arr.shape[1:]:
        raise ValueError(f"array {name!r} of shape {arr.shape} has rows of no elements")
    return Field(name, fs.tensor(arr.shape[1:], arr.dtype))


def _load(path: str, **kwargs):
    """``np.load`` without pickles; a file that is not NumPy's raises ``FormatError``."""
    try:
        return np.load(path, allow_pickle=False, **kwargs)
    except (ValueError, OSError, EOFError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise FormatError(f"{path} is not a readable .npy/.npz file: {e}", path=path) from e


def _arrays(src) -> dict[str, np.ndarray]:
    if isinstance(src, np.ndarray):
        return {"data": src}
    if isinstance(src, Mapping):
        out = {}
        for name, v in src.items():
            out[str(name)] = v if isinstance(v, np.ndarray) else _load(os.fspath(v), mmap_mode="r")
        return out
    out = {}
    for path in expand_paths(src):
        if path.endswith(".npz"):
            with _load(path) as z:
                for name in z.files:
                    if name in out:
                        raise ValueError(f"array name {name!r} appears twice ({path})")
                    out[name] = z[name]
        else:
            name = os.path.splitext(os.path.basename(path))[0]
            if name in out:
                raise ValueError(f"array name {name!r} appears twice ({path})")
            out[name] = _load(path, mmap_mode="r")
    return out


def from_numpy(
    src: str | os.PathLike | Sequence | Mapping | np.ndarray,
    dst: str | os.PathLike,
    *,
    progress: bool = True,
    overwrite: bool = False,
    shard_bytes: int | None = None,
    num_workers: int | None = None,
    storage_options: dict | None = None,
    progress_interval_s: float = 30.0,
) -> ConvertReport:
    """Convert NumPy arrays into a kuat dataset at ``dst``.

    Args:
        src: ``.npy``/``.npz`` path(s) or glob (field name: the file stem, or the ``.npz``
            member name), a mapping ``{field: array or .npy path}``, or one array (field
            ``"data"``).
        progress, progress_interval_s, overwrite, shard_bytes: see
            :class:`kuat.convert.ConvertOptions`.
        num_workers: accepted for a uniform signature; copying slices needs no threads.
        storage_options: fsspec options for a URL ``dst``.

    Raises:
        ValueError: arrays of different lengths, 0-d arrays or unsupported dtypes.
        kuat.FormatError: a file that is not a .npy/.npz (names it).
    """
    opts = ConvertOptions(
        num_workers=num_workers,
        progress=progress,
        progress_interval_s=progress_interval_s,
        shard_bytes=shard_bytes,
        overwrite=overwrite,
        storage_options=storage_options,
    )
    arrays = _arrays(src)
    fields = [_field(name, arr) for name, arr in arrays.items()]
    lengths = {name: len(arr) for name, arr in arrays.items()}
    n = next(iter(lengths.values()))
    if any(v != n for v in lengths.values()):
        raise ValueError(f"arrays have different lengths (first axis): {lengths}")
    row_bytes = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in arrays.values()) or 1
    step = max(1, (opts.shard_bytes or DEFAULT_SHARD_BYTES) // row_bytes // 4)
    bar = Progress(n, "convert numpy", opts.progress, opts.progress_interval_s)
    try:
        with converting(dst, Schema(fields), opts, {"source": "numpy"}) as (w, report):
            for start in range(0, n, step):
                w.write_batch(
                    {name: np.asarray(a[start : start + step]) for name, a in arrays.items()}
                )
                bar.update(min(step, n - start))
    finally:
        bar.close()
    return report
