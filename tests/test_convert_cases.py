"""Real-world inputs convert right or fail early, naming what is wrong (issues #18, #11.9-12).

Each test's expected values come from the reference reader (``json``, ``csv``, pyarrow,
Pillow, ``datasets``) in the same test.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _images import noise_image
from PIL import Image

import kuat
import kuat.convert
from kuat import format as kf
from kuat.convert import _tabular_files
from kuat.errors import DecodeError, FormatError, SchemaError


def _rows(path) -> list[dict]:
    ds = kuat.open(path)
    b = ds.read_batch(range(len(ds)))
    out = []
    for i in range(len(ds)):
        row = {}
        for name in ds.schema.names:
            v = b[name][i]
            row[name] = (
                v.tolist()
                if isinstance(v, np.ndarray)
                else (v.item() if isinstance(v, np.generic) else v)
            )
        out.append(row)
    return out


@pytest.fixture
def small_blocks(monkeypatch):
    """Reader blocks of 4 KiB, so that small files span many blocks."""
    monkeypatch.setattr(_tabular_files, "_JSON_BLOCK", 4096)
    monkeypatch.setattr(_tabular_files, "CSV_BLOCK", 4096)


# -- #18.3 reader limits ---------------------------------------------------------------------
def test_jsonl_record_larger_than_any_block(tmp_path):
    rows = [{"i": 0, "s": "a"}, {"i": 1, "s": "x" * (2 << 20)}, {"i": 2, "s": "b"}]
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kuat.convert.from_jsonl(path, tmp_path / "o", progress=False)
    with open(path) as f:
        expected = [json.loads(line) for line in f]
    assert _rows(tmp_path / "o") == expected


def test_jsonl_and_csv_of_many_blocks(tmp_path, small_blocks):
    rows = [{"i": i, "s": f"row {i}\nline two", "v": i / 4} for i in range(3000)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert os.path.getsize(tmp_path / "d.jsonl") > 20 * 4096
    kuat.convert.from_jsonl(tmp_path / "d.jsonl", tmp_path / "j", progress=False)
    with open(tmp_path / "d.jsonl") as f:
        assert _rows(tmp_path / "j") == [json.loads(line) for line in f]

    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["i", "s", "v"])
        w.writeheader()
        w.writerows(rows[:1500] + [{"i": 1500, "s": "y" * 50_000, "v": 0.5}] + rows[1501:])
    kuat.convert.from_csv(tmp_path / "d.csv", tmp_path / "c", progress=False)
    with open(tmp_path / "d.csv", newline="") as f:
        expected = [{"i": int(r["i"]), "s": r["s"], "v": float(r["v"])} for r in csv.DictReader(f)]
    assert _rows(tmp_path / "c") == expected


# -- #18.4 JSON arrays -----------------------------------------------------------------------
def test_json_array_detected_by_content(tmp_path):
    records = [{"text": f"t{i}", "label": i % 3, "score": [i, i + 0.5]} for i in range(7)]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records, indent=2))
    assert kuat.convert.detect_format(path)[0] == "jsonl"
    kuat.convert.convert(path, tmp_path / "a", progress=False)
    kuat.convert.from_jsonl(path, tmp_path / "b", progress=False, overwrite=True)
    with open(path) as f:
        expected = json.load(f)
    assert _rows(tmp_path / "a") == expected == _rows(tmp_path / "b")


def test_json_that_is_neither_says_what_was_expected(tmp_path):
    (tmp_path / "x.json").write_text('"just a string"')
    with pytest.raises(FormatError, match="neither JSON Lines .* nor a JSON array"):
        kuat.convert.from_jsonl(tmp_path / "x.json", tmp_path / "o", progress=False)
    (tmp_path / "y.json").write_text("[1, 2, 3]")
    with pytest.raises(FormatError, match="item 0 is not an object"):
        kuat.convert.from_jsonl(tmp_path / "y.json", tmp_path / "o", progress=False)


# -- #11.10 types over the whole input -------------------------------------------------------
def test_int_column_widens_to_float_after_many_blocks(tmp_path, small_blocks):
    n = 20_000
    lines = [json.dumps({"x": i if i < 15_000 else i + 0.5}) for i in range(n)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    kuat.convert.from_jsonl(tmp_path / "d.jsonl", tmp_path / "j", progress=False)
    ds = kuat.open(tmp_path / "j")
    assert ds.schema["x"].type == kf.float64()
    expected = [float(json.loads(line)["x"]) for line in lines]
    assert ds.read_batch(range(n))["x"].tolist() == expected

    import pyarrow.csv as pcsv

    (tmp_path / "d.csv").write_text(
        "x\n" + "".join(f"{i}\n" if i < 15_000 else f"{i + 0.5}\n" for i in range(n))
    )
    kuat.convert.from_csv(tmp_path / "d.csv", tmp_path / "c", progress=False)
    ref = pcsv.read_csv(tmp_path / "d.csv")  # pyarrow infers over the whole file
    ds = kuat.open(tmp_path / "c")
    assert ds.schema["x"].type == kf.float64() and ref.schema.field("x").type == pa.float64()
    np.testing.assert_array_equal(ds.read_batch(range(n))["x"], ref["x"].to_numpy())


def test_types_unify_across_files_and_nulls(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"x": 1, "y": null}\n{"x": 2, "y": null}\n')
    (tmp_path / "b.jsonl").write_text('{"x": 2.5, "y": "s"}\n')
    (tmp_path / "c.jsonl").write_text('{"x": 3, "y": "t"}\n')
    with pytest.raises(SchemaError, match=r"'y' of .*a.jsonl has a null at row 0"):
        kuat.convert.from_jsonl(str(tmp_path / "*.jsonl"), tmp_path / "o", progress=False)
    report = kuat.convert.from_jsonl(
        str(tmp_path / "*.jsonl"), tmp_path / "o", progress=False, on_error="skip"
    )
    assert report.rows == 2 and [s for s, _ in report.skipped] == [
        f"{tmp_path / 'a.jsonl'} row 0",
        f"{tmp_path / 'a.jsonl'} row 1",
    ]
    ds = kuat.open(tmp_path / "o")
    assert ds.schema["x"].type == kf.float64() and ds.schema["y"].type == kf.string()
    assert _rows(tmp_path / "o") == [{"x": 2.5, "y": "s"}, {"x": 3.0, "y": "t"}]


def test_real_type_conflict_names_column_file_and_row(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"x": 1}\n{"x": 2}\n')
    (tmp_path / "b.jsonl").write_text('{"x": null}\n{"x": "oops"}\n')
    with pytest.raises(SchemaError, match=r"column 'x' holds string values at .*b.jsonl row 1"):
        kuat.convert.from_jsonl(str(tmp_path / "*.jsonl"), tmp_path / "o", progress=False)


# -- #18.5 the source's presentation ---------------------------------------------------------
def test_from_hf_reads_arrow_whatever_the_format(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {
            "x": list(range(20)),
            "v": [[i, i + 1] for i in range(20)],
            "s": [f"s{i}" for i in range(20)],
        }
    )
    view = ds.shuffle(seed=3).filter(lambda e: e["x"] % 3 != 0).with_format("torch")
    kuat.convert.from_hf(view, tmp_path / "o", progress=False)
    expected = [dict(r) for r in view.with_format(None)]
    assert _rows(tmp_path / "o") == expected


# -- #18.6 / #18.7 column types and label names ----------------------------------------------
def test_dictionary_and_view_columns_become_strings_with_categories(tmp_path):
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"c": pd.Categorical(["b", "a", "b", "c"], categories=["a", "b", "c", "z"])})
    df.to_parquet(tmp_path / "cat.parquet")
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "cat.parquet").field("c").type)
    kuat.convert.from_parquet(tmp_path / "cat.parquet", tmp_path / "o", progress=False)
    ds = kuat.open(tmp_path / "o")
    assert ds.schema["c"].type == kf.string()
    assert ds.read_batch(range(4))["c"] == df["c"].astype(str).tolist()
    used = pq.read_table(tmp_path / "cat.parquet").column("c").combine_chunks().dictionary
    assert ds.schema["c"].metadata["categories"] == used.to_pylist()

    from kuat.convert._driver import ConvertOptions, converting
    from kuat.convert._table import TableBatch, write_batches
    from kuat.convert._table_fields import arrow_field
    from kuat.convert._table_types import logical_type

    batch = pa.record_batch(
        {
            "sv": pa.array(["x", "yy"], pa.string_view()),
            "ll": pa.array([[1, 2], []], pa.large_list(pa.int32())),
            "empty": pa.array([[], []], pa.list_(pa.null())),
        }
    )
    fields = [(arrow_field(f.name, f.type), logical_type(f.type)) for f in batch.schema]
    opts = ConvertOptions(progress=False)
    with converting(tmp_path / "v", kf.Schema([f for f, _ in fields]), opts) as (w, report):
        write_batches(w, fields, [TableBatch(batch, "mem", 0)], opts, report)
    assert _rows(tmp_path / "v") == [
        {"sv": "x", "ll": [1, 2], "empty": []},
        {"sv": "yy", "ll": [], "empty": []},
    ]


def test_lists_of_strings_become_strings_fields_in_every_arrow_variant(tmp_path):
    values = [["a", "bé"], [], ["c", "", "d—"]]
    table = pa.table(
        {
            "plain": pa.array(values, pa.list_(pa.string())),
            "large": pa.array(values, pa.large_list(pa.large_string())),
            "dict": pa.array(values, pa.list_(pa.string())).cast(
                pa.list_(pa.dictionary(pa.int32(), pa.string()))
            ),
            "fixed": pa.array([["x", "y"], ["z", "w"], ["", "v"]], pa.list_(pa.string(), 2)),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    kuat.convert.from_parquet(tmp_path / "t.parquet", tmp_path / "o", progress=False)
    ds = kuat.open(tmp_path / "o")
    assert all(f.type == kf.strings() for f in ds.schema)
    assert _rows(tmp_path / "o") == pq.read_table(tmp_path / "t.parquet").to_pylist()


def test_nested_lists_are_refused_naming_the_column(tmp_path):
    pq.write_table(pa.table({"nest": [[[1], [2, 3]], [[4]]]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match="column 'nest' holds nested lists.*flatten"):
        kuat.convert.from_parquet(tmp_path / "n.parquet", tmp_path / "o", progress=False)
    pq.write_table(pa.table({"nest": [[["a"], ["b", "c"]]]}), tmp_path / "s.parquet")
    with pytest.raises(ValueError, match="column 'nest' holds nested lists"):
        kuat.convert.from_parquet(tmp_path / "s.parquet", tmp_path / "o", progress=False)
    pq.write_table(pa.table({"raw": [[b"a", b"b"]]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="column 'raw' is a list of byte strings"):
        kuat.convert.from_parquet(tmp_path / "b.parquet", tmp_path / "o", progress=False)


def test_class_label_names_travel_through_parquet_and_hf(tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {
            "label": datasets.ClassLabel(names=["cat", "dog"]),
            "ner": datasets.Sequence(datasets.ClassLabel(names=["O", "B-PER", "I-PER"])),
        }
    )
    ds = datasets.Dataset.from_dict(
        {"label": [0, 1, 1], "ner": [[0, 1, 2], [0], []]}, features=features
    )
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ref = datasets.load_dataset(
        "parquet",
        data_files=str(tmp_path / "d.parquet"),
        split="train",
        cache_dir=str(tmp_path / "cache"),
    )
    for dst, convert in (
        ("p", lambda d: kuat.convert.from_parquet(tmp_path / "d.parquet", d, progress=False)),
        ("h", lambda d: kuat.convert.from_hf(ds, d, progress=False)),
    ):
        convert(tmp_path / dst)
        out = kuat.open(tmp_path / dst)
        assert out.schema["label"].metadata["names"] == ref.features["label"].names
        assert out.schema["ner"].metadata["names"] == ref.features["ner"].feature.names
        assert out.schema["ner"].type == kf.sequence("int64")
        assert _rows(tmp_path / dst) == [dict(r) for r in ref]
    assert kuat.open(tmp_path / "p").metadata["hf_features"]["label"]["names"] == ["cat", "dog"]


# -- #18.8 nulls inside lists ----------------------------------------------------------------
@pytest.mark.parametrize("value_type", [pa.float32(), pa.int64()])
def test_nulls_inside_lists_follow_the_null_rule(tmp_path, value_type):
    t = pa.table({"v": pa.array([[1, 2], [1, None, 3], [4]], pa.list_(value_type))})
    pq.write_table(t, tmp_path / "l.parquet")
    with pytest.raises(SchemaError, match=r"'v' of .*l.parquet has a null at row 1"):
        kuat.convert.from_parquet(tmp_path / "l.parquet", tmp_path / "o", progress=False)
    report = kuat.convert.from_parquet(
        tmp_path / "l.parquet", tmp_path / "o", progress=False, on_error="skip"
    )
    assert [s for s, _ in report.skipped] == [f"{tmp_path / 'l.parquet'} row 1"]
    ref = pq.read_table(tmp_path / "l.parquet").column("v").to_pylist()
    assert [r["v"] for r in _rows(tmp_path / "o")] == [ref[0], ref[2]]


# -- #18.9 duplicate WebDataset members ------------------------------------------------------
def test_webdataset_duplicate_member_is_an_error(tmp_path):
    path = tmp_path / "s.tar"
    members = [
        ("s000.cls", b"1"),
        ("s000.txt", b"a"),
        ("s001.cls", b"2"),
        ("s001.cls", b"3"),
        ("s001.txt", b"b"),
        ("s002.cls", b"4"),
        ("s002.txt", b"c"),
    ]
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:  # the reference reader sees both members
        assert [m.name for m in tar.getmembers()].count("s001.cls") == 2
    with pytest.raises(SchemaError, match=r"s.tar:s001\.cls"):
        kuat.convert.from_webdataset(path, tmp_path / "o", progress=False)
    report = kuat.convert.from_webdataset(path, tmp_path / "o", progress=False, on_error="skip")
    assert report.rows == 2 and report.skipped[0][0].endswith("s.tar:s001")
    assert [r["cls"] for r in _rows(tmp_path / "o")] == [1, 4]


# -- #18.10 delimiters -----------------------------------------------------------------------
def test_tsv_is_detected_and_delimiter_is_an_option(tmp_path):
    rows = [["a", "b"], ["1", "x,y"], ["2", "z"]]
    with open(tmp_path / "d.tsv", "w", newline="") as f:
        csv.writer(f, delimiter="\t").writerows(rows)
    kuat.convert.convert(tmp_path / "d.tsv", tmp_path / "t", progress=False)
    with open(tmp_path / "d.tsv", newline="") as f:
        ref = list(csv.DictReader(f, delimiter="\t"))
    assert _rows(tmp_path / "t") == [{"a": int(r["a"]), "b": r["b"]} for r in ref]
    with open(tmp_path / "d.txt", "w", newline="") as f:
        csv.writer(f, delimiter="|").writerows(rows)
    kuat.convert.from_csv(tmp_path / "d.txt", tmp_path / "p", progress=False, delimiter="|")
    assert _rows(tmp_path / "p") == _rows(tmp_path / "t")
    with pytest.raises(ValueError, match="delimiter"):
        kuat.convert.from_csv(tmp_path / "d.txt", tmp_path / "q", delimiter="||")


# -- #11.9 truncated images ------------------------------------------------------------------
def _jpeg(seed: int) -> bytes:
    return noise_image(64, 48, seed, quality=90)


def _png(seed: int) -> bytes:
    return noise_image(64, 48, seed, "PNG")



@pytest.mark.parametrize("fmt", ["jpg", "png"])
def test_truncated_images_are_caught_at_ingest_and_by_verify(tmp_path, fmt):
    make = _jpeg if fmt == "jpg" else _png
    root = tmp_path / "src" / "c"
    root.mkdir(parents=True)
    good, cut = make(0), make(1)
    cut = cut[: len(cut) // 3]
    (root / f"a.{fmt}").write_bytes(good)
    (root / f"b.{fmt}").write_bytes(cut)
    with pytest.raises(OSError, match="truncated"):  # Pillow, what training would hit
        Image.open(io.BytesIO(cut)).load()
    with pytest.raises(DecodeError, match=rf"truncated .*b\.{fmt}"):
        kuat.convert.from_imagefolder(tmp_path / "src", tmp_path / "o", progress=False)
    report = kuat.convert.from_imagefolder(
        tmp_path / "src", tmp_path / "o", progress=False, on_error="skip"
    )
    assert report.rows == 1 and report.skipped[0][0].endswith(f"b.{fmt}")

    # a dataset written before the check: verify --decode finds the bad row
    schema = kf.Schema([kf.Field("image", kf.image())])
    with kf.Writer(tmp_path / "old", schema) as w:
        for data in (good, cut):
            w.write({"image": kf.EncodedImage(data, 64, 48, "jpeg" if fmt == "jpg" else "png")})
    assert kf.verify(tmp_path / "old").ok  # checksums alone cannot know
    bad = kf.verify(tmp_path / "old", decode=True)
    assert not bad.ok and bad.errors[0].row == 1 and "truncated" in str(bad.errors[0])
    cli = subprocess.run(
        [sys.executable, "-m", "kuat.cli", "verify", str(tmp_path / "old"), "--decode"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert cli.returncode == 1 and "row 1" in cli.stdout


def test_corrupt_image_caught_by_decode_check(tmp_path):
    data = bytearray(_jpeg(2))
    dht = data.find(b"\xff\xc4")
    data[dht + 5 : dht + 25] = b"\xff" * 20  # a bogus Huffman table: complete, not decodable
    with pytest.raises(OSError):  # Pillow cannot decode it either
        Image.open(io.BytesIO(bytes(data))).load()
    pq.write_table(pa.table({"pic": [bytes(data)]}), tmp_path / "t.parquet")
    kuat.convert.from_parquet(  # header and end markers are fine: stored without decode_check
        tmp_path / "t.parquet", tmp_path / "o", image_fields=["pic"], progress=False
    )
    with pytest.raises(DecodeError):
        kuat.convert.from_parquet(
            tmp_path / "t.parquet",
            tmp_path / "o2",
            image_fields=["pic"],
            progress=False,
            decode_check=True,
        )
    assert not kf.verify(tmp_path / "o", decode=True).ok


# -- #11.12 progress lines -------------------------------------------------------------------
def test_cli_logs_progress_lines_when_stderr_is_not_a_terminal(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"i": i}) + "\n" for i in range(50)))
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "kuat.cli",
            "convert",
            str(tmp_path / "d.jsonl"),
            str(tmp_path / "o"),
            "--progress-interval",
            "0",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert cli.returncode == 0, cli.stderr
    lines = [ln for ln in cli.stderr.splitlines() if "convert jsonl:" in ln]
    assert lines and "50 samples" in lines[-1] and "samples/s" in lines[-1]


def test_hf_token_columns_round_trip_and_collate_as_torch(tmp_path):
    """A ``Sequence(Value("string"))`` token column (CoNLL-style) converts from the dataset
    and from its Parquet export; samples equal ``datasets``' rows and batches equal torch's
    ``default_collate`` of them, ragged batches failing alike."""
    datasets = pytest.importorskip("datasets")
    import torch.utils.data

    from kuat.collate import default_collate as kuat_collate

    features = datasets.Features(
        {
            "tokens": datasets.Sequence(datasets.Value("string")),
            "ner_tags": datasets.Sequence(datasets.ClassLabel(names=["O", "B-PER", "I-PER"])),
        }
    )
    hf = datasets.Dataset.from_dict(
        {
            "tokens": [["Peter", "Blackburn"], ["EU", "rejects"], [], ["Zoë", "—"]],
            "ner_tags": [[1, 2], [0, 0], [], [1, 0]],
        },
        features=features,
    )
    hf.to_parquet(str(tmp_path / "t.parquet"))
    kuat.convert.from_hf(hf, tmp_path / "hf", progress=False)
    kuat.convert.from_parquet(tmp_path / "t.parquet", tmp_path / "pq", progress=False)
    for out in ("hf", "pq"):
        ds = kuat.open(tmp_path / out)
        assert ds.schema["tokens"].type == kf.strings()
        assert ds.schema["ner_tags"].metadata == {"names": ["O", "B-PER", "I-PER"]}
        assert _rows(tmp_path / out) == [dict(r) for r in hf]
        assert [ds[i]["tokens"] for i in range(len(ds))] == hf["tokens"]
        assert ds.read_batch([3, 0])["tokens"] == [hf[3]["tokens"], hf[0]["tokens"]]
        even = [0, 1, 3]  # equal lengths: transposed into tuples of strings
        batch = kuat_collate([ds[i] for i in even])
        want = torch.utils.data.default_collate([hf[i] for i in even])
        assert batch["tokens"] == want["tokens"]
        with pytest.raises(RuntimeError) as theirs:
            torch.utils.data.default_collate([hf[i] for i in (0, 2)])
        with pytest.raises(RuntimeError, match=str(theirs.value)):
            kuat_collate([ds[i] for i in (0, 2)])
    empty = datasets.Dataset.from_dict(
        {"ids": [[], []], "x": [1, 2]},
        features=datasets.Features(
            {"ids": datasets.Sequence(datasets.Value("int32")), "x": datasets.Value("int64")}
        ),
    )
    kuat.convert.from_hf(empty, tmp_path / "e", progress=False)
    assert _rows(tmp_path / "e") == [dict(r) for r in empty]
    assert kuat.open(tmp_path / "e").schema["ids"].type == kf.sequence("int32")


def test_cli_reports_unreadable_input_without_a_traceback(tmp_path, capsys):
    from kuat.cli import main

    (tmp_path / "x.json").write_text("hello")
    assert main(["convert", str(tmp_path / "x.json"), str(tmp_path / "o"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "kuat convert: error:" in err and "neither JSON Lines" in err
    assert "Traceback" not in err


# -- issue #29: a decoder's own refusal types; names that are not UTF-8 ----------------------
@pytest.fixture
def pillow_pixel_limit(monkeypatch):
    """Pillow's decompression-bomb limit lowered so that a 64x48 PNG is over twice it:
    ``Image.open`` then raises ``DecompressionBombError``, which is not an ``OSError``."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)


