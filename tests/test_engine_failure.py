"""Error transport (kuat/engine/failure.py): an exception raised in a worker reaches the consumer
as the original itself (0 workers, threads) or its equal (processes: type, args, attributes,
chain) plus a note naming the worker, the stage (the dataset, collate_fn, worker_init_fn,
pinning, the hand-over) and the sample indices, on every fetch path (map-style per sample,
iterable, the vision batch kernel split over workers, the consumer's take-over of cheap
batches, worker_init_fn); what cannot cross a process boundary becomes kuat.WorkerError.
torch's DataLoader is the floor: its ExceptionWrapper keeps the type only when ``type(msg)``
works, and then replaces args; kuat keeps the type in every one of those cases."""

import collections
import errno
import gc
import re
import subprocess
import sys
import threading
import traceback

import pyarrow as pa
import pytest
import torch
from _images import jpeg_dataset, noise_image
from PIL import UnidentifiedImageError
from torch._utils import ExceptionWrapper

import kuat
import kuat.sources._rows_fetch as krf
from kuat import _parallel
from kuat.vision.decode import roi_batch_available
from kuat.vision.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop

MODES = [(0, "thread"), (2, "thread"), (2, "process")]
MODE_IDS = ["inline", "threads", "processes"]


class KwOnly(Exception):
    """A required keyword argument: ``KwOnly(*e.args)`` raises TypeError."""

    def __init__(self, message, *, code):
        super().__init__(message)
        self.code = code


class RewritesArgs(Exception):
    """``__init__`` rewrites its argument: ``RewritesArgs(*e.args)`` gives other args."""

    def __init__(self, code):
        super().__init__(f"code {code}")
        self.code = code


class RefusesArgs(Exception):
    """``__new__`` needs two arguments, args hold one: no route rebuilds it."""

    def __new__(cls, a, b):
        return super().__new__(cls, a, b)

    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


class ReduceRaises(Exception):
    """``__reduce__`` raises (and so does ``__reduce_ex__``, which calls it)."""

    def __reduce__(self):
        raise TypeError("ReduceRaises refuses to be reduced")


class ReduceExRaises(Exception):
    """``__reduce_ex__`` itself raises."""

    def __reduce_ex__(self, protocol):
        raise TypeError("ReduceExRaises refuses to be reduced")


def _no_rebuild(*args):
    raise RuntimeError("this reduction cannot be rebuilt")


class ReducesToNothing(Exception):
    """Pickles, but its reduction cannot be called back into an exception."""

    def __reduce__(self):
        return _no_rebuild, self.args


def _after(e, **attrs):
    for k, v in attrs.items():
        setattr(e, k, v)
    return e


def _noted(e, note):
    e.add_note(note)
    return e


