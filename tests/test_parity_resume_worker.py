"""A map-style epoch resumed mid-way sends each batch to the worker the uninterrupted epoch
sent it to (batch k to worker k % num_workers, as torchdata's StatefulDataLoader resumes its
worker cycle), so data that depends on the worker comes out the same."""

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import kuat


class WorkerTagged(torch.utils.data.Dataset):
    """Sample ``i`` is ``(i, id of the worker that read it)``."""

    def __len__(self):
        return 18

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return torch.tensor([i, -1 if info is None else info.id])


def _rest(cls, served, **kw):
    loader = cls(WorkerTagged(), batch_size=2, **kw)
    it = iter(loader)
    for _ in range(served):
        next(it)
    state = loader.state_dict()
    del it
    resumed = cls(WorkerTagged(), batch_size=2, **kw)
    resumed.load_state_dict(state)
    return [b.tolist() for b in resumed]


@pytest.mark.parametrize("worker_type", ["thread", "process"])
@pytest.mark.parametrize("num_workers,served", [(2, 1), (3, 2), (3, 4)])
def test_resumed_batches_come_from_the_workers_they_came_from(worker_type, num_workers, served):
    whole = [b.tolist() for b in StatefulDataLoader(WorkerTagged(), batch_size=2, num_workers=num_workers)]
    expected = _rest(StatefulDataLoader, served, num_workers=num_workers)
    assert expected == whole[served:]  # torchdata's resume: the same workers
    got = _rest(kuat.DataLoader, served, num_workers=num_workers, worker_type=worker_type,
                prefetch_factor=2)
    assert got == expected
