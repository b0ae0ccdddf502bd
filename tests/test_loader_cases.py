"""The small "Done when" cases of issue 4 (loader) and issue 6 (distributed shares, resume)."""

import traceback

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

import kuat


class TwoArgError(Exception):
    def __init__(self, code, detail):
        super().__init__(f"code {code}: {detail}")
        self.code, self.detail = code, detail


class FailsFirst:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 0:
            raise TwoArgError(7, "the first item is broken")
        return i


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_exception_with_two_required_args_keeps_type_attributes_traceback_and_index(worker_type):
    # TwoArgError(*e.args) raises TypeError (its __init__ takes (code, detail), its args are
    # one message): rebuilt without __init__, as pickle does, so type and attributes survive
    dl = kuat.DataLoader(FailsFirst(), num_workers=1, worker_type=worker_type)
    with pytest.raises(Exception) as info:
        next(iter(dl))
    text = "".join(traceback.format_exception(info.value))
    assert "TwoArgError" in text
    assert "code 7: the first item is broken" in text
    assert "sample indices [0]" in text
    assert "kuat-worker-0" in text
    assert 'raise TwoArgError(7, "the first item is broken")' in text  # the worker's traceback
    assert type(info.value) is TwoArgError
    assert info.value.args == ("code 7: the first item is broken",)
    assert (info.value.code, info.value.detail) == (7, "the first item is broken")


class ShardedRange(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        if info is None:
            return iter(range(10))
        return iter(range(info.id, 10, info.num_workers))


def test_iterable_sharded_by_worker_id_with_four_threads_yields_each_item_once():
    dl = kuat.DataLoader(ShardedRange(), batch_size=2, num_workers=4)
    items = [x for batch in dl for x in batch.tolist()]
    assert sorted(items) == list(range(10))
    assert get_worker_info() is None  # the main thread still sees no worker


class Items:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _orders(seed):
    dl = kuat.DataLoader(Items(22), batch_size=5, drop_last=True, shuffle=True, seed=seed)
    return [[b.tolist() for b in dl] for _ in range(3)]


def test_three_epochs_without_set_epoch_differ_and_repeat_with_the_same_seed():
    first = _orders(seed=123)
    assert all(len(epoch) == 4 and all(len(b) == 5 for b in epoch) for epoch in first)
    flat = [tuple(x for b in epoch for x in b) for epoch in first]
    assert len(set(flat)) == 3
    assert _orders(seed=123) == first
    assert _orders(seed=124) != first


class GlobalRandom:
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return np.random.randint(0, 2**31)


def _global_draws(seed, num_workers, worker_type="thread"):
    dl = kuat.DataLoader(GlobalRandom(), batch_size=1, num_workers=num_workers, seed=seed,
                         worker_type=worker_type)
    return [int(b) for _ in range(2) for b in dl]


def test_global_numpy_draws_are_distinct_and_reproducible_with_four_thread_workers():
    values = _global_draws(seed=5, num_workers=4)
    assert len(values) == 32 and len(set(values)) == 32
    assert _global_draws(seed=5, num_workers=4) == values
    # the same whatever the worker count or type
    assert _global_draws(seed=5, num_workers=0) == values
    assert _global_draws(seed=5, num_workers=2, worker_type="process") == values


def test_global_rng_isolation_leaves_the_callers_streams_alone():
    np.random.seed(0)
    expected = np.random.rand()
    np.random.seed(0)
    _global_draws(seed=5, num_workers=0)
    assert np.random.rand() == expected


@pytest.mark.parametrize("drop_last", [False, True])
def test_26_samples_world_size_4_batch_6_two_epochs(drop_last):
    for epoch in range(2):
        per_rank = []
        for rank in range(4):
            dl = kuat.DataLoader(Items(26), batch_size=6, shuffle=True, drop_last=drop_last,
                                 seed=3, rank=rank, world_size=4)
            dl.set_epoch(epoch)
            batches = [b.tolist() for b in dl]
            assert len(batches) == len(dl)
            assert all(len(b) > 0 for b in batches)
            per_rank.append(batches)
        assert len({len(b) for b in per_rank}) == 1  # equal batch counts
        seen = [x for batches in per_rank for b in batches for x in b]
        if drop_last:
            assert len(per_rank[0]) == 1 and len(seen) == 24 and len(set(seen)) == 24
        else:
            assert len(per_rank[0]) == 2 and set(seen) == set(range(26)) and len(seen) == 28


def test_range_100_resume_after_two_epochs_matches_four_uninterrupted_epochs():
    def make():
        return kuat.DataLoader(list(range(100)), batch_size=1, shuffle=True, seed=11)

    full = [int(b) for dl in [make()] for _ in range(4) for b in dl]
    first = make()
    head = [int(b) for _ in range(2) for b in first]
    state = first.state_dict()
    second = make()
    second.load_state_dict(state)
    assert second.state_dict() == state
    tail = [int(b) for _ in range(2) for b in second]
    assert len(head) + len(tail) == 400
    assert head + tail == full
    assert full[:100] != full[100:200]


def test_state_before_first_batch_and_seed_from_torch_manual_seed():
    torch.manual_seed(0)
    a = kuat.DataLoader(Items(10), shuffle=True)
    assert a.state_dict()["epoch"] == 0 and a.state_dict()["batches_served_in_epoch"] == 0
    order = [int(x) for x in a]  # the seed is drawn when the first epoch starts, as torch's
    torch.manual_seed(0)
    b = kuat.DataLoader(Items(10), shuffle=True)
    assert [int(x) for x in b] == order
    assert a.seed == b.seed and isinstance(a.seed, int)
