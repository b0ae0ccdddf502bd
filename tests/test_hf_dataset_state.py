"""A streamed ``datasets.IterableDataset``'s own ``state_dict()`` while a loader reads it.

``datasets`` documents resuming a loop with ``ds.state_dict()`` / ``ds.load_state_dict()``;
torch's DataLoader at ``num_workers=0`` iterates the user's object itself, so the recipe works
there. kuat reads a private copy; the user's object follows its progress
(``kuat.sources._hf_progress``): the state after the batches taken, and the resume from it,
are torch's, on the row path (a per-row collate) and the columnar path (the default collate).
"""

import pytest
import torch

import kuat

datasets = pytest.importorskip("datasets")
from datasets.distributed import split_dataset_by_node  # noqa: E402

B = 4


def rows_collate(rows):
    return {"a": torch.tensor([r["a"] for r in rows])}


def _base():
    return datasets.Dataset.from_dict({"a": list(range(42))}).to_iterable_dataset(num_shards=4)


def _double(batch):
    return {"a": [2 * x for x in batch["a"]]}


STREAMS = {
    "plain": _base,
    "batched map": lambda: _base().map(_double, batched=True, batch_size=3),
    "row map": lambda: _base().map(lambda r: {"a": r["a"] + 1}),
    "shuffle buffer": lambda: _base().shuffle(seed=1, buffer_size=5),
    "interleave": lambda: datasets.interleave_datasets(
        [_base(), _base().map(_double, batched=True)], probabilities=[0.5, 0.5], seed=2),
    "split by node": lambda: split_dataset_by_node(_base(), rank=1, world_size=2),
}
LOADERS = {"torch": (torch.utils.data.DataLoader, {"collate_fn": rows_collate}),
           "row path": (kuat.DataLoader, {"collate_fn": rows_collate}),
           "columnar": (kuat.DataLoader, {})}


def _run(loader_name, make, taken, epoch=0, **extra):
    """(the dataset's state after ``taken`` batches, the batches of a loop resumed from it)."""
    cls, kw = LOADERS[loader_name]
    ds = make()
    ds.set_epoch(epoch)
    it = iter(cls(ds, batch_size=B, **kw, **extra))
    for _ in range(taken):
        next(it)
    state = ds.state_dict()
    again = make()
    again.set_epoch(epoch)
    again.load_state_dict(state)
    return state, [b["a"].tolist() for b in cls(again, batch_size=B, **kw, **extra)]


@pytest.mark.filterwarnings("ignore:Loading a state dict of a shuffle buffer")
@pytest.mark.parametrize("stream", list(STREAMS))
@pytest.mark.parametrize("path", ["row path", "columnar"])
def test_the_datasets_own_state_follows_the_loader_as_under_torch(stream, path):
    for taken, epoch in ((3, 0), (1, 1)):
        expected = _run("torch", STREAMS[stream], taken, epoch)
        assert expected[1]  # (something left to read)
        assert _run(path, STREAMS[stream], taken, epoch) == expected, (taken, epoch)


def test_the_whole_epoch_read_and_an_untouched_dataset_answer_as_under_torch():
    # 0: never iterated; 11: every batch (42 rows, batch 4: the end read to fill the last);
    # 10 with drop_last: every batch kept, the end not read yet
    for taken, drop_last in ((0, False), (11, False), (10, True)):
        expected = _run("torch", _base, taken, drop_last=drop_last)
        for path in ("row path", "columnar"):
            assert _run(path, _base, taken, drop_last=drop_last) == expected, (path, taken)


def test_with_workers_the_users_object_is_not_read_as_under_torch():
    # torch's workers iterate copies: the user's object stays where it was; so does kuat's
    # (the batches differ by design: kuat splits a stream across workers by position)
    expected, _ = _run("torch", _base, 3, num_workers=2)
    for path in ("row path", "columnar"):
        assert _run(path, _base, 3, num_workers=2)[0] == expected


def test_a_state_asked_for_twice_and_a_deep_copy_of_the_dataset_agree():
    import copy

    ds = _base()
    it = iter(kuat.DataLoader(ds, batch_size=B))
    next(it), next(it)
    first = ds.state_dict()
    assert ds.state_dict() == first == copy.deepcopy(ds).state_dict()
    next(it)
    assert ds.state_dict() != first  # it moves on with the loader


def test_a_new_loader_or_a_process_worker_does_not_replay_the_stream(monkeypatch):
    import pickle

    from kuat.sources import _hf_progress

    ds = _base()
    for _ in kuat.DataLoader(ds, batch_size=B):
        pass
    replays = []
    state = _hf_progress.Replayed.state
    monkeypatch.setattr(_hf_progress.Replayed, "state",
                        lambda self: replays.append(self.rows) or state(self))
    # a second loader over the same object copies it without reading the stream again
    again = [b["a"].tolist() for b in kuat.DataLoader(ds, batch_size=B, num_workers=2,
                                                      worker_type="process")]
    assert sorted(sum(again, [])) == list(range(42)) and replays == []
    assert pickle.loads(pickle.dumps(ds))._state_dict is None and replays == []
    assert ds.state_dict() == _run("torch", _base, 11)[0] and replays == [None]


