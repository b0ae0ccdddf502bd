"""worker_type=None moves a drawing dataset to process workers (kuat.engine.rng_hint at the
start, the global-RNG watch mid-epoch, the measured choice): a dataset that does not pickle for
a spawn/forkserver context then stays on the thread workers it ran on (with a warning), where
torch would fail only because the user asked for processes (and kuat still does then)."""

import logging
import threading

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset

import kuat

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class Unpicklable(Dataset):
    """Holds a lock (no pickling); draws from torch's global generator through a torchvision
    random transform (``hinted``: the rng_hint sees it) or a bare ``torch.rand``."""

    def __init__(self, hinted: bool, n: int = 16):
        from torchvision import transforms as T

        self.n, self.lock = n, threading.Lock()
        if hinted:
            self.transform = T.RandomHorizontalFlip()
        self.hinted = hinted

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.arange(4.0).view(1, 2, 2) + 10 * i
        x = self.transform(x) if self.hinted else x + torch.rand(())
        return i, x


def _batches(loader, epochs=1):
    out = []
    for epoch in range(epochs):
        if epoch:
            loader.set_epoch(epoch)
        out += [(b[0].tolist(), b[1]) for b in loader]
    return out


def _same(got, expected):
    assert [g[0] for g in got] == [e[0] for e in expected]
    for (_, a), (_, b) in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
@pytest.mark.parametrize("hinted", [True, False], ids=["hinted", "drawing-mid-epoch"])
@pytest.mark.parametrize("persistent", [False, True], ids=["", "persistent"])
def test_a_dataset_that_does_not_pickle_stays_on_threads(context, hinted, persistent, caplog):
    kw = dict(batch_size=4, num_workers=2, multiprocessing_context=context)
    # torch fails on it, and kuat with worker_type="process" given fails the same way
    with pytest.raises(TypeError, match="pickle"), pytest.warns(UserWarning, match="pickle"):
        next(iter(TorchLoader(Unpicklable(hinted), **kw)))
    with pytest.raises(TypeError, match="pickle"), pytest.warns(UserWarning, match="pickle"):
        next(iter(kuat.DataLoader(Unpicklable(hinted), worker_type="process", **kw)))
    # indices as torch's own order (no workers); the draws those of kuat's thread workers
    # (isolation: seeded from (seed, epoch, index), whatever the worker type)
    ref = [[int(i) for i in b[0]] for b in TorchLoader(Unpicklable(hinted), batch_size=4)]
    threads = _batches(kuat.DataLoader(Unpicklable(hinted), worker_type="thread", seed=3,
                                       persistent_workers=persistent, **kw), epochs=2)
    assert [t[0] for t in threads] == ref + ref
    dl = kuat.DataLoader(Unpicklable(hinted), seed=3, persistent_workers=persistent, **kw)
    with caplog.at_level(logging.WARNING, logger="kuat.loader"):
        got = _batches(dl, epochs=2)
    _same(got, threads)
    workers = dl.stats()["workers"]
    assert workers["type"] == "thread" and workers["chosen"] == "rng", workers
    assert "process workers could not start" in workers["reason"], workers
    assert context in workers["reason"] and "cannot pickle" in workers["reason"]
    assert dl.worker_type == "thread"
    # said once, not again at each epoch (the loader no longer tries processes)
    said = [r for r in caplog.records if "could not start" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]



class LockedWork(Dataset):
    """Python work per sample and a lock in its attributes (no pickling)."""

    def __init__(self, n=160):
        self.n, self.lock = n, threading.Lock()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.lock:
            return torch.tensor(sum(j * j for j in range(200)) + i)


def test_a_measured_choice_of_processes_that_cannot_start_keeps_threads(monkeypatch, caplog):
    from kuat.loader import _auto

    measured = _auto.WorkerChoice.decide

    def decide(self, **kw):  # the measurement found processes better (tested on its own)
        measured(self, **kw)
        self.worker_type = "process"
        return "process", self.num_workers

    monkeypatch.setattr(_auto.WorkerChoice, "decide", decide)
    expected = [b.tolist() for b in TorchLoader(LockedWork(), batch_size=4)] * 2
    dl = kuat.DataLoader(LockedWork(), batch_size=4, num_workers=2,
                         multiprocessing_context="spawn")
    with caplog.at_level(logging.WARNING, logger="kuat.loader"):
        got = [b.tolist() for _ in range(2) for b in dl]
    assert got == expected
    workers = dl.stats()["workers"]
    assert workers["type"] == "thread" and workers["chosen"] == "measured", workers
    assert "process workers could not start" in workers["reason"], workers
    assert len([r for r in caplog.records if "could not start" in r.getMessage()]) == 1
