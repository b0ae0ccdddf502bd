"""The image loop's own cost (#12 B): batch-hashed sample generators, native-time stats.

What the loop saves must not change a pixel or a draw: ``sample_rngs`` gives the generators
``sample_rng`` gives (NumPy's ``SeedSequence`` is the reference), and a loader batch through
the fused path equals ``apply_encoded`` called sample by sample with ``sample_rng(i)``.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import kuat
import kuat.format as kf
from kuat import _seedseq, rng
from kuat.vision import Compose, RandomHorizontalFlip, RandomResizedCrop
from kuat.vision import resize as kresize

EDGE = [0, 1, 2, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 7, 2**63 - 1]


@pytest.mark.parametrize("n_entropy", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("n_words", [1, 2, 8])
def test_generate_state_is_numpys_seed_sequence(n_entropy, n_words):
    g = np.random.default_rng(n_entropy * 10 + n_words)
    cols = [g.integers(0, 2**32, 16, dtype=np.uint64).astype(np.uint32) for _ in range(n_entropy)]
    cols[0][:3] = [0, 1, 2**32 - 1]  # edge words
    got = _seedseq.generate_state(cols, n_words)  # (16, n_words)
    for b in range(16):
        entropy = np.array([c[b] for c in cols], np.uint32)
        want = np.random.SeedSequence(entropy).generate_state(n_words, np.uint32)
        np.testing.assert_array_equal(got[b], want)


def test_int_words_is_numpys_coercion():
    for n in EDGE + [2**64 - 1, 2**96 + 5]:
        words = np.array(_seedseq.int_words(n), np.uint32)
        assert np.random.SeedSequence(n).pool.tolist() == np.random.SeedSequence(words).pool.tolist()


@pytest.mark.parametrize("seed,epoch", [(0, 0), (0, 1), (7, 3), (2**32, 2**32 - 1),
                                        (2**64 - 1, 0), (-1, 5)])
def test_sample_rngs_equal_sample_rng(seed, epoch):
    with rng.epoch_context(seed, epoch):
        batch = rng.sample_rngs(EDGE + list(range(100, 140)))
        one = [rng.sample_rng(i) for i in EDGE + list(range(100, 140))]
    assert [r.seed for r in batch] == [r.seed for r in one]
    for a, b in zip(batch, one):
        np.testing.assert_array_equal(a.numpy.random(4), b.numpy.random(4))
        assert a.numpy.integers(0, 2**62) == b.numpy.integers(0, 2**62)
        # the other generators derive from the seed alone
        assert a.torch.initial_seed() == b.torch.initial_seed()
        assert a.python.random() == b.python.random()


def test_sample_rngs_seed_seq_answers_like_a_real_one():
    with rng.epoch_context(3, 1):
        a = rng.sample_rngs([12])[0].numpy.bit_generator.seed_seq
        b = rng.sample_rng(12).numpy.bit_generator.seed_seq
    assert a.entropy == b.entropy and a.pool.tolist() == b.pool.tolist()
    np.testing.assert_array_equal(a.generate_state(3), b.generate_state(3))
    np.testing.assert_array_equal(a.generate_state(4, np.uint64), b.generate_state(4, np.uint64))
    for x, y in zip(a.spawn(2), b.spawn(2)):  # children, as PCG64(seed).spawn would make them
        np.testing.assert_array_equal(x.generate_state(4), y.generate_state(4))
    ga = rng.sample_rngs([12])[0].numpy.spawn(1)[0]
    with rng.epoch_context(0, 0):
        gb = rng.sample_rng(12).numpy.spawn(1)[0]
    np.testing.assert_array_equal(ga.random(3), gb.random(3))


def test_sample_rngs_validation_and_empty():
    assert rng.sample_rngs([]) == []
    assert [r.seed for r in rng.sample_rngs(np.arange(3))] == [rng.sample_seed(0, 0, i)
                                                                 for i in range(3)]
    with pytest.raises(ValueError, match="-4"):
        rng.sample_rngs([1, -4])


def _photo_jpeg(seed: int) -> tuple[bytes, int, int]:
    g = np.random.default_rng(seed)
    h, w = int(g.integers(180, 260)), int(g.integers(200, 320))
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([(x * 255 // w), (y * 255 // h), ((x + y) * 3) % 256], -1)
    a = np.clip(a + g.normal(0, 12, a.shape), 0, 255).astype(np.uint8)  # grain
    out = io.BytesIO()
    Image.fromarray(a).save(out, format="JPEG", quality=88)
    return out.getvalue(), w, h


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    path = tmp_path_factory.mktemp("loop") / "ds"
    imgs = [_photo_jpeg(i)[0] for i in range(24)]
    with kuat.Writer(path, {"image": kf.image(), "label": kf.int64()}) as w:
        w.write_batch({"image": imgs, "label": np.arange(24)})
    return path


def _rrc_flip():
    return Compose([RandomResizedCrop(64), RandomHorizontalFlip()])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fused_batches_equal_per_sample_apply_encoded(jpegs, num_workers):
    """The batch-hashed generators and the slot views leave every pixel as it was."""
    t = _rrc_flip()
    ds = kuat.open(jpegs).with_transform({"image": t})
    loader = kuat.DataLoader(ds, batch_size=8, shuffle=True, seed=5, num_workers=num_workers)
    raw = kuat.open(jpegs)
    for epoch in range(2):
        for batch in loader:
            labels = batch["label"].tolist()
            assert batch["image"].shape == (8, 3, 64, 64) and batch["image"].dtype == torch.uint8
            with rng.epoch_context(loader.seed, epoch):
                for j, i in enumerate(labels):
                    e = raw.raw(i)["image"]  # EncodedImage: the bytes and the indexed size
                    want = t.apply_encoded(e.data, e.width, e.height, rng.sample_rng(i).numpy)
                    np.testing.assert_array_equal(batch["image"][j].numpy(), want)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stats_split_fetch_into_native_kernels_and_python(jpegs, num_workers):
    ds = kuat.open(jpegs).with_transform({"image": _rrc_flip()})
    loader = kuat.DataLoader(ds, batch_size=8, num_workers=num_workers)
    for _ in range(2):
        for _ in loader:
            pass
    s = loader.stats()
    native, fetch = s["busy_s"]["native"], s["busy_s"]["fetch"]
    assert 0.0 < native <= fetch
    assert s["fetch_python_fraction"] == pytest.approx((fetch - native) / fetch)
    assert 0.0 <= s["loader_overhead_fraction"] <= s["input_bound_fraction"] <= 1.0
    assert s["loader_overhead_fraction"] == pytest.approx(
        s["loader_overhead_us_per_batch"] * 1e-6 * s["batches"] / s["elapsed_s"])


@pytest.mark.parametrize("num_workers,worker_type", [(0, None), (2, "thread"), (1, "process")])
def test_stats_report_python_time_per_sample(jpegs, num_workers, worker_type):
    """``python_us_per_sample`` (issue 31's GIL budget, measured inside): the workers' CPU
    outside the GIL-releasing kernels, the loop's own, and their sum in the main process
    (process workers' Python runs under their own GILs: not in ``main_process``)."""
    ds = kuat.open(jpegs).with_transform({"image": _rrc_flip()})
    loader = kuat.DataLoader(ds, batch_size=8, num_workers=num_workers, worker_type=worker_type)
    assert loader.stats()["python_us_per_sample"] == dict.fromkeys(
        ("workers", "consumer", "main_process"))
    for _ in loader:
        pass
    s = loader.stats()
    py = s["python_us_per_sample"]
    assert 0.0 < s["busy_s"]["native_cpu"] <= s["busy_s"]["fetch_cpu"]
    assert py["workers"] > 0.0 and py["consumer"] > 0.0
    in_main = py["consumer"] + (0.0 if worker_type == "process" else py["workers"])
    assert py["main_process"] == pytest.approx(in_main)


def test_stats_without_native_kernels_report_none():
    data = torch.arange(40).reshape(20, 2)
    loader = kuat.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4, num_workers=2)
    for _ in loader:
        pass
    s = loader.stats()
    assert s["busy_s"]["native"] == 0.0 and s["fetch_python_fraction"] is None


@pytest.fixture(scope="module")
def roi(tmp_path_factory):
    """The ROI decoder with ``taps``: the built one, else built here from source."""
    from _roi import build_roi_module

    from kuat.vision import decode as kdecode

    if hasattr(kdecode._roi, "taps"):
        return kdecode._roi
    return build_roi_module(tmp_path_factory.mktemp("roijpeg"))


def test_c_taps_equal_the_numpy_reference(roi, monkeypatch):
    """The ROI decoder's C ``taps`` (first batch: ~100 new crop sizes) gives the NumPy
    reference's start indices, int16 weights, tap count and precision exactly."""
    from kuat.vision import decode as kdecode

    sizes = list(range(1, 700, 3)) + [1023, 1024, 4097, 20000]  # taps > 128: pairwise recursion
    for out in (1, 3, 64, 224, 299):
        for inn in sizes:
            s, w, taps, precision = roi.taps(inn, out)
            rs, rw, rtaps, rprecision = kresize.taps_numpy(inn, out)
            assert (taps, precision) == (rtaps, rprecision), (inn, out)
            np.testing.assert_array_equal(np.frombuffer(s, np.int32), rs)
            np.testing.assert_array_equal(np.frombuffer(w, np.int16).reshape(out, taps), rw)
    with pytest.raises(ValueError, match="positive"):
        roi.taps(0, 224)
    monkeypatch.setattr(kdecode, "_roi", roi)
    start, weights, _, _ = kresize.taps.__wrapped__(517, 224)  # taps takes the C path
    assert not start.flags.writeable and not weights.flags.writeable
    np.testing.assert_array_equal(weights, kresize.taps_numpy(517, 224)[1])