@pytest.mark.filterwarnings("ignore:Loading a state dict of a shuffle buffer")
@pytest.mark.parametrize("stream", ["plain", "batched map", "shuffle buffer"])
@pytest.mark.parametrize("path", ["row path", "columnar"])
def test_a_state_loaded_into_the_dataset_after_an_epoch_ran_resumes_there(stream, path):
    # datasets' recipe on one loader: part of an epoch read, ds.load_state_dict(state), the
    # loader read again. torch re-reads the object at its epoch and resumes; kuat's loader had
    # gone on to its epoch 1, where datasets drops a state of epoch 0 (the epoch read again
    # from its start: every row of the checkpoint's batches twice)
    def run(name):
        cls, kw = LOADERS[name]
        ds = STREAMS[stream]()
        loader = cls(ds, batch_size=B, **kw)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = ds.state_dict()
        del it
        ds.load_state_dict(state)
        return [b["a"].tolist() for b in loader]

    expected = run("torch")
    assert expected and len(expected) < 11
    assert run(path) == expected


@pytest.mark.parametrize("path", ["row path", "columnar"])
def test_a_state_saved_in_the_loaders_second_epoch_resumes_in_a_new_run(path):
    # without ds.set_epoch the loader's epochs still count (0, 1): ds.state_dict() in its
    # epoch 1 names epoch 1, and a fresh object given it (datasets' epoch 0) resumes there,
    # reading the rest of that epoch once: what datasets resumes from the state at its epoch
    cls, kw = LOADERS[path]
    ds = _base()
    loader = cls(ds, batch_size=B, **kw)
    assert sum(len(b["a"]) for b in loader) == 42
    it = iter(loader)
    first = [next(it)["a"].tolist() for _ in range(2)]
    state = ds.state_dict()
    assert state["epoch"] == 1
    again = _base()
    again.load_state_dict(state)
    got = [b["a"].tolist() for b in cls(again, batch_size=B, **kw)]

    ref = _base()
    ref.set_epoch(1)
    ref.load_state_dict(state)
    torch_kw = LOADERS["torch"][1]
    assert got == [b["a"].tolist() for b in torch.utils.data.DataLoader(ref, batch_size=B,
                                                                         **torch_kw)]
    whole = _base()
    whole.set_epoch(1)
    assert sorted(sum(first + got, [])) == sorted(
        sum((b["a"].tolist() for b in torch.utils.data.DataLoader(whole, batch_size=B,
                                                                  **torch_kw)), []))


RESUMED = {  # streams whose filter or map kuat runs only on the rows a resumed epoch keeps
    "filter": lambda: _base().filter(lambda r: r["a"] % 3 != 0),
    "row map": STREAMS["row map"],
    "remove_columns": lambda: _base().map(lambda r: {"b": r["a"]}).remove_columns(["a"])
    .rename_column("b", "a"),
}


@pytest.mark.parametrize("stream", list(RESUMED))
@pytest.mark.parametrize("path", ["row path", "columnar"])
def test_the_datasets_own_state_follows_a_loader_resumed_from_its_state_dict(stream, path):
    # kuat's own checkpoint (loader.state_dict) resumed on a new object, two more batches:
    # ds.state_dict() is then datasets' state after all the batches so far, as torch's after
    # as many (the resumed epoch read the filter/map past datasets' iteration, keeping none)
    make = RESUMED[stream]
    cls, kw = LOADERS[path]
    loader = cls(make(), batch_size=B, **kw)
    first = iter(loader)
    for _ in range(3):
        next(first)
    checkpoint = loader.state_dict()
    del first
    ds = make()
    resumed = cls(ds, batch_size=B, **kw)
    resumed.load_state_dict(checkpoint)
    it = iter(resumed)
    got = [next(it)["a"].tolist() for _ in range(2)]
    expected = _run("torch", make, 5)
    assert got == _run("torch", make, 3)[1][:2]
    assert (ds.state_dict(), _run_from(path, make, ds.state_dict())) == expected


def _run_from(loader_name, make, state):
    cls, kw = LOADERS[loader_name]
    again = make()
    again.load_state_dict(state)
    return [b["a"].tolist() for b in cls(again, batch_size=B, **kw)]


@pytest.mark.parametrize("stream", ["plain", "row map", "batched map", "interleave", "split by node"])
@pytest.mark.parametrize("path", ["row path", "columnar"])
def test_a_loader_state_and_the_datasets_own_state_both_loaded_resume_once(stream, path):
    # a checkpoint holding both (the loader's state_dict and ds.state_dict(), as datasets'
    # docs ask): torchdata's StatefulDataLoader, whose state holds the dataset's, resumes at
    # the position once; kuat skipped the served batches of a stream datasets had resumed.
    # (Not a shuffle buffer: datasets' own resume refills it, losing its rows; kuat's state
    # resumes it exactly, tests/test_hf_columnar.py)
    from torchdata.stateful_dataloader import StatefulDataLoader

    def run(cls, **kw):
        loader = cls(STREAMS[stream](), batch_size=B, **kw)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state, ds_state = loader.state_dict(), loader.dataset.state_dict()
        del it
        ds = STREAMS[stream]()
        resumed = cls(ds, batch_size=B, **kw)
        resumed.load_state_dict(state)
        ds.load_state_dict(ds_state)
        return [b["a"].tolist() for b in resumed]

    expected = run(StatefulDataLoader, collate_fn=rows_collate)
    whole = list(torch.utils.data.DataLoader(STREAMS[stream](), batch_size=B,
                                             collate_fn=rows_collate))
    assert expected and len(expected) == len(whole) - 3
    assert run(LOADERS[path][0], **LOADERS[path][1]) == expected
