"""Worker errors, skipping, time-outs, worker_init_fn and shared-memory errors."""

import errno
import os
import threading
import traceback
import warnings

import pytest
import torch
from torch.utils.data import get_worker_info

import kuat
from kuat.engine import shm

BOTH = ["thread", "process"]


def _own_slots():
    return {f for f in os.listdir(shm.SHM_DIR) if f.startswith(f"kuat-{os.getpid()}-")}


class Boom:
    def __init__(self, bad=(3,), exc=ValueError):
        self.bad, self.exc = set(bad), exc

    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i in self.bad:
            raise self.exc(f"bad sample {i}")
        return torch.tensor([i])


@pytest.mark.parametrize("worker_type", BOTH)
def test_rebuildable_exception_keeps_its_type_and_names_worker_and_indices(worker_type):
    dl = kuat.DataLoader(Boom(), batch_size=2, num_workers=2, worker_type=worker_type)
    it = iter(dl)
    assert next(it).tolist() == [[0], [1]]
    with pytest.raises(ValueError, match="bad sample 3") as info:
        next(it)
    notes = "\n".join(info.value.__notes__)
    assert "kuat-worker-1" in notes and "sample indices [2, 3]" in notes
    # the worker's traceback is shown, once (thread mode: as the exception's own frames, under
    # the consumer's; process mode: as text in the note), and the chain is the original's
    shown = "".join(traceback.format_exception(info.value))
    assert shown.count("in __getitem__") == 1
    assert info.value.__cause__ is None
    if worker_type == "thread":
        assert traceback.extract_tb(info.value.__traceback__)[-1].name == "__getitem__"
    # the iterator stays usable after a dataset error, as torch's does
    assert next(it).tolist() == [[4], [5]]
    del it


def test_inline_raises_the_original_exception():
    dl = kuat.DataLoader(Boom(bad=(0,)), batch_size=2)
    with pytest.raises(ValueError, match="bad sample 0") as info:
        next(iter(dl))
    assert any("sample indices [0, 1]" in n for n in info.value.__notes__)


@pytest.mark.parametrize("worker_type", BOTH)
def test_skip_drops_failing_samples_warns_once_and_counts(worker_type):
    ds = Boom(bad=(1, 3, 4, 5))
    dl = kuat.DataLoader(ds, batch_size=2, num_workers=2, worker_type=worker_type, on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = [b.flatten().tolist() for b in dl]
    assert batches == [[0], [2], [6, 7], [8, 9]]  # [4, 5] failed entirely: no empty batch
    assert dl.stats()["skipped_samples"] == 4
    skipped = [w for w in caught if "skipped sample" in str(w.message)]
    assert len(skipped) == 1 and "bad sample" in str(skipped[0].message)


def test_skip_with_getitems_falls_back_to_single_samples():
    class Batched(Boom):
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    dl = kuat.DataLoader(Batched(bad=(2,)), batch_size=4, on_error="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [b.flatten().tolist() for b in dl] == [[0, 1, 3], [4, 5, 6, 7], [8, 9]]


class Slow:
    def __init__(self):
        self.release = threading.Event()

    def __len__(self):
        return 4

    def __getitem__(self, i):
        self.release.wait(1)
        return i


def test_timeout_says_how_long_it_waited():
    ds = Slow()
    dl = kuat.DataLoader(ds, num_workers=1, timeout=0.2)
    with pytest.raises(kuat.LoaderTimeoutError, match=r"timed out after 0.2 seconds"):
        next(iter(dl))
    ds.release.set()
    with pytest.raises(ValueError, match="timeout=1 needs num_workers > 0"):
        kuat.DataLoader(ds, timeout=1)


def test_worker_init_fn_runs_once_per_thread_worker_with_worker_info():
    seen = []
    lock = threading.Lock()

    def init(worker_id):
        info = get_worker_info()
        with lock:
            seen.append((worker_id, info.id, info.num_workers, threading.current_thread().name))

    dl = kuat.DataLoader(list(range(20)), batch_size=2, num_workers=3, worker_init_fn=init)
    assert sum(len(b) for b in dl) == 20
    assert sorted(s[:3] for s in seen) == [(0, 0, 3), (1, 1, 3), (2, 2, 3)]
    assert sorted(s[3] for s in seen) == ["kuat-worker-0", "kuat-worker-1", "kuat-worker-2"]


def test_worker_init_fn_error_is_raised_in_the_consumer():
    def init(worker_id):
        raise RuntimeError("init failed")

    dl = kuat.DataLoader(list(range(4)), num_workers=1, worker_init_fn=init)
    with pytest.raises(RuntimeError, match="init failed"):
        next(iter(dl))


class Crashes:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            os._exit(3)
        return i


def test_a_dead_worker_process_is_reported_with_exit_code_and_indices():
    before = _own_slots()
    dl = kuat.DataLoader(Crashes(), batch_size=2, num_workers=1, worker_type="process")
    it = iter(dl)
    assert next(it).tolist() == [0, 1]
    with pytest.raises(kuat.WorkerError, match=r"exit code 3 .*sample indices \[2, 3\]"):
        next(it)
    assert _own_slots() <= before


def test_too_small_shared_memory_names_it_and_the_size(monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)  # inherited by forked workers
    before = _own_slots()
    dl = kuat.DataLoader([torch.zeros(1000)] * 4, batch_size=2, num_workers=1, worker_type="process")
    with pytest.raises(kuat.SharedMemoryError, match=r"shared memory .* needs \d+ bytes"):
        next(iter(dl))
    assert _own_slots() <= before


def test_invalid_kuat_arguments():
    with pytest.raises(ValueError, match="worker_type"):
        kuat.DataLoader([1], worker_type="fiber")
    with pytest.raises(ValueError, match="on_error"):
        kuat.DataLoader([1], on_error="ignore")
    with pytest.raises(TypeError, match="seed"):
        kuat.DataLoader([1], seed="1")
    with pytest.raises(ValueError, match="rank"):
        kuat.DataLoader([1], rank=2, world_size=2)
    with pytest.raises(ValueError, match="both rank and world_size"):
        kuat.DataLoader([1], rank=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")
def test_without_cuda_device_cuda_is_refused_and_pinning_skipped_with_one_warning():
    with pytest.raises(ValueError, match="CUDA is not available"):
        kuat.DataLoader([1], device="cuda")
    assert list(kuat.DataLoader([1, 2], device="cpu")) == [torch.tensor([1]), torch.tensor([2])]
    with pytest.warns(UserWarning, match="no accelerator is found") as caught:
        dl = kuat.DataLoader([torch.ones(2)], pin_memory=True)
    assert len(caught) == 1
    assert torch.equal(next(iter(dl)), torch.ones(1, 2))


def test_system_exit_in_a_thread_worker_reaches_the_consumer_instead_of_hanging():
    class Exits:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            raise SystemExit(4)

    with pytest.raises(SystemExit):
        next(iter(kuat.DataLoader(Exits(), num_workers=1)))
