"""Replica groups on device meshes (gloo, forked ranks, 127.0.0.1; kuat.replicas): replicas read
bit-identical batches whatever the workers, shares are disjoint and cover the epoch (as torch's
DistributedSampler splits it), the opt-in replica check catches a rank that differs, and
``replicas="broadcast"`` feeds peers the leader's batches, errors and end of data."""

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DistributedSampler

import kuat
from kuat.replicas import ReplicaMismatchError, batch_hash
from kuat.vision import RandomResizedCrop
from tests._gloo import run_ranks

N = 21  # samples: odd, so that DistributedSampler pads


class Crops(torch.utils.data.Dataset):
    """Each sample draws randomness three ways: a random crop (kuat.vision, the sample's
    generator), a kuat.sample_rng draw, and torch's global generator (isolate_global_rng)."""

    def __init__(self, n=N, fail_at=None):
        self.n, self.fail_at = n, fail_at
        self.crop = RandomResizedCrop(4)
        self.img = np.arange(10 * 10 * 3, dtype=np.uint8).reshape(10, 10, 3)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"sample {i} is broken")
        return {"index": i, "crop": torch.from_numpy(np.ascontiguousarray(self.crop(self.img))),
                "draw": int(kuat.sample_rng().numpy.integers(1 << 30)), "noise": torch.rand(2)}


MODES = {"w0": {}, "thread2": {"num_workers": 2, "worker_type": "thread"},
         "process2": {"num_workers": 2, "worker_type": "process"},
         "auto2": {"num_workers": 2}}  # threads, moving to processes on the first torch.rand


def _epochs(loader, epochs=2):
    """Per epoch, per batch: (indices, 64-bit hash of every field)."""
    return [[(b["index"].tolist(), batch_hash(b).intdigest()) for b in loader]
            for _ in range(epochs)]


def _identity_body(rank, world_size, names, shape, modes):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(rank)  # each rank's own default generator: must not matter with seed=
    loaders = {mode: kuat.DataLoader(Crops(), batch_size=3, shuffle=True, seed=7, mesh=mesh,
                                     isolate_global_rng=True, **MODES[mode]) for mode in modes}
    runs = {mode: _epochs(loader) for mode, loader in loaders.items()}
    types = {mode: loader.worker_type for mode, loader in loaders.items()}
    loader = kuat.DataLoader(Crops(), batch_size=3, mesh=mesh, seed=7)
    dp_rank, dp_size = loader.rank, loader.world_size
    ordered = [b["index"].tolist() for b in loader]
    theirs = list(DistributedSampler(range(N), num_replicas=dp_size, rank=dp_rank, shuffle=False))
    try:
        kuat.DataLoader(Crops(), mesh=mesh)
        seedless = None
    except ValueError as e:
        seedless = str(e)
    return {"share": (dp_rank, dp_size), "runs": runs, "ordered": ordered, "theirs": theirs,
            "seedless": seedless, "types": types}


