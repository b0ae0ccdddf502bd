"""Converters from common formats into kuat datasets.

    kuat.convert.from_imagefolder("imagenet/train", "train.kuat", num_workers=16)

Every converter runs its per-sample work (reading, probing, optional re-encoding) on a thread
pool, shows a progress bar on a terminal, keeps the original image bytes unless asked to
resize, and returns a :class:`ConvertReport`. ``convert(src, dst)`` picks the converter from
the source (see :func:`detect_format`).
"""

from kuat.convert._driver import ConvertOptions, ConvertReport
from kuat.convert.auto import FORMATS, convert, detect_format
from kuat.convert.hf import from_hf
from kuat.convert.imagefolder import from_imagefolder
from kuat.convert.npy import from_numpy
from kuat.convert.tabular import from_csv, from_jsonl, from_parquet
from kuat.convert.text import from_text
from kuat.convert.webdataset import from_webdataset

__all__ = [
    "FORMATS",
    "ConvertOptions",
    "ConvertReport",
    "convert",
    "detect_format",
    "from_csv",
    "from_hf",
    "from_imagefolder",
    "from_jsonl",
    "from_numpy",
    "from_parquet",
    "from_text",
    "from_webdataset",
]
