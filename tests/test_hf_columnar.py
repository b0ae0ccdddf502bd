"""The columnar path for Hugging Face datasets (kuat.sources.hf_columnar, _hf_arrow, _hf_map):
batches built from Arrow equal the row path's and torch's DataLoader's (order, values, dtypes,
nesting), on plain, shuffled, interleaved and mapped streams, split by node, rank and worker,
and resumed mid-epoch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import kuat  # noqa: E402
from kuat.sources import _hf_arrow  # noqa: E402
from kuat.sources.hf import HFIterableSource, HFMapSource  # noqa: E402
from kuat.sources.stream import rank_share, worker_share  # noqa: E402

B = 16
PLAIN = ["label", "score", "text", "fixed", "flag"]  # default_collate can take these


@pytest.fixture(autouse=True)
def _no_shutdown_sleep(monkeypatch):
    """datasets sleeps 5 s whenever an iterator over Parquet shards that used its thread pool
    (interleaves, shuffled shards) ends (``SLEEP_TIME_ON_THREADS_SHUTDOWN``); these tests
    end dozens."""
    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


def _table(rng, n: int, f: int):
    lens = rng.integers(0, 9, n)
    ids = [rng.integers(0, 1000, k).tolist() for k in lens]
    return pa.table({
        "input_ids": pa.array(ids, pa.list_(pa.int32())),
        "label": pa.array(rng.integers(0, 5, n), pa.int64()),
        "score": pa.array(rng.random(n), pa.float32()),
        "text": [f"f{f}-{i}" for i in range(n)],
        "fixed": pa.array([[i, -i, 7] for i in range(n)], pa.list_(pa.int16())),
        "flag": pa.array(rng.random(n) < 0.5),
    })


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("hfcol")
    rng = np.random.default_rng(0)
    paths = []
    for f in range(4):
        p = out / f"part-{f}.parquet"
        pq.write_table(_table(rng, 300 + 41 * f, f), p, row_group_size=97)
        paths.append(str(p))
    return paths


@pytest.fixture(scope="module")
def small(files, tmp_path_factory):
    """Two files of 45 rows: streams whose row path is slow (datasets interleaves shuffled
    shards row by row through a thread pool)."""
    out = tmp_path_factory.mktemp("hfsmall")
    paths = []
    for f in range(2):
        p = out / f"part-{f}.parquet"
        pq.write_table(pq.read_table(files[f]).slice(0, 45), p, row_group_size=13)
        paths.append(str(p))
    return paths


def _load(files):
    return datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)


def same(a, b) -> bool:
    """Equal structures, types, dtypes, shapes and values."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b, strict=True)))
    return type(a) is type(b) and a == b


def rows_collate(rows):  # another callable: the loader keeps the row path
    return kuat.default_collate(rows)


def _columnar_used(ds, collate=kuat.default_collate) -> bool:
    src = HFIterableSource(ds)
    src.kuat_set_batching(B, False)
    return src.kuat_iter_collated(collate, B, False) is not None


def _check(ds, *, workers=(0, 2), columnar=True, collate_fn=None, **kw):
    """kuat's columnar batches == kuat's row path == torch's (0 workers, one rank)."""
    collate = collate_fn or kuat.default_collate
    assert _columnar_used(ds, collate) is columnar
    want = list(torch.utils.data.DataLoader(ds, batch_size=B, collate_fn=collate_fn))
    assert want
    for w in workers:
        col = list(kuat.DataLoader(ds, batch_size=B, num_workers=w, collate_fn=collate_fn, **kw))
        row = list(kuat.DataLoader(ds, batch_size=B, num_workers=w,
                                   collate_fn=lambda r: collate(r), **kw))
        assert same(col, row), f"columnar != rows with {w} workers"
        assert same(col, want), f"kuat != torch with {w} workers"


def test_plain_stream(files):
    _check(_load(files).select_columns(PLAIN))


def test_plain_stream_through_remove_columns(files):
    _check(_load(files).remove_columns(["input_ids"]), workers=(0,))


