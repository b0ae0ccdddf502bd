"""Conversion on Ray Data (``engine="ray"``) against the local engine, on a one-node Ray
instance this module starts on loopback (the two-node cluster is in
``test_convert_ray_cluster.py``).

Ray must not reach the network: usage stats are off, and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
makes Ray keep 127.0.0.1 as the node address (on Linux it otherwise replaces a loopback
``_node_ip_address`` with the address of the default route and binds its servers there).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import test_format_remote

import kuat
import kuat.convert
from kuat.cli import main as cli_main
from kuat.convert._ray_parts import PART_RECORD, staging_dir
from kuat.errors import DecodeError, FormatError, SchemaError
from kuat.format import verify

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# before Ray is imported: it reads both when its constants module loads
for _k, _v in RAY_ENV.items():
    os.environ.setdefault(_k, _v)

ray = pytest.importorskip("ray")

s3_endpoint = test_format_remote.s3_endpoint  # a moto S3 server on 127.0.0.1 (module scope)

pytestmark = pytest.mark.slow
N_IMAGES = 240


def _jpeg(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    hwc = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)  # (H, W, 3) uint8
    return simplejpeg.encode_jpeg(hwc, quality=80, colorspace="RGB")


def make_imagefolder(root: Path, n: int = N_IMAGES, broken: int = 0) -> Path:
    """``n`` small JPEGs (sizes vary, some above 40 px on the shorter side) in 4 classes,
    plus ``broken`` files with a .jpg name that are not images."""
    for i in range(n):
        d = root / f"class{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"img{i:04d}.jpg").write_bytes(_jpeg(24 + i % 40, 20 + (7 * i) % 45, i))
    for i in range(broken):
        (root / "class1" / f"broken{i}.jpg").write_bytes(b"not a jpeg")
    return root


def rows_of(path, storage_options=None) -> list[tuple]:
    """Every row of a dataset as a hashable tuple (images: bytes, width, height, codec)."""
    ds = kuat.open(path, storage_options=storage_options)
    out = []
    for i in range(len(ds)):
        row = ds.raw(i)
        out.append(tuple((k, _hashable(v)) for k, v in sorted(row.items())))
    return out


def _hashable(v):
    if hasattr(v, "tolist"):  # numpy arrays (sequence, tensor fields)
        v = v.tolist()
    if isinstance(v, (list, tuple)):  # EncodedImage is a tuple: (data, width, height, codec)
        return tuple(_hashable(x) for x in v)
    return v


def check_same_dataset(ray_dst, local_dst, storage_options=None) -> None:
    """Same rows (as multisets, and in the same order), both pass ``verify``, same metadata."""
    got, want = rows_of(ray_dst, storage_options), rows_of(local_dst)
    assert collections.Counter(got) == collections.Counter(want)
    assert got == want  # the driver also keeps the local engine's order
    report = verify(ray_dst, images=True, storage_options=storage_options)
    assert report.ok, report
    report = verify(local_dst, images=True)
    assert report.ok, report
    on_ray = kuat.open(ray_dst, storage_options=storage_options).manifest.metadata
    assert on_ray == kuat.open(local_dst).manifest.metadata


@contextlib.contextmanager
def workers_import_tests():
    """While Ray starts its processes, PYTHONPATH also names tests/ (for ``_ray_faults``):
    they inherit it, and the workers import the setup hook by name."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *sys.path[1:]])
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    with workers_import_tests():
        ray.init(
            num_cpus=2,
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"worker_process_setup_hook": "_ray_faults.install"},
        )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("src") / "train", broken=2)


def test_cluster_is_loopback_only(ray_local):
    assert ray_local.startswith("127.0.0.1:")
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}


def test_imagefolder_same_rows_as_local(ray_local, images, tmp_path):
    opts = dict(on_error="skip", resize_shorter=40, shard_bytes=64 << 10, progress=False)
    local = kuat.convert.from_imagefolder(images, tmp_path / "local", **opts)
    on_ray = kuat.convert.from_imagefolder(
        images, tmp_path / "ray", engine="ray", rows_per_task=50, **opts
    )
    assert on_ray.rows == local.rows == N_IMAGES
    assert sorted(on_ray.skipped) == sorted(local.skipped) and len(local.skipped) == 2
    check_same_dataset(tmp_path / "ray", tmp_path / "local")
    # the tasks' shards were moved, not copied, and the staging folder is gone
    assert not staging_dir(tmp_path / "ray").exists()
    assert len(kuat.open(tmp_path / "ray").manifest.shards) >= 5  # at least one per task


