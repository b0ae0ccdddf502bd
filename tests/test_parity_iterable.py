"""Iterable datasets as torch's DataLoader reads them (issue 29, "Iterable datasets"): each case
runs torch's loader and kuat's on the same input, in the same test, and compares.

* an ``IterDataPipe``: ``shuffle=`` turns its shufflers on or off (torch applies it to the
  graph), every epoch seeds the graph from one shared draw (the same in every worker), and
  ``sharding_filter`` splits it over the workers (kuat used to refuse ``shuffle=True``, and with
  2 workers raise (threads) or yield every item twice (processes)); torch's draws from the
  default generator are the same afterwards;
* an ``IterableDataset`` with ``__len__``: the same warnings as torch, word for word (torch's
  "samples have been fetched" past the reported length, and no warning of kuat's own).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import IterableDataset
from torch.utils.data.datapipes.iter import IterableWrapper

import kuat

pytestmark = pytest.mark.timeout(60)

MODES = [(0, "thread", False), (2, "thread", False), (2, "process", False),
         (2, "thread", True), (2, "process", True)]
MODE_IDS = ["inline", "threads", "processes", "threads-persistent", "processes-persistent"]


def _pipe():
    return IterableWrapper(range(10)).shuffle().sharding_filter()


def _run(cls, dataset, epochs=2, **kw):
    """Batches of ``epochs`` epochs and what torch's default generator draws next."""
    torch.manual_seed(0)
    dl = cls(dataset, **kw)
    out = [[b.tolist() for b in dl] for _ in range(epochs)]
    return type(dl.dataset), out, torch.rand(2).tolist()


@pytest.mark.parametrize("shuffle", [True, False, None])
@pytest.mark.parametrize(("num_workers", "worker_type", "pw"), MODES, ids=MODE_IDS)
def test_an_iter_datapipe_is_shuffled_seeded_and_sharded_as_torch(num_workers, worker_type, pw,
                                                                   shuffle):
    kw = dict(batch_size=2, shuffle=shuffle, num_workers=num_workers, persistent_workers=pw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's datapipe deprecation notices
        expected = _run(TorchLoader, _pipe(), **kw)
        got = _run(kuat.DataLoader, _pipe(), worker_type=worker_type, **kw)
    assert got == expected
    items = sorted(x for b in got[1][0] for x in b)
    assert items == list(range(10))  # sharded: every item once


def test_an_iter_datapipe_with_a_generator_draws_from_it():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = []
        for cls in (TorchLoader, kuat.DataLoader):
            g = torch.Generator().manual_seed(7)
            runs.append(_run(cls, _pipe(), batch_size=3, shuffle=True, generator=g)
                        + (g.get_state(),))
    assert runs[1][:3] == runs[0][:3] and torch.equal(runs[1][3], runs[0][3])


class Sized(IterableDataset):
    """Yields 6 items in every worker (it does not split itself) and says its length is 6."""

    def __iter__(self):
        return iter(range(6))

    def __len__(self):
        return 6


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize(("num_workers", "worker_type"),
                         [(0, "thread"), (2, "thread"), (2, "process")],
                         ids=["inline", "threads", "processes"])
def test_an_iterable_with_len_warns_as_torch(num_workers, worker_type, batch_size):
    dataset = Sized()  # one object: torch's message names it
    said = {}
    for cls, extra in ((TorchLoader, {}), (kuat.DataLoader, {"worker_type": worker_type})):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dl = cls(dataset, batch_size=batch_size, num_workers=num_workers, **extra)
            length = len(dl)
            batches = [b.tolist() for b in dl]
        said[cls] = (length, sorted(batches), [(w.category, str(w.message)) for w in caught])
    assert said[kuat.DataLoader] == said[TorchLoader]
    if num_workers and batch_size == 1:  # the case torch's warning is for: it did speak
        assert any("samples have been fetched" in m for _, m in said[TorchLoader][2])


@pytest.mark.parametrize(("num_workers", "worker_type"), [(0, "thread"), (2, "thread"), (2, "process")],
                         ids=["inline", "threads", "processes"])
def test_an_iter_datapipe_resumes_with_its_graph_seed(num_workers, worker_type):
    # the right answer: torch's epoch from the same generator state; the state saves the
    # epoch's shared seed (torchdata's replay does not reproduce the epoch: checked here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        full = [b.tolist() for b in TorchLoader(_pipe(), batch_size=2, shuffle=True,
                                                num_workers=num_workers)]

        def make():
            return kuat.DataLoader(_pipe(), batch_size=2, shuffle=True,
                                   num_workers=num_workers, worker_type=worker_type)
        torch.manual_seed(0)
        dl = make()
        it = iter(dl)
        head = [next(it).tolist() for _ in range(2)]
        state = dl.state_dict()
        torch.rand(3)  # the resuming process's generator is elsewhere
        resumed = make()
        resumed.load_state_dict(state)
        assert head + [b.tolist() for b in resumed] == full
