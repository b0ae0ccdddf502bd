"""Conversion on a two-node Ray cluster on this machine (loopback only), against the local
engine. The one-node tests and the helpers are in ``test_convert_ray.py``.

The cluster is Ray's own ``ray.cluster_utils.Cluster``: a head and a second node, each a
raylet with its own CPU, started and stopped by this fixture; it is what
``ray start --head --node-ip-address=127.0.0.1`` plus ``ray start --address=...`` build,
but its ``shutdown()`` stops exactly the processes it started, where ``ray stop`` ends every
Ray process on the machine by name.
"""

from __future__ import annotations

import json

import pytest
from test_convert_ray import (
    N_IMAGES,
    check_same_dataset,
    make_imagefolder,
    workers_import_tests,
)

import kuat.convert

ray = pytest.importorskip("ray")  # test_convert_ray set Ray's environment before importing it

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    with workers_import_tests():
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "include_dashboard": False},
        )
    try:
        with workers_import_tests():
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes(timeout=60)
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            runtime_env={"worker_process_setup_hook": "_ray_faults.install"},
        )
        try:
            yield cluster
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


def test_two_nodes_same_rows_as_local(two_nodes, tmp_path):
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2 and {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
    assert two_nodes.address.startswith("127.0.0.1:")
    images = make_imagefolder(tmp_path / "train", broken=1)
    opts = dict(on_error="skip", resize_shorter=40, progress=False)
    kuat.convert.from_imagefolder(images, tmp_path / "local", **opts)
    report = kuat.convert.from_imagefolder(
        images, tmp_path / "spread", engine="ray", rows_per_task=30, **opts
    )
    assert report.rows == N_IMAGES and len(report.skipped) == 1
    check_same_dataset(tmp_path / "spread", tmp_path / "local")
    # the parts were written on both nodes (Ray Data spreads its tasks)
    written_on = {p.read_text() for p in (tmp_path / "spread.nodes").iterdir()}
    assert written_on == {n["NodeID"] for n in nodes}

    lines = [{"id": i, "text": f"line {i}", "score": i / 7} for i in range(300)]
    src = []  # four files: one Ray task each
    for k in range(4):
        src.append(tmp_path / f"lines-{k}.jsonl")
        src[-1].write_text("".join(json.dumps(r) + "\n" for r in lines[k * 75 : (k + 1) * 75]))
    kuat.convert.from_jsonl(src, tmp_path / "jl-local", progress=False)
    kuat.convert.from_jsonl(src, tmp_path / "jl-ray", engine="ray", progress=False)
    check_same_dataset(tmp_path / "jl-ray", tmp_path / "jl-local")
