"""GPU checks (issue 12): nvJPEG batch decode against the CPU path, and whether the loader's
device prefetch hides the host-to-device copy behind a ResNet-50 training step.

Run on a machine with a CUDA device (it refuses to run without one, except ``--smoke`` (or
``--cpu``), which runs every CPU part at toy sizes, 1 and 2 workers, and skips the CUDA-only
parts (nvJPEG, DALI's GPU pipeline), so the script itself can be tested anywhere;
``tests/test_bench_gpu_check.py`` runs it)::

    python -m benchmarks.gpu_check --out gpu.json            # about 8-10 minutes on 16 cores
    python -m benchmarks.gpu_check --parts sweep --out sweep.json   # one part per call
    python -m benchmarks.gpu_check --smoke --out smoke.json  # CPU, about 15-30 s

What it measures, every loader over the same generated ImageNet-like JPEGs
(:func:`kuat.demo_data.build_demo_imagefolder`: ImageNet's size and bytes per pixel), with
the same work per image (RandomResizedCrop(224) + horizontal flip, uint8 ``(B, 3, 224, 224)``
on the GPU at the end of each step):

* ``decode``: images/s into GPU memory, no model. ``torch-pil`` (torchvision ImageFolder + PIL +
  ``transforms.v2``, process workers, ``pin_memory=True``, non-blocking copy: the stock
  pipeline), ``torch-nvjpeg`` (torchvision's documented GPU path: file bytes from the
  workers, ``torchvision.io.decode_jpeg(list, device="cuda")``, ``v2.RandomResizedCrop`` and flip
  per image on the GPU), ``kuat-cpu`` (fused region decode in thread workers, ``device="cuda"``),
  ``kuat-cpu-processes`` (the same in process workers over shared memory) and ``kuat-nvjpeg`` (``Compose(..., decode_device="cuda")``). Medians and min-max over
  ``--rounds`` interleaved rounds of ``--epochs`` epochs after one warm-up epoch.
* ``sweep``: the same decode into GPU memory for ``torch-pil``, ``kuat-cpu`` and
  ``kuat-cpu-processes`` at 1, 2, 4, 8, 16 workers (up to ``--workers``): images/s and the
  efficiency against linear, ``rate(n) / (n * rate(1))`` within each round (target for kuat:
  >= 0.8 from 1 to 16 workers). Each point builds its loader afresh, reads a few warm-up
  batches, then batches for ``--sweep-seconds``, and closes it; ``--sweep-rounds`` rounds,
  interleaved.
* ``dali-gpu`` (in ``decode`` and ``resnet50``, where ``nvidia.dali`` imports): DALI's GPU
  pipeline as its ResNet-50 example builds it: ``fn.readers.file`` ->
  ``fn.decoders.image_random_crop(device="mixed")`` (nvJPEG, torchvision's area and aspect
  ranges) -> ``fn.resize`` (antialiased linear) -> ``fn.crop_mirror_normalize(uint8, CHW,
  mirror=coin_flip)`` on the GPU; ``num_threads`` = workers.
* ``resnet50``: a ResNet-50 training step (bf16 autocast, channels_last, SGD with momentum,
  normalisation on the GPU) fed by: ``synthetic`` (one batch already on the GPU: the step's own
  rate, the ceiling), ``pageable-sync`` (pre-decoded uint8 batches in pageable host memory,
  copied with a blocking ``.cuda()`` before each step: the copy is not hidden),
  ``kuat-prefetch`` (the same pre-decoded batches through ``kuat.DataLoader(device="cuda")``:
  pinned, copied on a side stream one batch ahead), and the decode pipelines above end to end.
  Reported: images/s, step-time ratio to ``synthetic`` and, for kuat, ``stats()``'s
  ``input_bound_fraction`` (the fraction of the loop's time spent waiting for input).

Results: a JSON file (``--out``) with the device, versions, corpus statistics, every
measurement and ``targets`` (issue 31's: the ResNet-50 step fed by kuat at >= 0.95x its rate
from data already on the GPU and >= 2x torch + PIL's, decode scaling efficiency >= 0.8 from 1
to 16 workers; each with the measured value, or why it was not measured); Markdown tables on
stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SIZE = 224
TORCH_TIMEOUT_S = 60  # torch's DataLoader(timeout=): a dead worker becomes an error, not a hang


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _env(device: str) -> dict:
    from kuat.vision import decode as kdecode

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "roi_decoder_built": kdecode._roi is not None,
        # which libjpeg-turbo it runs on (Pillow's bundled copy or the system's), or None
        "roi_libjpeg": kdecode._roi_libjpeg.describe() if kdecode._roi_libjpeg else None,
    }
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except ImportError:  # pragma: no cover - the script needs it; reported before failing
        info["torchvision"] = None
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            device_memory_gib=round(p.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    return info


# --- the loaders: each yields uint8 (B, 3, 224, 224) batches on `device` -------------------------


class _FileBytes(torch.utils.data.Dataset):
    """(file bytes as a uint8 tensor, label) per sample: torchvision's GPU-decode input."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        import torchvision.io

        path, label = self.samples[i]
        return torchvision.io.read_file(path), label


