"""Remote datasets (``kuat.format.fs`` / ``kuat.format.cache``) against real servers started here:
an S3-compatible server (moto's server mode, used through s3fs) and ``http.server``, both on
127.0.0.1 and a free port. Nothing leaves the machine."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import kuat
from kuat.cli import main as cli
from kuat.errors import FormatError
from kuat.format import Schema, Writer, int64, tensor
from kuat.format.cache import ShardCache
from kuat.format.fs import RemoteError, is_transient, open_remote

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 with dummy credentials in the environment."""
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port())
    server.start()
    try:
        yield f"http://127.0.0.1:{server._port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def bucket(s3_endpoint):
    """A fresh bucket: ``(s3://name, storage_options)``."""
    import s3fs

    name = f"b-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(endpoint_url=s3_endpoint).mkdir(name)
    return f"s3://{name}", {"endpoint_url": s3_endpoint}


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves ``server.root``; logs GET paths; ``server.fail[name]`` 503s that many GETs of a
    file; ``server.slow`` sends shards (or the requested byte range) in 1 KiB pieces 10 ms apart."""

    def __init__(self, *a, **kw):
        super().__init__(*a, directory=a[2].root, **kw)  # (request, client_address, server)

    def log_message(self, *args):
        pass

    def do_GET(self):
        name = self.path.rsplit("/", 1)[-1]
        self.server.gets.append(name)
        if self.server.fail.get(name, 0) > 0:
            self.server.fail[name] -= 1
            self.send_error(503, "slow down")
            return
        if self.server.slow and name.endswith(".arrow"):
            data = (Path(self.server.root) / self.path.lstrip("/")).read_bytes()
            spec = self.headers.get("Range")
            if spec:  # "bytes=a-b", inclusive
                a, b = (int(v) for v in spec.split("=")[1].split("-"))
                data = data[a : b + 1]
            self.send_response(206 if spec else 200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            for i in range(0, len(data), 1024):
                self.wfile.write(data[i : i + 1024])
                self.wfile.flush()
                time.sleep(0.01)  # the server is slow; nothing waits on this
            return
        super().do_GET()


@pytest.fixture
def http_root(tmp_path):
    """``(server, base URL)`` of an HTTP server on 127.0.0.1 serving ``tmp_path / "www"``."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.root, server.gets, server.fail, server.slow = str(root), [], {}, False
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


SCHEMA = Schema({"x": tensor((4,), "float32"), "y": int64()})


def _write(path, n=60, shard_bytes=400, **kw):
    with Writer(path, SCHEMA, shard_bytes=shard_bytes, **kw) as w:
        w.write_batch({"x": np.arange(n * 4, dtype=np.float32).reshape(n, 4), "y": np.arange(n)})


def _batches(loader):
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def _equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=0)


