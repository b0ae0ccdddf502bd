"""``in_order=False`` and resume: the state names the batches served, not how many (issue #29).

With ``in_order=False`` batches come back as they are ready, so the ones served are not the
first ``n`` of the epoch's order: a state that only counts them replays some and loses others
on resume. kuat's state names the keys done (``kuat.loader._state.KeysDone``), so resume
fetches exactly the others, the ones in flight when the state was taken included. Expected
values come from torchdata's ``StatefulDataLoader`` and torch's ``DataLoader`` in each test.
"""

import multiprocessing
import time

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset

import kuat

MODES = [dict(worker_type="thread"), dict(worker_type="process")]
IDS = ["threads", "processes"]


class SlowIndex(Dataset):
    """torchdata's _TestSlowIndexDataset: sample ``slow`` takes ``sleep_s`` seconds."""

    def __init__(self, n=10, slow=0, sleep_s=0.6):
        self.n, self.slow, self.sleep_s = n, slow, sleep_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.slow:
            time.sleep(self.sleep_s)
        return i


def _interrupted(cls, ds, take, **kw):
    """``take`` batches, the state, then everything a new loader resumed from it yields."""
    dl = cls(ds, num_workers=2, in_order=False, **kw)
    head = []
    for b in dl:
        head.append(b.tolist())
        if len(head) == take:
            state = dl.state_dict()
            break
    resumed = cls(ds, num_workers=2, in_order=False, **kw)
    resumed.load_state_dict(state)
    return head, [b.tolist() for b in resumed]


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_resume_after_a_slow_sample_serves_exactly_the_rest_as_torchdata(mode):
    # torchdata's TestOutOfOrderWithCheckpointing.test_out_of_order_index_ds
    from torchdata.stateful_dataloader import StatefulDataLoader

    td_head, td_rest = _interrupted(StatefulDataLoader, SlowIndex(), 4)
    head, rest = _interrupted(kuat.DataLoader, SlowIndex(), 4, **mode)
    assert [0] not in td_head  # the slow sample was still in flight
    assert [0] not in head  # (threads: the other worker fetches beside the slow one's probe)
    flat = [x for b in head + rest for x in b]
    assert sorted(flat) == sorted(x for b in td_head + td_rest for x in b) == list(range(10))


class Held(Dataset):
    """Sample 0 waits until ``release`` is set (the state is taken while it is in flight)."""

    def __init__(self, n, release):
        self.n, self.release = n, release

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 0 and not self.release.wait(20):
            raise RuntimeError("never released")
        return i


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_states_taken_out_of_order_resume_exactly_twice_over(mode):
    # the epoch's batches (torch's order for this generator): each exactly once over an
    # interrupted run, its resume (itself interrupted) and the resume of that
    def gen():  # (its order puts sample 0 in the second batch: in flight from the start)
        return torch.Generator().manual_seed(6)

    kw = dict(batch_size=2, shuffle=True, num_workers=2, in_order=False, **mode)
    release = multiprocessing.get_context("fork").Event()
    ds = Held(24, release)
    release.set()
    expected = sorted(b.tolist() for b in TorchLoader(ds, batch_size=2, shuffle=True,
                                                      generator=gen()))
    release.clear()
    served, states = [], []
    dl = kuat.DataLoader(ds, generator=gen(), **kw)
    it = iter(dl)
    for _ in range(4):  # sample 0's batch is held: these are the others
        served.append(next(it).tolist())
    states.append(dl.state_dict())
    release.set()
    rest = [b.tolist() for b in it]  # the uninterrupted run
    assert sorted(served + rest) == expected
    assert states[0]["keys_done"]["ahead"]  # served past a batch not served
    resumed = kuat.DataLoader(ds, generator=gen(), **kw)
    resumed.load_state_dict(states[0])
    it = iter(resumed)
    again = [next(it).tolist() for _ in range(3)]
    states.append(resumed.state_dict())
    assert sorted(again + [b.tolist() for b in it]) == sorted(rest)
    last = kuat.DataLoader(ds, generator=gen(), **kw)
    last.load_state_dict(states[1])
    assert sorted(served + again + [b.tolist() for b in last]) == expected
    assert states[1]["batches_served_in_epoch"] == 7


