"""Loader features: ordering, prefetch bound, worker info, batch transform, zero copy, stats,
torchvision ImageFolder, pinning and CUDA copies (the CUDA tests run on a GPU machine)."""

import collections
import dataclasses
import os
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

import kuat
from kuat.collate import new_batch_buffer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Slowish:
    """Sample i takes longer for small i, so completion order differs from sampler order."""

    def __init__(self, n=12):
        self.n = n
        self.gates = [threading.Event() for _ in range(n)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i + 1 < self.n:
            self.gates[i].wait(5)  # sample i waits until sample i + 1 is done
        self.gates[i - 1].set() if i > 0 else None
        return i


def test_in_order_false_yields_every_batch_as_completed():
    dl = kuat.DataLoader(Slowish(4), num_workers=4, in_order=False, isolate_global_rng=False)
    got = [int(b) for b in dl]
    assert sorted(got) == [0, 1, 2, 3]
    assert got != [0, 1, 2, 3]  # the last sample completes first
    dl = kuat.DataLoader(Slowish(4), num_workers=4, isolate_global_rng=False)
    assert [int(b) for b in dl] == [0, 1, 2, 3]


@pytest.mark.parametrize("prefetch", [1, 3])
def test_prefetch_factor_bounds_batches_in_flight(prefetch):
    dl = kuat.DataLoader(list(range(40)), batch_size=2, num_workers=2, prefetch_factor=prefetch)
    it = iter(dl)
    seen = []
    for b in it:
        assert len(it._tasks) + len(it._ready) <= prefetch * 2
        seen += b.tolist()
    assert seen == list(range(40))


class InfoRecorder(IterableDataset):
    # UserLists: objects every thread worker's copy shares (plain lists are each worker's own,
    # as in torch's worker processes), so the test reads what all workers recorded
    def __init__(self):
        self.infos = collections.UserList()
        self.epochs = collections.UserList()
        self.lock = threading.Lock()

    def set_epoch(self, epoch):
        with self.lock:
            self.epochs.append(epoch)

    def __iter__(self):
        info = get_worker_info()
        with self.lock:
            self.infos.append((info.id, info.num_workers, info.seed, info.dataset is self,
                               info.worker_method))
        yield info.id


def test_thread_workers_see_their_own_worker_info_and_set_epoch_each_epoch():
    ds = InfoRecorder()
    dl = kuat.DataLoader(ds, batch_size=None, num_workers=3, persistent_workers=True, seed=4)
    assert sorted(int(x) for x in dl) == [0, 1, 2]
    assert sorted(int(x) for x in dl) == [0, 1, 2]
    dl.close()
    first = sorted(ds.infos[:3])
    assert [i[:2] for i in first] == [(0, 3), (1, 3), (2, 3)]
    assert all(i[3] and i[4] == "thread" for i in first)
    assert first[1][2] == first[0][2] + 1  # seed = base_seed + worker id, as torch
    assert sorted(ds.epochs) == [0, 0, 0, 1, 1, 1]
    assert get_worker_info() is None


class Buffered:
    """Like a kuat dataset: one (B, C, H, W) buffer per batch from kuat.collate.new_batch_buffer
    (so the collate may return it without a copy), samples are views of it."""

    kuat_uses_sample_rng = True

    def __init__(self):
        self.buffers = collections.UserList()  # shared by the workers' copies (see InfoRecorder)

    def __len__(self):
        return 8

    def __getitems__(self, indices):
        buf = new_batch_buffer((len(indices), 3, 2, 2), torch.uint8)  # (B, C, H, W)
        for j, i in enumerate(indices):
            buf[j].fill_(i)
        self.buffers.append(buf)
        return [{"image": buf[j], "label": i} for j, i in enumerate(indices)]

    @staticmethod
    def kuat_batch_transform(batch):
        return {**batch, "image": batch["image"].float() / 255}  # (B, C, H, W) u8 -> f32


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_buffer_is_not_copied_and_the_batch_transform_runs_after(num_workers):
    ds = Buffered()
    raw = kuat.DataLoader(ds, batch_size=4, num_workers=num_workers)
    raw._traits = dataclasses.replace(raw._traits, batch_transform=None)  # the raw batches
    batches = list(raw)
    # worker threads may fill the buffers in any order
    assert sorted(b["image"].data_ptr() for b in batches) == sorted(b.data_ptr() for b in ds.buffers)
    out = list(kuat.DataLoader(ds, batch_size=4, num_workers=num_workers))
    assert out[1]["image"].dtype == torch.float32
    assert torch.allclose(out[1]["image"][0], torch.full((3, 2, 2), 4 / 255))
    assert out[1]["label"].tolist() == [4, 5, 6, 7]


def test_stats_count_batches_samples_and_stage_times():
    dl = kuat.DataLoader(list(range(50)), batch_size=8, num_workers=2)
    for _ in range(2):
        for _b in dl:
            pass
    s = dl.stats()
    assert s["batches"] == 14 and s["samples"] == 100 and s["skipped_samples"] == 0
    assert s["elapsed_s"] > 0 and 0 <= s["input_bound_fraction"] <= 1
    assert s["batches_per_s"] > 0 and s["samples_per_s"] > 0
    assert s["busy_s"]["fetch"] > 0 and s["busy_s"]["collate"] > 0
    assert set(s["busy_s"]) == {"fetch", "fetch_cpu", "native", "native_cpu", "runqueue",
                                "collate", "pin",
                                "rng_lock_wait", "device", "batch_transform"}
    # kuat's own per-batch cost: part of the time inside next(), not the dataset's
    assert 0 < s["loader_overhead_us_per_batch"] * s["batches"] / 1e6 <= s["elapsed_s"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_overhead_excludes_the_datasets_own_time(num_workers):
    class Slow:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            time.sleep(0.03)  # the dataset's work, not the loader's
            return i

    dl = kuat.DataLoader(Slow(), batch_size=2, num_workers=num_workers, isolate_global_rng=False)
    list(dl)
    s = dl.stats()
    overhead_s = s["loader_overhead_us_per_batch"] * s["batches"] / 1e6
    assert s["busy_s"]["fetch"] >= 0.24 and overhead_s < s["busy_s"]["fetch"] / 2


def test_worker_init_fn_runs_once_per_process_worker(tmp_path):
    def init(worker_id):
        (tmp_path / f"{worker_id}-{os.getpid()}").touch()

    dl = kuat.DataLoader(list(range(12)), batch_size=2, num_workers=2, worker_type="process",
                         worker_init_fn=init)
    assert sorted(x for b in dl for x in b.tolist()) == list(range(12))
    files = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
    assert files == ["0", "1"]


def test_torchvision_image_folder_with_random_transforms_is_reproducible(tmp_path):
    from PIL import Image
    from torchvision import datasets, transforms

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for k in range(5):
            pixels = rng.integers(0, 255, (12, 10, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / cls / f"{k}.png")
    tf = transforms.Compose([transforms.RandomResizedCrop(8), transforms.RandomHorizontalFlip(),
                             transforms.PILToTensor()])
    ds = datasets.ImageFolder(str(tmp_path), transform=tf)

    def run(**kw):
        dl = kuat.DataLoader(ds, batch_size=4, shuffle=True, drop_last=True, seed=3, **kw)
        return [(b[0].clone(), b[1].tolist()) for _ in range(2) for b in dl]

    a, b, c = run(num_workers=2), run(num_workers=0), run(num_workers=2, worker_type="process")
    assert len(a) == 4 and a[0][0].shape == (4, 3, 8, 8) and a[0][0].dtype == torch.uint8
    for x, y, z in zip(a, b, c):
        assert torch.equal(x[0], y[0]) and torch.equal(x[0], z[0]) and x[1] == y[1] == z[1]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_pin_memory_returns_pinned_tensors_in_the_same_containers(worker_type):
    ds = [{"x": torch.full((3,), i), "n": i, "s": str(i)} for i in range(8)]
    dl = kuat.DataLoader(ds, batch_size=4, num_workers=2, worker_type=worker_type, pin_memory=True)
    batches = list(dl)
    assert all(b["x"].is_pinned() and b["n"].is_pinned() for b in batches)
    assert batches[1]["s"] == ["4", "5", "6", "7"] and batches[1]["x"][:, 0].tolist() == [4, 5, 6, 7]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_cuda_copies_ahead_and_applies_the_batch_transform_on_the_device(num_workers):
    ds = Buffered()
    dl = kuat.DataLoader(ds, batch_size=4, num_workers=num_workers, device="cuda")
    out = list(dl)
    assert len(out) == 2
    assert out[0]["image"].device.type == "cuda" and out[0]["image"].dtype == torch.float32
    assert torch.allclose(out[1]["image"][3].cpu(), torch.full((3, 2, 2), 7 / 255))
    assert out[1]["label"].device.type == "cuda" and out[1]["label"].tolist() == [4, 5, 6, 7]
    assert dl.stats()["busy_s"]["device"] > 0


def test_torchs_default_collate_is_replaced_in_workers_and_non_int_keys_work():
    from torch.utils.data import default_collate as torch_collate

    class Keyed:
        def __len__(self):
            return 2

        def __getitem__(self, key):
            return {"key": key, "r": np.random.randint(1 << 30)}

    def first_batch():
        dl = kuat.DataLoader(Keyed(), batch_size=2, sampler=["a", "b"], num_workers=1,
                             collate_fn=torch_collate, seed=8)
        assert dl.collate_fn is torch_collate
        return next(iter(dl))

    first = first_batch()
    assert first["key"] == ["a", "b"]
    assert torch.equal(first_batch()["r"], first["r"])  # isolated per key, reproducible


class CountsPickles:
    pickles = 0

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i * 10

    def __getstate__(self):
        CountsPickles.pickles += 1
        return {}


@pytest.mark.slow
def test_spawned_workers_get_the_dataset_pickled_as_torch_does():
    # each spawned worker gets the dataset pickled as it starts, inside multiprocessing's
    # spawning context (as torch: a dataset holding multiprocessing.Value/Lock objects can only
    # be pickled there), once per worker start: persistent workers, so once per worker
    counts = {}
    for name, cls in (("torch", torch.utils.data.DataLoader), ("kuat", kuat.DataLoader)):
        extra = {"worker_type": "process"} if name == "kuat" else {}
        CountsPickles.pickles = 0
        dl = cls(CountsPickles(), batch_size=4, num_workers=2, multiprocessing_context="spawn",
                 persistent_workers=True, **extra)
        assert [b.tolist() for _ in range(2) for b in dl] == [[0, 10, 20, 30], [40, 50, 60, 70]] * 2
        counts[name] = CountsPickles.pickles
        del dl
    assert counts["kuat"] == counts["torch"] == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_one_batch_ahead_copy_path_yields_every_batch_and_defers_errors(num_workers):
    # The device path of the iterator (stage the next batch, then hand out the current one)
    # driven with a CPU "device", so it runs without CUDA.
    class FailsAt5:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            if i == 5:
                raise KeyError(i)
            return i

    dl = kuat.DataLoader(FailsAt5(), batch_size=2, num_workers=num_workers)
    dl._device = torch.device("cpu")
    it = iter(dl)
    assert next(it).tolist() == [0, 1]
    assert next(it).tolist() == [2, 3]  # batch [4, 5] failed while this one was staged
    assert dl.state_dict()["batches_served_in_epoch"] == 2
    with pytest.raises(KeyError):
        next(it)
    assert next(it).tolist() == [6, 7]
    with pytest.raises(StopIteration):
        next(it)
    assert dl.state_dict()["epoch"] == 1


def test_a_new_iterator_over_persistent_workers_ends_the_previous_one():
    with kuat.DataLoader(list(range(12)), batch_size=2, num_workers=2,
                         persistent_workers=True) as dl:
        first = iter(dl)
        assert next(first).tolist() == [0, 1]
        second = iter(dl)
        assert [b.tolist() for b in second] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
        with pytest.raises(StopIteration):
            next(first)


@pytest.mark.parametrize("persistent", [False, True])
def test_cheap_batches_give_the_same_epochs_whether_or_not_the_consumer_takes_them_over(persistent):
    # range(n) with thread workers: batches of ~0.1 ms, the consumer waits for them, so the
    # loader may move to fetching them itself mid-epoch; nothing observable may change
    inline = kuat.DataLoader(range(6000), batch_size=64, shuffle=True, seed=4)
    want = [b.tolist() for _ in range(2) for b in inline]
    dl = kuat.DataLoader(range(6000), batch_size=64, shuffle=True, seed=4, num_workers=2,
                         persistent_workers=persistent)
    got = []
    for _ in range(2):
        it = iter(dl)
        got += [b.tolist() for b in it]
    assert got == want and want[0] != want[len(want) // 2]  # two different epochs, same as inline
    assert dl.stats()["batches"] == len(want)
    dl2 = kuat.DataLoader(range(6000), batch_size=64, shuffle=True, seed=4, num_workers=2,
                          worker_init_fn=lambda w: None)
    assert dl2._job.thread_agnostic is False  # per-worker set-up: never fetched elsewhere


class LazyRows(torch.utils.data.Dataset):
    """A plain map-style dataset kuat knows nothing of: a handle assigned on first use (per
    worker, as a memory map opened lazily), one NumPy gather per batch after ``wait_s`` of
    sleep."""

    def __init__(self, n, consult_worker_info=False, wait_s=1e-4):
        self.data = np.arange(n * 4, dtype=np.int64).reshape(n, 4)  # (N, 4)
        self.consult = consult_worker_info
        self.wait_s = wait_s
        self.handle = None

    def __len__(self):
        return len(self.data)

    def __getitems__(self, indices):
        if self.consult:
            get_worker_info()
        if self.handle is None:
            self.handle = object()
        time.sleep(self.wait_s)  # more than the consumer's own cost per batch
        return list(torch.from_numpy(self.data[indices]))  # B x (4,) views of one (B, 4) array


def _every_batch_counts_as_cheap(monkeypatch):
    """Fix the adaptive policy's timing verdicts, which a test cannot control on a shared host
    (on a loaded one the 0.1 ms batches above cost over 0.5 ms of CPU, and none is cheap): every
    batch is cheap and the loop's own time never outweighs the work. What is left to the host
    is whether the loop waited for its batches, which the datasets' sleeps make certain."""
    from kuat.loader import _adaptive

    monkeypatch.setattr(_adaptive, "CHEAP_BATCH_S", 3600.0)
    monkeypatch.setattr(_adaptive, "INLINE_MAX_LOOP_SHARE", float("inf"))


@pytest.mark.parametrize("consult", [False, True])
def test_cheap_batches_of_any_map_dataset_are_taken_over_from_a_copy_of_its_own(consult,
                                                                               monkeypatch):
    # the consumer may fetch cheap batches of a dataset that is not declared thread-agnostic,
    # from its own shallow copy (the user's object stays as the workers leave it: untouched),
    # and never when a worker's dataset consulted get_worker_info(): nothing observable changes
    _every_batch_counts_as_cheap(monkeypatch)
    epochs, n, wait_s = 3, 1024, 5e-3  # (the loop waits: two workers, 2.5 ms a batch)
    inline = kuat.DataLoader(LazyRows(n, wait_s=wait_s), batch_size=32, shuffle=True, seed=2)
    want = [[b.tolist() for b in inline] for _ in range(epochs)]
    ds = LazyRows(n, consult_worker_info=consult, wait_s=wait_s)
    dl = kuat.DataLoader(ds, batch_size=32, shuffle=True, seed=2, num_workers=2,
                         persistent_workers=True)
    taken_over = []
    for e in range(epochs):
        it = iter(dl)
        assert [b.tolist() for b in it] == want[e]
        taken_over.append(it._inline)
    assert ds.handle is None
    assert taken_over == [not consult] * epochs
    dl.close()


def test_cheap_batches_deepen_process_workers_prefetch_without_changing_the_epoch(monkeypatch):
    # process workers, prefetch_factor not given: up to 8 cheap batches per worker in flight
    # (each worker wakes once per several batches; its shared-memory ring grows to match);
    # never taken over by the consumer (a worker process reads a full copy of the dataset)
    from kuat.loader._adaptive import CHEAP_PREFETCH

    _every_batch_counts_as_cheap(monkeypatch)
    want = [b.tolist() for b in kuat.DataLoader(LazyRows(2048), batch_size=32, seed=3,
                                                shuffle=True)]
    dl = kuat.DataLoader(LazyRows(2048), batch_size=32, shuffle=True, seed=3, num_workers=2,
                         worker_type="process")
    it = iter(dl)
    assert [b.tolist() for b in it] == want
    adapt = it._adapt
    assert adapt.adaptive and adapt.cheap == len(want) and not it._inline
    assert adapt.max_inflight == 2 * CHEAP_PREFETCH
    dl8 = kuat.DataLoader(LazyRows(256), batch_size=32, num_workers=2, worker_type="process",
                          prefetch_factor=2)
    it = iter(dl8)
    list(it)
    assert not it._adapt.adaptive and it._adapt.max_inflight == 4  # explicit prefetch_factor kept


class SharedCounter:
    """Counts fetches in a multiprocessing.Value shared with the workers (torch's
    test_worker_seed pattern): picklable only while a worker process is being spawned."""

    def __init__(self, ctx):
        self.count = ctx.Value("i", 0)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        with self.count.get_lock():
            self.count.value += 1
        return i


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_dataset_holding_a_multiprocessing_value_works_under_spawn(method):
    import multiprocessing

    ctx = multiprocessing.get_context(method)
    got = {}
    for name, cls in (("torch", torch.utils.data.DataLoader), ("kuat", kuat.DataLoader)):
        extra = {"worker_type": "process"} if name == "kuat" else {}
        ds = SharedCounter(ctx)
        dl = cls(ds, batch_size=4, num_workers=2, multiprocessing_context=ctx, **extra)
        got[name] = ([b.tolist() for b in dl], ds.count.value)
    assert got["kuat"] == got["torch"] == ([[0, 1, 2, 3], [4, 5, 6, 7]], 8)
