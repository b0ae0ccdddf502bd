"""Converters from common formats into kuat datasets.

    kuat.convert.from_imagefolder("imagenet/train", "train.kuat", num_workers=16)

Every converter runs its per-sample work (reading, probing, optional re-encoding) on a thread
pool, shows a progress bar on a terminal, keeps the original image bytes unless asked to
resize, and returns a :class:`ConvertReport`.
"""

from kuat.convert._driver import ConvertOptions, ConvertReport
from kuat.convert.imagefolder import from_imagefolder

__all__ = ["ConvertOptions", "ConvertReport", "from_imagefolder"]
