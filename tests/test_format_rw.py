"""Round trips through kuat.Writer and kuat.open for every field type, indices, transforms."""

from __future__ import annotations

import io
import json
import pickle
import threading

import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image

import kuat
from kuat import format as kf
from kuat.errors import FormatError, SchemaError
from kuat.rng import sample_rng


def _png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


SCHEMA = kuat.Schema(
    {
        "image": kf.image(),
        "label": kf.int64(),
        "u8": kf.uint8(),
        "f16": kf.float16(),
        "f64": kf.float64(),
        "flag": kf.bool_(),
        "text": kf.string(),
        "blob": kf.binary(),
        "emb": kf.tensor((2, 3), "float32"),
        "tokens": kf.sequence("int32"),
    }
)


def _row(i: int) -> dict:
    return {
        "image": _png(4 + i % 5, 3 + i % 4, i),
        "label": i * 1000 - 5,
        "u8": i % 256,
        "f16": i / 4,
        "f64": i * 1.5,
        "flag": i % 3 == 0,
        "text": f"row {i} \u00e9\u4e2d",
        "blob": bytes(range(i % 7)),
        "emb": np.arange(6, dtype=np.float32).reshape(2, 3) + i,
        "tokens": np.arange(i % 6, dtype=np.int32) * i,
    }


def _check(sample: dict, i: int) -> None:
    exp = _row(i)
    np.testing.assert_array_equal(sample["image"], _pixels(exp["image"]))
    assert sample["image"].dtype == np.uint8 and sample["image"].shape[2] == 3
    assert sample["label"] == exp["label"] and type(sample["label"]) is int
    assert sample["u8"] == exp["u8"] and type(sample["u8"]) is int
    assert sample["f16"] == exp["f16"]
    assert sample["f64"] == exp["f64"]
    assert sample["flag"] is exp["flag"]
    assert sample["text"] == exp["text"]
    assert sample["blob"] == exp["blob"] and type(sample["blob"]) is bytes
    np.testing.assert_array_equal(sample["emb"], exp["emb"])
    assert sample["emb"].dtype == np.float32 and sample["emb"].shape == (2, 3)
    np.testing.assert_array_equal(sample["tokens"], exp["tokens"])
    assert sample["tokens"].dtype == np.int32 and sample["tokens"].ndim == 1