# (id, exception of sample i, attributes outside __dict__ that must survive)
KINDS = [
    ("DecodeError", lambda i: kuat.DecodeError(f"cannot decode image (sample {i})", index=i,
                                               source="/d/shard-00000.arrow"), ()),
    ("FormatError", lambda i: kuat.FormatError("truncated shard", path="/d/shard-00001.arrow",
                                               row=i), ()),
    ("SchemaError", lambda i: kuat.SchemaError(f"bad label at {i}", field="label"), ()),
    ("RemoteError", lambda i: kuat.RemoteError("GET failed", url=f"s3://b/{i}.arrow"),
     ("errno", "filename")),
    ("MissingDependencyError", lambda i: kuat.MissingDependencyError(
        "needs ray", name="ray", extra="ray"), ("name", "path")),
    ("WorkerError", lambda i: kuat.WorkerError("nested", original_type="x.Y", worker="w-1",
                                               indices=[i], worker_traceback="tb"), ()),
    ("LoaderTimeoutError", lambda i: kuat.LoaderTimeoutError(f"waited {i} s"), ()),
    ("SharedMemoryError", lambda i: kuat.SharedMemoryError("no space in /dev/shm"), ()),
    ("FileNotFoundError", lambda i: FileNotFoundError(errno.ENOENT, "No such file",
                                                      f"/data/{i}.jpg"),
     ("errno", "strerror", "filename")),
    ("KeyError", lambda i: KeyError("label"), ()),
    ("UnicodeDecodeError", lambda i: UnicodeDecodeError("utf-8", b"\xff\xfe", 0, 1,
                                                        "invalid start byte"),
     ("encoding", "object", "start", "end", "reason")),
    ("CalledProcessError", lambda i: subprocess.CalledProcessError(
        2, ["ffmpeg", "-i", f"{i}.mp4"], output=b"out", stderr=b"err"), ()),
    ("UnidentifiedImageError", lambda i: UnidentifiedImageError(
        f"cannot identify image file '/data/{i}.jpg'"), ("errno", "filename")),
    ("ArrowInvalid", lambda i: pa.ArrowInvalid(f"row {i}: not a list"), ()),
    ("KwOnly", lambda i: KwOnly(f"bad sample {i}", code=7), ()),
    ("RewritesArgs", lambda i: RewritesArgs(i), ()),
    ("attribute set after construction", lambda i: _after(ValueError(f"bad {i}"), sample=i,
                                                          shard="s-3"), ()),
    ("note added in the dataset", lambda i: _noted(IndexError(f"row {i}"), "from the dataset"),
     ()),
    # nothing needs pickling in the worker's own process: these come back as themselves from
    # threads and at 0 workers, and as kuat.WorkerError only from a process
    ("__reduce__ raises", lambda i: ReduceRaises(f"bad {i}"), ()),
    ("__reduce_ex__ raises", lambda i: ReduceExRaises(f"bad {i}"), ()),
    ("__reduce__ cannot be rebuilt", lambda i: ReducesToNothing(f"bad {i}"), ()),
    ("__new__ refuses args", lambda i: RefusesArgs(i, "x"), ()),
]
KIND_IDS = [k[0] for k in KINDS]
MAKERS = {name: make for name, make, _ in KINDS}
NO_PROCESS = {"__reduce__ raises", "__reduce_ex__ raises", "__reduce__ cannot be rebuilt",
              "__new__ refuses args"}  # what cannot cross a process boundary


def _cause(i):
    return OSError(errno.EIO, f"read failed at sample {i}")


_KEPT: list = []  # every Raises' list of the exceptions it raised (emptied after each test)


@pytest.fixture(autouse=True)
def _drop_kept_exceptions():
    """Each kept exception's traceback holds the frames it crossed, the consumer's iterator
    among them, and the thread workers hold the dataset: kept, they would keep the iterator
    and its idle workers (and GIL probes) alive after the test, as they keep torch's worker
    processes, and slow the tests after this file. Emptied, the iterator is collected and
    shuts its workers down."""
    yield
    for kept in _KEPT:
        kept.clear()
    _KEPT.clear()
    gc.collect()


class Raises:
    """Samples ``[i]``; sample ``bad`` raises ``MAKERS[kind](bad)`` from an OSError, and keeps
    it in ``raised`` (an object the thread workers' copies share: a plain list would be each
    worker's own, as in torch's worker processes)."""

    def __init__(self, kind, bad=3, n=8):
        self.kind, self.bad, self.n = kind, bad, n
        self.raised = collections.UserList()
        _KEPT.append(self.raised)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i != self.bad:
            return torch.tensor([i])
        try:
            raise _cause(i)
        except OSError as e:
            self.raised.append(MAKERS[self.kind](i))
            raise self.raised[-1] from e


class RaisesIterable(torch.utils.data.IterableDataset):
    """Items 0..n-1 (worker k of w yields k, k + w, ...); item ``bad`` raises KwOnly."""

    def __init__(self, bad=3, n=8):
        self.bad, self.n = bad, n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        k, w = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(k, self.n, w):
            if i == self.bad:
                raise KwOnly(f"bad item {i}", code=i)
            yield torch.tensor([i])


def _own(e):
    return {k: v for k, v in vars(e).items() if k != "__notes__"}


def _assert_equal(got, want, c_attrs=()):
    """``got`` is ``want``'s equal: type, args, message, instance attributes, C-level ones."""
    assert type(got) is type(want)
    assert got.args == want.args
    assert str(got) == str(want)
    assert _own(got) == _own(want)
    for a in c_attrs:
        assert getattr(got, a) == getattr(want, a), a


def _kuat_notes(e):
    return [n for n in getattr(e, "__notes__", []) if "kuat" in n]


def _raised(it):
    try:
        next(it)
    except BaseException as e:  # noqa: BLE001 (whatever the worker raised)
        return e
    raise AssertionError("no exception")


