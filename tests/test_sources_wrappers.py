"""Every loader hook passes through every wrapper where it is correct (``kuat.sources.protocol``,
"Wrappers"): torch's ``Subset`` / ``random_split`` / ``StackDataset`` / ``ConcatDataset`` and
``kuat.mix``, each with kuat datasets inside (the image one a ``with_transform`` view with a fused
transform whose ``Normalize`` is the loader's batch step; a view is a kuat dataset, its hooks are
its class's, and a flag set on one view's instance is not carried to another view, whose new
transforms may draw from global generators).

A table of wrappers x hooks: the hook's value through the wrapper against the bare dataset's
(and against what the wrapper's semantics allow: a ``ConcatDataset`` is read per sample, so it
never splits a batch nor collates it in one fetch); the loader takes the same path (its job's
flags, ``isolate_global_rng``, the prefetch calls it makes); and its batches equal torch's
DataLoader over the same wrapper (same seed, same sampler) where torch defines the answer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _images import jpeg_dataset, noise_image
from torch.utils.data import ConcatDataset, StackDataset, Subset, random_split

import kuat
import kuat.format as kf
from kuat.sources import protocol as P
from kuat.testing import assert_same_batch
from kuat.vision import Compose, Normalize, RandomHorizontalFlip, RandomResizedCrop
from kuat.vision import decode as kdecode

N = 24
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("wrappers")
    rng = np.random.default_rng(0)
    with kuat.Writer(root / "tab", {"x": kf.tensor((3,), "float32"), "y": kf.int64()}) as w:
        w.write_batch({"x": rng.random((N, 3), dtype=np.float32), "y": np.arange(N)})
    jpeg_dataset(root / "img", [noise_image(28, 20 + i % 5, i, quality=90) for i in range(N)])
    return root


def _tab(paths, k=0):
    ds = kuat.open(paths / "tab")
    if k:  # a second source: other values
        ds = ds.with_transform({"y": lambda y, k=k: y + 100 * k})
    return ds


def _img(paths):
    return kuat.open(paths / "img").with_transform(
        {"image": Compose([RandomResizedCrop(16), RandomHorizontalFlip(), Normalize(MEAN, STD)])})


def wrap(kind: str, a, b):
    """``kind`` around kuat datasets ``a`` (and ``b``, a second one of the same fields)."""
    if kind == "bare":
        return a
    if kind == "Subset":
        return Subset(a, list(range(N - 1, -1, -2)))
    if kind == "random_split":
        return random_split(a, [0.5, 0.5], generator=torch.Generator().manual_seed(0))[1]
    if kind == "StackDataset":
        return StackDataset(a, b)
    if kind == "StackDataset(dict)":
        return StackDataset(first=a, second=b)
    if kind == "ConcatDataset":
        return ConcatDataset([a, b])
    if kind == "mix":
        return kuat.mix([a, b], [2, 1], seed=3)
    if kind == "Subset(ConcatDataset)":
        return Subset(ConcatDataset([a, b]), list(range(0, 2 * N, 3)))
    raise AssertionError(kind)


WRAPPERS = ["bare", "Subset", "random_split", "StackDataset",
            "StackDataset(dict)", "ConcatDataset", "mix", "Subset(ConcatDataset)"]
PER_SAMPLE = {"ConcatDataset", "Subset(ConcatDataset)"}  # torch reads these per sample
# one collated fetch per batch (per part of a StackDataset)
ONE_FETCH = {"bare", "Subset", "random_split", "StackDataset", "StackDataset(dict)"}


# -- the hooks' values ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", WRAPPERS)
def test_hook_values_through_each_wrapper(paths, kind):
    tab, img = _tab(paths), _img(paths)
    w = wrap(kind, tab, _tab(paths, 1))
    assert P.thread_agnostic(w)  # every part is
    assert (P.fetch_collated(w) is not None) == (kind in ONE_FETCH)
    assert P.prefetcher(w) is not None
    # a kuat dataset without user transforms draws nothing from the global generators; the
    # second part's user transform (a lambda) may: only wrappers that read the first alone
    # keep the declaration
    assert P.uses_sample_rng(w) == (kind in ("bare", "Subset", "random_split"))
    assert P.uses_sample_rng(wrap(kind, tab, list(range(N))))  # a plain list draws nothing
    assert not P.uses_sample_rng(wrap(kind, _tab(paths, 1), _tab(paths, 1)))
    assert P.uses_sample_rng(wrap(kind, _img(paths), _img(paths)))  # kuat.vision transforms

    wi = wrap(kind, img, _img(paths))
    assert P.splits_batches(wi) == (kdecode.roi_batch_available() and kind not in PER_SAMPLE)
    step = P.batch_transform(wi)
    assert step is not None
    u8 = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    want = Normalize(MEAN, STD)(u8)
    if kind.startswith("StackDataset"):
        parts = {"first": {"image": u8}, "second": {"image": u8}} if "dict" in kind else [
            {"image": u8}, {"image": u8}]
        out = step(parts)
        assert type(out) is type(parts)
        for part in (out.values() if isinstance(out, dict) else out):
            assert torch.equal(part["image"], want)
    else:
        assert torch.equal(step({"image": u8})["image"], want)

    # not through a wrapper whose own methods replace torch's
    class Own(Subset):
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    own = Own(tab, [0, 1])
    assert not P.thread_agnostic(own) and P.fetch_collated(own) is None
    assert P.prefetcher(own) is None and P.batch_transform(Own(img, [0])) is None


# -- the loader takes the bare dataset's path ------------------------------------------------
@pytest.mark.parametrize("kind", WRAPPERS)
def test_loader_path_through_each_wrapper(paths, kind, monkeypatch):
    bare = kuat.DataLoader(_tab(paths), batch_size=4, num_workers=2)
    tab = _tab(paths)
    w = wrap(kind, tab, _tab(paths, 1))
    loader = kuat.DataLoader(w, batch_size=4, num_workers=2, shuffle=True, seed=5)
    assert loader._job.thread_agnostic == bare._job.thread_agnostic is True
    assert loader._job.fetch_collated == (kind in ONE_FETCH)
    assert bare.isolate_global_rng is False  # a kuat dataset without user transforms
    # the second part's user transform may draw from the global generators
    assert loader.isolate_global_rng == (kind not in ("bare", "Subset", "random_split"))

    # prefetch: the inner dataset is told the samples it will read, in reading order
    seen = []
    monkeypatch.setattr(tab, "kuat_prefetch", seen.extend)
    order = [int(i) for i in loader.sampler.indices(0)]
    inner = _inner_indices(kind, w, order)
    ys = [int(y) for b in loader for y in _labels(b)]
    assert seen == inner
    assert ys == [_label(kind, w, i) for i in order]


def _inner_indices(kind, w, order):
    """Which samples of the first dataset positions ``order`` of ``w`` read, in order."""
    if kind == "bare":
        return order
    if kind in ("Subset", "random_split"):
        return [w.indices[i] for i in order]
    if kind.startswith("StackDataset"):
        return order
    if kind == "ConcatDataset":
        return [i for i in order if i < N]
    if kind == "Subset(ConcatDataset)":
        return [w.indices[i] for i in order if w.indices[i] < N]
    if kind == "mix":
        return [int(w.positions[i]) for i in order if w.source_ids[i] == 0]  # epoch 0's window
    raise AssertionError(kind)


def _labels(batch):
    if isinstance(batch, dict) and "first" in batch:
        return batch["first"]["y"]
    if isinstance(batch, list):
        return batch[0]["y"]
    return batch["y"]


def _label(kind, w, i):
    s = w[i]
    if isinstance(s, tuple):
        s = s[0]
    elif "first" in s:
        s = s["first"]
    return int(s["y"])


# -- batches equal torch's DataLoader over the same wrapper ------------------------------------
@pytest.mark.parametrize(("num_workers", "worker_type"), [(0, None), (2, "thread")])
@pytest.mark.parametrize("kind", WRAPPERS)
def test_batches_equal_torch_over_the_same_wrapper(paths, kind, num_workers, worker_type):
    w = wrap(kind, _tab(paths), _tab(paths, 1))
    torch.manual_seed(0)
    want = list(torch.utils.data.DataLoader(w, batch_size=5, shuffle=True))
    torch.manual_seed(0)
    got = list(kuat.DataLoader(w, batch_size=5, shuffle=True, num_workers=num_workers,
                               worker_type=worker_type))
    assert len(got) == len(want)
    for k, (g, t) in enumerate(zip(got, want, strict=True)):
        assert_same_batch(g, t, f"{kind} batch {k}")


def test_process_workers_fetch_a_subset_collated(paths):
    w = wrap("random_split", _tab(paths), None)
    torch.manual_seed(0)
    want = list(torch.utils.data.DataLoader(w, batch_size=5, shuffle=True))
    torch.manual_seed(0)
    loader = kuat.DataLoader(w, batch_size=5, shuffle=True, num_workers=2, worker_type="process")
    assert loader._job.fetch_collated
    for k, (g, t) in enumerate(zip(list(loader), want, strict=True)):
        assert_same_batch(g, t, f"batch {k}")


@pytest.mark.parametrize("kind", ["Subset", "random_split", "StackDataset", "mix"])
def test_image_batches_through_a_wrapper_get_the_batch_step(paths, kind):
    """With a fused image transform whose Normalize is the loader's batch step, a wrapper's
    batches are the bare dataset's (same samples, same per-sample draws), normalised."""
    img = _img(paths)
    w = wrap(kind, img, _img(paths))
    got = list(kuat.DataLoader(w, batch_size=4, num_workers=2, seed=7))
    assert got
    for b in got:
        parts = b if isinstance(b, list) else [b]
        for part in parts:
            assert part["image"].dtype == torch.float32 and part["image"].shape[1:] == (3, 16, 16)
    if kind in ("Subset", "random_split"):  # the bare dataset read in the subset's order
        want = list(kuat.DataLoader(img, batch_size=4, num_workers=2, seed=7,
                                    sampler=list(w.indices)))
        for k, (g, t) in enumerate(zip(got, want, strict=True)):
            assert_same_batch(g, t, f"{kind} batch {k}")


class _GlobalCrop(RandomResizedCrop):
    """A user's step in a kuat Compose: its box drawn from NumPy's global generator."""

    def get_params(self, height, width, rng):
        return super().get_params(height, width, np.random.default_rng(np.random.randint(2**31)))


def test_a_user_step_in_a_kuat_compose_keeps_isolation(paths):
    """``kuat_uses_sample_rng`` looked at the Compose's class only (kuat.vision's), so a user
    subclass inside it turned isolation off and its global draws made the pixels depend on
    the caller's NumPy state; the steps count too."""
    img = kuat.open(paths / "img")
    assert P.uses_sample_rng(img.with_transform({"image": Compose([RandomResizedCrop(16)])}))
    ds = img.with_transform({"image": Compose([_GlobalCrop(16), RandomHorizontalFlip()])})
    assert not P.uses_sample_rng(ds)
    runs = []
    for state in (1, 2):
        np.random.seed(state)
        loader = kuat.DataLoader(ds, batch_size=4, num_workers=2, seed=3)
        assert loader.isolate_global_rng
        runs.append([b["image"] for b in loader])
    for k, (a, b) in enumerate(zip(*runs, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"batch {k}")
