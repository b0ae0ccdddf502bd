"""A kuat dataset's batch in one C call (``kuat.sources._rows_fetch``, ``_roijpeg.c``
``fetch_rows``): the same batch as the general collated path (the columnar gather, then the
rows path or the per-image path) for every view it takes, across shards, with the samples the
C planner leaves (PNG, CMYK, EXIF-rotated, progressive), the errors of the general path, and
every index the general path refuses or wraps left to it; labels as torch's ``default_collate``
of the samples; and the loader's pool never reusing memory a caller still holds."""

import gc

import numpy as np
import pytest
import torch
from _images import photo_jpeg, planner_images, rrc_transforms
from _same import assert_same

import kuat
import kuat.format as kf
from kuat import _parallel, rng
from kuat._buffers import BufferPool, batch_scope
from kuat.vision import Compose, RandomHorizontalFlip, RandomResizedCrop

kdecode = pytest.importorskip("kuat.vision.decode")
if getattr(kdecode._roi, "fetch_rows", None) is None:
    pytest.skip("the ROI decoder predates fetch_rows", allow_module_level=True)

import kuat.sources._rows_fetch as krf  # noqa: E402

TRANSFORMS = rrc_transforms()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Images with every fixed-size field kind the one call takes (several shards)."""
    imgs = planner_images() * 2
    n = len(imgs)
    g = np.random.default_rng(0)
    p = tmp_path_factory.mktemp("rowsfetch") / "ds"
    schema = {"image": kf.image(), "label": kf.int64(), "weight": kf.float64(),
              "flag": kf.bool_(), "box": kf.tensor((2, 2), "float32")}
    with kuat.Writer(p, schema, shard_bytes=24 << 10) as w:
        w.write_batch({"image": imgs, "label": np.arange(n) * 7, "weight": g.standard_normal(n),
                       "flag": g.integers(0, 2, n).astype(bool),
                       "box": g.standard_normal((n, 2, 2)).astype(np.float32)})
    assert kuat.open(p).num_shards >= 4
    return p, n


class Taken:
    """Counts the batches the one call took (returned a batch for)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = krf.RowsFetch.__call__

        def call(fetch, indices):
            out = real(fetch, indices)
            self.n += out is not None
            return out

        monkeypatch.setattr(krf.RowsFetch, "__call__", call)


def _general(path, t, monkeypatch):
    """A view of ``path`` whose batches take the general path (no one-call fetcher)."""
    with monkeypatch.context() as m:
        m.setattr(krf, "rows_fetcher", lambda *a: None)
        ds = kuat.open(path).with_transform({"image": t})
        ds._collated_routes()  # decided now, without the fetcher
    return ds


def _mapped(ds):
    for k in range(ds.num_shards):
        ds._store.shard(k)
    return ds


@pytest.mark.parametrize("t", TRANSFORMS, ids=repr)
@pytest.mark.parametrize("seed,epoch", [(0, 0), (2**63 + 5, 2**33)])
@pytest.mark.parametrize("pooled", [False, True])
def test_the_one_call_gives_the_general_paths_batch(dataset, t, seed, epoch, pooled, monkeypatch):
    path, n = dataset
    general = _general(path, t, monkeypatch)
    taken = Taken(monkeypatch)
    ds = _mapped(kuat.open(path).with_transform({"image": t}))
    idx = [5, 0, n - 1, 14, 15, 16, 17, 3, 3, 30, 7, 21]  # PNG, EXIF, progressive, CMYK among them
    pool = BufferPool() if pooled else None
    for _ in range(3):  # (pooled: the later batches take ready tensors)
        with rng.epoch_context(seed, epoch), batch_scope(pool):
            got = ds.kuat_fetch_collated(idx)
            want = general.kuat_fetch_collated(idx)
        assert_same(got, want)
        samples = [{k: v for k, v in general[i].items() if k != "image"} for i in idx]
        labels = torch.utils.data.default_collate(samples)  # torch's collate of the samples
        assert_same({k: got[k] for k in labels}, labels)
        del got
        gc.collect()
    assert taken.n == 3
    if pooled:  # the fixed fields' arrays came back as ready (tensor, array) pairs
        assert {shape for shape, _ in pool._ready} >= {(len(idx),), (len(idx), 2, 2)}


