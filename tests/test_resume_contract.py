"""The exact-resume contract (kuat.testing.check_resume) on every source type and worker mode."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import kuat
from kuat.testing import assert_same_batch, check_resume

datasets = pytest.importorskip("datasets")

N = 22  # samples per source; batch 4 -> 6 batches per epoch (the last one short)


class Augmented(torch.utils.data.Dataset):
    """A torch map-style dataset whose samples carry per-sample random draws."""

    kuat_uses_sample_rng = True

    def __init__(self, n=N, offset=0):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = kuat.sample_rng(i).numpy
        return {"id": self.offset + i, "aug": torch.from_numpy(rng.random(3))}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    with kuat.Writer(
        root / "ds.kuat", {"id": kuat.format.int64(), "seq": kuat.format.sequence("int32")}
    ) as w:
        for i in range(N):
            w.write({"id": 1000 + i, "seq": np.arange(i % 5 + 1, dtype=np.int32)})
    hf = datasets.Dataset.from_dict({"id": list(range(2000, 2000 + N))}).with_format("torch")
    stream = datasets.Dataset.from_dict({"id": list(range(3000, 3000 + N))}).to_iterable_dataset(
        num_shards=3
    )
    return {
        "torch_map": Augmented(),
        "kuat": kuat.open(root / "ds.kuat"),
        "hf_map": hf.shuffle(seed=1),
        "hf_stream": stream.shuffle(seed=2, buffer_size=4),
        "mix_map": kuat.mix([Augmented(offset=500), hf], weights=[2, 1], stopping="all_exhausted"),
        "mix_stream": kuat.mix(
            [stream, Augmented(offset=600)], stopping="all_exhausted", shuffle_buffer=5
        ),
    }


def _collate(samples):
    """Ids stacked; other fields (ragged, or absent from another source of a mix) listed."""
    out = {"id": torch.stack([torch.as_tensor(s["id"]) for s in samples])}
    for key in ("aug", "seq"):
        if any(key in s for s in samples):
            out[key] = [torch.as_tensor(s[key]) if key in s else None for s in samples]
    return out


def _factory(source, num_workers, worker_type="thread"):
    iterable = isinstance(kuat.sources.as_source(source), torch.utils.data.IterableDataset)

    def make():
        return kuat.DataLoader(
            source,
            batch_size=4,
            shuffle=None if iterable else True,
            num_workers=num_workers,
            worker_type=worker_type,
            collate_fn=_collate,
            seed=7,
        )

    return make


# before the first batch, mid-epoch, end of epoch 0, in epoch 1, end of the run
BATCHES_PER_EPOCH = {"mix_map": 11, "mix_stream": 11}  # 44 samples; the others have 22


def _midpoints(name):
    n = BATCHES_PER_EPOCH.get(name, 6)
    return [0, 1, n, n + 2, 2 * n]


@pytest.mark.parametrize(
    "name", ["torch_map", "kuat", "hf_map", "hf_stream", "mix_map", "mix_stream"]
)
def test_resume_threads_other_worker_count(sources, name):
    ref = check_resume(
        _factory(sources[name], 2),
        _midpoints(name),
        epochs=2,
        make_resumed=_factory(sources[name], 3),
    )
    ids = [int(x) for b in ref for x in b["id"]]
    per_epoch = 2 * N if name.startswith("mix") else N
    assert len(ids) == 2 * per_epoch and len(set(ids[:per_epoch])) == per_epoch  # once per epoch


@pytest.mark.parametrize("name", ["torch_map", "hf_map", "hf_stream", "mix_stream"])
def test_resume_inline_and_same_worker_count(sources, name):
    check_resume(_factory(sources[name], 0), [3, 6], epochs=2)
    check_resume(_factory(sources[name], 2), [5], epochs=2)


@pytest.mark.parametrize("name", ["kuat", "hf_map", "hf_stream"])
def test_resume_processes_then_threads(sources, name):
    check_resume(
        _factory(sources[name], 2, "process"),
        [4, 7],
        epochs=2,
        make_resumed=_factory(sources[name], 1, "thread"),
    )


def test_hundred_samples_two_epochs_then_two_more():
    """range(100), batch 1, shuffle: 2 epochs, save, new loader, load, 2 more == 4 epochs."""

    def make():
        return kuat.DataLoader(list(range(100)), batch_size=1, shuffle=True, seed=3)

    ref = check_resume(make, [200], epochs=4)
    assert len(ref) == 400
    loader = make()
    for _ in zip(range(150), loader):
        pass
    assert len(pickle.dumps(loader.state_dict())) < 400  # a handful of ints
    epochs = [[int(b) for b in ref[i : i + 100]] for i in range(0, 400, 100)]
    assert all(sorted(e) == list(range(100)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4


def test_check_resume_catches_a_loader_that_does_not_resume():
    class Forgetful:
        """Resumes at the start of the epoch: the contract must fail."""

        def __init__(self):
            self.inner = kuat.DataLoader(list(range(10)), batch_size=2, seed=1)

        def __iter__(self):
            return iter(self.inner)

        def state_dict(self):
            return {"epoch": 0}

        def load_state_dict(self, state):
            pass

    with pytest.raises(AssertionError, match="midpoint 2"):
        check_resume(Forgetful, [2])


def test_assert_same_batch_names_the_path():
    with pytest.raises(AssertionError, match=r"b\['x'\]\[1\]: dtype"):
        assert_same_batch(
            {"x": [1, torch.zeros(2)]}, {"x": [1, torch.zeros(2, dtype=torch.int64)]}, "b"
        )


@pytest.mark.parametrize("name", ["hf_stream", "mix_map"])
def test_resume_with_persistent_workers(sources, name):
    def make():
        iterable = isinstance(
            kuat.sources.as_source(sources[name]), torch.utils.data.IterableDataset
        )
        return kuat.DataLoader(
            sources[name],
            batch_size=4,
            shuffle=None if iterable else True,
            num_workers=2,
            persistent_workers=True,
            collate_fn=_collate,
            seed=7,
        )

    check_resume(make, _midpoints(name)[1:4], epochs=3)