def _resumed(caplog) -> int:
    """Parts the last conversion took from an earlier run (the driver's log line)."""
    found = re.findall(r"resumed (\d+) of \d+ parts", caplog.text)
    return int(found[-1]) if found else 0


def test_rerun_resumes_finished_parts_and_restart_starts_over(ray_local, tmp_path, caplog):
    # class1 starts with two files that are no images: with on_error="raise" every run stops
    # at part 1, after part 0 (class0's 60 images) is finished
    src = make_imagefolder(tmp_path / "train", broken=2)
    dst = tmp_path / "out"
    kw = dict(engine="ray", rows_per_task=60, progress=False)
    caplog.set_level(logging.INFO, logger="kuat.convert.ray")

    def fails(**more):
        caplog.clear()
        with pytest.raises(DecodeError, match=r"broken0\.jpg"):
            kuat.convert.from_imagefolder(src, dst, **kw, **more)
        assert not (dst / "manifest.json").exists()  # no reader sees a partial dataset
        assert (staging_dir(dst) / "part-00000" / "manifest.json").exists()  # kept for a rerun

    fails()
    fails(restart=True)
    assert _resumed(caplog) == 0  # --restart: every part written again
    fails()
    assert _resumed(caplog) >= 1
    fails(resize_shorter=40)  # other options: another fingerprint, nothing is resumed
    assert _resumed(caplog) == 0 and "other inputs or options" in caplog.text
    record = kuat.open(staging_dir(dst) / "part-00000").manifest.metadata[PART_RECORD]
    assert record["inputs"] == 60 and record["first_input"].endswith("class0/img0000.jpg")
    assert record["fingerprint"].startswith("sha256:")
    # the input fixed: parts 1.. now hold other files and are written again, part 0 is kept
    for p in src.glob("class1/broken*"):
        p.unlink()
    caplog.clear()
    report = kuat.convert.from_imagefolder(src, dst, resize_shorter=40, **kw)
    assert _resumed(caplog) >= 1 and report.rows == N_IMAGES
    assert not staging_dir(dst).exists()
    kuat.convert.from_imagefolder(src, tmp_path / "local", resize_shorter=40, progress=False)
    check_same_dataset(dst, tmp_path / "local")  # as an uninterrupted run: rows and order


def test_edited_input_restarts_its_part(ray_local, tmp_path, caplog):
    src = make_imagefolder(tmp_path / "train", n=40, broken=1)  # part 1 holds the broken file
    dst = tmp_path / "out"
    kw = dict(engine="ray", rows_per_task=10, progress=False)
    with pytest.raises(DecodeError) as info:
        kuat.convert.from_imagefolder(src, dst, **kw)
    # as the local engine raises it (its message names the file, its cause is PIL's), plus
    # where it was raised
    assert "broken0.jpg" in str(info.value) and info.value.__cause__ is not None
    assert any(re.match(r"Raised in kuat's Ray task for item \d+ ", n)
               for n in info.value.__notes__)
    first = src / "class0" / "img0000.jpg"
    first.write_bytes(_jpeg(33, 31, 99))  # part 0's input changed since its record
    (src / "class1" / "broken0.jpg").unlink()
    caplog.set_level(logging.INFO, logger="kuat.convert.ray")
    kuat.convert.from_imagefolder(src, dst, **kw)
    assert "part-00000 was written from other inputs or options" in caplog.text
    kuat.convert.from_imagefolder(src, tmp_path / "local", progress=False)
    check_same_dataset(dst, tmp_path / "local")


def test_jsonl_with_image_paths_same_rows_as_local(ray_local, images, tmp_path):
    files = sorted(images.glob("class*/img*.jpg"))
    lines = [
        {"id": i, "caption": f"picture {i}", "pic": str(p.relative_to(images)), "v": [i, i * 2]}
        for i, p in enumerate(files)
    ]
    src = []  # three files: one Ray task each
    for k in range(3):
        src.append(images / f"captions-{k}.jsonl")
        src[-1].write_text("".join(json.dumps(r) + "\n" for r in lines[k::3]))
    opts = dict(image_fields=["pic"], resize_shorter=32, progress=False)
    kuat.convert.from_jsonl(src, tmp_path / "local", **opts)
    kuat.convert.from_jsonl(src, tmp_path / "ray", engine="ray", **opts)
    check_same_dataset(tmp_path / "ray", tmp_path / "local")
    # without images both engines write whole Arrow batches (Writer.write_batch)
    plain = images / "plain.jsonl"
    plain.write_text("".join(json.dumps({"id": r["id"], "v": r["v"]}) + "\n" for r in lines))
    kuat.convert.from_jsonl(plain, tmp_path / "plain-local", progress=False)
    kuat.convert.from_jsonl(plain, f"file://{tmp_path}/plain-ray", engine="ray", progress=False)
    check_same_dataset(tmp_path / "plain-ray", tmp_path / "plain-local")  # file:// is local
    assert not staging_dir(tmp_path / "plain-ray").exists()


