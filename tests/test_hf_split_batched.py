"""The row path of a streamed HF dataset with a lazy *batched* ``map`` (kuat.sources._hf_split
over _hf_arrow/_hf_map): the stream below the row tail is read as Arrow blocks, the batched
function gets the dict of lists ``datasets`` gives it (input_columns, with_indices,
remove_columns, fn_kwargs, drop_last_batch) on the whole stream in every worker, the worker's
share is taken on its output and only kept rows become Python dicts. Checked: the same samples
in the same order as ``datasets``' own iteration, torch's DataLoader at 0 workers and kuat's
read-all row path, on maps that keep, drop and duplicate rows (each output depending on its
whole batch), on shuffled and interleaved streams, split by rank (``rank=``/``world_size=``
and ``split_dataset_by_node``) and by 0 / 2 thread / 2 process workers, resumed mid-epoch."""

from __future__ import annotations

import threading

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

from kuat.sources import _hf_split  # noqa: E402
from kuat.sources.hf import HFIterableSource  # noqa: E402
from kuat.sources.stream import rank_share  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_parts(tmp_path_factory.mktemp("hfbmap"), seed=1, sizes=[37 + 8 * f for f in range(3)],
                       max_ids=7, vocab=999, row_group_size=13)


# Batched functions whose every output depends on the whole batch (its first row, its sum):
# taking a worker's share before them would change values, not only which rows.
def keep(batch):
    total = sum(batch["n"])
    return {"n": batch["n"], "total": [total] * len(batch["n"]),
            "head": [r[:2] for r in batch["ids"]]}


def drop(batch):
    """Keeps the rows whose n is not a multiple of 3: fewer rows than it got."""
    first = batch["n"][0]
    kept = [i for i, v in enumerate(batch["n"]) if v % 3]
    return {"n": [batch["n"][i] for i in kept], "first": [first] * len(kept),
            "ids": [batch["ids"][i] for i in kept], "text": [batch["text"][i] for i in kept]}


def dup(batch):
    """Each row twice, the copy numbered: more rows than it got."""
    out = {"n": [], "copy": [], "size": [], "ids": [], "text": []}
    for v, ids, text in zip(batch["n"], batch["ids"], batch["text"], strict=True):
        for c in (0, 1):
            out["n"].append(v)
            out["copy"].append(c)
            out["size"].append(len(batch["n"]))
            out["ids"].append(ids[c:])
            out["text"].append(text)
    return out


def indexed(n, ids, idx, scale):
    """input_columns + with_indices + fn_kwargs."""
    return {"pos": idx, "key": [scale * v + len(r) for v, r in zip(n, ids, strict=True)]}


def _stream(name, files):
    from datasets.distributed import split_dataset_by_node

    ds = load(files)
    if name == "keep":
        return ds.map(keep, batched=True, batch_size=16)
    if name == "drop":
        return ds.map(drop, batched=True, batch_size=10, remove_columns=["ids"])
    if name == "dup":
        return ds.map(dup, batched=True, batch_size=7)
    if name == "indices":
        return ds.map(indexed, batched=True, batch_size=9, with_indices=True,
                      input_columns=["n", "ids"], fn_kwargs={"scale": 3},
                      remove_columns=["text"])
    if name == "drop-last-batch":  # 37 + 45 + 53 = 135 rows: the last 15 dropped
        return ds.map(keep, batched=True, batch_size=20, drop_last_batch=True)
    if name == "whole-stream-batch":  # batch_size=None: one call on every row
        return ds.map(keep, batched=True, batch_size=None)
    if name == "shuffled":  # shards and buffer below the map
        return ds.shuffle(seed=3, buffer_size=23).map(drop, batched=True, batch_size=11)
    if name == "shuffled-after":  # a buffer shuffle of the map's output
        return ds.map(dup, batched=True, batch_size=6).shuffle(seed=2, buffer_size=17)
    if name == "interleaved":
        other = load(files[:1]).shuffle(seed=1, buffer_size=9)
        both = datasets.interleave_datasets([ds, other], probabilities=[0.6, 0.4], seed=5)
        return both.map(dup, batched=True, batch_size=12)
    if name == "row-tail":  # a per-row map above: run on kept rows only
        return ds.map(drop, batched=True, batch_size=10).map(
            lambda r: {"k": r["n"] * 2 + r["first"]})
    if name == "split-by-node":  # by position (3 shards over 2 nodes), above the map
        return split_dataset_by_node(ds.map(drop, batched=True, batch_size=10), rank=1,
                                     world_size=2)
    if name == "node-split-then-map":  # the node's rows numbered from 0 by with_indices
        return split_dataset_by_node(ds, rank=1, world_size=2).map(
            indexed, batched=True, batch_size=9, with_indices=True, input_columns=["n", "ids"],
            fn_kwargs={"scale": 5})
    raise AssertionError(name)


STREAMS = ["keep", "drop", "dup", "indices", "drop-last-batch", "whole-stream-batch",
           "shuffled", "shuffled-after", "interleaved", "row-tail", "split-by-node",
           "node-split-then-map"]


