"""Thread workers of an IterableDataset that do not wait for another worker's long hold of the
global generators (kuat.engine.worker_rng.own_stream): a batch fetched meanwhile is warned
about only if the generators changed by a draw, not by the other worker swapping its own states
in or out (which changes them without a draw)."""

from __future__ import annotations

import logging
import threading

import torch

import kuat
from kuat.engine import worker_rng

WARNING = "changed meanwhile"


class TwoWorkers(torch.utils.data.IterableDataset):
    """Worker 0's first item holds its batch (its generators swapped in, the lock held) until
    worker 1's first item has started; worker 1's first item returns after worker 0's batch
    ended (its second item started): worker 0 swapped its states out during worker 1's item.
    Neither draws."""

    def __init__(self):
        self.b_started, self.a_next = threading.Event(), threading.Event()

    def __iter__(self):
        if torch.utils.data.get_worker_info().id == 0:
            self.b_started.wait(10)
            yield torch.tensor([0])
            self.a_next.set()
            yield torch.tensor([2])
        else:
            self.b_started.set()
            self.a_next.wait(10)
            yield torch.tensor([1])
            yield torch.tensor([3])


def _run(ds, monkeypatch, caplog):
    monkeypatch.setattr(worker_rng, "_warned_unowned", False)
    with caplog.at_level(logging.WARNING):
        got = [b.item() for b in kuat.DataLoader(ds, batch_size=None, num_workers=2,
                                                 worker_type="thread")]
    assert sorted(got) == [0, 1, 2, 3]
    return [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]


def test_another_workers_swap_is_not_a_draw(monkeypatch, caplog):
    assert _run(TwoWorkers(), monkeypatch, caplog) == []

