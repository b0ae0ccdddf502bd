"""``benchmarks/gpu_check.py --smoke``: the GPU host's prepared script, run end to end on the
CPU at toy sizes (1 and 2 workers, a tiny model instead of ResNet-50, nvJPEG and DALI skipped),
so that the script a lent GPU runs once is known to work before it gets there.

Nothing is timed as an assertion (a busy machine would make that flaky): the smoke run takes
15-30 s on 2 cores, and the timeout only turns a hang into a failure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import gpu_check  # noqa: E402


@pytest.mark.timeout(180)
def test_smoke_runs_every_cpu_part_and_reports_the_targets(tmp_path: Path, capsys) -> None:
    out = tmp_path / "smoke.json"
    assert gpu_check.main(["--smoke", "--out", str(out), "--work-dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["sweep_counts"] == [1, 2]
    for name in ("torch-pil", "kuat-cpu", "kuat-cpu-processes"):
        sweep = result["sweep"][name]
        assert "error" not in sweep, sweep
        assert set(sweep["rates"]) == {"1", "2"} and sweep["rates"]["2"]["median"] > 0
        assert sweep["efficiency"]["1"]["median"] == 1.0
        assert result["decode"][name] == sweep["rates"]["2"]  # the top point, not re-measured
    assert set(result["skipped"]) == {"torch-nvjpeg", "kuat-nvjpeg", "dali-gpu"}
    train = result["resnet50"]
    for name in ("synthetic", "pageable-sync", "kuat-prefetch", "kuat-cpu",
                 "kuat-cpu-processes", "torch-pil"):  # fmt: skip
        assert train[name].get("images_per_s", 0) > 0, (name, train[name])
    assert train["synthetic"]["vs_synthetic"] == 1.0
    assert "input_bound_fraction" in train["kuat-cpu"]  # kuat's stats(); torch has none
    targets = result["targets"]
    assert targets["resnet50_vs_on_gpu"]["target"] == ">= 0.95"
    assert "value" in targets["resnet50_vs_torch_pil"]
    assert "value" in targets["decode_efficiency_1_to_2_kuat-cpu"]
    printed = capsys.readouterr().out
    assert "| decode to GPU memory, by workers |" in printed and "target (issue 31)" in printed