N = 40


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rw") / "ds"
    with kuat.Writer(path, SCHEMA, shard_bytes=600, metadata={"source": "test"}) as w:
        for i in range(N // 2):
            w.write(_row(i))
        rows = [_row(i) for i in range(N // 2, N)]
        w.write_batch({name: [r[name] for r in rows] for name in SCHEMA.names})
    return path


def test_round_trip_every_field_type(dataset_dir):
    ds = kuat.open(dataset_dir)
    assert len(ds) == N
    assert ds.num_shards > 3  # shard_bytes=600 rolls shards
    assert ds.metadata == {"source": "test"}
    assert ds.schema == SCHEMA
    for i in range(N):
        _check(ds[i], i)
    for i, sample in zip([7, 0, 39, 21, 7], ds.__getitems__([7, 0, 39, 21, 7])):
        _check(sample, i)


def test_manifest_records_shards(dataset_dir):
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    assert manifest["format"] == "kuat" and manifest["version"] == 1
    assert manifest["num_rows"] == N == sum(s["rows"] for s in manifest["shards"])
    for s in manifest["shards"]:
        assert (dataset_dir / s["file"]).stat().st_size == s["bytes"]
        assert s["checksum"].startswith("xxh3_64:")
    assert not [p for p in dataset_dir.iterdir() if p.name.startswith(".")]


def test_raw_and_read_batch(dataset_dir):
    ds = kuat.open(dataset_dir)
    raw = ds.raw(11)
    exp = _row(11)
    assert raw["image"].data == exp["image"]
    w, h = Image.open(io.BytesIO(exp["image"])).size
    assert (raw["image"].width, raw["image"].height, raw["image"].codec) == (w, h, "png")
    idx = [3, 38, 3, 17, -1]
    b = ds.read_batch(idx)
    rows = [_row(i % N) for i in idx]
    assert b["emb"].shape == (5, 2, 3) and b["emb"].dtype == np.float32
    np.testing.assert_array_equal(b["emb"], np.stack([r["emb"] for r in rows]))
    np.testing.assert_array_equal(b["label"], [r["label"] for r in rows])
    assert b["label"].dtype == np.int64
    assert [bytes(m) for m in b["image"].data] == [r["image"] for r in rows]
    assert isinstance(b["image"].data[0], memoryview)
    assert b["image"].codec == ["png"] * 5
    assert b["text"] == [r["text"] for r in rows]
    assert [bytes(m) for m in b["blob"]] == [r["blob"] for r in rows]
    for got, r in zip(b["tokens"], rows):
        np.testing.assert_array_equal(got, r["tokens"])
    only = ds.read_batch(np.array([5, 6]), fields=["u8"])
    assert list(only) == ["u8"] and only["u8"].tolist() == [5, 6]
    assert ds.read_batch([5], fields="u8")["u8"].tolist() == [5]
    with pytest.raises(ValueError, match="no field 'nope'"):
        ds.read_batch([5], fields=["nope"])


def test_indices_behave_like_a_sequence(dataset_dir):
    ds = kuat.open(dataset_dir)
    assert ds[-1]["label"] == ds[N - 1]["label"]
    assert ds[-N]["label"] == ds[0]["label"]
    for bad in (N, -N - 1, 10**30):
        with pytest.raises(IndexError):
            ds[bad]
    with pytest.raises(IndexError):
        ds.__getitems__([0, N])
    with pytest.raises(IndexError):
        ds.read_batch([-N - 1])
    with pytest.raises(TypeError):
        ds[1.5]
    with pytest.raises(TypeError):
        ds[0:2]
    assert [s["label"] for s in ds.__getitems__(torch.tensor([-1, 0]))] == [
        _row(N - 1)["label"],
        _row(0)["label"],
    ]
    assert ds.__getitems__([]) == []
    for nested in ([[0, 1], [2, 3]], np.zeros((2, 2), np.int64), np.int64(3)):
        with pytest.raises(TypeError, match="1-D"):  # not silently flattened
            ds.read_batch(nested)
    assert sum(1 for _ in ds) == N
    assert ds.locate(-1)[1] >= 0


def test_shards_open_with_hugging_face_datasets(dataset_dir):
    datasets = pytest.importorskip("datasets")
    ds = kuat.open(dataset_dir)
    seen = 0
    for path in ds.shard_paths:
        hf = datasets.Dataset.from_file(path)
        for row in hf:
            exp = _row(seen)
            assert row["label"] == exp["label"]
            assert row["text"] == exp["text"]
            assert row["image"]["bytes"] == exp["image"]
            assert row["tokens"] == exp["tokens"].tolist()
            np.testing.assert_array_equal(row["emb"], exp["emb"].reshape(-1))
            seen += 1
    assert seen == N


def test_lazy_open_of_thousands_of_shards(tmp_path):
    path = tmp_path / "many"
    with kuat.Writer(path, {"x": kf.int32()}) as w:
        w.write_batch({"x": np.arange(3, dtype=np.int32)})
    manifest = json.loads((path / "manifest.json").read_text())
    shard = manifest["shards"][0]
    manifest["shards"] = [shard] * 5000  # every entry names the same valid file
    manifest["num_rows"] = 3 * 5000
    (path / "manifest.json").write_text(json.dumps(manifest))
    ds = kuat.open(path)
    assert len(ds) == 15000
    assert all(s is None for s in ds._store.shards)  # nothing mapped by opening
    assert ds[14999]["x"] == 2 and ds[3 * 2500 + 1]["x"] == 1
    assert sum(s is not None for s in ds._store.shards) == 2


def test_threads_read_the_same_values(dataset_dir):
    ds = kuat.open(dataset_dir)
    expected = [int(v) for v in ds.read_batch(range(N))["label"]]
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(30):
            idx = rng.integers(0, N, 8)
            got = [s["label"] for s in ds.with_transform({"image": lambda x: 0}).__getitems__(idx)]
            if got != [expected[i] for i in idx]:
                errors.append((idx, got))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_pickle_reopens_lazily(dataset_dir):
    ds = kuat.open(dataset_dir)
    ds[0]
    copy = pickle.loads(pickle.dumps(ds.with_transform({"label": abs})))
    assert all(s is None for s in copy._store.shards)
    _check(copy[5], 5)


class _FakeFused:
    """A fused transform: writes a constant derived from the sample's generator."""

    def __init__(self, size=(4, 5)):
        self.size = size
        self.calls = []

    def output_size(self):
        return self.size

    def apply_encoded(self, data, width, height, rng, out=None):
        self.calls.append((bytes(data)[:8], width, height))
        value = int(rng.integers(0, 256))
        if out is None:
            out = np.empty((3, 2, 2), np.uint8)
        out[...] = value
        return out

    def batch_transform(self):
        return lambda x: x.float() / 255


def test_fused_transform_writes_into_one_batch_buffer(dataset_dir):
    ds = kuat.open(dataset_dir)
    t = _FakeFused()
    view = ds.with_transform({"image": t})
    samples = view.__getitems__([2, 9, 30])
    imgs = [s["image"] for s in samples]
    assert all(isinstance(x, torch.Tensor) and x.shape == (3, 4, 5) for x in imgs)
    base = imgs[0].untyped_storage().data_ptr()
    assert all(x.untyped_storage().data_ptr() == base for x in imgs)
    assert [imgs[j].data_ptr() - base for j in range(3)] == [0, 60, 120]  # consecutive slots
    for x, i in zip(imgs, [2, 9, 30]):
        assert int(x[0, 0, 0]) == int(sample_rng(i).numpy.integers(0, 256))
    raw = ds.raw(9)["image"]
    assert t.calls[1] == (raw.data[:8], raw.width, raw.height)
    assert samples[1]["label"] == _row(9)["label"]
    batch = view.kuat_batch_transform({"image": torch.full((1, 3, 1, 1), 255, dtype=torch.uint8)})
    assert batch["image"].dtype == torch.float32 and float(batch["image"][0, 0, 0, 0]) == 1.0
    assert ds.kuat_batch_transform is None
    # variable output size: one array per sample
    single = ds.with_transform({"image": _FakeFused(size=None)})
    out = single.__getitems__([1, 2])
    assert (
        out[0]["image"].shape == (3, 2, 2)
        and out[0]["image"].data_ptr() != out[1]["image"].data_ptr()
    )
    assert single[3]["image"].shape == (3, 2, 2)


def test_plain_callables_get_chw_tensors_and_sample_rng(dataset_dir):
    ds = kuat.open(dataset_dir)
    seen = {}

    def image_t(x):
        seen["shape"] = tuple(x.shape)
        return x.flip(-1)

    def label_t(v):
        return (v, int(kuat.sample_rng().numpy.integers(0, 1 << 30)))

    view = ds.with_transform({"image": image_t, "label": label_t})
    s = view[6]
    hwc = _pixels(_row(6)["image"])
    assert seen["shape"] == (3, hwc.shape[0], hwc.shape[1])
    np.testing.assert_array_equal(s["image"].numpy(), hwc.transpose(2, 0, 1)[:, :, ::-1])
    assert s["label"] == (_row(6)["label"], int(sample_rng(6).numpy.integers(0, 1 << 30)))
    whole = ds.with_transform(lambda sample: (sample["label"], kuat.sample_rng().seed))
    assert whole.__getitems__([4, -1]) == [
        (_row(4)["label"], sample_rng(4).seed),
        (_row(N - 1)["label"], sample_rng(N - 1).seed),
    ]
    with pytest.raises(ValueError, match="nope"):
        ds.with_transform({"nope": image_t})
    with pytest.raises(TypeError):
        ds.with_transform({"label": 3})


def test_torchvision_v2_transform_works(dataset_dir):
    v2 = pytest.importorskip("torchvision.transforms.v2")
    ds = kuat.open(dataset_dir).with_transform({"image": v2.Resize((8, 8), antialias=True)})
    samples = ds.__getitems__([0, 1])
    assert samples[0]["image"].shape == (3, 8, 8) and samples[0]["image"].dtype == torch.uint8
    batch = torch.utils.data.default_collate([{"image": s["image"]} for s in samples])
    assert batch["image"].shape == (2, 3, 8, 8)


def test_writer_rejects_rows_that_do_not_match(tmp_path):
    with kuat.Writer(tmp_path / "x", SCHEMA) as w:
        bad = [
            ("label", "seven", r"field 'label' row 0: expected int64, got str"),
            ("label", 2**63, "out of range"),
            ("label", True, "expected int64, got bool"),
            ("u8", -1, "expected uint8"),
            ("emb", np.zeros((3, 2), np.float32), r"expected tensor\[2x3, float32\], got ndarray"),
            ("emb", np.zeros((2, 3), np.float64), "unsafe dtype cast"),
            ("tokens", [1.5], "expected sequence"),
            ("text", b"bytes", "expected string, got bytes"),
            ("blob", "str", "expected bytes, got str"),
            ("flag", 1, "expected bool, got int"),
            ("image", b"not an image at all", "not a readable image"),
            ("image", 42, "expected image, got int"),
        ]
        for name, value, match in bad:
            row = _row(0)
            row[name] = value
            with pytest.raises(SchemaError, match=match) as e:
                w.write(row)
            assert e.value.field == name
        row = _row(0)
        del row["label"]
        with pytest.raises(SchemaError, match="missing field 'label'"):
            w.write(row)
        with pytest.raises(SchemaError, match="'extra'"):
            w.write({**_row(0), "extra": 1})
        with pytest.raises(SchemaError, match="different lengths"):
            w.write_batch(
                {name: [_row(0)[name]] * (2 if name == "u8" else 1) for name in SCHEMA.names}
            )
        cols = {name: [_row(i)[name] for i in range(3)] for name in SCHEMA.names}
        cols["u8"] = [1, 2, 300]
        with pytest.raises(SchemaError, match="field 'u8' row 2"):
            w.write_batch(cols)
        w.write(_row(0))
        w.write(
            {
                **_row(1),
                "emb": [[0, 1, 2], [3, 4, 5]],
                "tokens": torch.tensor([1, 2], dtype=torch.int16),
            }
        )
    ds = kuat.open(tmp_path / "x")
    assert len(ds) == 2  # rejected rows and batches wrote nothing
    np.testing.assert_array_equal(ds[1]["emb"], [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(ds[1]["tokens"], [1, 2])


def test_write_batch_takes_arrays_and_rolls_shards(tmp_path):
    schema = {"x": kf.tensor((16,), "uint8"), "y": kf.int16()}
    xs = np.arange(100 * 16, dtype=np.uint8).reshape(100, 16)
    with kuat.Writer(tmp_path / "d", schema, shard_bytes=16 * 30) as w:
        w.write_batch({"x": xs[:70], "y": np.arange(70, dtype=np.int8)})
        w.write_batch({"x": xs[70:], "y": list(range(70, 100))})
    ds = kuat.open(tmp_path / "d")
    assert [s.rows for s in ds.manifest.shards] == [
        26,
        26,
        26,
        22,
    ]  # 18 bytes per row, 480 per shard
    np.testing.assert_array_equal(ds.read_batch(range(100))["x"], xs)
    assert ds.read_batch(range(100))["y"].tolist() == list(range(100))


def test_interrupted_write_leaves_no_dataset(tmp_path):
    path = tmp_path / "d"
    with pytest.raises(RuntimeError):
        with kuat.Writer(path, {"x": kf.int64()}, shard_bytes=8) as w:
            for i in range(10):
                w.write({"x": i})
            raise RuntimeError("killed")
    assert not (path / "manifest.json").exists()
    assert list(path.iterdir()) == []
    with pytest.raises(FormatError, match="not a kuat dataset"):
        kuat.open(path)
    # a half-written directory is reusable without overwrite
    (path / "shard-00000.arrow").write_bytes(b"stale")
    with kuat.Writer(path, {"x": kf.int64()}) as w:
        w.write({"x": 1})
    assert kuat.open(path)[0]["x"] == 1


def test_overwrite(tmp_path):
    path = tmp_path / "d"
    with kuat.Writer(path, {"x": kf.int64()}, shard_bytes=8) as w:
        w.write_batch({"x": np.arange(5)})
    with pytest.raises(FileExistsError, match="overwrite=True"):
        kuat.Writer(path, {"x": kf.int64()})
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "cat.jpg").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="not a kuat dataset"):
        kuat.Writer(tmp_path / "other", {"x": kf.int64()})
    with kuat.Writer(path, {"y": kf.string()}, overwrite=True) as w:
        w.write({"y": "new"})
    ds = kuat.open(path)
    assert len(ds) == 1 and ds[0] == {"y": "new"}
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "shard-00000.arrow"]


def test_empty_dataset(tmp_path):
    with kuat.Writer(tmp_path / "e", {"x": kf.int64()}):
        pass
    ds = kuat.open(tmp_path / "e")
    assert len(ds) == 0 and ds.num_shards == 0
    with pytest.raises(IndexError):
        ds[0]


def test_schema_json_round_trip_and_validation():
    s = kuat.Schema([kuat.Field("a", kf.tensor((2, 2), "uint16"), {"names": ["x"]})])
    assert kuat.Schema.from_json(json.loads(json.dumps(s.to_json()))) == s
    assert s["a"].metadata == {"names": ["x"]}
    with pytest.raises(ValueError):
        kf.tensor((0, 3), "uint8")
    with pytest.raises(ValueError):
        kf.tensor((2,), "bool")
    with pytest.raises(ValueError):
        kf.sequence("U5")
    with pytest.raises(ValueError):
        kuat.Schema([kuat.Field("a", kf.int8()), kuat.Field("a", kf.int8())])
    with pytest.raises(ValueError):
        kuat.Writer("/nonexistent-never", {"a": kf.int8()}, shard_bytes=0)


class _FakeDeviceDecode(_FakeFused):
    """Stands in for ``Compose(decode_device="cuda")``: one call per batch."""

    decode_device = "cuda"

    def __init__(self):
        super().__init__()
        self.batches = []

    def apply_encoded_batch(self, datas, widths, heights, rngs, *, indices=None, sources=None):
        self.batches.append((list(indices), [bytes(d) for d in datas], list(widths), sources))
        out = torch.empty((len(datas), 3, 4, 5), dtype=torch.uint8)
        for j, rng in enumerate(rngs):
            out[j] = int(rng.integers(0, 256))
        return out


def test_device_decoding_transform_gets_the_whole_batch(dataset_dir):
    ds = kuat.open(dataset_dir)
    t = _FakeDeviceDecode()
    samples = ds.with_transform({"image": t}).__getitems__([5, -1])
    ((indices, datas, widths, sources),) = t.batches
    assert indices == [5, N - 1]
    assert datas == [_row(5)["image"], _row(N - 1)["image"]]
    assert widths == [ds.raw(5)["image"].width, ds.raw(N - 1)["image"].width]
    assert sources == [ds.locate(5)[0], ds.locate(N - 1)[0]]
    assert int(samples[1]["image"][0, 0, 0]) == int(sample_rng(N - 1).numpy.integers(0, 256))
    assert not t.calls  # the per-sample path was not used


def test_real_fused_transforms_and_loader(dataset_dir):
    from kuat import vision as kv

    t = kv.Compose(
        [kv.RandomResizedCrop(6), kv.RandomHorizontalFlip(), kv.Normalize((0.5,) * 3, (0.25,) * 3)]
    )
    ds = kuat.open(dataset_dir).with_transform({"image": t})
    a = ds.__getitems__([3, 8, 3])
    b = ds.__getitems__([3, 8, 3])
    assert all(torch.equal(x["image"], y["image"]) for x, y in zip(a, b))  # seeded per index
    assert torch.equal(a[0]["image"], a[2]["image"])
    assert a[0]["image"].untyped_storage().data_ptr() == a[1]["image"].untyped_storage().data_ptr()
    loader = kuat.DataLoader(
        kuat.open(dataset_dir).with_transform({"image": t, "tokens": len}),
        batch_size=8,
        num_workers=2,
    )
    batches = list(loader)
    assert len(batches) == N // 8
    first = batches[0]
    assert (
        first["image"].shape == (8, 3, 6, 6) and first["image"].dtype == torch.float32
    )  # normalised
    assert first["label"].tolist() == [_row(i)["label"] for i in range(8)]
    assert first["tokens"].tolist() == [i % 6 for i in range(8)]


def test_write_batch_takes_values_that_fit_from_wider_dtypes(tmp_path):
    with kuat.Writer(tmp_path / "d", {"a": kf.int64(), "b": kf.uint8()}) as w:
        w.write_batch({"a": np.array([1, 2**40], np.uint64), "b": np.array([0, 255], np.int64)})
        with pytest.raises(SchemaError, match="field 'b' row 3"):
            w.write_batch({"a": np.array([1, 2], np.uint64), "b": np.array([0, 256], np.int64)})
        with pytest.raises(SchemaError, match="field 'a' row 2"):
            w.write_batch({"a": np.array([1.5, 2.0]), "b": np.array([0, 1], np.uint8)})
    ds = kuat.open(tmp_path / "d")
    assert ds.read_batch([0, 1])["a"].tolist() == [1, 2**40]
    assert ds.read_batch([0, 1])["b"].tolist() == [0, 255]


def test_reads_ipc_file_format_and_multi_batch_shards(tmp_path):
    import pyarrow as pa

    schema = kuat.Schema({"x": kf.int64(), "v": kf.tensor((2,), "uint8")})
    with kuat.Writer(tmp_path / "d", schema) as w:
        w.write_batch({"x": np.arange(6), "v": np.arange(12, dtype=np.uint8).reshape(6, 2)})
    shard = tmp_path / "d" / "shard-00000.arrow"
    table = pa.ipc.open_stream(shard.read_bytes()).read_all()  # in memory: we rewrite the file
    with pa.ipc.new_file(str(shard), table.schema) as f:  # file format, 3 record batches
        for batch in table.to_batches(max_chunksize=2):
            f.write_batch(batch)
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    m["shards"][0]["bytes"] = shard.stat().st_size
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(m))
    ds = kuat.open(tmp_path / "d")
    b = ds.read_batch([5, 0, 3])
    assert b["x"].tolist() == [5, 0, 3]
    np.testing.assert_array_equal(b["v"], [[10, 11], [0, 1], [6, 7]])


def test_writer_refuses_values_arrow_cannot_store_at_write_time(tmp_path, monkeypatch):
    """Such values used to pass write() and fail at close() with a non-kuat error (or be
    stored as inf), losing the whole shard."""
    from kuat.format import builder

    schema = {"s": kf.string(), "h": kf.float16(), "d": kf.float64(), "b": kf.binary()}
    good = {"s": "ok \u00e9", "h": 1.5, "d": 2.0, "b": b"x"}
    monkeypatch.setattr(builder, "_MAX_VALUE_BYTES", 16)
    with kuat.Writer(tmp_path / "d", schema) as w:
        bad = [
            ("s", "a\udcff", "UTF-8"),
            ("s", "\u00e9" * 9, "18 bytes"),  # 9 characters, 18 bytes of UTF-8
            ("h", 70000.0, "out of range"),
            ("h", np.float64(1e10), "out of range"),
            ("d", 2**1100, "out of range"),
            ("b", b"y" * 17, "17 bytes"),
            ("b", "x" * 10_000_000, "expected bytes, got str"),
        ]
        for name, value, match in bad:
            with pytest.raises(SchemaError, match=match) as e:
                w.write({**good, name: value})
            assert e.value.field == name and len(str(e.value)) < 300
        w.write(good)
        w.write({**good, "h": float("inf"), "d": float("nan")})  # given, not overflowed
    ds = kuat.open(tmp_path / "d")
    assert len(ds) == 2 and ds[0] == good
    assert ds[1]["h"] == float("inf") and np.isnan(ds[1]["d"])


def test_write_batch_names_a_column_without_length(tmp_path):
    with kuat.Writer(tmp_path / "d", {"x": kf.int64(), "y": kf.int8()}) as w:
        with pytest.raises(SchemaError, match="field 'y'") as e:
            w.write_batch({"x": [1], "y": 5})
        assert e.value.field == "y"
        with pytest.raises(SchemaError, match=r"field 'y' row 0: expected int8, got float64 1.5"):
            w.write_batch({"x": [1], "y": np.array([1.5])})


def test_failed_close_leaves_no_shards(tmp_path, monkeypatch):
    from kuat.format import writer

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_manifest", disk_full)
    with pytest.raises(OSError, match="No space"):
        with kuat.Writer(tmp_path / "d", {"x": kf.int64()}, shard_bytes=8) as w:
            w.write_batch({"x": np.arange(5)})
    assert list((tmp_path / "d").iterdir()) == []


def test_values_view_matches_to_numpy_on_slices():
    from kuat.format.arrow_views import values_view

    ints = pa.array(np.arange(10, dtype=np.int16))
    bools = pa.array([i % 3 == 0 for i in range(11)])
    nested = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(pa.array(np.arange(24, dtype=np.float32)), 3), 2
    )
    for arr in (ints, bools, nested):
        for sl in (slice(0, None), slice(3, 7), slice(9, 9)):
            part = arr[sl]
            assert values_view(part).tolist() == part.to_pylist()
    assert values_view(nested[1:3]).shape == (2, 2, 3)
    assert values_view(bools[1:4]).tolist() == [False, False, True]
    with pytest.raises(ValueError, match="nulls"):
        values_view(pa.array([1, None]))
    with pytest.raises(ValueError, match="no NumPy view"):
        values_view(pa.array(["a"]))
    # and back: what the writer builds, without pyarrow.array
    from kuat.format.arrow_views import array_from_bytes, array_from_numpy

    for values in ([], [True, False, True] * 5, np.arange(7, dtype=np.float16)):
        arr = array_from_numpy(np.asarray(values, dtype=np.asarray(values).dtype))
        arr.validate(full=True)
        assert arr.to_pylist() == list(values) and arr.null_count == 0
    for values, t in (
        (["", "\u00e9\u4e2d", "x"], pa.string()),
        ([b"\x00", b""], pa.binary()),
        ([], pa.string()),
    ):
        arr = array_from_bytes(values, t)
        arr.validate(full=True)
        assert arr.type == t and arr.to_pylist() == values


