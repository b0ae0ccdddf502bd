"""Who reads what on a device mesh (gloo, 4 forked ranks, 127.0.0.1): the default is torch's
DataLoader's answer (every rank every sample); ``mesh=`` splits over the data-parallel
dimensions only, so tensor-parallel peers read identical batches."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import kuat
from tests._gloo import run_ranks

N = 22


def _mesh_body(rank, world_size, names, shape, kw):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    theirs = [b.tolist() for b in torch.utils.data.DataLoader(list(range(N)), batch_size=4, shuffle=True)]
    torch.manual_seed(0)
    default = [b.tolist() for b in kuat.DataLoader(list(range(N)), batch_size=4, shuffle=True, **kw)]
    loader = kuat.DataLoader(list(range(N)), batch_size=4, shuffle=True, seed=0, mesh=mesh, **kw)
    shared = [[b.tolist() for b in loader] for _ in range(2)]
    return {"coord": mesh.get_coordinate(), "theirs": theirs, "default": default,
            "mesh": shared, "share": (loader.rank, loader.world_size)}


@pytest.mark.parametrize("names, shape", [(("dp", "tp"), (2, 2)), (("pp", "dp"), (2, 2))])
@pytest.mark.parametrize("kw", [{}, {"num_workers": 2}], ids=["w0", "thread2"])
def test_mesh_data_parallel_share_and_default_as_torch(names, shape, kw):
    results = run_ranks(_mesh_body, 4, args=(names, shape, kw), timeout=120)
    dp = names.index("dp")
    for r in results:
        assert r["default"] == r["theirs"]  # torch's answer: every rank every sample
        assert sorted(x for b in r["default"] for x in b) == list(range(N))
        assert r["share"] == (r["coord"][dp], 2)
    groups = {}
    for r in results:
        groups.setdefault(r["coord"][dp], []).append(r["mesh"])
    assert len(groups) == 2
    for peers in groups.values():  # replicas (tp or pp peers) read identical batches
        assert all(p == peers[0] for p in peers)
    for epoch in range(2):
        halves = [groups[d][0][epoch] for d in (0, 1)]
        seen = [x for half in halves for b in half for x in b]
        assert len(halves[0]) == len(halves[1])  # equal steps
        assert set(seen) == set(range(N)) and len(seen) == 2 * ((N + 1) // 2)


def _bad_mesh(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    errors = []
    for kw in ({}, {"dp_dims": "cp"}, {"dp_dims": ("pp", "pp")}):
        try:
            kuat.DataLoader(list(range(8)), mesh=mesh, **kw)
        except ValueError as e:
            errors.append(str(e))
    loader = kuat.DataLoader(list(range(8)), batch_size=2, mesh=mesh, dp_dims="pp", seed=0)
    return errors, (loader.rank, loader.world_size), mesh.get_coordinate()


def test_mesh_without_a_data_parallel_dimension_raises_naming_it():
    for errors, share, coord in run_ranks(_bad_mesh, 4, timeout=60):
        assert len(errors) == 3
        assert "pp=2, tp=2" in errors[0] and "dp_dims=" in errors[0]
        assert "'cp'" in errors[1] and "twice" in errors[2]
        assert share == (coord[0], 2)


def _per_rank_data(rank, world_size):
    import datasets
    from datasets.distributed import split_dataset_by_node

    full = list(range(40))
    subset = torch.utils.data.Subset(full, range(rank * 20, rank * 20 + 20))
    hf = split_dataset_by_node(
        datasets.Dataset.from_dict({"id": full}), rank=rank, world_size=world_size)
    out = {}
    for name, data in (("subset", subset), ("split_dataset_by_node", hf)):
        for kw in ({}, {"shuffle": True}, {"num_workers": 2}):
            torch.manual_seed(3)
            theirs = [x for b in torch.utils.data.DataLoader(data, batch_size=4, **kw)
                      for x in (b["id"] if isinstance(b, dict) else b).tolist()]
            torch.manual_seed(3)
            ours = [x for b in kuat.DataLoader(data, batch_size=4, **kw)
                    for x in (b["id"] if isinstance(b, dict) else b).tolist()]
            out[name, tuple(kw)] = (ours, theirs)
    return out


def test_per_rank_data_is_read_whole_on_each_rank_as_torch():
    """A per-rank ``Subset`` or ``datasets``' ``split_dataset_by_node`` on a map-style dataset,
    inside a process group: torch's loader reads each rank's 20; kuat's did 10 (it split again)."""
    pytest.importorskip("datasets")
    for rank, out in enumerate(run_ranks(_per_rank_data, 2, timeout=120)):
        for key, (ours, theirs) in out.items():
            assert ours == theirs, key
            assert sorted(ours) == list(range(rank * 20, rank * 20 + 20)), key


def test_datapipe_loader_built_before_the_process_group_reads_its_rank_share(monkeypatch):
    """torch's iterator asks the process group for an IterDataPipe's shares each time it
    starts; a kuat loader built before init_process_group must too (it kept 0 of 1)."""
    from torch.utils.data.datapipes.iter import IterableWrapper
    from torch.utils.data.graph_settings import apply_sharding

    loader = kuat.DataLoader(IterableWrapper(range(8)).sharding_filter(), batch_size=2)
    assert [x for b in loader for x in b.tolist()] == list(range(8))  # no group: everything
    monkeypatch.setattr(kuat.distributed, "torch_group", lambda: (1, 2))  # the group is up
    expected = IterableWrapper(range(8)).sharding_filter()
    apply_sharding(expected, 2, 1)
    assert [x for b in loader for x in b.tolist()] == list(expected) == [1, 3, 5, 7]


def test_a_sampler_given_under_kuats_sharding_must_take_the_share():
    """rank=/world_size= shard the loader's own sampler; a user sampler that takes no share
    would give every rank every index (the rank silently ignored): refused. Samplers that take
    their share are served as torch's DataLoader serves them."""
    from torch.utils.data import (
        BatchSampler,
        DistributedSampler,
        RandomSampler,
        SequentialSampler,
        WeightedRandomSampler,
    )

    ds = list(range(10))
    refused = [dict(sampler=RandomSampler(ds)), dict(sampler=SequentialSampler(ds)),
               dict(sampler=WeightedRandomSampler([1.0] * 10, 10)), dict(sampler=[3, 1, 2]),
               dict(batch_sampler=BatchSampler(RandomSampler(ds), 2, False))]
    for kw in refused:
        size = {} if "batch_sampler" in kw else {"batch_size": 2}
        with pytest.raises(ValueError, match="does not take a rank's share"):
            kuat.DataLoader(ds, rank=1, world_size=2, **size, **kw)
    shares = [dict(sampler=DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=4)),
              dict(batch_sampler=BatchSampler(DistributedSampler(ds, num_replicas=2, rank=1), 2, False))]
    for kw in shares:
        size = {} if "batch_sampler" in kw else {"batch_size": 2}
        expected = [b.tolist() for b in torch.utils.data.DataLoader(ds, **size, **kw)]
        assert [b.tolist() for b in kuat.DataLoader(ds, rank=1, world_size=2, **size, **kw)] == expected
        assert sum(len(b) for b in expected) == 5
