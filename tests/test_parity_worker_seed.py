"""What a worker's samples read of the global generators equals torch's (issue #29, Randomness).

In each of torch's worker processes ``torch.initial_seed()`` is ``base_seed + worker_id``; kuat's
thread workers share the training process's generator and kuat's global-RNG isolation reseeds
it per sample, so the reading must be made torch's (``kuat.engine.seed_view``). Expected values
come from torch's DataLoader in the same test; ``generator=`` makes both loaders draw the same
``base_seed``.
"""

import threading

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset

import kuat

MODES = [dict(worker_type="thread"), dict(worker_type="process")]
IDS = ["threads", "processes"]


class InitialSeed(Dataset):
    """torch's SeedDataset: each sample is its worker's torch.initial_seed()."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.initial_seed()


class InitialSeedAndDraw(InitialSeed):
    """Reads the seed and draws (so kuat isolates it: each sample reseeded)."""

    def __getitem__(self, i):
        torch.rand(1)
        return torch.initial_seed()


class ReseedsItself(InitialSeed):
    """Seeds the generator itself: the seed it set is what it reads, under isolation too."""

    def __getitem__(self, i):
        torch.manual_seed(1000 + i)
        return torch.initial_seed()


def _seeds(cls, ds, batch_size=2, **kw):
    torch.manual_seed(1234)  # the training loop's seed: never what a worker reads
    g = torch.Generator().manual_seed(42)
    return [int(x) for b in cls(ds, batch_size=batch_size, generator=g, **kw) for x in b]


@pytest.mark.parametrize("ds", [InitialSeed, InitialSeedAndDraw, ReseedsItself],
                         ids=["reads", "reads-and-draws", "reseeds"])
@pytest.mark.parametrize("mode", MODES + [dict(num_workers=0)], ids=IDS + ["inline"])
def test_initial_seed_in_samples_is_torchs(mode, ds):
    torch_kw = dict(num_workers=mode.get("num_workers", 2))
    expected = _seeds(TorchLoader, ds(), **torch_kw)
    kw = dict(num_workers=2) | mode
    for _ in range(2):  # the first batch of each worker is probed, later ones watched
        assert _seeds(kuat.DataLoader, ds(), **kw) == expected
    if ds is InitialSeed and torch_kw["num_workers"]:
        assert len(set(expected)) == 2  # base_seed + worker_id


class Synchronized(Dataset):
    """torch's SynchronizedSeedDataset: every worker's first sample waits for all the others
    (under the probe's lock in kuat), then reads torch.initial_seed()."""

    def __init__(self, n):
        self.n = n
        self.count = [0]
        self.lock = threading.Lock()
        self.barrier = threading.Semaphore(0)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.lock:
            self.count[0] += 1
            if self.count[0] == self.n:
                self.barrier.release()
        if not self.barrier.acquire(timeout=30):
            raise RuntimeError("the other workers never came")
        self.barrier.release()
        return torch.initial_seed()

    def __copy__(self):  # the synchronisation objects are shared, as torch's mp.Value
        new = Synchronized.__new__(Synchronized)
        new.__dict__.update(self.__dict__)
        return new


def test_worker_seed_reproducibility_with_a_barrier_in_thread_workers():
    # torch's test_worker_seed_reproducibility: the first run's samples wait for each other
    # under the probe's lock (then fetched unlocked), the second's do not (all pass the barrier)
    n = 4
    ds = Synchronized(n)
    runs = [set(_seeds(kuat.DataLoader, ds, num_workers=n, worker_type="thread", batch_size=1,
                       timeout=20)) for _ in range(2)]
    # (torch's workers are processes: a threading barrier cannot hold them; without it each
    # of the n workers reads base_seed + worker_id all the same)
    expected = set(_seeds(TorchLoader, InitialSeed(), num_workers=n, batch_size=1))
    assert len(expected) == n
    assert runs[0] == runs[1] == expected


def _draw_collate(batch):
    return torch.rand(2)  # from the worker's own generator in torch's worker processes


def test_a_probed_worker_process_keeps_its_own_generator_state():
    # isolation reseeded the probed first batch: the worker's generator is restored after it,
    # so what runs outside the dataset (collate_fn) draws from base_seed + worker_id's stream
    def draws(cls, **kw):
        g = torch.Generator().manual_seed(42)
        return [b.tolist() for b in cls(InitialSeed(), batch_size=2, num_workers=2, generator=g,
                                        collate_fn=_draw_collate, **kw)]

    assert draws(kuat.DataLoader, worker_type="process") == draws(TorchLoader)
