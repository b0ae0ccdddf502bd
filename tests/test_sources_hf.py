"""HFMapSource: one gather per batch, same samples as torch's DataLoader over the dataset."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

datasets = pytest.importorskip("datasets")

from kuat.sources import as_source  # noqa: E402
from kuat.sources.hf import HFMapSource  # noqa: E402


def _identity(batch):
    return batch


def _same(a, b, where="sample"):
    """Exact equality: same type, dtype, shape and values, recursively."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), where
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a == b, where
    elif isinstance(a, pa.Table):
        assert a.equals(b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _make(n=40, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 9, n)
    return {
        "ids": [rng.integers(-50, 50, k).astype(np.int32).tolist() for k in lens],
        "emb": [rng.random(k).astype(np.float32).tolist() for k in lens],
        "label": rng.integers(0, 5, n).tolist(),
        "score": rng.random(n).tolist(),
        "name": [f"row{i}" for i in range(n)],
    }


def _features():
    f = datasets.Features
    return f(
        {
            "ids": datasets.List(datasets.Value("int32")),
            "emb": datasets.List(datasets.Value("float32")),
            "label": datasets.ClassLabel(num_classes=5),
            "score": datasets.Value("float64"),
            "name": datasets.Value("string"),
        }
    )


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    """A memory-mapped dataset of 40 rows in 6-row record batches (many Arrow chunks)."""
    d = tmp_path_factory.mktemp("hf")
    ds = datasets.Dataset.from_dict(_make(), features=_features())
    return ds.map(
        lambda b: b, batched=True, writer_batch_size=6, cache_file_name=str(d / "c.arrow")
    )


def _torch_samples(ds, order, batch_size=5):
    loader = torch.utils.data.DataLoader(
        ds, batch_size=batch_size, sampler=order, collate_fn=_identity
    )
    return [s for batch in loader for s in batch]


def _kuat_samples(ds, order, batch_size=5):
    src = as_source(ds)
    return [
        s
        for i in range(0, len(order), batch_size)
        for s in src.__getitems__(order[i : i + batch_size])
    ]


@pytest.mark.parametrize("fmt", [None, "numpy", "torch"])
@pytest.mark.parametrize("view", ["plain", "shuffle", "select", "range", "filter"])
def test_same_samples_as_torch_loader(chunked, fmt, view):
    ds = chunked.with_format(fmt)
    if view == "shuffle":
        ds = ds.shuffle(seed=7)
    elif view == "select":
        ds = ds.select([39, 3, 3, 17, 0, 25, 8, 30, 12, 6, 1])
    elif view == "range":  # contiguous: datasets slices the Arrow chunks instead of mapping
        ds = ds.select(range(5, 31))
        assert ds._indices is None
    elif view == "filter":
        ds = ds.filter(lambda r: r["label"] != 2)
    order = np.random.default_rng(1).permutation(len(ds)).tolist()
    src = as_source(ds)
    assert isinstance(src, HFMapSource) and len(src) == len(ds)
    # The numeric columns take the Arrow fast path; strings go through datasets' formatter.
    assert {c.name for c in src._fast} == {"ids", "emb", "label", "score"}
    ref = _torch_samples(ds, order)
    got = _kuat_samples(ds, order)
    assert len(got) == len(ref) == len(ds)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        _same(a, b, f"sample {i}")


def test_format_columns_and_output_all_columns(chunked):
    for kwargs in ({"columns": ["ids", "label"]}, {"columns": ["emb"], "output_all_columns": True}):
        ds = chunked.with_format("torch", **kwargs)
        order = [5, 0, 39, 12]
        for a, b in zip(_kuat_samples(ds, order), _torch_samples(ds, order), strict=True):
            _same(a, b)


def test_format_kwargs_go_through_datasets(chunked):
    ds = chunked.with_format("torch", dtype=torch.float64)
    got = as_source(ds).__getitems__([1, 2])
    ref = ds.__getitems__([1, 2])
    for a, b in zip(got, ref, strict=True):
        _same(a, b)
    assert got[0]["ids"].dtype == torch.float64


def test_lazy_transform_runs_once_per_batch(chunked):
    calls = []

    def transform(batch):
        calls.append(len(batch["ids"]))
        return {"double": [[2 * v for v in r] for r in batch["ids"]], "name": batch["name"]}

    ds = chunked.with_transform(transform)
    order = list(range(39, -1, -1))
    ref = _torch_samples(ds, order, batch_size=8)
    calls.clear()
    got = _kuat_samples(ds, order, batch_size=8)
    assert calls == [8] * 5  # one call per batch, never per row
    for a, b in zip(got, ref, strict=True):
        _same(a, b)
    assert got[0] == {"double": [2 * v for v in chunked[39]["ids"]], "name": "row39"}


def test_arrow_format_works_where_datasets_getitems_fails(chunked):
    ds = chunked.with_format("arrow")
    # datasets 5.2: its own __getitems__ cannot split an Arrow batch into samples.
    with pytest.raises(TypeError):
        list(torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=_identity))
    src = as_source(ds)
    got = [
        s for b in torch.utils.data.DataLoader(src, batch_size=4, collate_fn=_identity) for s in b
    ]
    assert len(got) == 40
    for i, s in enumerate(got):
        assert isinstance(s, pa.Table) and s.num_rows == 1
        assert s.equals(ds[i]), i


