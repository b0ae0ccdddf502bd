"""Elastic resume (#28): a state loaded with another data-parallel size, batch size or worker
count continues the epoch's remaining samples exactly once over all ranks; what cannot
continue exactly raises naming what changed.

Ranks are one loader per rank in one process (``rank=``/``world_size=``: the loader's share
depends on nothing else), plus one case on real gloo ranks (``shard=True``)."""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
from torch.utils.data import IterableDataset, RandomSampler, SequentialSampler

import kuat
from tests._gloo import run_ranks

N = 96


def _loaders(source, world, batch, workers=0, worker_type="thread", state=None, **kw):
    out = []
    for r in range(world):
        dl = kuat.DataLoader(source, batch_size=batch, shuffle=True, seed=5, rank=r,
                             world_size=world, num_workers=workers, worker_type=worker_type,
                             collate_fn=_ids, **kw)
        if state is not None:
            dl.load_state_dict(state)
        out.append(dl)
    return out


def _ids(samples):
    return [int(s["id"]) if isinstance(s, dict) else int(s) for s in samples]


def _take(loaders, batches=None):
    """Each rank's ids over ``batches`` batches (the whole epoch: None), and the ranks'
    states after them (equal but for ``rank``)."""
    ids, states = [], []
    for dl in loaders:
        it = iter(dl)
        ids.append([x for b in itertools.islice(it, batches) for x in b])
        states.append(dl.state_dict())
    same = [{**s, "rank": 0} for s in states]
    assert all(s == same[0] for s in same), "ranks disagree on the global position"
    return ids, states[0]


def _check_rest(consumed, rest, n, world):
    """``rest`` (the resumed ranks' ids) serves every id not in ``consumed`` exactly once; the
    only other ids are the new layout's wrap-around padding (fewer than ``world``, taken from
    samples consumed earlier in the epoch, as DistributedSampler pads). ``n``: the ids are
    ``range(n)``, or the given list."""
    universe = range(n) if isinstance(n, int) else n
    remaining = collections.Counter(universe) - collections.Counter(consumed)
    got = collections.Counter(x for ids in rest for x in ids)
    assert all(got[x] == 1 for x in remaining), "a remaining sample missed or served twice"
    extra = got - remaining
    assert sum(extra.values()) < world and set(extra) <= set(consumed)


CHANGES = [  # (world, batch) saved -> (world, batch) resumed
    ((4, 8), (2, 8)),
    ((2, 8), (4, 8)),
    ((2, 8), (3, 8)),
    ((2, 8), (2, 4)),
    ((1, 8), (1, 4)),
    ((3, 5), (2, 7)),
]


@pytest.mark.parametrize("saved,resumed", CHANGES)
@pytest.mark.parametrize("n", [N, 101])
def test_mid_epoch_the_rest_is_served_exactly_once(saved, resumed, n):
    data = list(range(n))
    before, state = _take(_loaders(data, *saved), batches=2)
    assert state["samples_consumed"] == 2 * saved[0] * saved[1]
    assert state["layout"] == {"world_size": saved[0], "batch_size": saved[1], "num_workers": 0}
    resumed_loaders = _loaders(data, *resumed, state=state)
    rest, end = _take(resumed_loaders)
    _check_rest([x for ids in before for x in ids], rest, n, resumed[0])
    # equal steps on every rank, and the next epoch is the new layout's normal epoch
    assert len({len(ids) for ids in rest}) == 1
    assert (end["epoch"], end["samples_consumed"]) == (1, 0)
    nxt, _ = _take(resumed_loaders)
    fresh = _loaders(data, *resumed)
    for dl in fresh:
        dl.set_epoch(1)
    assert nxt == _take(fresh)[0]