def _list_collate(batch):
    return [b[0] for b in batch], torch.tensor([b[1] for b in batch])


def _torch_loader(ds, batch_size, workers, **kw):
    """torch's DataLoader as every torch row uses it: shuffled, whole batches, persistent
    workers, ``timeout`` so that a dead worker is an error."""
    return torch.utils.data.DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        timeout=TORCH_TIMEOUT_S if workers > 0 else 0,
        **kw,
    )


def torch_pil(root, batch_size, workers, device):
    import torchvision
    from torchvision.transforms import v2

    tf = v2.Compose([v2.RandomResizedCrop(SIZE), v2.RandomHorizontalFlip(), v2.PILToTensor()])
    ds = torchvision.datasets.ImageFolder(root, transform=tf)
    dl = _torch_loader(ds, batch_size, workers, pin_memory=device == "cuda")

    def batches():
        for x, y in dl:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    return batches, dl


def torch_nvjpeg(root, batch_size, workers, device):
    import torchvision
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms import v2

    samples = torchvision.datasets.ImageFolder(root).samples
    dl = _torch_loader(_FileBytes(samples), batch_size, workers, collate_fn=_list_collate)
    tf = v2.Compose([v2.RandomResizedCrop(SIZE), v2.RandomHorizontalFlip()])

    def batches():
        for datas, y in dl:
            imgs = decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)  # B x (3, H, W) u8
            yield torch.stack([tf(im) for im in imgs]), y.to(device, non_blocking=True)

    return batches, dl


def _kuat_loader(path, batch_size, workers, device, decode_device, worker_type=None):
    import kuat
    from kuat import vision as kv

    c = kv.Compose(
        [kv.RandomResizedCrop(SIZE), kv.RandomHorizontalFlip()], decode_device=decode_device
    )
    ds = kuat.open(path).with_transform({"image": c})
    return kuat.DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        device=device,
        worker_type=worker_type,
    )


def _kuat_feed(dl):
    """``(batches, loader)``: ``batches()`` yields one epoch's ``(image, label)`` pairs."""
    return (lambda: ((b["image"], b["label"]) for b in dl)), dl


def kuat_cpu(path, batch_size, workers, device):
    return _kuat_feed(_kuat_loader(path, batch_size, workers, device, "cpu"))


def kuat_cpu_processes(path, batch_size, workers, device):
    return _kuat_feed(_kuat_loader(path, batch_size, workers, device, "cpu", worker_type="process"))


def kuat_nvjpeg(path, batch_size, workers, device):
    return _kuat_feed(_kuat_loader(path, batch_size, workers, device, device))


def dali_gpu(root, batch_size, workers, device):
    """DALI's GPU pipeline (nvJPEG through ``device="mixed"``); raises ImportError without
    ``nvidia.dali`` and RuntimeError without CUDA."""
    if device != "cuda":
        raise RuntimeError("DALI's GPU pipeline needs a CUDA device")
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(batch_size=batch_size, num_threads=workers, device_id=0, seed=1,
                  prefetch_queue_depth=2)  # fmt: skip
    def pipe():
        jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="Reader")
        images = fn.decoders.image_random_crop(
            jpegs, device="mixed", output_type=types.RGB, random_area=[0.08, 1.0],
            random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10,
        )  # fmt: skip
        images = fn.resize(images, resize_x=SIZE, resize_y=SIZE, interp_type=types.INTERP_LINEAR,
                           antialias=True)  # fmt: skip
        images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW",
                                          mirror=fn.random.coin_flip(probability=0.5))  # fmt: skip
        return images, labels.gpu()

    p = pipe()
    p.build()
    it = DALIGenericIterator([p], ["image", "label"], reader_name="Reader",
                             last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)  # fmt: skip

    def batches():
        for out in it:  # (B, 3, 224, 224) uint8 and (B, 1) int32, both on the GPU
            yield out[0]["image"], out[0]["label"].reshape(-1).long()

    return batches, None


