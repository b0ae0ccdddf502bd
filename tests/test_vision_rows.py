"""The rows path (``kuat.vision._rows``, ``_roijpeg.c`` ``plan_decode_rows``): a kuat dataset's
image rows to the finished batch in one C call gives the pixels of the per-image path (each
sample's ``Compose.apply_encoded`` from its own generator), across shards, with the samples the
C call leaves (PNG, CMYK, EXIF-rotated) and the errors of the views path (a corrupt JPEG, an image over
``max_pixels``);
bad rows and shard tables are refused with a clear error."""

import numpy as np
import pytest
from _images import photo_jpeg, planner_images, rrc_transforms

import kuat
import kuat.format as kf
from kuat import rng
from kuat.vision import Compose, RandomResizedCrop
from kuat.vision.steps import rrc_params

kdecode = pytest.importorskip("kuat.vision.decode")
import kuat.sources._rows_fetch as krf  # noqa: E402
import kuat.vision._rows as krows  # noqa: E402

roi = kdecode._roi
if getattr(roi, "plan_decode_rows", None) is None:
    pytest.skip("the ROI decoder predates plan_decode_rows", allow_module_level=True)

TRANSFORMS = rrc_transforms()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    imgs = planner_images() * 2
    p = tmp_path_factory.mktemp("rows") / "ds"
    with kuat.Writer(p, {"image": kf.image(), "label": kf.int64()}, shard_bytes=24 << 10) as w:
        w.write_batch({"image": imgs, "label": np.arange(len(imgs))})
    assert kuat.open(p).num_shards >= 4
    return p, imgs


def _per_image(t, imgs, widths, heights, idx, seed, epoch) -> np.ndarray:
    """Each sample's ``apply_encoded`` from its own generator: ``(B, 3, H, W)`` uint8."""
    out = np.zeros((len(idx), 3, *t.output_size()), np.uint8)
    with rng.epoch_context(seed, epoch):
        for j, i in enumerate(idx):
            t.apply_encoded(imgs[i], widths[i], heights[i], rng.sample_rng(i).numpy, out=out[j])
    return out


@pytest.mark.parametrize("t", TRANSFORMS, ids=repr)
@pytest.mark.parametrize("seed,epoch", [(0, 0), (2**63 + 5, 2**33)])
def test_the_rows_path_gives_the_per_image_pixels(dataset, t, seed, epoch, monkeypatch):
    path, imgs = dataset
    taken = []
    fill = krows._fill
    monkeypatch.setattr(krows, "_fill", lambda *a: taken.append(fill(*a)) or taken[-1])
    monkeypatch.setattr(krf, "rows_fetcher", lambda *a: None)  # (tests/test_rows_fetch.py)
    stored = kuat.open(path).read_batch(range(len(imgs)), ["image"])["image"]
    ds = kuat.open(path).with_transform({"image": t})  # its own store: no shard mapped yet
    idx = [5, 0, len(imgs) - 1, 14, 15, 16, 17, 18, 3, 3, 30, 7, 21]
    want = _per_image(t, imgs, stored.width.tolist(), stored.height.tolist(), idx, seed, epoch)
    for _ in range(2):
        with rng.epoch_context(seed, epoch):
            got = ds.kuat_fetch_collated(idx)
        np.testing.assert_array_equal(got["image"].numpy(), want)
        assert got["label"].tolist() == idx
    assert taken == [True, True]  # (the label's gather maps the batch's shards first)


def test_unmapped_shards_take_the_views_path_then_the_rows(dataset, tmp_path, monkeypatch):
    """An image-only dataset: its first batch finds the shards unmapped (the C call reports
    one, nothing written), the views path maps them; the next reads rows. Same pixels."""
    _, imgs = dataset
    with kuat.Writer(tmp_path / "d", {"image": kf.image()}, shard_bytes=24 << 10) as w:
        w.write_batch({"image": imgs})
    taken = []
    fill = krows._fill
    monkeypatch.setattr(krows, "_fill", lambda *a: taken.append(fill(*a)) or taken[-1])
    monkeypatch.setattr(krf, "rows_fetcher", lambda *a: None)  # (tests/test_rows_fetch.py)
    t = TRANSFORMS[0]
    stored = kuat.open(tmp_path / "d").read_batch(range(len(imgs)), ["image"])["image"]
    idx = [3, 20, 11, 0, 29]
    want = _per_image(t, imgs, stored.width.tolist(), stored.height.tolist(), idx, 5, 1)
    ds = kuat.open(tmp_path / "d").with_transform({"image": t})
    for _ in range(2):
        with rng.epoch_context(5, 1):
            np.testing.assert_array_equal(ds.kuat_fetch_collated(idx)["image"].numpy(), want)
    assert taken == [False, True]


