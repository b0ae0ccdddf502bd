"""The columnar path of a streamed HF dataset with a lazy batched ``map`` written for Arrow
(``ds.with_format("arrow").map(fn, batched=True)``, kuat.sources._hf_map.table_mapped_blocks):
the function gets exactly the tables ``datasets`` gives it (same rows per call, same columns,
``input_columns``/``with_indices``/``fn_kwargs``/``remove_columns``/``drop_last_batch``) and
its output tables become the batches without Python rows. Checked against ``datasets``' own
iteration (torch's DataLoader over the stream, the same collate) and kuat's row path, on maps
that keep, drop and duplicate rows (each output depending on its whole batch), on shuffled and
interleaved streams, ``split_dataset_by_node``, kuat's own rank split, 0 / 2 thread / 2 process
workers, resumed mid-epoch; a numpy-formatted map and a torch-formatted result keep the row
path."""

from __future__ import annotations

import pytest
import torch

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pc = pytest.importorskip("pyarrow.compute")
pytest.importorskip("pyarrow.parquet")

from _hf_streams import B, batches, load, loader, no_shutdown_sleep, write_parts  # noqa: E402,F401
from _same import assert_same  # noqa: E402

import kuat  # noqa: E402
from kuat.sources import _hf_map  # noqa: E402
from kuat.sources.hf import HFIterableSource  # noqa: E402
from kuat.sources.stream import rank_share  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_parts(tmp_path_factory.mktemp("hfamap"), seed=4, sizes=[37 + 8 * f for f in range(3)],
                       max_ids=7, vocab=999, row_group_size=13)


# Functions written for Arrow whose every output depends on the whole batch (its sum, its
# first row): a batch cut elsewhere than datasets cuts it would change values.
def a_keep(t):
    """Ids cut to 2, the batch's sum of n on every row."""
    ids = pc.list_slice(t["ids"], 0, 2)
    total = pc.sum(t["n"]).as_py()
    t = t.set_column(t.column_names.index("ids"), "ids", ids)
    return t.append_column("total", pa.array([total] * len(t), pa.int64()))


def a_drop(t):
    """Rows whose n is not a multiple of 3, with the batch's first n: fewer rows."""
    first = t["n"][0].as_py()
    kept = t.filter(pa.array(t["n"].to_numpy() % 3 != 0))
    return kept.append_column("first", pa.array([first] * len(kept), pa.int64()))


def a_dup(t):
    """Each row twice, the copy numbered and the batch's size added: more rows."""
    idx = [i for i in range(len(t)) for _ in (0, 1)]
    out = t.take(pa.array(idx, pa.int64()))
    out = out.append_column("copy", pa.array([c for _ in range(len(t)) for c in (0, 1)]))
    return out.append_column("size", pa.array([len(t)] * len(out), pa.int64()))


def a_indexed(n, ids, idx, scale):
    """input_columns (ChunkedArrays) + with_indices + fn_kwargs; a new table."""
    assert isinstance(n, pa.ChunkedArray) and isinstance(idx, list)
    key = pc.add(pc.multiply(n, scale), pc.list_value_length(ids).cast(pa.int64()))
    return pa.table({"pos": pa.array(idx, pa.int64()), "key": key})


def p_keep(df):
    """The same for the pandas format: a DataFrame in, one out."""
    df = df.copy()
    df["total"] = int(df["n"].sum())
    df["ids"] = [list(r[:2]) for r in df["ids"]]
    return df


def py_keep(batch):  # a list map above the Arrow one
    return {"m": [v * 2 + batch["n"][0] for v in batch["n"]]}


def _arrow(ds):
    return ds.with_format("arrow")


