"""What a worker's samples read of the global generators equals torch's (issue #29, Randomness).

In each of torch's worker processes ``torch.initial_seed()`` is ``base_seed + worker_id``; kuat's
thread workers share the training process's generator and kuat's global-RNG isolation reseeds
it per sample, so the reading must be made torch's (``kuat.engine.seed_view``). Expected values
come from torch's DataLoader in the same test; ``generator=`` makes both loaders draw the same
``base_seed``. An ``IterableDataset`` drawing in thread workers draws from each worker's own
generators, seeded as torch seeds worker processes (``kuat.engine.worker_rng``, 3).
"""

import random
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import IterableDataset, get_worker_info

import kuat
from tests.test_parity_threads import InitialSeed  # torch's SeedDataset
from tests.test_parity_threads import Synchronized as _Synchronized

MODES = [dict(worker_type="thread"), dict(worker_type="process")]
IDS = ["threads", "processes"]


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


class Synchronized(_Synchronized):
    """torch's SynchronizedSeedDataset: every worker's first sample waits for all the others
    (under the probe's lock in kuat), then reads torch.initial_seed()."""

    def __init__(self, n):
        super().__init__(n, n)

    def __getitem__(self, i):
        super().__getitem__(i)
        return torch.initial_seed()


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


# --- iterable datasets drawing from the global generators ---------------------------------------
class DrawingIterable(IterableDataset):
    """Each worker yields its own items, each drawn from all three global generators (and the
    worker's torch.initial_seed())."""

    def __init__(self, sizes=(3, 5, 4)):
        self.sizes = sizes

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        for _ in range(self.sizes[wid]):
            yield [wid, torch.randint(1000, (1,)).item(), random.randint(0, 999),
                   int(np.random.randint(1000)), torch.initial_seed()]


class Quiet(IterableDataset):
    """Never draws."""

    def __iter__(self):
        info = get_worker_info()
        return iter(range(info.id * 100, info.id * 100 + 6))


def _items(cls, ds, **kw):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    items = [b for b in cls(ds, batch_size=None, num_workers=3, generator=g, **kw)]
    return items, torch.rand(2).tolist()  # and what the training loop draws after


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_an_iterables_draws_are_each_workers_own_as_in_torch(mode):
    expected = _items(TorchLoader, DrawingIterable())
    assert _items(kuat.DataLoader, DrawingIterable(), **mode) == expected


def test_thread_workers_of_an_iterable_that_draws_move_to_processes_only_if_it_draws():
    loader = kuat.DataLoader(DrawingIterable(), batch_size=None, num_workers=3)
    quiet = kuat.DataLoader(Quiet(), batch_size=None, num_workers=3)
    for _ in range(2):
        list(loader), list(quiet)
    assert (loader.worker_type, quiet.worker_type) == ("process", "thread")


class StatefulShuffle(IterableDataset):
    """torchdata's DummyIterableDataset(shuffle=True): each worker's iterator draws an index per
    item and its state_dict saves the worker's torch generator state (set again on load)."""

    def __init__(self, sizes=(0, 20, 7)):
        self.sizes = sizes

    def __iter__(self):
        wid = get_worker_info().id
        start = sum(self.sizes[:wid])
        return _ShuffleIter(list(range(start, start + self.sizes[wid])))


class _ShuffleIter:
    def __init__(self, samples):
        self.samples, self.i = samples, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.samples):
            raise StopIteration
        self.i += 1
        return self.samples[torch.randint(len(self.samples), (1,)).item()]

    def state_dict(self):
        return {"i": self.i, "g": torch.get_rng_state()}

    def load_state_dict(self, state):
        self.i = state["i"]
        torch.set_rng_state(state["g"])


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
def test_a_thread_workers_stream_saved_in_its_iterators_state_resumes_as_torchdatas(persistent):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def run(cls, **kw):
        torch.manual_seed(0)
        ds = StatefulShuffle()
        make = lambda: cls(ds, batch_size=None, num_workers=3, persistent_workers=persistent,  # noqa: E731
                           generator=torch.Generator().manual_seed(4), **kw)
        dl = make()
        it = iter(dl)
        head = [next(it) for _ in range(5)]
        mid = dl.state_dict()
        rest = list(it)
        torch.rand(5)  # the training loop draws: no worker's stream may depend on it
        nxt = list(dl)  # the next epoch (the persistent workers' streams go on)
        resumed = make()
        resumed.load_state_dict(mid)
        return head, rest, nxt, list(resumed)

    expected = run(StatefulDataLoader)
    assert expected[3] == expected[1]
    assert run(kuat.DataLoader, worker_type="thread") == expected


class SlowFirstOfWorker1(IterableDataset):
    """torch's TestSlowIterableDataset: worker 1's first item takes a second."""

    def __iter__(self):
        info = get_worker_info()
        for i in range(info.id * 5, info.id * 5 + 5):
            if i == 5:
                time.sleep(1.0)
            yield i


def test_a_slow_first_item_of_one_thread_worker_does_not_hold_the_others_back():
    # torch's test_out_of_order_iterable_ds: worker 0's items all come before worker 1's slow
    # first one (its probed first batch holds the generators; the others do not wait for it)
    expected = [b.item() for b in TorchLoader(SlowFirstOfWorker1(), num_workers=2,
                                              in_order=False)]
    got = [b.item() for b in kuat.DataLoader(SlowFirstOfWorker1(), num_workers=2,
                                             in_order=False, worker_type="thread")]
    assert got == expected == list(range(10))
