"""One adapter module per loader. Each module defines:

- ``WORKLOADS``: the workloads it implements;
- ``versions() -> dict[str, str]``: imports the peer (so the import counts in the baseline
  memory) and returns the versions of the packages that matter;
- ``build(workload, data, spec) -> Loader`` where ``Loader.epoch(epoch)`` returns an iterable
  of canonical batches (see :mod:`benchmarks.checks`) and ``Loader.close()`` frees it;
- optionally ``PREPARE`` (workloads that read a converted copy) with
  ``prepare(workload, data, cache_dir) -> dict`` (convert the data into the
  peer's format once, cached; the returned keys are merged into ``data``) and
  ``ingest(data, out_dir, num_workers) -> int`` (convert the ImageFolder afresh; images written).

Every loader gets the same number of worker cores (``spec["num_workers"]``, default
``os.cpu_count()``), batch size, augmentations (``RandomResizedCrop(224)`` with torchvision's
scale/ratio and a horizontal flip with p=0.5) and output (uint8 ``(B, 3, 224, 224)`` plus int64
labels), with ``drop_last`` so every batch is full.

``LOADERS`` maps the names ``kuat bench --loaders`` accepts to their adapter module, the
environment they run in (``main`` = the interpreter running ``kuat bench``; others are
created by :mod:`benchmarks.envs`), adapter ``options`` (``num_workers`` there overrides the
run's worker count: ``torch-w0``), workloads to ``skip``, the report's ``label`` and
per-workload ``workload_labels`` (``{workers}`` there is replaced by the run's worker count).
A workload of another ``kind`` (:data:`benchmarks.workloads.KIND`: ``smooth-jpeg`` is
``imagenet-jpeg`` on other files) reaches ``build`` and ``prepare`` as that kind.
"""

from __future__ import annotations

import os
from pathlib import Path

LOADERS: dict[str, dict] = {
    "torch": {
        "adapter": "torch",
        "env": "main",
        "label": "torch DataLoader, {workers} workers",
        "workload_labels": {
            "imagenet-jpeg": "torch + PIL",
            "smooth-jpeg": "torch + PIL",
            "imagenet-jpeg-256": "torch + PIL (same resized files)",
        },
    },
    "torch-decode-jpeg": {
        "adapter": "torch",
        "env": "main",
        "options": {"decoder": "torchvision"},
        "skip": ("tokens", "hf-rows"),
        "label": "torch + decode_jpeg + v2 on tensors",
        "workload_labels": {
            "imagenet-jpeg-256": "torch + decode_jpeg + v2 on tensors (same resized files)",
        },
    },
    # imagenet-jpeg-256 only: what torch reads when nobody converts the data (the same run as
    # imagenet-jpeg's "torch" row, repeated so its ratios pair with this workload's rounds)
    "torch-originals": {
        "adapter": "torch",
        "env": "main",
        "options": {"files": "original"},
        "skip": ("imagenet-jpeg", "smooth-jpeg", "tokens", "hf-rows"),
        "label": "torch + PIL (original files)",
    },
    "torch-w0": {
        "adapter": "torch",
        "env": "main",
        "options": {"num_workers": 0},
        "skip": ("imagenet-jpeg", "smooth-jpeg", "imagenet-jpeg-256"),
        "label": "torch DataLoader, 0 workers",
    },
    "kuat": {
        "adapter": "kuat",
        "env": "main",
        # no worker_type: kuat's default (None: thread workers, moved to processes only for a
        # dataset seen drawing from the global RNGs), what a user who swaps the class gets
        "options": {},
        "label": "kuat (threads)",
    },
    "kuat-proc": {
        "adapter": "kuat",
        "env": "main",
        "options": {"worker_type": "process"},
        "skip": ("ingest",),  # the same converter as "kuat"
        "label": "kuat (processes)",
    },
    "kuat-ray": {"adapter": "kuat_ray", "env": "main", "label": "kuat convert on Ray, 1 node"},
    "kuat-ray-2": {
        "adapter": "kuat_ray_2nodes",
        "env": "main",
        "label": "kuat convert on Ray, 2 nodes",
    },
    "torchdata-nodes": {
        "adapter": "torchdata_nodes",
        "env": "main",
        "label": "torchdata.nodes (threads)",
    },
    "spdl": {"adapter": "spdl", "env": "peers", "label": "SPDL"},
    "dali": {"adapter": "dali", "env": "peers", "label": "DALI (CPU)"},
    "ffcv": {"adapter": "ffcv", "env": "ffcv", "label": "FFCV"},
    "streaming": {
        "adapter": "streaming",
        "env": "streaming",
        "skip": ("ingest",),  # the same MDSWriter as "mds", which needs no torch install
        "label": "Mosaic Streaming",
    },
    "mds": {"adapter": "mds", "env": "mds", "label": "Mosaic MDSWriter"},
    "litdata": {"adapter": "litdata", "env": "peers", "label": "LitData"},
    "webdataset": {"adapter": "webdataset", "env": "main", "label": "WebDataset"},
    "hf": {"adapter": "hf", "env": "main", "label": "HF datasets"},
    "decode-only": {
        "adapter": "decode_only",
        "env": "main",
        "label": "full-size decode reference (simplejpeg, nothing else)",
        "workload_labels": {
            "imagenet-jpeg-256": "full-size decode reference (same resized files, simplejpeg)",
        },
    },
}

