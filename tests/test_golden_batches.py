"""Golden batches: the SHA-256 of every batch of a fixed set of loader configurations.

A regression net for refactors that must not change behaviour (issue #27): the hashes in
``tests/data/golden_batches.json`` were computed on the code before the redesign (commit
de6134e), and every refactor since must reproduce them bit for bit. Each configuration is its
own test id; what it covers (kuat datasets over 0 workers, 2 threads and 2 processes, in
order, shuffled with ``seed=`` and in torch's ``RandomSampler`` order; a mid-epoch resume;
the fused JPEG crop path; packed text; Hugging Face map-style and streaming datasets;
``kuat.mix``; two explicit ranks; plain torch map-style and iterable datasets) is in
``CONFIGS`` below. Only public API is used, so the test survives a reorganisation of
``kuat``'s private modules.

Every dataset is built here, deterministically, in a temporary directory. A batch hashes as a
canonical walk of its structure: container types, dict keys sorted, lists and tuples in
order, tensors and arrays as dtype + shape + contiguous bytes, other leaves as their type and
``repr``. The hashes also depend on the environment's torch, NumPy, Pillow and libjpeg-turbo
(image bytes and pixels), so they hold in the project's pinned ``.venv``.

Regenerate ONLY for an intended behaviour change, never to make a refactor pass:

    KUAT_REGENERATE_GOLDEN=1 python -m pytest tests/test_golden_batches.py

writes the file (merging into it, so ``-k`` regenerates a subset) and skips the checks; say in
the commit message which behaviour changed and why the hashes had to.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

import kuat
import kuat.format as kf
from kuat import vision as kv

GOLDEN = Path(__file__).parent / "data" / "golden_batches.json"
REGENERATE = os.environ.get("KUAT_REGENERATE_GOLDEN") == "1"

THREADS = dict(num_workers=2, worker_type="thread")
PROCESSES = dict(num_workers=2, worker_type="process")
WORKERS = {"w0": dict(num_workers=0), "thread2": THREADS, "process2": PROCESSES}


# --- hashing -------------------------------------------------------------------------------


def _walk(h, obj) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        h.update(f"ndarray {a.dtype.str} {a.shape}|".encode())
        h.update(a.tobytes())
    elif isinstance(obj, dict):
        h.update(f"{type(obj).__name__} {len(obj)}{{".encode())
        for key in sorted(obj):
            _walk(h, key)
            _walk(h, obj[key])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__} {len(obj)}[".encode())
        for item in obj:
            _walk(h, item)
        h.update(b"]")
    elif isinstance(obj, (str, bytes, int, float, bool, np.generic)) or obj is None:
        h.update(f"{type(obj).__name__} {obj!r}|".encode())
    else:
        raise TypeError(f"golden hash: no canonical form for {type(obj)!r}")


def batch_hash(batch) -> str:
    h = hashlib.sha256()
    _walk(h, batch)
    return h.hexdigest()


def epochs(loader, n: int = 2) -> list[str]:
    """The hashes of ``n`` epochs of ``loader``'s batches, in order."""
    return [batch_hash(b) for _ in range(n) for b in loader]


# --- data, built once per module -----------------------------------------------------------

TABLE_ROWS = 50


def _write_table(path: Path, rows: int, offset: int, seed: int) -> Path:
    """label int64, x (3,) float32, name string; small shards so batches cross shards."""
    g = np.random.default_rng(seed)
    schema = {"label": kf.int64(), "x": kf.tensor((3,), "float32"), "name": kf.string()}
    with kuat.Writer(path, schema, shard_bytes=256) as w:
        w.write_batch({
            "label": (np.arange(rows) * 7 + offset) % 11 + offset,
            "x": g.standard_normal((rows, 3)).astype(np.float32),
            "name": [f"row-{offset + i}" for i in range(rows)],
        })
    return path


