"""``kuat_ray`` on two local Ray nodes of half the CPUs each (see that module)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.adapters import kuat_ray
from benchmarks.adapters.kuat_ray import WORKLOADS, versions

__all__ = ["WORKLOADS", "versions", "ingest"]


def ingest(data: dict, out_dir: Path, workers: int) -> int:
    return kuat_ray.ingest(data, out_dir, workers, nodes=2)