@pytest.mark.parametrize("names, shape, modes", [
    (("dp", "tp"), (2, 2), ("w0", "thread2", "process2", "auto2")),
    (("pp", "dp", "tp"), (2, 2, 2), ("w0", "thread2", "process2")),
    (("dp_replicate", "dp_shard", "tp"), (2, 2, 2), ("w0", "thread2", "process2")),
], ids=["dp-tp", "pp-dp-tp", "hsdp-tp"])
def test_replicas_identical_whatever_the_workers(names, shape, modes):
    results = run_ranks(_identity_body, int(np.prod(shape)), args=(names, shape, modes),
                        timeout=120)
    dp_size = int(np.prod([k for n, k in zip(names, shape) if n.startswith("dp")]))
    groups: dict[int, list] = {}
    for r in results:
        assert r["share"][1] == dp_size
        runs = r["runs"]
        assert all(runs[mode] == runs["w0"] for mode in modes)  # whatever the workers
        assert "auto2" not in modes or r["types"]["auto2"] == "process"  # (it did switch)
        # shuffle=False: the share is torch's DistributedSampler(num_replicas=dp, rank=dp_rank)'s
        assert [i for b in r["ordered"] for i in b] == r["theirs"]
        assert "seed=" in r["seedless"]  # mesh= without seed= raises at construction
        groups.setdefault(r["share"][0], []).append(runs["w0"])
    assert sorted(groups) == list(range(dp_size))
    for peers in groups.values():  # replica peers: bit-identical batches (hash of every field)
        assert all(p == peers[0] for p in peers[1:]) and len(peers) == len(results) // dp_size
    for epoch in range(2):
        shares = [[i for idx, _ in groups[d][0][epoch] for i in idx] for d in range(dp_size)]
        assert len({len(s) for s in shares}) == 1  # equal steps
        seen = [i for s in shares for i in s]  # disjoint and covering (padding: wrap-around)
        assert set(seen) == set(range(N)) and len(seen) == -(-N // dp_size) * dp_size
    assert groups[0][0][0] != groups[0][0][1]  # the epochs differ


def _check_body(rank, world_size, bad_rank):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    seed = 1 if rank == bad_rank else 0
    loader = kuat.DataLoader(Crops(), batch_size=2, shuffle=True, seed=seed, mesh=mesh,
                             replica_check_every=3)
    served = 0
    try:
        for _ in loader:
            served += 1
    except ReplicaMismatchError as e:
        return {"error": str(e), "groups": e.groups, "served": served}
    return {"error": None, "served": served}


@pytest.mark.parametrize("bad_rank", [None, 3])
def test_replica_check_catches_a_rank_with_another_seed(bad_rank):
    results = run_ranks(_check_body, 4, args=(bad_rank,), timeout=60)
    if bad_rank is None:  # equal seeds pass every check
        assert all(r["error"] is None and r["served"] == 6 for r in results)
        return
    for r in results:  # every rank raises at the first check (no rank waits in a collective)
        assert r["served"] == 2 and "share 1: ranks [2] vs ranks [3]" in r["error"]
        assert list(r["groups"]) == [1]  # share 1: ranks 2 and 3 (dp=1) on the (dp, tp) mesh
        assert sorted(sorted(v) for v in r["groups"][1].values()) == [[2], [3]]


def _feed_body(rank, world_size, names, shape, kw):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    modes = {}
    for replicas in ("read", "broadcast"):
        loader = kuat.DataLoader(Crops(), batch_size=3, shuffle=True, seed=3, mesh=mesh,
                                 replicas=replicas, replica_check_every=2, **kw)
        modes[replicas] = _epochs(loader)
    return {"share": mesh.get_coordinate(), "modes": modes,
            "peer": loader._feed.is_peer()}


@pytest.mark.parametrize("names, shape, kw", [
    (("dp", "tp"), (2, 2), {}),
    (("pp", "dp", "tp"), (2, 2, 2), {"num_workers": 2, "worker_type": "thread"}),
], ids=["dp-tp-w0", "pp-dp-tp-thread2"])
def test_broadcast_feeds_the_same_batches_as_reading(names, shape, kw):
    results = run_ranks(_feed_body, int(np.prod(shape)), args=(names, shape, kw), timeout=120)
    for r in results:  # (replica_check_every=2 checked every group in both modes too)
        assert r["modes"]["broadcast"] == r["modes"]["read"]
    assert sum(r["peer"] for r in results) == len(results) - 2  # peers: all but 2 leaders


class _Variable(torch.utils.data.Dataset):
    """Variable-size fields and non-tensor values; sample ``fail_at`` raises; ``n`` samples
    (only the leader's matters in broadcast mode: peers read nothing)."""

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at = n, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"sample {i} is broken")
        return {"tokens": torch.arange(i % 4 + 1, dtype=torch.int32), "name": f"s{i}",
                "flag": torch.tensor(i % 2 == 0), "half": torch.full((2,), i, dtype=torch.bfloat16)}


def _errors_body(rank, world_size):
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    # a peer's own dataset is never read: give it another length to prove it
    ds = _Variable(7 if rank == 0 else 100, fail_at=4 if rank == 0 else None)
    loader = kuat.DataLoader(ds, batch_size=None, seed=0, mesh=mesh, replicas="broadcast",
                             collate_fn=lambda x: x)
    it = iter(loader)
    got, errors, served = [], [], None
    while True:
        if len(got) == 3:  # a peer's position advances with the batches it receives
            served = loader.state_dict()["batches_served_in_epoch"]
        try:
            s = next(it)
        except StopIteration:
            break
        except KeyError as e:  # the leader's dataset error, on every rank; the epoch goes on
            errors.append((len(got), str(e)))
            continue
        got.append((s["tokens"].tolist(), s["name"], bool(s["flag"]), s["half"].tolist(),
                    str(s["half"].dtype)))
    return got, errors, served


def test_broadcast_carries_variable_fields_errors_and_the_end():
    results = run_ranks(_errors_body, 4, timeout=60)
    expected = [(list(range(i % 4 + 1)), f"s{i}", i % 2 == 0, [float(i)] * 2, "torch.bfloat16")
                for i in (0, 1, 2, 3, 5, 6)]
    for got, errors, served in results:
        assert got == expected  # ended after the leader's 7 samples, one of them failing
        assert len(errors) == 1 and errors[0][0] == 4 and "sample 4 is broken" in errors[0][1]
        assert served == 3