def _photo_jpeg(seed: int) -> bytes:
    """A JPEG of 90-149 x 100-179 pixels (drawn from ``seed``): gradients plus grain."""
    g = np.random.default_rng(seed)
    h, w = int(g.integers(90, 150)), int(g.integers(100, 180))
    y, x = np.mgrid[0:h, 0:w]
    hwc = np.stack([x * 255 // w, y * 255 // h, ((x + y) * 3) % 256], -1)  # (H, W, 3)
    hwc = np.clip(hwc + g.normal(0, 12, hwc.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(hwc).save(out, format="JPEG", quality=88)
    return out.getvalue()


def _write_images(path: Path, n: int) -> Path:
    images = [_photo_jpeg(1000 + i) for i in range(n)]
    with kuat.Writer(path, {"image": kf.image(), "label": kf.int64()}, shard_bytes=64 << 10) as w:
        w.write_batch({"image": images, "label": np.arange(n) % 5})
    return path


def _write_docs(path: Path, n: int) -> Path:
    """Token documents: lengths 0-40 (one longer than a row), token t of document d is
    ``(d * 37 + t) % 1000``."""
    lengths = np.random.default_rng(7).integers(0, 41, n)
    lengths[3] = 90
    docs = [((d * 37 + np.arange(k)) % 1000).astype(np.uint16) for d, k in enumerate(lengths)]
    with kuat.Writer(path, {"input_ids": kf.sequence("uint16")}, shard_bytes=512) as w:
        w.write_batch({"input_ids": docs})
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    return {
        "table": _write_table(root / "table.kuat", TABLE_ROWS, 0, seed=0),
        "table_b": _write_table(root / "table_b.kuat", 30, 1000, seed=1),
        "images": _write_images(root / "images.kuat", 24),
        "docs": _write_docs(root / "docs.kuat", 60),
    }


# --- torch datasets ------------------------------------------------------------------------


class MapRows(torch.utils.data.Dataset):
    """A plain map-style dataset: Python ``__getitem__`` returning a dict of tensors."""

    def __len__(self):
        return 37

    def __getitem__(self, i):
        return {"x": torch.arange(4, dtype=torch.float32) * i, "y": i % 3,
                "pair": (torch.tensor([i, -i]), f"s{i}")}


class ShardedStream(torch.utils.data.IterableDataset):
    """An iterable dataset that shards itself by ``get_worker_info()`` (torch's recipe)."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(wid, 41, nw):
            yield {"i": i, "v": torch.full((2,), float(i) / 4)}


class GlobalRNGRows(torch.utils.data.Dataset):
    """Draws from Python's, NumPy's and torch's global generators and from the sample's own
    generator: the loader isolates the global draws (reseeded per sample from ``(seed, epoch,
    index)``), so batches do not depend on the workers; ``worker_type=None`` moves to process
    workers when it sees the draws."""

    def __len__(self):
        return 21

    def __getitem__(self, i):
        return {"i": i, "py": random.random(), "np": np.random.randint(1 << 30),
                "torch": torch.rand(2), "own": int(kuat.sample_rng(i).numpy.integers(1 << 30))}


# --- configurations: id -> function(data) -> list of batch hashes --------------------------


def _table(data, **kw):
    return kuat.DataLoader(kuat.open(data["table"]), batch_size=8, **kw)


def _torch_order(make):
    """``seed=None``, ``shuffle=True``: torch's RandomSampler order from the default generator."""
    torch.manual_seed(0)
    return epochs(make())


CONFIGS: dict = {}
for _w, _kw in WORKERS.items():
    CONFIGS[f"table-{_w}-inorder"] = lambda d, kw=_kw: epochs(_table(d, **kw))
    CONFIGS[f"table-{_w}-seed"] = lambda d, kw=_kw: epochs(_table(d, shuffle=True, seed=3, **kw))
    CONFIGS[f"table-{_w}-seed-droplast"] = lambda d, kw=_kw: epochs(
        _table(d, shuffle=True, seed=3, drop_last=True, **kw))
    CONFIGS[f"table-{_w}-torchorder"] = lambda d, kw=_kw: _torch_order(
        lambda: _table(d, shuffle=True, **kw))


def _resume(data, kw, k=3):
    """Take ``k`` batches of epoch 0, save the state, resume in a new loader: the rest of epoch
    0 and all of epoch 1. Checks the resumed batches against an uninterrupted run."""
    make = lambda: _table(data, shuffle=True, seed=5, **kw)  # noqa: E731
    full = epochs(make())
    first = make()
    it = iter(first)
    head = [batch_hash(next(it)) for _ in range(k)]
    state = first.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    rest = epochs(resumed)
    assert head + rest == full, "resume is not exact"
    return rest


for _w in ("w0", "thread2", "process2"):
    CONFIGS[f"resume-{_w}"] = lambda d, kw=WORKERS[_w]: _resume(d, kw)


def _images(data, kw):
    ds = kuat.open(data["images"]).with_transform(
        {"image": kv.Compose([kv.RandomResizedCrop(48), kv.RandomHorizontalFlip()])})
    return epochs(kuat.DataLoader(ds, batch_size=8, shuffle=True, seed=11, **kw))


for _w, _kw in WORKERS.items():
    CONFIGS[f"images-fused-{_w}"] = lambda d, kw=_kw: _images(d, kw)


def _packed(data, kw, strategy):
    rows = kuat.pack(kuat.open(data["docs"]), 32, strategy, buffer_size=16, shuffle=True, seed=2)
    return epochs(kuat.DataLoader(rows, batch_size=4, collate_fn=kuat.pack_collate(), seed=2,
                                  **kw))


for _w in ("w0", "thread2"):
    for _s in ("best_fit", "concat"):
        CONFIGS[f"pack-{_s}-{_w}"] = lambda d, kw=WORKERS[_w], s=_s: _packed(d, kw, s)


def _hf_table():
    g = np.random.default_rng(4)
    n = 29
    return datasets.Dataset.from_dict({
        "x": g.standard_normal((n, 3)).astype(np.float32).tolist(),
        "label": [i % 4 for i in range(n)],
        "tokens": [list(range(i % 5 + 1)) for i in range(n)],
    })


def _hf_add_sum(batch):  # a set_transform: batched dict of lists in, dict of lists out
    return {"label": batch["label"], "sum": [float(sum(x)) for x in batch["x"]]}


def _hf(kind, kw):
    hf = _hf_table()
    if kind == "torch":
        ds, extra = hf.with_format("torch"), dict(collate_fn=kuat.pad_collate(pad_value=0))
    elif kind == "transform":
        ds, extra = hf, {}
        ds.set_transform(_hf_add_sum)
    else:  # "stream"
        stream = hf.remove_columns("tokens").to_iterable_dataset(num_shards=2)
        ds, extra = stream.shuffle(seed=3, buffer_size=8), {}  # a new order each epoch
    shuffle = dict(shuffle=True) if kind != "stream" else {}
    return epochs(kuat.DataLoader(ds, batch_size=8, seed=6, **shuffle, **extra, **kw))


for _k in ("torch", "transform", "stream"):
    for _w in ("w0", "thread2"):
        CONFIGS[f"hf-{_k}-{_w}"] = lambda d, k=_k, kw=WORKERS[_w]: _hf(k, kw)


def _mix(data, kw, stopping):
    mixed = kuat.mix([kuat.open(data["table"]), kuat.open(data["table_b"])], weights=[0.7, 0.3],
                     stopping=stopping, seed=9)
    return epochs(kuat.DataLoader(mixed, batch_size=8, shuffle=True, seed=9, **kw))


for _w in ("w0", "thread2"):
    for _s in ("first_exhausted", "all_exhausted"):
        CONFIGS[f"mix-{_s}-{_w}"] = lambda d, kw=WORKERS[_w], s=_s: _mix(d, kw, s)


def _rank(data, rank, kw):
    return epochs(_table(data, shuffle=True, seed=4, rank=rank, world_size=2, **kw))


for _r in (0, 1):
    for _w in ("w0", "thread2"):
        CONFIGS[f"rank{_r}of2-{_w}"] = lambda d, r=_r, kw=WORKERS[_w]: _rank(d, r, kw)


for _w, _kw in WORKERS.items():
    CONFIGS[f"torch-map-{_w}"] = lambda d, kw=_kw: epochs(
        kuat.DataLoader(MapRows(), batch_size=6, shuffle=True, seed=8, **kw))
    CONFIGS[f"torch-iterable-{_w}"] = lambda d, kw=_kw: epochs(
        kuat.DataLoader(ShardedStream(), batch_size=5, **kw))

    CONFIGS[f"torch-map-globalrng-{_w}"] = lambda d, kw=_kw: epochs(
        kuat.DataLoader(GlobalRNGRows(), batch_size=4, shuffle=True, seed=12, **kw))
CONFIGS["torch-map-globalrng-auto2"] = lambda d: epochs(  # threads, then processes
    kuat.DataLoader(GlobalRNGRows(), batch_size=4, shuffle=True, seed=12, num_workers=2))

# many cheap batches: after 16 of them thread workers may hand the rest of the epoch to the
# training loop's thread (an adaptive choice that must not change a batch)
for _w in ("w0", "thread2"):
    CONFIGS[f"table-{_w}-smallbatch"] = lambda d, kw=WORKERS[_w]: epochs(
        kuat.DataLoader(kuat.open(d["table"]), batch_size=2, shuffle=True, seed=3, **kw))
    CONFIGS[f"torch-map-smallbatch-{_w}"] = lambda d, kw=WORKERS[_w]: epochs(
        kuat.DataLoader(MapRows(), batch_size=1, shuffle=True, seed=8, **kw))


# configurations that must give the same batches whatever the workers (their worker count and
# type change nothing by design: kuat's order, per-sample randomness, one batch per call)
SAME = {
    **{f"table-{o}": [f"table-{w}-{o}" for w in WORKERS]
       for o in ("inorder", "seed", "seed-droplast", "torchorder")},
    "resume": [f"resume-{w}" for w in WORKERS],
    "images-fused": [f"images-fused-{w}" for w in WORKERS],
    "torch-map": [f"torch-map-{w}" for w in WORKERS],
    "torch-map-globalrng": [f"torch-map-globalrng-{w}" for w in [*WORKERS, "auto2"]],
    "table-smallbatch": ["table-w0-smallbatch", "table-thread2-smallbatch"],
    "torch-map-smallbatch": ["torch-map-smallbatch-w0", "torch-map-smallbatch-thread2"],
    # kuat splits these streams across workers by whole batches (kuat.sources.protocol.Batching;
    # HF streams by position, not by datasets' shard-per-worker rule)
    **{f"pack-{s}": [f"pack-{s}-w0", f"pack-{s}-thread2"] for s in ("best_fit", "concat")},
    "hf-stream": ["hf-stream-w0", "hf-stream-thread2"],
    **{f"hf-{k}": [f"hf-{k}-w0", f"hf-{k}-thread2"] for k in ("torch", "transform")},
    **{f"mix-{s}": [f"mix-{s}-w0", f"mix-{s}-thread2"]
       for s in ("first_exhausted", "all_exhausted")},
    **{f"rank{r}of2": [f"rank{r}of2-w0", f"rank{r}of2-thread2"] for r in (0, 1)},
}


# --- the tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden():
    stored = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    computed: dict[str, list[str]] = {}
    yield stored, computed
    if REGENERATE and computed:
        merged = {**stored, **computed}
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")


@pytest.mark.parametrize("config", list(CONFIGS))
def test_golden_batches(config, data, golden):
    stored, computed = golden
    hashes = CONFIGS[config](data)
    assert hashes, f"{config}: no batches"
    computed[config] = hashes
    if REGENERATE:
        pytest.skip(f"KUAT_REGENERATE_GOLDEN=1: {config} written to {GOLDEN.name}")
    assert config in stored, (f"{config} has no golden hashes; regenerate (module docstring) "
                              "only if this configuration is new")
    want = stored[config]
    assert len(hashes) == len(want), f"{config}: {len(hashes)} batches, golden has {len(want)}"
    diff = [i for i, (a, b) in enumerate(zip(hashes, want)) if a != b]
    assert not diff, f"{config}: batches {diff} differ from the golden ones"


@pytest.mark.parametrize("group", list(SAME))
def test_worker_count_and_type_change_nothing(group, golden):
    stored, _ = golden
    lists = {c: stored.get(c) for c in SAME[group]}
    if REGENERATE or any(v is None for v in lists.values()):
        pytest.skip("no stored hashes to compare")
    first = next(iter(lists.values()))
    assert all(v == first for v in lists.values()), f"{group}: {list(lists)} differ"