def test_views_it_cannot_take_have_no_fetcher(dataset, tmp_path):
    path, _ = dataset
    t = TRANSFORMS[0]
    ok = kuat.open(path).with_transform({"image": t})
    assert ok._collated_routes()[3] is not None
    # a whole-sample transform, a transform without the rows path, no image transform
    assert kuat.open(path).with_transform(lambda s: s)._collated_routes()[3] is None
    assert kuat.open(path).with_transform(
        {"image": Compose([RandomResizedCrop(48)], exact_resize=True)}
    )._collated_routes()[3] is not None  # (decided per batch: exact_resize is never taken)
    assert kuat.open(path)._collated_routes()[3] is None
    # a field the C gather does not collate as stored (float32 scalar: collated as float64),
    # a string field, two image fields
    for extra, value in ((kf.float32(), np.zeros(2, np.float32)), (kf.string(), ["a", "b"]),
                         (kf.image(), [photo_jpeg(1)] * 2)):  # fmt: skip
        p = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        with kuat.Writer(p, {"image": kf.image(), "x": extra}) as w:
            w.write_batch({"image": [photo_jpeg(0)] * 2, "x": value})
        tr = {"image": t, "x": t} if extra.kind == "image" else {"image": t}
        assert kuat.open(p).with_transform(tr)._collated_routes()[3] is None


def test_fields_with_a_transform_or_uint64_are_not_taken(tmp_path, monkeypatch):
    """A label's or tensor's own transform and a uint64 scalar (collated as Python ints, to
    int64) are not fields collated as stored: the general path's batch, not the stored
    values."""
    p = tmp_path / "d"
    with kuat.Writer(p, {"image": kf.image(), "label": kf.int64(), "u": kf.uint64(),
                         "box": kf.tensor((2,), "float32")}) as w:
        w.write_batch({"image": [photo_jpeg(k) for k in range(3)], "label": np.arange(3),
                       "u": np.arange(3, dtype=np.uint64), "box": np.ones((3, 2), np.float32)})
    t = TRANSFORMS[0]
    for tr in ({"image": t, "label": lambda x: x + 100}, {"image": t, "box": lambda x: x * 2},
               {"image": t}):  # fmt: skip
        ds = _mapped(kuat.open(p).with_transform(tr))
        with monkeypatch.context() as m:
            m.setattr(krf, "rows_fetcher", lambda *a: None)
            general = _mapped(kuat.open(p).with_transform(tr))
            general._collated_routes()
        with rng.epoch_context(2, 0):
            got, want = ds.kuat_fetch_collated([2, 0]), general.kuat_fetch_collated([2, 0])
        assert_same(got, want)
        assert got["u"].dtype == torch.int64
    assert (got["label"] == torch.tensor([2, 0])).all()


def test_exact_resize_takes_the_general_path(dataset, monkeypatch):
    path, _ = dataset
    taken = Taken(monkeypatch)
    t = Compose([RandomResizedCrop(48), RandomHorizontalFlip()], exact_resize=True)
    general = _general(path, t, monkeypatch)
    ds = _mapped(kuat.open(path).with_transform({"image": t}))
    with rng.epoch_context(1, 2):
        assert_same(ds.kuat_fetch_collated([1, 2, 3]), general.kuat_fetch_collated([1, 2, 3]))
    assert taken.n == 0


