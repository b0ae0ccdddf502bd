"""kuat.device: pin_batch (torch's pin_memory walk, except that tensors already on another
device pass through: a batch decoded on the GPU meets the loader's implicit pinning), and the
device stage's batch step: a fused image transform's Normalize runs once per batch, after the
copy, as the loader's step; its output is exactly Normalize of the uint8 batch the same loader
gives without it, wherever the batch is (no device, device="cpu", CUDA), and within float32
rounding of torchvision's ToDtype(scale=True) + Normalize."""

from __future__ import annotations

import collections
import io

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory
from torchvision.transforms import v2 as T2

import kuat
import kuat.format as kf
from kuat.device import FieldSteps, pin_batch
from kuat.vision import Compose, Normalize, RandomHorizontalFlip, RandomResizedCrop

Point = collections.namedtuple("Point", "x y")


class Pinnable:
    """A custom batch type with its own pin_memory(), which torch's walk calls."""

    def __init__(self, t):
        self.t = t

    def pin_memory(self):
        return Pinnable(self.t.pin_memory())


class Tagged(dict):
    """A mapping type with an attribute: torch's walk keeps it (copy + update)."""

    tag = "kept"


def _fake_pinning(monkeypatch):
    """Tensor.pin_memory replaced by a marked clone (this machine may have no accelerator)."""

    def fake(self, *a, **k):
        out = self.clone()
        out.fake_pinned = True
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake)


def _batch(device_tensor):
    return {
        "image": device_tensor,
        "label": torch.arange(4),
        "pair": (torch.zeros(2), "s"),
        "point": Point(torch.ones(1), 3),
        "list": [torch.zeros(1), b"raw"],
        "tagged": Tagged(a=torch.zeros(1)),
        "custom": Pinnable(torch.zeros(1)),
    }


def _shape(x):
    """Containers, types and fake-pinned flags of a batch, for comparison."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.device.type, getattr(x, "fake_pinned", False))
    if isinstance(x, Pinnable):
        return ("pinnable", _shape(x.t))
    if isinstance(x, dict):
        return (type(x), {k: _shape(v) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return (type(x), [_shape(v) for v in x])
    return x


def test_pin_batch_walks_containers_as_torch_does(monkeypatch):
    _fake_pinning(monkeypatch)
    cpu = _batch(torch.zeros(4, 3))
    assert _shape(pin_batch(cpu)) == _shape(torch_pin_memory(cpu))
    assert pin_batch(cpu)["tagged"].tag == "kept"


def test_pin_batch_passes_tensors_on_another_device_through(monkeypatch):
    _fake_pinning(monkeypatch)
    on_device = torch.empty(4, 3, device="meta")  # stands in for a CUDA tensor
    out = pin_batch(_batch(on_device))
    assert out["image"] is on_device
    assert out["label"].fake_pinned and out["pair"][0].fake_pinned
    expected = _shape(torch_pin_memory(_batch(torch.zeros(4, 3))))
    expected[1]["image"] = ("tensor", "meta", False)
    assert _shape(out) == expected


class _DecodedOnGpu(torch.utils.data.Dataset):
    """Batches built on the GPU by the dataset itself, as Compose(decode_device="cuda") does."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"image": torch.full((3, 2, 2), i, dtype=torch.uint8, device="cuda"), "label": i}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_already_on_the_gpu_go_through_device_cuda(num_workers):
    dl = kuat.DataLoader(
        _DecodedOnGpu(), batch_size=4, num_workers=num_workers, worker_type="thread", device="cuda"
    )
    out = list(dl)
    assert [b["image"].device.type for b in out] == ["cuda", "cuda"]
    assert out[1]["image"][:, 0, 0, 0].tolist() == [4, 5, 6, 7]
    assert out[1]["label"].device.type == "cuda" and out[1]["label"].tolist() == [4, 5, 6, 7]


MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("dev") / "img.kuat"
    rng = np.random.default_rng(0)
    with kuat.Writer(str(root), {"image": kf.image(), "label": kf.int64()}) as w:
        for i in range(24):
            buf = io.BytesIO()
            h, wd = (int(v) for v in rng.integers(20, 48, 2))
            Image.fromarray(rng.integers(0, 255, (h, wd, 3), dtype=np.uint8)).save(buf, "JPEG")
            w.write({"image": buf.getvalue(), "label": i})
    return kuat.open(str(root))


def _geometry():
    return [RandomResizedCrop(12), RandomHorizontalFlip()]


def _batches(ds, normalize: bool, **kw):
    steps = _geometry() + ([Normalize(MEAN, STD)] if normalize else [])
    src = ds.with_transform({"image": Compose(steps)})
    return list(kuat.DataLoader(src, batch_size=8, shuffle=True, seed=7, **kw))


@pytest.mark.parametrize("kw", [{}, {"device": "cpu"}, {"num_workers": 2}],
                         ids=["host", "device-cpu", "threads"])
def test_normalize_is_the_loaders_batch_step_and_bit_identical(images, kw):
    raw = _batches(images, normalize=False, **kw)
    out = _batches(images, normalize=True, **kw)
    norm = Normalize(MEAN, STD)
    for r, o in zip(raw, out, strict=True):
        assert r["image"].dtype == torch.uint8 and r["image"].shape == (8, 3, 12, 12)
        assert o["image"].dtype == torch.float32
        assert torch.equal(o["image"], norm(r["image"]))  # the same op, once per batch
        assert torch.equal(o["label"], r["label"])
        ref = T2.Normalize(MEAN, STD)(T2.ToDtype(torch.float32, scale=True)(r["image"]))
        torch.testing.assert_close(o["image"], ref, atol=1e-5, rtol=1e-5)


def test_the_source_declares_the_step_and_the_device_stage_applies_it(images):
    src = images.with_transform({"image": Compose([*_geometry(), Normalize(MEAN, STD)])})
    step = src.kuat_batch_transform
    assert isinstance(step, FieldSteps) and list(step.fns) == ["image"]
    # the source itself never normalises: its samples and collated batches stay uint8
    assert src[0]["image"].dtype == torch.uint8
    assert src.kuat_fetch_collated([0, 1])["image"].dtype == torch.uint8
    batch = {"image": torch.zeros(2, 3, 4, 4, dtype=torch.uint8), "label": torch.arange(2)}
    out = step(batch)
    assert out is not batch and batch["image"].dtype == torch.uint8  # input left alone
    assert torch.equal(out["label"], batch["label"])
    with pytest.raises(TypeError, match="expects the collated batch to be a dict"):
        step([batch["image"]])


def test_a_mix_applies_its_sources_step_once(images):
    t = Compose([*_geometry(), Normalize(MEAN, STD)])
    mixed = kuat.mix([images.with_transform({"image": t})], [1.0], seed=1)
    raw = kuat.mix([images.with_transform({"image": Compose(_geometry())})], [1.0], seed=1)
    a = list(kuat.DataLoader(mixed, batch_size=8, seed=2))
    b = list(kuat.DataLoader(raw, batch_size=8, seed=2))
    assert all(torch.equal(x["image"], Normalize(MEAN, STD)(y["image"])) for x, y in zip(a, b))


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("num_workers", [0, 2])
def test_on_cuda_normalize_runs_after_the_copy_and_matches_the_host(images, num_workers):
    raw = _batches(images, normalize=False, num_workers=num_workers)
    out = _batches(images, normalize=True, device="cuda", num_workers=num_workers)
    norm = Normalize(MEAN, STD)
    for r, o in zip(raw, out, strict=True):
        assert o["image"].device.type == "cuda" and o["image"].dtype == torch.float32
        assert torch.equal(o["image"], norm(r["image"].cuda()))  # normalised on the device
        torch.testing.assert_close(o["image"].cpu(), norm(r["image"]), atol=1e-6, rtol=1e-6)
