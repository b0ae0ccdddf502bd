"""``num_workers=0`` over a torch ``IterableDataset``: ``iter(loader)`` starts the epoch (issue 29,
"State"), as torch's single-process iterator does (it draws ``base_seed`` and calls
``iter(dataset)`` when it is made; torchdata's restores the saved iterator there). Each case
runs the same script on torch's or torchdata's loader and on kuat's, and compares.

Before, kuat called ``iter(dataset)`` at the first ``next()``: a state taken between
``iter()`` and the first ``next()`` held no iterator state (torchdata's
``TestStatefulDataLoaderIterable::test_random_state``, ``num_workers=0``, interrupt 0), and
draws from torch's generator between ``iter()`` and ``next()`` came out in another order.
"""

from __future__ import annotations

import pytest
import torch

import kuat

sdl = pytest.importorskip("torchdata.stateful_dataloader")

pytestmark = pytest.mark.timeout(60)


class GlobalRngWalk:
    """An iterator that draws from torch's global generator and saves its state in its
    ``state_dict`` (torchdata's ``DummyIterator``: restoring it sets that generator)."""

    def __init__(self, n):
        self.n, self.i = n, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return (self.i, int(torch.randint(100, (1,))))

    def state_dict(self):
        return {"i": self.i, "g": torch.get_rng_state()}

    def load_state_dict(self, state):
        self.i = state["i"]
        torch.set_rng_state(state["g"])


class Walks(torch.utils.data.IterableDataset):
    """Counts its ``iter()`` calls; the first ``fail`` of them raise ``OSError``."""

    def __init__(self, n=11, fail=0):
        self.n, self.fail, self.calls = n, fail, 0

    def __iter__(self):
        self.calls += 1
        if self.fail:
            self.fail -= 1
            raise OSError("could not open the stream")
        return GlobalRngWalk(self.n)


def _identity(batch):
    return batch


LOADERS = {"torch": torch.utils.data.DataLoader, "torchdata": sdl.StatefulDataLoader,
           "kuat": kuat.DataLoader}


@pytest.mark.parametrize("interrupt", [0, 1, 3])
def test_a_state_after_iter_holds_the_iterators_state(interrupt):
    # torchdata's test_random_state (num_workers=0): the resumed batches are the rest of the
    # epoch, drawn from the generator state the iterator saved, not from the one at resume
    result = {}
    for kind in ("torchdata", "kuat"):
        torch.manual_seed(3)
        dl = LOADERS[kind](Walks(), batch_size=2, collate_fn=_identity)
        it = iter(dl)
        head = [next(it) for _ in range(interrupt)]
        state = dl.state_dict()
        rest = list(it)
        resumed = LOADERS[kind](Walks(), batch_size=2, collate_fn=_identity)
        resumed.load_state_dict(state)
        result[kind] = (head, rest, list(resumed))
    assert result["torchdata"][1] == result["torchdata"][2] != []
    assert result["kuat"] == result["torchdata"]


def test_iter_calls_iter_of_the_dataset_and_draws_as_torch():
    # the training loop draws between iter() and next(): torch drew base_seed and the dataset
    # made its iterator before that; the numbers of both, and the batches, are torch's
    result = {}
    for kind in ("torch", "kuat"):
        torch.manual_seed(0)
        ds = Walks()
        dl = LOADERS[kind](ds, batch_size=2, collate_fn=_identity)
        it = iter(dl)
        calls, drawn = ds.calls, torch.rand(2).tolist()
        result[kind] = (calls, drawn, list(it), ds.calls, torch.rand(1).tolist())
    assert result["torch"][0] == 1
    assert result["kuat"] == result["torch"]


def test_a_resume_restores_the_iterator_at_iter():
    # torchdata restores the saved iterator (here: the global generator) at iter(), so a draw
    # of the training loop between iter() and next() comes from the restored state
    result = {}
    for kind in ("torchdata", "kuat"):
        torch.manual_seed(1)
        dl = LOADERS[kind](Walks(), batch_size=2, collate_fn=_identity)
        it = iter(dl)
        next(it)
        state = dl.state_dict()
        torch.manual_seed(9)  # another process
        resumed = LOADERS[kind](Walks(), batch_size=2, collate_fn=_identity)
        resumed.load_state_dict(state)
        it = iter(resumed)
        drawn = torch.rand(2).tolist()
        result[kind] = (drawn, list(it))
    assert result["kuat"] == result["torchdata"]


def test_an_iter_that_raises_keeps_the_loaded_state():
    # iter(dataset) raises at iter(loader), as in torch; the loaded state still waits for the
    # next iter(), as torchdata's next_iter_state does
    result = {}
    for kind in ("torchdata", "kuat"):
        torch.manual_seed(2)
        dl = LOADERS[kind](Walks(), batch_size=2, collate_fn=_identity)
        it = iter(dl)
        next(it), next(it)
        state = dl.state_dict()
        rest = list(it)
        resumed = LOADERS[kind](Walks(fail=1), batch_size=2, collate_fn=_identity)
        resumed.load_state_dict(state)
        with pytest.raises(OSError, match="could not open"):
            iter(resumed)
        result[kind] = (rest, list(resumed))
    assert result["torchdata"][0] == result["torchdata"][1]
    assert result["kuat"] == result["torchdata"]


def test_an_iterator_dropped_unused_keeps_the_epoch():
    # kuat's contract (tests/test_frameworks_torch.py, for workers): iter() without next()
    # does not advance the epoch; the batches are torch's
    torch.manual_seed(4)
    expected = list(torch.utils.data.DataLoader(Walks(), batch_size=3, collate_fn=_identity))
    torch.manual_seed(4)
    dl = kuat.DataLoader(Walks(), batch_size=3, collate_fn=_identity)
    torch.manual_seed(4)
    it = iter(dl)
    assert dl.state_dict()["epoch"] == 0
    del it
    assert dl.state_dict()["epoch"] == 0
    torch.manual_seed(4)
    assert list(dl) == expected
    assert dl.state_dict()["epoch"] == 1
