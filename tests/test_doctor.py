"""kuat.doctor and `kuat doctor`: is the loop input-bound, by how much, and which stage."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import kuat
from kuat import _doctor

SRC = str(Path(__file__).resolve().parents[1] / "src")


class Reads(Dataset):
    """Storage-bound: each sample waits 1 ms (a read), almost no CPU."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        time.sleep(0.001)
        return i


class Python(Dataset):
    """Python-bound: each sample is a loop of pure Python."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        s = 0
        for k in range(3000):
            s += (k * i) % 7
        return s


def test_a_slow_consumer_is_not_input_bound():
    dl = kuat.DataLoader(range(512), batch_size=8, num_workers=0)
    d = kuat.doctor(dl, steps=10, step_fn=lambda b: time.sleep(0.02))
    assert not d.input_bound and d.stage is None and d.steps == 10
    assert str(d).startswith("not input-bound") and d.numbers["step"] >= 15  # ms per batch


@pytest.mark.parametrize("kw", [dict(num_workers=0),
                                dict(num_workers=2, worker_type="thread")], ids=["inline", "threads"])
def test_a_fast_consumer_of_a_slow_source_is_input_bound_and_names_the_stage(kw):
    d = kuat.doctor(kuat.DataLoader(Reads(), batch_size=8, **kw), steps=8)
    assert d.input_bound and d.stage == "storage", d.line
    assert "Look at storage" in d.line and d.wait_share > 0.5
    d = kuat.doctor(kuat.DataLoader(Python(), batch_size=8, num_workers=0), steps=8)
    assert d.input_bound and d.stage == "Python/GIL", d.line


def test_doctor_starts_new_epochs_and_checks_its_arguments():
    dl = kuat.DataLoader(range(10), batch_size=4)  # 3 batches per epoch
    assert kuat.doctor(dl, steps=7).steps == 7
    with pytest.raises(ValueError, match="steps"):
        kuat.doctor(dl, steps=0)
    with pytest.raises(TypeError, match="kuat.DataLoader"):
        kuat.doctor(torch.utils.data.DataLoader(range(4)), steps=1)
    assert kuat.doctor(kuat.DataLoader([], batch_size=2), steps=3).steps == 0  # no hang


def _stats(**busy):
    s = {"consumer_wait_s": 0.0, "worker_wait_s": 0.0, "elapsed_s": 0.0, "batches": 0,
         "samples": 0, "busy_s": {k: 0.0 for k in _doctor._BUSY}}
    for k, v in busy.items():
        if k in s["busy_s"]:
            s["busy_s"][k] = v
        else:
            s[k] = v
    return s


@pytest.mark.parametrize("after, workers, stage", [
    (dict(consumer_wait_s=0.9, worker_wait_s=0.85, fetch=2.0, fetch_cpu=1.9, native=1.6),
     {"type": "thread", "num_workers": 2}, "decode"),
    (dict(consumer_wait_s=0.9, worker_wait_s=0.1, fetch=0.05, fetch_cpu=0.05),
     {"type": "process", "num_workers": 2}, "hand-off"),
    (dict(consumer_wait_s=0.9, worker_wait_s=0.2, device=0.6, fetch=0.2, fetch_cpu=0.2),
     {"type": "thread", "num_workers": 2}, "host-to-device copy"),
    (dict(consumer_wait_s=0.9, worker_wait_s=0.85, fetch=1.8, fetch_cpu=0.9),
     {"type": "thread", "num_workers": 2, "reason": "the work holds the GIL: ..."}, "Python/GIL"),
], ids=["decode", "hand-off", "device", "gil"])
def test_each_stage_is_named_from_its_numbers(after, workers, stage):
    a = _stats(**after)
    a["workers"] = workers
    d = _doctor.diagnose(_stats(), a, steps=10, step_s=0.1, total_s=1.0)
    assert d.input_bound and d.stage == stage, d.line
    assert f"Look at {stage}" in d.line and d.speedup == pytest.approx(10.0)


def test_the_command_line_runs_a_scripts_loader(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import time, kuat\n"
        "def make():\n"
        "    return kuat.DataLoader(range(64), batch_size=4)\n"
        "def step(batch):\n"
        "    time.sleep(0.01)\n"
        "if __name__ == '__main__':\n"
        "    raise SystemExit('the main block must not run')\n")
    run = [sys.executable, "-m", "kuat.cli", "doctor", f"{script}:make", "--steps", "5"]
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(run + ["--step", f"{script}:step"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("not input-bound"), out.stderr
    out = subprocess.run(run[:4] + ["nocolon"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 1 and "module:function" in out.stderr
    out = subprocess.run(run[:4] + ["no_such_module_xyz:make"], capture_output=True, text=True,
                         env=env, timeout=120)  # one line, no traceback
    assert out.returncode == 1 and "cannot import 'no_such_module_xyz'" in out.stderr
    assert "Traceback" not in out.stderr


def test_an_empty_loop_gets_no_speed_up_and_process_workers_no_advice_to_use_them(monkeypatch):
    """A loop that does nothing else (no step) has no meaningful "x faster with instant input";
    Python-bound process workers are told to add workers (while there are cores for them), not
    to use process workers."""
    from kuat.loader import _auto

    monkeypatch.setattr(_auto, "usable_cores", lambda: 8)
    d = kuat.doctor(kuat.DataLoader(Python(), batch_size=8, num_workers=0), steps=6)
    assert d.input_bound and "faster with instant input" not in d.line, d.line
    assert "runs at the input's rate" in d.line
    numbers = dict(fetch=4.0, fetch_cpu=3.9, native=0.0, collate=0.1, num_workers=2, chosen="given")
    advice = {kind: _doctor._evidence("Python/GIL", {**numbers, "workers": kind}) for kind in ("process", "thread")}
    assert "more process workers" in advice["process"] and "worker_type=None chooses" not in advice["process"]
    assert "worker_type=None chooses" in advice["thread"]
    monkeypatch.setattr(_auto, "usable_cores", lambda: 2)  # 2 workers already have every core
    assert "have every core already" in _doctor._evidence("Python/GIL", {**numbers,
                                                                         "workers": "process"})
    assert "(type still being measured)" in _doctor._evidence("Python/GIL", {**numbers, "workers": "thread",
                                                                             "chosen": "measuring"})
