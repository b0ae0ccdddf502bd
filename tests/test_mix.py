"""kuat.mix and kuat.shuffle_buffer: weights, stopping rules, determinism, no drops or duplicates."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

import kuat
from kuat.sources.mixture import MapMix, MixStream


class Stream(torch.utils.data.IterableDataset):
    """A plain torch iterable (no sharding of its own)."""

    def __init__(self, items):
        self.items = list(items)

    def __iter__(self):
        return iter(self.items)


def _all(source):
    if isinstance(source, MapMix):
        return [source[i] for i in range(len(source))]
    return list(source)


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_zero_weight_source_does_not_count_and_empty_source_ends_at_once(kind):
    wrap = list if kind == "map" else Stream
    m = kuat.mix([wrap(range(5)), wrap(range(10, 15))], weights=[1, 0], stopping="all_exhausted")
    assert isinstance(m, MapMix if kind == "map" else MixStream)
    assert _all(m) == [0, 1, 2, 3, 4]
    empty_first = kuat.mix([wrap([]), wrap(range(10, 15))], [1, 0], "all_exhausted")
    assert _all(empty_first) == []
    # first_exhausted: an empty source with a positive weight ends the mix at once
    assert _all(kuat.mix([wrap([]), wrap(range(10, 15))], [1, 1], "first_exhausted")) == []
    # all_exhausted: it simply leaves the draw
    assert _all(kuat.mix([wrap([]), wrap(range(10, 15))], [1, 1], "all_exhausted")) == list(
        range(10, 15)
    )


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_all_exhausted_yields_every_sample_once_in_source_order(kind):
    wrap = list if kind == "map" else Stream
    sources = [wrap(range(0, 30)), wrap(range(100, 110)), wrap(range(200, 250))]
    out = _all(kuat.mix(sources, weights=[3, 1, 1], stopping="all_exhausted", seed=5))
    assert sorted(out) == list(range(30)) + list(range(100, 110)) + list(range(200, 250))
    for lo in (0, 100, 200):  # each source is read in its own order
        mine = [x for x in out if lo <= x < lo + 100]
        assert mine == sorted(mine)
    # weight 3 source is drawn first: it dominates the first 20 picks
    assert sum(x < 100 for x in out[:20]) >= 9


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_first_exhausted_stops_when_a_picked_source_is_empty(kind):
    wrap = list if kind == "map" else Stream
    out = _all(kuat.mix([wrap(range(5)), wrap(range(100, 200))], [1, 1], seed=2))
    small = [x for x in out if x < 5]
    assert small == [0, 1, 2, 3, 4]  # the small source ran out ...
    assert len(out) < 105 and out[-1] >= 100 or out[-1] == 4  # ... and ended the mix
    big = [x for x in out if x >= 100]
    assert big == list(range(100, 100 + len(big)))


def test_deterministic_from_seed_and_weights_roughly_respected():
    sources = [list(range(10_000)), list(range(10_000, 20_000))]
    a = kuat.mix(sources, weights=[0.8, 0.2], seed=1)
    b = kuat.mix(sources, weights=[0.8, 0.2], seed=1)
    c = kuat.mix(sources, weights=[0.8, 0.2], seed=2)
    assert np.array_equal(a.source_ids, b.source_ids)
    assert not np.array_equal(a.source_ids[:100], c.source_ids[:100])
    share = float(np.mean(a.source_ids[:5000] == 0))
    assert 0.76 < share < 0.84
    s1 = list(kuat.mix([Stream(range(50)), sources[1]], [1, 1], seed=9))
    s2 = list(kuat.mix([Stream(range(50)), sources[1]], [1, 1], seed=9))
    assert s1 == s2


def test_iterable_mix_draws_per_epoch():
    m = kuat.mix([Stream(range(20)), Stream(range(100, 120))], stopping="all_exhausted", seed=3)
    e0 = list(m)
    m.set_epoch(1)
    e1 = list(m)
    assert sorted(e0) == sorted(e1) and e0 != e1
    m.set_epoch(0)
    assert list(m) == e0


def test_map_mix_fetches_each_source_once_per_batch():
    calls = []

    class Batched:
        def __init__(self, offset, n):
            self.offset, self.n = offset, n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            raise AssertionError("__getitems__ should be used")

        def __getitems__(self, indices):
            calls.append((self.offset, list(indices)))
            return [self.offset + i for i in indices]

    m = kuat.mix([Batched(0, 10), Batched(100, 10)], stopping="all_exhausted", seed=4)
    batch = m.__getitems__(list(range(len(m))))
    assert sorted(batch) == list(range(10)) + list(range(100, 110))
    assert sorted(c[0] for c in calls) == [0, 100]
    with pytest.raises(IndexError, match="out of range"):
        m.__getitems__([20])


def test_mix_of_mixes_and_hf_sources():
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"x": list(range(6))})
    inner = kuat.mix([[{"x": 100}], hf], stopping="all_exhausted", seed=1)
    outer = kuat.mix([inner, [{"x": -1}]], stopping="all_exhausted", seed=2)
    assert sorted(s["x"] for s in _all(outer)) == [-1, 0, 1, 2, 3, 4, 5, 100]
    stream = kuat.mix([hf.to_iterable_dataset(num_shards=2), [{"x": 7}]], stopping="all_exhausted")
    assert sorted(s["x"] for s in stream) == [0, 1, 2, 3, 4, 5, 7]


def test_validation_errors_name_the_values():
    with pytest.raises(ValueError, match="non-empty"):
        kuat.mix([])
    with pytest.raises(ValueError, match="2 sources but 1 weights"):
        kuat.mix([[1], [2]], weights=[1])
    with pytest.raises(ValueError, match=r"\[1, -1\]"):
        kuat.mix([[1], [2]], weights=[1, -1])
    with pytest.raises(ValueError, match="positive weight"):
        kuat.mix([[1], [2]], weights=[0, 0])
    with pytest.raises(ValueError, match="stopping"):
        kuat.mix([[1]], stopping="never")
    with pytest.raises(TypeError, match="seed"):
        kuat.mix([[1]], seed="1")
    with pytest.raises(TypeError, match="neither map-style"):
        kuat.mix([object()])
    with pytest.raises(ValueError, match="size"):
        kuat.shuffle_buffer([1], 0)


def test_shuffle_buffer_reorders_without_drops_or_duplicates():
    sb = kuat.shuffle_buffer(range(100), size=10, seed=1)
    e0 = list(sb)
    assert sorted(e0) == list(range(100)) and e0 != list(range(100))
    assert list(sb) == e0  # same epoch, same order
    sb.set_epoch(1)
    e1 = list(sb)
    assert sorted(e1) == list(range(100)) and e1 != e0
    # output i is emitted after reading sample 10 + i: nothing comes out before it is read
    assert all(x <= i + 10 for i, x in enumerate(e0))
    assert list(kuat.shuffle_buffer(Stream(range(7)), size=1)) == list(range(7))
    assert sorted(kuat.shuffle_buffer(Stream(range(7)), size=50)) == list(range(7))
    assert list(kuat.shuffle_buffer([], size=3)) == []
    mixed = kuat.mix(
        [list(range(20)), list(range(50, 60))], stopping="all_exhausted", shuffle_buffer=8
    )
    assert Counter(mixed) == Counter(list(range(20)) + list(range(50, 60)))


def test_sources_of_a_mix_draw_independently():
    class Draws(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return float(kuat.sample_rng(i).numpy.random())

    m = kuat.mix([Draws(), Draws()], stopping="all_exhausted", seed=1)
    (batch,) = list(kuat.DataLoader(m, batch_size=8, seed=3))
    (alone,) = list(kuat.DataLoader(Draws(), batch_size=4, seed=3))
    first = [float(batch[i]) for i in range(8) if m.source_ids[i] == 0]
    second = [float(batch[i]) for i in range(8) if m.source_ids[i] == 1]
    assert first == alone.tolist()  # source 0 draws as it does alone
    assert len(second) == 4 and not set(first) & set(second)  # source 1 draws differently


def test_mix_carries_the_sources_batch_transform(caplog):
    class WithStep(list):
        def __init__(self, items, step):
            super().__init__(items)
            self.kuat_batch_transform = step

    def double(batch):
        return batch * 2

    m = kuat.mix([list(range(3)), WithStep(range(10, 13), double)], stopping="all_exhausted")
    assert m.kuat_batch_transform is double
    batches = list(kuat.DataLoader(m, batch_size=6))
    assert sorted(batches[0].tolist()) == [0, 2, 4, 20, 22, 24]  # applied by the loader
    assert kuat.mix([[1], [2]]).kuat_batch_transform is None
    with caplog.at_level("WARNING", logger="kuat.sources.mixture"):
        both = kuat.mix([WithStep([1], double), WithStep([2], abs)])
    assert both.kuat_batch_transform is double and "sources [0, 1]" in caplog.text


def test_shuffle_buffer_keeps_the_batch_transform():
    class WithStep(list):
        kuat_batch_transform = staticmethod(abs)

    assert kuat.shuffle_buffer(WithStep([1, 2]), 2).kuat_batch_transform is abs
    m = kuat.mix([WithStep([-1]), [2]], stopping="all_exhausted", shuffle_buffer=4)
    assert m.kuat_batch_transform is abs


@pytest.mark.parametrize("num_workers", [0, 2])
def test_map_mix_reaches_all_of_a_cut_source_over_epochs(num_workers):
    """#11.11: with first_exhausted, A (100 items) gets about 10 positions per epoch; which of
    its items fill them moves on each epoch, so all of A is read within ceil(100 / m) epochs."""
    a, b = range(100), range(1000, 1010)
    m = kuat.mix([a, b], weights=[0.5, 0.5], stopping="first_exhausted", seed=1)
    share = int(m.counts[0])  # A's positions per epoch
    assert 0 < share < 100 and int(m.counts[1]) == 10
    epochs = -(-100 // share)
    loader = kuat.DataLoader(m, batch_size=4, shuffle=True, seed=3, num_workers=num_workers)
    per_epoch = [sorted(x for batch in loader for x in batch.tolist()) for _ in range(epochs)]
    for e, items in enumerate(per_epoch):
        from_a = [x for x in items if x < 1000]
        # the stated right value: epoch e reads A's window e*m, e*m + 1, ... (mod 100)
        assert from_a == sorted((e * share + j) % 100 for j in range(share)), e
        assert [x for x in items if x >= 1000] == list(b)  # B is read whole every epoch
    assert {x for items in per_epoch for x in items if x < 1000} == set(a)
    # torch's DataLoader over the same mix, told the epoch as with DistributedSampler
    for e in range(2):
        m.set_epoch(e)
        got = sorted(x for batch in torch.utils.data.DataLoader(m, batch_size=4, shuffle=True)
                     for x in batch.tolist())
        assert got == per_epoch[e]


def test_map_mix_all_exhausted_reads_every_item_every_epoch_and_set_epoch_is_validated():
    m = kuat.mix([range(30), range(100, 105)], stopping="all_exhausted", seed=2)
    for e in (0, 1, 7):
        m.set_epoch(e)
        assert sorted(_all(m)) == [*range(30), *range(100, 105)]
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="epoch should be a non-negative int"):
            m.set_epoch(bad)
