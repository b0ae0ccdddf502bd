"""ImageFolder -> kuat: torchvision's classes and order, original bytes, resize, error policy."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
from _images import noise_image
from PIL import Image, ImageOps

import kuat
import kuat.convert
from kuat.errors import DecodeError


def _jpeg(w: int, h: int, seed: int, orientation: int | None = None) -> bytes:
    if orientation is None:
        return noise_image(w, h, seed, quality=90)
    exif = Image.Exif()
    exif[0x0112] = orientation  # EXIF Orientation
    return noise_image(w, h, seed, quality=90, exif=exif)


def _png(w: int, h: int, seed: int) -> bytes:
    return noise_image(w, h, seed, "PNG")


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "train"
    files = {
        "zebra/b.jpg": _jpeg(20, 12, 1),
        "zebra/a.JPEG": _jpeg(12, 20, 2),
        "ant/x.png": _png(9, 7, 3),
        "ant/sub/y.jpg": _jpeg(16, 16, 4),
        "ant/sub/deeper/z.webp": None,
        "moth/rot.jpg": _jpeg(30, 10, 5, orientation=6),  # displayed 10 wide, 30 high
    }
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if data is None:
            buf = io.BytesIO()
            Image.new("RGB", (5, 6), (1, 2, 3)).save(buf, "WEBP", lossless=True)
            data = buf.getvalue()
        p.write_bytes(data)
    (root / "ant" / "notes.txt").write_text("not an image")
    (root / "empty").mkdir()
    (root / "stray.jpg").write_bytes(_jpeg(4, 4, 9))  # files at the root are not a class
    return root


def test_matches_torchvision_imagefolder(tree, tmp_path):
    datasets = pytest.importorskip("torchvision.datasets")
    report = kuat.convert.from_imagefolder(tree, tmp_path / "out", num_workers=3, progress=False)
    tv = datasets.ImageFolder(str(tree), allow_empty=True)
    ds = kuat.open(tmp_path / "out")
    assert report.rows == len(tv.samples) == len(ds) == 6
    assert ds.metadata["classes"] == tv.classes == ["ant", "empty", "moth", "zebra"]
    assert ds.metadata["class_to_idx"] == tv.class_to_idx
    assert ds.schema["label"].metadata == {"names": tv.classes}
    assert ds.schema["label"].type == kuat.format.int64()
    for i, (path, target) in enumerate(tv.samples):
        raw = ds.raw(i)
        assert raw["label"] == target
        with open(path, "rb") as f:
            assert raw["image"].data == f.read()  # original bytes kept
        decoded = ds[i]["image"]
        assert decoded.shape == (raw["image"].height, raw["image"].width, 3)
        # same pixels as torchvision's PIL loader, plus EXIF orientation (which it ignores)
        np.testing.assert_array_equal(decoded, np.asarray(ImageOps.exif_transpose(tv[i][0])))
    rot = ds.raw(3)["image"]
    assert tv.samples[3][0].endswith("rot.jpg")
    assert (rot.width, rot.height) == (10, 30)  # oriented size, as decode_image returns


def test_worker_count_does_not_change_the_result(tree, tmp_path):
    kuat.convert.from_imagefolder(tree, tmp_path / "a", num_workers=1, progress=False)
    kuat.convert.from_imagefolder(tree, tmp_path / "b", num_workers=4, progress=False)
    a, b = kuat.open(tmp_path / "a"), kuat.open(tmp_path / "b")
    assert [a.raw(i) for i in range(len(a))] == [b.raw(i) for i in range(len(b))]


def test_resize_shorter_reencodes_only_large_images(tree, tmp_path):
    kuat.convert.from_imagefolder(
        tree, tmp_path / "r", resize_shorter=10, quality=95, progress=False, include_path=True
    )
    ds = kuat.open(tmp_path / "r")
    by_path = {ds.raw(i)["path"]: ds.raw(i) for i in range(len(ds))}
    big = by_path["zebra/b.jpg"]["image"]  # 20x12 -> 17x10 (12 -> 10, 20 * 10/12 = 16.7)
    assert (big.width, big.height, big.codec) == (17, 10, "jpeg")
    tall = by_path["zebra/a.JPEG"]["image"]
    assert (tall.width, tall.height) == (10, 17)
    rot = by_path["moth/rot.jpg"]["image"]  # oriented 10x30: shorter side already 10
    assert (rot.width, rot.height) == (10, 30)
    assert by_path["ant/x.png"]["image"].data == (tree / "ant" / "x.png").read_bytes()
    for i in range(len(ds)):
        raw = ds.raw(i)["image"]
        assert ds[i]["image"].shape == (raw.height, raw.width, 3)
    # resized pixels stay close to the source's (a smooth image survives resize + JPEG)
    src = np.asarray(Image.open(tree / "zebra" / "b.jpg").convert("RGB").resize((17, 10)))
    got = ds[[k for k in range(len(ds)) if ds.raw(k)["path"] == "zebra/b.jpg"][0]]["image"]
    assert np.abs(got.astype(int) - src.astype(int)).mean() < 40


def test_unreadable_image_raises_naming_the_path(tree, tmp_path):
    bad = tree / "moth" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(DecodeError, match="broken.jpg"):
        kuat.convert.from_imagefolder(tree, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_skip_reports_every_skipped_path(tree, tmp_path, caplog):
    (tree / "moth" / "broken.jpg").write_bytes(b"garbage")
    (tree / "ant" / "empty.png").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="kuat.convert"):
        report = kuat.convert.from_imagefolder(
            tree, tmp_path / "out", on_error="skip", progress=False
        )
    assert report.rows == 6 and len(kuat.open(tmp_path / "out")) == 6
    skipped = sorted(p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1] for p, _ in report.skipped)
    assert skipped == ["ant/empty.png", "moth/broken.jpg"]
    assert "skipped 2 unreadable sample(s)" in caplog.text


def test_truncated_jpeg_is_caught_with_decode_check(tree, tmp_path):
    data = (tree / "zebra" / "b.jpg").read_bytes()
    (tree / "zebra" / "c.jpg").write_bytes(data[: len(data) // 2])
    report = kuat.convert.from_imagefolder(
        tree, tmp_path / "out", on_error="skip", decode_check=True, progress=False
    )
    assert [p.rsplit("/", 1)[-1] for p, _ in report.skipped] == ["c.jpg"]


def test_refuses_existing_dataset_and_bad_options(tree, tmp_path):
    kuat.convert.from_imagefolder(tree, tmp_path / "out", progress=False)
    with pytest.raises(FileExistsError):
        kuat.convert.from_imagefolder(tree, tmp_path / "out", progress=False)
    kuat.convert.from_imagefolder(tree, tmp_path / "out", progress=False, overwrite=True)
    with pytest.raises(ValueError, match="on_error"):
        kuat.convert.from_imagefolder(tree, tmp_path / "x", on_error="ignore")
    with pytest.raises(ValueError, match="inside"):
        kuat.convert.from_imagefolder(tree, tree / "out.kuat")
    with pytest.raises(FileNotFoundError, match="no class folders"):
        kuat.convert.from_imagefolder(tree / "empty", tmp_path / "y")


def test_imagefolder_without_images_is_refused(tmp_path, caplog):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "readme.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"no images .*\.jpg"):
        kuat.convert.from_imagefolder(tmp_path / "src", tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()  # no empty dataset written
    with pytest.raises(ValueError, match="no class folder holds images"):
        kuat.convert.detect_format(tmp_path / "src")
    # some empty classes: converted (as torchvision with allow_empty), and said once
    (tmp_path / "src" / "b").mkdir()
    (tmp_path / "src" / "b" / "x.png").write_bytes(_png(3, 3, 0))
    kuat.convert.from_imagefolder(tmp_path / "src", tmp_path / "o", progress=False)
    assert len(kuat.open(tmp_path / "o")) == 1
    assert any("hold no images: a" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("chunk", [1, 16])
def test_parallel_map_keeps_order_and_error_policy_across_chunks(chunk):
    """Items travel to the threads in chunks: order, skip records and the first error
    raised are still those of a plain loop over the items."""
    from kuat.convert._driver import ConvertOptions, ConvertReport, parallel_map
    from kuat.errors import DecodeError

    n = 5 * chunk + 10
    bad = {3, chunk + 4, 2 * chunk + 7}

    def fn(i):
        if i in bad:
            raise OSError(f"unreadable {i}")
        return i * i

    report = ConvertReport("x")
    opts = ConvertOptions(num_workers=3, progress=False, on_error="skip")
    got = parallel_map(
        fn, range(n), opts, source_of=lambda i: f"item{i}", report=report, chunk_size=chunk
    )
    assert list(got) == [i * i for i in range(n) if i not in bad]
    assert [s for s, _ in report.skipped] == [f"item{i}" for i in sorted(bad)]
    opts = ConvertOptions(num_workers=3, progress=False)
    with pytest.raises(DecodeError, match="cannot read 3: unreadable 3"):
        list(parallel_map(fn, range(n), opts, chunk_size=chunk))
    with pytest.raises(ValueError, match="chunk_size=0"):
        list(parallel_map(fn, range(n), opts, chunk_size=0))
