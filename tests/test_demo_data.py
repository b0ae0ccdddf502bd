import io

import numpy as np
import pytest
from PIL import Image

from kuat.demo_data import LONG_SIDE, SOURCES, build_demo_imagefolder, corpus_stats


def test_demo_imagefolder_is_imagenet_like_and_cached(tmp_path):
    out = build_demo_imagefolder(tmp_path, num_images=48, seed=3, progress=False)
    files = sorted(out.glob("*/*.jpg"))
    assert len(files) == 48
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(SOURCES)
    for f in files:
        data = f.read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            assert im.format == "JPEG"
            assert LONG_SIDE[0] <= max(im.size) <= LONG_SIDE[1]
            assert 0.5 - 0.01 <= im.size[0] / im.size[1] <= 2.0 + 0.01
            im.load()
    # second call reuses the tree (same files, untouched)
    mtimes = [f.stat().st_mtime_ns for f in files]
    again = build_demo_imagefolder(tmp_path, num_images=48, seed=3, progress=False)
    assert again == out
    assert [f.stat().st_mtime_ns for f in sorted(again.glob("*/*.jpg"))] == mtimes
    # no leftover temporary build directories
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_demo_imagefolder_same_seed_same_bytes(tmp_path):
    a = build_demo_imagefolder(tmp_path / "a", num_images=12, seed=1, progress=False)
    b = build_demo_imagefolder(tmp_path / "b", num_images=12, seed=1, progress=False)
    fa, fb = sorted(a.glob("*/*.jpg")), sorted(b.glob("*/*.jpg"))
    assert [f.read_bytes() for f in fa] == [f.read_bytes() for f in fb]


def test_demo_imagefolder_has_imagenet_size_and_bytes_per_pixel(tmp_path):
    # ImageNet-1k train: about 0.11-0.18 megapixels at 0.6-0.8 bytes per pixel
    out = build_demo_imagefolder(tmp_path, num_images=48, seed=0, progress=False)
    stats = corpus_stats(out)
    assert stats["images"] == 48 and stats["classes"] == len(SOURCES)
    assert 0.11 <= stats["megapixels"]["median"] <= 0.18
    assert 0.55 <= stats["bytes_per_pixel"]["median"] <= 0.85
    files = sorted(out.glob("*/*.jpg"))
    sizes = [f.stat().st_size for f in files]
    assert stats["total_mib"] == pytest.approx(sum(sizes) / 2**20)
    bpp = []
    for f, size in zip(files, sizes):
        with Image.open(f) as im:
            bpp.append(size / (im.width * im.height))
    assert stats["bytes_per_pixel"]["median"] == pytest.approx(float(np.median(bpp)))


def test_corpus_stats_rejects_a_tree_without_images(tmp_path):
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / "notes.txt").write_text("no images")
    with pytest.raises(ValueError, match="holds no"):
        corpus_stats(tmp_path)
