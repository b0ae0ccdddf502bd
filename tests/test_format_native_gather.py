"""The C gather (``_roijpeg.c`` ``take_rows`` / ``image_rows``, :func:`kuat.format.gather.native`)
gives what the Python gather by shard groups gives: every fixed-size field type and
self-advised image columns, across shards, shards not mapped yet, and bad input refused."""

import numpy as np
import pytest
from _images import noise_image

import kuat
import kuat.format as kf
from kuat.format import gather

pytest.importorskip("kuat.vision.decode")
import kuat.vision.decode  # noqa: E402  (registers the C gather when the ROI decoder loads)

if gather.native() is None:
    pytest.skip("the ROI decoder (and its C gather) is not built", allow_module_level=True)

N = 40
FIXED = ["i8", "u16", "i64", "u64", "f16", "f64", "flag", "t_u8", "t_f16", "t_i64"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    rng = np.random.default_rng(0)
    schema = {
        "i8": kf.int8(), "u16": kf.uint16(), "i64": kf.int64(), "u64": kf.uint64(),
        "f16": kf.float16(), "f64": kf.float64(), "flag": kf.bool_(),
        "t_u8": kf.tensor((2, 3), "uint8"), "t_f16": kf.tensor((3,), "float16"),
        "t_i64": kf.tensor((2,), "int64"), "text": kf.string(), "image": kf.image(),
    }
    cols = {
        "i8": rng.integers(-128, 127, N).astype(np.int8),
        "u16": rng.integers(0, 2**16 - 1, N).astype(np.uint16),
        "i64": rng.integers(-(2**62), 2**62, N),
        "u64": rng.integers(0, 2**62, N).astype(np.uint64),
        "f16": rng.standard_normal(N).astype(np.float16),
        "f64": rng.standard_normal(N),
        "flag": rng.integers(0, 2, N).astype(bool),
        "t_u8": rng.integers(0, 255, (N, 2, 3)).astype(np.uint8),
        "t_f16": rng.standard_normal((N, 3)).astype(np.float16),
        "t_i64": rng.integers(-9, 9, (N, 2)),
        "text": [f"row {i}" for i in range(N)],
        "image": [noise_image(16 + i % 5, 12 + i % 3, i, quality=90) for i in range(N)],
    }
    p = tmp_path_factory.mktemp("native") / "ds"
    with kuat.Writer(p, schema, shard_bytes=4096) as w:  # several shards, rows of each
        w.write_batch(cols)
    assert kuat.open(p).num_shards > 3
    return p


def _python_gather(store, idx, names, own, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(gather, "_native", None)
        return store.gather(idx, names, own)


@pytest.mark.parametrize("indices", [[5, 0, 39, 3, 3, 7, 20, 38], list(range(N)), [11], []])
def test_c_gather_equals_the_python_gather(path, indices, monkeypatch):
    store = kuat.open(path)._store
    idx = store.indices(indices)
    names = store.schema.names
    fresh = store.gather(idx, names, ["image"])  # shards not mapped yet: by groups, mapping them
    again = store.gather(idx, names, ["image"])  # all mapped: the C gather
    want = _python_gather(store, idx, names, ["image"], monkeypatch)
    for got in (fresh, again):
        assert np.array_equal(got[0], want[0])  # (B,) shard ids
        for name in FIXED:
            g, w = got[1][name], want[1][name]
            assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes(), name
        assert got[1]["text"] == want[1]["text"]
        gi, wi = got[1]["image"], want[1]["image"]
        assert [bytes(v) for v in gi.data] == [bytes(v) for v in wi.data]
        assert np.array_equal(gi.width, wi.width) and np.array_equal(gi.height, wi.height)
        assert gi.width.dtype == np.int32 and gi.codec is None and wi.codec is None


def test_a_shard_unmapped_again_is_gathered_by_groups(path, monkeypatch):
    """A shard dropped after the table was built (a remote store's eviction, ``close()``):
    the C gather reports it and that field goes by shard groups, which map it again."""
    store = kuat.open(path)._store
    idx = store.indices(list(range(N)))
    store.gather(idx, store.schema.names, ["image"])
    store.gather(idx, store.schema.names, ["image"])
    store.close()  # every mapping dropped
    got = store.gather(idx, store.schema.names, ["image"])
    want = _python_gather(store, idx, store.schema.names, ["image"], monkeypatch)
    assert got[1]["i64"].tolist() == want[1]["i64"].tolist()
    assert [bytes(v) for v in got[1]["image"].data] == [bytes(v) for v in want[1]["image"].data]


def test_rows_are_located_as_searchsorted_does():
    locate_rows = gather.native()[2]
    starts = np.array([0, 3, 3, 7, 20], np.int64)  # shard 1 is empty
    idx = np.array([0, 2, 3, 6, 7, 19, 20, 500], np.int64)
    sid, local = np.empty(8, np.int64), np.empty(8, np.int64)
    locate_rows(starts, idx, sid, local)
    want = np.searchsorted(starts, idx, side="right") - 1
    assert sid.tolist() == want.tolist() and local.tolist() == (idx - starts[want]).tolist()
    with pytest.raises(ValueError, match="before the first shard"):
        locate_rows(starts, np.array([-1], np.int64), sid[:1], local[:1])


def test_bad_rows_and_shards_are_refused():
    take_rows, image_rows, _ = gather.native()
    col = np.arange(4, dtype=np.int64)
    out = np.empty(2, np.int64)
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    assert take_rows([col], i64(0, 0), i64(3, 1), out) == -1 and out.tolist() == [3, 1]
    assert take_rows([col, None], i64(0, 1), i64(0, 0), out) == 1  # shard 1 unmapped
    with pytest.raises(ValueError, match="row 4"):
        take_rows([col], i64(0, 0), i64(0, 4), out)
    with pytest.raises(ValueError, match="shard 2"):
        take_rows([col], i64(2, 0), i64(0, 0), out)
    data = np.frombuffer(b"abcdef", np.uint8)
    entry = (memoryview(data), np.array([0, 2, 6], np.int32), np.array([5, 6], np.int32),
             np.array([7, 8], np.int32))
    w, h = np.empty(2, np.int32), np.empty(2, np.int32)
    views = image_rows([entry], i64(0, 0), i64(1, 0), w, h)
    assert [bytes(v) for v in views] == [b"cdef", b"ab"] and w.tolist() == [6, 5]
    assert h.tolist() == [8, 7]
    assert image_rows([None], i64(0), i64(0), w[:1], h[:1]) == 0
    with pytest.raises(ValueError, match="row 2"):
        image_rows([entry], i64(0), i64(2), w[:1], h[:1])
    bad = (entry[0], np.array([0, 9, 6], np.int32), entry[2], entry[3])  # offset past the data
    with pytest.raises(ValueError, match="row 0"):
        image_rows([bad], i64(0), i64(0), w[:1], h[:1])