@pytest.mark.parametrize("buffer_size", [1, 37, 1000])
def test_shuffled_stream_same_order(small, buffer_size):
    """The shuffle buffer is fed the rows cut where the row-by-row buffer reshuffles: the
    same permutations, the same order (also past the first epoch: set_epoch reseeds)."""
    ds = _load(small).select_columns(PLAIN).shuffle(seed=3, buffer_size=buffer_size)
    _check(ds, workers=(0,))
    for epoch in (1,):
        ds.set_epoch(epoch)
        want = list(torch.utils.data.DataLoader(ds, batch_size=B))
        src = HFIterableSource(ds)
        src.set_epoch(epoch)
        src.kuat_set_batching(B, False)
        got = [b for _n, b in src.kuat_iter_collated(kuat.default_collate, B, False)]
        assert same(got, want)


@pytest.mark.parametrize("kw", [
    {"probabilities": [0.3, 0.7], "seed": 5},
    {"stopping_strategy": "all_exhausted"},
    {"probabilities": [0.5, 0.5], "seed": 1, "stopping_strategy": "all_exhausted_without_replacement"},
])
def test_interleaved_streams(files, small, kw):
    a = _load(files[:2]).select_columns(PLAIN)
    b = _load(small).select_columns(PLAIN).shuffle(seed=2, buffer_size=17).take(30)
    _check(datasets.interleave_datasets([a, b], **kw))


def test_batched_map_runs_on_blocks(files, small):
    def fn(batch, idx):
        return {"double": [2 * v for v in batch["label"]], "pos": idx,
                "ids": [r[:3] for r in batch["input_ids"]]}

    ds = _load(files).map(fn, batched=True, batch_size=50, with_indices=True,
                          remove_columns=["input_ids", "text"])
    _check(ds, collate_fn=kuat.pad_collate())  # "ids" is ragged: padded
    small_ds = _load(small).map(fn, batched=True, batch_size=50, with_indices=True,
                                remove_columns=["input_ids", "text"])
    _check(small_ds.shuffle(seed=0, buffer_size=23), workers=(0,), collate_fn=kuat.pad_collate())


def test_map_that_needs_rows_keeps_the_row_path(files):
    ds = _load(files).select_columns(PLAIN).map(lambda r: {"label": r["label"] + 1})
    assert not _columnar_used(ds)
    _check(ds, workers=(0,), columnar=False)


def test_ragged_lists_raise_torchs_error(files):
    ds = _load(files).select_columns(["input_ids", "label"])
    with pytest.raises(RuntimeError, match="each element in list of batch should be of equal"):
        list(torch.utils.data.DataLoader(ds, batch_size=B))
    with pytest.raises(RuntimeError, match="each element in list of batch should be of equal"):
        list(kuat.DataLoader(ds, batch_size=B))


@pytest.mark.parametrize("opts", [{}, {"max_length": 4, "padding_side": "left"},
                                  {"return_attention_mask": True, "pad_to_multiple_of": 8,
                                   "pad_value": {"input_ids": -1}}])
def test_pad_collate_columnar_equals_rows(files, opts):
    ds = _load(files)
    pc = kuat.pad_collate(**opts)
    assert _columnar_used(ds, pc)
    col = list(kuat.DataLoader(ds, batch_size=B, collate_fn=pc))
    row = list(kuat.DataLoader(ds, batch_size=B, collate_fn=lambda r: pc(r)))
    assert same(col, row)
    assert same(col, list(torch.utils.data.DataLoader(ds, batch_size=B, collate_fn=pc)))


@pytest.mark.parametrize("world_size", [2, 3])  # 4 shards: split by shard (2), by step (3)
def test_split_dataset_by_node(files, world_size):
    from datasets.distributed import split_dataset_by_node

    for rank in range(world_size):
        _check(split_dataset_by_node(_load(files).select_columns(PLAIN), rank, world_size))