@pytest.mark.parametrize("num_workers,worker_type", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("kind,c_attrs", [(k[0], k[2]) for k in KINDS], ids=KIND_IDS)
def test_worker_error_is_the_originals_equal_with_a_note(kind, c_attrs, num_workers,
                                                         worker_type):
    ds = Raises(kind)
    dl = kuat.DataLoader(ds, batch_size=2, num_workers=num_workers, worker_type=worker_type)
    it = iter(dl)
    assert next(it).tolist() == [[0], [1]]
    got, want = _raised(it), MAKERS[kind](3)
    if worker_type == "thread":  # nothing crossed a process boundary: the object itself
        assert got is ds.raised[-1]
    elif kind in NO_PROCESS:
        assert isinstance(got, kuat.WorkerError) and got.indices == [2, 3]
        assert got.original_type == f"{__name__}.{type(want).__qualname__}"
        assert got.stage == "fetch" and f"{type(want).__name__}: {want}" in str(got)
        assert "raise self.raised[-1] from e" in got.worker_traceback
        assert "sample index 3 (of sample indices [2, 3]) from the dataset" in str(got)
        assert next(it).tolist() == [[4], [5]]
        return
    _assert_equal(got, want, c_attrs)
    # the chain survives (from a process: rebuilt without its traceback, whose text is in the
    # note)
    assert type(got.__cause__) is OSError
    assert (got.__cause__.errno, str(got.__cause__)) == (errno.EIO, str(_cause(3)))
    # the notes the dataset added come first; then exactly one kuat note
    assert got.__notes__[: len(getattr(want, "__notes__", []))] == getattr(want, "__notes__", [])
    (note,) = _kuat_notes(got)
    assert "while fetching sample index 3 (of sample indices [2, 3]) from the dataset" in note
    if num_workers:
        assert re.search(rf"kuat worker kuat-worker-\d \({'thread' if worker_type == 'thread' else 'process'}", note)
    else:
        assert "the kuat DataLoader's own thread (num_workers=0)" in note
    shown = "".join(traceback.format_exception(got))
    assert "raise self.raised[-1] from e" in shown  # the worker's own line, once
    assert shown.count("raise self.raised[-1] from e") == 1
    # the iterator stays usable after a dataset error, as torch's does
    assert next(it).tolist() == [[4], [5]]
    del it


def _torch_reraise(exc):
    """What torch's DataLoader raises for ``exc`` raised in one of its workers: the worker
    wraps it in ``ExceptionWrapper`` (torch/utils/data/_utils/worker.py), the main process
    calls ``reraise()``."""
    try:
        raise exc
    except BaseException:  # noqa: BLE001
        wrapper = ExceptionWrapper(where="in DataLoader worker process 0")
    try:
        wrapper.reraise()
    except BaseException as e:  # noqa: BLE001
        return e
    raise AssertionError("reraise raised nothing")


@pytest.mark.parametrize("kind", KIND_IDS)
def test_kuat_keeps_the_type_wherever_torch_does_and_the_args_torch_replaces(kind):
    dl = kuat.DataLoader(Raises(kind), batch_size=2, num_workers=1, sampler=[2, 3])
    got, want = _raised(iter(dl)), MAKERS[kind](3)
    theirs = _torch_reraise(MAKERS[kind](3))
    assert type(got) is type(want)
    if type(theirs) is not type(want):  # torch could not build type(msg)
        assert type(theirs) is RuntimeError
    else:
        assert isinstance(got, type(theirs))
    assert got.args == want.args  # torch's are its formatted traceback


def test_against_torchs_dataloader_keyerror_keeps_its_key():
    # KeyError is the case torch special-cases (KeyErrorMessage); measured on its real loader
    it = iter(torch.utils.data.DataLoader(Raises("KeyError"), batch_size=2, num_workers=1,
                                          sampler=[2, 3]))
    theirs = _raised(it)
    it._shutdown_workers()  # now, not when collected (torch then waits up to 5 s for it)
    del it
    ours = _raised(iter(kuat.DataLoader(Raises("KeyError"), batch_size=2, num_workers=1,
                                        sampler=[2, 3])))
    assert type(theirs) is type(ours) is KeyError
    assert ours.args == ("label",) and theirs.args != ("label",)


@pytest.mark.parametrize("num_workers,worker_type", MODES, ids=MODE_IDS)
def test_iterable_worker_error_is_the_originals_equal(num_workers, worker_type):
    dl = kuat.DataLoader(RaisesIterable(), batch_size=None, num_workers=num_workers,
                         worker_type=worker_type)
    got = None
    for _ in range(10):
        try:
            for _ in dl:
                pass
        except KwOnly as e:
            got = e
            break
    _assert_equal(got, KwOnly("bad item 3", code=3))
    (note,) = _kuat_notes(got)
    assert "while fetching the next batch of its IterableDataset" in note
    # the item is named by its position in the worker's items (worker 1 of 2 yields 1, 3, ...)
    assert f"raised at item {3 // max(1, num_workers)} of this worker's items in this epoch" in note


@pytest.mark.parametrize("num_workers,worker_type", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("batch_size", [2, 4])
def test_iterable_error_names_the_items_position_in_batches(num_workers, worker_type,
                                                           batch_size):
    # item 5: worker 1 of 2 yields 1, 3, 5 (position 2); one worker yields 0..5 (position 5)
    dl = kuat.DataLoader(RaisesIterable(bad=5), batch_size=batch_size, num_workers=num_workers,
                         worker_type=worker_type)
    got = None
    try:
        for _ in dl:
            pass
    except KwOnly as e:
        got = e
    assert got is not None and got.args == ("bad item 5",)
    (note,) = _kuat_notes(got)
    at = 5 // max(1, num_workers)
    assert f"its iterator raised at item {at} of this worker's items in this epoch" in note


def _collate_raising(batch):
    raise ValueError(f"cannot collate {len(batch)} samples")


@pytest.mark.parametrize("num_workers,worker_type", MODES, ids=MODE_IDS)
def test_a_collate_fn_error_names_collate_fn_not_the_dataset(num_workers, worker_type):
    dl = kuat.DataLoader(list(range(8)), batch_size=2, num_workers=num_workers,
                         worker_type=worker_type, sampler=[2, 3, 4, 5],
                         collate_fn=_collate_raising)
    got = _raised(iter(dl))
    assert type(got) is ValueError and got.args == ("cannot collate 2 samples",)
    (note,) = _kuat_notes(got)
    assert "in collate_fn, collating sample indices [2, 3]." in note
    assert "fetching" not in note


@pytest.mark.parametrize("num_workers,worker_type", MODES, ids=MODE_IDS)
def test_a_pinning_error_names_pin_memory(num_workers, worker_type, monkeypatch):
    # pinned in the worker with threads and at 0 workers, by the consumer as it copies the
    # batch out of a process worker's shared memory; failed here without an accelerator
    from kuat import device
    from kuat.engine import shm
    from kuat.loader import _options

    def pin_fails(*args, **kwargs):
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(_options, "accelerator_available", lambda: True)
    monkeypatch.setattr(device, "pin_batch", pin_fails)
    monkeypatch.setattr(shm, "read_batch", pin_fails)  # the consumer's copy (process workers)
    dl = kuat.DataLoader(list(range(8)), batch_size=2, num_workers=num_workers,
                         worker_type=worker_type, pin_memory=True, sampler=[6, 7])
    got = _raised(iter(dl))
    assert type(got) is RuntimeError and got.args == ("cudaHostAlloc failed",)
    (note,) = _kuat_notes(got)
    assert "while pinning the batch of sample indices [6, 7] (pin_memory=True)" in note
    if worker_type == "process":
        assert "own thread" in note and "from kuat worker kuat-worker-0" in note


def test_a_batch_a_process_cannot_hand_over_names_that_stage():
    # the batch pickles only when the worker sends it: that is the stage which fails
    dl = kuat.DataLoader(list(range(8)), batch_size=2, num_workers=1, worker_type="process",
                         sampler=[0, 1], collate_fn=lambda b: {"lock": threading.Lock()})
    got = _raised(iter(dl))
    assert type(got) is TypeError and "pickle" in str(got)
    (note,) = _kuat_notes(got)
    assert re.search(r"kuat worker kuat-worker-0 \(process \d+\) while handing the batch of "
                     r"sample indices \[0, 1\] to the loader", note)


class RaisesOneObject:
    """Every sample raises one stored exception object (as a dataset that failed to open)."""

    def __init__(self):
        self.error = OSError(errno.EIO, "cannot open /d/shard-00000.arrow")

    def __len__(self):
        return 8

    def __getitem__(self, i):
        raise self.error


@pytest.mark.parametrize("num_workers", [0, 2], ids=["inline", "threads"])
def test_one_exception_object_raised_again_has_the_note_of_this_raise_only(num_workers):
    ds = RaisesOneObject()
    it = iter(kuat.DataLoader(ds, batch_size=2, num_workers=num_workers, sampler=range(6)))
    for indices in ([0, 1], [2, 3], [4, 5]):
        got = _raised(it)
        assert got is ds.error
        (note,) = _kuat_notes(got)
        assert f"sample index {indices[0]} (of sample indices {indices}) from the dataset" in note


class Opaque:
    """Samples ``[i]``; sample 3 raises ``exc_of(3)``."""

    def __init__(self, exc_of):
        self.exc_of = exc_of

    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i == 3:
            raise self.exc_of(i)
        return torch.tensor([i])


def test_a_type_a_process_cannot_pickle_is_a_worker_error_a_thread_keeps_it():
    class Local(Exception):  # not importable by name: does not pickle
        def __init__(self, msg, *, code):
            super().__init__(msg)
            self.code = code

    def make(i):
        return Local(f"local {i}", code=i)

    for worker_type in ("thread", "process"):
        ds = Opaque(make)
        got = _raised(iter(kuat.DataLoader(ds, batch_size=2, num_workers=1,
                                           worker_type=worker_type, sampler=[2, 3])))
        if worker_type == "thread":
            _assert_equal(got, make(3))
        else:
            assert isinstance(got, kuat.WorkerError) and "Local: local 3" in str(got)
            assert got.indices == [2, 3]


def _with_lock(i):
    return _after(ValueError(f"locked {i}"), lock=threading.Lock(), sample=i)


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_an_attribute_that_does_not_pickle_stays_in_the_worker_process_named(worker_type):
    got = _raised(iter(kuat.DataLoader(Opaque(_with_lock), batch_size=2, num_workers=1,
                                       worker_type=worker_type, sampler=[2, 3])))
    assert type(got) is ValueError and got.args == ("locked 3",) and got.sample == 3
    (note,) = _kuat_notes(got)
    if worker_type == "thread":
        assert isinstance(got.lock, type(threading.Lock()))
    else:
        assert not hasattr(got, "lock")
        assert "Attributes left in the worker (they do not pickle): lock." in note


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_a_worker_init_fn_error_is_raised_for_every_batch_each_with_one_note(worker_type):
    def init(worker_id):
        raise KwOnly(f"init of worker {worker_id} failed", code=worker_id)

    it = iter(kuat.DataLoader(list(range(8)), batch_size=2, num_workers=1,
                              worker_type=worker_type, worker_init_fn=init))
    for _ in range(2):
        got = _raised(it)
        _assert_equal(got, KwOnly("init of worker 0 failed", code=0))
        (note,) = _kuat_notes(got)
        assert "kuat-worker-0" in note and "in worker_init_fn" in note
        assert "sample" not in note  # no batch was being fetched


def test_the_consumers_take_over_of_cheap_batches_raises_the_original():
    from kuat.loader import _adaptive

    ds = Raises("DecodeError", bad=13, n=16)
    it = iter(kuat.DataLoader(ds, batch_size=2, num_workers=2))
    assert next(it).tolist() == [[0], [1]]
    # as after _INLINE_PROBE cheap batches the consumer waited for: take over from the workers
    policy = it._adapt
    policy.may_go_inline = True
    policy._seen = policy._cheap = policy.blocked = _adaptive.INLINE_PROBE
    policy._loop_s, policy._work_s = 0.0, 1.0
    for k in range(1, 6):
        assert next(it).tolist() == [[2 * k], [2 * k + 1]]
    assert it._nw == 1 and policy.max_inflight == 1  # the batches that follow: in this thread
    got = _raised(it)
    _assert_equal(got, MAKERS["DecodeError"](13))
    assert type(got.__cause__) is OSError
    assert any("sample indices [12, 13]" in n for n in _kuat_notes(got))
    assert next(it).tolist() == [[14], [15]]


# -- the vision batch path: DecodeError from the fused batch kernel, first batch split ---------
@pytest.fixture(scope="module")
def broken_jpegs(tmp_path_factory):
    imgs = [noise_image(80, 60 + i % 7, i, quality=85) for i in range(12)]
    return jpeg_dataset(tmp_path_factory.mktemp("errattrs") / "ds", imgs, truncated=[5])


def _images(path):
    return kuat.open(path).with_transform(
        {"image": Compose([RandomResizedCrop(24), RandomHorizontalFlip()])})


@pytest.mark.parametrize("num_workers,worker_type", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("first", [True, False], ids=["first batch", "later batch"])
def test_decode_error_of_the_vision_batch_path_keeps_index_source_and_cause(
        broken_jpegs, num_workers, worker_type, first, monkeypatch):
    # sample 5 in the second half of its batch: split in 2 parts, a helper thread raises it
    bad_batch = [6, 7, 4, 5]
    order = bad_batch + [0, 1, 2, 3] if first else [0, 1, 2, 3] + bad_batch
    ds = _images(broken_jpegs)
    try:
        ds.__getitems__(bad_batch)
    except kuat.DecodeError as e:
        want = e
    parts, widths = [], []  # run_parts' splits; the widths the one-call rows fetch was given
    real = _parallel.run_parts
    monkeypatch.setattr(_parallel, "run_parts", lambda fns: parts.append(len(fns)) or real(fns))
    rows_call = krf.RowsFetch.__call__
    monkeypatch.setattr(krf.RowsFetch, "__call__",
                        lambda f, idx: widths.append(_parallel.width()) or rows_call(f, idx))
    dl = kuat.DataLoader(ds, batch_size=4, num_workers=num_workers, worker_type=worker_type,
                         sampler=order)
    it = iter(dl)
    if not first:
        assert next(it)["label"].tolist() == [0, 1, 2, 3]
    got = _raised(it)
    if first and worker_type == "thread" and num_workers == 2 and roi_batch_available():
        # the first batch was split over both workers' cores: by run_parts, or by the one-call
        # rows fetch's helper threads (its shard mapped already)
        assert parts == [2] or widths[:1] == [2]
    _assert_equal(got, want)
    assert got.index == 5 and got.source == want.source and got.source.endswith(".arrow")
    assert type(got.__cause__) is type(want.__cause__)
    assert str(got.__cause__) == str(want.__cause__)
    assert any("sample indices [6, 7, 4, 5]" in n for n in _kuat_notes(got))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="notes need Python 3.11")
def test_the_worker_traceback_is_shown_once_from_a_process():
    got = _raised(iter(kuat.DataLoader(Raises("KwOnly"), batch_size=2, num_workers=1,
                                       worker_type="process", sampler=[2, 3])))
    (note,) = _kuat_notes(got)
    assert "Worker traceback:" in note and "raise self.raised[-1] from e" in note
    assert got.__cause__.__traceback__ is None  # tracebacks do not pickle: the note has it


# -- the Ray converter's tasks send their errors the same way -------------------------------
def _conflicting_row(item, k, payload):
    try:
        int("one")
    except ValueError as e:
        raise kuat.SchemaError(f"{item} row 0: 'one' is not int64", field="v") from e


def test_a_ray_conversion_task_error_keeps_its_chain_and_names_the_task():
    import pickle

    from kuat.convert import _ray

    batch = {"item": [3], "payload": [pickle.dumps("c.jsonl")]}
    row = _ray._task(batch, fn=_conflicting_row, fn_kwargs={}, marker=None)
    got = pickle.loads(row["error"][0]).exception()  # what the driver raises (_ray._map)
    try:
        _conflicting_row("c.jsonl", 3, b"")
    except kuat.SchemaError as e:
        want = e
    _assert_equal(got, want)  # the message names the file and row, as the local engine's
    assert type(got.__cause__) is ValueError and str(got.__cause__) == str(want.__cause__)
    (note,) = _kuat_notes(got)
    assert re.match(r"Raised in kuat's Ray task for item 3 \(process \d+ on ", note)
    assert "Worker traceback:" in note and "raise kuat.SchemaError" in note


@pytest.mark.parametrize("kw", [dict(num_workers=0), dict(num_workers=2, worker_type="thread"),
                                dict(num_workers=2, worker_type="process")], ids=["inline", "threads", "processes"])
def test_the_note_names_the_sample_that_raised_not_only_its_batch(kw):
    """Sample 3 raises in the batch [4, 5, 3, 1]: the note names 3 (torch names nothing)."""
    it = iter(kuat.DataLoader(Opaque(lambda i: ValueError(f"corrupt sample {i}")), batch_size=4,
                              sampler=[4, 5, 3, 1], **kw))
    got = _raised(it)
    assert "corrupt sample 3" in str(got)
    (note,) = _kuat_notes(got)
    assert "while fetching sample index 3 (of sample indices [4, 5, 3, 1]) from the dataset" in note
