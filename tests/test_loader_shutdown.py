"""Nothing outlives the loader: threads, processes, shared-memory files; memory stays flat."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest
import torch

import kuat
from kuat.engine import shm

BOTH = ["thread", "process"]


class Tensors:
    def __init__(self, n=64, numel=256):
        self.n, self.numel = n, numel

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.numel,), i, dtype=torch.float32)


def _snapshot():
    gc.collect()
    return (
        threading.active_count(),
        len(psutil.Process().children(recursive=True)),
        # only this process's slots: other processes on the machine may use kuat too
        {f for f in os.listdir(shm.SHM_DIR) if f.startswith(f"kuat-{os.getpid()}-")},
    )


def _assert_clean(before):
    gc.collect()
    threads, children, files = _snapshot()
    assert threads == before[0], [t.name for t in threading.enumerate()]
    assert children == before[1]
    assert files <= before[2]


@pytest.mark.parametrize("worker_type", BOTH)
def test_fifty_early_breaks_leak_nothing(worker_type):
    before = _snapshot()
    workers = 2 if worker_type == "thread" else 1  # a fork costs ~40 ms on a busy machine
    dl = kuat.DataLoader(Tensors(), batch_size=4, num_workers=workers, worker_type=worker_type)
    for i in range(50):
        for j, batch in enumerate(dl):
            assert batch[0, 0] == 4 * j
            if j == i % 3:
                break
    _assert_clean(before)


@pytest.mark.parametrize("worker_type", BOTH)
def test_del_iterator_and_exception_in_the_training_loop(worker_type):
    before = _snapshot()
    dl = kuat.DataLoader(Tensors(), batch_size=4, num_workers=2, worker_type=worker_type)
    it = iter(dl)
    next(it)
    del it
    _assert_clean(before)

    def train():
        for _ in dl:
            raise ArithmeticError("loss is nan")

    with pytest.raises(ArithmeticError):
        train()
    _assert_clean(before)


@pytest.mark.parametrize("worker_type", BOTH)
def test_keyboard_interrupt_in_the_loop_releases_workers(worker_type):
    before = _snapshot()
    dl = kuat.DataLoader(Tensors(), batch_size=4, num_workers=2, worker_type=worker_type)

    def train():
        for j, _ in enumerate(dl):
            if j == 2:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train()
    _assert_clean(before)


@pytest.mark.parametrize("worker_type", BOTH)
def test_persistent_workers_end_on_close_and_with_block(worker_type):
    before = _snapshot()
    with kuat.DataLoader(Tensors(), batch_size=8, num_workers=2, worker_type=worker_type,
                         persistent_workers=True) as dl:
        for _ in range(3):
            seen = [int(b[0, 0]) for b in dl]
            assert seen == list(range(0, 64, 8))
            next(iter(dl))  # an abandoned epoch: its stale results are dropped next epoch
    dl.close()  # idempotent
    _assert_clean(before)
    with pytest.raises(RuntimeError, match="closed"):
        iter(dl)


def test_ctrl_c_and_interpreter_exit_mid_epoch_leave_nothing():
    """Ctrl-C (SIGINT to the whole process group) while loaders are mid-epoch."""
    # SIGINT as a terminal delivers it: a shell that starts the suite in the background (nohup,
    # `cmd &` in a script) leaves SIGINT ignored, and the child would inherit that
    script = textwrap.dedent("""
        import os, signal, time, psutil, torch, kuat
        signal.signal(signal.SIGINT, signal.default_int_handler)
        class D:
            def __len__(self): return 100
            def __getitem__(self, i):
                if i >= 8:
                    time.sleep(0.05)  # the workload: slow samples
                return torch.zeros(1000)
        loaders = [kuat.DataLoader(D(), batch_size=4, num_workers=2, worker_type=t,
                                   persistent_workers=True) for t in ("thread", "process")]
        iterators = [iter(dl) for dl in loaders]
        for it in iterators:
            next(it)
        children = [c.pid for c in psutil.Process().children(recursive=True)]
        print(os.getpid(), *children, flush=True)
        for it in iterators:
            for _ in it:
                pass
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 3, proc.stderr.read()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    leftovers = {f for f in os.listdir(shm.SHM_DIR) if f.startswith(f"kuat-{pids[0]}-")}
    assert leftovers == set()
    for pid in pids[1:]:  # the worker processes are gone, not orphaned
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _rss_all() -> int:
    me = psutil.Process()
    return me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))


@pytest.mark.parametrize("worker_type", BOTH)
def test_memory_does_not_grow_from_epoch_to_epoch(worker_type):
    dl = kuat.DataLoader(Tensors(n=128, numel=16384), batch_size=16, num_workers=2,
                         worker_type=worker_type, persistent_workers=True, shuffle=True)
    total = 0.0
    for epoch in range(5):
        for b in dl:
            total += float(b[0, 0])
        gc.collect()
        if epoch == 0:
            after_first = _rss_all()
    growth = _rss_all() - after_first
    dl.close()
    assert growth < 24 * 2**20, f"grew {growth / 2**20:.1f} MiB over 4 epochs of 8 MiB each"
