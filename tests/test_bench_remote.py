"""Plumbing of ``kuat bench --workloads remote``: the delaying proxy, the server child, the
workload end to end on tiny data through the runner, and the README merge of its table.

Nothing is timed: the assertions are on bytes, request counts, sample counts and structure.
Every server binds 127.0.0.1.
"""

from __future__ import annotations

import http.client
import http.server
import json
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from benchmarks import bench_remote, readme, report, runner  # noqa: E402
from benchmarks.delay_proxy import DelayProxy  # noqa: E402

BODY = bytes(range(256)) * 64  # 16 KiB


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: several requests on one connection

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)


@pytest.fixture
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address
    server.shutdown()
    server.server_close()


def test_proxy_forwards_bytes_and_counts_each_request_once(http_server):
    with DelayProxy(http_server, delay_s=0.01) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        for _ in range(3):  # three requests, one keep-alive connection
            conn.request("GET", "/x")
            assert conn.getresponse().read() == BODY
        conn.close()
        other = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        other.request("GET", "/y")
        assert other.getresponse().read() == BODY
        other.close()
        assert (proxy.requests, proxy.connections) == (4, 2)
    with pytest.raises(OSError):  # closed: nothing listens any more
        http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=2).request("GET", "/")


def test_proxy_only_forwards_to_loopback():
    with pytest.raises(ValueError, match="loopback"):
        DelayProxy(("10.0.0.1", 80), 0.05)
    with pytest.raises(ValueError, match="delay_s"):
        DelayProxy(("127.0.0.1", 80), -1)


def test_remote_workload_through_the_runner_and_readme(tmp_path, monkeypatch):
    def tiny(quick, rounds, progress):  # a few shards of about 16 rows, one round
        return bench_remote.run(rows=48, shard_mib=16 * 4 / 1024, rounds=rounds,
                                block_shards=1, progress=progress)  # fmt: skip

    monkeypatch.setattr(bench_remote, "run_for_bench", tiny)
    cfg = runner.BenchConfig(
        out_dir=tmp_path / "out", quick=True, workloads=("remote",), runs=1, memory_runs=0,
        cache_dir=tmp_path / "cache",
    )  # fmt: skip
    results = runner.run_bench(cfg)
    res = results["tables"]["remote"]
    assert res["rows"] == 48 and res["shards"] >= 2 and res["prefetch_shards"] == 2
    assert list(res["cells"]) == list(bench_remote.CELLS)
    for cell in res["cells"].values():
        assert len(cell["runs"]) == 1 and cell["median"] > 0 and cell["open_ms"] > 0
    assert [r[0] for r in bench_remote.RATIOS] == list(res["ratios"])
    assert res["ratios"]["warm cache / local disk"]["target"] == 0.95
    assert not results["runs"] and not results["unavailable"]  # no loader was probed
    text = report.markdown(results)
    assert "remote: epoch throughput" in text and "S3, cold cache, +50 ms" in text
    assert "Load average" in text

    # a tables-only run joins the committed results, which keep their own runs
    committed = json.loads(readme.RESULTS.read_text())
    merged = readme.merge_tables(committed, json.loads((cfg.out_dir / "results.json").read_text()))
    assert merged["runs"] == committed["runs"] and merged["tables"]["remote"] == res
    assert "S3, warm cache" in readme.section(merged)


def test_servers_child_stops_when_closed():
    import s3fs

    with bench_remote.Servers(delay_ms=0) as srv:
        fs = s3fs.S3FileSystem(endpoint_url=srv.proxy, **bench_remote.CREDENTIALS)
        fs.mkdir("kuat-test")
        fs.pipe("kuat-test/a", b"abc")
        assert fs.cat_file("kuat-test/a") == b"abc"
    assert srv.proc.returncode is not None
