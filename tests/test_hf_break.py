"""Inputs that broke kuat.DataLoader on Hugging Face datasets (issue #30's breaker): each test
computes the reference with torch's DataLoader (or ``datasets``) itself."""

from __future__ import annotations

import pytest
import torch

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from _same import assert_same  # noqa: E402

import kuat  # noqa: E402


@pytest.fixture(autouse=True)
def _no_shutdown_sleep(monkeypatch):
    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


def _rows(batch):
    return batch


# --- a datasets.Dataset in a table format: torch's DataLoader reads __getitems__ -----------

@pytest.mark.parametrize("fmt", ["pandas", "numpy", "torch", None])
@pytest.mark.parametrize("workers", [0, 2])
def test_map_dataset_formats_give_torchs_samples(fmt, workers):
    """With a batch size, torch's DataLoader fetches ``dataset.__getitems__(indices)``: for
    ``datasets.Dataset`` that is one dict per row (``{column: batch[column][i]}``) in every
    format, pandas included; without one, ``dataset[i]`` (a one-row DataFrame)."""
    pytest.importorskip("pandas")
    ds = datasets.Dataset.from_dict({"id": list(range(10)), "s": list("abcdefghij"),
                                     "x": [i / 4 for i in range(10)]}).with_format(fmt)
    for kw in ({"batch_size": 4}, {"batch_size": 4, "collate_fn": _rows},
               {"batch_size": None, "collate_fn": _rows}):
        want = list(torch.utils.data.DataLoader(ds, **kw))
        got = list(kuat.DataLoader(ds, num_workers=workers, **kw))
        if kw["batch_size"] is None and fmt == "pandas":
            assert [g.equals(w) for g, w in zip(got, want, strict=True)] == [True] * len(want)
            continue
        assert_same([list(b) if kw.get("collate_fn") else b for b in got],
                    [list(b) if kw.get("collate_fn") else b for b in want])


# --- datasets' own set_epoch on a stream --------------------------------------------------

@pytest.fixture(scope="module")
def stream_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("hfbreak")
    paths = []
    for f, n in enumerate((23, 17, 11)):
        p = out / f"part-{f}.parquet"
        pq.write_table(pa.table({"id": list(range(100 * f, 100 * f + n))}), p, row_group_size=5)
        paths.append(str(p))
    return paths


def _shuffled(files):
    ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    return ds.shuffle(seed=3, buffer_size=6)


def _ids(batches):
    return [int(i) for b in batches for i in (b["id"] if isinstance(b, dict) else [r["id"] for r in b])]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("collate_fn", [None, _rows])
def test_stream_follows_the_datasets_set_epoch(stream_files, workers, collate_fn):
    """``dataset.set_epoch(epoch)`` before each epoch (datasets' documented way to reshuffle a
    stream) picks that epoch's shard order and shuffle buffer in torch's DataLoader: kuat's
    epochs follow it too, also when they do not start at 0 (a script restarted at epoch 3
    without kuat's state) or when it is set before the loader is built."""
    ds_t, ds_k = _shuffled(stream_files), _shuffled(stream_files)
    ds_t.set_epoch(2)
    ds_k.set_epoch(2)
    torch_dl = torch.utils.data.DataLoader(ds_t, batch_size=4, collate_fn=collate_fn)
    kuat_dl = kuat.DataLoader(ds_k, batch_size=4, num_workers=workers, collate_fn=collate_fn)
    assert _ids(kuat_dl) == _ids(torch_dl)  # epoch 2, set before the loader was built
    for epoch in (5, 6, 1):
        ds_t.set_epoch(epoch)
        ds_k.set_epoch(epoch)
        want = list(torch_dl)
        assert _ids(want) != _ids(list(torch.utils.data.DataLoader(_shuffled(stream_files),
                                                                   batch_size=4,
                                                                   collate_fn=collate_fn)))
        assert_same(list(kuat_dl), want)


