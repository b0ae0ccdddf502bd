"""Global-RNG isolation (kuat.engine.isolate): reproducible whatever the workers, and free for
datasets that do not draw."""

import random
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import Subset, TensorDataset, random_split

import kuat
from kuat.engine import isolate
from kuat.rng import global_rng_seed

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

MODES = [(0, "thread"), (1, "thread"), (4, "thread"), (1, "process"), (4, "process")]
SEED = 11


def _draws():
    return (random.random(), float(np.random.rand()), float(torch.rand(())))


class PerSample:
    """Draws from all three global generators in ``__getitem__`` (from ``first_drawing`` on)."""

    def __init__(self, n=48, first_drawing=0):
        self.n, self.first_drawing = n, first_drawing

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (i, *_draws()) if i >= self.first_drawing else (i, 0.0, 0.0, 0.0)


class Batched(PerSample):
    def __getitems__(self, indices):
        return [self[i] for i in indices]


def _expected(i, epoch=0):
    """What sample ``i`` draws under isolation: the generators seeded from (seed, epoch, i)."""
    saved = isolate.save()
    try:
        isolate.seed_globals_cpu(global_rng_seed(SEED, epoch, i))
        return _draws()
    finally:
        isolate.restore(saved)


def _rows(ds, workers, wtype, **kw):
    dl = kuat.DataLoader(ds, batch_size=4, num_workers=workers, worker_type=wtype, seed=SEED, **kw)
    out = {}
    for batch in dl:
        for i, *vals in zip(*(t.tolist() for t in batch)):
            out[i] = tuple(vals)
    return out, dl


@pytest.mark.parametrize("workers,wtype", MODES)
def test_per_sample_draws_are_seeded_by_seed_epoch_and_index(workers, wtype):
    rows, _ = _rows(PerSample(), workers, wtype, shuffle=True)
    assert rows == {i: pytest.approx(_expected(i)) for i in range(48)}


@pytest.mark.parametrize("workers,wtype", MODES)
def test_a_dataset_that_starts_drawing_after_the_first_batches_is_caught(workers, wtype):
    # samples 0..39 draw nothing (the probe of every worker's first batch sees no draw);
    # the watch then sees 40..47 draw, and those batches are fetched again isolated
    rows, _ = _rows(PerSample(first_drawing=40), workers, wtype)
    want = {i: (0.0, 0.0, 0.0) if i < 40 else pytest.approx(_expected(i)) for i in range(48)}
    assert rows == want


@pytest.mark.parametrize("workers,wtype", MODES)
def test_getitems_datasets_are_reproducible_per_batch(workers, wtype):
    ref, _ = _rows(Batched(), 0, "thread", shuffle=True)
    rows, _ = _rows(Batched(), workers, wtype, shuffle=True)
    assert rows == ref and len(set(ref.values())) == 48  # same draws, distinct per sample


@pytest.mark.parametrize("workers,wtype", [(0, "thread"), (4, "thread"), (2, "process")])
def test_subset_and_random_split_are_isolated_per_sample(workers, wtype):
    base = PerSample()
    assert hasattr(Subset(base, [0]), "__getitems__")  # torch's wrapper has a batched fetch
    train, _ = random_split(base, [32, 16], generator=torch.Generator().manual_seed(0))
    for ds in (train, Subset(Subset(base, list(range(40))), list(range(0, 40, 2)))):
        rows, _ = _rows(ds, workers, wtype, shuffle=True)
        # per sample, keyed by the index into the wrapper, as for any map-style dataset
        by_pos = {j: ds[j][0] for j in range(len(ds))}
        want = {by_pos[j]: pytest.approx(_expected(j)) for j in range(len(ds))}
        assert rows == want


