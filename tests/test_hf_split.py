"""A streamed HF dataset split by position before the per-row work (kuat.sources._hf_split):
the same samples in the same order as reading the whole stream in every worker (the read-all
path) and as the stream's own order, on plain, shuffled, interleaved, mapped, filtered and
node-split streams, split by rank and by 0 / 2 thread / 2 process workers, resumed mid-epoch;
and a per-row map runs only on the rows a worker keeps."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")
pytest.importorskip("pyarrow.parquet")

from _hf_streams import (  # noqa: E402,F401
    B,
    Worker0of2,
    batches,
    load,
    loader,
    no_shutdown_sleep,
    rows_collate,
    write_parts,
)

import kuat  # noqa: E402
from kuat.sources import _hf_split  # noqa: E402
from kuat.sources.hf import HFIterableSource  # noqa: E402
from kuat.sources.stream import rank_share  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_parts(tmp_path_factory.mktemp("hfsplit"), seed=0, sizes=[41 + 6 * f for f in range(3)],
                       max_ids=6, vocab=99, row_group_size=11)


def _mapped(row):
    return {"twice": 2 * row["n"], "head": row["ids"][:2], "text": row["text"].upper()}


def _odd(row):
    return row["n"] % 2 == 1


def _stream(name, files):
    from datasets.distributed import split_dataset_by_node

    ds = load(files)
    if name == "plain":
        return ds
    if name == "shuffled":  # shards and buffer
        return ds.shuffle(seed=3, buffer_size=23).map(_mapped)
    if name == "interleaved":
        other = load(files[:1]).shuffle(seed=1, buffer_size=9)
        return datasets.interleave_datasets([ds, other], probabilities=[0.6, 0.4],
                                            seed=5).map(_mapped)
    if name == "mapped":
        return ds.map(_mapped).rename_column("twice", "double").select_columns(
            ["n", "double", "head"])
    if name == "filtered-then-mapped":  # rows through the filter, the map on kept rows only
        return ds.filter(_odd).map(_mapped)
    if name == "mapped-then-filtered":  # the read-all path: a filter above the map
        return ds.map(_mapped).filter(_odd)
    if name == "split-by-node":  # 3 shards over 2 nodes: by position, above the map
        return split_dataset_by_node(ds.map(_mapped), rank=1, world_size=2)
    if name == "skip-take":  # kept by position above the map: moved under it
        return ds.map(_mapped).skip(7).take(90).map(lambda r: {"k": r["twice"] + 1})
    raise AssertionError(name)


STREAMS = ["plain", "shuffled", "interleaved", "mapped", "filtered-then-mapped",
           "mapped-then-filtered", "split-by-node", "skip-take"]
CUT = {"mapped-then-filtered": False}  # whether the split is taken before per-row work


def _uses_cut(ds, monkeypatch) -> bool:
    src = HFIterableSource(ds)
    src.kuat_set_batching(B, False)
    with monkeypatch.context() as m:
        m.setattr(torch.utils.data, "get_worker_info", lambda: Worker0of2())
        return _hf_split.owned_examples(src, src._copy(0)) is not None


@pytest.mark.parametrize("name", STREAMS)
def test_same_samples_as_the_stream(files, name, monkeypatch):
    ds = _stream(name, files)
    assert _uses_cut(ds, monkeypatch) is CUT.get(name, True)
    rows = list(ds)  # the stream's own order (datasets, main process)
    want = batches(rows)
    assert list(loader(ds, 0)) == want
    assert list(loader(ds, 2, "thread")) == want
    if name == "split-by-node":
        return  # kuat refuses to split by rank a dataset split by node
    for rank in range(3):  # kuat's own rank split: DistributedSampler's rule on the stream
        for drop_last in (False, True):
            share = list(rank_share(iter(rows), rank, 3, drop_last))
            got = list(loader(ds, 2, "thread", rank=rank, world_size=3, drop_last=drop_last))
            assert got == batches(share, drop_last)


@pytest.mark.parametrize("name", ["shuffled", "mapped-then-filtered"])
def test_equal_to_the_read_all_path(files, name, monkeypatch):
    ds = _stream(name, files)
    dl = loader(ds, 2, "thread", rank=1, world_size=2)
    got = [list(dl), list(dl)]  # epochs 0 and 1 (set_epoch reshuffles shards and buffer)
    assert got[0] != got[1] or name != "shuffled"
    with monkeypatch.context() as m:
        m.setattr(_hf_split, "owned_examples", lambda stream, ds: None)
        dl = loader(ds, 2, "thread", rank=1, world_size=2)
        assert got == [list(dl), list(dl)]


@pytest.mark.parametrize("name", ["interleaved", "split-by-node"])
def test_process_workers(files, name):
    ds = _stream(name, files)
    want = batches(list(ds))
    assert list(loader(ds, 2, "process")) == want


def test_resume_mid_epoch(files):
    ds = _stream("shuffled", files)
    full = list(loader(ds, 2, "thread"))
    for k in (1, 5, len(full) - 1):
        dl = loader(ds, 2, "thread")
        it = iter(dl)
        for _ in range(k):
            next(it)
        state = dl.state_dict()
        del it
        for workers, wtype in ((0, None), (2, "thread"), (3, "thread")):
            resumed = loader(ds, workers, wtype)
            resumed.load_state_dict(state)
            assert list(resumed) == full[k:]


def test_map_runs_once_per_kept_row(files):
    """Two thread workers map each row once between them (the read-all path mapped every row
    in each worker): the function is called only on the rows a worker keeps, as in a torch
    worker reading datasets' own split."""
    seen = []
    lock = threading.Lock()

    def counted(row):
        with lock:
            seen.append(row["n"])
        return {"twice": 2 * row["n"]}

    ds = load(files).map(counted)
    n = sum(1 for _ in load(files))
    got = [r["twice"] for b in loader(ds, 2, "thread") for r in b]
    assert got == [2 * r["n"] for r in load(files)]
    assert sorted(seen) == sorted(v // 2 for v in got) and len(seen) == n


def test_rows_equal_torch_loader_with_default_collate(files):
    """With the default collate (the row path: lists of ints are ragged, so the map's output
    is collated) kuat's batches equal torch's DataLoader's at 0 workers."""
    ds = load(files).map(lambda r: {"k": r["n"] % 7}).select_columns(["n", "k"])
    want = list(torch.utils.data.DataLoader(ds, batch_size=B))
    got = list(kuat.DataLoader(ds, batch_size=B, num_workers=2, worker_type="thread"))
    assert len(got) == len(want)
    assert all(torch.equal(a["n"], b["n"]) and torch.equal(a["k"], b["k"])
               for a, b in zip(got, want, strict=True))


def test_decoded_images_only_for_kept_rows(monkeypatch):
    """An Image feature decodes in the formatting node on top of the Arrow reading: the share
    is taken on its Arrow tables and only kept rows are decoded (the same images, same order,
    plain, shuffled and mapped)."""
    import io

    from PIL import Image

    def png(i):
        b = io.BytesIO()
        Image.fromarray(np.full((2, 2, 3), i, np.uint8)).save(b, "PNG")
        return {"bytes": b.getvalue(), "path": None}

    feats = datasets.Features({"img": datasets.Image(), "i": datasets.Value("int64")})
    base = datasets.Dataset.from_dict({"img": [png(i) for i in range(30)], "i": list(range(30))},
                                      features=feats)
    streams = [base.to_iterable_dataset(num_shards=3),
               base.to_iterable_dataset(num_shards=3).shuffle(seed=2, buffer_size=7),
               base.to_iterable_dataset(num_shards=3).map(lambda r: {"s": int(r["i"]) * 3})]

    def values(batches):
        return [(r["i"], np.asarray(r["img"]).tolist(), r.get("s")) for b in batches for r in b]

    for ds in streams:
        assert _uses_cut(ds, monkeypatch)
        want = values(batches(list(ds)))
        assert values(loader(ds, 2, "thread")) == want
        assert values(loader(ds, 2, "process")) == want
