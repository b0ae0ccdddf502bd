"""A batch gather asks the kernel for its rows' pages at once (madvise(MADV_WILLNEED)).

Why it exists: an epoch's first batch on a shard that is not in the page cache faulted its
rows in one at a time (benchmarks/first_batch.py). These tests check which pages are asked
for, against the addresses of the very views the gather returns, and, on a real file whose
pages were dropped from the page cache, that the hint (and only the hint) reads them.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import sys
import time

import numpy as np
import pytest
from PIL import Image

import kuat
from kuat import format as kf
from kuat.format import shard as kshard

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or kshard._madvise is None,
    reason="madvise(MADV_WILLNEED) through libc is Linux-only",
)
PAGE = mmap.PAGESIZE


def _png(i: int) -> bytes:
    arr = np.random.default_rng(i).integers(0, 255, (3 + i % 4, 4 + i % 5, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def _address(view) -> int:
    """Address of the first byte of a zero-copy view of the mapping."""
    return np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0


def test_gather_advises_exactly_each_rows_pages(tmp_path, monkeypatch):
    schema = kuat.Schema({"image": kf.image(), "blob": kf.binary(), "tokens": kf.sequence("int32"),
                          "text": kf.string()})
    n = 40
    rows = [{"image": _png(i), "blob": os.urandom(i * 300 % 5000),  # row 0: empty
             "tokens": np.arange(i * 50, dtype=np.int32), "text": f"row {i}"} for i in range(n)]
    with kuat.Writer(tmp_path / "d", schema, shard_bytes=40_000) as w:
        for r in rows:
            w.write(r)
    ds = kuat.open(tmp_path / "d")
    assert ds.num_shards > 1  # rows of several shards in one gather
    calls = []
    monkeypatch.setattr(kshard, "_madvise", lambda a, n, adv: calls.append((a, n, adv)) or 0)

    idx = [37, 0, 5, 22, 5, 13]
    got = ds.read_batch(idx)
    views = [(got["image"].data[j], 1) for j in range(len(idx))]
    expected = set()
    for view, itemsize in views:
        nbytes = len(view) * itemsize
        if nbytes:
            start = _address(memoryview(view).cast("B"))
            lo = start & ~(PAGE - 1)
            expected.add((lo, start + nbytes - lo, mmap.MADV_WILLNEED))
    # one call per image span, from the page holding its first byte to its last byte
    assert expected == set(calls)
    assert all(a % PAGE == 0 and adv == mmap.MADV_WILLNEED for a, _, adv in calls)
    # nothing else: binary, sequence and string rows this short (under 64 KiB on average)
    # cost more to advise than to fault in, so they ask nothing
    assert len(calls) == len(idx)
    # and the values are the rows written
    for j, i in enumerate(idx):
        assert bytes(got["image"].data[j]) == rows[i]["image"]
        assert bytes(got["blob"][j]) == rows[i]["blob"]
        np.testing.assert_array_equal(got["tokens"][j], rows[i]["tokens"])
        assert got["text"][j] == rows[i]["text"]


def _libc_mincore():
    fn = ctypes.CDLL(None, use_errno=True).mincore
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


def _resident(view) -> float:
    """Fraction of the pages under ``view`` that are in the page cache (mincore)."""
    start = _address(view)
    lo = start & ~(PAGE - 1)
    length = start + len(view) - lo
    vec = np.zeros(-(-length // PAGE), np.uint8)
    assert _libc_mincore()(lo, length, vec.ctypes.data) == 0, ctypes.get_errno()
    return float((vec & 1).mean())


def test_large_binary_rows_are_advised_short_ones_not(tmp_path, monkeypatch):
    schema = kuat.Schema({"big": kf.binary(), "small": kf.binary()})
    with kuat.Writer(tmp_path / "d", schema) as w:
        for _ in range(8):
            w.write({"big": os.urandom(96 << 10), "small": os.urandom(2000)})
    ds = kuat.open(tmp_path / "d")
    calls = []
    monkeypatch.setattr(kshard, "_madvise", lambda a, n, adv: calls.append((a, n)) or 0)
    got = ds.read_batch([6, 1, 3])
    starts = {_address(v) & ~(PAGE - 1) for v in got["big"]}
    assert {a for a, _ in calls} == starts and len(calls) == 3  # the big rows only


@pytest.mark.parametrize("hint", [True, False])
def test_advice_reads_dropped_pages_from_disk(tmp_path, monkeypatch, hint):
    rows, size = 24, 256 << 10  # 6 MiB of binary rows in one shard
    with kuat.Writer(tmp_path / "d", kuat.Schema({"blob": kf.binary()})) as w:
        for i in range(rows):
            w.write({"blob": np.random.default_rng(i).bytes(size)})
    ds = kuat.open(tmp_path / "d")
    (shard_path,) = ds.shard_paths
    ds.read_batch([0])  # opens (maps) the shard; rows 4, 12, 20 stay untouched
    fd = os.open(shard_path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop its clean, unmapped pages
    finally:
        os.close(fd)
    col = ds._store.shard(0).columns["blob"]  # views of rows 4, 12, 20 that advise nothing
    starts, ends = col.spans([4, 12, 20])
    views = [col.mv[s:e] for s, e in zip(starts, ends)]
    if max(_resident(v) for v in views) > 0.5:
        pytest.skip("this file system kept the shard's pages cached (posix_fadvise DONTNEED)")
    if not hint:
        monkeypatch.setattr(kshard, "_madvise", None)
    got = ds.read_batch([4, 12])["blob"]  # zero-copy: the gather itself reads no value
    assert [_address(g) for g in got] == [_address(v) for v in views[:2]]
    deadline = time.monotonic() + 10.0  # the kernel reads in the background: bounded wait
    while hint and min(_resident(v) for v in views[:2]) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if hint:
        assert [_resident(v) for v in views[:2]] == [1.0, 1.0]
        assert _resident(views[2]) < 0.5  # only the rows asked for, not the whole shard
    else:
        assert max(_resident(v) for v in views) < 0.5  # nothing reads them before use
    assert bytes(got[1]) == np.random.default_rng(12).bytes(size)


def _jpeg(i: int) -> bytes:
    arr = np.random.default_rng(i).integers(0, 255, (40 + i, 56, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=80)
    return buf.getvalue()


def test_a_transform_that_advises_its_own_reads_is_not_advised_again(tmp_path, monkeypatch):
    """``RandomResizedCrop`` + flips on the ROI decoder's one-call path asks the kernel for the
    batch's pages itself, in C without the GIL (``_roijpeg.c`` ``advise_willneed``): the
    gather then makes no per-row system call under the worker's Python. Other transforms (a
    Python-planned ``Resize``), and plain reads, are advised by the gather as before."""
    from kuat import vision as kv

    with kuat.Writer(tmp_path / "d", kuat.Schema({"image": kf.image()})) as w:
        for i in range(12):
            w.write({"image": _jpeg(i)})
    calls = []
    monkeypatch.setattr(kshard, "_madvise", lambda a, n, adv: calls.append(a) or 0)
    rrc = kv.Compose([kv.RandomResizedCrop(32), kv.RandomHorizontalFlip()])
    resize = kv.Compose([kv.Resize((32, 32))])
    idx = [3, 0, 7, 11]
    for t, advised in [(rrc, not kv.protocol.advises_reads(rrc)), (resize, True), (None, True)]:
        ds = kuat.open(tmp_path / "d")
        if t is not None:
            ds = ds.with_transform({"image": t})
        calls.clear()
        batch = ds.kuat_fetch_collated(idx) if t is not None else ds.read_batch(idx)
        assert len(calls) == (len(idx) if advised else 0), repr(t)
        if t is not None:
            assert batch["image"].shape == (4, 3, 32, 32)
    from kuat.vision import decode as kdecode

    if getattr(kdecode._roi, "plan_decode_rrc", None) is not None:
        assert kv.protocol.advises_reads(rrc) and not kv.protocol.advises_reads(resize)