# -- S3 ------------------------------------------------------------------------------------------
def test_s3_convert_open_epoch_resume_verify_merge(bucket, tmp_path, monkeypatch):
    url, so = bucket
    ep = so["endpoint_url"]
    n = 60
    np.save(tmp_path / "y.npy", np.arange(n))
    np.save(tmp_path / "x.npy", np.arange(n * 4, dtype=np.float32).reshape(n, 4))
    monkeypatch.chdir(tmp_path)
    src = [str(tmp_path / "x.npy"), str(tmp_path / "y.npy")]
    argv = ["convert", *src, f"{url}/ds.kuat", "--shard-bytes", "400", "--no-progress"]
    assert cli([*argv, "--storage-option", f"endpoint_url={ep}"]) == 0
    assert not any(p.name.startswith("s3") for p in tmp_path.iterdir())  # nothing local
    # the local twin, converted the same way, is the reference for every read
    assert cli(["convert", *src, "local.kuat", "--shard-bytes", "400", "--no-progress"]) == 0
    local = kuat.open(tmp_path / "local.kuat")
    ds = kuat.open(f"{url}/ds.kuat", storage_options=so, cache_dir=tmp_path / "cache")
    assert len(ds) == n and ds.num_shards == local.num_shards > 3
    assert ds.manifest.shards == local.manifest.shards  # same bytes, same checksums

    def loader(d):
        return kuat.DataLoader(d, batch_size=8, shuffle=True, num_workers=2, seed=3)

    want = _batches(loader(local))
    _equal(_batches(loader(ds)), want)
    procs = kuat.DataLoader(kuat.open(f"{url}/ds.kuat", storage_options=so,
                                      cache_dir=tmp_path / "cache-p"),
                            batch_size=8, shuffle=True, num_workers=2, seed=3,
                            worker_type="process")  # fmt: skip
    _equal(_batches(procs), want)  # workers share the on-disk cache the prefetcher fills
    # resume mid-epoch on a fresh dataset object with a cold cache
    ld = loader(ds)
    it = iter(ld)
    first = [next(it) for _ in range(3)]
    state = ld.state_dict()
    _equal([{k: v.clone() for k, v in b.items()} for b in first], want[:3])
    fresh = kuat.open(f"{url}/ds.kuat", storage_options=so, cache_dir=tmp_path / "cache2")
    resumed = loader(fresh)
    resumed.load_state_dict(state)
    _equal(_batches(resumed), want[3:])

    assert cli(["verify", f"{url}/ds.kuat", "--storage-option", f"endpoint_url={ep}"]) == 0
    m = kuat.format.merge([f"{url}/ds.kuat", tmp_path / "local.kuat"], f"{url}/m.kuat",
                          storage_options=so)  # fmt: skip
    assert m.num_rows == 2 * n
    merged = kuat.open(f"{url}/m.kuat", storage_options=so, cache_dir=tmp_path / "cache")
    assert [merged[i]["y"] for i in (0, n - 1, n, 2 * n - 1)] == [0, n - 1, 0, n - 1]
    assert kuat.format.verify(f"{url}/m.kuat", storage_options=so).ok
    argv = ["merge", f"{url}/m.kuat", "-o", "back.kuat", "--storage-option", f"endpoint_url={ep}"]
    assert cli(argv) == 0
    assert kuat.format.verify("back.kuat").ok and len(kuat.open("back.kuat")) == 2 * n


def test_s3_overwrite_and_refusals(bucket, tmp_path):
    url, so = bucket
    _write(f"{url}/d.kuat", storage_options=so)
    with pytest.raises(FileExistsError, match="already a kuat dataset"):
        _write(f"{url}/d.kuat", storage_options=so)
    _write(f"{url}/d.kuat", n=10, overwrite=True, storage_options=so)
    ds = kuat.open(f"{url}/d.kuat", storage_options=so, cache_dir=tmp_path)
    assert len(ds) == 10
    remote = open_remote(f"{url}/d.kuat", so)
    names = sorted(p.rsplit("/", 1)[-1] for p in remote.fs.ls(remote.path, detail=False))
    assert names == ["manifest.json"] + [s.file for s in ds.manifest.shards]  # old shards gone
    with pytest.raises(ValueError, match="storage_options are for URLs"):
        kuat.open(tmp_path, storage_options=so)


def test_s3_corrupt_shard_fails_on_arrival_naming_url(bucket, tmp_path):
    url, so = bucket
    _write(f"{url}/d.kuat", storage_options=so)
    remote = open_remote(f"{url}/d.kuat", so)
    name = kuat.format.read_manifest(f"{url}/d.kuat", storage_options=so).shards[1].file
    data = bytearray(remote.fs.cat_file(remote.path_of(name)))
    data[-20] ^= 0xFF  # same size, other bytes
    remote.fs.pipe_file(remote.path_of(name), bytes(data))
    ds = kuat.open(f"{url}/d.kuat", storage_options=so, cache_dir=tmp_path / "c")
    with pytest.raises(FormatError, match=f"{url}/d.kuat/{name} checksum mismatch"):
        ds.__getitems__(list(range(len(ds))))
    assert not list((tmp_path / "c").glob("*.arrow"))[1:]  # at most the good shard 0
    report = kuat.format.verify(f"{url}/d.kuat", storage_options=so)
    assert [e.path for e in report.errors] == [f"{url}/d.kuat/{name}"]


