"""The loader's choices for its user (kuat/loader/_auto.py): the worker type under
worker_type=None and the count under num_workers="auto", decided from the first batches, never
changing a batch. Assertions are on the decision, never on speed."""

import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import kuat
from kuat.engine.process import ProcessEngine
from kuat.loader import _auto
from kuat.sources.stream import Stream

_others_cores = _auto.others_cores  # (the fixture below replaces it)

N = 480  # items: 30 batches of 16


def _python_work(i: int) -> int:
    """About 0.5 ms of pure Python (holds the GIL): a batch of 16 holds it longer than the
    interpreter's switch interval (5 ms), the case a loaded machine cannot blur."""
    s = 0
    for k in range(5000):
        s += (k * i) % 7
    return s


class GilBound(Dataset):
    """A torch-style dataset: per-sample Python, and (``worker``) which worker fetched it."""

    def __init__(self, worker=True):
        self.worker = worker

    def __len__(self):
        return N

    def __getitem__(self, i):
        if not self.worker:
            return {"i": i, "v": _python_work(i)}
        info = get_worker_info()
        return {"i": i, "v": _python_work(i), "worker": -1 if info is None else info.id}


class SleepyIO(Dataset):
    """I/O-bound: each sample waits (the GIL released), little Python."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        time.sleep(0.0004)
        return i


class NumpyHeavy(Dataset):
    """GIL-free compute: a sort of 100,000 floats per sample (NumPy releases the GIL)."""

    def __init__(self):
        self.a = np.random.default_rng(0).random(100_000)

    def __len__(self):
        return N // 4

    def __getitem__(self, i):
        return float(np.sort(self.a * (i + 1))[i])


class ShortPython(Dataset):
    """Issue 30's case: about 10 us of pure Python per item, so that a batch of 64 holds the
    GIL for well under the interpreter's switch interval (5 ms): the GIL waits fall between
    fetches, not inside them."""

    def __len__(self):
        return 64 * 150

    def __getitem__(self, i):
        s = 0
        for k in range(160):
            s += (k * i) % 7
        return {"i": i, "v": s}


class ShortNumpy(Dataset):
    """Short GIL-free batches: a NumPy sort of 20,000 floats per item (about 0.8 ms, the GIL
    released), batch 2: about as long as ShortPython's batches. (5,000 floats at batch 8 made
    the same batches with 4x the Python around the sorts: on a host whose code runs 20x slower
    right after a wait, that Python held the GIL at half the probe's takes, and 2 of 5 runs
    of 3 loaders read the work as GIL-bound.)"""

    def __init__(self):
        self.a = np.random.default_rng(0).random(20_000)

    def __len__(self):
        return 800

    def __getitem__(self, i):
        return float(np.sort(self.a * (i + 1))[i % 100])


class GilBoundStream(IterableDataset):
    """A per-row Python iterable split by worker, as a lazily mapped stream."""

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(wid, N, nw):
            yield {"i": i, "v": _python_work(i)}


@pytest.fixture(autouse=True)
def two_idle_cores(monkeypatch):
    """Decisions as on a machine with 2 usable cores (whatever this one has), taken as idle
    (no runqueue limit, no other process using CPU) whatever the load of this one (test_decide_rules tests the busy-machine rule)."""
    monkeypatch.setattr(_auto, "usable_cores", lambda: 2)
    monkeypatch.setattr(_auto, "others_cores", lambda *a: 0.0)
    monkeypatch.setattr(_auto, "BUSY_MACHINE", 1.0)


def _batches(loader):
    return [{k: v.clone() for k, v in b.items()} if isinstance(b, dict) else b.clone()
            for b in loader]


def _equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                assert torch.equal(x[k], y[k]), k
        else:
            assert torch.equal(x, y)


def _force_processes(monkeypatch):
    """The decision made "process" whatever this machine's load makes of the measurement (the
    measurement is tested on its own): for tests of the move itself."""
    measured = _auto.WorkerChoice.decide

    def decide(self, **kw):
        measured(self, **kw)
        self.worker_type = "process"
        return "process", self.num_workers

    monkeypatch.setattr(_auto.WorkerChoice, "decide", decide)


def test_gil_bound_map_dataset_moves_to_processes_with_torchs_batches():
    torch_batches = _batches(torch.utils.data.DataLoader(GilBound(), batch_size=16, num_workers=2))
    # A measurement: on a machine whose cores are all taken (the rest of the suite, other
    # jobs) it may find the work GIL-bound but keep threads (no spare core for processes),
    # or, rarely, misread one run; three fresh loaders, and every one gives torch's batches.
    seen = []
    for _ in range(3):
        dl = kuat.DataLoader(GilBound(), batch_size=16, num_workers=2)
        assert dl.worker_type == "thread"  # before any batch: threads
        batches = _batches(dl)
        _equal(batches, torch_batches)  # same samples, order and worker per batch as torch's
        w = dl.stats()["workers"]
        seen.append((dl.worker_type, w["reason"]))
        assert w["chosen"] == "measured" and w["measured"]["batches"] >= _auto.PROBE_BATCHES, w
        if dl.worker_type == "process":
            assert w["type"] == "process" and "GIL" in w["reason"], w
            break
        if w["reason"].startswith("GIL-bound, but"):  # found GIL-bound; no spare core now
            break
    else:
        raise AssertionError(f"a GIL-bound dataset was not found GIL-bound in 3 runs: {seen}")
    # an explicit type is honoured
    dl = kuat.DataLoader(GilBound(), batch_size=16, num_workers=2, worker_type="thread")
    _equal(_batches(dl), torch_batches)
    assert dl.worker_type == "thread" and dl.stats()["workers"]["chosen"] == "given"


def test_short_gil_bound_batches_leave_threads_with_torchs_batches(monkeypatch):
    """Issue 30: batches of pure Python shorter than the switch interval were read as GIL-free
    (the probe's mean wait was low; the waits fell between fetches). They leave threads: for
    processes on a machine with spare cores, else fetched inline; every batch torch's."""
    ref = _batches(torch.utils.data.DataLoader(ShortPython(), batch_size=64))
    seen = []
    for _ in range(3):  # a measurement: three fresh loaders (see the test above)
        dl = kuat.DataLoader(ShortPython(), batch_size=64, num_workers=2)
        _equal(_batches(dl), ref)
        w = dl.stats()["workers"]
        seen.append((w["type"], w["reason"], w["measured"].get("gil_held_share")))
        if w["type"] == "process" and "GIL" in w["reason"]:
            break
    else:
        raise AssertionError(f"short GIL-bound batches stayed on threads in 3 runs: {seen}")
    # where no core is spare (here: every machine counts as busy), the loop waits for its
    # batches: they are fetched inline, in this epoch and the next, torch's batches throughout
    monkeypatch.setattr(_auto, "BUSY_MACHINE", -1.0)
    seen = []
    for _ in range(3):
        dl = kuat.DataLoader(ShortPython(), batch_size=64, num_workers=2)
        first = _batches(dl)
        w = dl.stats()["workers"]
        seen.append((w["type"], w["reason"], w["measured"].get("gil_held_share")))
        if w["type"] == "inline":
            break
    else:
        raise AssertionError(f"short GIL-bound batches on a busy machine not inline: {seen}")
    assert "GIL-bound, but" in w["reason"] and dl.worker_type == "thread", w
    _equal(first, ref)
    it = iter(dl)  # the next epoch: inline from its first batch
    second = _batches([next(it)])
    assert it._inline
    _equal(second + _batches(it), ref)
    assert dl.stats()["workers"] == w  # decided once


@pytest.mark.parametrize("ds, bs", [(SleepyIO, 16), (NumpyHeavy, 4), (ShortNumpy, 2)],
                         ids=["io", "numpy", "short-numpy"])
def test_gil_free_work_stays_on_threads(ds, bs):
    # live, on a machine other processes share: a thread holding the GIL while preempted off
    # its core reads as Python holding it, so one misread in 3 loaders is tolerated (as the
    # GIL-bound tests tolerate one); torch's batches every time, whatever was chosen
    ref, seen = _batches(torch.utils.data.DataLoader(ds(), batch_size=bs)), []
    for _ in range(3):
        dl = kuat.DataLoader(ds(), batch_size=bs, num_workers=2)
        _equal(_batches(dl), ref)
        w = dl.stats()["workers"]
        seen.append((dl.worker_type, w["reason"], w["measured"]))
        assert w["chosen"] == "measured", w
        if dl.worker_type == "thread":
            break
    else:
        raise AssertionError(f"GIL-free work left threads in 3 loaders: {seen}")
    assert "GIL" not in w["reason"] or "releases" in w["reason"] or "I/O" in w["reason"]


def test_kuat_format_dataset_stays_on_threads(tmp_path):
    path = tmp_path / "d"
    with kuat.Writer(path, {"x": kuat.format.int64()}) as w:
        w.write_batch({"x": np.arange(4000, dtype=np.int64)})
    ds = kuat.open(path)
    dl = kuat.DataLoader(ds, batch_size=64, num_workers=2, prefetch_factor=2)
    list(dl)
    w = dl.stats()["workers"]
    assert (dl.worker_type, w["chosen"]) == ("thread", "measured"), w


def test_the_decision_is_stable_across_epochs_and_resume(monkeypatch):
    _force_processes(monkeypatch)
    dl = kuat.DataLoader(GilBound(worker=False), batch_size=16, num_workers=2, shuffle=True,
                         seed=3)
    first = _batches(dl)
    decided = dl.stats()["workers"]
    assert dl.worker_type == "process"
    it = iter(dl)
    head = [next(it) for _ in range(5)]
    state = dl.state_dict()
    rest = list(it)
    assert dl.stats()["workers"] == decided  # not measured again
    assert len(first) == len(head) + len(rest)
    # the same loader, resumed: still processes, the same batches
    dl.load_state_dict(state)
    _equal(_batches(dl), rest)
    assert dl.worker_type == "process" and dl.stats()["workers"] == decided
    # a new loader resumed from the state: the same rest of the epoch whatever it measures
    fresh = kuat.DataLoader(GilBound(worker=False), batch_size=16, num_workers=2, shuffle=True,
                            seed=3)
    fresh.load_state_dict(state)
    _equal(_batches(fresh), rest)


def test_gil_bound_iterable_moves_at_the_next_epoch_with_torchs_batches(monkeypatch):
    _force_processes(monkeypatch)
    torch_dl = torch.utils.data.DataLoader(GilBoundStream(), batch_size=16, num_workers=2)
    expected = _batches(torch_dl)
    dl = kuat.DataLoader(GilBoundStream(), batch_size=16, num_workers=2)
    _equal(_batches(dl), expected)  # the first epoch ends on its threads
    assert dl.stats()["workers"]["chosen"] == "measured" and dl.worker_type == "thread"
    _equal(_batches(dl), expected)  # the next one runs on processes
    assert dl.worker_type == "process"
    assert dl.stats()["workers"]["num_workers"] == 2  # an iterable's count never changes


class PyStream(Stream):
    """A kuat stream (one deterministic stream per epoch, as HF streaming) of per-row Python."""

    def samples(self, epoch):
        for i in range(N):
            yield {"i": i + 1000 * epoch, "v": _python_work(i)}


def test_a_gil_bound_kuat_stream_moves_mid_epoch_and_replays_exactly(monkeypatch):
    _force_processes(monkeypatch)
    inline = kuat.DataLoader(PyStream(), batch_size=16)
    want = [_batches(inline) for _ in range(2)]
    dl = kuat.DataLoader(PyStream(), batch_size=16, num_workers=2)
    it = iter(dl)
    first = [{k: v.clone() for k, v in b.items()} for b in it]
    assert isinstance(it._engine, ProcessEngine)  # moved within the first epoch
    _equal(first, want[0])  # every batch once, in order: the new workers skipped the old ones'
    _equal(_batches(dl), want[1])
    assert dl.worker_type == "process" and dl.stats()["workers"]["chosen"] == "measured"


# --- num_workers="auto" ------------------------------------------------------------------------
def _run(ds, step_s: float, **kw):
    dl = kuat.DataLoader(ds, batch_size=16, num_workers="auto", **kw)
    assert dl.num_workers == _auto.initial_workers(2) == 2  # an int before the decision
    for _ in dl:
        if step_s and dl._choice.probing:
            time.sleep(step_s)  # (then the rest of the epoch, on the workers chosen)
    return dl


def test_auto_with_a_fast_consumer_uses_the_cores(monkeypatch):
    with monkeypatch.context() as m:
        _force_processes(m)  # (the type is measured in the tests above; the count here)
        dl = _run(GilBound(worker=False), 0)
    assert (dl.worker_type, dl.num_workers) == ("process", 2)
    assert isinstance(dl.num_workers, int) and dl.stats()["workers"]["auto_count"]
    dl = _run(SleepyIO(), 0)  # threads waiting on I/O: up to 4 per core
    assert (dl.worker_type, dl.num_workers) == ("thread", 8)


def test_auto_with_a_slow_consumer_needs_one_worker():
    dl = _run(GilBound(worker=False), 0.1)  # 100 ms per step: one worker keeps up
    assert dl.num_workers == 1
    dl = _run(SleepyIO(), 0.06)
    assert (dl.worker_type, dl.num_workers) == ("thread", 1)


def test_auto_keeps_an_iterables_count_and_torchs_checks_stay():
    dl = _run(GilBoundStream(), 0)
    assert dl.num_workers == 2
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):
        kuat.DataLoader(range(4), num_workers=-1)
    with pytest.raises(ValueError, match="'auto'"):
        kuat.DataLoader(range(4), num_workers="many")