def _stream(name, files):
    from datasets.distributed import split_dataset_by_node

    ds = load(files)
    if name == "keep":
        return _arrow(ds).map(a_keep, batched=True, batch_size=16).with_format(None)
    if name == "drop":
        return _arrow(ds).map(a_drop, batched=True, batch_size=10,
                              remove_columns=["ids"]).with_format(None)
    if name == "dup":
        return _arrow(ds).map(a_dup, batched=True, batch_size=7).with_format(None)
    if name == "indices":
        return _arrow(ds).map(a_indexed, batched=True, batch_size=9, with_indices=True,
                              input_columns=["n", "ids"], fn_kwargs={"scale": 3}).with_format(None)
    if name == "drop-last-batch":  # 37 + 45 + 53 = 135 rows: the last 15 dropped
        return _arrow(ds).map(a_keep, batched=True, batch_size=20,
                              drop_last_batch=True).with_format(None)
    if name == "whole-stream-batch":
        return _arrow(ds).map(a_keep, batched=True, batch_size=None).with_format(None)
    if name == "shuffled":  # the map reads datasets' own Arrow shuffle (chunk order)
        return _arrow(ds.shuffle(seed=3, buffer_size=23)).map(
            a_drop, batched=True, batch_size=11).with_format(None)
    if name == "shuffled-after":  # a buffer shuffle of the map's output
        return _arrow(ds).map(a_dup, batched=True, batch_size=6).with_format(None).shuffle(
            seed=2, buffer_size=17)
    if name == "interleaved":
        other = load(files[:1])
        both = datasets.interleave_datasets([ds, other], probabilities=[0.6, 0.4], seed=5)
        return _arrow(both).map(a_dup, batched=True, batch_size=12).with_format(None)
    if name == "split-by-node":  # by position (3 shards over 2 nodes), above the map
        return split_dataset_by_node(
            _arrow(ds).map(a_drop, batched=True, batch_size=10).with_format(None), rank=1,
            world_size=2)
    if name == "node-split-then-map":  # the node's rows numbered from 0 by with_indices
        return _arrow(split_dataset_by_node(ds, rank=1, world_size=2)).map(
            a_indexed, batched=True, batch_size=9, with_indices=True,
            input_columns=["n", "ids"], fn_kwargs={"scale": 5}).with_format(None)
    if name == "list-map-above":
        return _arrow(ds).map(a_keep, batched=True, batch_size=8).with_format(None).map(
            py_keep, batched=True, batch_size=5)
    if name == "pandas":
        return ds.with_format("pandas").map(p_keep, batched=True, batch_size=16).with_format(None)
    raise AssertionError(name)


STREAMS = ["keep", "drop", "dup", "indices", "drop-last-batch", "whole-stream-batch",
           "shuffled", "shuffled-after", "interleaved", "split-by-node", "node-split-then-map",
           "list-map-above", "pandas"]
OWN = {"shuffled-after"}  # a shuffle above the map: datasets' own Arrow iteration of it all


def _columnar(ds, workers=0, wtype=None, **kw):
    return kuat.DataLoader(ds, batch_size=B, num_workers=workers, worker_type=wtype,
                           collate_fn=kuat.pad_collate(), timeout=60 if wtype == "process" else 0,
                           **kw)


def _padded(rows_batches):
    collate = kuat.pad_collate()
    return [collate(b) for b in rows_batches]


@pytest.fixture
def no_datasets_arrow_map(monkeypatch):
    """datasets' own MappedExamplesIterable._iter_arrow made to fail: the function runs in
    kuat's table_mapped_blocks (thread workers and 0 workers share this process)."""
    def refuse(*a, **k):
        raise AssertionError("datasets' own Arrow map ran")

    def patch():
        monkeypatch.setattr(datasets.iterable_dataset.MappedExamplesIterable, "_iter_arrow",
                            refuse)
    return patch


