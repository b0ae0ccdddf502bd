"""The same scenarios through torch's DataLoader and kuat's, compared exactly (or as multisets
per epoch where the order is random)."""

import collections
import math

import numpy as np
import pytest
import torch
from _same import assert_same
from torch.utils.data import BatchSampler, IterableDataset, get_worker_info
from torch.utils.data import DataLoader as TorchLoader

import kuat

Pair = collections.namedtuple("Pair", "a b")
MODES = [dict(num_workers=0), dict(num_workers=2), dict(num_workers=2, worker_type="process")]
MODE_IDS = ["inline", "threads", "processes"]


class Rich:
    """Nested dicts, namedtuples, NumPy arrays, Python numbers and strings."""

    def __len__(self):
        return 11

    def __getitem__(self, i):
        return {
            "t": torch.arange(4, dtype=torch.float32) * i,
            "np": np.full((2, 2), i, dtype=np.int16),
            "int": i,
            "float": i / 3,
            "str": f"item-{i}",
            "pair": Pair(i, torch.tensor([i, 2 * i])),
            "list": [i, np.float64(i) / 2],
            "nested": {"deep": (torch.tensor(i % 3, dtype=torch.uint8), "x")},
        }


class WithGetitems(Rich):
    def __init__(self):
        self.calls = 0

    def __getitems__(self, indices):
        return [self[i] for i in indices]


def both(dataset, mode, epochs=1, **kw):
    ours = kuat.DataLoader(dataset, **mode, **kw)
    theirs = TorchLoader(dataset, **kw)
    got = [list(ours) for _ in range(epochs)]
    want = [list(theirs) for _ in range(epochs)]
    try:
        want_len = len(theirs)
    except TypeError:
        with pytest.raises(TypeError):
            len(ours)
    else:
        assert len(ours) == want_len
    return got, want


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_rich_structures_batched(mode, drop_last):
    got, want = both(Rich(), mode, batch_size=4, drop_last=drop_last)
    assert_same(got, want)


@pytest.mark.parametrize("mode", MODES[:2], ids=MODE_IDS[:2])
def test_getitems_and_no_batching(mode):
    got, want = both(WithGetitems(), mode, batch_size=3)
    assert_same(got, want)
    got, want = both(Rich(), mode, batch_size=None)
    assert_same(got, want)


def _collate_pairs(samples):
    return [s["int"] for s in samples], torch.stack([s["t"] for s in samples]).sum(0)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_custom_collate_sampler_and_batch_sampler(mode):
    got, want = both(Rich(), mode, batch_size=3, collate_fn=_collate_pairs)
    assert_same(got, want)
    order = [5, 3, 9, 0, 1, 10]
    got, want = both(Rich(), mode, batch_size=2, sampler=order)
    assert_same(got, want)
    bs = BatchSampler(list(reversed(range(11))), batch_size=4, drop_last=False)
    got, want = both(Rich(), mode, batch_sampler=bs)
    assert_same(got, want)


@pytest.mark.parametrize("mode", MODES[:2], ids=MODE_IDS[:2])
def test_shuffle_is_a_permutation_per_epoch(mode):
    ours = kuat.DataLoader(list(range(23)), batch_size=4, shuffle=True, **mode)
    theirs = TorchLoader(list(range(23)), batch_size=4, shuffle=True)
    for _ in range(2):
        a = sorted(x for b in ours for x in b.tolist())
        b = sorted(x for b in theirs for x in b.tolist())
        assert a == b == list(range(23))


@pytest.mark.parametrize("mode", MODES[:2], ids=MODE_IDS[:2])
def test_shuffle_with_a_generator_gives_torchs_exact_order(mode):
    ours = kuat.DataLoader(list(range(23)), batch_size=4, shuffle=True,
                           generator=torch.Generator().manual_seed(9), **mode)
    theirs = TorchLoader(list(range(23)), batch_size=4, shuffle=True,
                         generator=torch.Generator().manual_seed(9))
    for _ in range(3):
        assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]


class Unsharded(IterableDataset):
    def __iter__(self):
        return iter(range(7))


class Sharded(IterableDataset):
    def __init__(self, n=12):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


