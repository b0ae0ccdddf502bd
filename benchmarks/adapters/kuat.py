"""kuat: ``kuat.DataLoader`` over a kuat dataset, thread workers (default) or process workers.

- imagenet-jpeg: the ImageFolder converted with ``kuat.convert.from_imagefolder`` (original
  JPEG bytes, no re-encode), opened with ``kuat.open(...).with_transform({"image":
  Compose([RandomResizedCrop(224), RandomHorizontalFlip()])})``: the crop is planned from the
  stored size, the JPEG decoded at the smallest DCT scale covering it, resized (antialiased
  bilinear) and flipped straight into the batch buffer.
- imagenet-jpeg-256: the same, converted with ``resize_shorter=256`` (from ``original_root``
  when the data has one: the workload's ``root`` is then the export of this very dataset).
- tokens: :class:`benchmarks.workloads.TokenWindows`, the dataset every loader reads (its
  ``__getitems__`` gathers a batch of windows in one NumPy indexing operation).
- hf-rows: ``benchmarks.bench_hf.kuat_loader`` (the HF area's configuration): the
  ``datasets.Dataset`` ``with_format("torch")`` read a batch at a time through its Arrow table,
  ``collate_fn=kuat.pad_collate()``; the torch baseline is ``bench_hf.torch_loader`` (per-row
  Python padding). Both read the same fixed shuffled order.
- ingest: ``from_imagefolder`` into a fresh directory.

Loader settings: ``num_workers=cores``, ``persistent_workers=True``, ``drop_last=True``,
``shuffle=True``, ``seed`` fixed; ``worker_type`` kuat's default (``kuat``: ``None``, thread
workers for every workload here) or ``"process"`` (``kuat-proc``); ``prefetch_factor`` not
given (kuat's adaptive depth).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.adapters import IMAGE_SIZE, Loader, num_workers

WORKLOADS = ("imagenet-jpeg", "imagenet-jpeg-256", "tokens", "hf-rows", "ingest")
PREPARE = ("imagenet-jpeg", "imagenet-jpeg-256")  # workloads that read a converted copy


def versions() -> dict[str, str]:
    import torch

    import kuat
    import kuat.convert.imagefolder  # noqa: F401  (imported before ingest is timed)
    import kuat.loader  # noqa: F401
    import kuat.sources.hf  # noqa: F401  (as_source's lookup; torch imports its v2 here too)
    import kuat.vision  # noqa: F401
    import kuat.vision.transforms  # noqa: F401  (kuat.vision imports it lazily)
    from kuat.vision import decode

    return {
        "kuat": kuat.__version__,
        "torch": torch.__version__,
        # the optional region (ROI) JPEG decoder and the libjpeg-turbo it runs on; without it
        # kuat decodes whole images (simplejpeg)
        "kuat ROI decoder": _roi_decoder(decode),
    }


def _roi_decoder(decode) -> str:
    import importlib.util

    if decode._roi is not None:
        return f"built, on {decode._roi_libjpeg.describe()}"
    if importlib.util.find_spec("kuat.vision._roijpeg") is not None:
        return "built, but no usable libjpeg-turbo (simplejpeg decodes instead)"
    return "not built"


def prepare(workload: str, data: dict, cache_dir: Path) -> dict:
    if workload == "tokens":
        return {}
    from benchmarks.workloads import kuat_copy

    shorter = 256 if workload == "imagenet-jpeg-256" else None
    root = data.get("original_root", data["root"]) if shorter else data["root"]
    return {"kuat_path": kuat_copy(root, cache_dir, shorter)}


def ingest(data: dict, out_dir: Path, workers: int) -> int:
    import kuat
    from kuat.convert.imagefolder import from_imagefolder

    dst = out_dir / "data.kuat"
    from_imagefolder(data["root"], dst, num_workers=workers, progress=False, overwrite=True)
    return len(kuat.open(dst))


def image_dataset(path):
    """The kuat dataset at ``path`` with the image workloads' fused transform:
    ``RandomResizedCrop(IMAGE_SIZE)`` then ``RandomHorizontalFlip()`` (also what
    ``benchmarks/gil_floor.py`` reads in ``kuat bench --scaling``)."""
    import kuat
    from kuat import vision as kv

    return kuat.open(path).with_transform(
        {"image": kv.Compose([kv.RandomResizedCrop(IMAGE_SIZE), kv.RandomHorizontalFlip()])}
    )


def build(workload: str, data: dict, spec: dict) -> Loader:
    import kuat

    opts = spec.get("options", {})
    workers = num_workers(spec)
    if workload == "hf-rows":
        from benchmarks import bench_hf

        indices = bench_hf.order(data["num_rows"], spec.get("seed", 0))
        loader = bench_hf.kuat_loader(data, workers, indices, opts.get("worker_type", "thread"))
        return Loader(lambda e: iter(loader), getattr(loader, "close", None))
    if workload.startswith("imagenet-jpeg"):
        ds = image_dataset(data["kuat_path"])
    elif workload == "tokens":
        from benchmarks.workloads import TokenWindows

        ds = TokenWindows(data["tokens_path"], data["offsets_path"], data["window"])
    else:
        raise ValueError(f"kuat adapter: unknown workload={workload!r}")
    loader = kuat.DataLoader(
        ds,
        batch_size=spec["batch_size"],
        shuffle=True,
        num_workers=workers,
        drop_last=True,
        persistent_workers=workers > 0,
        worker_type=opts.get("worker_type"),  # None: kuat's default
        seed=spec.get("seed", 0),
    )

    def epoch(e):
        return iter(loader)

    out = Loader(epoch, getattr(loader, "close", None))
    out.stats = loader.stats  # kuat's own measure of its Python per image (--scaling)
    return out
