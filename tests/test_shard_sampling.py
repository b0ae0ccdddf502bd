"""ShardShuffleSampler: equal rank shares covering the dataset, determinism, and the bound on how
many shards a rank reads at a time (the point of the algorithm)."""

import numpy as np
import pytest
import torch

import kuat
from kuat.format import Schema, Writer, int64


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = tmp_path_factory.mktemp("s") / "d.kuat"
    with Writer(path, Schema({"y": int64()}), shard_bytes=8 * 50) as w:  # 50 rows a shard
        w.write_batch({"y": np.arange(1003)})
    return kuat.open(path)


def _shard_of(ds, order):
    starts = np.cumsum([0] + [s.rows for s in ds.manifest.shards])[:-1]
    return np.searchsorted(starts, np.asarray(order), side="right") - 1


@pytest.mark.parametrize("world_size", [1, 3])
def test_ranks_share_equally_and_cover_everything(ds, world_size):
    orders = [
        kuat.ShardShuffleSampler(ds, block_size=120, seed=1, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    got = [s.indices(2) for s in orders]
    assert {len(g) for g in got} == {len(orders[0])} == {-(-len(ds) // world_size)}
    assert set(np.concatenate(got).tolist()) == set(range(len(ds)))
    assert got == [s.indices(2) for s in orders]  # deterministic
    assert got[0] != orders[0].indices(3)  # another epoch, another order


def test_a_block_touches_few_shards_and_is_shuffled(ds):
    rows = min(s.rows for s in ds.manifest.shards[:-1])
    block = 120
    s = kuat.ShardShuffleSampler(ds, block_size=block, seed=0)
    order = s.indices(0)
    assert order != sorted(order)
    sid = _shard_of(ds, order)
    for b in range(0, len(order), block):
        assert len(set(sid[b : b + block].tolist())) <= block // rows + 2
    # a global shuffle, for contrast, touches nearly every shard in every block
    full = np.random.default_rng(0).permutation(len(ds))
    assert len(set(_shard_of(ds, full[:block]).tolist())) > block // rows + 2


def test_loader_reads_the_sampler_order(ds):
    s = kuat.ShardShuffleSampler(ds, block_size=64, seed=5)
    s.set_epoch(1)  # as torch users do; kuat's loader sets its own epoch (0 first)
    torch_loader = torch.utils.data.DataLoader(ds, batch_size=16, sampler=s)
    assert [int(y) for b in torch_loader for y in b["y"]] == s.indices(1)
    loader = kuat.DataLoader(ds, batch_size=16, sampler=s, num_workers=2)
    assert [int(y) for b in loader for y in b["y"]] == s.indices(0)


def test_validation(ds):
    with pytest.raises(ValueError, match="block_size=0"):
        kuat.ShardShuffleSampler(ds, block_size=0)
    with pytest.raises(ValueError, match="rank=2"):
        kuat.ShardShuffleSampler(ds, rank=2, world_size=2)
    with pytest.raises(TypeError, match="needs a kuat dataset"):
        kuat.ShardShuffleSampler(range(10))


def test_the_loader_sets_the_epoch_and_resumes_it(ds):
    def make():
        return kuat.DataLoader(ds, batch_size=32, sampler=kuat.ShardShuffleSampler(ds, seed=2,
                               block_size=100), num_workers=2)  # fmt: skip

    loader = make()
    list(loader)
    it = iter(loader)  # epoch 1
    head = [next(it)["y"].tolist() for _ in range(4)]
    state = loader.state_dict()
    rest = [b["y"].tolist() for b in it]
    assert sum(head + rest, []) == loader.sampler.indices(1)
    resumed = make()
    resumed.load_state_dict(state)
    assert [b["y"].tolist() for b in resumed] == rest
