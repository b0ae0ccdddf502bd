"""Thread engine: per-thread get_worker_info() across concurrent loaders, skip on iterables."""

import threading
import warnings

import torch
from torch.utils.data import IterableDataset, get_worker_info

import kuat


class WhoAmI(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        for k in range(self.n):
            yield (info.id, info.num_workers, threading.current_thread().name, k)


def test_two_loaders_iterated_together_each_see_their_own_workers():
    a = kuat.DataLoader(WhoAmI(3), batch_size=None, num_workers=2)
    b = kuat.DataLoader(WhoAmI(3), batch_size=None, num_workers=3)
    seen_a, seen_b = [], []
    for x, y in zip(a, b):
        seen_a.append(x)
        seen_b.append(y)
    assert {s[1] for s in seen_a} == {2} and {s[1] for s in seen_b} == {3}
    assert all(s[2] == f"kuat-worker-{s[0]}" for s in seen_a + seen_b)
    assert get_worker_info() is None


class FlakyIterator(IterableDataset):
    """An iterator (not a generator) that fails on some items and goes on."""

    def __iter__(self):
        return _Flaky()


class _Flaky:
    def __init__(self):
        self.k = -1

    def __iter__(self):
        return self

    def __next__(self):
        self.k += 1
        if self.k >= 10:
            raise StopIteration
        if self.k in (2, 3, 7):
            raise ValueError(f"item {self.k} is corrupt")
        return torch.tensor(self.k)


def test_skip_on_an_iterable_drops_failing_items():
    dl = kuat.DataLoader(FlakyIterator(), batch_size=3, on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [b.tolist() for b in dl]
    assert got == [[0, 1, 4], [5, 6, 8], [9]]
    assert dl.stats()["skipped_samples"] == 3
    assert sum("skipped sample" in str(w.message) for w in caught) == 1
