"""Process workers: worker settings that keep them from oversubscribing the machine."""

import multiprocessing
import queue
import threading

import pytest
import torch

import kuat
from kuat.engine.base import OK, Task
from kuat.engine.job import FetchJob
from kuat.engine.process import ProcessEngine


class _Threads(torch.utils.data.Dataset):
    """Sample i is ``(i, torch.get_num_threads())`` as seen where the sample is fetched."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i, torch.get_num_threads()


def test_process_workers_run_torch_single_threaded_and_the_consumer_keeps_its_threads():
    # torch's workers call torch.set_num_threads(1): N workers x M intra-op threads would
    # oversubscribe the cores. The consumer's own setting is left alone.
    before = torch.get_num_threads()
    loader = kuat.DataLoader(_Threads(), batch_size=2, num_workers=2, worker_type="process", seed=0)
    indices, threads = [], []
    for idx, n in loader:
        indices += idx.tolist()
        threads += n.tolist()
    assert sorted(indices) == list(range(8))
    assert threads == [1] * 8
    assert torch.get_num_threads() == before


def test_process_engine_adds_no_consumer_thread():
    # Results are received in the consumer's own get(): no receiver thread per engine. Threads
    # of earlier tests' loaders may still wait for the garbage collector (an exception a test
    # kept holds its frame, and so its iterator): only threads this loader starts count.
    before = set(threading.enumerate())
    loader = kuat.DataLoader(_Threads(), batch_size=2, num_workers=2, worker_type="process", seed=0)
    it = iter(loader)
    first = next(it)
    names = [t.name for t in threading.enumerate() if t not in before]
    assert not [n for n in names if n.startswith("kuat-")], names
    assert first[0].tolist() == [0, 1]
    assert [b[0].tolist() for b in it] == [[2, 3], [4, 5], [6, 7]]


def _identity(x):
    return x


def test_get_drains_every_ready_worker_and_refuses_after_close():
    job = FetchJob(dataset=_Threads(), iterable=False, auto_collation=False, batch_size=None,
                   drop_last=False, collate_fn=_identity, seed=0, isolate_rng=False,
                   on_error="raise")
    engine = ProcessEngine(job, 2, 0, multiprocessing.get_context("fork"))
    try:
        for i in range(6):
            engine.submit(i % 2, Task(i, 0, i, 0))
        got = {}
        for _ in range(6):
            r = engine.get(10)
            assert r.kind == OK
            got[r.task_id] = r.value
        assert got == {i: (i, 1) for i in range(6)}
        with pytest.raises(queue.Empty):
            engine.get(0.05)
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.get(0.05)


class _GcThreshold(torch.utils.data.Dataset):
    """Sample i is ``(i, gc.get_threshold()[0])`` as seen where the sample is fetched."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import gc

        return i, gc.get_threshold()[0]


def _own_threshold(worker_id):
    import gc

    gc.set_threshold(1234)


def test_process_workers_raise_the_young_gc_threshold_and_worker_init_fn_wins():
    # Short-lived containers (rows, token lists) would trigger a young collection every 700
    # alive; a worker raises the threshold (kuat.engine.process._YOUNG). The consumer's own is
    # left alone, and a worker_init_fn (run after) sets its own.
    import gc

    from kuat.engine.process import _YOUNG

    before = gc.get_threshold()
    seen = [t for _i, t in kuat.DataLoader(_GcThreshold(), batch_size=2, num_workers=2,
                                           worker_type="process", seed=0)]
    assert torch.cat(seen).tolist() == [_YOUNG] * 4
    seen = [t for _i, t in kuat.DataLoader(_GcThreshold(), batch_size=2, num_workers=2,
                                           worker_type="process", seed=0,
                                           worker_init_fn=_own_threshold)]
    assert torch.cat(seen).tolist() == [1234] * 4
    assert gc.get_threshold() == before


def test_young_threshold_keeps_a_higher_one_and_collection_off():
    from kuat.engine import process

    class _Gc:  # stands for the gc module: records what the worker would set
        def __init__(self, threshold):
            self.threshold = threshold

        def get_threshold(self):
            return self.threshold

        def set_threshold(self, *t):
            self.threshold = t

    for start, want in (((700, 10, 10), (process._YOUNG, 10, 10)),
                        ((50_000, 5, 5), (50_000, 5, 5)),
                        ((0, 10, 10), (0, 10, 10))):
        fake = _Gc(start)
        process._young_threshold(fake)
        assert fake.threshold == want
