"""Mosaic Streaming's ``MDSWriter`` for the ingest workload only, in the project's interpreter.

The same writer as the ``streaming`` adapter (:func:`benchmarks.adapters.streaming.write_mds`:
``columns={"image": "jpeg", "label": "int"}``, ``compression=None``, default 64 MB shards,
fed ``PIL.Image.open(path)``, whose ``jpeg`` encoding stores the file's original bytes: no
re-encode, the same bytes kuat's converter stores). It runs from the ``mds`` overlay
(:mod:`benchmarks.envs`: ``mosaicml-streaming`` installed ``--no-deps`` beside the project's
packages), so the row needs no separate torch install and times the writer on exactly the
interpreter, numpy and Pillow that ``kuat convert`` runs on. Reading MDS shards is measured by
the ``streaming`` loader in its own environment.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import envs
from benchmarks.adapters import streaming

WORKLOADS = ("ingest",)

envs.use_overlay("mds")  # before `import streaming` anywhere in this process


def versions() -> dict[str, str]:
    from importlib.metadata import version

    from streaming import MDSWriter  # noqa: F401  (imported before ingest is timed)

    return {"mosaicml-streaming": version("mosaicml-streaming")}


def ingest(data: dict, out_dir: Path, workers: int) -> int:
    return streaming.write_mds(data["root"], out_dir)
