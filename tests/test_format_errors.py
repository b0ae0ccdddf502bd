"""Bad input raises kuat errors naming the path (and row): missing/truncated/corrupt shards,
bad manifests, unknown versions, checksum mismatches; verify and merge."""

from __future__ import annotations

import importlib
import json
import os
import sys

import numpy as np
import pytest

import kuat
from kuat import format as kf
from kuat.errors import DecodeError, FormatError, KuatError, SchemaError


def _write(path, n=30, shard_bytes=100, start=0, schema=None):
    schema = schema or {"x": kf.int64(), "v": kf.tensor((4,), "uint8"), "s": kf.string()}
    with kuat.Writer(path, schema, shard_bytes=shard_bytes) as w:
        for i in range(start, start + n):
            w.write({"x": i, "v": np.full(4, i % 256, np.uint8), "s": f"s{i}"})
    return kuat.open(path)


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def test_missing_shard_names_its_path(tmp_path):
    ds = _write(tmp_path / "d")
    victim, row = ds.locate(20)
    os.unlink(victim)
    ds = kuat.open(tmp_path / "d")
    assert ds[0]["x"] == 0  # other shards still read
    with pytest.raises(FormatError, match="missing") as e:
        ds[20]
    assert e.value.path == victim


def test_truncated_shard(tmp_path):
    ds = _write(tmp_path / "d")
    victim, _ = ds.locate(5)
    data = open(victim, "rb").read()
    open(victim, "wb").write(data[: len(data) // 2])
    with pytest.raises(FormatError, match="truncated") as e:
        kuat.open(tmp_path / "d")[5]
    assert e.value.path == victim


def test_truncated_shard_with_matching_manifest_size(tmp_path):
    """Also fix the recorded size: the Arrow reader must still refuse the file."""
    ds = _write(tmp_path / "d", shard_bytes=10_000)
    victim, _ = ds.locate(0)
    data = open(victim, "rb").read()
    for cut in (8, 100, len(data) // 2, len(data) - 9):
        open(victim, "wb").write(data[:cut])
        m = _manifest(tmp_path / "d")
        m["shards"][0]["bytes"] = cut
        (tmp_path / "d" / "manifest.json").write_text(json.dumps(m))
        if cut < 30 * 16:  # 30 rows of int64 + 4 uint8 + a string offset: 16 bytes each
            with pytest.raises(FormatError, match="cannot hold more than") as e:
                kuat.open(tmp_path / "d")
            assert e.value.path == str(tmp_path / "d" / "manifest.json")
            continue
        with pytest.raises(FormatError) as e:
            kuat.open(tmp_path / "d").read_batch([0, 29])
        assert e.value.path == victim


def test_manifest_not_json_and_unknown_version(tmp_path):
    _write(tmp_path / "d")
    path = tmp_path / "d" / "manifest.json"
    good = path.read_text()
    path.write_text(good[: len(good) // 2])
    with pytest.raises(FormatError, match="not valid JSON") as e:
        kuat.open(tmp_path / "d")
    assert e.value.path == str(path)
    m = json.loads(good)
    m["version"] = 2
    path.write_text(json.dumps(m))
    with pytest.raises(FormatError, match="unknown kuat format version 2"):
        kuat.open(tmp_path / "d")
    for key, value, match in [
        ("format", "other", "'format'"),
        ("shards", {}, "'shards' must be a list"),
        ("num_rows", 7, "'num_rows' is 7"),
        ("schema", {"fields": [{"name": "x", "type": "complex128"}]}, "invalid schema"),
        (
            "schema",
            {"fields": [{"name": "v", "type": "tensor", "shape": [2**40], "dtype": "uint8"}]},
            "invalid schema",
        ),
    ]:
        m = json.loads(good)
        m[key] = value
        path.write_text(json.dumps(m))
        with pytest.raises(FormatError, match=match):
            kuat.open(tmp_path / "d")
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(FormatError):
        kuat.open(tmp_path / "d")
    path.unlink()
    with pytest.raises(FormatError, match="not a kuat dataset"):
        kuat.open(tmp_path / "d")
    with pytest.raises(FormatError, match="does not exist"):
        kuat.open(tmp_path / "nowhere")


def test_shard_with_another_schema(tmp_path):
    _write(tmp_path / "a", shard_bytes=10_000)
    _write(
        tmp_path / "b",
        shard_bytes=10_000,
        schema={"x": kf.int32(), "v": kf.tensor((4,), "uint8"), "s": kf.string()},
    )
    os.link(tmp_path / "b" / "shard-00000.arrow", tmp_path / "a" / "other.arrow")
    m = _manifest(tmp_path / "a")
    m["shards"][0]["file"] = "other.arrow"
    m["shards"][0]["bytes"] = os.path.getsize(tmp_path / "a" / "other.arrow")
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(
        FormatError, match="does not match the manifest's schema.*x: int64 vs int32"
    ):
        kuat.open(tmp_path / "a")[0]


def test_row_count_mismatch(tmp_path):
    _write(tmp_path / "d", shard_bytes=10_000)
    m = _manifest(tmp_path / "d")
    m["shards"][0]["rows"] = 31
    m["num_rows"] = 31
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="holds 30 rows but the manifest records 31"):
        kuat.open(tmp_path / "d")[30]


def test_undecodable_image_names_index_and_shard(tmp_path):
    with kuat.Writer(tmp_path / "d", {"image": kf.image()}) as w:
        w.write({"image": kuat.format.EncodedImage(b"\xff\xd8garbage", 4, 4, "jpeg")})
    ds = kuat.open(tmp_path / "d")
    with pytest.raises(DecodeError) as e:
        ds[0]
    assert e.value.index == 0 and "shard-00000.arrow" in str(e.value.source)
    assert ds.raw(0)["image"].data == b"\xff\xd8garbage"
    from kuat import vision as kv

    fused = ds.with_transform({"image": kv.Compose([kv.Resize(8), kv.CenterCrop(8)])})
    with pytest.raises(DecodeError) as e:
        fused.__getitems__([-1])
    assert e.value.index == 0 and "shard-00000.arrow" in str(e.value.source)


def test_verify_finds_bad_checksums_and_missing_shards(tmp_path):
    ds = _write(tmp_path / "d")
    report = kf.verify(tmp_path / "d")
    assert report.ok and report.rows == 30 and report.shards == ds.num_shards
    flip, _ = ds.locate(3)
    gone, _ = ds.locate(29)
    data = bytearray(open(flip, "rb").read())
    data[-20] ^= 0xFF  # same size, different bytes
    open(flip, "wb").write(bytes(data))
    os.unlink(gone)
    report = kf.verify(tmp_path / "d")
    assert not report.ok
    assert [e.path for e in report.errors] == [flip, gone]
    assert "checksum mismatch" in str(report.errors[0]) and "missing" in str(report.errors[1])
    with pytest.raises(FormatError):
        report.raise_first()


def test_verify_images_compares_headers(tmp_path):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (7, 5)).save(buf, "PNG")
    with kuat.Writer(tmp_path / "d", {"image": kf.image()}) as w:
        w.write({"image": buf.getvalue()})
        w.write({"image": kuat.format.EncodedImage(buf.getvalue(), 5, 7, "png")})
    assert kf.verify(tmp_path / "d").ok  # headers are not read by default
    report = kf.verify(tmp_path / "d", images=True)
    assert len(report.errors) == 1 and report.errors[0].row == 1
    assert "(5, 7, 'png')" in str(report.errors[0])


def test_merge_hard_links_without_rewriting(tmp_path):
    _write(tmp_path / "a", n=10)
    _write(tmp_path / "b", n=7, start=10)
    m = kf.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "ab")
    ds = kuat.open(tmp_path / "ab")
    assert len(ds) == m.num_rows == 17
    assert ds.read_batch(range(17))["x"].tolist() == list(range(17))
    assert [ds[i]["s"] for i in (0, 10, 16)] == ["s0", "s10", "s16"]
    a_first = kuat.open(tmp_path / "a").shard_paths[0]
    assert os.stat(ds.shard_paths[0]).st_ino == os.stat(a_first).st_ino  # same bytes on disk
    assert kf.verify(tmp_path / "ab").ok
    assert ds.metadata["merged_from"] == [str(tmp_path / "a"), str(tmp_path / "b")]
    with pytest.raises(FileExistsError):
        kf.merge([tmp_path / "a"], tmp_path / "ab")


def test_merge_by_copy(tmp_path):
    _write(tmp_path / "a", n=5)
    _write(tmp_path / "b", n=5, start=5)
    kf.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "c", link="copy")
    m = _manifest(tmp_path / "c")
    assert [s["file"] for s in m["shards"]] == [
        f"shard-{k:05d}.arrow" for k in range(len(m["shards"]))
    ]
    for s in m["shards"]:  # copies, not links: the sources may now be deleted
        assert os.stat(tmp_path / "c" / s["file"]).st_nlink == 1
    ds = kuat.open(tmp_path / "c")
    assert ds.read_batch(range(10))["x"].tolist() == list(range(10))
    assert kf.verify(tmp_path / "c").ok
    # merging a merged dataset
    kf.merge([tmp_path / "c", tmp_path / "a"], tmp_path / "cc")
    assert kuat.open(tmp_path / "cc").read_batch(range(15))["x"].tolist() == list(range(10)) + list(
        range(5)
    )


def test_merge_schema_mismatch_names_the_field(tmp_path):
    _write(tmp_path / "a", n=3)
    _write(
        tmp_path / "b",
        n=3,
        schema={"x": kf.int64(), "v": kf.tensor((4,), "int16"), "s": kf.string()},
    )
    with pytest.raises(SchemaError, match=r"field 'v' is tensor\[4, uint8\] vs tensor\[4, int16\]"):
        kf.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "o")
    assert not (tmp_path / "o" / "manifest.json").exists()
    with kuat.Writer(
        tmp_path / "c", kuat.Schema([kuat.Field("x", kf.int64(), {"names": ["a"]})])
    ) as w:
        w.write({"x": 0})
    with kuat.Writer(
        tmp_path / "e", kuat.Schema([kuat.Field("x", kf.int64(), {"names": ["b"]})])
    ) as w:
        w.write({"x": 0})
    with pytest.raises(SchemaError, match="different metadata"):
        kf.merge([tmp_path / "c", tmp_path / "e"], tmp_path / "o")


