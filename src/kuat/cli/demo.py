"""kuat demo: the main job, end to end, on real photos and nothing downloaded.

1. build (or reuse) an ImageNet-like ImageFolder cut from photos that installed packages ship;
2. convert it to a kuat dataset;
3. one epoch through torch's DataLoader over torchvision's ImageFolder (PIL decode) and one
   through kuat's DataLoader over the kuat dataset, same augmentations and output, each in a
   fresh process that has imported every library of both sides before it measures anything;
   print images/s and time to first batch (one epoch from a fresh loader, worker start-up included), then, in
   separate runs (the memory sampler costs CPU), the memory each loader adds (PSS summed over
   all the loader's processes, anonymous and file-backed apart);
4. train a small CNN for a bounded time from the kuat loader, printing the loss and the
   fraction of each step spent waiting for data.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="build demo images, convert them, race torch's DataLoader, train a small CNN",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--num-images", type=int, default=2000, help="demo dataset size (default 2000)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache root: the demo images and dataset are kept in DIR/demo (default $KUAT_CACHE, "
        "else $XDG_CACHE_HOME/kuat, else ~/.cache/kuat)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="num_workers of both loaders (default: all cores)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument(
        "--train-seconds",
        type=float,
        default=60.0,
        help="time budget of the training run in seconds; 0 skips it (default 60)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the loaders (default 0)")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    p.add_argument(
        "--text",
        action="store_true",
        help="the language-model demo instead: tokenize, pack, train a small transformer",
    )
    p.add_argument("--seq-len", type=int, default=512, help="(--text) packed row length in tokens (default 512)")
    return p


# --- one loader epoch, run in a fresh interpreter (python -m kuat.cli.demo measure ...) --------

LOADERS = {  # what the demo races, and the name its table gives each
    "torch": "torch DataLoader + ImageFolder (PIL)",
    "kuat": "kuat.DataLoader + kuat dataset",
}


def _import_both_sides() -> None:
    """Import every library either loader uses, before anything is timed or measured, so that
    neither side's imports (torchvision's take 1.8-2.6 s and about 400 MiB; kuat.open's
    pyarrow ~70 ms) land in its own or the other side's numbers (tests/test_demo.py checks
    that the epoch imports no kuat or pyarrow module)."""
    import torch  # noqa: F401
    import torchvision.datasets  # noqa: F401
    import torchvision.transforms.v2  # noqa: F401
    from PIL import JpegImagePlugin  # noqa: F401  (PIL's JPEG decoder, imported at first open)
    from tqdm.auto import tqdm  # noqa: F401

    import kuat  # noqa: F401
    import kuat.loader  # noqa: F401
    import kuat.sources.dataset  # noqa: F401  (kuat.open's module: kuat.format and pyarrow, ~70 ms)
    import kuat.vision  # noqa: F401
    import kuat.vision.decode  # noqa: F401  (loads the ROI decoder and its libjpeg-turbo)
    import kuat.vision.transforms  # noqa: F401


def _measure(which: str, path: str, workers: int, batch_size: int, seed: int, memory: bool) -> dict:
    """One epoch of ``which`` ("torch" or "kuat"); returns the measurements as a dict.

    With ``memory`` the PSS of this process tree is sampled during the epoch (``added_mib``
    by kind: see :mod:`kuat._memory`) and the times are not reported; without
    it nothing runs beside the loader.
    """
    import contextlib

    _import_both_sides()
    import torch
    from tqdm.auto import tqdm

    from kuat._memory import PeakMemory

    torch.manual_seed(seed)
    mem = PeakMemory() if memory else None
    with mem if mem is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        if which == "torch":
            from torchvision import datasets
            from torchvision.transforms import v2

            tf = v2.Compose(
                [v2.RandomResizedCrop(224), v2.RandomHorizontalFlip(), v2.PILToTensor()]
            )
            ds = datasets.ImageFolder(path, transform=tf)
            loader = torch.utils.data.DataLoader(
                ds, batch_size=batch_size, shuffle=True, num_workers=workers
            )

            def unpack(batch):
                return batch[0], batch[1]
        else:
            import kuat
            from kuat import vision as kv

            ds = kuat.open(path).with_transform(
                {"image": kv.Compose([kv.RandomResizedCrop(224), kv.RandomHorizontalFlip()])}
            )
            loader = kuat.DataLoader(
                ds, batch_size=batch_size, shuffle=True, num_workers=workers, seed=seed
            )

            def unpack(batch):
                return batch["image"], batch["label"]

        n = 0
        first = None
        labels = torch.zeros(0, dtype=torch.int64)
        bar = tqdm(loader, desc=f"{which} epoch", unit="batch", leave=False, disable=None)
        for batch in bar:
            images, label = unpack(batch)
            if first is None:
                first = time.perf_counter() - t0
                if images.dtype != torch.uint8 or tuple(images.shape[1:]) != (3, 224, 224):
                    raise RuntimeError(f"{which}: unexpected batch {images.dtype} {images.shape}")
            n += images.shape[0]
            labels = torch.cat([labels, label.to(torch.int64)])
        elapsed = time.perf_counter() - t0
        del loader
    out = {"loader": which, "images": n, "label_counts": torch.bincount(labels).tolist()}
    if mem is not None:
        out["added_mib"] = {k: v / 2**20 for k, v in mem.added.items()}
        out["peak_mib"] = mem.peak["pss"] / 2**20
    else:
        out.update(epoch_s=elapsed, images_per_s=n / elapsed, first_batch_s=first)
    return out


def _measure_in_subprocess(mode: str, which: str, path: Path, args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "kuat.cli.demo",
        "measure",
        mode,
        which,
        str(path),
        str(args.workers),
        str(args.batch_size),
        str(args.seed),
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"the {which} loader run failed (exit {proc.returncode}): {' '.join(cmd)}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- training -----------------------------------------------------------------------------


def _train(path: Path, num_classes: int, args) -> dict:
    import torch
    from torch import nn
    from tqdm.auto import tqdm

    import kuat
    from kuat import vision as kv

    torch.manual_seed(args.seed)
    ds = kuat.open(path).with_transform(
        {
            "image": kv.Compose(
                [
                    kv.RandomResizedCrop(224),
                    kv.RandomHorizontalFlip(),
                    kv.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
                ]
            )
        }
    )
    loader = kuat.DataLoader(
        ds,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        drop_last=True,
        persistent_workers=args.workers > 0,
        seed=args.seed,
    )
    if len(loader) == 0:
        raise ValueError(
            f"no full batch of {args.batch_size} in {len(ds)} images: nothing to train on"
        )

    def block(cin: int, cout: int, k: int, s: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    model = nn.Sequential(  # (B, 3, 224, 224) float32 -> (B, num_classes) logits
        *block(3, 24, 5, 4),  # -> (B, 24, 56, 56)
        *block(24, 48, 3, 2),  # -> (B, 48, 28, 28)
        *block(48, 96, 3, 2),  # -> (B, 96, 14, 14)
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),  # -> (B, 96)
        nn.Linear(96, num_classes),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()

    steps, wait_s, total_s = 0, 0.0, 0.0
    log_every_s, next_log = 10.0, 10.0
    history = []
    window_loss, window_correct, window_n = 0.0, 0, 0
    bar = tqdm(
        total=round(args.train_seconds),
        desc="training",
        leave=False,
        disable=None,
        bar_format="{desc}: {bar} {n:.0f}/{total:.0f} s",
    )
    start = time.perf_counter()
    try:
        while total_s < args.train_seconds:
            it = iter(loader)
            while total_s < args.train_seconds:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                t1 = time.perf_counter()
                x, y = batch["image"], batch["label"]  # (B, 3, 224, 224) float32, (B,) int64
                logits = model(x)
                loss = loss_fn(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                t2 = time.perf_counter()
                wait_s += t1 - t0
                total_s = t2 - start
                steps += 1
                window_loss += loss.item() * len(y)
                window_correct += int((logits.argmax(1) == y).sum())
                window_n += len(y)
                bar.update(round(total_s) - bar.n)
                if total_s >= next_log or total_s >= args.train_seconds:
                    entry = {
                        "t_s": round(total_s, 1),
                        "step": steps,
                        "loss": window_loss / window_n,
                        "train_acc": window_correct / window_n,
                    }
                    history.append(entry)
                    tqdm.write(
                        f"  t={entry['t_s']:5.1f}s  step {steps:4d}  loss {entry['loss']:.3f}"
                        f"  train acc {entry['train_acc']:.2f}"
                    )
                    window_loss, window_correct, window_n = 0.0, 0, 0
                    next_log += log_every_s
    finally:
        bar.close()
        loader.close()
    return {
        "steps": steps,
        "seconds": total_s,
        "data_wait_fraction": wait_s / total_s if total_s else 0.0,
        "history": history,
    }


# --- the command --------------------------------------------------------------------------


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if k == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def run(args) -> int:
    if args.workers < 0 or args.batch_size < 1 or args.train_seconds < 0 or args.seq_len < 2:
        raise SystemExit(  # both demos: a traceback from deep inside is no answer
            f"kuat demo: need --workers >= 0, --batch-size >= 1, --train-seconds >= 0 and "
            f"--seq-len >= 2; got --workers {args.workers}, --batch-size {args.batch_size}, "
            f"--train-seconds {args.train_seconds:g}, --seq-len {args.seq_len}"
        )
    if args.text:
        from kuat.cli.demo_text import run_text

        return run_text(args)
    import kuat.convert
    from kuat.demo_data import SOURCES, build_demo_imagefolder, default_cache_dir

    if (
        args.workers < 0
        or args.batch_size < 1
        or args.num_images < max(len(SOURCES), args.batch_size)
    ):
        raise SystemExit(
            f"kuat demo: need --workers >= 0, --batch-size >= 1 and --num-images >= "
            f"max({len(SOURCES)} classes, --batch-size); got --workers {args.workers}, "
            f"--batch-size {args.batch_size}, --num-images {args.num_images}"
        )
    cache = args.cache_dir or default_cache_dir()
    print(f"kuat demo: {args.num_images} images, {args.workers} workers, cache {cache}")

    print("\n[1/4] demo ImageFolder")
    src = build_demo_imagefolder(cache / "demo", args.num_images, seed=args.seed)
    print(f"  {src}")

    print("\n[2/4] kuat convert")
    dst = src.with_name(src.name + ".kuat")
    t0 = time.perf_counter()
    kuat.convert.from_imagefolder(
        src, dst, num_workers=max(1, args.workers), progress=True, overwrite=True
    )
    conv_s = time.perf_counter() - t0
    print(
        f"  {dst}: {args.num_images} images in {conv_s:.1f}s ({args.num_images / conv_s:,.0f} images/s, start-up included)"
    )

    print(
        "\n[3/4] one epoch each from a fresh loader (worker start-up included; files in the "
        "page cache): torch DataLoader + torchvision ImageFolder (PIL) vs kuat.DataLoader; every "
        "library imported before the clock starts"
    )
    res = {
        w: _measure_in_subprocess("rate", w, src if w == "torch" else dst, args) for w in LOADERS
    }
    mem = {
        w: _measure_in_subprocess("memory", w, src if w == "torch" else dst, args) for w in LOADERS
    }
    for w in LOADERS:
        for r in (res[w], mem[w]):
            if r["images"] != args.num_images:
                raise RuntimeError(
                    f"{w} loader yielded {r['images']} images, not {args.num_images}"
                )
    if res["torch"]["label_counts"] != res["kuat"]["label_counts"]:
        raise RuntimeError("the two loaders yielded different label counts")
    t, k = res["torch"], res["kuat"]
    rows = [
        [
            "loader", "images/s", "first batch (s)", "added MiB: anonymous", "shared",
            "anonymous + shared", "file-backed",
        ],
        *(
            [
                LOADERS[w],
                f"{res[w]['images_per_s']:,.0f}",
                f"{res[w]['first_batch_s']:.2f}",
                f"{mem[w]['added_mib']['anon']:,.0f}",
                f"{mem[w]['added_mib']['shm_system']:,.0f}",
                f"{mem[w]['added_mib']['anon_shared']:,.0f}",
                f"{mem[w]['added_mib']['file']:,.0f}",
            ]
            for w in LOADERS
        ),
    ]
    print(_table(rows))
    print(
        f"  against {LOADERS['torch']}, over one epoch from a fresh loader: kuat "
        f"{k['images_per_s'] / t['images_per_s']:.2f}x the images/s, "
        f"{k['first_batch_s'] / t['first_batch_s']:.2f}x the time to first batch. Memory "
        "from separate runs; shared is the machine's /dev/shm and memfd pages, mapped or not "
        "(torch's prefetched batches wait there); file-backed pages (kuat's memory-mapped "
        "shard) are page cache the kernel can reclaim. For steady-state rates against the strongest torch "
        "configuration (torch + decode_jpeg), run `kuat bench`."
    )

    train = None
    if args.train_seconds > 0:
        print(f"\n[4/4] training a small CNN for {args.train_seconds:.0f}s from kuat.DataLoader")
        train = _train(dst, len(SOURCES), args)
        h = train["history"]
        print(
            f"  {train['steps']} steps; loss {h[0]['loss']:.3f} -> {h[-1]['loss']:.3f}; "
            f"waiting for data {100 * train['data_wait_fraction']:.1f}% of step time"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"loaders": res, "memory": mem, "convert_s": conv_s, "train": train}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "measure" and sys.argv[2] in ("rate", "memory"):
        _, _, mode, which, path, workers, batch_size, seed = sys.argv
        out = _measure(which, path, int(workers), int(batch_size), int(seed), mode == "memory")
        print(json.dumps(out))
    else:
        sys.exit(
            "usage: python -m kuat.cli.demo measure rate|memory torch|kuat PATH WORKERS BATCH SEED"
        )
