"""Conversion on a two-node Ray cluster on this machine (loopback only), against the local
engine, into a local path and into an S3 URL (moto's S3 server on 127.0.0.1, the fixture of
``test_format_remote.py``). The one-node tests and the helpers are in ``test_convert_ray.py``.

The cluster is Ray's own ``ray.cluster_utils.Cluster``: a head and a second node, each a
raylet with its own CPU, started and stopped by this fixture; it is what
``ray start --head --node-ip-address=127.0.0.1`` plus ``ray start --address=...`` build,
but its ``shutdown()`` stops exactly the processes it started, where ``ray stop`` ends every
Ray process on the machine by name.
"""

from __future__ import annotations

import json
import logging
import re
import uuid

import pytest
import test_format_remote
from test_convert_ray import (
    N_IMAGES,
    _resumed,
    check_same_dataset,
    make_imagefolder,
    workers_import_tests,
)

import kuat.convert
from kuat.errors import DecodeError

ray = pytest.importorskip("ray")  # test_convert_ray set Ray's environment before importing it

pytestmark = pytest.mark.slow

s3_endpoint = test_format_remote.s3_endpoint  # a moto S3 server on 127.0.0.1 (module scope)


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


def test_url_destination_same_rows_resume_and_refusals(
    two_nodes, s3_endpoint, tmp_path, caplog, monkeypatch
):
    import s3fs

    monkeypatch.setenv("KUAT_CACHE_DIR", str(tmp_path / "cache"))
    # the tasks get the credentials with the storage options (Ray's workers did not inherit
    # the fixture's AWS_* environment)
    so = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**so)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    url, prefix = f"s3://{bucket}/train.kuat", f"{bucket}/train.kuat"
    src = make_imagefolder(tmp_path / "train", n=120, broken=1)  # part 1 starts with it
    kw = dict(engine="ray", rows_per_task=30, progress=False, storage_options=so)
    caplog.set_level(logging.INFO, logger="kuat.convert.ray")

    # a failed run leaves the finished parts' records at the URL, and no manifest
    with pytest.raises(DecodeError, match=r"broken0\.jpg"):
        kuat.convert.from_imagefolder(src, url, **kw)
    fs.invalidate_cache()
    assert not fs.exists(f"{prefix}/manifest.json")
    assert fs.exists(f"{prefix}/part-00000/manifest.json")
    # the input fixed, the same command resumes and ends as an uninterrupted run would
    (src / "class1" / "broken0.jpg").unlink()
    caplog.clear()
    report = kuat.convert.from_imagefolder(src, url, **kw)
    assert _resumed(caplog) >= 1 and report.rows == 120
    kuat.convert.from_imagefolder(src, tmp_path / "local", progress=False)
    check_same_dataset(url, tmp_path / "local", storage_options=so)
    # written in place under part-based names (no copy); the part records are gone
    shards = kuat.open(url, storage_options=so).manifest.shards
    assert all(re.fullmatch(r"part-\d{5}/shard-\d{5}\.arrow", s.file) for s in shards)
    fs.invalidate_cache()
    assert fs.glob(f"{prefix}/part-*/manifest.json") == []
    # an existing dataset is refused; --overwrite --restart writes every part again
    with pytest.raises(FileExistsError, match="already a kuat dataset"):
        kuat.convert.from_imagefolder(src, url, **kw)
    caplog.clear()
    kuat.convert.from_imagefolder(src, url, overwrite=True, restart=True, **kw)
    assert _resumed(caplog) == 0
    check_same_dataset(url, tmp_path / "local", storage_options=so)
    # a prefix holding something else is refused, as by kuat.Writer
    fs.pipe_file(f"{bucket}/other.kuat/notes.txt", b"mine")
    with pytest.raises(FileExistsError, match="not a kuat dataset"):
        kuat.convert.from_imagefolder(src, f"s3://{bucket}/other.kuat", **kw)

    # tables: the types are inferred by the tasks, the shards written straight to the URL
    lines = [{"id": i, "text": f"line {i}", "score": i / 7} for i in range(90)]
    files = []
    for k in range(3):
        files.append(tmp_path / f"lines-{k}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in lines[k::3]))
    kuat.convert.from_jsonl(files, tmp_path / "jl-local", progress=False)
    kuat.convert.from_jsonl(files, f"s3://{bucket}/jl.kuat", **{**kw, "rows_per_task": 1000})
    check_same_dataset(f"s3://{bucket}/jl.kuat", tmp_path / "jl-local", storage_options=so)
    # and tables at a URL, each downloaded by its own tasks, into a local path
    for f in files:
        fs.put_file(str(f), f"{bucket}/src/{f.name}")
    urls = [f"s3://{bucket}/src/{f.name}" for f in files]
    kuat.convert.from_jsonl(urls, tmp_path / "jl-from-s3", **{**kw, "rows_per_task": 1000})
    check_same_dataset(tmp_path / "jl-from-s3", tmp_path / "jl-local")
