"""Streaming HF datasets are never pickled where torch needs no pickling (issue #18.2).

torch's DataLoader iterates a ``datasets.IterableDataset`` built with lambdas or a local
generator at ``num_workers=0`` (and its worker processes under ``fork``); kuat's inline and
thread workers must too. Only process workers that pickle (``spawn``) may fail, with pickle's
own error as torch's does.
"""

from __future__ import annotations

import pytest
import torch

import kuat

datasets = pytest.importorskip("datasets")


def _streams():
    def gen():  # a local function: not picklable
        for i in range(12):
            yield {"x": i, "y": float(i) / 2}

    from_gen = datasets.IterableDataset.from_generator(gen)
    mapped = (
        datasets.Dataset.from_dict({"x": list(range(12))})
        .to_iterable_dataset(num_shards=2)
        .map(lambda e: {"x": e["x"] * 10})
        .filter(lambda e: e["x"] % 20 == 0)
    )
    return {"from_generator": from_gen, "map_filter": mapped}


def _flat(batches) -> list:
    out = []
    for b in batches:
        out.extend(b["x"].tolist())
    return out


@pytest.mark.parametrize("name", ["from_generator", "map_filter"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_lambda_streams_iterate_without_pickling(name, num_workers):
    ds = _streams()[name]
    expected = _flat(torch.utils.data.DataLoader(ds, batch_size=4))  # torch, in-process
    loader = kuat.DataLoader(ds, batch_size=4, num_workers=num_workers)
    for _ in range(2):  # every epoch copies the dataset again
        got = _flat(loader)
        assert sorted(got) == sorted(expected)
        assert len(got) == len(expected)


@pytest.mark.filterwarnings("ignore:Got pickle error")  # torch's hint, around the same error
def test_spawned_process_workers_fail_as_torch_does():
    ds = _streams()["map_filter"]
    with pytest.raises(Exception) as torch_err:
        next(
            iter(
                torch.utils.data.DataLoader(
                    ds, batch_size=4, num_workers=1, multiprocessing_context="spawn"
                )
            )
        )
    loader = kuat.DataLoader(
        ds, batch_size=4, num_workers=1, worker_type="process", multiprocessing_context="spawn"
    )
    with pytest.raises(type(torch_err.value)) as kuat_err:
        next(iter(loader))
    assert "<lambda>" in str(torch_err.value) and "<lambda>" in str(kuat_err.value)
