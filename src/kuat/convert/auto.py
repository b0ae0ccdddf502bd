"""Pick the converter from the source: what ``kuat convert SRC DST`` does without ``--format``."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence

from kuat.convert.hf import from_hf
from kuat.convert.imagefolder import IMG_EXTENSIONS, from_imagefolder
from kuat.convert.npy import from_numpy
from kuat.convert.tabular import from_csv, from_jsonl, from_parquet
from kuat.convert.webdataset import from_webdataset
from kuat.errors import FormatError
from kuat.format.fs import is_url
from kuat.format.manifest import check_regular_file

__all__ = ["FORMATS", "RAY_FORMATS", "detect_format", "convert"]

FORMATS = ("imagefolder", "hf", "parquet", "jsonl", "csv", "numpy", "webdataset")
# the converters that take engine="ray" (through kuat.convert._ray_convert.convert_on_ray)
RAY_FORMATS = ("imagefolder", "parquet", "jsonl", "csv")

_BY_EXT = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".tsv": "csv",
    ".tab": "csv",
    ".npy": "numpy",
    ".npz": "numpy",
    ".tar": "webdataset",
    ".tgz": "webdataset",
    ".tar.gz": "webdataset",
}


def _ext(path: str) -> str:
    p = path.lower()
    if p.endswith(".tar.gz"):
        return ".tar.gz"
    return os.path.splitext(p)[1]


def _expand(sources: Sequence[str]) -> list[str]:
    out = []
    for s in sources:
        s = os.fspath(s)
        out.extend(sorted(glob.glob(s)) if glob.has_magic(s) else [s])
    return out


def _is_kuat_manifest(path: str) -> bool:
    """Whether ``path`` is a kuat ``manifest.json``. Anything but a regular file is not one
    and is never opened (opening a FIFO would block detection forever)."""
    try:
        check_regular_file(path, "manifest")
        with open(path, "rb") as f:
            obj = json.load(f)
    except (OSError, ValueError, RecursionError, FormatError):
        return False
    return isinstance(obj, dict) and obj.get("format") == "kuat"


def _dir_format(d: str) -> tuple[str, list[str]]:
    names = set(os.listdir(d))
    if "manifest.json" in names and _is_kuat_manifest(os.path.join(d, "manifest.json")):
        raise ValueError(
            f"{d} is already a kuat dataset: open it with kuat.open; kuat merge combines "
            "datasets without copying"
        )
    if "dataset_dict.json" in names or {"dataset_info.json", "state.json"} <= names:
        return "hf", [d]
    subdirs = sorted(n for n in names if os.path.isdir(os.path.join(d, n)))
    for sub in subdirs:
        for _, _, fnames in os.walk(os.path.join(d, sub), followlinks=True):
            if any(f.lower().endswith(IMG_EXTENSIONS) for f in fnames):
                return "imagefolder", [d]
    # regular files only: a FIFO or device that happens to be named x.json is no table
    files = sorted(
        os.path.join(d, n)
        for n in names
        if _ext(n) in _BY_EXT and os.path.isfile(os.path.join(d, n))
    )
    kinds = {_BY_EXT[_ext(f)] for f in files}
    if len(kinds) == 1:
        return kinds.pop(), files
    found = f"files of several kinds ({', '.join(sorted(kinds))})" if kinds else "no data files"
    raise ValueError(
        f"cannot tell what {d} holds: no class folder holds images (ImageFolder), no "
        f"state.json or dataset_dict.json (Hugging Face save_to_disk), and {found} "
        f"({', '.join(sorted(_BY_EXT))}); pass --format {{{','.join(FORMATS)}}}"
    )


def detect_format(sources: str | os.PathLike | Sequence) -> tuple[str, list[str]]:
    """``(format, inputs)`` for sources given as paths or globs.

    A directory is a Hugging Face ``save_to_disk`` directory (``state.json`` or
    ``dataset_dict.json``), an ImageFolder tree (class folders holding images) or a folder of
    files of one kind; files are recognised by extension (``.parquet``, ``.jsonl``/``.json``,
    ``.csv``, ``.npy``/``.npz``, ``.tar``/``.tar.gz``).

    Raises:
        FileNotFoundError: a source does not exist.
        ValueError: the sources are of several kinds or of none kuat knows.
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    paths = _expand(sources)
    if not paths:
        raise FileNotFoundError(f"no input matches {list(map(str, sources))}")
    for p in paths:
        if not is_url(p) and not os.path.exists(p):
            raise FileNotFoundError(f"no such file or directory: {p}")
    if len(paths) == 1 and os.path.isdir(paths[0]):
        return _dir_format(paths[0])
    kinds = set()
    for p in paths:
        if os.path.isdir(p):
            raise ValueError(f"{p} is a directory; give one directory or a list of files")
        kind = _BY_EXT.get(_ext(p))
        if kind is None:
            raise ValueError(f"cannot tell the format of {p} from its extension; pass --format")
        kinds.add(kind)
    if len(kinds) != 1:
        raise ValueError(
            f"the inputs are of several kinds ({sorted(kinds)}); convert them separately"
        )
    return kinds.pop(), paths


def convert(
    sources,
    dst: str | os.PathLike,
    *,
    format: str = "auto",
    image_fields: Sequence[str] = (),
    split: str | None = None,
    delimiter: str | None = None,
    **options,
):
    """Convert ``sources`` into a kuat dataset at ``dst`` with the converter for ``format``
    (``"auto"``: :func:`detect_format`). ``options`` are those of
    :class:`kuat.convert.ConvertOptions`; ``delimiter`` is CSV's (see
    :func:`kuat.convert.from_csv`). Returns the converter's ``ConvertReport``.

    Raises:
        ValueError: unknown ``format``, or options the chosen converter does not take
            (``engine="ray"`` exists for the formats in ``RAY_FORMATS``).
    """
    if format == "auto":
        format, inputs = detect_format(sources)
    elif format not in FORMATS:
        raise ValueError(f"format={format!r} must be 'auto' or one of {FORMATS}")
    else:
        inputs = _expand([sources] if isinstance(sources, (str, os.PathLike)) else sources)
        if format in ("imagefolder", "hf") and len(inputs) == 1 and os.path.isdir(inputs[0]):
            pass
        elif format in ("imagefolder", "hf"):
            raise ValueError(f"format {format!r} takes one directory, got {inputs}")
        elif len(inputs) == 1 and os.path.isdir(inputs[0]):
            inputs = _dir_format(inputs[0])[1]
    engine = options.get("engine", "local")
    if engine != "local" and format not in RAY_FORMATS:
        raise ValueError(
            f"engine={engine!r} converts {', '.join(RAY_FORMATS)}; {format!r} converts "
            "locally only (drop the engine option)"
        )
    if format == "imagefolder":
        return from_imagefolder(inputs[0], dst, **options)
    if format == "hf":
        return from_hf(inputs[0], dst, split=split, **options)
    if format == "numpy":
        keep = {
            k: v
            for k, v in options.items()
            if k
            in (
                "progress",
                "overwrite",
                "shard_bytes",
                "num_workers",
                "progress_interval_s",
                "storage_options",
            )
        }
        return from_numpy(inputs, dst, **keep)
    if format == "webdataset":
        return from_webdataset(inputs, dst, **options)
    if format == "csv":
        return from_csv(inputs, dst, image_fields=image_fields, delimiter=delimiter, **options)
    if delimiter is not None:
        raise ValueError(f"delimiter={delimiter!r} applies to CSV input, not {format}")
    fn = {"parquet": from_parquet, "jsonl": from_jsonl}[format]
    return fn(inputs, dst, image_fields=image_fields, **options)
