"""torchdata's ``StatefulDataLoader`` contract (issue 29, "State"): each case runs the same
script on torchdata's loader and on kuat's, and kuat must give what torchdata gives.

* a stateful ``IterableDataset`` (its own ``state_dict``, or its iterator's) resumes each
  worker's copy from that worker's state, with 0 workers, thread and process workers (kuat
  used to ask the main process's copy, and with 0 workers skipped the served batches again);
* a state taken after ``iter()`` and before the first ``next()``, or after an epoch ran out,
  names the order of the epoch it points at (``shuffle=True`` without a seed);
* ``state_dict()`` right after ``load_state_dict(s)`` is ``s``;
* a state taken inside the loop after the last batch resumes to the empty rest of that epoch
  (pytorch/data #1439), and one taken after the loop to the next epoch;
* ``snapshot_every_n_steps=0`` is accepted.
"""

from __future__ import annotations

import pytest
import torch

import kuat

sdl = pytest.importorskip("torchdata.stateful_dataloader")

pytestmark = pytest.mark.timeout(60)

WORKERS = [(0, "thread"), (2, "thread"), (2, "process")]
IDS = ["inline", "threads", "processes"]


def _identity(batch):
    return batch


def _shares(num_workers: int) -> list[int]:
    return [11] if num_workers == 0 else [7, 4]


def _share(sizes):
    info = torch.utils.data.get_worker_info()
    wid = 0 if info is None else info.id
    start = sum(sizes[:wid])
    return start, sizes[wid]


