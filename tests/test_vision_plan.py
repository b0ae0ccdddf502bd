"""The batch planned in C (#12 B, the loop's own cost): ``_roijpeg.c``'s ``sample_words`` and
``plan_rrc`` must give exactly what the Python planner gives, so that moving ~45 us per image
out of Python changes no seed, no draw, no box and no pixel.

The references are NumPy's ``SeedSequence``/``PCG64`` (through ``kuat.rng``'s NumPy path) and
``Compose.plan`` + ``Compose._batch_job`` (torchvision's ``get_params`` with the sample's
generator, the header read by simplejpeg, the EXIF walk of ``kuat.vision._exif``).
"""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from kuat import rng
from kuat.vision import Compose, RandomHorizontalFlip, RandomResizedCrop, Resize
from kuat.vision import decode as kdecode

roi = kdecode._roi
pytestmark = pytest.mark.skipif(
    getattr(roi, "plan_rrc", None) is None, reason="the optional ROI decoder is not built"
)

EDGE = [0, 1, 2, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 7, 2**63 - 1]


@pytest.fixture
def numpy_words(monkeypatch):
    """``kuat.rng`` hashing in NumPy (kuat._seedseq), as without the ROI decoder."""
    monkeypatch.setattr(rng, "_native_words", None)


@pytest.mark.parametrize("seed,epoch", [(0, 0), (7, 3), (2**32, 2**32 - 1), (2**64 - 1, 0),
                                        (-1, 5), (2**70 + 3, 1)])
def test_c_sample_words_equal_numpys_seed_sequence(seed, epoch, monkeypatch):
    idx = EDGE + list(range(100, 164))
    with rng.epoch_context(seed, epoch):
        c_seeds, c_words = rng._batch_words(idx)
        monkeypatch.setattr(rng, "_native_words", None)
        n_seeds, n_words = rng._batch_words(idx)
    np.testing.assert_array_equal(c_seeds, n_seeds)
    np.testing.assert_array_equal(c_words, n_words)
    assert c_seeds.tolist() == [rng.sample_seed(seed, epoch, i) for i in idx]
    for s, w in zip(c_seeds.tolist()[:12], c_words[:12]):  # what PCG64(seed) asks for
        np.testing.assert_array_equal(w, np.random.SeedSequence(s).generate_state(4, np.uint64))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(2**80), 2**80) | st.sampled_from([0, 2**32 - 1, 2**32, 2**64 - 1]),
                max_size=16), st.integers(1, 64))
def test_c_derive_seed_equals_numpys_seed_sequence(words, bits):
    """kuat.rng.derive_seed (an epoch's shuffle and worker seeds, a mix's...) in C gives
    NumPy's SeedSequence value for any words (each modulo 2**64, 0 to 16 of them)."""
    assert rng._native_seed is not None  # (registered with the ROI decoder)
    ss = np.random.SeedSequence([w % 2**64 for w in words]).generate_state(2, np.uint32)
    want = (int(ss[0]) | int(ss[1]) << 32) & ((1 << bits) - 1)
    assert rng.derive_seed(*words, bits=bits) == want
    with pytest.raises(TypeError, match="int"):
        roi.derive_seed((*words, 1.5))


@pytest.mark.parametrize("native", [True, False], ids=["C", "NumPy"])
def test_derive_seed_takes_numpys_integers_as_the_ints_they_are(native, monkeypatch):
    """A sample index from a sampler yielding NumPy integers (``kuat.sample_rng(np.int64(i))``),
    or a seed or epoch given as one, is the same word as its Python int, on both paths; a
    float is refused with a TypeError."""
    if not native:
        monkeypatch.setattr(rng, "_native_seed", None)
    words = [(np.int64(5), np.uint32(7), True), (np.uint64(2**64 - 1), np.int64(-3), 0),
             (np.int8(-1), np.uint16(65535), np.int64(2**62))]
    for w in words:
        ints = [int(x) % 2**64 for x in w]
        ss = np.random.SeedSequence(ints).generate_state(2, np.uint32)
        assert rng.derive_seed(*w) == int(ss[0]) | int(ss[1]) << 32
    with rng.epoch_context(3, 1):
        a, b = rng.sample_rng(np.int64(11)).numpy, rng.sample_rng(11).numpy
    np.testing.assert_array_equal(a.random(4), b.random(4))
    with pytest.raises(TypeError):
        rng.derive_seed(3, 1.0)


