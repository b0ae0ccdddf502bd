"""Batch samplers that wrap a batch sampler (Accelerate's ``BatchSamplerShard`` and
``SkipBatchSampler``: torch ``BatchSampler`` subclasses with no ``.sampler``): kuat's loader
gives torch's batches, resumes them, and under kuat's sharding accepts one that takes the
rank's share (the check looks through the wrapping) and refuses one that does not."""

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler
from torch.utils.data import DataLoader as TorchLoader

import kuat

accelerate_data_loader = pytest.importorskip("accelerate.data_loader")
BatchSamplerShard = accelerate_data_loader.BatchSamplerShard
SkipBatchSampler = accelerate_data_loader.SkipBatchSampler

DS = list(range(23))


def wrapped(kind):
    inner = BatchSampler(RandomSampler(DS), 4, False)
    if kind == "shard":
        return BatchSamplerShard(inner, num_processes=2, process_index=1)
    return SkipBatchSampler(inner, 2)


def epochs(loader_cls, kind, n=2, **kw):
    torch.manual_seed(7)
    loader = loader_cls(DS, batch_sampler=wrapped(kind), **kw)
    return [[b.tolist() for b in loader] for _ in range(n)]


@pytest.mark.parametrize("kind", ["shard", "skip"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_wrapping_batch_sampler_gives_torchs_batches(kind, num_workers):
    assert epochs(kuat.DataLoader, kind, num_workers=num_workers) == epochs(TorchLoader, kind)


@pytest.mark.parametrize("kind", ["shard", "skip"])
def test_wrapping_batch_sampler_resumes(kind):
    whole = epochs(TorchLoader, kind, n=1)[0]
    torch.manual_seed(7)
    loader = kuat.DataLoader(DS, batch_sampler=wrapped(kind))
    it = iter(loader)
    head = [next(it).tolist()]
    state = loader.state_dict()
    torch.manual_seed(99)  # the training loop's draws between save and resume
    resumed = kuat.DataLoader(DS, batch_sampler=wrapped(kind))
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == whole


def test_kuat_sharding_accepts_a_wrapped_share_and_refuses_a_wrapped_whole():
    share = BatchSamplerShard(BatchSampler(SequentialSampler(DS), 4, False),
                              num_processes=2, process_index=0)
    skipped = SkipBatchSampler(
        BatchSampler(DistributedSampler(DS, num_replicas=2, rank=0, shuffle=False), 4, False), 1)
    for bs in (share, skipped):
        got = [b.tolist() for b in kuat.DataLoader(DS, batch_sampler=bs, rank=0, world_size=2)]
        assert got == [b.tolist() for b in TorchLoader(DS, batch_sampler=bs)]
    whole = SkipBatchSampler(BatchSampler(SequentialSampler(DS), 4, False), 1)
    with pytest.raises(ValueError, match="SkipBatchSampler was given, which does not take"):
        kuat.DataLoader(DS, batch_sampler=whole, rank=0, world_size=2)


@pytest.mark.parametrize("shuffle", [False, True])
def test_seed_warning_only_where_ranks_would_shuffle_apart(shuffle, caplog):
    """Without seed= a sharded loader warns that ranks may shuffle apart; unshuffled, every
    rank's order is torch's DistributedSampler(shuffle=False) share, whatever the seed: no
    warning (torch's loader gives none)."""
    want = list(DistributedSampler(DS, num_replicas=2, rank=1, shuffle=False))
    with caplog.at_level("WARNING", logger="kuat"):
        got = [i for b in kuat.DataLoader(DS, batch_size=4, shuffle=shuffle, rank=1,
                                           world_size=2) for i in b.tolist()]
    assert (got == want) if not shuffle else len(got) == len(want)
    assert ("drew its seed" in caplog.text) is shuffle


def test_a_wrapped_sampler_the_loader_would_give_its_share_is_refused():
    """kuat's loader gives its share (kuat_set_distributed) to the batch sampler it holds, not
    to one inside a wrapper: wrapped without rank=, kuat.TokenBudgetBatchSampler would read
    every rank's batches, so it is refused; with its own rank= it takes torch's
    DistributedSampler-like share itself and is accepted."""
    lengths = [3] * len(DS)
    plain = kuat.TokenBudgetBatchSampler(lengths, max_tokens=12, seed=0)
    with pytest.raises(ValueError, match="SkipBatchSampler was given, which does not take"):
        kuat.DataLoader(DS, batch_sampler=SkipBatchSampler(plain, 1), rank=1, world_size=2)
    direct = kuat.DataLoader(DS, batch_sampler=kuat.TokenBudgetBatchSampler(
        lengths, max_tokens=12, seed=0), rank=1, world_size=2)
    own = kuat.TokenBudgetBatchSampler(lengths, max_tokens=12, seed=0, rank=1, world_size=2)
    wrapped = kuat.DataLoader(DS, batch_sampler=SkipBatchSampler(own, 1), rank=1, world_size=2)
    assert [b.tolist() for b in wrapped] == [b.tolist() for b in direct][1:]


def test_a_sampler_reading_another_share_than_the_loaders_is_refused():
    """rank=1/world_size=2 with a sampler built for another share (a DistributedSampler of
    rank 0, Accelerate's shard of 1 process) would read that share silently; torch's
    DistributedSampler of the loader's pair is accepted."""
    for s in (DistributedSampler(DS, num_replicas=2, rank=0),
              BatchSamplerShard(BatchSampler(SequentialSampler(DS), 4, False), num_processes=1,
                                process_index=0)):
        how = {"batch_sampler": s} if isinstance(s, BatchSampler) else {"sampler": s}
        with pytest.raises(ValueError, match="reads share 0 of"):
            kuat.DataLoader(DS, rank=1, world_size=2, **how)
    ok = DistributedSampler(DS, num_replicas=2, rank=1, shuffle=False)
    got = [b.tolist() for b in kuat.DataLoader(DS, sampler=ok, batch_size=4, rank=1, world_size=2)]
    assert got == [b.tolist() for b in TorchLoader(DS, sampler=ok, batch_size=4)]