def test_all_format_errors_are_kuat_errors():
    assert issubclass(FormatError, KuatError) and issubclass(SchemaError, KuatError)


def test_merge_falls_back_to_copies_when_links_fail(tmp_path, monkeypatch):
    _write(tmp_path / "a", n=4)
    _write(tmp_path / "b", n=4, start=4)

    def no_links(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    kf.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    for s in _manifest(tmp_path / "m")["shards"]:
        assert "/" not in s["file"] and os.stat(tmp_path / "m" / s["file"]).st_nlink == 1
    assert kuat.open(tmp_path / "m").read_batch(range(8))["x"].tolist() == list(range(8))
    assert kf.verify(tmp_path / "m").ok
    with pytest.raises(OSError, match="cross-device"):
        kf.merge([tmp_path / "a"], tmp_path / "h", link="hardlink")


def test_merge_into_one_of_its_sources_is_refused_and_loses_nothing(tmp_path):
    _write(tmp_path / "a", n=10)
    _write(tmp_path / "b", n=5, start=10)
    with pytest.raises(ValueError, match="holds shards of"):
        kf.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "a", overwrite=True)
    with pytest.raises(ValueError, match="holds shards of"):
        kf.merge([tmp_path / "b"], tmp_path / "b" / ".." / "b", overwrite=True)
    # hard links of b's shards merged back into b: b's names go, the inodes stay
    kf.merge([tmp_path / "b"], tmp_path / "r", link="hardlink")
    kf.merge([tmp_path / "r"], tmp_path / "b", overwrite=True)
    assert kuat.open(tmp_path / "a").read_batch(range(10))["x"].tolist() == list(range(10))
    assert kf.verify(tmp_path / "a").ok and kf.verify(tmp_path / "b").ok