def test_pandas_format_rows_match_indexing(chunked):
    """``src[i]`` is ``ds[i]`` (a one-row frame); ``__getitems__`` is datasets' own (a dict
    per row, what torch's DataLoader fetches with a batch size)."""
    ds = chunked.with_format("pandas")
    src = as_source(ds)
    for i in (4, 9):
        assert src[i].equals(ds[i])
    got, want = src.__getitems__([4, 9]), ds.__getitems__([4, 9])
    assert [list(r) for r in got] == [list(r) for r in want]
    for r, w in zip(got, want, strict=True):
        assert all(type(r[k]) is type(w[k]) and np.array_equal(r[k], w[k]) for k in w)


def test_nulls_and_nested_lists_fall_back_to_datasets():
    ds = datasets.Dataset.from_dict(
        {"ids": [[1, 2], None, [3]], "nested": [[[1], [2, 3]], [], [[4]]], "v": [1.0, None, 3.0]}
    ).with_format("torch")
    src = as_source(ds)
    assert src._fast == []
    for a, b in zip(src.__getitems__([0, 1, 2]), ds.__getitems__([0, 1, 2]), strict=True):
        assert a.keys() == b.keys()
        assert repr(a) == repr(b)


def test_single_index_negative_and_out_of_range(chunked):
    src = as_source(chunked.with_format("numpy"))
    _same(src[-1], src.__getitems__([39])[0])
    assert src.__getitems__([]) == []
    with pytest.raises(IndexError, match="index 40 is out of range"):
        src.__getitems__([0, 40])
    with pytest.raises(IndexError, match="-41"):
        src[-41]


def test_views_of_one_batch_buffer(chunked):
    """List columns come back as consecutive views of one buffer (what pad_collate uses)."""
    got = as_source(chunked.with_format("torch")).__getitems__([3, 1, 2])
    base = got[0]["ids"]._base
    assert base is not None and all(s["ids"]._base is base for s in got)
    assert base.dtype == torch.int64


def test_pickle_round_trip_rebuilds_the_plan(chunked):
    import pickle

    src = as_source(chunked.with_format("torch").shuffle(seed=2))
    clone = pickle.loads(pickle.dumps(src))
    for a, b in zip(clone.__getitems__([0, 5, 7]), src.__getitems__([0, 5, 7]), strict=True):
        _same(a, b)


def test_non_hf_datasets_pass_through():
    data = list(range(5))
    assert as_source(data) is data
    with pytest.raises(TypeError, match="datasets.Dataset"):
        HFMapSource(data)


def test_concatenated_in_memory_chunks(chunked):
    """Chunks in separate allocations take the per-chunk gather; same samples."""
    parts = [
        datasets.Dataset.from_dict(_make(n, seed), features=_features())
        for n, seed in ((5, 1), (9, 2), (4, 3))
    ]
    ds = datasets.concatenate_datasets(parts).with_format("torch")
    src = as_source(ds)
    ids = next(c for c in src._fast if c.name == "ids").gather
    assert len(ids.offsets) == 3 and ids.offsets_region is None
    mm = next(c for c in as_source(chunked)._fast if c.name == "ids").gather
    assert len(mm.offsets) == 7 and mm.offsets_region is not None  # one memory-mapped file
    order = [17, 0, 5, 4, 13, 9, 2, 16]
    for a, b in zip(_kuat_samples(ds, order), _torch_samples(ds, order), strict=True):
        _same(a, b)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_kuat_loader_same_samples_as_torch_loader(chunked, num_workers):
    import kuat

    ds = chunked.with_format("torch").shuffle(seed=5)
    order = np.random.default_rng(4).permutation(len(ds)).tolist()
    loader = kuat.DataLoader(
        ds, batch_size=6, sampler=order, collate_fn=_identity, num_workers=num_workers
    )
    got = [s for batch in loader for s in batch]
    for i, (a, b) in enumerate(zip(got, _torch_samples(ds, order, 6), strict=True)):
        _same(a, b, f"sample {i}")


def test_kuat_loader_reads_arrow_format_with_pad_collate(chunked):
    import kuat

    ds = chunked.with_format("arrow")
    loader = kuat.DataLoader(ds, batch_size=8, collate_fn=kuat.pad_collate(), num_workers=2)
    batches = list(loader)
    assert len(batches) == 5
    first = batches[0]
    assert first["ids"].dtype == torch.int32 and first["ids"].shape[0] == 8
    assert first["ids_lengths"].tolist() == [len(chunked[i]["ids"]) for i in range(8)]
    assert first["label"].tolist() == [chunked[i]["label"] for i in range(8)]
    assert first["name"] == [f"row{i}" for i in range(8)]


def test_image_feature_decoded_by_datasets():
    from PIL import Image

    images = [Image.new("RGB", (4 + i, 3), (10 * i, 20, 30)) for i in range(5)]
    ds = datasets.Dataset.from_dict(
        {"image": images, "label": list(range(5))},
        features=datasets.Features(
            {"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=5)}
        ),
    ).with_format("torch")
    src = as_source(ds)
    assert [c.name for c in src._fast] == ["label"] and src._slow == ["image"]
    for a, b in zip(src.__getitems__([4, 1]), ds.__getitems__([4, 1]), strict=True):
        _same(a, b)
    assert src[4]["image"].shape == (3, 3, 8)
