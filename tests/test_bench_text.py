"""benchmarks/bench_text.py runs end to end on a small corpus and reports every workload."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")


def test_bench_text_reports_every_workload(tmp_path, capsys):
    from benchmarks import bench_text

    out = tmp_path / "r" / "text.json"
    args = ["--docs", "400", "--seq-len", "256", "--repeats", "1", "--cache-dir", str(tmp_path)]
    assert bench_text.main(args + ["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "padding waste" in printed and "resume" in printed
    result = json.loads(out.read_text())
    assert {
        "kuat concat (tokenized)",
        "kuat best_fit (tokenized)",
        "kuat best_fit (raw text)",
    } <= set(result["pack"])
    pack = result["pack"]
    assert pack["kuat concat (tokenized)"]["rows"] == -(-result["tokens"] // 256)  # no gaps
    assert pack["kuat best_fit (tokenized)"]["rows"] <= pack["kuat first_fit (tokenized)"]["rows"]
    assert result["waste"]["best_fit"] < result["waste"]["naive per-sample (batch 8)"]
    assert result["memory"]["disk_bytes_per_token"] < 2.5
    assert set(result["resume_ms"]) == {"10%", "50%", "90%"}
    # the peers run in a child (their own environment when set up): reported or said why not
    peers = result["peers"]
    for name in ("torchtune PackedDataset", "trl pack_dataset bfd", "trl pack_dataset wrapped"):
        assert name in pack or name in peers["unavailable"]
        if name in pack:  # per-round time ratios, wall and CPU, of every kuat packer to it
            ratios = result["ratios"][name]
            assert set(ratios) == {k for k in pack if k.startswith("kuat")}
            for r in ratios.values():
                assert r["wall"][1] <= r["wall"][0] <= r["wall"][2] and r["cpu"][0] > 0


def test_text_peers_child_reports_runs_or_why_not(tmp_path):
    """benchmarks/text_peers.py, as the bench runs it (a script, in whatever interpreter holds
    the peers): every peer either timed on the given tokens or named unavailable."""
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    from benchmarks.text_peers import write_tokens

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 500, rng.integers(1, 40)).astype(np.uint16) for _ in range(60)]
    write_tokens(tmp_path / "t.npz", docs)
    script = Path(__file__).parents[1] / "benchmarks" / "text_peers.py"
    out = tmp_path / "o.json"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "t.npz"), "64", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    names = {"torchtune PackedDataset", "trl pack_dataset bfd", "trl pack_dataset wrapped"}
    assert set(got["runs"]) | set(got["unavailable"]) == names
    total = sum(len(d) for d in docs)
    for name, (secs, first, rows, tokens, cpu) in got["runs"].items():
        assert rows >= -(-total // 64) and tokens >= total and secs >= first >= 0, name
        assert cpu > 0, name