@pytest.mark.parametrize("drop_last", [False, True])
def test_loader_rank_split_equals_rows(small, drop_last):
    ds = _load(small).select_columns(PLAIN).shuffle(seed=1, buffer_size=19)
    for rank in range(3):
        kw = dict(batch_size=B, rank=rank, world_size=3, drop_last=drop_last, num_workers=2)
        col = list(kuat.DataLoader(ds, **kw))
        row = list(kuat.DataLoader(ds, collate_fn=rows_collate, **kw))
        assert col and same(col, row)


def test_resume_mid_epoch(small):
    ds = _load(small).select_columns(PLAIN).shuffle(seed=4, buffer_size=29)
    full = list(kuat.DataLoader(ds, batch_size=B, num_workers=2))
    for k in (1, 4, len(full) - 1):
        dl = kuat.DataLoader(ds, batch_size=B, num_workers=2)
        it = iter(dl)
        for _ in range(k):
            next(it)
        state = dl.state_dict()
        del it
        resumed = kuat.DataLoader(ds, batch_size=B, num_workers=0)
        resumed.load_state_dict(state)
        assert same(list(resumed), full[k:])


def test_split_by_shards_matches_torch_workers(files):
    """split="shards": each worker reads the shards datasets gives it in a torch worker."""
    ds = _load(files).select_columns(PLAIN)
    src = HFIterableSource(ds, split="shards")
    got = list(kuat.DataLoader(src, batch_size=B, num_workers=2))
    want = list(torch.utils.data.DataLoader(ds, batch_size=B, num_workers=2, timeout=60))
    assert same(got, want)


def test_map_style_dataset_fetch_collated(files):
    table = pa.concat_tables([pq.read_table(f) for f in files]).select(PLAIN)
    ds = datasets.Dataset(table)
    src = HFMapSource(ds)
    idx = np.random.default_rng(0).permutation(len(ds))[:70].tolist()
    assert same(src.kuat_fetch_collated(idx), kuat.default_collate(src.__getitems__(idx)))
    got = list(kuat.DataLoader(ds, batch_size=B, num_workers=2))
    assert same(got, list(torch.utils.data.DataLoader(ds, batch_size=B)))
    shuffled = ds.shuffle(seed=0).select(range(0, 500, 3))  # an indices mapping
    assert same(list(kuat.DataLoader(shuffled, batch_size=B)),
                list(torch.utils.data.DataLoader(shuffled, batch_size=B)))


def _chunks(n: int, rng):
    t = pa.table({"i": np.arange(n)})
    out, start = [], 0
    while start < n:
        k = int(rng.integers(1, 9))
        out.append(t.slice(start, k))
        start += k
    return out


@pytest.mark.parametrize("n", [0, 1, 5, 23, 24])
def test_position_share_and_batches_equal_row_rules(n):
    rng = np.random.default_rng(n)
    for world in (1, 2, 3, 5):
        for drop_last in (False, True):
            for rank in range(world):
                blocks = _hf_arrow.position_share(iter(_chunks(n, rng)), rank, world, drop_last)
                got = [v for b in blocks for v in b.column("i").to_pylist()]
                assert got == list(rank_share(iter(range(n)), rank, world, drop_last))
    for workers in (1, 2, 3):
        for w in range(workers):
            batches = list(_hf_arrow.batches_of(iter(_chunks(n, rng)), 4, False, w, workers))
            got = [v for b in batches for v in b.column("i").to_pylist()]
            assert got == list(worker_share(iter(range(n)), w, workers, 4))
            assert all(len(b) == 4 for b in batches[:-1])


def test_process_workers_read_columnar(files):
    """Process workers get the source pickled and build the same batches."""
    ds = _load(files[:2])
    pc = kuat.pad_collate()
    got = list(kuat.DataLoader(ds, batch_size=B, num_workers=2, worker_type="process",
                               collate_fn=pc, timeout=60))
    assert same(got, list(kuat.DataLoader(ds, batch_size=B, collate_fn=lambda r: pc(r))))