def test_c_derive_seed_refuses_more_words_than_it_takes_and_numpy_takes_them():
    with pytest.raises(TypeError, match="16"):
        roi.derive_seed(tuple(range(17)))
    words = tuple(range(40))
    ss = np.random.SeedSequence(list(words)).generate_state(2, np.uint32)
    assert rng.derive_seed(*words) == int(ss[0]) | int(ss[1]) << 32


def test_batch_generators_are_sample_rngs_made_on_demand():
    with rng.epoch_context(3, 2):
        gens = rng.BatchGenerators(np.array([5, 0, 2**40]))
        ref = [rng.sample_rng(i).numpy for i in (5, 0, 2**40)]
    assert len(gens) == 3 and gens._gens == [None] * 3  # nothing made yet
    assert gens[1] is gens[1]  # made once, then kept (the same stream for the whole batch)
    for g, r in zip(gens, ref):
        np.testing.assert_array_equal(g.random(5), r.random(5))
    assert [g.integers(0, 10**9) for g in gens[1:]] == [r.integers(0, 10**9) for r in ref[1:]]
    assert not gens.pcg_words.flags.writeable
    assert len(rng.BatchGenerators([])) == 0
    with pytest.raises(ValueError, match="-3"):
        rng.BatchGenerators([1, -3])


def _jpeg(w: int, h: int, seed: int = 0, mode: str = "RGB", orientation: int | None = None,
          **save) -> bytes:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    im = Image.fromarray(a).convert(mode)
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        save["exif"] = exif.tobytes()
    b = io.BytesIO()
    im.save(b, "JPEG", quality=85, **save)
    return b.getvalue()


def _png(w: int, h: int) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (w, h), (10, 20, 30)).save(b, "PNG")
    return b.getvalue()


def _python_plan(t: Compose, datas, widths, heights, gens, size):
    """What ``apply_encoded_many`` plans in Python: ``(k, y0, y1, x0, x1, flip)`` or None."""
    out = []
    for j, d in enumerate(datas):
        plan = t.plan(int(widths[j]), int(heights[j]), gens[j])
        job = t._batch_job(d, int(widths[j]), int(heights[j]), plan, j, size)
        out.append(None if job is None else (*job[1:6], job[7]))
    return out


def _c_plan(t: Compose, datas, widths, heights, gens, size):
    return t._plan_in_c(datas, widths, heights, gens, size)


TRANSFORMS = [
    Compose([RandomResizedCrop(224), RandomHorizontalFlip()]),
    Compose([RandomResizedCrop(64)]),
    Compose([RandomResizedCrop((48, 96), scale=(1, 1), ratio=(1, 3))]),  # int scale and ratio
    Compose([RandomResizedCrop(32, scale=(0.9, 1.0), ratio=(0.1, 0.2)),  # the fallback box
             RandomHorizontalFlip(0.3), RandomHorizontalFlip(0.8)]),
    Compose([RandomResizedCrop(40, ratio=(5.0, 9.0))], max_pixels=50_000),
]


@pytest.fixture(scope="module")
def corpus():
    """JPEGs the batch path takes and ones it must leave to the per-image path."""
    imgs = [(_jpeg(w, h, k), w, h) for k, (w, h) in
            enumerate([(320, 240), (240, 320), (97, 301), (513, 77), (48, 48), (640, 480)])]
    imgs += [(_jpeg(200, 150, 7, orientation=o), *((150, 200) if o >= 5 else (200, 150)))
             for o in range(1, 9)]  # the index holds the oriented size
    imgs += [
        (_jpeg(160, 120, 8, mode="L"), 160, 120),  # grayscale
        (_jpeg(160, 120, 9, mode="CMYK"), 160, 120),  # 4 components: per-image path
        (_jpeg(160, 120, 10, progressive=True), 160, 120),
        (_jpeg(160, 120, 11, subsampling=0), 160, 120),  # 4:4:4
        (_jpeg(160, 120, 12), 150, 110),  # the index disagrees with the bytes: box rescaled
        (_jpeg(160, 120, 13, orientation=2), 170, 100),  # ... and mirrored by EXIF
        (_png(90, 60), 90, 60),  # not a JPEG
        (_jpeg(160, 120, 14)[:300], 160, 120),  # truncated in the header
        (b"\xff\xd8\xff\xd9", 10, 10),  # no frame
        (b"", 10, 10),
    ]
    return imgs