@pytest.mark.parametrize("name", STREAMS)
def test_same_batches_as_datasets_and_the_row_path(files, name, no_datasets_arrow_map):
    ds = _stream(name, files)
    rows = list(ds)  # datasets' own iteration, main process
    assert rows
    want = list(torch.utils.data.DataLoader(ds, batch_size=B, collate_fn=kuat.pad_collate()))
    assert_same(_padded(batches(rows)), want)
    src = HFIterableSource(ds)
    src.kuat_set_batching(B, False)
    assert src.kuat_iter_collated(kuat.pad_collate(), B, False) is not None  # columnar
    assert list(loader(ds, 2, "thread")) == batches(rows)  # kuat's row path
    if name not in OWN:
        no_datasets_arrow_map()
    assert_same(list(_columnar(ds)), want)
    assert_same(list(_columnar(ds, 2, "thread")), want)
    if name in ("split-by-node", "node-split-then-map"):
        return  # kuat refuses to split by rank a dataset split by node
    for rank in (0, 2):  # kuat's own rank split: DistributedSampler's rule on the stream
        for drop_last in (False, True):
            share = list(rank_share(iter(rows), rank, 3, drop_last))
            got = list(_columnar(ds, 2, "thread", rank=rank, world_size=3, drop_last=drop_last))
            assert_same(got, _padded(batches(share, drop_last)))


@pytest.mark.parametrize("name", ["shuffled", "interleaved", "indices", "drop-last-batch"])
def test_function_gets_the_tables_datasets_gives(files, name, monkeypatch):
    """Each call's table (rows, columns, types) and arguments are the ones datasets passes,
    in the same order, on epochs 0 and 1 (set_epoch reshuffles)."""
    calls = []

    def recording(fn):
        def wrapped(*args, **kwargs):
            calls.append([a.to_pydict() if isinstance(a, pa.Table) else
                          (a.type, a.to_pylist()) if isinstance(a, pa.ChunkedArray) else a
                          for a in args] + [kwargs,
                         [(a.schema if isinstance(a, pa.Table) else a.type) for a in args
                          if isinstance(a, (pa.Table, pa.ChunkedArray))]])
            return fn(*args, **kwargs)
        return wrapped

    real = {f.__name__: f for f in (a_keep, a_drop, a_dup, a_indexed)}
    for k, f in real.items():
        monkeypatch.setitem(globals(), k, recording(f))
    ds = _stream(name, files)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        calls.clear()
        list(ds)
        want = list(calls)
        calls.clear()
        dl = _columnar(ds)
        dl.set_epoch(epoch)
        list(dl)
        assert calls == want, epoch


@pytest.mark.parametrize("name", ["dup", "shuffled", "interleaved"])
def test_process_workers(files, name):
    ds = _stream(name, files)
    want = list(torch.utils.data.DataLoader(ds, batch_size=B, collate_fn=kuat.pad_collate()))
    assert_same(list(_columnar(ds, 2, "process")), want)


def test_resume_mid_epoch(files):
    ds = _stream("shuffled", files)
    full = list(_columnar(ds, 2, "thread"))
    for k in (1, 4, len(full) - 1):
        dl = _columnar(ds, 2, "thread")
        it = iter(dl)
        for _ in range(k):
            next(it)
        state = dl.state_dict()
        del it
        for workers, wtype in ((0, None), (2, "thread")):
            resumed = _columnar(ds, workers, wtype)
            resumed.load_state_dict(state)
            assert_same(list(resumed), full[k:])


def test_formats_that_are_not_tables_keep_the_row_path(files):
    """A numpy-formatted map (its function gets arrays) and an Arrow map read in the torch
    format: no table map; the batches are still datasets'."""
    def np_keep(batch):
        return {"n": batch["n"] * 2}

    for ds in (load(files).with_format("numpy").map(np_keep, batched=True, batch_size=8)
               .with_format(None).select_columns(["n", "text"]),
               _arrow(load(files)).map(a_keep, batched=True, batch_size=8)
               .with_format("torch").select_columns(["n", "total"])):
        for collate in (None, kuat.pad_collate()):
            src = HFIterableSource(ds)
            src.kuat_set_batching(B, False)
            assert src.kuat_iter_collated(collate or kuat.default_collate, B, False) is None
            want = list(torch.utils.data.DataLoader(ds, batch_size=B, collate_fn=collate))
            for workers in (0, 2):
                got = kuat.DataLoader(ds, batch_size=B, num_workers=workers, collate_fn=collate)
                assert_same(list(got), want)
    ex = load(files).with_format("numpy").map(np_keep, batched=True)._ex_iterable
    assert _hf_map.mapped_blocks(ex, lambda: iter(())) is None