def test_merge_refuses_a_non_empty_directory_that_is_not_a_dataset(tmp_path):
    _write(tmp_path / "a", n=3)
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a kuat dataset"):
        kf.merge([tmp_path / "a"], out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    kf.merge([tmp_path / "a"], out, overwrite=True)  # asked for: written beside the file
    assert len(kuat.open(out)) == 3 and (out / "notes.txt").read_text() == "mine"


@pytest.mark.timeout(60)
def test_special_files_are_refused_without_blocking(tmp_path):
    """A manifest naming a FIFO (or a FIFO as manifest.json) must not block open or verify."""
    _write(tmp_path / "d", n=3, shard_bytes=10_000)
    m = _manifest(tmp_path / "d")
    m["shards"][0].update(file="fifo")
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(m))
    os.mkfifo(tmp_path / "d" / "fifo")
    with pytest.raises(FormatError, match="not a regular file"):
        kuat.open(tmp_path / "d")[0]
    report = kf.verify(tmp_path / "d")
    assert not report.ok and "not a regular file" in str(report.errors[0])
    os.mkdir(tmp_path / "d" / "sub")  # a directory
    m["shards"][0].update(file="sub")
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="not a regular file"):
        kuat.open(tmp_path / "d")[0]
    (tmp_path / "e").mkdir()
    os.mkfifo(tmp_path / "e" / "manifest.json")
    with pytest.raises(FormatError, match="not a regular file"):
        kuat.open(tmp_path / "e")
    m = _manifest(tmp_path / "d")
    m["schema"]["fields"][0]["metadata"] = ["not", "an", "object"]
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="field 'x': 'metadata' must be an object"):
        kuat.open(tmp_path / "d")