def _close(loader) -> None:
    """Stop a loader's workers now: kuat's ``close()``, torch's persistent workers through
    its iterator (torch's DataLoader has no public close)."""
    if loader is None:
        return
    if hasattr(loader, "close"):
        loader.close()
        return
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


# --- measurements -----------------------------------------------------------------------------


def _epoch_rate(batches) -> tuple[float, int]:
    n = 0
    _sync()
    t0 = time.perf_counter()
    for x, _ in batches():
        assert x.shape[1:] == (3, SIZE, SIZE) and x.dtype == torch.uint8, (x.shape, x.dtype)
        n += x.shape[0]
    _sync()
    return n / (time.perf_counter() - t0), n


def measure_decode(makers: dict, rounds: int, epochs: int) -> dict:
    """Images/s per loader: one warm-up epoch, then ``rounds`` interleaved rounds of ``epochs``
    epochs each; median and min-max of the per-round rates. ``makers[name]()`` returns
    ``(batches, loader)``; every loader is closed at the end."""
    built, failed = {}, {}
    for name, make in makers.items():
        try:
            built[name] = make()
            _epoch_rate(built[name][0])  # warm-up: workers start, caches fill, nvJPEG starts
        except Exception as e:  # reported in the results; the other loaders still run
            failed[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            built.pop(name, None)
            print(f"{name} failed: {failed[name]['error']}", file=sys.stderr)
    rates = {name: [] for name in built}
    for _ in range(rounds):
        for name, (batches, _) in built.items():
            total_n, total_t = 0, 0.0
            for _ in range(epochs):
                _sync()
                t0 = time.perf_counter()
                _, n = _epoch_rate(batches)
                total_t += time.perf_counter() - t0
                total_n += n
            rates[name].append(total_n / total_t)
    for _, loader in built.values():
        _close(loader)
    return {name: _summary(r) for name, r in rates.items()} | failed


def _timed_rate(batches, seconds: float, warmup_batches: int) -> float:
    """Images/s over ``seconds`` of batches (epochs cycled) after ``warmup_batches``."""
    it = _cycle(batches)
    for _ in range(warmup_batches):
        next(it)
    _sync()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x, _ = next(it)
        n += x.shape[0]
    _sync()
    return n / (time.perf_counter() - t0)


def measure_sweep(makers: dict, counts: list[int], rounds: int, seconds: float) -> dict:
    """Images/s per loader and worker count: each point builds ``makers[name](workers)``,
    reads ``2 + workers`` warm-up batches, then batches for ``seconds`` (epochs cycled, so a
    slow point costs no more than a fast one), and closes it; rounds interleaved.

    Returns ``{name: {"rates": {n: summary}, "efficiency": {n: summary}}}`` (efficiency:
    ``rate(n) / (n * rate(1))`` within each round), plus ``"error"`` for a loader that failed
    (it is not built again; the points measured before stand)."""
    from benchmarks.scaling_report import efficiency

    rates: dict[str, dict[int, list[float]]] = {name: {} for name in makers}
    failed: dict[str, dict] = {}
    for _ in range(rounds):
        for n in counts:
            for name, make in makers.items():
                if name in failed:
                    continue
                loader = None
                try:
                    batches, loader = make(n)
                    rates[name].setdefault(n, []).append(_timed_rate(batches, seconds, 2 + n))
                except Exception as e:  # reported; the other loaders still run
                    failed[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
                    print(f"sweep {name} at {n} workers failed: {failed[name]['error']}",
                          file=sys.stderr)  # fmt: skip
                finally:
                    _close(loader)
    out: dict = {}
    for name, by_n in rates.items():
        eff = {n: [efficiency(r, r1, n) for r, r1 in zip(rs, by_n.get(1, []))]
               for n, rs in by_n.items()}  # fmt: skip
        out[name] = {
            "rates": {str(n): _summary(rs) for n, rs in by_n.items()},
            "efficiency": {str(n): _summary(e) for n, e in eff.items() if e},
        } | failed.get(name, {})  # the points measured before a failure are kept
    return out


def targets(result: dict, counts: list[int]) -> dict:
    """Issue 31's GPU-host targets against this run: each ``{"target", "value", "met"}`` or
    ``{"target", "not_measured"}``."""
    train, out = result.get("resnet50", {}), {}
    base = train.get("synthetic", {}).get("images_per_s")
    pil = train.get("torch-pil", {}).get("images_per_s")
    kuat = {k: r["images_per_s"] for k, r in train.items()
            if k.startswith("kuat-") and k != "kuat-prefetch" and "images_per_s" in r}  # fmt: skip
    best = max(kuat, key=kuat.get) if kuat else None
    if best and base:
        v = kuat[best] / base
        out["resnet50_vs_on_gpu"] = {"target": ">= 0.95", "loader": best, "value": v,
                                     "met": v >= 0.95}  # fmt: skip
    else:
        out["resnet50_vs_on_gpu"] = {"target": ">= 0.95", "not_measured": "no kuat or synthetic"}
    if best and pil:
        v = kuat[best] / pil
        out["resnet50_vs_torch_pil"] = {"target": ">= 2.0", "loader": best, "value": v,
                                        "met": v >= 2.0}  # fmt: skip
    else:
        out["resnet50_vs_torch_pil"] = {"target": ">= 2.0", "not_measured": "no kuat or torch-pil"}
    top = str(counts[-1])
    for name in ("kuat-cpu", "kuat-cpu-processes"):
        e = result.get("sweep", {}).get(name, {}).get("efficiency", {}).get(top)
        key = f"decode_efficiency_1_to_{top}_{name}"
        if e and counts[-1] > 1:
            out[key] = {"target": ">= 0.8 (at 16 workers)", "value": e["median"],
                        "met": e["median"] >= 0.8}  # fmt: skip
        else:
            out[key] = {"target": ">= 0.8 (at 16 workers)", "not_measured": f"no sweep to {top}"}
    return out


def _summary(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": values,
    }


def _resnet(device: str, tiny: bool = False):
    import torchvision

    if tiny:  # --smoke: the same step on a model small enough for a loaded CPU
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 7, stride=8),
            torch.nn.Flatten(),
            torch.nn.Linear(8 * 28 * 28, 1000),
        )
    else:
        model = torchvision.models.resnet50(weights=None, num_classes=1000)
    model = model.to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")

    def step(x_u8, y):
        x = ((x_u8.float() - mean) / std).contiguous(memory_format=torch.channels_last)
        with amp:
            loss = torch.nn.functional.cross_entropy(model(x), y % 1000)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def measure_training(feeds: dict, steps: int, warmup: int, device: str, tiny: bool) -> dict:
    """ResNet-50 training images/s per feed (``steps`` timed steps after ``warmup``). Each
    feed is a factory returning ``(batches, loader)``, built right before its steps and closed
    after them, so one feed's workers never compete with another's."""
    step = _resnet(device, tiny)
    out = {}
    for name, make in feeds.items():
        loader = None
        try:
            batches, loader = make()
            out[name] = _train(step, batches, loader, steps, warmup)
        except Exception as e:  # reported in the results; the other feeds still run
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"{name} failed: {out[name]['error']}", file=sys.stderr)
        finally:
            _close(loader)
    base = out.get("synthetic", {}).get("images_per_s")
    for rec in out.values():
        if base and "images_per_s" in rec:
            rec["vs_synthetic"] = rec["images_per_s"] / base
    return out


