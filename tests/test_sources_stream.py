"""Streams: rank shares as DistributedSampler, workers by whole batches, HF streaming."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

import kuat
from kuat.sources.stream import rank_share, worker_share


@pytest.mark.parametrize("n", [0, 1, 3, 26, 28])
@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_share_matches_distributed_sampler(n, drop_last):
    items = list(range(n))
    for world_size in (1, 2, 4, 5):
        shares = [
            list(rank_share(iter(items), r, world_size, drop_last)) for r in range(world_size)
        ]
        if n == 0:
            assert shares == [[]] * world_size
            continue
        for r in range(world_size):
            ref = DistributedSampler(items, world_size, r, shuffle=False, drop_last=drop_last)
            assert shares[r] == list(ref), (world_size, r)
        assert len({len(s) for s in shares}) == 1


def test_worker_share_takes_whole_batches():
    items = list(range(23))
    shares = [list(worker_share(iter(items), w, 3, 4)) for w in range(3)]
    assert shares[0] == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shares[1] == [4, 5, 6, 7, 16, 17, 18, 19]
    assert shares[2] == [8, 9, 10, 11, 20, 21, 22]


@pytest.fixture
def hf_stream():
    # one per test: the dataset's own set_epoch() (a test calls it) chooses a kuat loader's
    # next epoch, as torch's DataLoader re-reading the dataset would
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"x": list(range(26)), "y": [i % 3 for i in range(26)]})
    return ds.to_iterable_dataset(num_shards=4).shuffle(seed=3, buffer_size=5)


def test_hf_stream_epoch_is_the_datasets_iteration(hf_stream):
    src = kuat.sources.as_source(hf_stream)
    for epoch in (0, 1):
        hf_stream.set_epoch(epoch)
        assert list(src.samples(epoch)) == list(hf_stream)
    assert [s["x"] for s in src.samples(0)] != [s["x"] for s in src.samples(1)]


@pytest.mark.parametrize("num_workers", [0, 1, 3])
def test_hf_stream_in_kuat_loader_same_batches_whatever_the_workers(hf_stream, num_workers):
    src = kuat.sources.as_source(hf_stream)
    expected = [s["x"] for s in src.samples(0)]
    loader = kuat.DataLoader(hf_stream, batch_size=4, num_workers=num_workers)
    got = [b["x"].tolist() for b in loader]
    assert got == [expected[i : i + 4] for i in range(0, 26, 4)]
    # the next iter() is epoch 1: the dataset's set_epoch was called (new shuffle)
    again = [x for b in loader for x in b["x"].tolist()]
    assert sorted(again) == list(range(26)) and again != expected


def test_hf_stream_persistent_workers_get_each_epoch(hf_stream):
    src = kuat.sources.as_source(hf_stream)
    loader = kuat.DataLoader(hf_stream, batch_size=5, num_workers=2, persistent_workers=True)
    for epoch in range(3):
        got = [x for b in loader for x in b["x"].tolist()]
        assert got == [s["x"] for s in src.samples(epoch)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_stream_ranks_equal_batches_no_empty_union_covers(hf_stream, drop_last):
    """26 samples, world size 4, batch 6, 2 epochs (the issue's case, on a stream)."""
    for epoch in range(2):
        per_rank = []
        for rank in range(4):
            loader = kuat.DataLoader(
                hf_stream,
                batch_size=6,
                drop_last=drop_last,
                num_workers=2,
                rank=rank,
                world_size=4,
            )
            loader.set_epoch(epoch)
            per_rank.append([b["x"].tolist() for b in loader])
        counts = [len(b) for b in per_rank]
        assert len(set(counts)) == 1 and counts[0] >= 1
        assert all(len(batch) > 0 for batches in per_rank for batch in batches)
        seen = {x for batches in per_rank for batch in batches for x in batch}
        if drop_last:
            assert counts[0] == 1  # 26 // 4 = 6 samples per rank: one batch of 6
            assert len(seen) == 24
        else:
            assert counts[0] == 2  # ceil(26 / 4) = 7 samples per rank: 6 + 1
            assert seen == set(range(26))


def test_torch_loader_over_a_stream_splits_by_sample():
    """Under torch's DataLoader (no batching hook) workers split sample by sample."""
    stream = kuat.shuffle_buffer(list(range(12)), size=1)
    loader = torch.utils.data.DataLoader(stream, batch_size=2, num_workers=2)
    got = sorted(x for b in loader for x in b.tolist())
    assert got == list(range(12))


def test_hf_stream_split_by_shards_reads_each_example_once(hf_stream):
    from kuat.sources.hf import HFIterableSource

    with pytest.raises(ValueError, match="split"):
        HFIterableSource(hf_stream, split="rows")
    src = HFIterableSource(hf_stream, split="shards")
    for workers in (0, 2):
        got = [
            x
            for b in kuat.DataLoader(src, batch_size=4, num_workers=workers)
            for x in b["x"].tolist()
        ]
        assert sorted(got) == list(range(26))
    # kuat's sharding promises equal steps, which whole shards cannot: refused, naming why
    with pytest.raises(ValueError, match="split='shards'"):
        kuat.DataLoader(src, batch_size=4, rank=0, world_size=2)
    # each example once over ranks: datasets' own split, read by an unsharded loader (torch's
    # semantics: the loader reads what it is given, in shares that may differ)
    from datasets.distributed import split_dataset_by_node

    shares = []
    for rank in range(2):
        part = HFIterableSource(split_dataset_by_node(hf_stream, rank=rank, world_size=2),
                                split="shards")
        loader = kuat.DataLoader(part, batch_size=4, num_workers=2)
        shares.append({x for b in loader for x in b["x"].tolist()})
        with pytest.raises(ValueError, match="split_dataset_by_node"):
            kuat.DataLoader(part, batch_size=4, rank=rank, world_size=2)
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(range(26))


class _Docs(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_map_style_source_in_a_stream_reads_the_streams_epoch():
    """A map-style mix read as a stream (stream_of, shuffle_buffer, a mix of it with a stream)
    reads epoch e's window, outside kuat's loader too (it used to read epoch 0's every time)."""
    from kuat.sources.reading import stream_of

    def build():  # the first source is cut to 3 samples per epoch, a new window each epoch
        return kuat.mix([_Docs(list(range(12))), _Docs([100, 101, 102])], seed=0)

    for epoch in range(3):
        m = build()
        m.set_epoch(epoch)
        want = [m[i] for i in range(len(m))]
        assert list(stream_of(build(), epoch)) == want
        shuffled = kuat.shuffle_buffer(build(), 4, seed=1).samples(epoch)
        assert list(shuffled) == list(kuat.shuffle_buffer(_Docs(want), 4, seed=1).samples(epoch))
    assert list(stream_of(build(), 1)) != list(stream_of(build(), 0))
