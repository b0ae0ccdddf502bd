"""Hugging Face ``datasets`` with torch's DataLoader, the way HF's image-classification
examples feed PyTorch.

- imagenet-jpeg: ``load_dataset("imagefolder", data_dir=root, split="train")`` (the Arrow cache
  it builds is made in ``prepare`` and reused), ``with_transform`` applying the same torchvision
  v2 crop and flip to each decoded PIL image of the batch, ``torch.utils.data.DataLoader
  (num_workers=cores, persistent_workers=True, drop_last=True, shuffle=True)``; the dataset's own
  ``__getitems__`` fetches each batch.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.adapters import Loader, num_workers, torchvision_transform

WORKLOADS = ("imagenet-jpeg",)
PREPARE = ("imagenet-jpeg",)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import datasets  # noqa: F401
    import torch

    return {
        "datasets": version("datasets"),
        "pyarrow": version("pyarrow"),
        "torch": torch.__version__,
    }


def _load(root: str, cache_dir: Path):
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_dataset(
        "imagefolder", data_dir=root, split="train", cache_dir=str(cache_dir / "hf")
    )


def prepare(workload: str, data: dict, cache_dir: Path) -> dict:
    _load(data["root"], cache_dir)
    return {"hf_cache": str(cache_dir)}


class _BatchTransform:
    """``{"image": [PIL], "label": [int]}`` -> ``{"image": [(3, 224, 224) uint8], "label": ...}``."""

    def __init__(self) -> None:
        self.tf = torchvision_transform(pil=True)

    def __call__(self, batch):
        return {
            "image": [self.tf(im.convert("RGB")) for im in batch["image"]],
            "label": batch["label"],
        }


def build(workload: str, data: dict, spec: dict) -> Loader:
    import torch
    from torch.utils.data import DataLoader

    ds = _load(data["root"], Path(data["hf_cache"])).with_transform(_BatchTransform())
    g = torch.Generator()
    g.manual_seed(spec.get("seed", 0))
    workers = num_workers(spec)
    loader = DataLoader(
        ds,
        batch_size=spec["batch_size"],
        shuffle=True,
        num_workers=workers,
        drop_last=True,
        persistent_workers=workers > 0,
        generator=g,
    )

    def epoch(e):
        for b in loader:  # {"image": (B, 3, 224, 224) uint8, "label": (B,) int64}
            yield {"image": b["image"], "label": b["label"].to(torch.int64)}

    return Loader(epoch)