def _uses_arrow_prefix(ds, monkeypatch) -> bool:
    """Whether worker 0 of 2 reads the prefix as Arrow blocks (only kept rows made)."""
    src = HFIterableSource(ds)
    src.kuat_set_batching(B, False)
    made = []
    real = _hf_split._arrow_rows
    with monkeypatch.context() as m:
        m.setattr(torch.utils.data, "get_worker_info", lambda: Worker0of2())
        m.setattr(_hf_split, "_arrow_rows", lambda *a: made.append(1) or real(*a))
        owned = _hf_split.owned_examples(src, src._copy(0))
        return owned is not None and bool(made)


@pytest.mark.parametrize("name", STREAMS)
def test_same_samples_as_the_stream_and_torch(files, name, monkeypatch):
    ds = _stream(name, files)
    assert _uses_arrow_prefix(ds, monkeypatch)
    rows = list(ds)  # the stream's own order (datasets, main process)
    assert rows
    want = batches(rows)
    assert list(torch.utils.data.DataLoader(ds, batch_size=B, collate_fn=rows_collate)) == want
    assert list(loader(ds, 0)) == want
    assert list(loader(ds, 2, "thread")) == want
    if name in ("split-by-node", "node-split-then-map"):
        return  # kuat refuses to split by rank a dataset split by node
    for rank in range(3):  # kuat's own rank split: DistributedSampler's rule on the stream
        for drop_last in (False, True):
            share = list(rank_share(iter(rows), rank, 3, drop_last))
            got = list(loader(ds, 2, "thread", rank=rank, world_size=3, drop_last=drop_last))
            assert got == batches(share, drop_last), (rank, drop_last)


@pytest.mark.parametrize("name", ["shuffled", "interleaved", "indices"])
def test_equal_to_the_read_all_path(files, name, monkeypatch):
    ds = _stream(name, files)
    dl = loader(ds, 2, "thread", rank=1, world_size=2)
    got = [list(dl), list(dl)]  # epochs 0 and 1 (set_epoch reshuffles shards and buffer)
    assert got[0] != got[1] or name == "indices"
    with monkeypatch.context() as m:
        m.setattr(_hf_split, "owned_examples", lambda stream, ds: None)
        dl = loader(ds, 2, "thread", rank=1, world_size=2)
        assert got == [list(dl), list(dl)]


@pytest.mark.parametrize("name", ["dup", "shuffled", "split-by-node"])
def test_process_workers(files, name):
    ds = _stream(name, files)
    assert list(loader(ds, 2, "process")) == batches(list(ds))


def test_process_workers_rank_split(files):
    ds = _stream("drop", files)
    rows = list(ds)
    share = list(rank_share(iter(rows), 1, 2, False))
    assert list(loader(ds, 2, "process", rank=1, world_size=2)) == batches(share)


def test_resume_mid_epoch(files):
    ds = _stream("shuffled", files)
    full = list(loader(ds, 2, "thread"))
    for k in (1, 4, len(full) - 1):
        dl = loader(ds, 2, "thread")
        it = iter(dl)
        for _ in range(k):
            next(it)
        state = dl.state_dict()
        del it
        for workers, wtype in ((0, None), (2, "thread"), (3, "thread")):
            resumed = loader(ds, workers, wtype)
            resumed.load_state_dict(state)
            assert list(resumed) == full[k:], (k, workers)


def test_rows_made_for_kept_rows_only(files, monkeypatch):
    """Two thread workers turn each output row into a dict once between them, while each runs
    the batched function on every batch of the stream (its output may depend on the batch)."""
    calls = []
    lock = threading.Lock()

    def counted(batch):
        with lock:
            calls.append(len(batch["n"]))
        return dup(batch)

    made = []
    real = _hf_split._arrow_rows

    def counting(blocks, rows_of):
        for pair in real(blocks, rows_of):
            with lock:
                made.append(1)
            yield pair

    monkeypatch.setattr(_hf_split, "_arrow_rows", counting)
    ds = load(files).map(counted, batched=True, batch_size=10)
    n = sum(1 for _ in load(files))
    got = [r for b in loader(ds, 2, "thread") for r in b]
    assert got == [r for b in batches(list(load(files).map(dup, batched=True, batch_size=10)))
                   for r in b]
    assert len(made) == len(got) == 2 * n  # each output row made once, by the worker keeping it
    assert sum(calls) == 2 * n  # the function saw the whole stream in each of the 2 workers


def test_a_filter_keeps_the_read_all_path(files, monkeypatch):
    """A filter (its mask is a map) below the batched map: rows are not counted before the
    per-row work, the worker reads the whole stream as before, with the same samples."""
    ds = load(files).filter(lambda r: r["n"] % 2 == 0).map(keep, batched=True, batch_size=8)
    assert not _uses_arrow_prefix(ds, monkeypatch)
    assert list(loader(ds, 2, "thread")) == batches(list(ds))