def test_reading_shards_imports_neither_pandas_nor_torch(tmp_path):
    """pyarrow's to_numpy imports pandas (~1 s per process); inspect must not import torch."""
    import subprocess
    import sys

    (tmp_path / "t.csv").write_text("a,b\n1,x\n2,y\n")
    code = f"""
import sys
import numpy as np
import kuat
from kuat import format as kf
from kuat.cli import main
schema = {{"f": kf.bool_(), "t": kf.tensor((2, 2), "int8"), "q": kf.sequence("int32"), "x": kf.float32()}}
with kuat.Writer({str(tmp_path / "d")!r}, schema) as w:
    w.write({{"f": True, "t": np.ones((2, 2), np.int8), "q": [1, 2], "x": 1.0}})
ds = kuat.open({str(tmp_path / "d")!r})
assert ds[0]["f"] is True and ds.read_batch([0])["q"][0].tolist() == [1, 2]
assert main(["inspect", {str(tmp_path / "d")!r}]) == 0
assert main(["convert", {str(tmp_path / "t.csv")!r}, {str(tmp_path / "c")!r}, "--no-progress"]) == 0
assert kuat.open({str(tmp_path / "c")!r}).read_batch([0, 1])["a"].tolist() == [1, 2]
print(sorted(m for m in ("pandas", "torch", "datasets") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_second_writer_into_the_same_directory_is_refused(tmp_path):
    """Two writers (two `kuat convert` runs, say) would delete and rename over each other's
    shards: the last manifest could list the other writer's bytes."""
    path = tmp_path / "d"
    w1 = kuat.Writer(path, {"x": kf.int64()}, shard_bytes=8)
    w1.write({"x": 1})
    w1.write({"x": 2})  # rolls a shard
    with pytest.raises(FileExistsError, match="another kuat Writer"):
        kuat.Writer(path, {"x": kf.int64()}, overwrite=True)
    w1.write({"x": 3})
    w1.close()
    assert kuat.open(path).read_batch([0, 1, 2])["x"].tolist() == [1, 2, 3]
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "shard-00000.arrow",
        "shard-00001.arrow",
        "shard-00002.arrow",
    ]
    with kuat.Writer(path, {"x": kf.int64()}, overwrite=True) as w2:  # free again
        w2.write({"x": 4})
    with pytest.raises(FileExistsError, match="already a kuat dataset"):
        kuat.Writer(path, {"x": kf.int64()})  # a refused writer releases its lock too
    with pytest.raises(RuntimeError):
        with kuat.Writer(path, {"x": kf.int64()}, overwrite=True):
            raise RuntimeError("aborted")
    with kuat.Writer(path, {"x": kf.int64()}, overwrite=True) as w3:
        w3.write({"x": 5})
    assert kuat.open(path)[0]["x"] == 5