def _bomb_sources(tmp_path, good, bomb):
    """The same two images as an ImageFolder, a WebDataset tar and a Parquet file."""
    folder = tmp_path / "folder" / "c"
    folder.mkdir(parents=True)
    (folder / "a.png").write_bytes(good)
    (folder / "b.png").write_bytes(bomb)
    tar_path = tmp_path / "w.tar"
    with tarfile.open(tar_path, "w") as tar:
        for key, data in (("a", good), ("b", bomb)):
            for ext, value in (("png", data), ("cls", b"0")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(value)
                tar.addfile(info, io.BytesIO(value))
    pq.write_table(pa.table({"pic": [good, bomb]}), tmp_path / "t.parquet")
    return {
        "imagefolder": lambda dst, **kw: kuat.convert.from_imagefolder(tmp_path / "folder", dst, **kw),
        "webdataset": lambda dst, **kw: kuat.convert.from_webdataset(str(tar_path), dst, **kw),
        "parquet": lambda dst, **kw: kuat.convert.from_parquet(
            tmp_path / "t.parquet", dst, image_fields=["pic"], **kw),
    }


@pytest.mark.parametrize("converter", ["imagefolder", "webdataset", "parquet"])
@pytest.mark.parametrize("decode_check", [False, True])
def test_a_decoder_refusal_is_a_decode_error_that_obeys_on_error(tmp_path, pillow_pixel_limit,
                                                                 converter, decode_check):
    good = noise_image(20, 20, 0, "PNG")  # 400 pixels: under the limit
    bomb = _png(1)  # 64 x 48 = 3072 pixels > 2 x 1000
    with pytest.raises(Image.DecompressionBombError) as pillow:  # the reference refuses it
        Image.open(io.BytesIO(bomb))
    assert not isinstance(pillow.value, OSError)
    convert = _bomb_sources(tmp_path, good, bomb)[converter]
    with pytest.raises(DecodeError, match=r"b\.png|row 1") as info:
        convert(tmp_path / "raised", progress=False, decode_check=decode_check)
    assert isinstance(info.value.__cause__, Image.DecompressionBombError)
    assert not any((tmp_path / "raised").glob("*"))  # no dataset, no shard (the Writer aborted)
    report = convert(tmp_path / "o", progress=False, decode_check=decode_check, on_error="skip")
    assert report.rows == 1 and len(report.skipped) == 1
    assert "DecompressionBombError" in report.skipped[0][1]
    field = "pic" if converter == "parquet" else "png" if converter == "webdataset" else "image"
    stored = kuat.open(tmp_path / "o")[0][field]
    with Image.open(io.BytesIO(good)) as im:
        want = np.asarray(im.convert("RGB"))
    assert np.array_equal(np.asarray(stored), want)  # (H, W, 3) uint8, as Pillow decodes it


def test_probe_image_names_the_source_of_a_refused_image(pillow_pixel_limit):
    with pytest.raises(DecodeError, match="DecompressionBombError.*x.png|x.png.*DecompressionBombError"):
        kuat.probe_image(_png(1), source="x.png")


@pytest.mark.skipif(sys.platform != "linux", reason="file names are bytes on Linux")
def test_names_that_are_not_utf8_convert_or_fail_before_writing(tmp_path):
    src = os.fsencode(tmp_path / "src")
    os.makedirs(src + b"/dog")
    (tmp_path / "src" / "dog" / "c.png").write_bytes(_png(0))
    with open(src + b"/dog/b\xff.png", "wb") as f:  # a file name (not stored by default)
        f.write(_png(1))
    # torchvision's ImageFolder order over the same tree (names as Python decodes them)
    torchvision = pytest.importorskip("torchvision")
    ref = torchvision.datasets.ImageFolder(os.fsdecode(src))
    report = kuat.convert.from_imagefolder(src, tmp_path / "o", progress=False)  # bytes src
    ds = kuat.open(tmp_path / "o")
    assert report.rows == len(ref) == 2
    for i, (path, label) in enumerate(ref.samples):
        with Image.open(path) as im:
            want = np.asarray(im.convert("RGB"))
        assert int(ds[i]["label"]) == label
        assert np.array_equal(np.asarray(ds[i]["image"]), want)
    # stored names must be UTF-8: refused before anything is written, naming the bytes
    with pytest.raises(ValueError, match=r"include_path.*b'.*/dog/b\\xff\.png' is not valid UTF-8"):
        kuat.convert.from_imagefolder(src, tmp_path / "p", include_path=True, progress=False)
    assert not (tmp_path / "p").exists()
    os.makedirs(src + b"/caf\xe9")
    os.rename(src + b"/dog/c.png", src + b"/caf\xe9/c.png")
    with pytest.raises(ValueError, match=r"class folder b'.*/caf\\xe9' is not valid UTF-8"):
        kuat.convert.from_imagefolder(src, tmp_path / "q", progress=False)
    assert not (tmp_path / "q").exists()

    # WebDataset: a key that is not UTF-8 is a SchemaError naming the sample (skippable); a
    # tar file name (stored in the metadata) is refused before writing
    tar_path = os.fsencode(tmp_path / "w.tar")
    members = [(b"a", b"0"), (b"k\xff", b"1"), (b"z", b"2")]
    with tarfile.open(tar_path, "w") as tar:
        for key, label in members:
            info = tarfile.TarInfo(os.fsdecode(key + b".cls"))
            info.size = len(label)
            tar.addfile(info, io.BytesIO(label))
    with tarfile.open(tar_path) as tar:  # the reference reader's keys
        keys = [m.name.split(".")[0] for m in tar.getmembers()]
    with pytest.raises(SchemaError, match=r"sample key b'k\\xff' is not valid UTF-8"):
        kuat.convert.from_webdataset(tar_path, tmp_path / "w1", progress=False)
    assert not any((tmp_path / "w1").glob("*"))  # the Writer aborted: no dataset
    report = kuat.convert.from_webdataset(tar_path, tmp_path / "w2", progress=False, on_error="skip")
    got = kuat.open(tmp_path / "w2")
    assert keys == ["a", "k\udcff", "z"]  # tarfile: the bad byte as a lone surrogate
    assert [got[i]["__key__"] for i in range(len(got))] == ["a", "z"]
    assert report.skipped[0][0].endswith("w.tar:k\udcff")
    assert [int(got[i]["cls"]) for i in range(len(got))] == [0, 2]
    bad_tar = os.fsencode(tmp_path) + b"/shard\xfe.tar"
    os.rename(tar_path, bad_tar)
    with pytest.raises(ValueError, match=r"'files' b'shard\\xfe.tar' is not valid UTF-8"):
        kuat.convert.from_webdataset(bad_tar, tmp_path / "w3", progress=False, on_error="skip")
    assert not (tmp_path / "w3").exists()

    # NumPy: the file stem names the field
    arr = np.arange(6, dtype=np.int64)
    np.save(os.fsdecode(os.fsencode(tmp_path) + b"/x\xfe.npy"), arr)
    with pytest.raises(ValueError, match=r"field name b'x\\xfe' is not valid UTF-8"):
        kuat.convert.from_numpy(os.fsencode(tmp_path) + b"/x\xfe.npy", tmp_path / "n", progress=False)
    assert not (tmp_path / "n").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="file names are bytes on Linux")
