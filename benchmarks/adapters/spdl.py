"""SPDL 0.8 (Meta's Scalable and Performant Data Loading): an asyncio pipeline whose stages run
in a thread pool; FFmpeg (GIL released) decodes each JPEG and applies the crop, resize and
flip as one filter graph, then ``convert_frames`` packs a batch into one buffer.

Idiomatic configuration, after SPDL's ImageNet example: ``PipelineBuilder`` with a source of
``(path, label)``, a ``pipe`` that demuxes and decodes with a per-sample filter
(``crop=w:h:x:y,scale=224:224:flags=bilinear[,hflip],format=rgb24``; the crop box drawn as
torchvision draws it, since SPDL has no random-resized-crop op), ``concurrency`` = all cores,
``aggregate(64, drop_last=True)``, a batch stage converting frames to one ``(B, H, W, 3)`` uint8
tensor, ``build(num_threads=cores)``. The channels-first output is a ``permute`` view.

Run-time requirement: Debian's ``libavdevice59`` and ``libavfilter8`` (FFmpeg 5 libraries).
"""

from __future__ import annotations

from benchmarks.adapters import IMAGE_SIZE, Loader, list_imagefolder, num_workers
from benchmarks.adapters import random_resized_crop_box as rrc_box

WORKLOADS = ("imagenet-jpeg",)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import spdl.io  # noqa: F401
    import spdl.pipeline  # noqa: F401
    import torch

    return {"spdl": version("spdl"), "torch": torch.__version__}


def build(workload: str, data: dict, spec: dict) -> Loader:
    import numpy as np
    import spdl.io
    import torch
    from spdl.pipeline import PipelineBuilder

    files, labels, _ = list_imagefolder(data["root"])
    workers, batch = num_workers(spec), spec["batch_size"]
    seed = spec.get("seed", 0)

    def load(item):
        path, label, sample_seed = item
        rng = np.random.default_rng(sample_seed)
        packets = spdl.io.demux_image(path)
        top, left, h, w = rrc_box(rng, packets.height, packets.width)
        flip = ",hflip" if rng.random() < 0.5 else ""
        desc = (
            f"crop={w}:{h}:{left}:{top},scale={IMAGE_SIZE}:{IMAGE_SIZE}:flags=bilinear"
            f"{flip},format=rgb24"
        )
        return spdl.io.decode_packets(packets, filter_desc=desc), label

    def collate(items):
        frames = [f for f, _ in items]
        images = spdl.io.to_torch(spdl.io.convert_frames(frames))  # (B, H, W, 3) uint8
        return {
            "image": images.permute(0, 3, 1, 2),  # (B, 3, H, W) view
            "label": torch.tensor([lb for _, lb in items], dtype=torch.int64),
        }

    def epoch(e):
        order = np.random.default_rng([seed, e]).permutation(len(files))
        source = [(files[i], labels[i], (seed, e, int(i))) for i in order]
        pipeline = (
            PipelineBuilder()
            .add_source(source)
            .pipe(load, concurrency=workers, output_order="completion")
            .aggregate(batch, drop_last=True)
            .pipe(collate)
            .add_sink(3)
            .build(num_threads=workers)
        )
        with pipeline.auto_stop():
            yield from pipeline

    return Loader(epoch)