@pytest.mark.parametrize("t", TRANSFORMS, ids=repr)
@pytest.mark.parametrize("seed,epoch", [(0, 0), (11, 4), (2**63 + 5, 2**33)])
def test_c_plan_equals_python_plan(corpus, t, seed, epoch):
    datas = [d for d, _, _ in corpus] * 4
    widths = [w for _, w, _ in corpus] * 4
    heights = [h for _, _, h in corpus] * 4
    with rng.epoch_context(seed, epoch):
        gens = rng.BatchGenerators(range(len(datas)))
        ref_gens = rng.BatchGenerators(range(len(datas)))
    size = t.output_size()
    got = _c_plan(t, datas, widths, heights, gens, size)
    want = _python_plan(t, datas, widths, heights, ref_gens, size)
    assert got == want
    assert gens._gens == [None] * len(datas)  # the C planner made no generator
    assert sum(p is not None for p in got) >= 40  # most of the corpus is planned in C


@settings(max_examples=300, deadline=None)
@given(
    w=st.integers(1, 5000), h=st.integers(1, 5000), index=st.integers(0, 2**63 - 1),
    s0=st.floats(0.01, 1.0), ds=st.floats(0.0, 1.0), r0=st.floats(0.1, 3.0),
    dr=st.floats(0.0, 3.0), out=st.integers(1, 400), p=st.floats(0.0, 1.0),
)  # fmt: skip
def test_c_boxes_equal_python_for_any_size_and_parameters(w, h, index, s0, ds, r0, dr, out, p):
    """torchvision's get_params arithmetic, the DCT scale and the snap, for any index size
    (the bytes are one small JPEG: the box is rescaled to it, as when the index disagrees)."""
    t = Compose([RandomResizedCrop(out, scale=(s0, min(1.0, s0 + ds)), ratio=(r0, r0 + dr)),
                 RandomHorizontalFlip(p)])
    data = _SMALL
    with rng.epoch_context(1, 2):
        gens, ref = rng.BatchGenerators([index]), rng.BatchGenerators([index])
    got = _c_plan(t, [data], [w], [h], gens, (out, out))
    assert got == _python_plan(t, [data], [w], [h], ref, (out, out))


_SMALL = _jpeg(333, 211, 3)


def _with_app1(payload: bytes, base: bytes = _SMALL) -> bytes:
    """``base`` with an APP1 segment holding ``payload`` right after SOI."""
    return base[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + base[2:]


def _exif(order: str, entries: list[tuple[int, int, int]], ifd: int = 8) -> bytes:
    e = "<" if order == "II" else ">"
    body = order.encode() + struct.pack(e + "HI", 42, ifd)
    body += b"\0" * (ifd - 8) + struct.pack(e + "H", len(entries))
    for tag, typ, value in entries:
        body += struct.pack(e + "HHI", tag, typ, 1) + (
            struct.pack(e + "HH", value, 0) if typ == 3 else struct.pack(e + "I", value)
        )
    return b"Exif\0\0" + body


EXIF_CASES = [
    _exif("II", [(0x0112, 3, 2)]), _exif("MM", [(0x0112, 3, 2)]),
    _exif("MM", [(0x0100, 4, 9), (0x0112, 3, 6)]), _exif("II", [(0x0112, 4, 2)]),  # LONG
    _exif("II", [(0x0112, 5, 2)]),  # wrong type: 1
    _exif("II", [(0x0112, 3, 9)]),  # out of range: 1
    _exif("II", [(0x0112, 3, 2)], ifd=4000),  # IFD past the segment: 1
    _exif("II", [(0x0112, 3, 2)])[:-4],  # entry cut short: 1
    b"Exif\0\0" + _exif("II", [(0x0112, 3, 2)]),  # the header twice (seen in the wild)
    b"Exif\0\0XX", b"Exif", b"http://ns.adobe.com/xap/1.0/\0<x/>",  # junk, short, XMP
]


@pytest.mark.parametrize("payload", EXIF_CASES)
def test_c_exif_walk_equals_python(payload):
    data = _with_app1(payload)
    data2 = _with_app1(_exif("II", [(0x0112, 3, 2)]), data)  # only the first Exif APP1 counts
    t = TRANSFORMS[0]
    for d in (data, data2):
        with rng.epoch_context(0, 0):
            gens, ref = rng.BatchGenerators(range(8)), rng.BatchGenerators(range(8))
        args = ([d] * 8, [333] * 8, [211] * 8)
        assert _c_plan(t, *args, gens, (224, 224)) == _python_plan(t, *args, ref, (224, 224))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=80), st.integers(0, 60))
