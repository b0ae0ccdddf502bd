"""The Source protocol (kuat.sources.protocol): kuat's sources implement the hooks they claim,
the loader honours every hook through the protocol (a hook set to None is absent), and no
other module looks a ``kuat_*`` source hook up by name."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import kuat
import kuat.format as kf
from kuat.sources import protocol as P
from kuat.sources.dataset import Dataset
from kuat.vision import Compose, Normalize, RandomResizedCrop

SRC = Path(kuat.__file__).parent


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    root = tmp_path_factory.mktemp("proto") / "t.kuat"
    with kuat.Writer(str(root), {"x": kf.tensor((2,), "int32"), "y": kf.int64()}, shard_bytes=256) as w:
        for i in range(40):
            w.write({"x": np.array([i, -i], np.int32), "y": i})
    return str(root)


def test_kuat_dataset_implements_the_map_style_hooks(table):
    ds = kuat.open(table)
    assert type(ds) is Dataset and kuat.Dataset is Dataset
    assert kuat.open is kuat.sources.dataset.open_dataset
    for proto in (P.MapSource, P.BatchFetch, P.CollatedFetch, P.Prefetching):
        assert isinstance(ds, proto) and P.provides(ds, proto), proto.__name__
    for proto in (P.EpochAware, P.Distributed, P.Batching, P.Stateful):
        assert not isinstance(ds, proto) and not P.provides(ds, proto), proto.__name__
    assert P.thread_agnostic(ds)
    # draws only from kuat.sample_rng (no global generators to isolate) unless a transform
    # other than kuat.vision's may draw from them
    assert P.uses_sample_rng(ds)
    assert not P.uses_sample_rng(ds.with_transform({"x": lambda v: v}))
    assert not P.uses_sample_rng(ds.with_transform(lambda sample: sample))
    assert not P.splits_batches(ds)  # no fused image transform: nothing to split
    assert P.batch_transform(ds) is None
    # a fused transform with Normalize gives the loader a batch step for that field
    t = Compose([RandomResizedCrop(4), Normalize([0.5] * 3, [0.25] * 3)])
    assert P.batch_transform(ds.with_transform({"x": lambda v: v})) is None
    with pytest.raises(TypeError, match="image fields only"):
        ds.with_transform({"x": t})


def test_a_kuat_dataset_view_can_declare_it_uses_the_sample_rng(table):
    """What the loader's advice says to do for a user transform drawing from
    ``kuat.sample_rng``: assign ``kuat_uses_sample_rng`` on the view (it became a read-only
    property, so that raised AttributeError). It holds for that view only."""
    ds = kuat.open(table)
    view = ds.with_transform({"y": lambda y: y + int(kuat.sample_rng().numpy.integers(3))})
    assert not P.uses_sample_rng(view)
    view.kuat_uses_sample_rng = True
    assert P.uses_sample_rng(view)
    assert kuat.DataLoader(view, batch_size=4).isolate_global_rng is False
    assert not P.uses_sample_rng(view.with_transform({"y": lambda y: y}))  # a new view
    ds.kuat_uses_sample_rng = False  # and the other way
    assert not P.uses_sample_rng(ds)


def test_kuat_streams_implement_the_iterable_hooks(table):
    ds = kuat.open(table)
    stream = kuat.shuffle_buffer(ds, 8, seed=0)
    for proto in (P.EpochAware, P.Distributed, P.Batching):
        assert isinstance(stream, proto) and P.provides(stream, proto), proto.__name__
    assert not P.provides(stream, P.MapSource)
    with pytest.raises(TypeError, match="not a protocol"):
        P.provides(stream, torch.utils.data.Dataset)
    mixed = kuat.mix([ds, ds], [1.0, 1.0])
    assert isinstance(mixed, P.MapSource) and P.batch_transform(mixed) is None


class Recording(torch.utils.data.Dataset):
    """A map-style source with every map-style hook, recording how the loader calls them."""

    kuat_uses_sample_rng = True
    kuat_thread_agnostic = True

    def __init__(self, n=12):
        self.n, self.calls = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"v": torch.tensor([i], dtype=torch.int64)}

    def __getitems__(self, indices):
        self.calls.append(("getitems", list(indices)))
        return [self[i] for i in indices]

    def kuat_fetch_collated(self, indices):
        self.calls.append(("collated", list(indices)))
        return {"v": torch.tensor(list(indices), dtype=torch.int64)[:, None]}  # (B, 1)

    def kuat_prefetch(self, indices):
        self.calls.append(("prefetch", list(indices)))

    def kuat_batch_transform(self, batch):
        return {"v": batch["v"] * 10}

    def state_dict(self):
        return {"calls": len(self.calls)}

    def load_state_dict(self, state):
        self.calls.append(("load", state))


def test_the_loader_honours_every_map_style_hook():
    src = Recording()
    dl = kuat.DataLoader(src, batch_size=4, shuffle=True, seed=3, num_workers=0)
    assert dl.isolate_global_rng is False  # kuat_uses_sample_rng
    batches = list(dl)
    order = [i for b in batches for i in (b["v"][:, 0] // 10).tolist()]
    # kuat_prefetch: once, with the epoch's order, before any batch is fetched
    assert src.calls[0] == ("prefetch", order)
    # kuat_fetch_collated (default collate), never __getitems__; kuat_batch_transform after
    assert [c[0] for c in src.calls[1:]] == ["collated"] * 3
    assert all(torch.equal(b["v"], torch.tensor(c[1])[:, None] * 10)
               for b, c in zip(batches, src.calls[1:]))
    state = dl.state_dict()
    assert state["source"] == {"calls": 4}
    kuat.DataLoader(src, batch_size=4).load_state_dict(state)
    assert src.calls[-1] == ("load", {"calls": 4})
    # a custom collate: the per-sample fetch (__getitems__), same values
    src.calls.clear()
    custom = list(kuat.DataLoader(src, batch_size=4, shuffle=True, seed=3,
                                  collate_fn=lambda s: {"v": torch.stack([x["v"] for x in s])}))
    assert [c[0] for c in src.calls] == ["prefetch"] + ["getitems"] * 3
    assert all(torch.equal(a["v"], b["v"]) for a, b in zip(batches, custom))


def test_a_hook_set_to_none_is_absent():
    src = Recording()
    src.kuat_fetch_collated = None
    src.kuat_prefetch = None
    src.kuat_batch_transform = None
    assert not P.provides(src, P.CollatedFetch) and not P.provides(src, P.Prefetching)
    assert isinstance(src, P.Prefetching)  # isinstance sees the class's method: not the test
    batches = list(kuat.DataLoader(src, batch_size=4))
    assert [c[0] for c in src.calls] == ["getitems"] * 3
    assert torch.equal(batches[0]["v"][:, 0], torch.arange(4))  # no batch step


class Iterable(torch.utils.data.IterableDataset):
    """An iterable source with the iterable hooks, recording the calls it gets."""

    calls: list = []  # shared by the workers' copies

    def set_epoch(self, epoch):
        self.calls.append(("set_epoch", epoch))

    def kuat_set_distributed(self, rank, world_size):
        self.calls.append(("distributed", rank, world_size))

    def kuat_set_batching(self, batch_size, drop_last):
        self.calls.append(("batching", batch_size, drop_last))

    def __iter__(self):
        return iter(range(6))


def test_the_loader_honours_every_iterable_hook():
    Iterable.calls = []
    src = Iterable()
    dl = kuat.DataLoader(src, batch_size=3, drop_last=True, rank=1, world_size=2)
    assert Iterable.calls == [("batching", 3, True)]  # at construction
    for epoch in range(2):
        dl.set_epoch(epoch)
        assert [b.tolist() for b in dl] == [[0, 1, 2], [3, 4, 5]]
    assert Iterable.calls[1:] == [("distributed", 1, 2), ("set_epoch", 0), ("set_epoch", 1)]


def test_hooks_are_looked_up_only_through_the_protocol():
    # getattr/hasattr of a kuat_* hook anywhere but the protocol module would be a second,
    # undocumented list of hooks; providers define them, only kuat.sources.protocol reads them
    pattern = re.compile(r"""(?:getattr|hasattr)\([^()]*["']kuat_(\w+)["']""")
    offenders = []
    for path in SRC.rglob("*.py"):
        if path == SRC / "sources" / "protocol.py":
            continue
        for m in pattern.finditer(path.read_text()):
            # not source hooks: the samplers' (kuat.sampling, kuat._sampler_order, the share
            # check in kuat.loader._options), a fetched batch's (kuat.padding)
            sampler_hook = (path in (SRC / "sampling.py", SRC / "_sampler_order.py", SRC / "loader" / "_options.py")
                            and m.group(1) == "set_distributed")
            if m.group(1) not in ("set_epoch", "columns") and not sampler_hook:
                offenders.append(f"{path.relative_to(SRC)}: kuat_{m.group(1)}")
    assert offenders == []
    # and every hook a kuat source provides is one the protocol documents
    documented = set(re.findall(r"``(kuat_\w+)``", (SRC / "sources" / "protocol.py").read_text()))
    provided = set()
    for path in (SRC / "sources").glob("*.py"):
        provided |= set(re.findall(r"(?:def |\.|^\s+)(kuat_\w+)\s*[(=:]", path.read_text(), re.M))
    assert provided and provided <= documented, provided - documented


def test_what_the_source_asks_of_a_fused_transform_is_in_the_vision_protocol():
    from kuat.vision.protocol import (
        BatchDecodingTransform,
        FusedImageTransform,
        decodes_batches,
        is_fused,
        takes_location,
    )

    t = Compose([RandomResizedCrop(4)])
    assert isinstance(t, FusedImageTransform) and isinstance(t, BatchDecodingTransform)
    assert is_fused(t) and takes_location(t)  # index=/source= are in its signature
    assert not decodes_batches(t)  # decode_device="cpu": per-sample apply_encoded

    class Minimal:  # only the required method, without the optional keywords
        def apply_encoded(self, data, width, height, rng, out=None):
            return out

    assert is_fused(Minimal()) and not takes_location(Minimal())
    assert not decodes_batches(Minimal())