def _train(step, make, loader, steps: int, warmup: int) -> dict:
    """One feed: ``warmup`` untimed steps, then ``steps`` timed ones."""
    it = _cycle(make)
    for _ in range(warmup):
        step(*next(it))
    _sync()
    loader = loader if hasattr(loader, "stats") else None  # kuat's stats(); torch has none
    before = loader.stats() if loader is not None else None  # stats are cumulative
    n = 0
    wait = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        tw = time.perf_counter()
        x, y = next(it)
        wait += time.perf_counter() - tw
        step(x, y)
        n += x.shape[0]
    _sync()
    dt = time.perf_counter() - t0
    rec = {"images_per_s": n / dt, "step_ms": dt / steps * 1e3, "host_wait_fraction": wait / dt}
    if loader is not None:
        after = loader.stats()
        waited = after["consumer_wait_s"] - before["consumer_wait_s"]
        elapsed = after["elapsed_s"] - before["elapsed_s"]
        rec["input_bound_fraction"] = waited / elapsed if elapsed > 0 else None
    return rec


def _cycle(batches):
    while True:
        yield from batches()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu.json"))
    ap.add_argument("--images", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=None, help="default: one per core")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sweep-rounds", type=int, default=2, help="interleaved sweep rounds")
    ap.add_argument("--sweep-seconds", type=float, default=5.0, help="timed seconds per point")
    ap.add_argument(
        "--parts",
        nargs="+",
        choices=("sweep", "decode", "train"),
        default=("sweep", "decode", "train"),
        help="what to measure (default all: about 8-10 minutes on 16 cores; split the parts "
        "over several calls where one call's time is bounded)",
    )
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument(
        "--torch-sharing-strategy",
        default=None,
        help="torch.multiprocessing sharing strategy for torch's worker processes (recorded)",
    )
    ap.add_argument(
        "--smoke",
        "--cpu",
        action="store_true",
        help="CPU only, toy sizes, 1 and 2 workers; skips nvJPEG and DALI (tests the script)",
    )
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device != "cuda" and not args.smoke:
        print(
            "no CUDA device: nothing to measure (use --smoke to test the script)", file=sys.stderr
        )
        return 2
    if args.smoke:
        args.images, args.batch_size, args.rounds, args.epochs, args.steps = 64, 16, 1, 1, 2
        args.sweep_rounds, args.sweep_seconds = 1, 0.3
        args.workers = min(args.workers or 2, 2)
    workers = args.workers or os.cpu_count() or 2
    from benchmarks.scaling import worker_counts

    counts = worker_counts(workers)
    torch.backends.cudnn.benchmark = True
    if args.torch_sharing_strategy:
        torch.multiprocessing.set_sharing_strategy(args.torch_sharing_strategy)

    import kuat.convert
    from kuat.demo_data import build_demo_imagefolder, corpus_stats

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kuat-gpu-"))
    t0 = time.perf_counter()
    root = build_demo_imagefolder(
        work / "corpus", num_images=args.images, seed=0, progress=False, num_workers=workers
    )
    path = work / "train.kuat"
    kuat.convert.from_imagefolder(root, path, overwrite=True, progress=False, num_workers=workers)
    print(f"corpus of {args.images} JPEGs built and converted in {time.perf_counter() - t0:.1f} s")
    result = {
        "env": _env(device),
        "config": {k: str(v) for k, v in vars(args).items()}
        | {"workers": workers, "sweep_counts": counts},
        "corpus": corpus_stats(root),
    }

    bs = args.batch_size
    # CPU decoding, handed to GPU memory: swept over worker counts
    cpu_makers = {
        "torch-pil": lambda n: torch_pil(root, bs, n, device),
        "kuat-cpu": lambda n: kuat_cpu(path, bs, n, device),
        "kuat-cpu-processes": lambda n: kuat_cpu_processes(path, bs, n, device),
    }
    # decoding on the GPU (nvJPEG): at the full worker count only; CUDA-only
    gpu_makers = {}
    if device == "cuda":
        gpu_makers = {
            "torch-nvjpeg": lambda n: torch_nvjpeg(root, bs, n, device),
            "kuat-nvjpeg": lambda n: kuat_nvjpeg(path, bs, n, device),
            "dali-gpu": lambda n: dali_gpu(root, bs, n, device),
        }
    else:
        result["skipped"] = {
            name: "needs a CUDA device" for name in ("torch-nvjpeg", "kuat-nvjpeg", "dali-gpu")
        }
    parts = set(args.parts)
    result["sweep"] = {}
    if "sweep" in parts:
        result["sweep"] = measure_sweep(cpu_makers, counts, args.sweep_rounds, args.sweep_seconds)
        args.out.write_text(json.dumps(result, indent=1))  # partial results survive a failure
        _print_sweep(result, counts)

    # the decode table at the full worker count: the sweep's top point for CPU decoding (or,
    # without the sweep, measured here), then the GPU decoders (built together, rounds
    # interleaved)
    top = str(counts[-1])
    result["decode"] = {
        name: sweep["rates"].get(top) or {"error": sweep.get("error", f"no point at {top}")}
        for name, sweep in result["sweep"].items()
    }
    if "decode" in parts:
        again = {} if result["sweep"] else cpu_makers
        result["decode"].update(measure_decode(
            {name: (lambda m=m: m(workers)) for name, m in {**again, **gpu_makers}.items()},
            args.rounds, args.epochs,
        ))  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))
        _print_decode(result)
    if "train" not in parts:
        print(f"wrote {args.out}")
        return 0

    # pre-decoded batches for the copy-hiding question: 8 distinct batches, pageable memory
    g = torch.Generator().manual_seed(0)
    pre = [
        (torch.randint(0, 256, (bs, 3, SIZE, SIZE), dtype=torch.uint8, generator=g),
         torch.randint(0, 1000, (bs,), generator=g))
        for _ in range(8)
    ]  # fmt: skip
    resident = (pre[0][0].to(device), pre[0][1].to(device))
    flat = torch.utils.data.TensorDataset(
        torch.cat([x for x, _ in pre]), torch.cat([y for _, y in pre])
    )

    def prefetch():
        dl = kuat.DataLoader(flat, batch_size=bs, num_workers=2, persistent_workers=True,
                             device=device)  # fmt: skip
        return (lambda: iter(dl)), dl

    feeds = {
        # the ceiling: one batch already in GPU memory, the step's own rate
        "synthetic": lambda: ((lambda: iter([resident] * 8)), None),
        "pageable-sync": lambda: ((lambda: ((x.to(device), y.to(device)) for x, y in pre)), None),
        "kuat-prefetch": prefetch,
    }
    makers = {**cpu_makers, **gpu_makers}
    for name in ("kuat-cpu", "kuat-cpu-processes", "kuat-nvjpeg", "dali-gpu", "torch-pil",
                 "torch-nvjpeg"):  # fmt: skip
        if name in makers and "error" not in result["decode"].get(name, {}):
            feeds[name] = lambda m=makers[name]: m(workers)
    result["resnet50"] = measure_training(
        feeds, args.steps, warmup=1 if args.smoke else 5, device=device, tiny=args.smoke
    )
    _print_training(result)
    result["targets"] = targets(result, counts)
    _print_targets(result)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


