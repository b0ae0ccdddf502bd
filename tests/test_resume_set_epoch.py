"""A training loop resumed from a checkpoint calls ``set_epoch(epoch)`` after
``load_state_dict`` (the HF Trainer on the prepared loader, a hand-written Accelerate loop):
the loaded position of that epoch stays, as it does for Accelerate's ``DataLoaderShard`` over
torchdata's ``StatefulDataLoader``; and under ``use_seedable_sampler`` the resumed epoch is
the uninterrupted one even before the sampler's first ``__iter__`` and under another global
seed. The uninterrupted epochs come from torch's DataLoader (prepared alike)."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader

import kuat

DS = list(range(22))


def ids(loader):
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("how", ["loader", "sampler"])
def test_set_epoch_after_load_keeps_the_loaded_position(num_workers, how):
    torch.manual_seed(0)
    torch_loader = TorchLoader(DS, batch_size=4, shuffle=True)
    want = [ids(torch_loader) for _ in range(2)][1]
    torch.manual_seed(0)
    loader = kuat.DataLoader(DS, batch_size=4, shuffle=True, num_workers=num_workers)
    ids(loader)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    del it
    torch.manual_seed(5)
    resumed = kuat.DataLoader(DS, batch_size=4, shuffle=True, num_workers=num_workers)
    resumed.load_state_dict(state)
    (resumed if how == "loader" else resumed.sampler).set_epoch(1)
    assert head + ids(resumed) == want
    resumed.set_epoch(3)  # another epoch: that one, from its start
    assert len(ids(resumed)) == len(want)


accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402


def _prepared(cls):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return accelerate.Accelerator(dataloader_config=config).prepare(
            cls(DS, batch_size=4, shuffle=True))


@pytest.mark.parametrize("set_epoch_first", [False, True])
def test_seedable_sampler_resumes_its_epoch(set_epoch_first):
    torch.manual_seed(0)
    torch_loader = _prepared(TorchLoader)
    want = []
    for epoch in range(2):
        torch_loader.set_epoch(epoch)
        want.append(ids(torch_loader))
    torch.manual_seed(0)
    loader = _prepared(kuat.DataLoader)
    loader.set_epoch(0)
    assert ids(loader) == want[0] and len(loader) == len(torch_loader)  # 22 rows: a short last
    loader.set_epoch(1)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    del it
    torch.manual_seed(123)  # another initial seed: the sampler's own is in the state
    resumed = _prepared(kuat.DataLoader)
    if set_epoch_first:
        resumed.set_epoch(1)
    resumed.load_state_dict(state)  # before the sampler made its generator (first __iter__)
    resumed.set_epoch(1)
    assert head + ids(resumed) == want[1]