@pytest.mark.parametrize("width", [2, 3, 64])
def test_a_split_fetch_is_taken_with_the_same_batch_and_its_helpers_counted(
        dataset, width, monkeypatch):
    """An epoch's first batch, given a width (kuat._parallel): its decodes shared by helper
    threads inside the call (64: more threads than rows), the general path's batch all the
    same (PNG, EXIF, progressive and CMYK samples among them, left to the per-image path),
    and the helpers' seconds added to the calling thread's helper totals, as run_parts'."""
    path, n = dataset
    t = TRANSFORMS[0]
    general = _general(path, t, monkeypatch)
    taken = Taken(monkeypatch)
    ds = _mapped(kuat.open(path).with_transform({"image": t}))
    idx = [5, 0, n - 1, 14, 15, 16, 17, 3, 3, 30, 7, 21]
    with rng.epoch_context(3, 1):
        want = general.kuat_fetch_collated(idx)
    for w in (1, width):
        h0 = _parallel.helper_totals()
        with rng.epoch_context(3, 1), _parallel.share(w):
            got = ds.kuat_fetch_collated(idx)
        h1 = _parallel.helper_totals()
        assert_same(got, want)
        busy, cpu, native, native_cpu = (b - a for a, b in zip(h0, h1))
        if w == 1:
            assert (busy, cpu, native, native_cpu) == (0, 0, 0, 0)
        else:  # (helpers run only the C kernels: all their time is native)
            # (differences of running totals that began at different values: equal to
            # rounding, not bit for bit)
            assert busy > 0 and native == pytest.approx(busy, rel=1e-9, abs=1e-12)
            assert cpu >= 0 and native_cpu == pytest.approx(cpu, rel=1e-9, abs=1e-12)
    assert taken.n == 2


@pytest.mark.parametrize("indices", [
    [], [-1, 2], [0, 10**6], [True, 1], [np.int64(3), 1], np.array([4, 1]), torch.tensor([4, 1]),
    range(3), (1, 2), [2**70],
], ids=repr)
def test_indices_it_refuses_go_to_the_general_path(dataset, indices, monkeypatch):
    """Anything but a non-empty list of Python ints in range: the general path's answer (a
    batch, or its IndexError or TypeError), the same with the one call on or off."""
    path, _ = dataset
    t = TRANSFORMS[0]
    answers = []
    for ds in (_mapped(kuat.open(path).with_transform({"image": t})),
               _mapped(_general(path, t, monkeypatch))):  # fmt: skip
        try:
            with rng.epoch_context(3, 1):
                answers.append(ds.kuat_fetch_collated(indices))
        except (IndexError, TypeError, OverflowError) as e:
            answers.append((type(e), str(e)))
    if isinstance(answers[0], tuple):
        assert answers[0] == answers[1]
    else:
        assert_same(answers[0], answers[1])


def test_an_empty_dataset_raises_the_general_paths_index_error(tmp_path, monkeypatch):
    """No rows, no shards (no starts): every index is out of range, the general path's
    IndexError, not the C call's complaint about its starts."""
    with kuat.Writer(tmp_path / "d", {"image": kf.image(), "label": kf.int64()}):
        pass
    t = TRANSFORMS[0]
    errors = []
    for ds in (kuat.open(tmp_path / "d").with_transform({"image": t}),
               _general(tmp_path / "d", t, monkeypatch)):  # fmt: skip
        with pytest.raises(IndexError) as e:
            ds.kuat_fetch_collated([0])
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_unmapped_shards_go_to_the_general_path_which_maps_them(dataset, monkeypatch):
    path, _ = dataset
    taken = Taken(monkeypatch)
    t = TRANSFORMS[1]
    general = _general(path, t, monkeypatch)
    ds = kuat.open(path).with_transform({"image": t})  # its own store: no shard mapped
    idx = [3, 20, 11, 0, 29]
    for k in range(2):
        with rng.epoch_context(5, 1):
            assert_same(ds.kuat_fetch_collated(idx), general.kuat_fetch_collated(idx))
        assert taken.n == k  # the first found a shard unmapped; the general path mapped it