def test_c_exif_walk_equals_python_on_garbage(junk, cut):
    """Random bytes in an Exif APP1 (valid segment lengths): never a crash, always the
    Python walk's orientation (a mirror moves the box; 3-8 leave the sample to Python)."""
    base = _exif("MM", [(0x0112, 3, 2)])
    payload = base[: 6 + cut] + junk  # keeps "Exif\0\0", then anything
    t = TRANSFORMS[0]
    with rng.epoch_context(0, 0):
        gens, ref = rng.BatchGenerators(range(4)), rng.BatchGenerators(range(4))
    args = ([_with_app1(payload)] * 4, [333] * 4, [211] * 4)
    assert _c_plan(t, *args, gens, (224, 224)) == _python_plan(t, *args, ref, (224, 224))


def test_other_pipelines_and_plain_generators_plan_in_python(corpus):
    datas, widths, heights = [corpus[0][0]], [320], [240]
    gens = rng.BatchGenerators([0])
    assert _c_plan(Compose([RandomHorizontalFlip(), RandomResizedCrop(64)]), datas, widths,
                   heights, gens, (64, 64)) is None  # flip first: the box is mirrored
    assert _c_plan(Compose([Resize(64)]), datas, widths, heights, gens, (64, 64)) is None
    assert _c_plan(TRANSFORMS[0], datas, widths, heights, list(gens), (224, 224)) is None
    assert _c_plan(TRANSFORMS[0], datas, [0], heights, gens, (224, 224)) is None  # raises later


@pytest.mark.parametrize("t", TRANSFORMS[:4], ids=repr)
def test_batch_pixels_equal_per_sample_apply_encoded(corpus, t):
    """The whole batch through the C planner equals ``apply_encoded`` image by image with
    ``sample_rng(i)``: the per-image path's samples (CMYK, rotated, PNG) included."""
    keep = [c for c in corpus if c[0][:2] == b"\xff\xd8" and len(c[0]) > 400] + [corpus[-4]]
    datas, widths, heights = zip(*keep)
    size = t.output_size()
    out = np.zeros((len(datas), 3, *size), np.uint8)
    with rng.epoch_context(5, 1):
        t.apply_encoded_many(datas, widths, heights, rng.BatchGenerators(range(len(datas))), out)
        for j, (d, w, h) in enumerate(keep):
            one = t.apply_encoded(d, w, h, rng.sample_rng(j).numpy)
            np.testing.assert_array_equal(out[j], one, err_msg=f"sample {j}")


def test_degenerate_fallback_box_keeps_one_pixel():
    """A 1-pixel side times a ratio below 1/2 rounds to an empty box in torchvision's
    fallback (its resize then fails); kuat keeps the one pixel row or column, in Python and C."""
    t = RandomResizedCrop(4, scale=(0.5, 0.5), ratio=(0.4, 0.4))
    assert t.get_params(1, 1, np.random.default_rng(0)) == (0, 0, 1, 1)
    assert RandomResizedCrop(4, scale=(0.5, 0.5), ratio=(3.0, 3.0)).get_params(
        1, 1, np.random.default_rng(0)) == (0, 0, 1, 1)
    data = _jpeg(1, 1)
    c = Compose([t])
    out = c.apply_encoded(data, 1, 1, np.random.default_rng(0))
    assert out.shape == (3, 4, 4)
    batch = np.zeros((2, 3, 4, 4), np.uint8)
    c.apply_encoded_many([data, data], [1, 1], [1, 1], rng.BatchGenerators([0, 1]), batch)
    np.testing.assert_array_equal(batch[0], out)


def test_non_contiguous_or_odd_buffers_go_to_the_per_image_path():
    data = np.frombuffer(_SMALL, np.uint8)
    strided = np.repeat(data, 2)[::2]  # the same bytes, not contiguous
    gens = rng.BatchGenerators([0, 1, 2])
    got = _c_plan(TRANSFORMS[0], [data, strided, 17], [333] * 3, [211] * 3, gens, (224, 224))
    assert got[0] is not None and got[1] is None and got[2] is None


@pytest.mark.parametrize("max_pixels", [float("inf"), float("nan"), 2.0**70, -1, 0,
                                        333 * 211, 333 * 211 + 0.5, 333 * 211 - 0.5])
