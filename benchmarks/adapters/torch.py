"""The baselines: ``torch.utils.data.DataLoader`` as training scripts use it.

- imagenet-jpeg(-256), ``decoder="pil"`` (loader ``torch``, the default most scripts run):
  ``torchvision.datasets.ImageFolder`` (PIL decode) with torchvision v2
  ``RandomResizedCrop(224)`` (bilinear, antialiased), ``RandomHorizontalFlip()``,
  ``PILToTensor()``; ``default_collate``.
- imagenet-jpeg(-256), ``decoder="torchvision"`` (loader ``torch-decode-jpeg``): torchvision's
  documented fast path, the same ``ImageFolder`` with ``loader=`` reading the file with
  ``torchvision.io.read_file`` and decoding it with ``torchvision.io.decode_image(...,
  mode=RGB)`` (``decode_jpeg`` for JPEGs, libjpeg-turbo), then the same v2 transforms on
  ``(3, H, W)`` uint8 tensors (about twice the PIL path per image).
  For ``imagenet-jpeg-256`` both read the resized files kuat stores, exported once as an
  ImageFolder (:func:`benchmarks.workloads.resized_imagefolder`); loader ``torch-originals``
  (option ``files="original"``) reads the original files with PIL, what a torch user reads
  without converting anything.
- tokens: :class:`benchmarks.workloads.TokenWindows`, the same dataset kuat reads (torch calls
  its ``__getitems__``), and ``default_collate`` stacking. Loader ``torch-w0`` runs it with
  ``num_workers=0`` (in the main process, no inter-process copy), often the fastest torch
  configuration for a memcpy-bound workload; the report names whichever is faster.
- hf-rows: ``benchmarks.bench_hf.torch_loader``: the ``datasets.Dataset``
  ``with_format("torch")`` and the usual per-row Python padding collate.

Fast settings used: ``num_workers=os.cpu_count()``, ``persistent_workers=True`` (no worker
restart per epoch), ``prefetch_factor=2`` (default), ``drop_last=True``, fork start method.
"""

from __future__ import annotations

from benchmarks.adapters import IMAGE_SIZE, Loader, num_workers

WORKLOADS = ("imagenet-jpeg", "imagenet-jpeg-256", "tokens", "hf-rows")


def versions() -> dict[str, str]:
    import numpy
    import PIL
    import torch
    import torchvision
    from torchvision.transforms import v2  # noqa: F401

    return {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "pillow": PIL.__version__,
        "numpy": numpy.__version__,
    }


def _tv_decode(path: str):
    """``(3, H, W)`` uint8 RGB tensor of the image file at ``path`` (torchvision.io)."""
    from torchvision.io import ImageReadMode, decode_image, read_file

    return decode_image(read_file(path), mode=ImageReadMode.RGB)


def build(workload: str, data: dict, spec: dict) -> Loader:
    import torch
    from torch.utils.data import DataLoader

    g = torch.Generator()
    g.manual_seed(spec.get("seed", 0))
    workers = num_workers(spec)
    decoder = spec.get("options", {}).get("decoder", "pil")
    files = spec.get("options", {}).get("files", "workload")
    if files not in ("workload", "original"):
        raise ValueError(f"torch adapter: files={files!r} must be 'workload' or 'original'")
    common = dict(
        batch_size=spec["batch_size"],
        shuffle=True,
        num_workers=workers,
        drop_last=True,
        persistent_workers=workers > 0,
        generator=g,
    )
    if workload.startswith("imagenet-jpeg"):
        from torchvision.datasets import ImageFolder
        from torchvision.transforms import v2

        augment = [v2.RandomResizedCrop(IMAGE_SIZE, antialias=True), v2.RandomHorizontalFlip()]
        root = data["original_root"] if files == "original" else data["root"]
        if decoder == "pil":
            folder = ImageFolder(root, transform=v2.Compose([*augment, v2.PILToTensor()]))
        elif decoder == "torchvision":
            folder = ImageFolder(root, transform=v2.Compose(augment), loader=_tv_decode)
        else:
            raise ValueError(f"torch adapter: decoder={decoder!r} must be 'pil' or 'torchvision'")
        loader = DataLoader(folder, **common)

        def epoch(e):
            for images, labels in loader:  # (B, 3, 224, 224) uint8, (B,) int64
                yield {"image": images, "label": labels}

    elif workload == "hf-rows":
        from benchmarks import bench_hf

        indices = bench_hf.order(data["num_rows"], spec.get("seed", 0))
        loader = bench_hf.torch_loader(data, workers, indices)  # with_format("torch"), pad_rows

        def epoch(e):
            return iter(loader)

    elif workload == "tokens":
        from benchmarks.workloads import TokenWindows

        ds = TokenWindows(data["tokens_path"], data["offsets_path"], data["window"])
        loader = DataLoader(ds, **common)

        def epoch(e):
            return iter(loader)  # {"tokens": (B, T) int64}

    else:
        raise ValueError(f"torch adapter: unknown workload={workload!r}")

    # The worker process exits right after the last epoch, taking the persistent workers
    # with it; torch's DataLoader has no public close().
    return Loader(epoch)