def test_failed_part_is_retried_without_deprecated_ray_args(ray_local, images, tmp_path):
    # _ray_faults makes the first attempt of every part raise OSError while closing
    dst = tmp_path / "flaky"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kuat.convert.from_imagefolder(
            images, dst, engine="ray", rows_per_task=100, on_error="skip", progress=False
        )
    # Ray 2.60 deprecates map_batches(**ray_remote_args) (removed in 2.64): none is passed
    assert not [w for w in caught if "ray_remote_args" in str(w.message)]
    failed = sorted(p.name for p in (tmp_path / "flaky.failed").iterdir())
    assert failed == ["part-00000", "part-00001", "part-00002"]  # each part failed once
    assert report.rows == N_IMAGES and verify(dst).ok
    kuat.convert.from_imagefolder(images, tmp_path / "local", on_error="skip", progress=False)
    check_same_dataset(dst, tmp_path / "local")


@pytest.mark.parametrize("where", ["path", "s3"])
def test_killed_driver_leaves_no_manifest_and_rerun_resumes(
    ray_local, images, tmp_path, caplog, request, monkeypatch, where
):
    # the driver runs in a child process connected to this module's Ray instance; parts
    # after the first wait for a gate file (see _ray_faults), so the kill lands mid-run
    so = None
    dst = tmp_path / "gated"
    first = staging_dir(dst) / "part-00000" / "manifest.json"
    exists = os.path.exists
    if where == "s3":
        import s3fs

        monkeypatch.setenv("KUAT_CACHE_DIR", str(tmp_path / "cache"))
        so = {"endpoint_url": request.getfixturevalue("s3_endpoint")}
        so.update(key="testing", secret="testing")  # the workers have no AWS_* variables
        fs = s3fs.S3FileSystem(**so)
        bucket = f"b-{uuid.uuid4().hex[:12]}"
        fs.mkdir(bucket)
        dst, first = f"s3://{bucket}/gated", f"{bucket}/gated/part-00000/manifest.json"

        def exists(key: str) -> bool:
            fs.invalidate_cache()
            return fs.exists(key)

    script = (
        "import json, sys, ray, kuat.convert\n"
        "ray.init(address=sys.argv[1], log_to_driver=False,"
        " runtime_env={'worker_process_setup_hook': '_ray_faults.install',"
        " 'env_vars': {'KUAT_TEST_GATES': sys.argv[4]}})\n"
        "kuat.convert.from_imagefolder(sys.argv[2], sys.argv[3], engine='ray',"
        " rows_per_task=60, on_error='skip', progress=False,"
        " storage_options=json.loads(sys.argv[5]))\n"
    )
    env = dict(os.environ, **RAY_ENV)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parent), *sys.path[1:], env.get("PYTHONPATH", "")]
    )
    argv = [ray_local, str(images), str(dst), str(tmp_path), json.dumps(so)]
    driver = subprocess.Popen(
        [sys.executable, "-c", script, *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not exists(first) and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exists(first), driver.stderr.read().decode()[-2000:] if driver.poll() else ""
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
        driver.stderr.close()
    with pytest.raises(FormatError, match="not a kuat dataset"):  # no reader sees a partial one
        kuat.open(dst, storage_options=so)
    (tmp_path / "gated.gate").touch()
    caplog.set_level(logging.INFO, logger="kuat.convert.ray")
    report = kuat.convert.from_imagefolder(
        images, dst, engine="ray", rows_per_task=60, on_error="skip", progress=False,
        storage_options=so,
    )  # fmt: skip
    assert _resumed(caplog) == 1  # part 0, finished before the kill; parts 1-3 written now
    assert report.rows == N_IMAGES and len(report.skipped) == 2
    assert not staging_dir(tmp_path / "gated").exists()
    kuat.convert.from_imagefolder(images, tmp_path / "local", on_error="skip", progress=False)
    check_same_dataset(dst, tmp_path / "local", storage_options=so)


def test_table_types_are_inferred_by_the_tasks(ray_local, tmp_path, monkeypatch):
    from kuat.convert._tabular_files import TableFiles

    def rows(name: str, values: list) -> Path:
        p = tmp_path / name
        p.write_text("".join(json.dumps({"id": i, "v": v}) + "\n" for i, v in enumerate(values)))
        return p

    ints, floats = rows("a.jsonl", list(range(8))), rows("b.jsonl", [i / 4 for i in range(8)])
    words = rows("c.jsonl", ["one", "two"])
    (tmp_path / "a.csv").write_text("id,v\n" + "".join(f"{i},{i}\n" for i in range(5)))
    (tmp_path / "b.csv").write_text("id,v\n" + "".join(f"{i},{i}.5\n" for i in range(5)))
    csvs = [tmp_path / "a.csv", tmp_path / "b.csv"]
    kuat.convert.from_jsonl([ints, floats], tmp_path / "jl-local", progress=False)
    kuat.convert.from_csv(csvs, tmp_path / "csv-local", progress=False)
    with pytest.raises(SchemaError) as local_conflict:
        kuat.convert.from_jsonl([ints, words], tmp_path / "x-local", progress=False)

    def read_on_the_driver(*args, **kwargs):
        raise AssertionError("the driver read rows to infer the types")

    monkeypatch.setattr(TableFiles, "infer", read_on_the_driver)  # the tasks' copies
    monkeypatch.setattr(TableFiles, "infer_file", read_on_the_driver)  # are not patched
    kuat.convert.from_jsonl([ints, floats], tmp_path / "jl-ray", engine="ray", progress=False)
    check_same_dataset(tmp_path / "jl-ray", tmp_path / "jl-local")  # int64 + float64 -> float64
    kuat.convert.from_csv(csvs, tmp_path / "csv-ray", engine="ray", progress=False)
    check_same_dataset(tmp_path / "csv-ray", tmp_path / "csv-local")
    # a later file that contradicts the types so far: the same error, naming file and row
    with pytest.raises(SchemaError) as ray_conflict:
        kuat.convert.from_jsonl([ints, words], tmp_path / "x-ray", engine="ray", progress=False)
    assert str(ray_conflict.value) == str(local_conflict.value)
    assert "c.jsonl row 0" in str(ray_conflict.value) and "a.jsonl row 0" in str(ray_conflict.value)
    assert not (tmp_path / "x-ray").exists() and not staging_dir(tmp_path / "x-ray").exists()


def test_cli_engine_ray(ray_local, images, tmp_path, capsys):
    dst = tmp_path / "cli"
    argv = ["convert", str(images), str(dst), "--engine", "ray", "--rows-per-task", "80"]
    assert cli_main([*argv, "--on-error", "skip", "--no-progress"]) == 0
    assert "wrote 240 rows" in capsys.readouterr().out
    assert cli_main(["verify", str(dst)]) == 0
    # an existing dataset is refused without --overwrite, as with the local engine
    assert cli_main([*argv, "--on-error", "skip", "--no-progress"]) == 1
    assert "already a kuat dataset" in capsys.readouterr().err
    argv += ["--overwrite", "--restart", "--on-error", "skip", "--no-progress"]
    assert cli_main(argv) == 0 and "wrote 240 rows" in capsys.readouterr().out


def test_engine_is_validated_and_refused_where_unsupported(tmp_path):
    with pytest.raises(ValueError, match="engine='spark'"):
        kuat.convert.ConvertOptions(engine="spark")
    with pytest.raises(ValueError, match="rows_per_task=0"):
        kuat.convert.ConvertOptions(rows_per_task=0)
    with pytest.raises(ValueError, match="restart='yes'"):
        kuat.convert.ConvertOptions(restart="yes")
    np.save(tmp_path / "a.npy", np.arange(4))
    with pytest.raises(ValueError, match="'numpy' converts locally only"):
        kuat.convert.convert(str(tmp_path / "a.npy"), tmp_path / "o", engine="ray")
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        tar.add(tmp_path / "a.npy", arcname="000.npy")
    with pytest.raises(ValueError, match="engine='ray': this converter runs locally only"):
        kuat.convert.from_webdataset(str(tmp_path / "a.tar"), tmp_path / "o", engine="ray")
    assert not (tmp_path / "o").exists()