@pytest.mark.parametrize("saved,resumed", CHANGES[:4])
def test_at_the_epoch_boundary_the_next_epoch_is_the_new_layouts(saved, resumed):
    data = list(range(N))
    loaders = _loaders(data, *saved)
    _take(loaders)  # epoch 0 runs out
    state = loaders[0].state_dict()
    assert (state["epoch"], state["samples_consumed"]) == (1, 0)
    got, _ = _take(_loaders(data, *resumed, state=state))
    fresh = _loaders(data, *resumed)
    for dl in fresh:
        dl.set_epoch(1)
    assert got == _take(fresh)[0]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_workers_two_then_none_then_three(worker_type):
    """Same layout, other worker counts: the uninterrupted run's batches, rank by rank."""
    data = list(range(N))
    whole, _ = _take(_loaders(data, 2, 4, workers=2, worker_type=worker_type))
    a, state = _take(_loaders(data, 2, 4, workers=2, worker_type=worker_type), batches=3)
    assert state["layout"]["num_workers"] == 2
    b, state = _take(_loaders(data, 2, 4, workers=0, state=state), batches=4)
    c, _ = _take(_loaders(data, 2, 4, workers=3, worker_type=worker_type, state=state))
    assert [x + y + z for x, y, z in zip(a, b, c)] == whole


def test_data_parallel_batch_and_workers_change_at_once_on_a_kuat_dataset(tmp_path):
    with kuat.Writer(tmp_path / "ds.kuat", {"id": kuat.format.int64()}) as w:
        for i in range(N):
            w.write({"id": i})
    ds = kuat.open(tmp_path / "ds.kuat")
    before, state = _take(_loaders(ds, 4, 4, workers=2), batches=3)
    mid, state = _take(_loaders(ds, 3, 6, workers=0, state=state), batches=1)
    assert state["samples_consumed"] == 3 * 16 + 18
    rest, _ = _take(_loaders(ds, 2, 5, workers=3, state=state))
    consumed = [x for ids in before + mid for x in ids]
    assert len(set(consumed)) == len(consumed)
    _check_rest(consumed, rest, N, 2)


def test_a_map_style_mix_continues_each_source_exactly():
    a = [{"id": i} for i in range(40)]
    b = [{"id": 1000 + i} for i in range(24)]
    mixed = kuat.mix([a, b], weights=[2, 1], stopping="all_exhausted", seed=1)
    whole = sorted(x for ids in _take(_loaders(mixed, 2, 4))[0] for x in ids)
    assert whole == sorted(list(range(40)) + list(range(1000, 1024)))
    before, state = _take(_loaders(mixed, 2, 4), batches=3)
    rest, _ = _take(_loaders(mixed, 4, 2, state=state))
    consumed = [x for ids in before for x in ids]
    got = sorted(consumed + [x for ids in rest for x in ids])
    assert got == whole  # every sample of every source once (64 = 24 + 40: no padding)


def _gloo_phase(rank, world_size, batches, state):
    dl = kuat.DataLoader(list(range(N)), batch_size=4, shuffle=True, seed=5, shard=True,
                         num_workers=1)
    if state is not None:
        dl.load_state_dict(state)
    assert (dl.rank, dl.world_size) == (rank, world_size)
    it = iter(dl)
    ids = [x for b in itertools.islice(it, batches) for x in b.tolist()]
    return ids, dl.state_dict()


def test_real_ranks_two_then_three():
    first = run_ranks(_gloo_phase, 2, args=(3, None), timeout=60)
    state = first[0][1]
    assert state["layout"]["world_size"] == 2 and state["samples_consumed"] == 24
    second = run_ranks(_gloo_phase, 3, args=(None, state), timeout=60)
    _check_rest([x for ids, _ in first for x in ids], [ids for ids, _ in second], N, 3)


# --- a user sampler= resumed with another batch size: torchdata counts samples ---------------

def _torchdata_rest(make_sampler, n, k):
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(n))
    a = StatefulDataLoader(data, batch_size=8, sampler=make_sampler(data))
    it = iter(a)
    head = [x for b in itertools.islice(it, k) for x in b.tolist()]
    b = StatefulDataLoader(data, batch_size=4, sampler=make_sampler(data))
    b.load_state_dict(a.state_dict())
    return head, [x for batch in b for x in batch.tolist()]