def test_datasets_that_do_not_draw_are_not_isolated_and_the_callers_streams_are_kept():
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    # torch's loader draws its base_seed and its RandomSampler's seed from torch's generator
    # (kuat makes the same two draws: test_parity_rng_stream.py); nothing else may draw
    list(torch.utils.data.DataLoader(PerSample(64, first_drawing=64), batch_size=8, shuffle=True))
    want = _draws()
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    dl = kuat.DataLoader(PerSample(64, first_drawing=64), batch_size=8, shuffle=True, seed=1)
    assert sorted(int(v) for b in dl for v in b[0]) == list(range(64))
    assert dl._job.isolate_rng and not dl._job.rng_use.draws  # probed and watched: no draw
    assert _draws() == want  # neither the probe nor the watch drew or left a reseeded stream

    dl = kuat.DataLoader(PerSample(), batch_size=8, seed=1)
    list(dl)
    assert dl._job.rng_use.draws
    for pure in (range(4), [1, 2], np.arange(4), torch.arange(4), TensorDataset(torch.arange(4))):
        assert not kuat.DataLoader(pure, batch_size=2)._job.isolate_rng  # cannot draw


def test_fingerprint_changes_on_every_kind_of_draw_and_seed():
    for draw in (random.random, np.random.rand, lambda: torch.rand(()), lambda: random.seed(1),
                 lambda: np.random.seed(1), lambda: torch.manual_seed(1),
                 lambda: np.random.randint(0, 10, 700), lambda: torch.rand(1000),
                 lambda: torch.randn(1), lambda: torch.randn(1),  # the second: a cached sample
                 np.random.randn, np.random.randn,  # the legacy RandomState's cached sample
                 lambda: random.gauss(0, 1), lambda: random.gauss(0, 1),
                 # a whole MT19937 block: the counters come back to where they were
                 lambda: random.getrandbits(32 * 624), lambda: torch.randint(0, 5, (624,)),
                 lambda: torch.set_rng_state(torch.Generator().get_state()),
                 lambda: np.random.set_state(np.random.RandomState(5).get_state())):
        before = isolate.fingerprint()
        draw()
        assert isolate.fingerprint() != before, draw
    assert isolate.fingerprint() == isolate.fingerprint()


def test_fingerprint_reads_every_generator_in_place_where_calibration_finds_it():
    # CPython + NumPy + torch's CPU generator: each state is read through a window found on a
    # fresh instance of its type (the accessors copy 2.5-5 KB: 3.5 us per fingerprint instead
    # of 0.75); the windows hold what the accessors report
    isolate.fingerprint()
    assert isolate._py_window is not None and isolate._torch_window is not None
    assert isolate._np_window is not None and isolate._np_window[2] is not None
    torch.manual_seed(12345)
    assert isolate._torch_window.raw[:8] == (12345).to_bytes(8, "little")
    random.seed(7)
    random.random()
    index = int.from_bytes(isolate._py_window.raw[:4], "little")
    assert random.getstate()[1][-1] == index
    np.random.seed(9)
    np.random.randn()
    has_gauss, gauss = np.random.get_state()[3:]
    raw = isolate._np_window[2].raw
    assert int.from_bytes(raw[:4], "little") == has_gauss == 1
    assert np.frombuffer(raw[8:], np.float64)[0] == gauss


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / c).mkdir()
        for k in range(6):
            a = rng.integers(0, 255, (20 + k, 24, 3), dtype=np.uint8)
            Image.fromarray(a).save(root / c / f"{k}.png")
    return root


def _image_folder(root):
    """An unchanged torchvision ImageFolder with transforms.v2 at default arguments."""
    import torchvision
    import torchvision.transforms.v2 as T

    tf = T.Compose([
        T.ToImage(), T.RandomResizedCrop(12), T.RandomHorizontalFlip(),
        T.ToDtype(torch.float32, scale=True), T.Normalize([0.5] * 3, [0.25] * 3),
    ])
    return torchvision.datasets.ImageFolder(str(root), transform=tf)


def _epoch(ds, seed=5, **kw):
    dl = kuat.DataLoader(ds, batch_size=4, shuffle=True, seed=seed, **kw)
    batches = [(x.clone(), y.clone()) for x, y in dl]
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]), dl


