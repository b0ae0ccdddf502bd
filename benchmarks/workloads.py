"""The data every workload reads, generated (or reused) by the parent before any run.

All of it lives under the bench cache directory (default ``~/.cache/kuat/bench``) and is
reused across runs; nothing is downloaded.

- ``imagenet-jpeg``: the generated ImageNet-like ImageFolder
  (:func:`kuat.demo_data.build_demo_imagefolder`: JPEGs cut from the photos that
  scikit-image, scikit-learn and matplotlib ship, at ImageNet's size and bytes per pixel), or
  the user's ``--imagefolder``; :func:`image_stats` describes whichever was measured.
- ``smooth-jpeg``: the same generator without grain (:func:`smooth_jpeg`): ImageNet's sizes at
  about 0.19 bytes per pixel, the smooth photographs the issue's first measurements used. The
  loaders do exactly what they do in ``imagenet-jpeg`` (:data:`KIND`); only the files differ.
- ``imagenet-jpeg-256``: the ``imagenet-jpeg`` tree converted by kuat with
  ``resize_shorter=256``, and those very JPEG bytes exported once as an ImageFolder
  (:func:`resized_imagefolder`), so torch, torch + ``decode_jpeg`` and the full-size decode
  reference decode the same files kuat stores; ``original_root`` keeps the original tree for
  the one row that reads it (torch + PIL on the original files).
- ``tokens``: one flat ``uint16`` memmap of ``num_tokens`` ids (GPT-2 vocabulary size 50,257,
  so uint16 holds every id, as in nanoGPT), plus the random window start offsets of one epoch,
  read by every loader through the same :class:`TokenWindows` dataset.
- ``hf-rows``: from ``benchmarks/bench_hf.py`` (the HF sources area) when present.
- ``ingest``: the imagenet-jpeg tree, converted afresh by each writer.
- ``hf-stream`` (a table workload): Parquet files of token lists streamed by ``datasets``,
  written by ``benchmarks/bench_hf_stream.py`` itself.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

TOKEN_WINDOW = 1025  # 1,024 inputs + 1 shifted target, as nanoGPT reads them
VOCAB = 50257
IMAGE_WORKLOADS = ("imagenet-jpeg", "smooth-jpeg", "imagenet-jpeg-256", "ingest")
ALL = ("imagenet-jpeg", "smooth-jpeg", "imagenet-jpeg-256", "tokens", "hf-rows", "ingest")
# workload -> what the adapters run for it: smooth-jpeg is imagenet-jpeg on other files
KIND = {"smooth-jpeg": "imagenet-jpeg"}
# Workloads measured in the parent process by their own module (a table of their own, not one
# run per loader): name -> module under benchmarks/ with run(quick, progress) and
# markdown(result). The runner runs them; the report renders their tables.
TABLE_WORKLOADS = {
    "overhead": "bench_overhead", "remote": "bench_remote", "hf-stream": "bench_hf_stream",
}
RESIZE_SHORTER = 256  # imagenet-jpeg-256's --resize-shorter
BATCH_SIZE = {
    "imagenet-jpeg": 64,
    "smooth-jpeg": 64,
    "imagenet-jpeg-256": 64,
    "tokens": 32,
    "hf-rows": 64,
    "ingest": 0,
}


def imagenet_jpeg(num_images: int, progress: bool) -> dict:
    """The generated ImageNet-like ImageFolder with ``num_images`` JPEGs (built once, then
    reused from the kuat cache): ``{"root", "num_images"}``."""
    from kuat.demo_data import build_demo_imagefolder

    root = build_demo_imagefolder(num_images=num_images, seed=0, progress=progress)
    return {"root": str(root), "num_images": num_images}


def kind(workload: str) -> str:
    """What the adapters run for ``workload`` (``smooth-jpeg`` -> ``imagenet-jpeg``)."""
    return KIND.get(workload, workload)


def smooth_jpeg(num_images: int, progress: bool) -> dict:
    """The ImageNet-like ImageFolder without grain: the same photographs, crops, sizes and
    quality, about 0.19 bytes per pixel (built once, then reused): ``{"root", "num_images"}``."""
    from kuat.demo_data import build_demo_imagefolder

    root = build_demo_imagefolder(num_images=num_images, seed=0, progress=progress, grain=False)
    return {"root": str(root), "num_images": num_images}


def kuat_copy(root: str | Path, cache_dir: Path, resize_shorter: int | None = None) -> str:
    """The path of kuat's conversion of the ImageFolder at ``root``
    (``kuat.convert.from_imagefolder``: the original JPEG bytes, or re-encoded with
    ``resize_shorter``), converted once with every core and reused from
    ``cache_dir/kuat/<cache_key(root)>[-short<N>].kuat``. The kuat adapter reads it
    (``imagenet-jpeg``, ``imagenet-jpeg-256``) and :func:`resized_imagefolder` exports it."""
    import os

    from benchmarks.adapters import cache_key
    from kuat.convert.imagefolder import from_imagefolder

    name = cache_key(root) + (f"-short{resize_shorter}" if resize_shorter else "")
    dst = cache_dir / "kuat" / f"{name}.kuat"
    if not (dst / "manifest.json").exists():
        from_imagefolder(
            root,
            dst,
            num_workers=os.cpu_count() or 1,
            progress=False,
            overwrite=True,
            resize_shorter=resize_shorter,
        )
    return str(dst)


def resized_imagefolder(original_root: str | Path, cache_dir: Path) -> dict:
    """imagenet-jpeg-256's data: kuat's ``resize_shorter=256`` conversion of
    ``original_root`` (:func:`kuat_copy`, converted here if missing) and its
    image bytes written once as an ImageFolder beside it, byte for byte what kuat stores.

    Returns ``{"root": exported tree, "original_root", "kuat_path"}``. The export is named
    after the converted dataset's manifest checksum, so a reconverted dataset is exported
    again. Raises ValueError when the dataset has no ``image`` and ``label`` fields.
    """
    import hashlib

    from kuat.format import open_store

    kuat_path = kuat_copy(str(original_root), cache_dir, RESIZE_SHORTER)
    manifest = (Path(kuat_path) / "manifest.json").read_bytes()
    out = cache_dir / "resized" / f"{Path(kuat_path).stem}-{hashlib.sha1(manifest).hexdigest()[:8]}"
    if not (out / ".complete").exists():
        store = open_store(kuat_path)
        if "image" not in store.schema or "label" not in store.schema:
            raise ValueError(f"{kuat_path} has no image and label fields: {store.schema}")
        from benchmarks.adapters import list_imagefolder

        classes = list_imagefolder(original_root)[2]
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        for c in classes:
            (tmp / c).mkdir(parents=True)
        n, step = store.num_rows, 256
        for start in range(0, n, step):
            rows = list(range(start, min(n, start + step)))
            cols = store.read_batch(rows, ["image", "label"])
            images = cols["image"]
            for i, data, codec, label in zip(rows, images.data, images.codec, cols["label"]):
                suffix = "jpg" if codec == "jpeg" else codec
                (tmp / classes[int(label)] / f"{i:07d}.{suffix}").write_bytes(data)
        (tmp / ".complete").write_text(f"{n} images exported from {kuat_path}\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return {"root": str(out), "original_root": str(original_root), "kuat_path": kuat_path}


def image_stats(root: str | Path, generated: bool, corpus: str = "ImageNet-like") -> dict:
    """What an image workload measured: ``{"source", "corpus", "root", **corpus_stats(root)}``
    where ``source`` is ``"generated"`` (``corpus`` names which generated corpus) or
    ``"imagefolder"`` (the user's ``--imagefolder``); see
    :func:`kuat.demo_data.corpus_stats`."""
    from kuat.demo_data import corpus_stats

    return {
        "source": "generated" if generated else "imagefolder",
        "corpus": corpus,
        "root": str(root),
        **corpus_stats(root),
    }


class TokenWindows:
    """Map-style dataset every loader reads in the tokens workload: sample ``i`` is
    ``{"tokens": tokens[offsets[i] : offsets[i] + window]}`` as a ``(T,)`` int64 tensor.

    ``__getitems__`` gathers a whole batch of windows in one NumPy fancy-indexing call; torch's
    DataLoader (>= 2.2) and kuat's both call it when it exists, and per-sample loaders
    (torchdata.nodes) call ``__getitem__``; so the loaders differ only in what they do around
    the dataset. Thread-safe (reads only); the memmap is opened lazily in each process and is
    not pickled.
    """

    def __init__(self, path: str, offsets_path: str, window: int) -> None:
        self.path = path
        self.offsets = np.load(offsets_path)  # (N,) int64
        self.window = window
        self._arange = np.arange(window, dtype=np.int64)  # (T,)
        self._mm = None

    def __len__(self) -> int:
        return len(self.offsets)

    def _tokens(self) -> np.ndarray:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        return self._mm

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_mm": None}

    def __getitem__(self, i: int) -> dict:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices) -> list[dict]:
        import torch

        starts = self.offsets[np.asarray(indices, dtype=np.int64)]  # (B,)
        rows = starts[:, None] + self._arange  # (B, T) token positions
        batch = torch.from_numpy(self._tokens()[rows].astype(np.int64))  # (B, T) u16 -> i64
        return [{"tokens": t} for t in batch]  # (T,) views of one (B, T) buffer


def tokens(cache_dir: Path, num_tokens: int, num_windows: int, seed: int = 0) -> dict:
    """A ``(num_tokens,)`` uint16 memmap and ``(num_windows,)`` int64 window starts.

    Returns ``{"tokens_path", "offsets_path", "window", "num_tokens", "num_windows"}``.
    Raises ValueError when ``num_tokens`` cannot hold one window.
    """
    if num_tokens <= TOKEN_WINDOW:
        raise ValueError(f"num_tokens={num_tokens} must exceed the window of {TOKEN_WINDOW}")
    d = cache_dir / "tokens"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"tokens-u16-n{num_tokens}-s{seed}.bin"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        mm = np.memmap(tmp, dtype=np.uint16, mode="w+", shape=(num_tokens,))
        rng = np.random.default_rng(seed)
        step = 1 << 23
        for start in range(0, num_tokens, step):
            n = min(step, num_tokens - start)
            mm[start : start + n] = rng.integers(0, VOCAB, n, dtype=np.uint16)
        mm.flush()
        del mm
        tmp.rename(path)
    offsets_path = d / f"offsets-n{num_tokens}-w{num_windows}-s{seed}.npy"
    if not offsets_path.exists():
        rng = np.random.default_rng(seed + 1)
        offsets = rng.integers(0, num_tokens - TOKEN_WINDOW, num_windows, dtype=np.int64)
        np.save(offsets_path, offsets)
    return {
        "tokens_path": str(path),
        "offsets_path": str(offsets_path),
        "window": TOKEN_WINDOW,
        "num_tokens": num_tokens,
        "num_windows": num_windows,
    }


def hf_rows(cache_dir: Path, num_rows: int) -> dict:
    """Delegates to ``benchmarks.bench_hf.prepare(cache_dir, num_rows)`` (the HF area's
    module). Raises ModuleNotFoundError when that module is not in the checkout."""
    from benchmarks import bench_hf

    return dict(bench_hf.prepare(cache_dir, num_rows))
