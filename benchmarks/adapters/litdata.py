"""LitData 0.2 (Lightning AI): chunked binary files written by ``optimize`` and read by a
``StreamingDataset`` under its ``StreamingDataLoader``.

Conversion (``prepare``/``ingest``): ``litdata.optimize(fn, inputs, chunk_bytes="64MB",
num_workers=cores)`` where ``fn`` returns ``{"image": PIL.Image.open(path), "label": int}`` (the
JPEG serializer stores the file's original bytes). ``optimize`` switches the process-wide
multiprocessing start method to spawn, which is why every measurement runs in its own process.

Loading, as LitData's ImageNet example does it: ``StreamingDataset(input_dir, shuffle=True,
drop_last=True, transform=...)`` where the transform gets the decoded ``(C, H, W)`` uint8 tensor
and applies the same torchvision v2 crop and flip as the baseline;
``StreamingDataLoader(batch_size=64, num_workers=cores, persistent_workers=True)``.
"""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.adapters import (
    Loader,
    cache_key,
    list_imagefolder,
    num_workers,
    torchvision_transform,
)

WORKLOADS = ("imagenet-jpeg", "ingest")
PREPARE = ("imagenet-jpeg",)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import litdata  # noqa: F401
    import torch

    return {"litdata": version("litdata"), "torch": torch.__version__}


def _to_row(item):
    from PIL import Image

    path, label = item
    return {"image": Image.open(path), "label": label}


def _write(root: str, out_dir: Path, workers: int) -> int:
    import litdata

    files, labels, _ = list_imagefolder(root)
    litdata.optimize(
        fn=_to_row,
        inputs=list(zip(files, labels)),
        output_dir=str(out_dir),
        chunk_bytes="64MB",
        num_workers=workers,
        mode="overwrite",
        verbose=False,
    )
    return len(files)


def prepare(workload: str, data: dict, cache_dir: Path) -> dict:
    out = cache_dir / "litdata" / cache_key(data["root"])
    if not (out / "index.json").exists():
        _write(data["root"], out, os.cpu_count() or 1)
    return {"litdata_dir": str(out)}


def ingest(data: dict, out_dir: Path, workers: int) -> int:
    return _write(data["root"], out_dir, workers)


class _Transform:
    """Picklable: the decoded row dict -> ``((3, 224, 224) uint8, label)``."""

    def __init__(self) -> None:
        self.tf = torchvision_transform(pil=False)

    def __call__(self, row):
        return self.tf(row["image"]), row["label"]


def build(workload: str, data: dict, spec: dict) -> Loader:
    import torch
    from litdata import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(
        data["litdata_dir"],
        shuffle=True,
        drop_last=True,
        seed=spec.get("seed", 0),
        transform=_Transform(),
    )
    workers = num_workers(spec)
    loader = StreamingDataLoader(
        ds,
        batch_size=spec["batch_size"],
        num_workers=workers,
        persistent_workers=workers > 0,
        drop_last=True,
    )

    def epoch(e):
        for images, labels in loader:  # (B, 3, 224, 224) uint8, (B,) int64
            yield {"image": images, "label": torch.as_tensor(labels, dtype=torch.int64)}

    return Loader(epoch)
