"""What frameworks rely on, checked against torch's DataLoader without a framework (issue #10):
isinstance, truthful attributes, lazy ``iter()``, rank resolution at epoch start, pickling,
torchdata StatefulDataLoader's arguments and state-dict call pattern."""

import logging
import multiprocessing
import threading
import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler
from torch.utils.data import DataLoader as TorchLoader

import kuat
import kuat.distributed


def _init(worker_id):
    pass


def test_is_a_torch_dataloader_with_torchs_attributes():
    ds = list(range(10))
    g = torch.Generator()
    kwargs = dict(batch_size=3, num_workers=2, drop_last=True, timeout=5.0, worker_init_fn=_init,
                  generator=g, prefetch_factor=3, persistent_workers=True, pin_memory=False,
                  multiprocessing_context="spawn")
    ours, theirs = kuat.DataLoader(ds, **kwargs), TorchLoader(ds, **kwargs)
    assert isinstance(ours, torch.utils.data.DataLoader)
    for name in ("batch_size", "drop_last", "num_workers", "timeout", "worker_init_fn", "generator",
                 "prefetch_factor", "persistent_workers", "pin_memory", "pin_memory_device", "in_order",
                 "_auto_collation", "_dataset_kind"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.dataset is ds
    assert type(ours.multiprocessing_context) is type(theirs.multiprocessing_context)
    assert type(ours.batch_sampler) is BatchSampler and ours.batch_sampler.sampler is ours.sampler
    assert len(ours) == len(theirs) == 3
    for name in ("batch_size", "sampler", "batch_sampler", "drop_last", "dataset", "persistent_workers"):
        with pytest.raises(ValueError, match="should not be set after"):  # torch's guard, inherited
            setattr(ours, name, None)
    plain = kuat.DataLoader(ds, batch_size=None)
    # unsharded (torch's semantics) the sampler is not a DistributedSampler, so Lightning and
    # Fabric inject theirs as they do for torch's loader; kuat's own sharding is one
    assert plain.batch_sampler is None and not isinstance(plain.sampler, DistributedSampler)
    assert isinstance(kuat.DataLoader(ds, rank=0, world_size=2).sampler, DistributedSampler)
    assert isinstance(kuat.DataLoader(ds, batch_sampler=[[0, 1]]).sampler, SequentialSampler)


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_iter_without_next_starts_nothing_and_keeps_the_epoch(worker_type):
    loader = kuat.DataLoader(list(range(8)), batch_size=2, shuffle=True, seed=0, num_workers=2,
                             worker_type=worker_type)
    expected = [[b.tolist() for b in TorchLoader(list(range(8)), batch_size=2, sampler=list(loader.sampler))]]
    threads, children = threading.active_count(), len(multiprocessing.active_children())
    it = iter(loader)  # what Lightning's _check_dataloader_iterable does
    assert threading.active_count() == threads and len(multiprocessing.active_children()) == children
    del it
    assert loader.state_dict()["epoch"] == 0
    assert [[b.tolist() for b in loader]] == expected  # epoch 0's order, from epoch 0
    assert loader.state_dict()["epoch"] == 1


def test_environment_rank_alone_shards_nothing_as_torch(monkeypatch):
    """``RANK=0 WORLD_SIZE=4`` with no process group and no sampler (an evaluation script on
    rank 0): torch's DataLoader reads all 10 samples; so does kuat's, on every rank."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        for kw in ({}, {"num_workers": 2}, {"shuffle": True}):
            torch.manual_seed(7)
            expected = [b.tolist() for b in torch.utils.data.DataLoader(list(range(10)), batch_size=3, **kw)]
            torch.manual_seed(7)
            got = [b.tolist() for b in kuat.DataLoader(list(range(10)), batch_size=3, **kw)]
            assert got == expected and sorted(x for b in got for x in b) == list(range(10))


def test_rank_from_environment_with_one_warning_then_from_torch_distributed(monkeypatch, caplog):
    monkeypatch.setattr(kuat.distributed, "_warned_env", False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = kuat.DataLoader(list(range(10)), batch_size=2, seed=0, shard=True)
    assert (loader.rank, loader.world_size) == (1, 2) and len(loader) == 3
    expected = list(DistributedSampler(list(range(10)), num_replicas=2, rank=1, shuffle=False))
    with caplog.at_level(logging.WARNING, logger="kuat"):
        assert [x for _ in range(2) for b in loader for x in b.tolist()] == expected * 2
    assert sum("RANK/WORLD_SIZE" in r.message for r in caplog.records) == 1  # once per process
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert (loader.rank, loader.world_size) == (0, 1) and len(loader) == 5  # resolved again
    explicit = kuat.DataLoader(list(range(10)), batch_size=2, rank=0, world_size=5)
    assert len(explicit) == 1
    with pytest.raises(ValueError, match="give one of"):
        kuat.DataLoader(list(range(10)), rank=0, world_size=2, mesh=object())
    with pytest.raises(ValueError, match="contradicts"):
        kuat.DataLoader(list(range(10)), rank=0, world_size=2, shard=False)
    with pytest.raises(TypeError, match="DeviceMesh"):
        kuat.DataLoader(list(range(10)), mesh=object())


def test_statefuldataloader_arguments_and_call_pattern():
    ds = list(range(12))
    loader = kuat.DataLoader(ds, batch_size=2, shuffle=True, seed=3, snapshot_every_n_steps=5)
    assert loader.snapshot_every_n_steps == 5
    assert kuat.DataLoader(ds, snapshot_every_n_steps=0).snapshot_every_n_steps == 0  # torchdata's
    with pytest.raises(ValueError, match="snapshot_every_n_steps"):
        kuat.DataLoader(ds, snapshot_every_n_steps=-1)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()  # no arguments, as StatefulDataLoader
    rest = [b.tolist() for b in it]
    again = kuat.DataLoader(ds, batch_size=2, shuffle=True, seed=0)
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == rest
    assert sorted(x for b in head + rest for x in b) == ds


def test_a_stream_built_before_the_rank_is_known_reads_its_share(monkeypatch):
    datasets = pytest.importorskip("datasets")
    stream = datasets.Dataset.from_dict({"id": list(range(12))}).to_iterable_dataset(num_shards=2)

    def ids(loader):
        return [int(x) for b in loader for x in b["id"]]

    loader = kuat.DataLoader(stream, batch_size=2, num_workers=2, shard=True)  # rank unknown yet
    unsharded = kuat.DataLoader(stream, batch_size=2, num_workers=2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    explicit = [ids(kuat.DataLoader(stream, batch_size=2, rank=r, world_size=2)) for r in (0, 1)]
    assert ids(loader) == explicit[1]
    assert sorted(explicit[0] + explicit[1]) == list(range(12))
    # an unsplit datasets stream: torch's DataLoader gives every rank all of it; so does kuat's
    theirs = [int(x) for b in torch.utils.data.DataLoader(stream, batch_size=2, num_workers=2)
              for x in b["id"]]
    assert sorted(ids(unsharded)) == sorted(theirs) == list(range(12))


def test_loading_another_ranks_state_is_exact_and_quiet():
    """Accelerate's register_for_checkpointing saves rank 0's state and loads it on every rank."""
    def make(rank):
        return kuat.DataLoader(list(range(20)), batch_size=2, shuffle=True, seed=1, rank=rank, world_size=2)

    rank0, rank1 = make(0), make(1)
    for loader in (rank0, rank1):
        it = iter(loader)
        next(it), next(it)
    rest1 = [b.tolist() for b in it]
    resumed = make(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(rank0.state_dict())
    assert [b.tolist() for b in resumed] == rest1