def test_loader_set_epoch_after_the_datasets_wins(stream_files):
    """Both ``set_epoch``s: the later call decides the epoch, as between the loader's and its
    sampler's (and a ``load_state_dict`` of the same epoch keeps its position)."""
    ds = _shuffled(stream_files)
    ref = _shuffled(stream_files)
    dl = kuat.DataLoader(ds, batch_size=4)
    ds.set_epoch(4)
    dl.set_epoch(1)
    ref.set_epoch(1)
    assert _ids(dl) == _ids(torch.utils.data.DataLoader(ref, batch_size=4))
    dl.set_epoch(7)
    ds.set_epoch(3)
    ref.set_epoch(3)
    assert _ids(dl) == _ids(torch.utils.data.DataLoader(ref, batch_size=4))
    # resume mid-epoch 3, then the script's own ds.set_epoch(3): the position is kept
    dl.set_epoch(3)
    it = iter(dl)
    first = [next(it) for _ in range(2)]
    state = dl.state_dict()
    del it
    ds2 = _shuffled(stream_files)
    dl2 = kuat.DataLoader(ds2, batch_size=4)
    dl2.load_state_dict(state)
    ds2.set_epoch(3)
    assert _ids(first) + _ids(dl2) == _ids(torch.utils.data.DataLoader(ref, batch_size=4))


# --- a datasets.Dataset whose format changes in place after the loader is built -----------

def _add_z(batch):
    return {"z": [i * 10 for i in batch["id"]]}


@pytest.mark.parametrize("change", ["set_format", "set_format_columns", "set_transform",
                                    "reset_format"])
@pytest.mark.parametrize("workers", [(0, None), (2, "thread"), (2, "process")])
@pytest.mark.parametrize("collate_fn", [None, _rows])
def test_map_dataset_format_set_in_place_after_the_loader_is_built(change, workers, collate_fn):
    """``Dataset.set_format``/``set_transform``/``reset_format`` change the dataset in place;
    torch's DataLoader reads it live, so the next epoch has the new format: kuat's too."""
    ds = datasets.Dataset.from_dict({"id": list(range(10)), "x": [i / 2 for i in range(10)]})
    if change == "reset_format":
        ds.set_format("numpy")
    w, wt = workers
    torch_dl = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=collate_fn)
    kuat_dl = kuat.DataLoader(ds, batch_size=4, num_workers=w, collate_fn=collate_fn,
                              **({"worker_type": wt} if wt else {}))
    assert_same([list(b) for b in kuat_dl] if collate_fn else list(kuat_dl),
                [list(b) for b in torch_dl] if collate_fn else list(torch_dl))
    if change == "set_format":
        ds.set_format("torch")
    elif change == "set_format_columns":
        ds.set_format("numpy", columns=["x"])
    elif change == "set_transform":
        ds.set_transform(_add_z)
    else:
        ds.reset_format()
    want = list(torch_dl)
    got = list(kuat_dl)
    assert_same([list(b) for b in got] if collate_fn else got,
                [list(b) for b in want] if collate_fn else want)


# --- a stream resumed with datasets' own state_dict / load_state_dict --------------------

@pytest.mark.parametrize("kind", ["plain", "shuffled", "batched_map"])
@pytest.mark.parametrize("workers", [(0, None), (2, "thread")])
@pytest.mark.parametrize("collate_fn", [None, _rows])
@pytest.mark.parametrize("loaded", ["before", "after"])
def test_stream_resumed_by_datasets_load_state_dict(stream_files, kind, workers, collate_fn,
                                                    loaded):
    """``IterableDataset.load_state_dict(state)`` (datasets' own resume, e.g. with torchdata's
    StatefulDataLoader) makes the epoch it was saved in start where it was saved, in torch's
    DataLoader and so in kuat's, columnar path included, whether it is called before or after
    the loader is built; later epochs start at the top."""
    def make():
        ds = datasets.load_dataset("parquet", data_files=stream_files, split="train",
                                   streaming=True)
        if kind == "shuffled":
            ds = ds.shuffle(seed=2, buffer_size=4)
        elif kind == "batched_map":
            ds = ds.map(lambda b: {"y": [i + 1 for i in b["id"]]}, batched=True, batch_size=3)
        return ds

    src = make()
    it = iter(src)
    for _ in range(9):
        next(it)
    state = src.state_dict()
    ref, ds = make(), make()
    if loaded == "before":
        ref.load_state_dict(state)
        ds.load_state_dict(state)
    w, wt = workers
    torch_dl = torch.utils.data.DataLoader(ref, batch_size=4, collate_fn=collate_fn)
    kuat_dl = kuat.DataLoader(ds, batch_size=4, num_workers=w, collate_fn=collate_fn,
                              **({"worker_type": wt} if wt else {}))
    if loaded == "after":
        ref.load_state_dict(state)
        ds.load_state_dict(state)
    for _epoch in range(2):
        want = list(torch_dl)
        ref.set_epoch(ref.epoch + 1)
        assert_same(list(kuat_dl), want)