@pytest.mark.parametrize("wrap", ["plain", "random_split", "subset"])
def test_torchvision_image_folder_is_reproducible_from_the_seed_in_every_mode(image_folder, wrap):
    base = _image_folder(image_folder)
    if wrap == "random_split":
        ds, _ = random_split(base, [8, 4], generator=torch.Generator().manual_seed(1))
    elif wrap == "subset":
        ds = Subset(base, [11, 0, 5, 3, 7, 2, 9, 1])
    else:
        ds = base
    x0, y0, _ = _epoch(ds, num_workers=0)
    for kw in ({"num_workers": 0}, {"num_workers": 1}, {"num_workers": 4},
               {"num_workers": 2, "worker_type": "thread"},
               {"num_workers": 2, "worker_type": "process"}):
        x, y, _ = _epoch(ds, **kw)
        assert torch.equal(y, y0) and torch.equal(x, x0), kw
    x1, _, _ = _epoch(ds, seed=6, num_workers=0)
    assert not torch.equal(x1, x0)  # the augmentations do draw


def test_default_worker_type_moves_a_drawing_dataset_to_processes(image_folder, monkeypatch):
    import torchvision.transforms as T1

    from kuat.loader import _workers

    def no_threads(*args, **kwargs):
        raise AssertionError("thread workers started for a dataset known to draw")

    # torchvision's random transforms in its attributes: processes from the start (no thread
    # workers started, fetched and dropped first); the same batches as on threads
    x_thread, _, _ = _epoch(_image_folder(image_folder), num_workers=2, worker_type="thread")
    with monkeypatch.context() as m:
        m.setattr(_workers, "ThreadEngine", no_threads)
        x, _, dl = _epoch(Subset(_image_folder(image_folder), range(12)), num_workers=2)
    assert dl.worker_type == "process" and torch.equal(x, x_thread)
    workers = dl.stats()["workers"]
    assert workers["chosen"] == "rng" and "RandomResizedCrop" in workers["reason"], workers
    # the hint looks at attributes only: deterministic torchvision transforms, v1 or v2, are
    # no hint; v1's random ones (and those inside RandomApply, nn.Sequential) are
    from kuat.engine.rng_hint import draws_hint

    class Holder(torch.utils.data.Dataset):
        transform = target_transform = None

    base = Holder()
    base.transform = T1.Compose([T1.Resize(8), T1.ToTensor()])
    assert draws_hint(base) is None
    base.transform = T1.Compose([T1.Resize(8), T1.RandomApply([T1.ColorJitter(0.1)], p=0.5)])
    assert draws_hint(base) == "RandomApply"
    base.transform = torch.nn.Sequential(T1.CenterCrop(8), T1.ColorJitter(0.1))
    assert draws_hint(base) == "ColorJitter"
    base.transform, base.target_transform = None, T1.RandomChoice([lambda t: t])
    assert draws_hint(base) == "RandomChoice"
    # a drawing dataset the hint cannot see: found drawing in the first batches, moved mid-epoch
    rows, dl = _rows(PerSample(), 2, None)
    assert rows == {i: pytest.approx(_expected(i)) for i in range(48)}
    assert dl.worker_type == "process" and dl.stats()["workers"]["chosen"] == "rng"
    _, _, dl = _epoch(_image_folder(image_folder), num_workers=2, worker_type="thread")
    assert dl.worker_type == "thread"  # an explicit choice stays
    dl = kuat.DataLoader(range(12), batch_size=4, num_workers=2)
    assert sorted(int(v) for b in dl for v in b) == list(range(12))
    assert dl.worker_type == "thread"  # a dataset that does not draw stays in threads


def test_watching_stops_after_false_alarms_from_other_threads(caplog):
    use = isolate.RngUse()
    with caplog.at_level("INFO", logger="kuat.engine"):
        for _ in range(isolate.MAX_FALSE_ALARMS):
            assert use.watch
            use.false_alarm()
    assert not use.watch and not use.draws and "no longer watching" in caplog.text