def test_c_plan_reads_max_pixels_as_python(max_pixels):
    """Any number ``Compose`` takes as ``max_pixels`` limits the C planner as ``_batch_job``'s
    ``w * h > max_pixels``: inf/nan no limit (they raised OverflowError/ValueError), a
    negative one every image (-1 meant no limit, so the batch decoded what Python refuses)."""
    t = Compose([RandomResizedCrop(32)], max_pixels=max_pixels)
    gens, ref = rng.BatchGenerators([0, 1]), rng.BatchGenerators([0, 1])
    got = _c_plan(t, [_SMALL] * 2, [333] * 2, [211] * 2, gens, (32, 32))
    assert got == _python_plan(t, [_SMALL] * 2, [333] * 2, [211] * 2, ref, (32, 32))


def test_c_plan_takes_strided_sizes():
    """Widths and heights may be any int64 array (a column of the index, every other row):
    a strided one raised ValueError ("ndarray is not C-contiguous") in the C planner."""
    sizes = np.array([[333, 211], [1, 1], [333, 211], [1, 1]], np.int64)
    widths, heights = sizes[::2, 0], sizes[::2, 1]  # (2,) views, strides of 32 bytes
    gens, ref = rng.BatchGenerators([0, 1]), rng.BatchGenerators([0, 1])
    t = TRANSFORMS[0]
    got = _c_plan(t, [_SMALL] * 2, widths, heights, gens, (224, 224))
    assert got == _python_plan(t, [_SMALL] * 2, widths, heights, ref, (224, 224))
    assert None not in got


@pytest.mark.parametrize("scale,ratio", [((0.5, float("inf")), (0.75, 4 / 3)),
                                         ((0.5, 1.0), (1.0, float("inf"))),
                                         ((1e305, 1e305), (0.75, 4 / 3))])
def test_c_plan_leaves_what_python_cannot_draw_to_python(scale, ratio):
    """Parameters whose box side is inf or nan: torchvision's arithmetic raises in Python
    (round() of inf or nan); the C planner gave a box for them (the cast of inf
    read as a failed attempt) instead of leaving the sample to the Python path's error."""
    t = Compose([RandomResizedCrop(32, scale=scale, ratio=ratio)])
    gens = rng.BatchGenerators([0, 1])
    assert _c_plan(t, [_SMALL] * 2, [333] * 2, [211] * 2, gens, (32, 32)) == [None, None]
    with pytest.raises((OverflowError, ValueError, ZeroDivisionError)):
        t.plan(333, 211, rng.BatchGenerators([0])[0])
    out = np.zeros((2, 3, 32, 32), np.uint8)
    with pytest.raises((OverflowError, ValueError, ZeroDivisionError)):
        t.apply_encoded_many([_SMALL] * 2, [333] * 2, [211] * 2, gens, out)


def test_generators_continue_after_the_c_plan_as_a_list_would(corpus):
    """``rngs`` after ``apply_encoded_many`` are where the Python planner leaves a list of
    generators: the C planner drew from the words only, so a caller drawing more afterwards
    got the crop's own draws again (its first number was the box's area draw), a second call
    with the same ``rngs`` repeated the first's boxes, and draws made before the call were
    ignored."""
    keep = [c for c in corpus if c[0][:2] == b"\xff\xd8" and len(c[0]) > 400] + [corpus[-4]]
    datas, widths, heights = zip(*keep)
    n, t = len(datas), TRANSFORMS[3]
    size = t.output_size()

    def run(rngs, before=False):
        if before:
            rngs[1].random(3)
        outs = [np.zeros((n, 3, *size), np.uint8) for _ in range(2)]
        for out in outs:  # twice with the same generators
            t.apply_encoded_many(datas, widths, heights, rngs, out)
        return outs, [g.random() for g in rngs]

    for before in (False, True):
        with rng.epoch_context(2, 0):
            got = run(rng.BatchGenerators(range(n)), before)
            want = run(list(rng.BatchGenerators(range(n))), before)
        np.testing.assert_array_equal(got[0][0], want[0][0])
        np.testing.assert_array_equal(got[0][1], want[0][1])
        assert got[1] == want[1]


@pytest.mark.skipif(getattr(roi, "plan_decode_rrc", None) is None,
                    reason="the ROI decoder predates plan_decode_rrc")
