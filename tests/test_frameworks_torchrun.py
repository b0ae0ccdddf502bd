"""torchrun with 2 processes (gloo): loaders built before ``init_process_group``, and Accelerate's
``prepare`` across ranks; each compared with torch's loader in the same run (issues #10, #28)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import kuat

pytest.importorskip("accelerate")

SCRIPT = Path(__file__).with_name("_torchrun_script.py")
SRC = Path(kuat.__file__).resolve().parents[1]
N = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun") / "result.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1", "--monitor-interval=0.1",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(SCRIPT), str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "reading rank" in proc.stderr  # the one warning that the process group is not up
    return json.loads(out.read_text())


def _disjoint_equal_halves(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) == N // 2 and not set(a) & set(b) and set(a) | set(b) == set(range(N))


@pytest.mark.slow
def test_loaders_built_before_init_process_group(ranks):
    """Unsharded (the default): every rank reads every sample, before and after the process
    group exists, as torch's loader. ``shard=True``: the share from RANK/WORLD_SIZE, then from
    torch.distributed (the same), in kuat's order of that rank; unshuffled, it is
    DistributedSampler's share."""
    assert [r["env_share"] for r in ranks] == [[0, 2], [1, 2]]
    for r in ranks:
        assert r["plain"] == [r["torch_plain"]] * 2 == [list(range(N))] * 2
        assert r["kuat_sharded_unshuffled"] == r["torch_sharded"]
    for epoch in range(2):
        assert _disjoint_equal_halves(*(r["sharded"][epoch] for r in ranks))
    for rank, r in enumerate(ranks):
        expected = kuat.DataLoader(list(range(N)), batch_size=4, shuffle=True, seed=1, rank=rank, world_size=2)
        assert r["sharded"] == [[int(x) for b in expected for x in b] for _ in range(2)]


@pytest.mark.slow
def test_accelerate_prepare_gives_disjoint_equal_shares(ranks):
    """Accelerate shards kuat's loader as torch's (its BatchSamplerShard): unshuffled, the same
    batches; shuffled with seed=, disjoint halves (the order is kuat's (seed, epoch))."""
    assert all(r["accelerate_kuat_is_kuat"] for r in ranks)
    assert _disjoint_equal_halves(*(r["accelerate_torch"] for r in ranks))
    assert _disjoint_equal_halves(*(r["accelerate_kuat"] for r in ranks))
    for r in ranks:
        assert r["accelerate_kuat_unshuffled"] == r["accelerate_torch_unshuffled"]
