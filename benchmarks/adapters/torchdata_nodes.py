"""torchdata.nodes (torchdata 0.11): composable iterator nodes, here with thread workers.

Idiomatic configuration from torchdata's migration guide for map-style datasets:
``SamplerWrapper(RandomSampler)`` -> ``ParallelMapper(dataset.__getitem__, num_workers=cores,
method="thread")`` -> ``Batcher(64, drop_last=True)`` -> ``Mapper(default_collate)`` ->
``Prefetcher(2)`` -> ``Loader``. The dataset is the same torchvision ``ImageFolder`` with the same
v2 transforms as the torch baseline (PIL decode and resize release the GIL, so threads help).
"""

from __future__ import annotations

from benchmarks.adapters import IMAGE_SIZE, Loader, num_workers

WORKLOADS = ("imagenet-jpeg", "tokens")


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import torch
    import torchdata.nodes  # noqa: F401
    import torchvision

    return {
        "torchdata": version("torchdata"),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
    }


def build(workload: str, data: dict, spec: dict) -> Loader:
    import torch
    from torch.utils.data import RandomSampler, default_collate
    from torchdata import nodes

    if workload == "imagenet-jpeg":
        from torchvision.datasets import ImageFolder
        from torchvision.transforms import v2

        tf = v2.Compose(
            [
                v2.RandomResizedCrop(IMAGE_SIZE, antialias=True),
                v2.RandomHorizontalFlip(),
                v2.PILToTensor(),
            ]
        )
        ds = ImageFolder(data["root"], transform=tf)

        def to_batch(b):
            return {"image": b[0], "label": b[1]}  # (B, 3, 224, 224) uint8, (B,) int64
    else:
        from benchmarks.workloads import TokenWindows

        ds = TokenWindows(data["tokens_path"], data["offsets_path"], data["window"])

        def to_batch(b):
            return b  # {"tokens": (B, T) int64}

    g = torch.Generator()
    g.manual_seed(spec.get("seed", 0))
    node = nodes.SamplerWrapper(RandomSampler(ds, generator=g))
    node = nodes.ParallelMapper(
        node, map_fn=ds.__getitem__, num_workers=num_workers(spec), method="thread", in_order=True
    )
    node = nodes.Batcher(node, batch_size=spec["batch_size"], drop_last=True)
    node = nodes.Mapper(node, default_collate)
    node = nodes.Prefetcher(node, prefetch_factor=2)
    loader = nodes.Loader(node)

    def epoch(e):
        for b in loader:
            yield to_batch(b)

    return Loader(epoch)