def _pipeline_body(rank, world_size):
    world = init_device_mesh("cpu", (3, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    stage = world.get_coordinate()[0]
    if stage == 1:  # a middle stage builds no loader and takes part in no collective of it
        return stage, None
    # the first stage keeps the inputs, the last the labels; each passes its stage's sub-mesh
    # (no new group: the parent's per-dimension groups) so the collectives stay in the stage
    keep = "crop" if stage == 0 else "index"
    loader = kuat.DataLoader(Crops(), batch_size=4, shuffle=True, seed=5,
                             mesh=world["dp", "tp"], replicas="broadcast", replica_check_every=2,
                             collate_fn=lambda samples: torch.utils.data.default_collate(
                                 [{keep: s[keep]} for s in samples]))
    return stage, [[batch_hash(b[keep]).intdigest() if keep == "crop" else b[keep].tolist()
                    for b in loader] for _ in range(2)]


def test_pipeline_first_and_last_stage_only():
    results = run_ranks(_pipeline_body, 6, timeout=90)
    by_stage: dict[int, list] = {}
    for stage, epochs in results:
        by_stage.setdefault(stage, []).append(epochs)
    assert by_stage[1] == [None, None]
    for stage in (0, 2):  # both replicas of a stage: the same batches
        assert by_stage[stage][0] == by_stage[stage][1]
    # the last stage's labels are the samples the first stage's inputs came from, in order
    single = kuat.DataLoader(Crops(), batch_size=4, shuffle=True, seed=5, rank=0, world_size=1)
    for epoch, labels in enumerate(by_stage[2][0]):
        batches = list(single)
        assert labels == [b["index"].tolist() for b in batches]
        assert by_stage[0][0][epoch] == [batch_hash(b["crop"]).intdigest() for b in batches]


def _default_group_body(rank, world_size, sharded):
    kw = {"rank": rank % 2, "world_size": 2} if sharded else {}  # else: every rank everything
    modes = {replicas: _epochs(kuat.DataLoader(
        Crops(), batch_size=4, shuffle=True, seed=2, replicas=replicas, replica_check_every=2,
        isolate_global_rng=True, **kw)) for replicas in ("read", "broadcast")}
    bad = kuat.DataLoader(Crops(), batch_size=4, shuffle=True, seed=2 + (rank == 1),
                          replica_check_every=2, **kw)
    try:
        _epochs(bad, 1)
        error = None
    except ReplicaMismatchError as e:
        error = str(e)
    return modes, error


@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "rank-of-2"])
def test_without_a_mesh_replicas_are_ranks_of_equal_share(sharded):
    results = run_ranks(_default_group_body, 4, args=(sharded,), timeout=90)
    for rank, (modes, error) in enumerate(results):
        assert modes["broadcast"] == modes["read"] == results[rank % 2][0]["read"]
        # rank 1 with another seed: caught on every rank, over the default process group
        assert "ranks [1] vs ranks" in error if sharded else "vs ranks [1]" in error
    if not sharded:
        assert results[0][0] == results[1][0]  # torch's answer: every rank reads everything


def test_arguments_checked_and_one_process_needs_no_group():
    for kw, words in (({"replicas": "leader"}, "replicas should be 'read' or 'broadcast'"),
                      ({"replica_check_every": 0}, "replica_check_every should be a positive"),
                      ({"replica_check_every": True}, "replica_check_every should be a positive"),
                      ({"replica_check_every": 2.0}, "replica_check_every should be a positive")):
        with pytest.raises(ValueError, match=words):
            kuat.DataLoader(Crops(), **kw)
    plain = _epochs(kuat.DataLoader(Crops(), batch_size=4, shuffle=True, seed=1))
    both = kuat.DataLoader(Crops(), batch_size=4, shuffle=True, seed=1, replicas="broadcast",
                           replica_check_every=1)  # no process group: one rank, no collective
    assert _epochs(both) == plain and both._feed.steps == 2 * 6
    assert both.replicas == "broadcast" and both.replica_check_every == 1  # torch-style attributes


class _Stuck(torch.utils.data.Dataset):
    """Sample 2 never comes on rank 0 (waits up to 5 s on an event nobody sets)."""

    def __init__(self, rank):
        import threading

        self.rank, self.never = rank, threading.Event()

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 2 and self.rank == 0:
            self.never.wait(5)
        return i


def _stopped_body(rank, world_size):
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    loader = kuat.DataLoader(_Stuck(rank), batch_size=2, seed=0, mesh=mesh, num_workers=1,
                             worker_type="thread", timeout=0.5, replicas="broadcast")
    got = []
    try:
        for b in loader:
            got.append(b.tolist())
    except Exception as e:  # the leader's time-out; its peer hears of it instead of waiting
        return got, type(e).__name__, str(e)
    return got, None, None


def test_broadcast_a_leader_that_stops_stops_its_peers():
    (got0, kind0, _), (got1, kind1, msg1) = run_ranks(_stopped_body, 2, timeout=60)
    assert got0 == got1 == [[0, 1]]
    assert kind0 == "LoaderTimeoutError"
    assert kind1 == "RuntimeError" and "rank 0" in msg1 and "LoaderTimeoutError" in msg1