class ShardedWithLen(Sharded):
    def __len__(self):
        return self.n


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_iterable_sharded_round_robin_like_torch(worker_type):
    ours = kuat.DataLoader(Sharded(), batch_size=2, num_workers=2, worker_type=worker_type)
    theirs = TorchLoader(Sharded(), batch_size=2, num_workers=2)
    assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]


def test_iterable_unsharded_duplicates_per_worker_like_torch():
    ours = kuat.DataLoader(Unsharded(), batch_size=3, num_workers=2)
    theirs = TorchLoader(Unsharded(), batch_size=3, num_workers=2)
    a = sorted(x for b in ours for x in b.tolist())
    b = sorted(x for b in theirs for x in b.tolist())
    assert a == b == sorted(list(range(7)) * 2)
    got, want = both(Unsharded(), dict(num_workers=0), batch_size=3, drop_last=True)
    assert_same(got, want)


@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_with_len(drop_last):
    for bs in (None, 5) if not drop_last else (5,):
        got, want = both(ShardedWithLen(12), dict(num_workers=0), batch_size=bs, drop_last=drop_last)
        assert_same(got, want)
        n = len(kuat.DataLoader(ShardedWithLen(12), batch_size=bs, drop_last=drop_last))
        assert n == (12 if bs is None else (12 // 5 if drop_last else math.ceil(12 / 5)))


INVALID = [
    dict(num_workers=-1),
    dict(timeout=-1),
    dict(prefetch_factor=2),
    dict(num_workers=1, prefetch_factor=-1),
    dict(persistent_workers=True),
    dict(sampler=[0, 1], shuffle=True),
    dict(batch_sampler=[[0]], batch_size=2),
    dict(batch_sampler=[[0]], drop_last=True),
    dict(batch_size=None, drop_last=True),
    dict(multiprocessing_context="fork"),
    dict(num_workers=1, multiprocessing_context="nope"),
    dict(num_workers=1, multiprocessing_context=3),
]


@pytest.mark.parametrize("kwargs", INVALID, ids=[str(k) for k in INVALID])
def test_invalid_arguments_raise_torchs_errors(kwargs):
    with pytest.raises((ValueError, TypeError)) as theirs:
        TorchLoader(list(range(4)), **kwargs)
    with pytest.raises(type(theirs.value)) as ours:
        kuat.DataLoader(list(range(4)), **kwargs)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("kwargs", [dict(shuffle=True), dict(sampler=[0]), dict(batch_sampler=[[0]])])
def test_iterable_dataset_rejects_sampling_options_like_torch(kwargs):
    with pytest.raises(ValueError) as theirs:
        TorchLoader(Unsharded(), **kwargs)
    with pytest.raises(ValueError) as ours:
        kuat.DataLoader(Unsharded(), **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_attributes_cannot_be_set_after_init_like_torch():
    dl = kuat.DataLoader(list(range(4)), batch_size=2)
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        dl.batch_size = 3
    assert dl.batch_size == 2 and dl.drop_last is False and dl.num_workers == 0


def test_generic_subscript_as_torch():
    # torch's DataLoader is Generic[T_co]: annotations such as ``DataLoader[dict]`` are evaluated
    # at import time by modules that use them, and calling the alias builds a loader.
    import typing

    for args in (dict, tuple[torch.Tensor, int]):
        ours, theirs = kuat.DataLoader[args], TorchLoader[args]
        assert typing.get_origin(ours) is kuat.DataLoader
        assert typing.get_args(ours) == typing.get_args(theirs)

    def annotated(loader: kuat.DataLoader[dict]) -> kuat.DataLoader[dict]:
        return loader

    assert typing.get_type_hints(annotated)["loader"] == kuat.DataLoader[dict]
    loader = kuat.DataLoader[int](list(range(5)), batch_size=2)
    assert isinstance(loader, kuat.DataLoader)
    assert_same(list(loader), list(TorchLoader[int](list(range(5)), batch_size=2)))
    with pytest.raises(TypeError) as theirs_error:
        TorchLoader[int, str]
    with pytest.raises(TypeError) as ours_error:
        kuat.DataLoader[int, str]
    assert type(ours_error.value) is type(theirs_error.value)