def test_a_draw_by_another_thread_during_a_batch_is_a_false_alarm_not_a_draw():
    class DrawsElsewhere(PerSample):
        fired = False

        def __getitem__(self, i):
            if i == 20 and not self.fired:  # as if the training loop drew during this batch
                self.fired = True
                t = threading.Thread(target=torch.rand, args=(3,))
                t.start()
                t.join()
            return (i, 0.0, 0.0, 0.0)

    dl = kuat.DataLoader(DrawsElsewhere(), batch_size=8, seed=1)
    assert [int(v) for b in dl for v in b[0]] == list(range(48))
    assert not dl._job.rng_use.draws and dl._job.rng_use.false_alarms == 1


class DrawsOutsideWorker0(PerSample):
    """Draws in every worker but worker 0."""

    def __getitem__(self, i):
        wid = torch.utils.data.get_worker_info().id
        return (i, wid, *(_draws() if wid else (0.0, 0.0, 0.0)))


def test_thread_workers_watch_their_first_batches_and_the_watch_catches_draws(monkeypatch):
    # a dataset that does not draw: no thread worker's batch runs reseeded under the exclusive
    # lock (a probe there would stall the other workers, or make the batches fetched beside it
    # run again: a __getitem__ with side effects would run more often than under torch)
    reseeded = []  # the thread of every sample fetched isolated (reseeded)
    seed = isolate.seed_globals_cpu
    monkeypatch.setattr(isolate, "seed_globals_cpu",
                        lambda s: (reseeded.append(threading.current_thread().name), seed(s)))
    rows, dl = _rows(PerSample(64, first_drawing=64), 4, "thread", shuffle=True)
    assert sorted(rows) == list(range(64)) and not dl._job.rng_use.draws
    assert reseeded == []
    monkeypatch.setattr(isolate, "seed_globals_cpu", seed)

    # workers other than worker 0 draw from their first batch on: the watch sees it,
    # and their batches are fetched again isolated (draws seeded from (seed, epoch, index))
    dl = kuat.DataLoader(DrawsOutsideWorker0(), batch_size=4, num_workers=4, worker_type="thread",
                         seed=SEED, shuffle=True)
    seen = {}
    for batch in dl:
        for i, wid, *vals in zip(*(t.tolist() for t in batch)):
            seen[i] = (wid, tuple(vals))
    assert sorted(seen) == list(range(48)) and dl._job.rng_use.draws
    assert {wid for wid, _ in seen.values()} == {0, 1, 2, 3}
    for i, (wid, vals) in seen.items():
        assert vals == ((0.0, 0.0, 0.0) if wid == 0 else pytest.approx(_expected(i))), (i, wid)


class DrawBeside(PerSample):
    """Samples 0 and 1 (the two workers' first batches) draw while the other's runs: sample 0
    draws, lets sample 1 draw, then draws again; whichever one is probed, the other is
    fetched beside it (isolate.py, 1) and its draw lands in the probed sample's stream."""

    def __init__(self, started, drew):
        super().__init__(8)
        self.started, self.drew = started, drew

    def __getitem__(self, i):
        if i == 0:
            first = _draws()
            self.started.set()
            if not self.drew.wait(20):
                raise RuntimeError("sample 1 never drew")
            return (i, *first, *_draws())
        if i == 1:
            if not self.started.wait(20):
                raise RuntimeError("sample 0 never started")
            out = (i, *_draws(), 0.0, 0.0, 0.0)
            self.drew.set()
            return out
        return (i, *_draws(), 0.0, 0.0, 0.0)


