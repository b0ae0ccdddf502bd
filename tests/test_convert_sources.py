"""Hugging Face, Parquet/JSONL/CSV, NumPy and WebDataset -> kuat: values equal to the source."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _images import noise_image

import kuat
import kuat.convert
from kuat import format as kf
from kuat.errors import DecodeError, FormatError, SchemaError


# -- Hugging Face ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dataset():
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {
            "img": datasets.Image(),
            "label": datasets.ClassLabel(names=["cat", "dog", "emu"]),
            "score": datasets.Value("float32"),
            "ok": datasets.Value("bool"),
            "caption": datasets.Value("string"),
            "ids": datasets.Sequence(datasets.Value("int32")),
            "vec": datasets.List(datasets.Value("float16"), length=3),
            "grid": datasets.Array2D((2, 2), "uint8"),
        }
    )
    n = 12
    data = {
        "img": [{"bytes": noise_image(5 + i, 4, i, "PNG"), "path": None} for i in range(n)],
        "label": [i % 3 for i in range(n)],
        "score": [i / 8 for i in range(n)],
        "ok": [i % 2 == 0 for i in range(n)],
        "caption": [f"a photo {i}" for i in range(n)],
        "ids": [list(range(i % 4)) for i in range(n)],
        "vec": [[i, i + 0.5, -i] for i in range(n)],
        "grid": [[[i, 1], [2, 3]] for i in range(n)],
    }
    return datasets.Dataset.from_dict(data, features=features)


def _check_hf(ds, hf):
    assert len(ds) == len(hf)
    assert ds.schema["label"].metadata == {"names": ["cat", "dog", "emu"]}
    assert ds.metadata["hf_features"]["label"]["names"] == ["cat", "dog", "emu"]
    assert ds.schema["ids"].type == kf.sequence("int32")
    assert ds.schema["vec"].type == kf.tensor((3,), "float16")
    assert ds.schema["grid"].type == kf.tensor((2, 2), "uint8")
    raw_hf = hf.cast_column("img", __import__("datasets").Image(decode=False))
    for i in range(len(hf)):
        exp, got = raw_hf[i], ds.raw(i)
        assert got["img"].data == exp["img"]["bytes"]
        assert (got["img"].width, got["img"].height) == (5 + i, 4)
        assert got["label"] == exp["label"] and got["ok"] is exp["ok"]
        assert got["score"] == pytest.approx(exp["score"])
        assert got["caption"] == exp["caption"]
        assert got["ids"].tolist() == exp["ids"]
        np.testing.assert_array_equal(got["vec"], np.asarray(exp["vec"], np.float16))
        np.testing.assert_array_equal(got["grid"], exp["grid"])
    np.testing.assert_array_equal(ds[3]["img"], np.asarray(hf[3]["img"].convert("RGB")))


def test_hf_in_memory(hf_dataset, tmp_path):
    report = kuat.convert.from_hf(hf_dataset, tmp_path / "out", num_workers=2, progress=False)
    assert report.rows == 12
    _check_hf(kuat.open(tmp_path / "out"), hf_dataset)


def test_hf_save_to_disk_and_auto_detect(hf_dataset, tmp_path):
    hf_dataset.save_to_disk(str(tmp_path / "saved"))
    assert kuat.convert.detect_format(tmp_path / "saved")[0] == "hf"
    kuat.convert.convert(str(tmp_path / "saved"), tmp_path / "out", progress=False)
    _check_hf(kuat.open(tmp_path / "out"), hf_dataset)
    shuffled = hf_dataset.shuffle(seed=0).select(range(5))
    kuat.convert.from_hf(shuffled, tmp_path / "sh", progress=False)
    assert [kuat.open(tmp_path / "sh").raw(i)["caption"] for i in range(5)] == shuffled["caption"]


def test_hf_dataset_dict_split(hf_dataset, tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": hf_dataset, "test": hf_dataset.select([2, 0])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match="split"):
        kuat.convert.from_hf(str(tmp_path / "dd"), tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match=r"no split 'val'.*\['test', 'train'\]"):
        kuat.convert.from_hf(str(tmp_path / "dd"), tmp_path / "o", split="val", progress=False)
    kuat.convert.convert(str(tmp_path / "dd"), tmp_path / "o", split="test", progress=False)
    ds = kuat.open(tmp_path / "o")
    assert [ds.raw(i)["caption"] for i in range(len(ds))] == ["a photo 2", "a photo 0"]


def test_hf_unsupported_feature_names_the_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"when": [{"a": 1}]})
    with pytest.raises(ValueError, match="'when'"):
        kuat.convert.from_hf(hf, tmp_path / "o", progress=False)


# -- tabular ---------------------------------------------------------------------------------
def _table(n: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(np.arange(n, dtype=np.int64)),
            "x": pa.array(np.linspace(0, 1, n, dtype=np.float32)),
            "name": [f"n{i}" for i in range(n)],
            "flag": [i % 2 == 1 for i in range(n)],
            "toks": pa.array([list(range(i % 5)) for i in range(n)], type=pa.list_(pa.int16())),
            "emb": pa.FixedSizeListArray.from_arrays(
                pa.array(np.arange(n * 4, dtype=np.float32)), 4
            ),
            "blob": [bytes([i % 256]) * 3 for i in range(n)],
        }
    )


def test_parquet_round_trip_across_files(tmp_path):
    t = _table(50)
    pq.write_table(t.slice(0, 20), tmp_path / "a.parquet")
    pq.write_table(t.slice(20), tmp_path / "b.parquet", row_group_size=7)
    kuat.convert.from_parquet(
        str(tmp_path / "*.parquet"), tmp_path / "out", progress=False, batch_size=8
    )
    ds = kuat.open(tmp_path / "out")
    assert len(ds) == 50
    assert ds.schema["toks"].type == kf.sequence("int16")
    assert ds.schema["emb"].type == kf.tensor((4,), "float32")
    b = ds.read_batch(range(50))
    np.testing.assert_array_equal(b["id"], np.arange(50))
    np.testing.assert_array_equal(b["x"], t["x"].to_numpy())
    assert b["name"] == t["name"].to_pylist()
    np.testing.assert_array_equal(b["flag"], t["flag"].to_numpy(zero_copy_only=False))
    assert [v.tolist() for v in b["toks"]] == t["toks"].to_pylist()
    np.testing.assert_array_equal(b["emb"], np.arange(200, dtype=np.float32).reshape(50, 4))
    assert [bytes(v) for v in b["blob"]] == t["blob"].to_pylist()
    assert ds.metadata["files"] == ["a.parquet", "b.parquet"]


def test_parquet_images_by_bytes_and_by_path(tmp_path):
    imgs = [noise_image(8 + i, 6, i) for i in range(4)]
    for i, data in enumerate(imgs):
        (tmp_path / f"{i}.jpg").write_bytes(data)
    t = pa.table(
        {
            "pic": pa.array(imgs, type=pa.binary()),
            "file": [f"{i}.jpg" for i in range(4)],
            "hf": pa.array(
                [{"bytes": d, "path": None} for d in imgs],
                type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
            ),
            "y": [0, 1, 2, 3],
        }
    )
    pq.write_table(t, tmp_path / "t.parquet")
    kuat.convert.from_parquet(
        tmp_path / "t.parquet", tmp_path / "out", image_fields=["pic", "file"], progress=False
    )
    ds = kuat.open(tmp_path / "out")
    for i in range(4):
        raw = ds.raw(i)
        assert raw["pic"].data == raw["file"].data == raw["hf"].data == imgs[i]
        assert (raw["pic"].width, raw["pic"].height, raw["pic"].codec) == (8 + i, 6, "jpeg")
        assert raw["y"] == i


def test_jsonl_and_csv(tmp_path):
    rows = [{"a": i, "b": f"s{i}", "c": i * 0.5, "t": [i, i + 1]} for i in range(9)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    kuat.convert.from_jsonl(tmp_path / "d.jsonl", tmp_path / "j", progress=False)
    ds = kuat.open(tmp_path / "j")
    assert [ds.raw(i)["b"] for i in range(9)] == [r["b"] for r in rows]
    assert ds.raw(4)["t"].tolist() == [4, 5] and ds.raw(4)["a"] == 4 and ds.raw(4)["c"] == 2.0
    (tmp_path / "d.csv").write_text("a,b,c\n" + "".join(f"{i},s{i},{i * 0.5}\n" for i in range(9)))
    kuat.convert.convert(str(tmp_path / "d.csv"), tmp_path / "c", progress=False)
    ds = kuat.open(tmp_path / "c")
    assert ds.schema["a"].type == kf.int64() and ds.schema["c"].type == kf.float64()
    assert [ds[i]["a"] for i in range(9)] == list(range(9))
    assert ds[8] == {"a": 8, "b": "s8", "c": 4.0}


def test_url_source_with_storage_options_into_a_local_path(tmp_path):
    # storage_options serve the URL source; the local destination's Writer must not get them
    import fsspec

    fsspec.filesystem("memory").pipe("/kuat-src-test/a.jsonl", b'{"a": 1}\n{"a": 2}\n')
    report = kuat.convert.from_jsonl(
        "memory://kuat-src-test/a.jsonl",
        tmp_path / "o",
        storage_options={"skip_instance_cache": True},
        progress=False,
    )
    assert report.rows == 2 and [kuat.open(tmp_path / "o")[i]["a"] for i in (0, 1)] == [1, 2]


def test_nulls_are_refused_naming_column_and_row(tmp_path):
    pq.write_table(pa.table({"v": [1, None, 3]}), tmp_path / "n.parquet")
    with pytest.raises(SchemaError, match=r"'v' of .*n.parquet has a null at row 1"):
        kuat.convert.from_parquet(tmp_path / "n.parquet", tmp_path / "o", progress=False)


def test_unreadable_image_in_a_table(tmp_path):
    t = pa.table({"pic": pa.array([noise_image(4, 4, 0), b"nope"], type=pa.binary())})
    pq.write_table(t, tmp_path / "t.parquet")
    with pytest.raises(DecodeError, match="row 1"):
        kuat.convert.from_parquet(
            tmp_path / "t.parquet", tmp_path / "o", image_fields=["pic"], progress=False
        )
    report = kuat.convert.from_parquet(
        tmp_path / "t.parquet",
        tmp_path / "o",
        image_fields=["pic"],
        progress=False,
        on_error="skip",
    )
    assert report.rows == 1 and len(report.skipped) == 1


# -- NumPy -----------------------------------------------------------------------------------
def test_numpy_files_and_arrays(tmp_path):
    x = np.arange(30 * 2 * 3, dtype=np.uint8).reshape(30, 2, 3)
    y = np.arange(30, dtype=np.int32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    kuat.convert.convert(
        [str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
        tmp_path / "o",
        progress=False,
        shard_bytes=64,
    )
    ds = kuat.open(tmp_path / "o")
    assert ds.num_shards > 1
    assert ds.schema["x"].type == kf.tensor((2, 3), "uint8") and ds.schema["y"].type == kf.int32()
    b = ds.read_batch(range(30))
    np.testing.assert_array_equal(b["x"], x)
    np.testing.assert_array_equal(b["y"], y)
    kuat.convert.from_numpy(
        {"m": np.eye(3, dtype=np.float64), "ok": np.array([True, False, True])},
        tmp_path / "m",
        progress=False,
    )
    ds = kuat.open(tmp_path / "m")
    np.testing.assert_array_equal(ds[1]["m"], [0, 1, 0])
    assert ds[1]["ok"] is False
    with pytest.raises(ValueError, match="different lengths"):
        kuat.convert.from_numpy(
            {"a": np.zeros(3), "b": np.zeros(4)}, tmp_path / "bad", progress=False
        )

    (tmp_path / "junk.npy").write_bytes(b"junk")
    with pytest.raises(FormatError, match="junk.npy is not a readable") as e:
        kuat.convert.from_numpy(tmp_path / "junk.npy", tmp_path / "bad", progress=False)
    assert e.value.path == str(tmp_path / "junk.npy")
    with pytest.raises(ValueError, match="array 'z' of shape"):
        kuat.convert.from_numpy({"z": np.zeros((3, 0))}, tmp_path / "bad", progress=False)


# -- WebDataset ------------------------------------------------------------------------------
def _tar(path, samples):
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _wds_samples(start, n):
    out = []
    for i in range(start, start + n):
        buf = io.BytesIO()
        np.save(buf, np.full((2,), i, np.float32))
        out.append(
            (
                f"part/{i:06d}",
                {
                    "jpg": noise_image(6, 5 + i % 3, i),
                    "cls": str(i % 4).encode(),
                    "txt": f"caption {i} \u00e9".encode(),
                    "json": json.dumps({"i": i}).encode(),
                    "npy": buf.getvalue(),
                    "seg.png": noise_image(3, 3, i, "PNG"),
                },
            )
        )
    return out


def test_webdataset_groups_members_and_maps_extensions(tmp_path):
    s1, s2 = _wds_samples(0, 5), _wds_samples(5, 4)
    _tar(tmp_path / "shard-0.tar", s1)
    _tar(tmp_path / "shard-1.tar", s2)
    assert kuat.convert.detect_format(str(tmp_path / "*.tar"))[0] == "webdataset"
    kuat.convert.convert(str(tmp_path / "*.tar"), tmp_path / "o", progress=False, num_workers=3)
    ds = kuat.open(tmp_path / "o")
    assert len(ds) == 9
    types = {f.name: f.type for f in ds.schema}
    assert types == {
        "__key__": kf.string(),
        "jpg": kf.image(),
        "cls": kf.int64(),
        "txt": kf.string(),
        "json": kf.string(),
        "npy": kf.tensor((2,), "float32"),
        "seg.png": kf.image(),
    }
    for i, (key, members) in enumerate(s1 + s2):
        raw = ds.raw(i)
        assert raw["__key__"] == key
        assert raw["jpg"].data == members["jpg"] and raw["seg.png"].data == members["seg.png"]
        assert raw["cls"] == i % 4
        assert raw["txt"] == members["txt"].decode()
        assert json.loads(raw["json"]) == {"i": i}
        np.testing.assert_array_equal(raw["npy"], [i, i])


def test_webdataset_sample_with_other_extensions(tmp_path):
    samples = _wds_samples(0, 3)
    del samples[1][1]["txt"]
    _tar(tmp_path / "s.tar", samples)
    with pytest.raises(SchemaError, match="000001"):
        kuat.convert.from_webdataset(tmp_path / "s.tar", tmp_path / "o", progress=False)
    report = kuat.convert.from_webdataset(
        tmp_path / "s.tar", tmp_path / "o", progress=False, on_error="skip"
    )
    assert report.rows == 2 and "000001" in report.skipped[0][0]


def test_detect_format(tmp_path):
    for name in ("a.parquet", "b.jsonl", "c.csv", "d.npz", "e.tar.gz"):
        (tmp_path / name).write_bytes(b"")
    assert kuat.convert.detect_format(tmp_path / "a.parquet")[0] == "parquet"
    assert kuat.convert.detect_format(tmp_path / "b.jsonl")[0] == "jsonl"
    assert kuat.convert.detect_format(tmp_path / "c.csv")[0] == "csv"
    assert kuat.convert.detect_format(tmp_path / "d.npz")[0] == "numpy"
    assert kuat.convert.detect_format(tmp_path / "e.tar.gz")[0] == "webdataset"
    with pytest.raises(ValueError, match="several kinds"):
        kuat.convert.detect_format([tmp_path / "a.parquet", tmp_path / "c.csv"])
    with pytest.raises(FileNotFoundError):
        kuat.convert.detect_format(tmp_path / "missing.parquet")
    with pytest.raises(ValueError, match="--format"):
        kuat.convert.detect_format(tmp_path)
    with kuat.Writer(tmp_path / "k", {"x": kf.int64()}):
        pass  # no rows, no shards: only the manifest says what it is
    with pytest.raises(ValueError, match="already a kuat dataset"):  # not 'manifest.json' as jsonl
        kuat.convert.detect_format(tmp_path / "k")


def test_detect_format_never_opens_a_special_manifest(tmp_path):
    """A FIFO named manifest.json is neither a kuat manifest nor a JSON table: detection goes
    on without opening it (an open would block until a writer came)."""
    import threading

    d = tmp_path / "fifo"
    d.mkdir()
    (d / "rows.jsonl").write_text('{"a": 1}\n')
    os.mkfifo(d / "manifest.json")
    result = []
    t = threading.Thread(target=lambda: result.append(kuat.convert.detect_format(d)), daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # unblock the reader before failing
        fd = os.open(d / "manifest.json", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
    assert result == [("jsonl", [str(d / "rows.jsonl")])]


def test_unreadable_table_files_are_named(tmp_path):
    cases = {
        "bad.jsonl": '{"a": 1}\n{"a": \n',
        "mixed.jsonl": '{"a": 1}\n{"a": "x"}\n',
        "bad.csv": "a,b\n1,2\n3\n",
        "empty.csv": "",
        "text.parquet": "not parquet at all",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(FormatError, match=f"{name} is not a readable") as e:
            kuat.convert.convert(str(tmp_path / name), tmp_path / "o", progress=False)
        assert e.value.path == str(tmp_path / name)
    (tmp_path / "nested.jsonl").write_text('{"a": {"b": 1}}\n')
    with pytest.raises(ValueError, match=r"column 'a' has Arrow type struct.*nested.jsonl"):
        kuat.convert.from_jsonl(tmp_path / "nested.jsonl", tmp_path / "o", progress=False)


def _npy(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_webdataset_bad_npy_names_tar_and_key_and_can_be_skipped(tmp_path):
    _tar(tmp_path / "p.tar", [("a", {"npy": b"garbage"})])
    with pytest.raises(SchemaError, match=r"p.tar:a.npy"):
        kuat.convert.from_webdataset(tmp_path / "p.tar", tmp_path / "o", progress=False)
    _tar(tmp_path / "b.tar", [("a", {"npy": _npy(np.zeros(3, bool))})])
    with pytest.raises(SchemaError, match=r"b.tar:a.npy.*bool"):
        kuat.convert.from_webdataset(tmp_path / "b.tar", tmp_path / "o", progress=False)
    shapes = [np.zeros(3), np.zeros(4), np.ones(3), np.zeros(3, np.complex64)]
    _tar(tmp_path / "s.tar", [(f"k{i}", {"npy": _npy(a)}) for i, a in enumerate(shapes)])
    with pytest.raises(SchemaError, match=r"s.tar:k1.npy"):
        kuat.convert.from_webdataset(tmp_path / "s.tar", tmp_path / "o", progress=False)
    report = kuat.convert.from_webdataset(
        tmp_path / "s.tar", tmp_path / "o", progress=False, on_error="skip"
    )
    assert report.rows == 2
    assert [os.path.basename(w) for w, _ in report.skipped] == ["s.tar:k1", "s.tar:k3"]
    np.testing.assert_array_equal(kuat.open(tmp_path / "o")[1]["npy"], np.ones(3))
