"""Exact resume of map-style datasets: state_dict() mid-epoch, at an epoch's end and before
the first batch, into a loader with the same or another worker count and type."""

import pickle

import numpy as np
import pytest

import kuat

CONFIGS = [dict(num_workers=0), dict(num_workers=3), dict(num_workers=2, worker_type="process")]


class Augmented:
    """Per-sample randomness from kuat.sample_rng and from NumPy's global generator."""

    def __len__(self):
        return 23

    def __getitem__(self, i):
        return {"i": i, "aug": int(kuat.sample_rng(i).numpy.integers(1 << 30)),
                "glob": int(np.random.randint(1 << 30))}


class BatchAugmented:
    kuat_uses_sample_rng = True

    def __len__(self):
        return 23

    def __getitems__(self, indices):
        return [{"i": i, "aug": int(kuat.sample_rng(i).numpy.integers(1 << 30))} for i in indices]

    def __getitem__(self, i):
        return self.__getitems__([i])[0]


def _rows(batch):
    return [tuple(int(v) for v in vals) for vals in zip(*(batch[k] for k in sorted(batch)))]


def _take(loader, k):
    out = []
    while len(out) < k:
        for b in loader:
            out.append(_rows(b))
            if len(out) == k:
                break
    return out


def _rest(loader, state, epochs):
    out = []
    for _ in range(state["epoch"], epochs):
        out += [_rows(b) for b in loader]
    return out


@pytest.mark.parametrize("dataset", [Augmented, BatchAugmented])
@pytest.mark.parametrize("before,after", [(0, 1), (1, 2), (2, 0)])
def test_resume_matches_an_uninterrupted_run(dataset, before, after):
    def make(cfg):
        return kuat.DataLoader(dataset(), batch_size=4, shuffle=True, drop_last=False, seed=17, **cfg)

    full = _take(make(CONFIGS[0]), 12)  # two epochs of 6 batches
    assert full[:6] != full[6:]
    for k in (0, 3, 6, 8):  # before the first batch, mid-epoch, end of epoch, mid second epoch
        first = make(CONFIGS[before])
        head = _take(first, k)
        state = first.state_dict()
        assert len(pickle.dumps(state)) < 300
        second = make(CONFIGS[after])
        second.load_state_dict(state)
        assert second.state_dict() == state
        assert head + _rest(second, state, 2) == full, (k, state)


def test_end_of_epoch_state_points_at_the_next_epoch():
    dl = kuat.DataLoader(list(range(10)), batch_size=5, seed=1)
    assert dl.state_dict()["epoch"] == 0
    it = iter(dl)
    next(it)
    assert (dl.state_dict()["epoch"], dl.state_dict()["batches_served_in_epoch"]) == (0, 1)
    next(it)  # the last batch, inside the loop: the rest of epoch 0 is empty (torchdata #1439)
    assert (dl.state_dict()["epoch"], dl.state_dict()["batches_served_in_epoch"]) == (0, 2)
    assert list(it) == []  # the epoch ran out: the state points at the next one
    assert (dl.state_dict()["epoch"], dl.state_dict()["batches_served_in_epoch"]) == (1, 0)


def test_resume_changes_the_seed_to_the_saved_one():
    a = kuat.DataLoader(list(range(30)), batch_size=3, shuffle=True, seed=5)
    order = [b.tolist() for b in a]
    b = kuat.DataLoader(list(range(30)), batch_size=3, shuffle=True, seed=a.seed + 1)
    b.load_state_dict({**a.state_dict(), "epoch": 0})
    assert [x.tolist() for x in b] == order


def test_set_epoch_selects_the_order():
    a = kuat.DataLoader(list(range(30)), batch_size=3, shuffle=True, seed=2)
    epochs = [[x.tolist() for x in a] for _ in range(3)]
    b = kuat.DataLoader(list(range(30)), batch_size=3, shuffle=True, seed=2)
    b.set_epoch(2)
    assert [x.tolist() for x in b] == epochs[2]
    with pytest.raises(ValueError, match="epoch"):
        b.set_epoch(-1)


class Stateful:
    def __init__(self):
        self.state = {"cursor": 0}

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return i

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def test_source_state_is_saved_and_restored():
    src = Stateful()
    src.state["cursor"] = 7
    state = kuat.DataLoader(src).state_dict()
    assert state["source"] == {"cursor": 7}
    other = Stateful()
    kuat.DataLoader(other).load_state_dict(state)
    assert other.state == {"cursor": 7}


def test_invalid_state_is_refused():
    with pytest.raises(ValueError, match="kuat DataLoader state"):
        kuat.DataLoader([1]).load_state_dict({"epoch": 1})


def test_iterable_resume_replays_the_served_batches():
    from torch.utils.data import IterableDataset

    class Counter(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    a = kuat.DataLoader(Counter(), batch_size=3)
    it = iter(a)
    next(it)
    state = a.state_dict()
    b = kuat.DataLoader(Counter(), batch_size=3)
    b.load_state_dict(state)
    assert [x.tolist() for x in b] == [[3, 4, 5], [6, 7, 8], [9]]