@pytest.mark.parametrize("t", TRANSFORMS, ids=repr)
def test_plan_decode_in_one_call_equals_plan_then_decode(corpus, t):
    """``plan_decode_rrc`` (plan, weights, decode and resize in one C call, no per-image Python
    object) gives ``plan_rrc``'s boxes and draws and ``decode_resize_batch``'s pixels: the
    same unplanned samples, the same failed decodes (a JPEG cut in its scan data), the same
    bytes in every slot, untouched slots left as they were."""
    cut = _jpeg(160, 120, 15)
    datas = [d for d, _, _ in corpus] + [cut[: len(cut) // 2]]
    widths = np.array([w for _, w, _ in corpus] + [160], np.int64)
    heights = np.array([h for _, _, h in corpus] + [120], np.int64)
    size, n = t.output_size(), len(datas)
    with rng.epoch_context(3, 1):
        words = rng.BatchGenerators(range(n)).pcg_words
        c_args = t._c_plan_args(widths, heights, rng.BatchGenerators(range(n)))
    want_draws, got_draws = np.zeros(n, np.int64), np.zeros(n, np.int64)
    boxes = roi.plan_rrc(datas, widths, heights, words, *size, *c_args[3], want_draws)
    want = np.full((n, 3, *size), 7, np.uint8)
    from kuat.vision.compose import _batch_job_of

    jobs = [(j, _batch_job_of(datas[j], b, j, size)) for j, b in enumerate(boxes) if b is not None]
    want_failed = [(jobs[k][0], why) for k, why in
                   kdecode.decode_resize_batch([job for _, job in jobs], want)]
    got = np.full((n, 3, *size), 7, np.uint8)
    unplanned, failed = kdecode.plan_decode_rrc(datas, widths, heights, words, got, c_args[3],
                                                got_draws)
    assert unplanned == [j for j, b in enumerate(boxes) if b is None]
    assert [j for j, _ in failed] == [j for j, _ in want_failed] and failed  # the cut JPEG
    np.testing.assert_array_equal(got_draws, want_draws)
    np.testing.assert_array_equal(got, want)


def test_a_batch_shared_by_idle_cores_equals_the_one_call(corpus):
    """An epoch's first batch, shared by helper threads (``kuat._parallel``), keeps the
    plan-then-decode path; its pixels and generators equal the one-call path's."""
    from kuat import _parallel

    keep = [c for c in corpus if c[0][:2] == b"\xff\xd8" and len(c[0]) > 400] * 3
    datas, widths, heights = zip(*keep)
    t, n = TRANSFORMS[0], len(keep)
    outs, after = [], []
    for width in (1, 2):
        out = np.zeros((n, 3, 224, 224), np.uint8)
        with rng.epoch_context(9, 0), _parallel.share(width):
            rngs = rng.BatchGenerators(range(n))
            t.apply_encoded_many(datas, widths, heights, rngs, out)
        outs.append(out)
        after.append([g.random() for g in rngs])
    np.testing.assert_array_equal(outs[0], outs[1])
    assert after[0] == after[1]


def test_words_hashed_in_the_batch_call_equal_the_generators_words(corpus):
    """``plan_decode_rrc`` hashing each sample's words itself, without the GIL (fresh
    ``BatchGenerators``: ``_unhashed``), gives the pixels and the continued streams of the
    words hashed in Python first (``pcg_words`` read before the call); both are the epoch's
    current at construction, whatever is current when the batch is decoded."""
    keep = [c for c in corpus if c[0][:2] == b"\xff\xd8" and len(c[0]) > 400]
    datas, widths, heights = zip(*keep)
    t, n = TRANSFORMS[3], len(datas)
    outs, nexts = [], []
    for hashed_first in (False, True):
        with rng.epoch_context(9, 4):
            gens = rng.BatchGenerators(range(100, 100 + n))
        if hashed_first:
            gens.pcg_words  # noqa: B018  (hashed now, in Python)
        assert (gens._unhashed is None) == hashed_first
        out = np.zeros((n, 3, *t.output_size()), np.uint8)
        with rng.epoch_context(1, 1):  # another epoch current: the words stay epoch 4's
            t.apply_encoded_many(datas, widths, heights, gens, out)
        outs.append(out)
        nexts.append([g.random() for g in gens])
    np.testing.assert_array_equal(outs[0], outs[1])
    assert nexts[0] == nexts[1]
    with rng.epoch_context(9, 4):
        want = [rng.sample_rng(100 + j).numpy for j in range(n)]
    for j in range(n):  # the C planner's draws, then the same stream
        t.plan(int(widths[j]), int(heights[j]), want[j])
    assert nexts[0] == [g.random() for g in want]