@pytest.mark.parametrize("make_sampler", [
    lambda d: SequentialSampler(d),
    lambda d: RandomSampler(d, generator=torch.Generator().manual_seed(3)),
], ids=["sequential", "random_with_generator"])
def test_a_user_sampler_with_another_batch_size_counts_samples_as_torchdata(make_sampler):
    data = list(range(48))
    head_td, rest_td = _torchdata_rest(make_sampler, 48, 3)
    a = kuat.DataLoader(data, batch_size=8, sampler=make_sampler(data))
    it = iter(a)
    head = [x for b in itertools.islice(it, 3) for x in b.tolist()]
    state = a.state_dict()
    assert state["samples_consumed"] == 24
    b = kuat.DataLoader(data, batch_size=4, sampler=make_sampler(data))
    b.load_state_dict(state)
    batches = [x.tolist() for x in b]
    assert head == head_td and [x for bt in batches for x in bt] == rest_td  # the 24 unserved
    assert sorted(head + rest_td) == data and [len(x) for x in batches] == [4] * 6


# --- what cannot continue exactly raises, naming the change ---------------------------------

class WorkerSharded(IterableDataset):
    """Items 0..23, split between workers as torch's documentation shows."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is None:
            return iter(range(24))
        return iter(range(info.id, 24, info.num_workers))


class Plain(IterableDataset):
    """Items lo..hi-1, whatever reads them."""

    def __init__(self, lo, hi):
        self.lo, self.hi = lo, hi

    def __iter__(self):
        return iter(range(self.lo, self.hi))


def _iterable_state(**kw):
    dl = kuat.DataLoader(WorkerSharded(), batch_size=2, **kw)
    it = iter(dl)
    next(it), next(it)
    return dl.state_dict()


@pytest.mark.parametrize("workers", [1, 3])
def test_a_worker_sharded_iterable_with_another_worker_count_raises(workers):
    state = _iterable_state(num_workers=2)
    dl = kuat.DataLoader(WorkerSharded(), batch_size=2, num_workers=workers)
    with pytest.raises(ValueError, match=rf"num_workers=2 -> {workers}.*num_workers=2"):
        dl.load_state_dict(state)
    same = kuat.DataLoader(WorkerSharded(), batch_size=2, num_workers=2)
    same.load_state_dict(state)  # the saved worker count resumes exactly, as before
    uninterrupted = [x for b in kuat.DataLoader(WorkerSharded(), batch_size=2, num_workers=2)
                     for x in b.tolist()]
    assert [x for b in same for x in b.tolist()] == uninterrupted[4:]


@pytest.mark.filterwarnings("ignore:This DataLoader will create", "ignore:'set_vital'")
def test_torchdata_refuses_another_worker_count_too():
    from torchdata.stateful_dataloader import StatefulDataLoader

    a = StatefulDataLoader(WorkerSharded(), batch_size=2, num_workers=2)
    it = iter(a)
    next(it), next(it)
    b = StatefulDataLoader(WorkerSharded(), batch_size=2, num_workers=3)
    b.load_state_dict(a.state_dict())
    with pytest.raises(AssertionError):
        next(iter(b))


def test_an_iterable_with_another_world_or_batch_size_raises(monkeypatch):
    # (kuat's own sharding refuses a torch IterableDataset at construction, so its world size
    # is the process group's, which the dataset may split itself by)
    state = _iterable_state()
    with pytest.raises(ValueError, match=r"batch_size=2 -> 3"):
        kuat.DataLoader(WorkerSharded(), batch_size=3).load_state_dict(state)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # a process group that grew (the dataset may split)
    with pytest.raises(ValueError, match=r"processes=1 -> 2"):
        kuat.DataLoader(WorkerSharded(), batch_size=2).load_state_dict(_no_env_state())


def _no_env_state():
    with pytest.MonkeyPatch.context() as m:
        m.delenv("RANK", raising=False)
        m.delenv("WORLD_SIZE", raising=False)
        return _iterable_state()


def test_at_an_epoch_boundary_an_iterable_may_change_layout():
    dl = kuat.DataLoader(WorkerSharded(), batch_size=2, num_workers=2)
    list(dl)
    state = dl.state_dict()
    resumed = kuat.DataLoader(WorkerSharded(), batch_size=3, num_workers=0)
    resumed.load_state_dict(state)
    assert sorted(x for b in resumed for x in b.tolist()) == list(range(24))


def _mix_stream():
    return kuat.mix([Plain(0, 20), Plain(100, 120)], stopping="all_exhausted", seed=1)


def _stream_loaders(make, world, batch, workers=0, state=None):
    """One loader per rank, each over its own stream (a rank's process has its own copy)."""
    out = []
    for r in range(world):
        dl = kuat.DataLoader(make(), batch_size=batch, rank=r, world_size=world,
                             num_workers=workers)
        if state is not None:
            dl.load_state_dict(state)
        out.append(dl)
    return out


def _stream_take(loaders, batches=None):
    ids, states = [], []
    for dl in loaders:
        ids.append([x for b in itertools.islice(iter(dl), batches) for x in b.tolist()])
        states.append(dl.state_dict())
    return ids, states[0]


@pytest.mark.parametrize("saved,resumed", [((2, 4, 2), (3, 2, 0)), ((4, 2, 0), (2, 4, 3)),
                                           ((2, 4, 0), (2, 2, 2))])
def test_an_iterable_mix_continues_the_rest_of_its_stream(saved, resumed):
    stream = _mix_stream  # an iterable mix (a Stream)
    universe = list(range(20)) + list(range(100, 120))
    whole, _ = _stream_take(_stream_loaders(stream, *saved))
    assert sorted(x for ids in whole for x in ids) == universe  # 40: no padding
    before, state = _stream_take(_stream_loaders(stream, *saved), batches=2)
    assert state["samples_consumed"] == 2 * saved[0] * saved[1]
    resumed_loaders = _stream_loaders(stream, *resumed, state=state)
    rest, end = _stream_take(resumed_loaders)
    _check_rest([x for ids in before for x in ids], rest, universe, resumed[0])
    assert len({len(ids) for ids in rest}) == 1 and (end["epoch"], end["samples_consumed"]) == (1, 0)
    nxt, _ = _stream_take(resumed_loaders)  # the next epoch: the new layout's own
    fresh = _stream_loaders(stream, *resumed)
    for dl in fresh:
        dl.set_epoch(1)
    assert nxt == _stream_take(fresh)[0]


def test_a_kuat_stream_with_another_worker_count_replays_exactly():
    stream = kuat.mix([Plain(0, 20), Plain(100, 120)], stopping="all_exhausted", seed=1)
    dl = kuat.DataLoader(stream, batch_size=4, num_workers=2)
    it = iter(dl)
    head = [next(it), next(it)]
    state = dl.state_dict()
    other = kuat.DataLoader(stream, batch_size=4, num_workers=3)
    other.load_state_dict(state)
    whole = [b.tolist() for b in kuat.DataLoader(stream, batch_size=4)]
    assert [b.tolist() for b in head] + [b.tolist() for b in other] == whole


DOCS = [{"input_ids": list(range(1000 * i, 1000 * i + i % 7 + 1))} for i in range(60)]


def _rows(rows):
    return [tuple(r["input_ids"].tolist()) for r in rows]  # a row is its tokens (all distinct)


@pytest.mark.parametrize("strategy", ["concat", "best_fit", "first_fit"])
@pytest.mark.parametrize("known", [True, False], ids=["lengths", "no_lengths"])
def test_packed_rows_continue_on_another_layout(strategy, known):
    lengths = [len(d["input_ids"]) for d in DOCS] if known else None

    def loaders(world, batch, workers=0, state=None):
        out = []
        for r in range(world):
            packed = kuat.pack(DOCS, seq_len=8, strategy=strategy, buffer_size=16,
                               lengths=lengths)
            dl = kuat.DataLoader(packed, batch_size=batch, rank=r, world_size=world,
                                 num_workers=workers, collate_fn=_rows)
            if state is not None:
                dl.load_state_dict(state)
            out.append(dl)
        return out

    def take(ls, batches=None):
        ids = [[x for b in itertools.islice(iter(dl), batches) for x in b] for dl in ls]
        return ids, ls[-1].state_dict()

    rows = take(loaders(1, 4))[0][0]  # the epoch's rows (the plan does not depend on layout)
    before, state = take(loaders(2, 3), batches=2)
    assert state["samples_consumed"] == 12
    rest, _ = take(loaders(3, 2, workers=2, state=state))
    _check_rest([x for ids in before for x in ids], rest, rows, 3)


def test_an_hf_stream_split_by_shards_with_another_worker_count_raises():
    datasets = pytest.importorskip("datasets")
    from kuat.sources.hf import HFIterableSource

    ds = datasets.Dataset.from_dict({"id": list(range(24))}).to_iterable_dataset(num_shards=4)
    dl = kuat.DataLoader(HFIterableSource(ds, split="shards"), batch_size=2, num_workers=2)
    it = iter(dl)
    next(it), next(it)
    state = dl.state_dict()
    with pytest.raises(ValueError, match=r"num_workers=2 -> 3"):
        kuat.DataLoader(HFIterableSource(ds, split="shards"), batch_size=2,
                        num_workers=3).load_state_dict(state)


def test_a_user_batch_sampler_of_another_size_raises():
    data = list(range(40))

    def make(bs):
        return kuat.DataLoader(data, batch_sampler=torch.utils.data.BatchSampler(
            SequentialSampler(data), bs, False))

    a = make(8)
    it = iter(a)
    next(it)
    state = a.state_dict()
    assert state["layout"]["batch_size"] == 8 and state["samples_consumed"] is None
    with pytest.raises(ValueError, match=r"batch_size=8 -> 4.*batch sampler"):
        make(4).load_state_dict(state)


def test_a_user_distributed_sampler_with_other_replicas_raises():
    data = list(range(40))

    def make(replicas):
        s = torch.utils.data.DistributedSampler(data, num_replicas=replicas, rank=0, seed=1)
        return kuat.DataLoader(data, batch_size=4, sampler=s)

    a = make(2)
    it = iter(a)
    next(it)
    state = a.state_dict()
    with pytest.raises(ValueError, match=r"sampler_replicas=2 -> 4"):
        make(4).load_state_dict(state)
    b = make(2)
    b.load_state_dict(state)
    assert [x for bt in b for x in bt.tolist()] == list(make(2).sampler)[4:]


def test_a_state_without_layout_still_loads_and_warns_on_another_world_size():
    data = list(range(N))
    _, state = _take(_loaders(data, 2, 4), batches=1)
    for key in ("layout", "samples_consumed"):
        del state[key]
    with pytest.warns(UserWarning, match="not exact"):
        _loaders(data, 4, 4, state=state)


def test_rest_of_matches_distributed_sampler_at_offset_zero_and_its_rest_on_the_same_layout():
    from kuat.loader._elastic import rest_indices, rest_size
    from kuat.sampling import DistributedEpochSampler

    for n, world, drop in [(10, 3, False), (10, 3, True), (12, 4, False), (7, 1, False)]:
        for r in range(world):
            s = DistributedEpochSampler(n, shuffle=True, seed=2, rank=r, world_size=world,
                                        drop_last=drop)
            full = s.indices(0)
            t = torch.utils.data.DistributedSampler(range(n), num_replicas=world, rank=r,
                                                    shuffle=False, drop_last=drop)
            plain = DistributedEpochSampler(n, shuffle=False, seed=0, rank=r, world_size=world,
                                            drop_last=drop)
            assert plain.indices(0) == list(t)
            for k in range(len(full) + 1):
                assert rest_indices(s, 0, k * world) == full[k:]
                assert rest_size(s, k * world) == len(full) - k


class StatefulCounter(IterableDataset):
    """A stateful iterable (per-worker states, as torchdata resumes them)."""

    def __init__(self):
        self.start = 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(self.start, 24):
            if i % nw == wid:
                self.start = i + 1
                yield i

    def state_dict(self):
        return {"start": self.start}

    def load_state_dict(self, state):
        self.start = state["start"]


def test_a_stateful_iterable_with_another_worker_count_raises():
    dl = kuat.DataLoader(StatefulCounter(), batch_size=2, num_workers=2)
    it = iter(dl)
    next(it), next(it)
    state = dl.state_dict()
    assert state["workers"]["num_workers"] == 2
    with pytest.raises(ValueError, match=r"num_workers=2 workers.*num_workers=3"):
        kuat.DataLoader(StatefulCounter(), batch_size=2, num_workers=3).load_state_dict(state)


# --- a resumed epoch saved again and resumed once more (the position is off the batch grid) --

def test_own_sampler_resumed_twice_serves_each_sample_once():
    data = list(range(N))
    a, state = _take(_loaders(data, 4, 8), batches=1)  # 32 consumed
    b, state = _take(_loaders(data, 3, 5, state=state), batches=1)  # + 15 = 47
    assert (state["samples_consumed"], state["batches_served_in_epoch"]) == (47, 3)
    c, _ = _take(_loaders(data, 3, 5, state=state))  # the same layout again
    consumed = [x for ids in a + b for x in ids]
    assert len(set(consumed)) == 47
    _check_rest(consumed, c, N, 3)


def test_a_stream_resumed_twice_serves_each_sample_once():
    universe = list(range(20)) + list(range(100, 120))
    a, state = _stream_take(_stream_loaders(_mix_stream, 2, 4), batches=1)  # 8 consumed
    b, state = _stream_take(_stream_loaders(_mix_stream, 3, 3, state=state), batches=1)  # 17
    assert state["samples_consumed"] == 17
    c, _ = _stream_take(_stream_loaders(_mix_stream, 3, 3, workers=2, state=state))
    consumed = [x for ids in a + b for x in ids]
    assert len(set(consumed)) == 17
    _check_rest(consumed, c, universe, 3)


def test_a_user_sampler_resumed_twice_serves_each_sample_once():
    data = list(range(48))

    def make(bs):
        return kuat.DataLoader(data, batch_size=bs, sampler=RandomSampler(
            data, generator=torch.Generator().manual_seed(4)))

    a = make(8)
    head = [x for b in itertools.islice(iter(a), 3) for x in b.tolist()]  # 24
    b = make(5)
    b.load_state_dict(a.state_dict())
    mid = [x for bt in itertools.islice(iter(b), 2) for x in bt.tolist()]  # + 10 = 34
    state = b.state_dict()
    assert (state["samples_consumed"], state["batches_served_in_epoch"]) == (34, 6)
    c = make(5)
    c.load_state_dict(state)
    rest = [x for bt in c for x in bt.tolist()]
    assert head + mid + rest == list(make(8).sampler)  # the sampler's one order, each once


def test_exact_evaluation_resumed_on_other_ranks_serves_the_rest_once_padding_flagged():
    def loaders(world, batch, state=None):
        out = []
        for r in range(world):
            dl = kuat.DataLoader([{"i": i} for i in range(23)], batch_size=batch, shuffle=True,
                                 seed=2, rank=r, world_size=world, exact_eval=True)
            if state is not None:
                dl.load_state_dict(state)
            out.append(dl)
        return out

    def take(ls, batches=None):
        got = [[(int(i), bool(p)) for b in itertools.islice(iter(dl), batches)
                for i, p in zip(b["i"], b["is_padding"])] for dl in ls]
        return got, ls[0].state_dict()

    before, state = take(loaders(3, 2), batches=2)  # 12 of 23 consumed
    assert state["samples_consumed"] == 12
    rest, _ = take(loaders(2, 4, state=state))
    assert len({len(r) for r in rest}) == 1  # equal steps
    real = sorted(i for r in before + rest for i, pad in r if not pad)
    assert real == list(range(23))  # every sample valid exactly once
