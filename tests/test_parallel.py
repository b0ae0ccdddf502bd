"""An epoch's first batch split over the waiting workers' cores (kuat._parallel, the loader's
dispatch, the vision batch kernel): same pixels, order and errors as an unsplit fetch; the
other workers start only once it is back; stats count the helpers' work."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from _images import jpeg_dataset, photo_jpeg
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

import kuat
from kuat import _parallel
from kuat.engine.thread import ThreadEngine
from kuat.errors import DecodeError
from kuat.vision import Compose, RandomHorizontalFlip, RandomResizedCrop
from kuat.vision import decode as kdecode


# -- kuat._parallel ------------------------------------------------------------------------------
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=80), st.integers(1, 8))
def test_split_even_covers_in_order_with_non_empty_balanced_ranges(costs, parts):
    ranges = _parallel.split_even(costs, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(costs)
    assert all(lo < hi for lo, hi in ranges)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert len(ranges) <= min(parts, len(costs))
    if parts <= len(costs):
        # greedy cut at each k/parts of the total: no range exceeds its share by more than
        # one item's cost
        share = sum(costs) / parts
        for lo, hi in ranges:
            assert sum(costs[lo:hi]) <= share + max(costs) + 1e-9


def test_split_even_uses_every_part_when_costs_are_equal():
    assert _parallel.split_even([1] * 64, 2) == [(0, 32), (32, 64)]
    assert _parallel.split_even([1] * 3, 4) == [(0, 1), (1, 2), (2, 3)]


def test_run_parts_returns_in_order_on_several_threads_and_counts_helper_work():
    seen = []

    def part(k):
        def fn():
            seen.append(threading.current_thread().name)
            return k * 10
        return fn

    before = _parallel.helper_totals()
    assert _parallel.run_parts([part(k) for k in range(3)]) == [0, 10, 20]
    assert seen.count(threading.current_thread().name) == 1  # the caller ran one part
    assert all(n.startswith("kuat-helper-") for n in seen if n != threading.current_thread().name)
    after = _parallel.helper_totals()
    assert all(a >= b for a, b in zip(after, before)) and after[0] > before[0]


def test_run_parts_raises_the_lowest_failing_part_after_all_parts_ended():
    done = threading.Event()
    gate = threading.Event()

    def slow_ok():
        gate.wait(5)
        done.set()

    def fail(msg):
        def fn():
            gate.set()
            raise KeyError(msg)
        return fn

    with pytest.raises(KeyError, match="first"):
        _parallel.run_parts([slow_ok, fail("first"), fail("second")])
    assert done.is_set()  # the caller's part finished before the error was raised
    with pytest.raises(KeyError, match="caller"):
        _parallel.run_parts([fail("caller"), fail("helper")])


def test_width_is_per_thread_and_nests():
    assert _parallel.width() == 1
    with _parallel.share(3):
        assert _parallel.width() == 3
        seen = []
        t = threading.Thread(target=lambda: seen.append(_parallel.width()))
        t.start()
        t.join()
        assert seen == [1]
        with _parallel.share(2):
            assert _parallel.width() == 2
        assert _parallel.width() == 3
    assert _parallel.width() == 1


# -- the vision batch kernel ---------------------------------------------------------------------
def _size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as im:
        return im.size


needs_roi = pytest.mark.skipif(not kdecode.roi_batch_available(),
                               reason="the ROI decoder's batch kernel is not built")


@pytest.fixture(params=["counter", "halves"])
def split_kind(request, monkeypatch):
    """The split first batch's two ways: a shared job counter (this build), or contiguous
    parts of about equal cost (a build that predates the counter)."""
    if request.param == "halves":
        monkeypatch.setattr("kuat.vision.compose.shares_jobs", lambda: False)
    return request.param


@needs_roi
@pytest.mark.parametrize("width", [2, 3, 5])
def test_split_batch_kernel_writes_the_same_pixels(width, split_kind):
    datas = [photo_jpeg(k) for k in range(13)]
    sizes = [_size(d) for d in datas]
    c = Compose([RandomResizedCrop(48), RandomHorizontalFlip()])
    assert c.splits_batches

    def run(w):
        out = np.zeros((len(datas), 3, 48, 48), np.uint8)
        rngs = [np.random.default_rng(100 + k) for k in range(len(datas))]
        with _parallel.share(w):
            c.apply_encoded_many(datas, [s[0] for s in sizes], [s[1] for s in sizes], rngs, out)
        return out

    np.testing.assert_array_equal(run(width), run(1))


@needs_roi
def test_split_batch_kernel_raises_the_first_bad_sample_in_sample_order(split_kind):
    good = [photo_jpeg(k) for k in range(8)]
    datas = list(good)
    datas[6] = b"not an image"  # in the last part
    datas[3] = good[3][: len(good[3]) // 3]  # truncated, in an earlier part
    sizes = [_size(d) for d in good]
    c = Compose([RandomResizedCrop(32)])
    out = np.zeros((8, 3, 32, 32), np.uint8)
    rngs = [np.random.default_rng(k) for k in range(8)]
    with _parallel.share(3), pytest.raises(DecodeError) as ei:
        c.apply_encoded_many(datas, [s[0] for s in sizes], [s[1] for s in sizes], rngs, out,
                             indices=list(range(100, 108)))
    assert ei.value.index == 103


@needs_roi
def test_batch_kernel_counter_shares_jobs_between_threads():
    """Calls on several threads with one shared counter take each job exactly once: the
    slots equal one call's, and each failing job is reported once, by the call that took it."""
    if not kdecode.shares_jobs():
        pytest.skip("this ROI decoder build has no job counter")
    from kuat.vision.resize import taps

    datas = [photo_jpeg(k) for k in range(23)]
    datas[5] = datas[5][: len(datas[5]) // 3]  # truncated: fails in whichever call takes it
    jobs = []
    for k, d in enumerate(datas):
        w, h = _size(photo_jpeg(k))
        jobs.append((d, 8, 0, h, 0, w, k, k % 2, *taps(w, 40), *taps(h, 30)))
    one = np.zeros((23, 3, 30, 40), np.uint8)
    expected = kdecode.decode_resize_batch(jobs, one)
    assert [k for k, _ in expected] == [5]
    shared = np.zeros((23, 3, 30, 40), np.uint8)
    counter = np.zeros(1, np.int32)
    parts = _parallel.run_parts(
        [lambda: kdecode.decode_resize_batch(jobs, shared, counter) for _ in range(3)]
    )
    assert sorted(k for part in parts for k, _ in part) == [5]
    assert counter[0] >= len(jobs)  # every job was taken
    np.testing.assert_array_equal(shared[[k for k in range(23) if k != 5]],
                                  one[[k for k in range(23) if k != 5]])
    with pytest.raises(ValueError, match="4-byte aligned"):
        kdecode.decode_resize_batch(jobs, shared, np.zeros(1, np.int8))


# -- the loader ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    imgs = [photo_jpeg(i) for i in range(40)]
    return jpeg_dataset(tmp_path_factory.mktemp("first") / "ds", imgs, truncated=[21])


def _dataset(path):
    return kuat.open(path).with_transform(
        {"image": Compose([RandomResizedCrop(40), RandomHorizontalFlip()])})


def _good_indices(n=40, bad=21):
    return [i for i in range(n) if i != bad]


class _Spy:
    """Records, in order, every task submitted to and every result taken from thread engines."""

    def __init__(self, monkeypatch):
        self.events = []
        calls = ThreadEngine.calls  # (what the loader's loop submits and gets through)
        spy = self

        def spy_calls(engine):
            submits, get = calls(engine)

            def spy_submit(put):
                def submit(task):
                    spy.events.append(("submit", task.task_id, task.width))
                    return put(task)
                return submit

            def spy_get(timeout_s=None):
                r = get(timeout_s)
                spy.events.append(("result", r.task_id, None))
                return r

            return [spy_submit(put) for put in submits], spy_get

        monkeypatch.setattr(ThreadEngine, "calls", spy_calls)


@needs_roi
def test_first_batch_goes_alone_with_every_workers_width(jpegs, monkeypatch):
    spy = _Spy(monkeypatch)
    loader = kuat.DataLoader(_dataset(jpegs), batch_size=6, num_workers=3, seed=1,
                             sampler=_good_indices(), persistent_workers=True)
    for _ in range(2):  # every epoch's first batch (persistent workers)
        spy.events.clear()
        batches = list(loader)
        first = spy.events[0]
        assert first[0] == "submit" and first[2] == 3
        # nothing else is submitted before the first batch is back; then the others start
        assert spy.events[1] == ("result", first[1], None)
        assert all(e[2] == 1 for e in spy.events[2:] if e[0] == "submit")
        assert len(batches) == 7
    # a source that does not split batches (a ConcatDataset of it: fetched per sample): the
    # usual dispatch, 2 workers x prefetch 2 submitted before any result
    ds = torch.utils.data.ConcatDataset([_dataset(jpegs)])
    spy.events.clear()
    for _ in kuat.DataLoader(ds, batch_size=6, num_workers=2, sampler=_good_indices()):
        pass
    assert [e[2] for e in spy.events[:4]] == [1, 1, 1, 1]
    assert [e[0] for e in spy.events[:4]] == ["submit"] * 4


@needs_roi
@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_split_first_batch_keeps_order_pixels_and_stats(jpegs, worker_type):
    def epochs(nw, wt):
        loader = kuat.DataLoader(_dataset(jpegs), batch_size=8, num_workers=nw, seed=3,
                                 sampler=_good_indices()[::-1], worker_type=wt)
        out = [[(b["label"].clone(), b["image"].clone()) for b in loader] for _ in range(2)]
        return out, loader.stats()

    want, _ = epochs(0, "thread")
    got, s = epochs(2, worker_type)
    for we, ge in zip(want, got, strict=True):
        for (wl, wi), (gl, gi) in zip(we, ge, strict=True):
            torch.testing.assert_close(gl, wl, rtol=0, atol=0)
            torch.testing.assert_close(gi, wi, rtol=0, atol=0)
    b = s["busy_s"]
    assert 0.0 < b["native"] <= b["fetch"] and b["fetch_cpu"] > 0.0
    assert s["samples"] == 2 * 39 and s["batches"] == 2 * 5


@pytest.mark.parametrize("num_workers", [0, 2])
def test_first_failing_sample_in_sample_order_is_raised(jpegs, num_workers):
    loader = kuat.DataLoader(_dataset(jpegs), batch_size=8, num_workers=num_workers,
                             sampler=[30, 31, 21, 33, 34, 35, 36, 37, 1, 2])
    it = iter(loader)
    with pytest.raises(DecodeError, match=r"\(sample 21, from "):
        next(it)
    assert next(it)["label"].tolist() == [1, 2]  # the iterator stays usable, as in torch


def test_inline_loader_never_splits(jpegs, monkeypatch):
    calls = []
    real = _parallel.run_parts
    monkeypatch.setattr(_parallel, "run_parts", lambda fns: calls.append(len(fns)) or real(fns))
    loader = kuat.DataLoader(_dataset(jpegs), batch_size=8, num_workers=0,
                             sampler=_good_indices())
    assert sum(len(b["label"]) for b in loader) == 39
    assert calls == []


def test_which_kuat_datasets_split_batches(jpegs):
    from kuat.sources import protocol as P

    raw = kuat.open(jpegs)
    assert not P.splits_batches(raw)  # decoded per sample, no fused batch kernel
    exact = raw.with_transform({"image": Compose([RandomResizedCrop(40)], exact_resize=True)})
    assert not P.splits_batches(exact)  # torch's resize per image
    unfixed = raw.with_transform({"image": Compose([RandomHorizontalFlip()])})
    assert not P.splits_batches(unfixed)  # no fixed output size: no batch buffer
    assert P.splits_batches(_dataset(jpegs)) == kdecode.roi_batch_available()


# -- wrappers: the first batch of a Subset, random_split part, StackDataset or mix is split ------
def _wrapped(jpegs, kind):
    ds = _dataset(jpegs)
    if kind == "Subset":
        return torch.utils.data.Subset(ds, _good_indices()[::-1])
    if kind == "random_split":
        sub = torch.utils.data.Subset(ds, _good_indices())
        return torch.utils.data.random_split(sub, [0.5, 0.5],
                                             generator=torch.Generator().manual_seed(0))[1]
    if kind == "StackDataset":
        return torch.utils.data.StackDataset(
            torch.utils.data.Subset(ds, _good_indices()), torch.arange(39))
    if kind == "mix":  # one splitting source and one that is not (fetched per sample)
        return kuat.mix([torch.utils.data.Subset(ds, _good_indices()),
                         torch.utils.data.ConcatDataset([ds, ds])], [3, 1], seed=2)
    raise AssertionError(kind)


WRAPPERS = ["Subset", "random_split", "StackDataset", "mix"]


def test_which_wrappers_split_batches(jpegs):
    from kuat.sources import protocol as P

    for kind in WRAPPERS:
        assert P.splits_batches(_wrapped(jpegs, kind)) == kdecode.roi_batch_available(), kind
    raw = kuat.open(jpegs)
    assert not P.splits_batches(torch.utils.data.Subset(raw, [0, 1]))  # the inner one does not
    assert not P.splits_batches(torch.utils.data.ConcatDataset([_dataset(jpegs)]))  # per sample

    class PerSample(torch.utils.data.Subset):  # its own __getitems__: torch's forward is gone
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    assert not P.splits_batches(PerSample(_dataset(jpegs), [0, 1]))
    # a mix splits only through a source it draws from
    assert not P.splits_batches(kuat.mix([_dataset(jpegs), list(range(5))], [0, 1]))


def _samples_of(batch):
    if isinstance(batch, (list, tuple)):  # StackDataset: (dataset's batch, labels)
        batch = batch[0]
    return batch["image"], batch["label"]


@needs_roi
@pytest.mark.parametrize("kind", WRAPPERS)
def test_wrappers_first_batch_is_split_with_the_unsplit_pixels(jpegs, kind, monkeypatch):
    def epoch(nw):
        loader = kuat.DataLoader(_wrapped(jpegs, kind), batch_size=6, num_workers=nw, seed=4)
        return [tuple(t.clone() for t in _samples_of(b)) for b in loader]

    want = epoch(0)
    spy = _Spy(monkeypatch)
    parts = []
    real = _parallel.run_parts
    monkeypatch.setattr(_parallel, "run_parts", lambda fns: parts.append(len(fns)) or real(fns))
    got = epoch(2)
    first = spy.events[0]
    assert first[0] == "submit" and first[2] == 2  # the first batch gets both workers' width
    assert spy.events[1] == ("result", first[1], None)  # and goes alone
    assert parts and parts[0] == 2  # the inner kernel really ran in 2 parts
    assert len(got) == len(want)
    for (wi, wl), (gi, gl) in zip(want, got, strict=True):
        torch.testing.assert_close(gl, wl, rtol=0, atol=0)
        torch.testing.assert_close(gi, wi, rtol=0, atol=0)