@pytest.mark.timeout(120)
def test_killed_writer_process_leaves_no_dataset(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "d"
    code = f"""
import numpy as np, kuat
from kuat import format as kf
with kuat.Writer({str(path)!r}, {{"t": kf.tensor((256,), "float32")}}, shard_bytes=4096) as w:
    for i in range(10**7):
        w.write({{"t": np.full(256, i, np.float32)}})
"""
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 100
        while not (path.is_dir() and len(list(path.glob("shard-*.arrow"))) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with pytest.raises(FormatError, match="not a kuat dataset"):
        kuat.open(path)
    with kuat.Writer(path, {"x": kf.int64()}) as w:  # leftovers and the stale lock: reusable
        w.write({"x": 7})
    assert kuat.open(path)[0] == {"x": 7}
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "shard-00000.arrow"]


def test_add_shard_moves_finished_shards_in_without_rewriting(tmp_path):
    # how the Ray engine assembles a dataset: parts written by separate Writers
    schema = {"x": kf.int64(), "s": kf.string()}
    parts = []
    for k in range(2):
        with kf.Writer(tmp_path / f"part{k}", schema, shard_bytes=64) as w:
            for i in range(10):
                w.write({"x": 10 * k + i, "s": f"row {10 * k + i}"})
        parts.append(tmp_path / f"part{k}")
    checksums = []
    with kf.Writer(tmp_path / "out", schema) as out:
        out.write({"x": -1, "s": "written here"})  # flushed to its own shard first
        for p in parts:
            for info in kf.read_manifest(p).shards:
                checksums.append(info.checksum)
                entry = out.add_shard(p / info.file, info)
                assert entry.checksum == info.checksum and not (p / info.file).exists()
        bad = kf.ShardInfo("x", 1, 12345, checksums[0])
        (tmp_path / "stray.arrow").write_bytes(b"not 12345 bytes")
        with pytest.raises(FormatError, match=r"stray\.arrow holds 15 bytes.*says 12345"):
            out.add_shard(tmp_path / "stray.arrow", bad)
    ds = kuat.open(tmp_path / "out")
    assert [ds[i]["x"] for i in range(len(ds))] == [-1, *range(20)]
    assert [s.checksum for s in ds.manifest.shards[1:]] == checksums
    assert kf.verify(tmp_path / "out").ok


def test_an_image_transform_for_the_whole_sample_is_refused_naming_the_field(dataset_dir):
    from kuat import vision as kv

    ds = kuat.open(dataset_dir)
    crop = kv.RandomResizedCrop(8)
    for t in (crop, kv.Compose([crop, kv.RandomHorizontalFlip()]), kv.RandomHorizontalFlip()):
        # it would get the sample dict and fail at iteration ("expected a torch.Tensor ...")
        with pytest.raises(TypeError, match=r"per field: with_transform\(\{'image': \.\.\.\}\)"):
            ds.with_transform(t)
        assert ds.with_transform({"image": t})[3]["image"].shape[0] == 3  # (3, H, W) uint8
    assert ds.with_transform(lambda s: s["label"])[3] == ds[3]["label"]  # a plain callable
