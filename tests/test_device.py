"""kuat.device.pin_batch: torch's pin_memory walk, except that tensors already on another
device pass through (a batch decoded on the GPU meets the loader's implicit pinning)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

import kuat
from kuat.device import pin_batch

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
