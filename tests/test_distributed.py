"""Rank shares under a real torchrun launch (2 CPU processes, gloo), over every source kind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import kuat

datasets = pytest.importorskip("datasets")

N = 26  # samples per source: 13 per rank, batch 6 -> 3 batches (or 2 with drop_last)
SCRIPT = Path(__file__).with_name("_distributed_script.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    with kuat.Writer(d / "ds.kuat", {"id": kuat.format.int64()}) as w:
        for i in range(N):
            w.write({"id": i})
    datasets.Dataset.from_dict({"id": list(range(100, 100 + N))}).save_to_disk(str(d / "hf"))
    datasets.Dataset.from_dict({"id": list(range(200, 200 + N))}).save_to_disk(str(d / "hf2"))
    out = d / "result.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1", "--monitor-interval=0.1",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
        str(SCRIPT), str(d), str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


EXPECTED = {
    "kuat": set(range(N)),
    "hf_map": set(range(100, 100 + N)),
    "hf_stream": set(range(200, 200 + N)),
    "mix_map": set(range(N)) | set(range(100, 100 + N)),
    "mix_stream": set(range(N)) | set(range(200, 200 + N)),
}


@pytest.mark.slow  # two fresh interpreters import torch and datasets (~5 s CPU)
@pytest.mark.parametrize("name", list(EXPECTED))
@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_shares(run, name, drop_last):
    per_rank = run[f"{name}/drop_last={drop_last}"]  # [rank][epoch][batch] -> ids
    assert len(per_rank) == 2
    total = len(EXPECTED[name])
    share = total // 2  # both totals (26, 52) are even: no padding needed, nothing dropped
    for epoch in range(2):
        counts = [len(r[epoch]) for r in per_rank]
        assert counts[0] == counts[1], f"epoch {epoch}: batch counts {counts}"
        expect = share // 6 if drop_last else -(-share // 6)
        assert counts[0] == expect
        assert all(len(b) > 0 for r in per_rank for b in r[epoch])
        ids = [x for r in per_rank for b in r[epoch] for x in b]
        if drop_last:  # the rank's short last batch is dropped, nothing else
            assert len(ids) == len(set(ids)) == 2 * 6 * expect
            assert set(ids) <= EXPECTED[name]
        else:  # the ranks together cover the epoch, each sample once
            assert sorted(ids) == sorted(EXPECTED[name])
        # the two ranks read disjoint shares
        assert not {x for b in per_rank[0][epoch] for x in b} & {
            x for b in per_rank[1][epoch] for x in b
        }
    if name != "hf_stream":  # shuffled (or per-epoch mixed) orders differ between epochs
        e0, e1 = ([x for b in per_rank[0][e] for x in b] for e in range(2))
        assert e0 != e1