class GeneratorStream(torch.utils.data.IterableDataset):
    """State on the dataset; ``__iter__`` is a generator (torchdata's ``GeneratorIterable``)."""

    def __init__(self, sizes, increment_epoch=False):
        self.sizes, self.i, self.resume, self.epoch = sizes, 0, None, 0
        self.increment_epoch = increment_epoch

    def __iter__(self):
        start, n = _share(self.sizes)
        self.i, self.resume = (self.resume or 0), None
        for k in range(start + self.i, start + n):
            self.i += 1
            yield (k, self.epoch)
        self.i = 0
        if self.increment_epoch:
            self.epoch += 1

    def state_dict(self):
        return {"i": self.i, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.resume, self.epoch = state["i"], state["epoch"]


class RandomWalk:
    """An iterator with its own RNG and ``state_dict`` (the dataset has none)."""

    def __init__(self, start, n):
        self.start, self.n, self.i = start, n, 0
        self.g = torch.Generator().manual_seed(1000 + start)

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return (self.start + self.i, int(torch.randint(100, (1,), generator=self.g)))

    def state_dict(self):
        return {"i": self.i, "g": self.g.get_state().tolist()}

    def load_state_dict(self, state):
        self.i = state["i"]
        self.g.set_state(torch.tensor(state["g"], dtype=torch.uint8))


class IteratorStateStream(torch.utils.data.IterableDataset):
    def __init__(self, sizes):
        self.sizes = sizes

    def __iter__(self):
        return RandomWalk(*_share(self.sizes))


class SelfIterator(torch.utils.data.IterableDataset):
    """The dataset is its own iterator (``iter()`` returns it), with ``state_dict``."""

    def __init__(self, sizes):
        self.sizes, self.i, self.base, self.n = sizes, 0, 0, 0

    def __iter__(self):
        self.base, self.n = _share(self.sizes)
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self.base + self.i - 1

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


DATASETS = {"dataset_state": GeneratorStream, "iterator_state": IteratorStateStream,
            "self_iterator": SelfIterator}


def _loaders(num_workers, worker_type, **kw):
    """``make(kind, dataset)``: a torchdata or a kuat loader over ``dataset``."""
    def make(kind, dataset):
        if kind == "torchdata":
            return sdl.StatefulDataLoader(dataset, num_workers=num_workers, **kw)
        return kuat.DataLoader(dataset, num_workers=num_workers, worker_type=worker_type,
                               **kw)
    return make


@pytest.mark.parametrize("name", sorted(DATASETS))
@pytest.mark.parametrize("interrupt", [1, 4])
@pytest.mark.parametrize(("num_workers", "worker_type"), WORKERS, ids=IDS)
def test_stateful_iterable_resumes_each_worker(num_workers, worker_type, interrupt, name):
    make = _loaders(num_workers, worker_type, batch_size=2, collate_fn=_identity)
    result = {}
    for kind in ("torchdata", "kuat"):
        dl = make(kind, DATASETS[name](_shares(num_workers)))
        it = iter(dl)
        head = [next(it) for _ in range(interrupt)]
        state = dl.state_dict()
        rest = list(it)
        resumed = make(kind, DATASETS[name](_shares(num_workers)))
        resumed.load_state_dict(state)
        if kind == "kuat":  # (torchdata's inline loader answers from the reloaded dataset)
            assert resumed.state_dict() == state  # nothing moved since load_state_dict
        result[kind] = (head, rest, list(resumed))
    head, rest, again = result["torchdata"]
    assert again == rest  # torchdata's own contract, in this environment
    assert result["kuat"] == result["torchdata"]


@pytest.mark.parametrize(("num_workers", "worker_type", "pw"),
                         [(0, "thread", False), (2, "thread", True), (2, "process", True)],
                         ids=["inline", "threads-persistent", "processes-persistent"])
def test_dataset_state_carries_over_epochs_with_persistent_copies(num_workers, worker_type, pw):
    # torchdata's TestMultiEpochState: the dataset counts its epochs in each worker's copy
    make = _loaders(num_workers, worker_type, collate_fn=_identity, persistent_workers=pw)
    result = {}
    for kind in ("torchdata", "kuat"):
        dl = make(kind, GeneratorStream(_shares(num_workers), increment_epoch=True))
        first = list(dl)
        state = dl.state_dict()
        second, third = list(dl), list(dl)
        resumed = make(kind, GeneratorStream(_shares(num_workers), increment_epoch=True))
        it = iter(resumed)
        next(it)
        resumed.load_state_dict(state)
        result[kind] = (first, second, third, list(resumed), list(resumed))
    assert result["torchdata"][1:3] == result["torchdata"][3:]
    assert result["kuat"] == result["torchdata"]


@pytest.mark.parametrize(("num_workers", "worker_type"), WORKERS, ids=IDS)
def test_a_state_before_the_first_batch_names_the_order(num_workers, worker_type):
    # torchdata's TestSnapshotZero.test_map_shuffle: shuffle=True without a seed
    make = _loaders(num_workers, worker_type, batch_size=3, shuffle=True)
    for kind in ("torchdata", "kuat"):
        torch.manual_seed(0)
        dl = make(kind, list(range(20)))
        it = iter(dl)
        state0 = dl.state_dict()
        expected = [b.tolist() for b in it]
        torch.rand(5)  # the training loop draws from the same generator
        dl.load_state_dict(state0)
        assert [b.tolist() for b in dl] == expected, kind


@pytest.mark.parametrize(("num_workers", "worker_type"), WORKERS, ids=IDS)
def test_the_epoch_after_an_end_of_epoch_state_is_the_saved_one(num_workers, worker_type):
    # torchdata's TestSnapshotEnd.test_map_shuffle: the next epoch's order is in the state
    make = _loaders(num_workers, worker_type, batch_size=4, shuffle=True)
    for kind in ("torchdata", "kuat"):
        dl = make(kind, list(range(20)))
        list(dl)
        state_end = dl.state_dict()
        expected = [b.tolist() for b in dl]
        torch.rand(7)  # another process, whose generator is elsewhere
        resumed = make(kind, list(range(20)))
        resumed.load_state_dict(state_end)
        assert resumed.state_dict() == state_end, kind
        assert [b.tolist() for b in resumed] == expected, kind


def test_a_state_is_returned_as_loaded():
    # torchdata's TestInitialState.test_load_then_state
    for kind in ("torchdata", "kuat"):
        make = _loaders(2, "thread", batch_size=2, shuffle=True)
        dl = make(kind, list(range(12)))
        state0 = dl.state_dict()
        expected = [b.tolist() for b in dl]
        other = make(kind, list(range(12)))
        it = iter(other)
        next(it), next(it)
        other.load_state_dict(state0)
        assert other.state_dict() == state0, kind
        assert [b.tolist() for b in other] == expected, kind


@pytest.mark.parametrize(("num_workers", "worker_type"), WORKERS, ids=IDS)
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_state_after_the_last_batch_resumes_the_empty_rest(num_workers, worker_type, shuffle):
    # torchdata's TestEndOfEpochBehavior (pytorch/data #1439)
    make = _loaders(num_workers, worker_type, batch_size=1, shuffle=shuffle)
    counts = {}
    for kind in ("torchdata", "kuat"):
        dl = make(kind, list(range(10)))
        for _ in dl:
            inside = dl.state_dict()
        after = dl.state_dict()
        resumed_in, resumed_out = make(kind, list(range(10))), make(kind, list(range(10)))
        resumed_in.load_state_dict(inside)
        resumed_out.load_state_dict(after)
        counts[kind] = (len(list(resumed_in)), len(list(resumed_in)), len(list(resumed_out)))
    assert counts["torchdata"] == (0, 10, 10)
    assert counts["kuat"] == counts["torchdata"]


def test_snapshot_every_n_steps_zero_is_accepted():
    assert sdl.StatefulDataLoader(list(range(4)), snapshot_every_n_steps=0).snapshot_every_n_steps == 0
    dl = kuat.DataLoader(list(range(4)), snapshot_every_n_steps=0)
    assert dl.snapshot_every_n_steps == 0 and len(list(dl)) == 4
    with pytest.raises(ValueError, match="snapshot_every_n_steps"):
        kuat.DataLoader(list(range(4)), snapshot_every_n_steps=-1)


def test_another_worker_count_is_refused_for_per_worker_states():
    dl = kuat.DataLoader(GeneratorStream([7, 4]), num_workers=2, collate_fn=_identity)
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    with pytest.raises(ValueError, match="num_workers=2"):
        kuat.DataLoader(GeneratorStream([11]), collate_fn=_identity).load_state_dict(state)


@pytest.mark.parametrize(("num_workers", "worker_type"), WORKERS, ids=IDS)
def test_two_epochs_resumed_are_the_uninterrupted_run(num_workers, worker_type):
    # torchdata's TestMultiEpochSDL: shuffle=True without a seed, resumed after two epochs in
    # the same process; the loaded state names epoch 2's draws, so the resume draws nothing more
    make = _loaders(num_workers, worker_type, batch_size=5, shuffle=True)
    for kind in ("torchdata", "kuat"):
        torch.manual_seed(0)
        dl = make(kind, list(range(20)))
        got = [[b.tolist() for b in dl] for _ in range(2)]
        state = dl.state_dict()
        resumed = make(kind, list(range(20)))
        resumed.load_state_dict(state)
        got += [[b.tolist() for b in resumed] for _ in range(2)]
        torch.manual_seed(0)
        again = make(kind, list(range(20)))
        assert got == [[b.tolist() for b in again] for _ in range(4)], kind


class GlobalRngWalk(RandomWalk):
    """Draws from torch's global generator (a worker process's own) and saves its state, as
    torchdata's ``DummyIterator``: restoring it sets that generator."""

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return (self.start + self.i, int(torch.randint(100, (1,))))

    def state_dict(self):
        return {"i": self.i, "g": torch.get_rng_state()}

    def load_state_dict(self, state):
        self.i = state["i"]
        torch.set_rng_state(state["g"])


class GlobalRngStream(IteratorStateStream):
    def __iter__(self):
        return GlobalRngWalk(*_share(self.sizes))


@pytest.mark.parametrize(("num_workers", "pw"), [(0, False), (2, True)],
                         ids=["inline", "processes-persistent"])
def test_an_end_of_epoch_state_carries_the_iterators_side_effects(num_workers, pw):
    # torchdata's TestSnapshotEnd.test_iterable: the next epoch of persistent copies goes on
    # from the generator state the last iterator saved (a new iter(), after loading it)
    g = torch.Generator()  # worker processes seeded as torch seeds them (from generator=)
    make = _loaders(num_workers, "process", batch_size=3, collate_fn=_identity,
                    persistent_workers=pw, generator=g)
    result = {}
    for kind in ("torchdata", "kuat"):
        torch.manual_seed(4)
        g.manual_seed(4)
        dl = make(kind, GlobalRngStream(_shares(num_workers)))
        list(dl)
        state_end = dl.state_dict()
        expected = list(dl)
        torch.manual_seed(5)
        g.manual_seed(4)
        resumed = make(kind, GlobalRngStream(_shares(num_workers)))
        resumed.load_state_dict(state_end)
        result[kind] = (expected, list(resumed))
    assert result["torchdata"][0] == result["torchdata"][1]
    assert result["kuat"] == result["torchdata"]


@pytest.mark.parametrize("pw", [False, True], ids=["processes", "processes-persistent"])
def test_a_state_before_the_first_batch_of_a_stateful_iterable(pw):
    # torchdata's TestSnapshotZero.test_iterable: loaded into the same loader after its epoch,
    # the state (no worker has reported yet) replays that epoch from fresh copies. (With
    # num_workers=0 the state holds the iterator iter() made: tests/test_parity_iter_open.py)
    num_workers = 2
    make = _loaders(num_workers, "process", collate_fn=_identity, persistent_workers=pw)
    for kind in ("torchdata", "kuat"):
        dl = make(kind, GlobalRngStream(_shares(num_workers)))
        it = iter(dl)
        state0 = dl.state_dict()
        expected = list(it)
        dl.load_state_dict(state0)
        assert list(dl) == expected, kind


@pytest.mark.parametrize("name", ["dataset_state", "self_iterator"])
def test_a_state_before_the_first_batch_with_no_workers_holds_the_datasets_own(name):
    # torchdata's TestStatefulDataLoaderIterable2.test_no_mp (interrupt 0): the same dataset
    # object, read by a second loader with num_workers=0 after the first read it all, resumes
    # from the state taken before the first batch: every item again, not an empty epoch
    result = {}
    for kind in ("torchdata", "kuat"):
        dataset = DATASETS[name](_shares(1))
        make = _loaders(0, None, batch_size=2, collate_fn=_identity)
        dl = make(kind, dataset)
        it = iter(dl)
        state = dl.state_dict()
        expected = list(it)
        resumed = make(kind, dataset)
        resumed.load_state_dict(state)
        result[kind] = (expected, list(resumed))
        assert result[kind][1] == expected and expected, kind
    assert result["kuat"] == result["torchdata"]