def test_merge_waits_for_no_writer_busy_in_its_output(tmp_path):
    _write(tmp_path / "a", n=3)
    w = kuat.Writer(tmp_path / "o", {"x": kf.int64()}, shard_bytes=8)
    w.write({"x": 1})
    w.write({"x": 2})  # a shard on disk
    with pytest.raises(FileExistsError, match="another kuat Writer"):
        kf.merge([tmp_path / "a"], tmp_path / "o", overwrite=True)
    w.close()
    assert kuat.open(tmp_path / "o").read_batch([0, 1])["x"].tolist() == [1, 2]
    kf.merge([tmp_path / "a"], tmp_path / "o", overwrite=True)
    assert len(kuat.open(tmp_path / "o")) == 3
    assert not (tmp_path / "o" / ".kuat-writer.lock").exists()


def test_open_wrong_path_says_what_to_do(tmp_path):
    # a newcomer's first mistakes: kuat.open on the raw ImageFolder, or on a file
    raw = tmp_path / "imagefolder" / "cat"
    raw.mkdir(parents=True)
    (raw / "0.jpg").write_bytes(b"")
    with pytest.raises(FormatError, match="kuat convert"):
        kuat.open(tmp_path / "imagefolder")
    (tmp_path / "f.arrow").write_bytes(b"x")
    with pytest.raises(FormatError, match="is a file"):
        kuat.open(tmp_path / "f.arrow")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are 3.11+")
def test_permanent_remote_error_names_the_url():
    from kuat.format.fs import retry

    def fail():
        raise PermissionError("Unable to locate credentials")

    with pytest.raises(PermissionError) as info:
        retry(fail, what="reading manifest", url="s3://bucket/x.kuat/manifest.json")
    assert "s3://bucket/x.kuat/manifest.json" in "".join(getattr(info.value, "__notes__", []))


@pytest.mark.parametrize("remote", [False, True], ids=["path", "url"])
def test_verify_reports_a_shard_it_cannot_read_and_goes_on(tmp_path, monkeypatch, remote):
    # local and remote verify share one per-shard error rule: an OSError reading shard k
    # becomes a FormatError naming that shard (cause chained), every shard is still counted
    verify_mod = importlib.import_module("kuat.format.verify")  # kf.verify is the function

    ds = _write(tmp_path / "d")
    assert ds.num_shards >= 3
    real_open, calls = verify_mod.open_shard, []

    def flaky_open(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(verify_mod, "open_shard", flaky_open)
    seen = []
    root = f"file://{tmp_path}/d" if remote else tmp_path / "d"
    report = kf.verify(root, on_shard=lambda k, where: seen.append((k, where)))
    manifest = _manifest(tmp_path / "d")
    files = [s["file"] for s in manifest["shards"]]
    assert [k for k, _ in seen] == list(range(len(files)))
    assert [os.path.basename(str(w)) for _, w in seen] == files
    assert report.shards == len(files)
    assert report.bytes == sum(s["bytes"] for s in manifest["shards"])
    assert len(report.errors) == 1
    (err,) = report.errors
    assert isinstance(err, FormatError) and isinstance(err.__cause__, OSError)
    assert err.path == seen[1][1] and f"cannot read shard {seen[1][1]}:" in str(err)