def test_decide_rules_on_given_numbers():
    """The rule itself, on synthetic measurements (no timing involved)."""
    from kuat.engine.base import WorkStats

    def choice(cpu, runq, wall, loop, n=2, auto_count=False, gil_held=0.0, cores=4,
               parallel=1.0, iterable=False, c=None, others=0.0):
        c = c or _auto.WorkerChoice(auto_type=True, auto_count=auto_count,
                                    worker_type="thread", num_workers=n)
        c._skip = 0
        for _ in range(_auto.PROBE_BATCHES):
            st = WorkStats()
            st.sched = (cpu, runq, wall)
            c.observe(st)
            c.loop(loop, loop)  # (wall and CPU seconds alike)
            # what the probe thread found: ``gil_held`` of its 10 takes per batch waited
            # (2 ms) for the GIL, the others got it at once
            for t in range(10):
                waited = 2e-3 if t < round(10 * gil_held) else 1e-5
                c.gil_waited(waited, _auto.PROBE_SLEEP_S + waited)
        # the window as long as the workers' CPU seconds (after the first) over ``parallel``
        c._t0 = time.perf_counter() - (_auto.PROBE_BATCHES - 1) * cpu / parallel
        return c.decide(num_workers=n, iterable=iterable, persistent=False, cores=cores,
                        other_cpu=others)

    # long batches convoying on the GIL: each waits about as long as the other runs
    assert choice(0.010, 0.001, 0.021, 0.0, gil_held=0.9)[0] == "process"
    # ... unless the workers' CPU seconds show they ran in parallel (not one at a time)
    assert choice(0.010, 0.001, 0.021, 0.0, gil_held=0.9, parallel=1.9)[0] == "thread"
    # short batches of Python one at a time, while the loop waits: the GIL is held throughout
    assert choice(0.002, 0.0, 0.0021, 0.0, gil_held=0.9)[0] == "process"
    # the short batches of issue 30 (0.6-1.5 ms of Python per batch, under the 5 ms switch
    # interval): fetches hardly blocked (the GIL waits fall between them), two workers never
    # on the CPU together, and the probe found the GIL held at nearly every look
    assert choice(0.0009, 0.00005, 0.001, 0.0, gil_held=0.9, parallel=0.7)[0] == "process"
    assert choice(0.0009, 0.00005, 0.001, 0.0, gil_held=0.9, parallel=0.7, n=4)[0] == "process"
    # ... on an idle machine the GIL is released at each hand-off and found held less often;
    # with workers that never ran together (CPU seconds per second at most 1.1) that is enough
    assert choice(0.0009, 0.00005, 0.001, 0.0, gil_held=0.3, parallel=0.8)[0] == "process"
    # ... but not for workers that did run together a good part of the time
    assert choice(0.0009, 0.00005, 0.001, 0.0, gil_held=0.3, parallel=1.3)[0] == "thread"
    # ... nor for workers kept apart by a loaded machine (they waited for a core)
    assert choice(0.0009, 0.0006, 0.0016, 0.0, gil_held=0.3, parallel=0.8)[0] == "thread"
    # ... the same numbers with the GIL found free (short GIL-free kernels, a loop's sleeps):
    # something else kept the workers from running together, not the GIL
    assert choice(0.0009, 0.00005, 0.001, 0.0, gil_held=0.2, parallel=0.7)[0] == "thread"
    # ... and short GIL-free batches that did run in parallel
    assert choice(0.0009, 0.00005, 0.001, 0.0, gil_held=0.5, parallel=1.8)[0] == "thread"
    # ... but not when the probe found the GIL free (the waits are not for the GIL)
    assert choice(0.010, 0.001, 0.021, 0.0, gil_held=0.1)[0] == "thread"
    # ... nor with one core
    assert choice(0.002, 0.0, 0.0021, 0.0, gil_held=0.9, cores=1)[0] == "thread"
    # ... nor on a machine whose cores are busy (the workers waited for one most of the time)
    _auto.BUSY_MACHINE = 0.25  # (the fixture's monkeypatch restores it)
    c = _auto.WorkerChoice(auto_type=True, auto_count=False, worker_type="thread", num_workers=2)
    assert choice(0.002, 0.006, 0.0081, 0.0, gil_held=0.9, c=c)[0] == "thread"
    # ... there the loop waited for its batches: fetched inline, in the loop's thread
    assert c.inline and "inline" in c.reason
    # ... unless the loop's own time is a large share of a batch (threads hide the fetch)
    c = _auto.WorkerChoice(auto_type=True, auto_count=False, worker_type="thread", num_workers=2)
    assert choice(0.002, 0.006, 0.0081, 0.001, gil_held=0.9, c=c)[0] == "thread"
    assert not c.inline
    # ... or an iterable dataset (it splits itself by worker)
    c = _auto.WorkerChoice(auto_type=True, auto_count=False, worker_type="thread", num_workers=2)
    assert choice(0.002, 0.006, 0.0081, 0.0, gil_held=0.9, iterable=True, c=c)[0] == "thread"
    assert not c.inline
    assert choice(0.002, 0.0002, 0.0026, 0.0, gil_held=0.9)[0] == "process"
    # ... nor when other processes used more than 0.5 of 2 cores while it was measured,
    # though the GIL-bound threads rarely waited for a core (one runnable at a time)
    c = _auto.WorkerChoice(auto_type=True, auto_count=False, worker_type="thread", num_workers=2)
    assert choice(0.002, 0.0002, 0.0026, 0.0, gil_held=0.9, cores=2, others=1.0, c=c)[0] == "thread"
    assert c.inline and "other processes used 1.0 of the 2" in c.reason
    assert choice(0.002, 0.0002, 0.0026, 0.0, gil_held=0.9, cores=2, others=0.4)[0] == "process"
    assert choice(0.002, 0.0002, 0.0026, 0.0, gil_held=0.9, cores=8, others=5.0)[0] == "process"
    # waiting on I/O: far longer than the other worker's CPU time
    assert choice(0.001, 0.0, 0.030, 0.0, gil_held=0.9)[0] == "thread"
    # running or runnable all along (a loaded machine): GIL-free
    assert choice(0.004, 0.006, 0.010, 0.0)[0] == "thread"
    # too cheap for processes
    assert choice(0.0001, 0.0, 0.0003, 0.0)[0] == "thread"
    # the count: 1.25 * cost / loop, within [1, cores]
    assert choice(0.004, 0.006, 0.010, 0.005, auto_count=True) == ("thread", 3)
    assert choice(0.004, 0.006, 0.010, 1.0, auto_count=True) == ("thread", 1)
    assert choice(0.004, 0.006, 0.010, 1e-5, auto_count=True) == ("thread", 4)


def test_other_processes_cpu_is_measured_over_the_window(monkeypatch):
    # the machine's busy seconds less this process's, per second, scaled to the usable cores
    start, end = (10.0, 1.0, 100.0, 4), (12.0, 1.5, 101.0, 4)
    assert _others_cores(start, end, 4) == pytest.approx(1.5)
    assert _others_cores(start, end, 2) == pytest.approx(0.75)
    assert _others_cores(start, (11.0, 3.0, 101.0, 4), 4) == 0.0  # (never below 0)
    # without snapshots (not Linux): the load average less this process's runnable thread
    monkeypatch.setattr(_auto, "machine_load", lambda: 2.5)
    assert _others_cores(None, end, 4) == pytest.approx(1.5)
    snap = _auto.cpu_snapshot()
    if snap is not None:  # Linux
        busy, own, _, cpus = snap
        assert busy > 0 and own > 0 and cpus >= 1