def test_table_files_whose_names_are_not_utf8_are_refused_naming_them(tmp_path):
    name = os.fsencode(tmp_path) + b"/t\xff"
    table = pa.table({"a": [1, 2]})
    with open(name + b".parquet", "wb") as f:
        pq.write_table(table, f)
    with open(name + b".csv", "wb") as f:
        f.write(b"a\n1\n2\n")
    for convert, ext in ((kuat.convert.from_parquet, b".parquet"), (kuat.convert.from_csv, b".csv")):
        with pytest.raises(ValueError, match=r"input file b'.*/t\\xff\..*' is not valid UTF-8"):
            convert(name + ext, tmp_path / "o", progress=False)
        assert not (tmp_path / "o").exists()
    # text records from a Parquet file: the name is not stored, so it converts (pyarrow's rows)
    pytest.importorskip("tokenizers")
    from kuat.text.corpus import train_bpe

    tok = train_bpe(["one two three"] * 10, vocab_size=300)
    with open(name + b".text.parquet", "wb") as f:
        pq.write_table(pa.table({"text": ["one two", "three"]}), f)
    kuat.convert.from_text(name + b".text.parquet", tmp_path / "t", tok, eos_id=0, progress=False)
    with open(name + b".text.parquet", "rb") as f:
        texts = pq.read_table(f).column("text").to_pylist()
    got = [np.asarray(kuat.open(tmp_path / "t")[i]["input_ids"]).tolist() for i in range(2)]
    assert got == [tok.encode(t, add_special_tokens=False).ids + [0] for t in texts]
