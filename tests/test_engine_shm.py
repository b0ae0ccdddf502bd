"""The shared-memory slot ring: encoding round trips, growth, reuse, nameless slots."""

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


def _consume(msg, fd):
    """The consumer's side of a new slot: map the descriptor the worker sends, close it."""
    assert msg.new and fd is not None
    try:
        return shm.map_fd(fd, msg.size)
    finally:
        os.close(fd)


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
        msg, fd = writer.write(batch, None)
        mm = _consume(msg, fd)
        assert _files("kuat-test-rt") == []  # nameless while in use
        out = shm.read_batch(msg, mm)
        mm.close()
    finally:
        writer.close()
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
        first, fd = writer.write(torch.zeros(1000), None)
        _consume(first, fd).close()
        again, fd = writer.write(torch.ones(1000), (first.slot, first.size))
        assert again.slot == first.slot and not again.new and fd is None  # reused
        bigger, fd = writer.write(torch.ones(100_000), (first.slot, first.size))
        assert bigger.slot != first.slot and bigger.size >= 400_000
        mm = _consume(bigger, fd)
        assert torch.equal(shm.read_batch(bigger, mm), torch.ones(100_000))
        mm.close()
        assert list(writer._maps) == [bigger.slot]  # the replaced slot is unmapped
    finally:
        writer.close()
    assert _files("kuat-test-grow") == []


class Sized:
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((10 * (i + 1),), i)  # batches grow: slots are replaced


def test_process_engine_ring_is_bounded_nameless_and_unmapped_on_close():
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
            assert len(engine._maps) <= 4 and _files(prefix) == []
        assert all(torch.equal(got[i], torch.full((10 * (i + 1),), i)) for i in range(12))
    finally:
        engine.close()
        engine.close()
    assert _files(prefix) == [] and engine._maps == {}


def test_unwritable_directory_errors_are_not_swallowed(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "_MEMFD", False)  # the named-then-unlinked fallback
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        shm.create("kuat-x-0-1", 4096)


def test_without_memfd_a_slot_file_is_unlinked_as_soon_as_it_is_open(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "_MEMFD", False)
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    writer = shm.SlotWriter("kuat-test-named", 0)
    try:
        msg, fd = writer.write(torch.arange(10), None)
        mm = _consume(msg, fd)
        assert os.listdir(tmp_path) == []
        assert torch.equal(shm.read_batch(msg, mm), torch.arange(10))
        mm.close()
    finally:
        writer.close()


def test_large_arrays_are_views_released_when_gone_small_ones_are_copied():
    big = torch.arange(shm.VIEW_MIN_BYTES // 4 + 10, dtype=torch.float32)
    batch = {"image": big, "label": torch.tensor([1, 2]), "np": np.ones(shm.VIEW_MIN_BYTES)}
    writer = shm.SlotWriter("kuat-test-view", 0)
    released = []
    try:
        msg, fd = writer.write(batch, None)
        mm = _consume(msg, fd)
        out = shm.view_batch(msg, mm, lambda: released.append(msg.slot))
        assert torch.equal(out["image"], big) and np.array_equal(out["np"], batch["np"])
        assert out["label"].tolist() == [1, 2]
        label, image = out["label"], out["image"][10:]  # keep a small field and a view
        del out
        assert released == []
        del image
        gc.collect()
        assert released == [msg.slot] and label.tolist() == [1, 2]  # labels never pin a slot
    finally:
        writer.close()


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


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie holds no memory
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads worker state from /proc")
def test_sigkill_of_the_training_process_leaves_no_shared_memory():
    """#11.13: the out-of-memory killer or a scheduler SIGKILLs the training process mid-epoch.

    Torch unlinks its segments as soon as both sides hold them; kuat's slots never have a name
    (memfd / unlinked at once), so nothing is in /dev/shm even while the loader runs, nothing
    after the kill, and the workers (the last holders of the memory) exit on their own.
    """
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    script = textwrap.dedent(
        """
        import torch, kuat

        class Big(torch.utils.data.Dataset):
            def __len__(self):
                return 10_000

            def __getitem__(self, i):
                return torch.zeros(3, 128, 128, dtype=torch.uint8)

        loader = kuat.DataLoader(Big(), batch_size=64, num_workers=2, worker_type="process")
        it = iter(loader)
        for k in range(3):
            held = next(it)
        print(*[p.pid for p in it._engine._procs], flush=True)
        for batch in it:
            pass
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(x) for x in proc.stdout.readline().split()]
        assert len(workers) == 2
        prefix = f"kuat-{proc.pid}-"
        assert _files(prefix) == [], "slots must have no name while in use"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert _files(prefix) == []
        deadline = time.monotonic() + 10  # workers poll for their parent every second
        while not all(_gone(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(w) for w in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_reap_orphans_removes_files_of_dead_processes_only():
    """Files an older kuat (named slots) left behind, removed by the next process engine."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    name = f"kuat-{int(dead.stdout)}-deadbeef-0-1"
    open(os.path.join(shm.SHM_DIR, name), "wb").close()
    try:
        assert name in shm.reap_orphans()
        assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
    finally:
        if os.path.exists(os.path.join(shm.SHM_DIR, name)):
            os.unlink(os.path.join(shm.SHM_DIR, name))


def test_reap_orphans_spares_live_processes(tmp_path):
    live = f"kuat-{os.getpid()}-deadbeef-0-1"
    open(os.path.join(shm.SHM_DIR, live), "wb").close()
    try:
        assert live not in shm.reap_orphans()
        assert os.path.exists(os.path.join(shm.SHM_DIR, live))
    finally:
        os.unlink(os.path.join(shm.SHM_DIR, live))
