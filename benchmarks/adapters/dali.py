"""NVIDIA DALI, CPU-only pipeline (``device_id=None``: no GPU is touched).

Idiomatic configuration from DALI's ResNet-50 example, with every op on the CPU backend:
``fn.readers.file(file_root, random_shuffle=True)`` -> ``fn.decoders.image_random_crop``
(libjpeg-turbo ROI decode of only the crop window, torchvision's area/aspect ranges) ->
``fn.resize(224x224, antialias)`` -> ``fn.crop_mirror_normalize(dtype=UINT8,
output_layout="CHW", mirror=coin_flip(0.5))``; ``num_threads`` = all cores,
``prefetch_queue_depth=2``; ``DALIGenericIterator`` with ``LastBatchPolicy.DROP`` hands out
torch tensors. Labels come out ``(B, 1)`` int32 and are reshaped and cast to int64.
"""

from __future__ import annotations

from benchmarks.adapters import IMAGE_SIZE, RATIO, SCALE, Loader, num_workers

WORKLOADS = ("imagenet-jpeg",)


def versions() -> dict[str, str]:
    import nvidia.dali
    import nvidia.dali.plugin.pytorch  # noqa: F401
    import torch

    return {"nvidia-dali": nvidia.dali.__version__, "torch": torch.__version__}


def build(workload: str, data: dict, spec: dict) -> Loader:
    import torch
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(
        batch_size=spec["batch_size"],
        num_threads=num_workers(spec),
        device_id=None,
        seed=spec.get("seed", 0) + 1,
        prefetch_queue_depth=2,
    )
    def pipe():
        jpegs, labels = fn.readers.file(file_root=data["root"], random_shuffle=True, name="Reader")
        images = fn.decoders.image_random_crop(
            jpegs,
            device="cpu",
            output_type=types.RGB,
            random_area=list(SCALE),
            random_aspect_ratio=list(RATIO),
            num_attempts=10,
        )
        images = fn.resize(
            images,
            resize_x=IMAGE_SIZE,
            resize_y=IMAGE_SIZE,
            interp_type=types.INTERP_LINEAR,
            antialias=True,
        )
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.UINT8,
            output_layout="CHW",
            mirror=fn.random.coin_flip(probability=0.5),
        )
        return images, labels

    p = pipe()
    p.build()
    it = DALIGenericIterator(
        [p],
        ["image", "label"],
        reader_name="Reader",
        last_batch_policy=LastBatchPolicy.DROP,
        auto_reset=True,
    )

    def epoch(e):
        for out in it:
            b = out[0]
            yield {
                "image": b["image"],  # (B, 3, 224, 224) uint8
                "label": b["label"].reshape(-1).to(torch.int64),
            }  # (B, 1) int32 -> (B,)

    return Loader(epoch)