def test_errors_of_the_function(files):
    """What the function raises reaches the user as datasets raises it, with the rows of
    the map's input it was called on; a result that is not a table: datasets' TypeError."""
    def bad(t):
        if 20 in t["n"].to_pylist():
            raise KeyError("boom")
        return t

    ds = _arrow(load(files)).map(bad, batched=True, batch_size=8).with_format(None)
    with pytest.raises(KeyError):
        list(ds)
    for workers in (0, 2):
        with pytest.raises(KeyError) as got:
            list(_columnar(ds, workers))
        assert any("rows 16..23 of the map's input" in n for n in got.value.__notes__)
    listed = load(files).map(lambda b: {"m": [1 / (v - 20) for v in b["n"]]}, batched=True,
                             batch_size=8)  # the list map's function: the same note
    with pytest.raises(ZeroDivisionError) as got:
        list(_columnar(listed))
    assert any("rows 16..23 of the map's input" in n for n in got.value.__notes__)

    ds = _arrow(load(files)).map(lambda t: t.to_pydict(), batched=True).with_format(None)
    with pytest.raises(TypeError) as want:
        list(ds)
    with pytest.raises(TypeError) as got:
        list(_columnar(ds))
    assert str(want.value) == str(got.value)


def test_split_by_shards_matches_torch_workers(files, no_datasets_arrow_map):
    """split="shards": each worker maps the shards datasets gives it in a torch worker."""
    ds = _stream("dup", files)
    want = list(torch.utils.data.DataLoader(ds, batch_size=B, num_workers=2, timeout=60,
                                            collate_fn=kuat.pad_collate()))
    no_datasets_arrow_map()
    src = HFIterableSource(ds, split="shards")
    assert_same(list(kuat.DataLoader(src, batch_size=B, num_workers=2, worker_type="thread",
                                     collate_fn=kuat.pad_collate())), want)


def test_resumed_by_datasets_load_state_dict(files):
    """datasets' own resume (``IterableDataset.load_state_dict``) of a stream with an Arrow
    map: that epoch starts where it was saved, as in torch's DataLoader."""
    src = _stream("keep", files)
    it = iter(src)
    for _ in range(21):
        next(it)
    state = src.state_dict()
    ref, ds = _stream("keep", files), _stream("keep", files)
    ref.load_state_dict(state)
    ds.load_state_dict(state)
    want = list(torch.utils.data.DataLoader(ref, batch_size=B, collate_fn=kuat.pad_collate()))
    assert len(want) < len(list(_columnar(_stream("keep", files))))
    for workers in (0, 2):
        assert_same(list(_columnar(ds, workers, "thread" if workers else None)), want)
        ds.set_epoch(0)


def test_tables_of_different_types_in_one_batch(tmp_path):
    """CSV files typed one by one (x: double, then int64) met in one batch of an Arrow map:
    datasets cannot join them (ArrowInvalid); neither does kuat, with the same type."""
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("id,x\n" + "".join(f"{i},{i / 4}\n" for i in range(12)))
    b.write_text("id,x\n" + "".join(f"{100 + i},{i}\n" for i in range(8)))
    ds = datasets.load_dataset("csv", data_files=[str(a), str(b)], split="train", streaming=True)
    ds = _arrow(ds).map(lambda t: t, batched=True, batch_size=5).with_format(None)
    with pytest.raises(pa.ArrowInvalid):
        list(ds)
    with pytest.raises(pa.ArrowInvalid):
        list(_columnar(ds))
