"""The baseline: ``torch.utils.data.DataLoader`` as most training scripts use it.

- imagenet-jpeg(-256): ``torchvision.datasets.ImageFolder`` (PIL decode) with torchvision v2
  ``RandomResizedCrop(224)`` (bilinear, antialiased), ``RandomHorizontalFlip()``,
  ``PILToTensor()``; ``default_collate``. For ``imagenet-jpeg-256`` it still reads the original
  files: it is the reference kuat's resized dataset is compared with.
- tokens: a map-style dataset that slices a ``np.memmap`` per sample (nanoGPT's read, one
  window per ``__getitem__``) and ``default_collate`` stacking.
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


class TokenWindows:
    """Map-style: sample ``i`` is ``tokens[offsets[i] : offsets[i] + window]`` as int64.

    The memmap is opened lazily in each worker process (a memmap is not shared by pickling).
    """

    def __init__(self, path: str, offsets_path: str, window: int) -> None:
        import numpy as np

        self.path = path
        self.offsets = np.load(offsets_path)  # (N,) int64
        self.window = window
        self._mm = None

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int):
        import numpy as np
        import torch

        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        o = int(self.offsets[i])
        return torch.from_numpy(self._mm[o : o + self.window].astype(np.int64))  # (T,) int64


def build(workload: str, data: dict, spec: dict) -> Loader:
    import torch
    from torch.utils.data import DataLoader

    g = torch.Generator()
    g.manual_seed(spec.get("seed", 0))
    workers = num_workers(spec)
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

        tf = v2.Compose(
            [
                v2.RandomResizedCrop(IMAGE_SIZE, antialias=True),
                v2.RandomHorizontalFlip(),
                v2.PILToTensor(),
            ]
        )
        loader = DataLoader(ImageFolder(data["root"], transform=tf), **common)

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
        ds = TokenWindows(data["tokens_path"], data["offsets_path"], data["window"])
        loader = DataLoader(ds, **common)

        def epoch(e):
            for tokens in loader:  # (B, T) int64
                yield {"tokens": tokens}

    else:
        raise ValueError(f"torch adapter: unknown workload={workload!r}")

    # The worker process exits right after the last epoch, taking the persistent workers
    # with it; torch's DataLoader has no public close().
    return Loader(epoch)
