"""WebDataset 1.0: POSIX tar shards read sequentially, shuffled by shard and in a buffer.

Conversion (``prepare``/``ingest``): ``wds.ShardWriter`` with the original JPEG bytes
(``.jpg``) and the label (``.cls``), 16 shards (so up to 16 workers each get whole shards).

Loading, as WebDataset's ImageNet example does it: ``wds.WebDataset(urls, shardshuffle=True)``
-> ``shuffle(1000)`` -> ``decode("pil")`` -> ``to_tuple("jpg", "cls")`` -> the same torchvision v2
transforms as the torch baseline -> ``batched(64, partial=False)`` inside the workers, then
``wds.WebLoader(batch_size=None, num_workers=cores, persistent_workers=True)``. Batches are
formed per worker, so an epoch may end a few samples short of the others (counted as served).
"""

from __future__ import annotations

import math
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
SHARDS = 16


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import torch
    import webdataset  # noqa: F401

    return {"webdataset": version("webdataset"), "torch": torch.__version__}


def _write(root: str, out_dir: Path) -> int:
    import webdataset as wds

    files, labels, _ = list_imagefolder(root)
    out_dir.mkdir(parents=True, exist_ok=True)
    per_shard = max(1, math.ceil(len(files) / SHARDS))
    with wds.ShardWriter(str(out_dir / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, (path, label) in enumerate(zip(files, labels)):
            with open(path, "rb") as f:
                sink.write({"__key__": f"{i:08d}", "jpg": f.read(), "cls": label})
    return len(files)


def prepare(workload: str, data: dict, cache_dir: Path) -> dict:
    out = cache_dir / "webdataset" / cache_key(data["root"])
    if not (out / ".complete").exists():
        _write(data["root"], out)
        (out / ".complete").write_text("ok\n")
    return {"wds_dir": str(out)}


def ingest(data: dict, out_dir: Path, workers: int) -> int:
    return _write(data["root"], out_dir)


def build(workload: str, data: dict, spec: dict) -> Loader:
    import torch
    import webdataset as wds

    urls = sorted(str(p) for p in Path(data["wds_dir"]).glob("shard-*.tar"))
    tf = torchvision_transform(pil=True)
    ds = (
        wds.WebDataset(
            urls,
            shardshuffle=len(urls),
            seed=spec.get("seed", 0),
            nodesplitter=wds.single_node_only,
            workersplitter=wds.split_by_worker,
            empty_check=False,
        )
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(tf, lambda y: y)
        .batched(spec["batch_size"], partial=False)
    )
    workers = num_workers(spec)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)

    def epoch(e):
        for images, labels in loader:  # (B, 3, 224, 224) uint8, (B,) int64
            yield {"image": images, "label": torch.as_tensor(labels, dtype=torch.int64)}

    return Loader(epoch)
