import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler

from kuat.sampling import EpochSampler, batches_of


def test_order_depends_only_on_seed_and_epoch():
    a = EpochSampler(50, shuffle=True, seed=1)
    b = EpochSampler(50, shuffle=True, seed=1)
    assert a.indices(3) == b.indices(3)
    assert a.indices(3) != a.indices(4)
    assert sorted(a.indices(3)) == list(range(50))
    assert EpochSampler(50, shuffle=True, seed=2).indices(3) != a.indices(3)
    assert EpochSampler(5, shuffle=False, seed=1).indices(7) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("n,ws,drop", [(26, 4, False), (26, 4, True), (3, 4, False), (8, 4, True), (1, 3, False)])
def test_distributed_shares_match_distributed_sampler(n, ws, drop):
    for rank in range(ws):
        ours = EpochSampler(n, shuffle=False, seed=0, rank=rank, world_size=ws, drop_last=drop)
        theirs = DistributedSampler(range(n), num_replicas=ws, rank=rank, shuffle=False, drop_last=drop)
        assert ours.indices(0) == list(theirs)
        assert len(ours) == len(theirs)


def test_generator_follows_random_sampler_draws():
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    ours = EpochSampler(10, shuffle=True, seed=0, generator=g1)
    theirs = RandomSampler(range(10), generator=g2)
    assert ours.indices(0) == list(theirs)
    assert ours.indices(1) == list(theirs)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="rank"):
        EpochSampler(5, shuffle=False, seed=0, rank=4, world_size=4)
    with pytest.raises(ValueError, match="world_size"):
        EpochSampler(5, shuffle=False, seed=0, world_size=0)


def test_batches_of():
    assert batches_of(list(range(7)), 3, False) == [[0, 1, 2], [3, 4, 5], [6]]
    assert batches_of(list(range(7)), 3, True) == [[0, 1, 2], [3, 4, 5]]


def test_a_dataset_that_grows_between_epochs_is_read_again():
    data = list(range(5))
    sampler = EpochSampler(data, shuffle=True, seed=0)
    assert sorted(sampler.indices(0)) == list(range(5)) and len(sampler) == 5
    data.extend([5, 6])
    assert sorted(sampler.indices(1)) == list(range(7)) and len(sampler) == 7