def test_unreachable_endpoint_fails_clearly_and_writes_nothing(tmp_path, monkeypatch, s3_endpoint):
    monkeypatch.setenv("KUAT_REMOTE_RETRIES", "2")
    monkeypatch.chdir(tmp_path)
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    so = {"endpoint_url": dead}
    with pytest.raises(RemoteError, match=r"s3://b/x\.kuat/manifest\.json failed after 2") as e:
        kuat.open("s3://b/x.kuat", storage_options=so)
    assert e.value.url == "s3://b/x.kuat/manifest.json" and e.value.__cause__ is not None
    with pytest.raises(RemoteError, match="s3://b/y.kuat"):
        _write("s3://b/y.kuat", storage_options=so)
    np.save(tmp_path / "a.npy", np.arange(10))
    before = sorted(os.listdir(tmp_path))
    argv = ["convert", "a.npy", "s3://my-bucket/train.kuat", "--no-progress"]
    assert cli([*argv, "--storage-option", f"endpoint_url={dead}"]) == 1
    assert sorted(os.listdir(tmp_path)) == before  # no local folder named "s3:"


@pytest.mark.parametrize(
    "command, applies_to",
    [("merge", "every URL among SOURCES and --out"), ("verify", "the URL PATH"),
     ("convert", "every URL among the sources and the destination")],
)  # fmt: skip
def test_help_says_which_urls_one_set_of_storage_options_serves(command, applies_to, capsys):
    with pytest.raises(SystemExit):
        cli([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert f"one set for {applies_to}" in text and "local paths ignore it" in text


# -- HTTP ----------------------------------------------------------------------------------------
def test_http_tabular_source_and_dataset(http_root, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    server, base = http_root
    www = Path(server.root)
    pq.write_table(pa.table({"a": np.arange(30), "b": np.arange(30) * 0.5}), www / "t.parquet")
    kuat.convert.from_parquet(f"{base}/t.parquet", tmp_path / "t.kuat", progress=False)
    kuat.convert.from_parquet(www / "t.parquet", tmp_path / "ref.kuat", progress=False)
    assert kuat.open(tmp_path / "t.kuat").manifest.shards == (
        kuat.open(tmp_path / "ref.kuat").manifest.shards
    )
    with pytest.raises(FileNotFoundError, match="no such file"):
        kuat.convert.from_parquet(f"{base}/missing.parquet", tmp_path / "m.kuat", progress=False)

    _write(www / "d.kuat")
    ds = kuat.open(f"{base}/d.kuat", cache_dir=tmp_path / "c")
    ref = kuat.open(www / "d.kuat")
    idx = list(range(len(ds)))
    np.testing.assert_array_equal(ds.read_batch(idx)["x"], ref.read_batch(idx)["x"])


@pytest.mark.parametrize(
    "name, content, error",
    [
        ("bad.jsonl", b'{"a": 1}\n{"a": \n', FormatError),  # does not parse
        ("items.json", b'[{"a": 1}, 2]', FormatError),  # an array item is no record
        ("mixed.json", b'[{"a": 1}, {"a": "x"}]', ValueError),  # a column of two types
        ("bad.parquet", b"PAR1 not parquet", FormatError),
    ],
)
def test_http_tabular_errors_name_the_url_not_the_local_copy(http_root, tmp_path, name,
                                                             content, error):  # fmt: skip
    server, base = http_root
    (Path(server.root) / name).write_bytes(content)
    url = f"{base}/{name}"
    convert = kuat.convert.from_parquet if name.endswith(".parquet") else kuat.convert.from_jsonl
    with pytest.raises(error) as e:
        convert(url, tmp_path / "t.kuat", progress=False)
    assert url in str(e.value) and "kuat-sources-" not in str(e.value), str(e.value)
    if getattr(e.value, "path", None) is not None:
        assert e.value.path == url
    assert e.value.__cause__ is not None  # the error as raised on the copy, chained


def _assert_fetched_in_order(gets: list[str], first_use: list[str], depth: int) -> None:
    """Each shard was fetched once, in the order the epoch first uses them, up to ``depth`` at
    once (concurrent fetches reach the server in any order within that window)."""
    fetched = [g for g in gets if g.endswith(".arrow")]
    assert sorted(fetched) == sorted(first_use)
    rank = {name: i for i, name in enumerate(first_use)}
    assert all(rank[name] < i + depth for i, name in enumerate(fetched)), (fetched, first_use)


def test_http_prefetch_follows_the_epoch_order(http_root, tmp_path):
    server, base = http_root
    www = Path(server.root)
    _write(www / "d.kuat", n=200, shard_bytes=600)
    ds = kuat.open(f"{base}/d.kuat", cache_dir=tmp_path / "c", prefetch_shards=3)
    loader = kuat.DataLoader(ds, batch_size=10, shuffle=True, seed=7)
    order = loader.sampler.indices(0) if hasattr(loader.sampler, "indices") else None
    starts = np.cumsum([0] + [s.rows for s in ds.manifest.shards])[:-1]
    server.gets.clear()
    seen = [int(y) for b in loader for y in b["y"]]
    if order is not None:
        assert seen == list(order)
    sid = np.searchsorted(starts, np.asarray(seen), side="right") - 1
    _, first = np.unique(sid, return_index=True)
    first_use = [ds.manifest.shards[k].file for k in sid[np.sort(first)]]
    _assert_fetched_in_order(server.gets, first_use, depth=3)


def test_a_warm_epoch_fetches_nothing_and_starts_no_prefetch_threads(http_root, tmp_path):
    server, base = http_root
    _write(Path(server.root) / "d.kuat", n=200, shard_bytes=600)
    cold = kuat.open(f"{base}/d.kuat", cache_dir=tmp_path / "c", prefetch_shards=3)
    first = _batches(kuat.DataLoader(cold, batch_size=10, shuffle=True, seed=7, num_workers=2))
    cold.close()
    server.gets.clear()
    warm = kuat.open(f"{base}/d.kuat", cache_dir=tmp_path / "c", prefetch_shards=3)
    before = {t for t in threading.enumerate() if t.name.startswith("kuat-prefetch")}
    again = _batches(kuat.DataLoader(warm, batch_size=10, shuffle=True, seed=7, num_workers=2))
    started = {t for t in threading.enumerate() if t.name.startswith("kuat-prefetch")} - before
    _equal(first, again)
    assert [g for g in server.gets if g.endswith(".arrow")] == []  # every shard from the cache
    assert not started


def test_transient_http_errors_are_retried_then_reported(http_root, tmp_path):
    server, base = http_root
    _write(Path(server.root) / "d.kuat")
    ds = kuat.open(f"{base}/d.kuat", cache_dir=tmp_path / "c", prefetch_shards=0)
    name = ds.manifest.shards[0].file
    server.fail[name] = 2  # two 503s, then the file
    assert ds[0]["y"] == 0
    name = ds.manifest.shards[1].file
    server.fail[name] = 100
    os.environ["KUAT_REMOTE_RETRIES"] = "3"
    try:
        with pytest.raises(RemoteError, match=f"shard {name} from {base}/d.kuat/{name}"):
            ds[ds.manifest.shards[0].rows]
    finally:
        del os.environ["KUAT_REMOTE_RETRIES"]
    assert server.gets.count(name) == 3
    assert not [p for p in (tmp_path / "c").iterdir() if ".tmp-" in p.name]


def test_is_transient_classifies_like_http_and_os():
    class Reply(Exception):
        def __init__(self, status):
            self.status = status

    assert is_transient(ConnectionResetError()) and is_transient(TimeoutError())
    assert is_transient(Reply(503)) and is_transient(Reply(429))
    assert not is_transient(Reply(403)) and not is_transient(FileNotFoundError())
    assert not is_transient(PermissionError()) and not is_transient(FormatError("x"))


_KILLED_FETCH = """
import sys
import kuat.format.cache
from kuat.format.cache import ShardCache
kuat.format.cache.CHUNK_BYTES = 16 << 10  # parallel ranges, each written as it arrives
from kuat.format.fs import open_remote
from kuat.format import read_manifest
url, cache = sys.argv[1], sys.argv[2]
info = read_manifest(url).shards[0]
ShardCache(cache).get(open_remote(url), info.file, info)
"""


def test_killed_download_leaves_the_cache_consistent(http_root, tmp_path):
    server, base = http_root
    _write(Path(server.root) / "d.kuat", n=8000, shard_bytes=256 << 10)
    server.slow = True  # 16 ranges of 16 KiB, 8 at a time, each ~0.16 s: ~0.3 s per shard
    cache = tmp_path / "c"
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_FETCH, f"{base}/d.kuat", str(cache)],
                            env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(g.endswith(".arrow") for g in server.gets) < 9:
            time.sleep(0.005)  # polling until a first range is written (a 9th began), bounded
        assert any(".tmp-" in p.name for p in cache.iterdir())
        assert proc.poll() is None, "the download finished before it could be killed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert not list(cache.glob("*.arrow"))  # no entry from the killed download
    server.slow = False
    ds = kuat.open(f"{base}/d.kuat", cache_dir=cache)
    assert ds[0]["y"] == 0 and ds[len(ds) - 1]["y"] == len(ds) - 1
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]  # the dead one's bytes are gone
    entries = list(cache.glob("*.arrow"))
    assert len(entries) == len({ds.locate(0)[0], ds.locate(len(ds) - 1)[0]})
    info = ds.manifest.shards[0]
    assert ShardCache(cache).entry(f"{base}/d.kuat/{info.file}", info) in entries


# -- cache and fs seams (memory://) ------------------------------------------------------------
def test_cache_is_bounded_lru_and_shared(tmp_path):
    url = f"memory://kuat-test-{uuid.uuid4().hex[:8]}/d.kuat"
    _write(url, n=200, shard_bytes=600)
    shard_bytes = max(s.bytes for s in kuat.open(url, cache_dir=tmp_path).manifest.shards)
    limit = 3 * shard_bytes
    ds = kuat.open(url, cache_dir=tmp_path / "c", cache_limit_bytes=limit)
    assert [int(ds[i]["y"]) for i in range(len(ds))] == list(range(len(ds)))
    entries = list((tmp_path / "c").glob("*.arrow"))
    assert 0 < sum(p.stat().st_size for p in entries) <= limit
    newest = max(entries, key=lambda p: p.stat().st_mtime_ns)
    last = ds.manifest.shards[-1]
    assert newest == ShardCache(tmp_path / "c").entry(f"{url}/{last.file}", last)
    # a second dataset object (another loader) reuses the entries, fetching nothing again
    other = kuat.open(url, cache_dir=tmp_path / "c", cache_limit_bytes=limit)
    before = {p: p.stat().st_ino for p in entries}
    assert other[len(other) - 1]["y"] == len(other) - 1
    assert {p: p.stat().st_ino for p in entries if p.exists()}.items() <= before.items()
    with pytest.raises(ValueError, match="cache_limit_bytes=0"):
        kuat.open(url, cache_dir=tmp_path, cache_limit_bytes=0)


def test_missing_backend_names_the_package(monkeypatch):
    import fsspec  # noqa: F401

    registry = sys.modules["fsspec.registry"]._registry  # classes imported so far, by scheme
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed
    monkeypatch.delitem(registry, "gs", raising=False)
    monkeypatch.delitem(registry, "gcs", raising=False)
    with pytest.raises(ImportError, match=r"gs:// needs the gcsfs package.*pip install gcsfs"):
        kuat.open("gs://bucket/train.kuat")


def test_file_url_is_the_local_fast_path(tmp_path):
    _write(tmp_path / "d.kuat")
    ds = kuat.open(f"file://{tmp_path}/d.kuat")
    assert ds.path == tmp_path / "d.kuat" and ds[5]["y"] == 5


def test_shard_shuffle_sampler_prefetches_its_order(http_root, tmp_path):
    server, base = http_root
    _write(Path(server.root) / "d.kuat", n=300, shard_bytes=600)
    ds = kuat.open(f"{base}/d.kuat", cache_dir=tmp_path / "c", prefetch_shards=2)
    sampler = kuat.ShardShuffleSampler(ds, block_size=40, seed=1)
    server.gets.clear()
    seen = [int(y) for b in kuat.DataLoader(ds, batch_size=10, sampler=sampler) for y in b["y"]]
    assert seen == sampler.indices(0)
    starts = np.cumsum([0] + [s.rows for s in ds.manifest.shards])[:-1]
    sid = np.searchsorted(starts, np.asarray(seen), side="right") - 1
    _, first = np.unique(sid, return_index=True)
    _assert_fetched_in_order(
        server.gets, [ds.manifest.shards[k].file for k in sid[np.sort(first)]], depth=2
    )


# -- damaged cache entries and servers that ignore Range ---------------------------------------
def _expected_rows(root: Path) -> list[int]:
    """Every ``y`` of the dataset at ``root``, read from its shards with pyarrow (the reference)."""
    import pyarrow as pa

    from kuat.format import read_manifest

    manifest = read_manifest(str(root))
    ys = []
    for info in manifest.shards:
        with pa.memory_map(str(root / info.file)) as f:
            ys += pa.ipc.open_stream(f).read_all().column("y").to_pylist()
    return ys


def _read_all(url, cache):
    ds = kuat.open(url, cache_dir=cache, prefetch_shards=0)
    try:
        return [int(ds[i]["y"]) for i in range(len(ds))], ds
    finally:
        ds.close()


@pytest.mark.parametrize("damage", ["truncated", "same-size-changed", "stamp-lost"])
def test_a_damaged_cache_entry_is_fetched_again_naming_shard_and_url(http_root, tmp_path, damage,
                                                                       caplog, monkeypatch):
    server, base = http_root
    root = Path(server.root) / "d.kuat"
    _write(root, n=200, shard_bytes=600)
    want, cache = _expected_rows(root), tmp_path / "c"
    got, ds = _read_all(f"{base}/d.kuat", cache)
    assert got == want
    info = ds.manifest.shards[1]
    entry = ShardCache(cache).entry(f"{base}/d.kuat/{info.file}", info)
    data = bytearray(entry.read_bytes())
    if damage == "truncated":  # e.g. a disk that filled up while the cache dir was copied
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "same-size-changed":  # y values rewritten in place: same size, same mtime
        st = entry.stat()
        y = np.asarray(want[ds.manifest.shards[0].rows:][: info.rows], dtype="<i8").tobytes()
        at = bytes(data).index(y)
        data[at : at + len(y)] = np.full(info.rows, 7, dtype="<i8").tobytes()
        entry.write_bytes(bytes(data))
        os.utime(entry, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:  # an entry cached by an older kuat (no verification stamp): checked once, kept
        (cache / f".{entry.stem}.ok").unlink()
    server.gets.clear()
    import kuat.format.cache as cache_mod

    checksums = []
    real = cache_mod.file_checksum
    monkeypatch.setattr(cache_mod, "file_checksum", lambda p: checksums.append(p) or real(p))
    with caplog.at_level("WARNING", logger="kuat.format.cache"):
        got, _ = _read_all(f"{base}/d.kuat", cache)
    assert got == want
    fetched = [g for g in server.gets if g.endswith(".arrow")]
    warnings = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    if damage == "stamp-lost":
        assert fetched == [] and warnings == [] and checksums == [entry]
    else:
        assert fetched == [info.file]  # only the damaged shard, once
        assert len(warnings) == 1 and info.file in warnings[0] and f"{base}/d.kuat/{info.file}" in warnings[0]
        assert ("bytes" if damage == "truncated" else "checksum") in warnings[0]
    # a later run trusts the (re)verified entries: a stat and a stamp, no checksum, no fetch
    checksums.clear()
    server.gets.clear()
    assert _read_all(f"{base}/d.kuat", cache)[0] == want
    assert checksums == [] and [g for g in server.gets if g.endswith(".arrow")] == []


def test_a_server_that_ignores_range_serves_whole_shards(http_root, tmp_path, monkeypatch):
    # http.server's handler ignores Range: every ranged GET gets a 200 with the whole file
    import kuat.format.cache as cache_mod

    server, base = http_root
    root = Path(server.root) / "d.kuat"
    _write(root, n=2000, shard_bytes=16 << 10)
    monkeypatch.setattr(cache_mod, "CHUNK_BYTES", 2 << 10)  # several ranges per shard
    got, ds = _read_all(f"{base}/d.kuat", tmp_path / "c")
    assert got == _expected_rows(root)
    shards = [s.file for s in ds.manifest.shards]
    assert all(s.bytes > 2 * (2 << 10) for s in ds.manifest.shards)
    gets = [g for g in server.gets if g.endswith(".arrow")]
    assert sorted(set(gets)) == sorted(shards)
    assert len(gets) <= len(shards) * cache_mod.CHUNK_THREADS  # not one whole object per range
    # a wrong whole object (the shard changed at its URL) is still refused
    info = ds.manifest.shards[0]
    (root / info.file).write_bytes((root / info.file).read_bytes()[::-1])
    with pytest.raises(FormatError, match="checksum mismatch"):
        _read_all(f"{base}/d.kuat", tmp_path / "other")