def test_a_draw_beside_a_probed_sample_has_both_fetched_again_isolated():
    # the probed sample cannot tell its draws from the other's: it is fetched again once the
    # other is gone, and the other, whose generators changed, is fetched again isolated; each
    # sample's draws are those isolation gives it, as with one worker
    def expected(i):
        saved = isolate.save()
        try:
            isolate.seed_globals_cpu(global_rng_seed(SEED, 0, i))
            return _draws() + (_draws() if i == 0 else (0.0, 0.0, 0.0))
        finally:
            isolate.restore(saved)

    started, drew = threading.Event(), threading.Event()
    dl = kuat.DataLoader(DrawBeside(started, drew), batch_size=1, num_workers=2,
                         worker_type="thread", seed=SEED, timeout=30)
    rows = {int(b[0]): tuple(float(v) for v in b[1:]) for b in dl}
    assert rows == {i: pytest.approx(expected(i)) for i in range(8)}
    assert dl._job.rng_use.draws


def test_the_loops_first_batch_waits_only_for_fetches_begun_before_any_ended():
    """RngUse's count of thread fetches the loop's first batch of an epoch waits for (their
    draws rewound first): the workers' first batches, begun before any fetch ended, not a
    worker's next one; nothing once the loop has its batch; a new epoch counts afresh."""
    use = isolate.RngUse()
    use.threads_start()  # (the dataset not known to draw: the caller's state kept)
    assert use.caller_state is not None
    assert use.fetch_begins() and use.fetch_begins()  # two workers' first batches
    use.fetch_ends()
    use.fetch_done()  # worker 0's first batch is back
    assert not use.fetch_begins()  # its next batch is not waited for
    use.fetch_ends()
    use.fetch_done()
    use.loop_has_batch()  # nothing pending: returns at once, the state dropped
    assert use.caller_state is None and not use.fetch_begins()
    use.threads_start()
    assert use.fetch_begins()
    use.fetch_ends()
    assert use._pending == 0


class _Inner(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([float(i)])


class _IteratesALoader(torch.utils.data.Dataset):
    """Each sample iterates a kuat loader of its own in the fetching thread (no workers)."""

    def __init__(self):
        self.inner = kuat.DataLoader(_Inner(), batch_size=2, num_workers=0,
                                     generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([float(i) + sum(float(b.sum()) for b in self.inner)])


def test_a_loader_inside_a_thread_workers_sample_leaves_the_outer_count_alone():
    # the inner loader's fetches run in the outer worker's thread: each keeps its own pending
    # fetch (before, the inner one cleared the outer's, whose count then grew every epoch
    # and made every first batch wait its longest)
    dl = kuat.DataLoader(_IteratesALoader(), batch_size=2, num_workers=2, worker_type="thread")
    assert [float(x) for b in dl for x in b[:, 0]] == [i + 6.0 for i in range(4)]
    assert dl._job.rng_use._pending == 0


class _Plain(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([float(i)])


@pytest.mark.parametrize("isolate_global_rng", [True, False])
def test_the_callers_generators_are_kept_at_an_epoch_start_only_where_fetches_are_isolated(
        isolate_global_rng, monkeypatch):
    """A loader that does not isolate (``isolate_global_rng=False``, the default for a source
    drawing from ``kuat.sample_rng``) never watches nor rewinds a fetch, so it keeps nothing of
    the caller's generators at an epoch's start (a save reads all three); one that isolates
    keeps them until its first batch. The caller's stream is torch's either way."""
    saves = []
    real = isolate.save
    monkeypatch.setattr(isolate, "save", lambda: saves.append(1) or real())
    g = torch.Generator().manual_seed(3)
    dl = kuat.DataLoader(_Plain(), batch_size=2, num_workers=2, worker_type="thread",
                         shuffle=True, generator=g, isolate_global_rng=isolate_global_rng)
    tg = torch.Generator().manual_seed(3)
    ref = torch.utils.data.DataLoader(_Plain(), batch_size=2, shuffle=True, generator=tg)
    for _ in range(2):
        assert [b.tolist() for b in dl] == [b.tolist() for b in ref]
    assert (len(saves) > 0) == isolate_global_rng
    assert dl._job.rng_use.caller_state is None
    assert g.get_state().equal(tg.get_state())