IMAGE_SIZE = 224
SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)


def num_workers(spec: dict) -> int:
    """Worker threads/processes for this run: the loader entry's ``num_workers`` option when it
    has one, else the run's ``num_workers``, else ``os.cpu_count()``; 0 is kept (main process)."""
    n = spec.get("options", {}).get("num_workers")
    if n is None:
        n = spec.get("num_workers")
    return int(os.cpu_count() or 1) if n is None else int(n)


def list_imagefolder(root: str | os.PathLike) -> tuple[list[str], list[int], list[str]]:
    """``(files, labels, classes)`` of an ImageFolder tree, ordered as torchvision's
    ``ImageFolder`` orders them (classes sorted, files sorted within each class)."""
    root = Path(root)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    files, labels = [], []
    for label, cls in enumerate(classes):
        for f in sorted((root / cls).iterdir()):
            if f.is_file() and f.suffix.lower() in (".jpg", ".jpeg", ".png"):
                files.append(str(f))
                labels.append(label)
    return files, labels, classes


class Loader:
    """A loader under test: ``epoch(e)`` gives that epoch's batches; ``close()`` frees it."""

    def __init__(self, epoch_fn, close_fn=None) -> None:
        self._epoch_fn = epoch_fn
        self._close_fn = close_fn

    def epoch(self, epoch: int):
        return self._epoch_fn(epoch)

    def close(self) -> None:
        if self._close_fn is not None:
            fn, self._close_fn = self._close_fn, None
            fn()


def random_resized_crop_box(rng, height: int, width: int) -> tuple[int, int, int, int]:
    """``(top, left, crop_height, crop_width)`` drawn like torchvision's
    ``RandomResizedCrop.get_params`` (10 tries, then a central crop clamped to the ratio
    range), from a ``numpy.random.Generator``. For peers without a random-resized-crop op."""
    import math

    area = height * width
    log_lo, log_hi = math.log(RATIO[0]), math.log(RATIO[1])
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif in_ratio > RATIO[1]:
        h, w = height, int(round(height * RATIO[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def torchvision_transform(pil: bool = True):
    """torchvision v2 ``RandomResizedCrop(224)`` (antialiased bilinear) + ``RandomHorizontalFlip()``,
    ending in a ``(3, 224, 224)`` uint8 tensor; input PIL (``pil=True``) or a ``(C, H, W)`` uint8
    tensor (grayscale expanded to 3 channels). For peers that run torchvision transforms."""
    from torchvision.transforms import v2

    head = [v2.RandomResizedCrop(IMAGE_SIZE, antialias=True), v2.RandomHorizontalFlip()]
    if pil:
        return v2.Compose([*head, v2.PILToTensor()])

    def rgb(t):
        return t.expand(3, -1, -1) if t.shape[0] == 1 else t[:3]  # (1|3|4, H, W) -> (3, H, W)

    return v2.Compose([v2.Lambda(rgb), *head])


def cache_key(root: str | os.PathLike) -> str:
    """A directory name for converted copies of the ImageFolder at ``root``: its base name
    plus a digest of its absolute path, so two trees of the same name never share a cache."""
    import hashlib

    path = str(Path(root).resolve())
    return f"{Path(path).name}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"
