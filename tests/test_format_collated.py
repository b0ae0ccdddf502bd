"""kuat datasets' collated batch fetch (``kuat_fetch_collated``) equals collating the samples.

The default-collate path of the loader goes from the columnar gather straight to batch tensors;
these tests pin that it gives what ``default_collate(ds.__getitems__(indices))`` (and torch's
``default_collate``) give, for every field type, with and without transforms.
"""

import numpy as np
import pytest
import torch
from _images import noise_image
from _same import assert_same
from torch.utils.data import default_collate as torch_collate

import kuat
import kuat.format as kf
from kuat.collate import batch_scope, default_collate
from kuat.vision import RandomResizedCrop

N = 12
INDICES = [5, 0, 11, 3, 3, 7, -1]


@pytest.fixture(scope="module")
def every_type(tmp_path_factory):
    rng = np.random.default_rng(0)
    schema = {
        "i8": kf.int8(), "i32": kf.int32(), "i64": kf.int64(), "u8": kf.uint8(),
        "u16": kf.uint16(), "u32": kf.uint32(), "u64": kf.uint64(),
        "f16": kf.float16(), "f32": kf.float32(), "f64": kf.float64(), "flag": kf.bool_(),
        "t_u8": kf.tensor((2, 3), "uint8"), "t_u16": kf.tensor((4,), "uint16"),
        "t_f16": kf.tensor((3,), "float16"), "t_i64": kf.tensor((2,), "int64"),
        "text": kf.string(), "blob": kf.binary(), "seq": kf.sequence("int32"), "image": kf.image(),
    }
    cols = {
        "i8": rng.integers(-128, 127, N).astype(np.int8),
        "i32": rng.integers(-(2**31), 2**31 - 1, N).astype(np.int32),
        "i64": rng.integers(-(2**62), 2**62, N),
        "u8": rng.integers(0, 255, N).astype(np.uint8),
        "u16": rng.integers(0, 2**16 - 1, N).astype(np.uint16),
        "u32": rng.integers(0, 2**32 - 1, N).astype(np.uint32),
        "u64": rng.integers(0, 2**62, N).astype(np.uint64),
        "f16": rng.standard_normal(N).astype(np.float16),
        "f32": rng.standard_normal(N).astype(np.float32),
        "f64": rng.standard_normal(N),
        "flag": rng.integers(0, 2, N).astype(bool),
        "t_u8": rng.integers(0, 255, (N, 2, 3)).astype(np.uint8),
        "t_u16": rng.integers(0, 2**16 - 1, (N, 4)).astype(np.uint16),
        "t_f16": rng.standard_normal((N, 3)).astype(np.float16),
        "t_i64": rng.integers(-9, 9, (N, 2)),
        "text": [f"row {i} é" for i in range(N)],
        "blob": [bytes([i]) * 3 for i in range(N)],
        "seq": [np.arange(i, i + 3, dtype=np.int32) for i in range(N)],  # equal lengths: stackable
        "image": [noise_image(32, 24, i, quality=90) for i in range(N)],
    }
    path = tmp_path_factory.mktemp("every") / "ds"
    with kuat.Writer(path, schema, shard_bytes=4096) as w:  # several shards
        w.write_batch(cols)
    ds = kuat.open(path)
    assert ds.num_shards > 1
    return ds


def _check(ds, indices=INDICES):
    with batch_scope():
        fast = ds.kuat_fetch_collated(indices)
    with batch_scope():
        samples = ds.__getitems__(indices)
        want = default_collate(samples)
    assert_same(fast, want)
    return fast, samples


def test_every_field_type_matches_collating_the_samples(every_type):
    fast, samples = _check(every_type)
    assert_same(fast, torch_collate(samples))  # and torch's own default_collate
    assert fast["i8"].dtype == torch.int64 and fast["f16"].dtype == torch.float64
    assert fast["t_u16"].shape == (len(INDICES), 4) and fast["text"][0] == "row 5 é"


def test_field_and_sample_transforms_match_collating_the_samples(every_type):
    seen = []

    def label(v):
        seen.append(kuat.sample_rng().seed)  # the sample's own index is set
        return v * 2

    ds = every_type.with_transform({"i64": label, "image": RandomResizedCrop(8)})
    fast, _ = _check(ds)
    assert fast["image"].shape == (len(INDICES), 3, 8, 8) and len(seen) == 2 * len(INDICES)
    assert seen[: len(INDICES)] == seen[len(INDICES):]
    _check(every_type.with_transform(lambda s: {"x": s["i32"], "t": s["t_f16"]}))


def test_the_loader_uses_the_collated_fetch_and_gives_todays_batches(every_type):
    def collate(samples):  # a custom collate_fn: the per-sample path, same outputs
        return default_collate(samples)

    for workers in (0, 2):
        fast = kuat.DataLoader(every_type, batch_size=5, shuffle=True, seed=3, num_workers=workers)
        slow = kuat.DataLoader(every_type, batch_size=5, shuffle=True, seed=3, num_workers=workers,
                               collate_fn=collate)
        assert fast._job.fetch_collated and not slow._job.fetch_collated
        for a, b in zip(fast, slow, strict=True):
            assert_same(a, b)


def test_the_collated_fetch_validates_indices_like_getitems(every_type):
    for bad, exc in (([N], IndexError), ([-N - 1], IndexError), ([1.5], TypeError),
                     ([[1, 2]], TypeError)):
        with pytest.raises(exc):
            every_type.kuat_fetch_collated(bad)
        with pytest.raises(exc):
            every_type.__getitems__(bad)
    _check(every_type, np.array([2, 1]))
    _check(every_type, torch.tensor([4, 4]))


def test_a_fused_image_batch_is_returned_as_its_batch_buffer(every_type, monkeypatch):
    """The fused transform fills one (B, 3, H, W) buffer: the collated fetch returns it as it
    is (no split into B views and collate back), pool-backed inside the loader's scope, and
    equal to collating the samples' views."""
    import kuat.collate as kcollate
    from kuat._buffers import BufferPool
    from kuat.vision import Compose, RandomHorizontalFlip

    ds = every_type.with_transform({"image": Compose([RandomResizedCrop(240),
                                                      RandomHorizontalFlip()])})
    collated = []
    real = kcollate.default_collate
    monkeypatch.setattr(kcollate, "default_collate", lambda b: collated.append(b) or real(b))
    pool = BufferPool()
    with batch_scope(pool):
        fast = ds.kuat_fetch_collated(INDICES)
    image = fast["image"]  # (B, 3, 240, 240) uint8: 1.2 MiB, from the pool
    assert image.shape == (len(INDICES), 3, 240, 240) and image.is_contiguous()
    assert pool.created == 1 and image.untyped_storage().nbytes() == image.numel()
    assert not any(isinstance(v, torch.Tensor) and v.shape == (3, 240, 240)
                   for b in collated for v in b)  # the image field was never collated
    monkeypatch.setattr(kcollate, "default_collate", real)
    with batch_scope():
        want = default_collate(ds.__getitems__(INDICES))
    assert_same(fast, want)
    outside = ds.kuat_fetch_collated(INDICES)["image"]  # no scope: a fresh torch.empty buffer
    assert outside.is_contiguous() and torch.equal(outside, image)
