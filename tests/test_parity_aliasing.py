"""Parity with torch: editing a batch in place never reaches the dataset (issue #11, item 1).

torch's collate stacks a copy; kuat returns a view only of buffers it allocated for that batch.
Each case runs torch's DataLoader and kuat's on fresh copies of the same data, edits every batch
in place, and compares the batches and what is left of the data.
"""

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import TensorDataset

import kuat
import kuat.format as kf

MODES = [(0, "thread"), (2, "thread"), (2, "process")]


class NumpyViews(torch.utils.data.Dataset):
    """Rows of one array: each sample is a view (``x[i]``), consecutive in a sequential batch."""

    def __init__(self, x):
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": i}


def _edit_all(loader) -> list:
    seen = []
    for batch in loader:
        xb = batch[0] if isinstance(batch, (list, tuple)) else batch["x"]
        xb.sub_(100)  # the training loop edits its batch in place
        seen.append(xb.clone())
    return seen


def _both(make_data, read_back, workers, wtype, **kw):
    """(torch's batches, torch's data after), (kuat's ...), each on its own fresh data."""
    out = []
    for build in (
        lambda ds: TorchLoader(ds, batch_size=4, num_workers=workers, **kw),
        lambda ds: kuat.DataLoader(ds, batch_size=4, num_workers=workers, worker_type=wtype, **kw),
    ):
        data, ds = make_data()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only arrays: torch warns alike
            batches = _edit_all(build(ds))
        out.append((batches, read_back(data)))
    return out


def _same(a, b):
    (ba, da), (bb, db) = a, b
    assert len(ba) == len(bb) and all(torch.equal(x, y) for x, y in zip(ba, bb))
    assert np.array_equal(da, db)


@pytest.mark.parametrize("workers,wtype", MODES)
def test_tensor_dataset_is_unchanged_by_in_place_batch_edits(workers, wtype):
    def make():
        t = torch.arange(24).reshape(8, 3)
        return t, TensorDataset(t)

    torch_side, kuat_side = _both(make, lambda t: t.numpy().copy(), workers, wtype)
    assert torch_side[1][0].tolist() == [0, 1, 2]  # torch: the dataset is untouched
    _same(torch_side, kuat_side)


@pytest.mark.parametrize("workers,wtype", MODES)
def test_numpy_views_are_unchanged_by_in_place_batch_edits(workers, wtype):
    def make():
        x = np.arange(32, dtype=np.int64).reshape(8, 4)
        return x, NumpyViews(x)

    _same(*_both(make, lambda x: x.copy(), workers, wtype))


@pytest.mark.parametrize("workers,wtype", MODES)
def test_writable_memory_maps_are_unchanged_by_in_place_batch_edits(workers, wtype, tmp_path):
    counter = iter(range(2))

    def make():
        path = tmp_path / f"x{next(counter)}.npy"
        np.save(path, np.arange(32, dtype=np.float32).reshape(8, 4))
        x = np.load(path, mmap_mode="r+")
        return path, NumpyViews(x)

    _same(*_both(make, lambda p: np.load(p), workers, wtype))


@pytest.mark.parametrize("workers,wtype", MODES)
def test_read_only_memory_maps_are_never_handed_out(workers, wtype, tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.arange(32, dtype=np.float32).reshape(8, 4))

    def make():
        return None, NumpyViews(np.load(path, mmap_mode="r"))

    # torch copies (the edit works on a copy); kuat must too (an alias would fault: read-only)
    _same(*_both(make, lambda _: np.load(path), workers, wtype))


@pytest.mark.parametrize("workers,wtype", MODES)
def test_kuat_dataset_batches_are_the_batchs_own_memory(workers, wtype, tmp_path):
    x = np.arange(8 * 4, dtype=np.int32).reshape(8, 4)
    with kuat.Writer(tmp_path / "ds", {"x": kf.tensor((4,), "int32"), "y": kf.int64()}) as w:
        w.write_batch({"x": x, "y": np.arange(8)})

    def make():
        return None, kuat.open(tmp_path / "ds")

    torch_side, kuat_side = _both(make, lambda _: kuat.open(tmp_path / "ds").read_batch(
        range(8))["x"], workers, wtype)
    _same(torch_side, kuat_side)
    assert np.array_equal(kuat_side[1], x)
