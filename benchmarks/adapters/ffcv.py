"""FFCV 1.0.2: a ``.beton`` file read by a Numba-compiled pipeline in threads.

Conversion (``prepare``/``ingest``): ``DatasetWriter`` with ``RGBImageField(write_mode="jpg",
max_resolution=None, jpeg_quality=90)`` (FFCV cannot keep the original JPEG bytes: it decodes
each image and re-encodes it, here at full resolution) and ``IntField``, all cores.

Loading, after FFCV's ImageNet example: ``Loader(order=OrderOption.RANDOM, os_cache=True,
drop_last=True, num_workers=cores, batches_ahead=3)``, image pipeline
``RandomResizedCropRGBImageDecoder((224, 224))`` (decode + crop + resize with OpenCV's
INTER_AREA, compiled with Numba), ``RandomHorizontalFlip()``, ``ToTensor()``,
``ToTorchImage()`` (a channels-last view shaped ``(B, 3, 224, 224)``, uint8), label pipeline
``IntDecoder()``, ``ToTensor()``, ``Squeeze()``. The first epoch includes Numba's JIT.
"""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.adapters import IMAGE_SIZE, RATIO, SCALE, Loader, cache_key, num_workers

WORKLOADS = ("imagenet-jpeg", "ingest")
PREPARE = ("imagenet-jpeg",)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import ffcv.loader  # noqa: F401
    import numba
    import torch

    return {"ffcv": version("ffcv"), "numba": numba.__version__, "torch": torch.__version__}


def _write(root: str, out: Path, workers: int) -> int:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(root)  # (PIL RGB image, int label)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = DatasetWriter(
        str(out),
        {
            "image": RGBImageField(write_mode="jpg", max_resolution=None, jpeg_quality=90),
            "label": IntField(),
        },
        num_workers=workers,
    )
    writer.from_indexed_dataset(ds, chunksize=64)
    return len(ds)


def prepare(workload: str, data: dict, cache_dir: Path) -> dict:
    out = cache_dir / "ffcv" / f"{cache_key(data['root'])}.beton"
    if not out.exists():
        tmp = out.with_suffix(".tmp.beton")
        _write(data["root"], tmp, os.cpu_count() or 1)
        tmp.rename(out)
    return {"beton": str(out)}


def ingest(data: dict, out_dir: Path, workers: int) -> int:
    return _write(data["root"], out_dir / "data.beton", workers)


def build(workload: str, data: dict, spec: dict) -> Loader:
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader as FFCVLoader
    from ffcv.loader import OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    loader = FFCVLoader(
        data["beton"],
        batch_size=spec["batch_size"],
        num_workers=num_workers(spec),
        order=OrderOption.RANDOM,
        os_cache=True,
        drop_last=True,
        batches_ahead=3,
        seed=spec.get("seed", 0),
        pipelines={
            "image": [
                RandomResizedCropRGBImageDecoder(
                    (IMAGE_SIZE, IMAGE_SIZE), scale=SCALE, ratio=RATIO
                ),
                RandomHorizontalFlip(),
                ToTensor(),
                ToTorchImage(),
            ],
            "label": [IntDecoder(), ToTensor(), Squeeze()],
        },
    )

    def epoch(e):
        for images, labels in loader:  # (B, 3, 224, 224) uint8 view, (B,) int64
            yield {"image": images, "label": labels.long()}

    return Loader(epoch)
