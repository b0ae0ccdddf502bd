import io

from PIL import Image

from kuat.cli.demo_data import SOURCES, build_demo_imagefolder


def test_demo_imagefolder_is_imagenet_like_and_cached(tmp_path):
    out = build_demo_imagefolder(tmp_path, num_images=48, seed=3, progress=False)
    files = sorted(out.glob("*/*.jpg"))
    assert len(files) == 48
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(SOURCES)
    for f in files:
        data = f.read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            assert im.format == "JPEG"
            assert 300 <= max(im.size) <= 900
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
