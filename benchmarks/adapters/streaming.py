"""Mosaic Streaming 0.13 (MosaicML): MDS shards read by a ``StreamingDataset`` under torch's
DataLoader.

Conversion (``prepare``/``ingest``): ``MDSWriter(columns={"image": "jpeg", "label": "int"},
compression=None)`` fed ``PIL.Image.open(path)`` (the ``jpeg`` encoding stores the file's
original bytes) and the label; default 64 MB shards.

Loading, as Streaming's ImageNet example does it: a ``StreamingDataset`` subclass with
``local=`` the MDS directory (no remote), ``shuffle=True``, ``batch_size=64``, whose
``__getitem__`` applies the same torchvision v2 transforms as the torch baseline to the decoded
PIL image; ``torch.utils.data.DataLoader(num_workers=cores, persistent_workers=True,
drop_last=True)``. Runs in its own environment: Streaming pins ``numpy<2.2``.
"""

from __future__ import annotations

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

    import streaming  # noqa: F401
    import torch

    return {"mosaicml-streaming": version("mosaicml-streaming"), "torch": torch.__version__}


def write_mds(root: str, out_dir: Path) -> int:
    """Convert the ImageFolder at ``root`` into MDS shards in ``out_dir``; returns images
    written. Also the ``mds`` adapter's ingest."""
    from PIL import Image
    from streaming import MDSWriter

    files, labels, _ = list_imagefolder(root)
    with MDSWriter(
        out=str(out_dir),
        columns={"image": "jpeg", "label": "int"},
        compression=None,
        progress_bar=False,
    ) as w:
        for path, label in zip(files, labels):
            with Image.open(path) as im:
                w.write({"image": im, "label": label})
    return len(files)


def prepare(workload: str, data: dict, cache_dir: Path) -> dict:
    out = cache_dir / "mds" / cache_key(data["root"])
    if not (out / "index.json").exists():
        write_mds(data["root"], out)
    return {"mds_dir": str(out)}


def ingest(data: dict, out_dir: Path, workers: int) -> int:
    return write_mds(data["root"], out_dir)


def build(workload: str, data: dict, spec: dict) -> Loader:
    import torch
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()
    tf = torchvision_transform(pil=True)

    class Images(StreamingDataset):
        def __getitem__(self, i):
            row = super().__getitem__(i)
            return tf(row["image"].convert("RGB")), row["label"]  # (3, 224, 224) uint8, int

    ds = Images(
        local=data["mds_dir"],
        shuffle=True,
        batch_size=spec["batch_size"],
        shuffle_seed=spec.get("seed", 0) + 1,
    )
    workers = num_workers(spec)
    loader = DataLoader(
        ds,
        batch_size=spec["batch_size"],
        num_workers=workers,
        drop_last=True,
        persistent_workers=workers > 0,
    )

    def epoch(e):
        for images, labels in loader:  # (B, 3, 224, 224) uint8, (B,) int64
            yield {"image": images, "label": labels.to(torch.int64)}

    return Loader(epoch)
