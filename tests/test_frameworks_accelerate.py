"""kuat.DataLoader inside Hugging Face Accelerate (issue #10), each against torch's loader.

Single-process tests run here (CPU); the 2- and 4-rank rows (Accelerate's sharding applied to
kuat's loader) are in tests/test_frameworks_accelerate_ranks.py, and a torchrun launch in
``tests/_torchrun_script.py`` (see tests/test_frameworks_torchrun.py).
"""

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader

import kuat

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class Halved:
    """40 ints; the batch transform (run by kuat's loader after collation) makes them float."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor(i)

    @staticmethod
    def kuat_batch_transform(batch):
        return batch.float() / 2  # (B,) int64 -> (B,) float32


def ids(batches):
    return [b.tolist() for b in batches]


def test_prepare_returns_the_kuat_loader_and_its_engine_serves():
    accelerator = Accelerator(cpu=True)
    loader = kuat.DataLoader(Halved(), batch_size=4, shuffle=True, seed=2, num_workers=2)
    prepared = accelerator.prepare(loader)
    torch_prepared = accelerator.prepare(TorchLoader(list(range(40)), batch_size=4))
    assert prepared is loader
    got = ids(prepared)
    assert len(got) == len(ids(torch_prepared)) == 10
    assert sorted(x * 2 for b in got for x in b) == list(range(40))
    assert loader.stats()["batches"] == 10


def test_skip_first_batches_keeps_engine_transform_and_order():
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(kuat.DataLoader(Halved(), batch_size=4, shuffle=True, seed=2, num_workers=2))
    epoch0 = list(loader)
    epoch1 = list(loader)
    reference = kuat.DataLoader(Halved(), batch_size=4, shuffle=True, seed=2)
    assert ids(epoch0) == ids(reference) and ids(epoch1) == ids(reference)  # epochs 0 and 1
    loader.load_state_dict({**loader.state_dict(), "epoch": 1, "batches_served_in_epoch": 0})
    before = loader.stats()["batches"]
    skipped = accelerator.skip_first_batches(loader, 3)
    torch_skipped = accelerator.skip_first_batches(TorchLoader(Halved(), batch_size=4), 3)
    assert isinstance(skipped, kuat.DataLoader) and len(skipped) == len(torch_skipped) == 7
    rest = list(skipped)
    assert ids(rest) == ids(epoch1)[3:]  # epoch 1's order, from its 4th batch
    assert all(b.dtype == torch.float32 for b in rest)  # the batch transform ran
    assert loader.stats()["batches"] - before == 7  # kuat's engine served them
    assert loader.state_dict()["epoch"] == 2  # and the original loader follows on


def test_save_state_and_load_state_resume_exactly(tmp_path):
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(kuat.DataLoader(list(range(40)), batch_size=4, shuffle=True, seed=5, num_workers=2))
    it = iter(loader)
    head = [next(it).tolist() for _ in range(3)]
    accelerator.save_state(str(tmp_path / "ckpt"))
    rest = ids(it)

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)  # a new run
    resumed = accelerator.prepare(kuat.DataLoader(list(range(40)), batch_size=4, shuffle=True, seed=99))
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert ids(resumed) == rest
    assert sorted(x for b in head + rest for x in b) == list(range(40))


def _sync_steps(accelerator, loader) -> list[int]:
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    synced = []
    for step, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(batch.float().view(-1, 1)).sum()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                synced.append(step)
    return synced


def test_gradient_accumulation_steps_on_the_last_partial_window():
    data = list(range(40))  # 10 batches of 4; windows of 4 -> steps after batches 3, 7 and 9
    expected = _sync_steps(Accelerator(cpu=True, gradient_accumulation_steps=4), TorchLoader(data, batch_size=4))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    got = _sync_steps(Accelerator(cpu=True, gradient_accumulation_steps=4),
                      kuat.DataLoader(data, batch_size=4, num_workers=2))
    assert expected == [3, 7, 9]
    assert got == expected


def test_split_batches_as_accelerate_and_refused_only_where_kuat_shards_itself():
    """One process: Accelerate changes nothing (torch's batches, the loader itself); a loader
    sharded by kuat (rank=/world_size=) keeps its share, so split_batches is refused, naming it;
    dispatch_batches=True is refused for every kuat loader (each rank reads its own batches)."""
    from accelerate import DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    loader = kuat.DataLoader(list(range(10)), batch_size=4)
    assert accelerator.prepare(loader) is loader
    assert ids(loader) == ids(accelerator.prepare(TorchLoader(list(range(10)), batch_size=4)))
    with pytest.raises(ValueError, match="split_batches"):
        accelerator.prepare(kuat.DataLoader(list(range(8)), batch_size=4, rank=0, world_size=2))
    config = DataLoaderConfiguration(dispatch_batches=True)
    with pytest.raises(ValueError, match="dispatch_batches"):
        Accelerator(cpu=True, dataloader_config=config).prepare(kuat.DataLoader(list(range(8)), batch_size=4))


def test_even_batches_false_and_seedable_sampler_are_applied_not_ignored(caplog):
    """Accelerate's own code decides (tests/test_frameworks_accelerate_ranks.py shows the
    shares on 2 ranks); kuat no longer logs that it ignores them."""
    from accelerate import DataLoaderConfiguration

    config = DataLoaderConfiguration(even_batches=False, use_seedable_sampler=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    with caplog.at_level("WARNING", logger="kuat"):
        loader = accelerator.prepare(kuat.DataLoader(list(range(25)), batch_size=4, shuffle=True, seed=1))
        assert sorted(x for b in ids(loader) for x in b) == list(range(25))
    assert not [r for r in caplog.records if "ignore" in r.getMessage()]


def test_seedable_sampler_on_one_process_replaces_kuats_random_sampler_as_torchs():
    """use_seedable_sampler (the HF Trainer's default) on one process: Accelerate swaps torch's
    RandomSampler for its SeedableRandomSampler; kuat's (shuffle=True, no seed=) is one too."""
    from accelerate import DataLoaderConfiguration
    from accelerate.utils import set_seed

    def epochs(cls):
        set_seed(3)
        config = DataLoaderConfiguration(use_seedable_sampler=True)
        loader = Accelerator(cpu=True, dataloader_config=config).prepare(
            cls(list(range(12)), batch_size=4, shuffle=True))
        out = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            out.append(ids(loader))
        return out, loader

    expected, _ = epochs(TorchLoader)
    got, loader = epochs(kuat.DataLoader)
    assert got == expected and expected[0] != expected[1]
    assert isinstance(loader, kuat.DataLoader) and loader.stats()["batches"] == 6


class Stream(torch.utils.data.IterableDataset):
    """40 ints, no length: the end of data is known only by reading one batch ahead."""

    def __iter__(self):
        return iter(range(40))


def test_gradient_accumulation_steps_on_the_last_window_of_a_stream():
    expected = _sync_steps(Accelerator(cpu=True, gradient_accumulation_steps=4), TorchLoader(Stream(), batch_size=4))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    loader = kuat.DataLoader(Stream(), batch_size=4)
    got = _sync_steps(Accelerator(cpu=True, gradient_accumulation_steps=4), loader)
    assert expected == [3, 7, 9]
    assert got == expected
    assert loader.state_dict()["epoch"] == 1 and loader.stats()["batches"] == 10


# Each order in a fresh interpreter: the names Accelerate exports are bound before (or after)
# kuat is imported and before any kuat loader exists. The right batches come from Accelerate's
# own skip_first_batches over torch's loader (unshuffled), through the batch transform.
_ORDER_SCRIPT = """
import sys
import torch
{before}
import kuat
{after}
from torch.utils.data import DataLoader as TorchLoader
import accelerate.data_loader as adl

class Halved:
    def __len__(self):
        return 40
    def __getitem__(self, i):
        return torch.tensor(i)
    @staticmethod
    def kuat_batch_transform(batch):
        return batch.float() / 2

loader = kuat.DataLoader(Halved(), batch_size=4, num_workers=2)
{after_loader}
epoch0 = [b.tolist() for b in loader]
prepared = prepare_data_loader(loader)
assert prepared is loader, type(prepared)
skipped = skip_first_batches(loader, 3)
assert isinstance(skipped, kuat.DataLoader), type(skipped)
rest = list(skipped)
assert all(b.dtype == torch.float32 for b in rest), [b.dtype for b in rest]
expected = [(b.float() / 2).tolist() for b in adl.skip_first_batches(TorchLoader(Halved(), batch_size=4), 3)]
assert [b.tolist() for b in rest] == expected == epoch0[3:], ([b.tolist() for b in rest], expected)
assert loader.state_dict()["epoch"] == 2  # the epoch that ended was not replayed
other = adl.prepare_data_loader(TorchLoader(Halved(), batch_size=4))  # other loaders: Accelerate's
assert type(other).__name__ == "DataLoaderShard", type(other)
print("ok")
"""

_NAMES = "from accelerate import skip_first_batches\nfrom accelerate.data_loader import prepare_data_loader"
_ORDERS = {  # where the names are imported: before kuat, after kuat, after the first loader
    "names-before-kuat": (_NAMES, "", ""),
    "accelerate-after-kuat": ("", _NAMES, ""),
    "accelerate-after-first-loader": ("", "", _NAMES),
}


@pytest.mark.parametrize("order", sorted(_ORDERS))
def test_integration_does_not_depend_on_import_order(order):
    import os
    import subprocess
    import sys

    before, after, after_loader = _ORDERS[order]
    script = _ORDER_SCRIPT.format(before=before, after=after, after_loader=after_loader)
    if not before:  # kuat first: accelerate must not be loaded by `import kuat` itself
        script = script.replace("import kuat\n", "import kuat\nassert 'accelerate' not in sys.modules\n", 1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_routed_functions_keep_accelerate_signature():
    import inspect

    import accelerate.data_loader as adl

    kuat.DataLoader(Halved(), batch_size=4)  # installs (already installed by `import kuat`)
    assert adl.skip_first_batches.__kuat_dispatch__
    params = list(inspect.signature(adl.prepare_data_loader).parameters)
    assert params[:2] == ["dataloader", "device"] and "even_batches" in params