# --- a stream whose files have different Arrow types (CSV/JSON typed file by file) -------

@pytest.fixture(scope="module")
def csv_files(tmp_path_factory):
    """Two CSV files that pyarrow types differently (x: double then int64, s: string then
    int64): ``datasets`` streams each file's rows with its own types."""
    out = tmp_path_factory.mktemp("hfcsv")
    a, b = out / "a.csv", out / "b.csv"
    a.write_text("id,x,s\n" + "".join(f"{i},{i / 4},s{i}\n" for i in range(12)))
    b.write_text("id,x,s\n" + "".join(f"{100 + i},{i},{7 * i}\n" for i in range(8)))
    return [str(a), str(b)]


@pytest.mark.parametrize("workers", [(0, None), (2, "thread"), (3, "thread")])
@pytest.mark.parametrize("collate_fn", [None, _rows])
@pytest.mark.parametrize("shuffled", [False, True])
def test_stream_of_files_with_different_types(csv_files, workers, collate_fn, shuffled):
    """Blocks of different Arrow types are never concatenated as Arrow (pyarrow refuses, or
    would promote ints to floats): the rows keep each file's Python values, as in torch."""
    ds = datasets.load_dataset("csv", data_files=csv_files, split="train", streaming=True)
    if shuffled:
        ds = ds.shuffle(seed=1, buffer_size=6)
    w, wt = workers
    kuat_dl = kuat.DataLoader(ds, batch_size=4, num_workers=w, collate_fn=collate_fn,
                              **({"worker_type": wt} if wt else {}))
    if collate_fn is None and shuffled:  # a batch mixes str and int: torch's collate error
        with pytest.raises(TypeError) as want:
            list(torch.utils.data.DataLoader(ds, batch_size=4))
        with pytest.raises(TypeError) as got:
            list(kuat_dl)
        assert str(want.value) in str(got.value)  # torch's message, plus where it happened
        return
    want = list(torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=collate_fn))
    assert_same(list(kuat_dl), want)


# --- interleave_datasets of streams with different columns --------------------------------

@pytest.fixture(scope="module")
def two_schemas(tmp_path_factory):
    out = tmp_path_factory.mktemp("hfinter")
    a, b = out / "a.parquet", out / "b.parquet"
    pq.write_table(pa.table({"id": list(range(9)), "s": [str(i) for i in range(9)]}), a,
                   row_group_size=4)
    pq.write_table(pa.table({"extra": [1.5] * 7, "id": list(range(100, 107)),
                             "s": [f"b{i}" for i in range(7)]}), b, row_group_size=3)
    return str(a), str(b)


@pytest.mark.parametrize("kind", ["plain", "probabilities", "mapped_source", "selected"])
@pytest.mark.parametrize("workers", [0, 2, 3])
def test_interleave_of_streams_with_different_columns(two_schemas, kind, workers):
    """``interleave_datasets`` gives every row the union of the sources' columns (``None``
    where a source has none): kuat's Arrow reads too, instead of refusing to join the blocks."""
    a, b = (datasets.load_dataset("parquet", data_files=[f], split="train", streaming=True)
            for f in two_schemas)
    if kind == "mapped_source":
        a = a.map(lambda bt: {"q": [i * 2 for i in bt["id"]]}, batched=True, batch_size=2)
    kw = {"probabilities": [0.4, 0.6], "seed": 3, "stopping_strategy": "all_exhausted"}
    ds = datasets.interleave_datasets([a, b], **(kw if kind == "probabilities" else {}))
    collates = [_rows]
    if kind == "selected":
        ds = ds.select_columns(["id", "s"])
        collates.append(None)  # the columnar path
    for collate_fn in collates:
        want = list(torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=collate_fn))
        got = list(kuat.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=collate_fn))
        assert_same(got, want)