def test_a_corrupt_jpeg_fails_the_batch_naming_it(dataset, tmp_path, monkeypatch):
    """A JPEG cut in its scan data: the C call leaves it, the per-image path raises the
    ``DecodeError`` the views path raises (the rows path off), naming the sample."""
    _, imgs = dataset
    cut = list(imgs)
    cut[9] = cut[9][: len(cut[9]) * 3 // 4]
    with kuat.Writer(tmp_path / "d", {"image": kf.image()}, shard_bytes=24 << 10) as w:
        w.write_batch({"image": cut})
    errors = []
    for rows in (True, False):
        if not rows:
            monkeypatch.setattr(krows, "rows_filler", lambda t: None)
        ds = kuat.open(tmp_path / "d").with_transform({"image": TRANSFORMS[0]})
        for k in range(ds.num_shards):
            ds._store.shard(k)  # mapped: the rows path takes the batch
        with pytest.raises(kuat.DecodeError) as e:
            ds.kuat_fetch_collated([1, 9, 2])
        errors.append((str(e.value), e.value.index))
    assert errors[0] == errors[1] and errors[0][1] == 9


def _entry(data: bytes, offsets, widths, heights):
    return (memoryview(data), np.array(offsets, np.int32), np.array(widths, np.int32),
            np.array(heights, np.int32))


def test_bad_rows_and_tables_are_refused():
    """A shard id or row out of range, offsets past the data, a malformed entry or sizes
    that do not fit: a clear error, nothing decoded; an unmapped shard: its id returned."""
    jpg = photo_jpeg(1)
    entry = _entry(jpg, [0, len(jpg)], [200], [150])
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    params = rrc_params(*TRANSFORMS[0]._c_plan, None)
    out = np.full((1, 3, 48, 48), 7, np.uint8)

    def call(table, sid, local, idx, o=out):
        return roi.plan_decode_rows(table, sid, local, idx, o, 48, 48, *params, 1, 2)

    assert call([entry], i64(0), i64(0), i64(0)) == ([], [])
    assert (out != 7).any()
    out[:] = 7
    assert call([entry, None], i64(1), i64(0), i64(0)) == 1 and (out == 7).all()
    with pytest.raises(ValueError, match="shard 2 of 2"):
        call([entry, None], i64(2), i64(0), i64(0))
    with pytest.raises(ValueError, match="shard -1"):
        call([entry], i64(-1), i64(0), i64(0))
    with pytest.raises(ValueError, match="row 1 outside shard 0"):
        call([entry], i64(0), i64(1), i64(0))
    with pytest.raises(ValueError, match="row 0 outside shard 0"):
        call([_entry(jpg, [0, len(jpg) + 1], [200], [150])], i64(0), i64(0), i64(0))
    with pytest.raises(ValueError, match="do not fit"):
        call([_entry(jpg, [0, len(jpg)], [], [150])], i64(0), i64(0), i64(0))
    with pytest.raises(TypeError, match="entry is"):
        call([(entry[0], entry[1])], i64(0), i64(0), i64(0))
    with pytest.raises(ValueError, match="int64 sid, local and idx"):
        call([entry], i64(0, 0), i64(0), i64(0))
    with pytest.raises(ValueError, match="uint8 out"):
        call([entry], i64(0), i64(0), i64(0), np.zeros((2, 3, 48, 48), np.uint8))
    assert (out == 7).all()
    # a zero stored size is left to the per-image path (which raises for it)
    assert call([_entry(jpg, [0, len(jpg)], [0], [150])], i64(0), i64(0), i64(0)) == ([0], [])


def test_an_image_over_max_pixels_fails_as_on_the_views_path(dataset, monkeypatch):
    """The C call leaves an image over ``max_pixels`` to the per-image path, which refuses it:
    the same ``DecodeError`` (message and sample) as with the rows path off."""
    path, imgs = dataset
    t = Compose([RandomResizedCrop(32)], max_pixels=30_000)
    errors = []
    for rows in (True, False):
        if not rows:
            monkeypatch.setattr(krows, "rows_filler", lambda t: None)
        ds = kuat.open(path).with_transform({"image": t})  # (a view decides its routes once)
        ds.kuat_fetch_collated([14, 16])  # small images: maps the shards
        with pytest.raises(kuat.DecodeError, match="max_pixels") as e:
            ds.kuat_fetch_collated([14, 2, 16, 4])
        errors.append((str(e.value), e.value.index))
    assert errors[0] == errors[1] and errors[0][1] == 2
