"""The shared-memory slot ring: encoding round trips, growth, reuse, cleanup."""

import collections
import gc
import multiprocessing
import os

import numpy as np
import pytest
import torch

from kuat.engine import shm
from kuat.engine.base import OK, Task
from kuat.engine.job import FetchJob
from kuat.engine.process import ProcessEngine

Pair = collections.namedtuple("Pair", "a b")


def _files(prefix):
    return sorted(f for f in os.listdir(shm.SHM_DIR) if f.startswith(prefix))


def test_round_trip_keeps_values_dtypes_and_containers():
    batch = {
        "u8": torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4),  # (B, H, W)
        "f": torch.randn(2, 5)[:, ::2],  # non-contiguous
        "b": torch.tensor([True, False]),
        "bf": torch.ones(3, dtype=torch.bfloat16),
        "c": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
        "big": torch.arange(40_000, dtype=torch.int64).reshape(200, 200),  # > 32 Ki elements
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "np": np.arange(6, dtype=np.int32).reshape(2, 3),
        "pair": Pair([1, "x"], (torch.tensor([7]),)),
        "names": ["a", "b"],
    }
    writer = shm.SlotWriter("kuat-test-rt", 0)
    try:
        msg = writer.write(batch, None)
        mm = shm.attach(msg.name)
        out = shm.read_batch(msg, mm)
        mm.close()
    finally:
        writer.close()
        shm.unlink_prefix("kuat-test-rt")
    for k in ("u8", "f", "b", "bf", "c", "big", "scalar", "empty"):
        assert out[k].dtype == batch[k].dtype and torch.equal(out[k], batch[k]), k
    assert isinstance(out["np"], np.ndarray) and np.array_equal(out["np"], batch["np"])
    assert isinstance(out["pair"], Pair) and out["pair"].a == [1, "x"]
    assert torch.equal(out["pair"].b[0], torch.tensor([7]))
    assert out["names"] == ["a", "b"]
    assert _files("kuat-test-rt") == []


def test_slot_is_reused_and_grown_when_a_batch_does_not_fit():
    writer = shm.SlotWriter("kuat-test-grow", 0)
    try:
        first = writer.write(torch.zeros(1000), None)
        again = writer.write(torch.ones(1000), (first.name, first.size))
        assert again.name == first.name  # reused
        bigger = writer.write(torch.ones(100_000), (first.name, first.size))
        assert bigger.name != first.name and bigger.size >= 400_000
        mm = shm.attach(bigger.name)
        assert torch.equal(shm.read_batch(bigger, mm), torch.ones(100_000))
        mm.close()
    finally:
        writer.close()
        shm.unlink_prefix("kuat-test-grow")
    assert _files("kuat-test-grow") == []


class Sized:
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((10 * (i + 1),), i)  # batches grow: slots are replaced


def test_process_engine_ring_is_bounded_and_unlinked_on_close():
    job = FetchJob(dataset=Sized(), iterable=False, auto_collation=False, batch_size=None,
                   drop_last=False, collate_fn=lambda x: x, seed=0, isolate_rng=False,
                   on_error="raise")
    engine = ProcessEngine(job, 2, 0, multiprocessing.get_context("fork"))
    prefix = engine._prefix
    try:
        got = {}
        for start in range(0, 12, 4):  # at most 4 tasks in flight
            for i in range(start, start + 4):
                engine.submit(i % 2, Task(i, 0, i, 0))
            for _ in range(4):
                r = engine.get(10)
                assert r.kind == OK
                got[r.task_id] = r.value
            assert len(_files(prefix)) <= 4
        assert all(torch.equal(got[i], torch.full((10 * (i + 1),), i)) for i in range(12))
    finally:
        engine.close()
        engine.close()
    assert _files(prefix) == []


def test_unwritable_directory_errors_are_not_swallowed(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        shm.create("kuat-x-0-1", 4096)


def test_large_arrays_are_views_released_when_gone_small_ones_are_copied():
    big = torch.arange(shm.VIEW_MIN_BYTES // 4 + 10, dtype=torch.float32)
    batch = {"image": big, "label": torch.tensor([1, 2]), "np": np.ones(shm.VIEW_MIN_BYTES)}
    writer = shm.SlotWriter("kuat-test-view", 0)
    released = []
    try:
        msg = writer.write(batch, None)
        mm = shm.attach(msg.name)
        out = shm.view_batch(msg, mm, lambda: released.append(msg.name))
        assert torch.equal(out["image"], big) and np.array_equal(out["np"], batch["np"])
        assert out["label"].tolist() == [1, 2]
        label, image = out["label"], out["image"][10:]  # keep a small field and a view
        del out
        assert released == []
        del image
        gc.collect()
        assert released == [msg.name] and label.tolist() == [1, 2]  # labels never pin a slot
    finally:
        writer.close()
        shm.unlink_prefix("kuat-test-view")


class Big:
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((shm.VIEW_MIN_BYTES // 4,), float(i))  # a view-sized batch


def test_a_held_zero_copy_batch_is_never_overwritten():
    import kuat

    dl = kuat.DataLoader(Big(), batch_size=None, num_workers=2, worker_type="process")
    held = []
    for i, b in enumerate(dl):
        if i % 5 == 0:
            held.append((i, b))  # kept while the ring goes on being reused
    assert all(torch.all(b == float(i)) for i, b in held)


def test_slots_of_a_killed_consumer_are_reaped_by_the_next_loader():
    """SIGTERM/SIGKILL skip every clean-up; the next process engine removes what is left."""
    import signal
    import subprocess
    import sys
    import textwrap

    import kuat

    script = textwrap.dedent(
        """
        import sys, torch, kuat

        class Big(torch.utils.data.Dataset):
            def __len__(self):
                return 10_000

            def __getitem__(self, i):
                return torch.zeros(3, 64, 64, dtype=torch.uint8)

        loader = kuat.DataLoader(Big(), batch_size=64, num_workers=2, worker_type="process")
        for k, batch in enumerate(loader):
            if k == 2:
                print("running", flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "running"
        prefix = f"kuat-{proc.pid}-"
        assert _files(prefix), "the running loader should hold slots"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # its worker processes may take a moment to notice the consumer is gone; slots stay
    assert _files(prefix)
    loader = kuat.DataLoader(list(range(4)), batch_size=2, num_workers=1, worker_type="process")
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    assert _files(prefix) == []


def test_reap_orphans_spares_live_processes(tmp_path):
    live = f"kuat-{os.getpid()}-deadbeef-0-1"
    open(os.path.join(shm.SHM_DIR, live), "wb").close()
    try:
        assert live not in shm.reap_orphans()
        assert os.path.exists(os.path.join(shm.SHM_DIR, live))
    finally:
        shm.unlink(live)
