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
