"""kuat's converter on Ray Data (``from_imagefolder(..., engine="ray")``), ingest only.

Each timed ingest starts a Ray cluster on this machine, loopback only (usage stats off), with
``num_workers`` CPUs in all: one node, or (``kuat_ray_2nodes``) two nodes of half the CPUs
each (``ray.cluster_utils.Cluster``: two raylets on one machine, as ``ray start`` twice would
make them). The time includes the cluster's start-up and shutdown, so the row against
``kuat convert`` (the local engine, same cores) is Ray's whole overhead at this size; the
start-up alone is in ``docs/scale.md``.
"""

from __future__ import annotations

import os
from pathlib import Path

WORKLOADS = ("ingest",)
ROWS_PER_TASK = 128  # several tasks per CPU even on the quick data set (512 images)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import kuat
    import kuat.convert.imagefolder  # noqa: F401  (imported before ingest is timed)

    return {"kuat": kuat.__version__, "ray": version("ray")}


def ingest(data: dict, out_dir: Path, workers: int, nodes: int = 1) -> int:
    # before Ray is imported (it reads them as it loads): no usage stats, and keep the
    # loopback node address (on Linux Ray otherwise swaps 127.0.0.1 for the default route's)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    import kuat
    from kuat.convert.imagefolder import from_imagefolder

    cluster = None
    if nodes == 1:
        ray.init(
            num_cpus=workers,
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=False,
        )
    else:
        from ray.cluster_utils import Cluster

        per_node = max(1, workers // nodes)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": per_node, "include_dashboard": False},
        )
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=per_node)
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address, log_to_driver=False)
    try:
        dst = out_dir / "data.kuat"
        from_imagefolder(
            data["root"],
            dst,
            engine="ray",
            rows_per_task=ROWS_PER_TASK,
            progress=False,
            overwrite=True,
            restart=True,  # time a whole conversion, never a resume of an interrupted run
        )
        return len(kuat.open(dst))
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