class EmptyAt(Dataset):
    """Samples 2 and 3 fail: with on_error='skip' and batch_size=2 their batch is empty."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i in (2, 3):
            raise ValueError(f"bad sample {i}")
        return i


def test_a_batch_skipped_whole_is_not_fetched_again_nor_a_served_one_replayed():
    # in order: batches [0,1], (2,3 skipped), [4,5] served; resume serves [6,7] only, as the
    # uninterrupted run does (torch's order: no shuffle)
    expected = [b.tolist() for b in TorchLoader(range(8), batch_size=2)]
    dl = kuat.DataLoader(EmptyAt(), batch_size=2, on_error="skip")
    it = iter(dl)
    head = [next(it).tolist() for _ in range(2)]
    state = dl.state_dict()
    resumed = kuat.DataLoader(EmptyAt(), batch_size=2, on_error="skip")
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert head + rest == [b for b in expected if b != [2, 3]]


class SlowSecondIterable(torch.utils.data.IterableDataset):
    """Worker 0's second item is slow; no state_dict (resume replays)."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id * 10, info.id * 10 + 4):
            if i == 1:
                time.sleep(1.0)
            yield i


def test_an_iterable_served_out_of_order_without_state_warns_that_resume_is_not_exact():
    dl = kuat.DataLoader(SlowSecondIterable(), num_workers=2, in_order=False,
                         worker_type="thread")
    it = iter(dl)
    head = [next(it).item() for _ in range(3)]
    assert 1 not in head  # worker 1's came first
    with pytest.warns(UserWarning, match="out of order"):
        dl.state_dict()
    in_order = kuat.DataLoader(SlowSecondIterable(), num_workers=2, worker_type="thread")
    it = iter(in_order)
    next(it)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        in_order.state_dict()


def test_out_of_order_state_resumed_on_another_layout_loses_nothing():
    """A state naming batches served out of order, loaded with another worker count (an elastic
    resume: the epoch continues from a global position): the contiguous prefix is skipped, the
    batches served past it are served again, with a warning; nothing is lost."""
    dl = kuat.DataLoader(SlowIndex(), num_workers=2, in_order=False, worker_type="process")
    head = []
    for b in dl:
        head.append(b.tolist())
        if len(head) == 4:
            state = dl.state_dict()
            break
    assert "keys_done" in state and state["keys_done"]["ahead"]  # 0 still in flight
    resumed = kuat.DataLoader(SlowIndex(), num_workers=0, in_order=False)
    with pytest.warns(UserWarning, match="served again"):
        resumed.load_state_dict(state)
        rest = [b.tolist() for b in resumed]
    prefix = state["keys_done"]["prefix"]
    assert [x for b in rest for x in b] == list(range(prefix, 10))
    assert set(x for b in head + rest for x in b) == set(range(10))


class Rendezvous(Dataset):
    """Sample 1 (worker 1's first) starts only once sample 0 (worker 0's first) has started,
    and sample 0 ends only once the test saw the other worker's batches: each first batch is
    in flight while the other worker's runs, whichever worker takes the global-RNG probe."""

    def __init__(self, n, started, release):
        self.n, self.started, self.release = n, started, release

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 0:
            self.started.set()
            if not self.release.wait(20):
                raise RuntimeError("sample 0 was never released")
        elif i == 1 and not self.started.wait(20):
            raise RuntimeError("sample 0 never started")
        return i


def test_threads_yield_the_other_workers_batches_while_the_probed_first_sample_is_slow(monkeypatch):
    # torchdata's test_out_of_order_index_ds with thread workers: the global-RNG probe of one
    # worker's first batch (exclusive: its generators reseeded) must not hold the other
    # worker's batches back for as long as the probed sample takes. STALL_S (after which a
    # waiter gives up on a stuck holder) is made long, so that only not waiting passes.
    from kuat.engine import isolate

    def run(cls, **kw):
        ctx = multiprocessing.get_context("fork")
        started, release = ctx.Event(), ctx.Event()
        it = iter(cls(Rendezvous(12, started, release), batch_size=1, num_workers=2,
                      in_order=False, timeout=30, **kw))
        # everything but the slow sample and the one queued behind it (prefetch_factor 2)
        head = [next(it).item() for _ in range(10)]
        release.set()
        return head, [b.item() for b in it]

    t_head, t_rest = run(TorchLoader)
    assert set(t_head) == set(range(12)) - {0, 2}
    monkeypatch.setattr(isolate, "STALL_S", 60.0)
    dl_kw = dict(worker_type="thread", seed=0)
    head, rest = run(kuat.DataLoader, **dl_kw)
    assert set(head) == set(t_head) and sorted(rest) == sorted(t_rest)