def _print_sweep(result: dict, counts: list[int]) -> None:
    print("\n| decode to GPU memory, by workers | " + " | ".join(
        f"{n} workers: images/s (vs linear)" for n in counts) + " |")  # fmt: skip
    print("|---|" + "---:|" * len(counts))
    for name, s in result["sweep"].items():
        if "error" in s and not s["rates"]:
            print(f"| {name} | failed: {s['error'][:80]} |" + " |" * (len(counts) - 1))
            continue
        cells = []
        for n in map(str, counts):
            r, e = s["rates"].get(n), s["efficiency"].get(n)
            cells.append(f"{r['median']:,.0f} ({e['median']:.2f})" if r and e else
                         f"{r['median']:,.0f}" if r else "")  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " |")


def _print_targets(result: dict) -> None:
    print("\n| target (issue 31) | wanted | measured |")
    print("|---|---:|---:|")
    for name, t in result["targets"].items():
        got = t.get("not_measured") or f"{t['value']:.2f} ({'met' if t['met'] else 'NOT met'})"
        print(f"| {name} | {t['target']} | {got} |")


def _print_decode(result: dict) -> None:
    d = result["decode"]
    base = d.get("torch-pil", {}).get("median")
    print("\n| decode to GPU memory | images/s, median (min-max) | vs torch-pil |")
    print("|---|---:|---:|")
    for name, s in d.items():
        if "error" in s:
            print(f"| {name} | failed: {s['error'][:80]} | |")
            continue
        ratio = f"{s['median'] / base:.2f}x" if base else "-"
        print(f"| {name} | {s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f}) | {ratio} |")


def _print_training(result: dict) -> None:
    print("\n| ResNet-50 step fed by | images/s | ms/step | vs synthetic | waiting for input |")
    print("|---|---:|---:|---:|---:|")
    for name, r in result["resnet50"].items():
        if "error" in r:
            print(f"| {name} | failed: {r['error'][:80]} | | | |")
            continue
        print(
            f"| {name} | {r['images_per_s']:,.0f} | {r['step_ms']:.1f} | "
            f"{r.get('vs_synthetic', float('nan')):.2f}x | {r['host_wait_fraction']:.1%} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