def test_errors_are_the_general_paths(tmp_path, monkeypatch):
    """A JPEG cut in its scan data and an image over ``max_pixels``: the one call leaves them
    to the per-image path, which raises the general path's ``DecodeError`` naming the first
    such sample."""
    imgs = [photo_jpeg(k) for k in range(12)]
    imgs[9] = imgs[9][: len(imgs[9]) * 3 // 4]
    with kuat.Writer(tmp_path / "d", {"image": kf.image(), "label": kf.int64()},
                     shard_bytes=24 << 10) as w:
        w.write_batch({"image": imgs, "label": np.arange(12)})
    stored = kuat.open(tmp_path / "d").read_batch(range(12), ["image"])["image"]
    pixels = (stored.width.astype(np.int64) * stored.height).tolist()
    limit = sorted(pixels)[6]  # about half the images are over it
    big = [i for i in range(12) if i != 9 and pixels[i] > limit]
    small = [i for i in range(12) if i != 9 and pixels[i] <= limit]
    cases = ((TRANSFORMS[0], [1, 9, 2], 9),
             (Compose([RandomResizedCrop(32)], max_pixels=limit), [small[0], big[0], big[1]],
              big[0]))  # fmt: skip
    for t, bad, want in cases:
        errors = []
        ds = _mapped(kuat.open(tmp_path / "d").with_transform({"image": t}))
        for width in (1, 3):  # (3: the decodes split over helper threads)
            with pytest.raises(kuat.DecodeError) as e, _parallel.share(width):
                ds.kuat_fetch_collated(bad)
            errors.append((str(e.value), e.value.index))
        with pytest.raises(kuat.DecodeError) as e:
            _mapped(_general(tmp_path / "d", t, monkeypatch)).kuat_fetch_collated(bad)
        errors.append((str(e.value), e.value.index))
        assert errors[0] == errors[1] == errors[2] and errors[0][1] == want


def test_fetch_rows_refuses_bad_arguments_clearly():
    fetch = kdecode._roi.fetch_rows
    jpg = photo_jpeg(1)
    entry = (memoryview(jpg), np.array([0, len(jpg)], np.int32), np.array([200], np.int32),
             np.array([150], np.int32))
    params = (*krf.rrc_params(*TRANSFORMS[0]._c_plan, None), 1, 2)
    out = np.full((1, 3, 48, 48), 7, np.uint8)
    starts = np.zeros(1, np.int64)
    label = np.full(1, -1, np.int64)
    column = [np.array([42], np.int64)]

    def call(indices, fixed=None, table=None, o=out, st=starts, num_rows=1):
        fixed = [(column, label)] if fixed is None else fixed
        return fetch(indices, num_rows, st, fixed, [entry] if table is None else table, o,
                     48, 48, *params)

    unplanned, failed, wall, cpu, helper_s, helper_cpu = call([0])
    assert (unplanned, failed) == ([], []) and label[0] == 42 and (out != 7).any()
    assert wall >= 0 and cpu >= 0 and helper_s == helper_cpu == 0.0  # (no helper: one row)
    out[:] = 7
    assert call([1]) is None and call([-1]) is None and call(["0"]) is None  # general path's
    assert call([0], table=[None]) == 0 and (out == 7).all()  # a shard to map first
    assert call([0], fixed=[([None], label)]) == 0
    with pytest.raises(ValueError, match="starts"):
        call([0], st=np.zeros(0, np.int64))
    with pytest.raises(TypeError, match="pairs"):
        call([0], fixed=[(column,)])
    with pytest.raises(ValueError, match="row 1 outside shard 0"):
        call([1], num_rows=2)
    with pytest.raises(ValueError, match="uint8 out"):
        call([0], o=np.zeros((2, 3, 48, 48), np.uint8))
    assert (out == 7).all()


def test_a_flip_that_empties_the_tables_is_refused_not_a_crash():
    """A flip probability's ``__float__`` runs Python code while the flips are read; the
    tables' length is read after it (it was read before: an emptied list was then indexed
    past its end, a segfault)."""
    jpg = photo_jpeg(1)
    entry = (memoryview(jpg), np.array([0, len(jpg)], np.int32), np.array([200], np.int32),
             np.array([150], np.int32))
    tables = [entry] * 3

    class Emptying:
        def __float__(self):
            tables.clear()
            return 0.5

    params = list(krf.rrc_params(*TRANSFORMS[0]._c_plan, None))
    params[6] = [Emptying()]  # flip_ps
    out = np.zeros((1, 3, 48, 48), np.uint8)
    with pytest.raises(ValueError, match="shard 2 of 0"):
        kdecode._roi.fetch_rows([2], 3, np.arange(3, dtype=np.int64), [], tables, out, 48, 48,
                                *params, 1, 2)
    tables[:] = [entry] * 3
    with pytest.raises(ValueError, match="shard 2 of 0"):  # the same core, the rows path's
        kdecode._roi.plan_decode_rows(tables, np.array([2]), np.array([0]), np.array([2]),
                                      out, 48, 48, *params, 1, 2)


@pytest.mark.parametrize("emptied", ["flips", "datas"])
def test_plan_calls_read_their_lists_after_the_flips(emptied):
    """plan_rrc and plan_decode_rrc (the per-batch planners of views): a flip's ``__float__``
    that empties the flips or the images list makes a clear error or a batch, not a read past
    the list's end (a segfault)."""
    jpg = photo_jpeg(1)
    params = krf.rrc_params(*TRANSFORMS[0]._c_plan, None)
    w, h = np.array([200, 200], np.int64), np.array([150, 150], np.int64)
    words, out = np.zeros((2, 4), np.uint64), np.zeros((2, 3, 48, 48), np.uint8)
    for call in (lambda d, f: kdecode._roi.plan_rrc(d, w, h, words, 48, 48, *params[:6], f,
                                                    params[7]),
                 lambda d, f: kdecode._roi.plan_decode_rrc(d, w, h, words, out, 48, 48,
                                                           *params[:6], f, params[7],
                                                           np.zeros(2, np.int64))):
        datas, flips = [jpg, jpg], []

        class Emptying:
            def __float__(self, target=flips if emptied == "flips" else datas):
                target.clear()
                return 0.5

        flips[:] = [Emptying(), Emptying(), 0.3]
        if emptied == "flips":
            assert len(call(datas, flips)) == 2
        else:
            with pytest.raises(ValueError, match="B=0"):
                call(datas, flips)


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_a_loader_epoch_matches_torch_and_held_labels_stay_intact(dataset, worker_type,
                                                                   monkeypatch):
    """Labels the loop keeps while later batches come from the pool keep their values; the
    epoch's labels are those of torch's DataLoader with the same sampler order."""
    path, n = dataset
    taken = Taken(monkeypatch)
    ds = kuat.open(path).with_transform({"image": TRANSFORMS[0]})
    g = torch.Generator().manual_seed(4)
    order = torch.randperm(n, generator=g).tolist()
    stored = kuat.open(path).read_batch(range(n), ["label"])["label"].tolist()  # Python ints
    ref = torch.utils.data.DataLoader(stored, batch_size=8, sampler=list(order))
    want = list(ref)  # (B,) int64 each, as torch collates the samples' ints
    loader = kuat.DataLoader(ds, batch_size=8, sampler=list(order), num_workers=2,
                             worker_type=worker_type)
    for _ in range(2):
        kept = [b["label"] for b in loader]  # the images are dropped, the labels kept
        gc.collect()
        assert len(kept) == len(want)
        for k, w in zip(kept, want):
            assert_same(k, w)
    if worker_type == "thread":
        assert taken.n > 0
    loader.close()
