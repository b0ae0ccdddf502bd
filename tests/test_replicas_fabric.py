"""Lightning Fabric's ``ModelParallelStrategy`` on CPU (gloo, 4 forked ranks, 127.0.0.1): a kuat
loader given Fabric's device mesh splits over its ``data_parallel`` dimension as the
``DistributedSampler`` Fabric injects into torch's loader, and tensor-parallel peers read
bit-identical batches (random crops included)."""

import pytest
import torch
from torch.utils.data import DistributedSampler

import kuat
from tests._gloo import run_ranks
from tests.test_replicas import Crops, _epochs

pytest.importorskip("lightning")
from lightning.fabric import Fabric  # noqa: E402  (imported before the ranks fork: shared)
from lightning.fabric.strategies import ModelParallelStrategy  # noqa: E402

N = 21


def _fabric_body(rank, world_size, kw):
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ModelParallelStrategy(
        parallelize_fn=lambda module, mesh: module, data_parallel_size=2, tensor_parallel_size=2))
    fabric.launch()  # the process group is up (run_ranks): Fabric builds its mesh on it
    mesh = fabric.strategy.device_mesh  # ("data_parallel", "tensor_parallel")
    theirs = fabric.setup_dataloaders(torch.utils.data.DataLoader(list(range(N)), batch_size=3))
    ordered = fabric.setup_dataloaders(kuat.DataLoader(list(range(N)), batch_size=3, seed=0,
                                                       mesh=mesh))
    shuffled = fabric.setup_dataloaders(kuat.DataLoader(
        Crops(), batch_size=3, shuffle=True, seed=7, mesh=mesh, isolate_global_rng=True,
        replica_check_every=2, **kw))
    return {"coord": mesh.get_coordinate(), "theirs": [b.tolist() for b in theirs],
            "ordered": [b.tolist() for b in ordered], "shuffled": _epochs(shuffled)}


@pytest.mark.parametrize("kw", [{}, {"num_workers": 2, "worker_type": "thread"}],
                         ids=["w0", "thread2"])
def test_fabric_model_parallel_mesh(kw):
    results = run_ranks(_fabric_body, 4, args=(kw,), timeout=120)
    by_dp: dict[int, list] = {}
    for r in results:
        assert r["ordered"] == r["theirs"]  # Fabric's DistributedSampler over data_parallel
        by_dp.setdefault(r["coord"][0], []).append(r["shuffled"])
    for peers in by_dp.values():  # tensor-parallel peers: bit-identical batches
        assert len(peers) == 2 and peers[0] == peers[1]
    for epoch in range(2):
        seen = [i for d in (0, 1) for idx, _ in by_dp[d][0][epoch] for i in idx]
        assert set(seen) == set(range(N)) and len(seen) == 22


def test_lightning_rebuild_keeps_the_replica_arguments():
    """Lightning's _update_dataloader rebuilds ``type(loader)(**attributes)``."""
    from lightning.fabric.utilities.data import _update_dataloader

    loader = kuat.DataLoader(list(range(8)), batch_size=2, seed=0, replicas="broadcast",
                             replica_check_every=5)
    rebuilt = _update_dataloader(loader, DistributedSampler(range(8), num_replicas=2, rank=0))
    assert (rebuilt.replicas, rebuilt.replica_check_every) == ("broadcast", 5)
    assert rebuilt._feed is not None and rebuilt._feed.check_every == 5
