"""``kuat.format.prefetch.Prefetcher``: concurrent fetches in epoch order, bounded by its depth,
freed by readers in this process (a notification) or in another process (the mtime of the
entry's use mark).

The fetch function stands in for ``ShardCache.get``: it blocks where the test says, so what is
asserted is which fetches have started, never how long anything took.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

import kuat.format.prefetch as prefetch_mod
from kuat.format.prefetch import Prefetcher, use_mark

WAIT_S = 10.0  # bound on every wait for something that must happen


class Fetches:
    """``fetch(k)`` records ``k``, then blocks until :meth:`release`; returns a file per shard."""

    def __init__(self, root: Path, gate: threading.Barrier | None = None):
        self.root = root
        self.gate = gate
        self.started: list[int] = []
        self.cond = threading.Condition()
        self.released = threading.Event()

    def __call__(self, k: int) -> Path:
        with self.cond:
            self.started.append(k)
            self.cond.notify_all()
        if self.gate is not None:
            self.gate.wait(WAIT_S)  # with the test: passes when `parties - 1` fetches run at once
        assert self.released.wait(WAIT_S)
        path = self.root / f"{k}.arrow"
        path.write_bytes(b"x")
        use_mark(path).touch()  # as ShardCache.get leaves it
        return path

    def release(self) -> None:
        self.released.set()

    def wait_started(self, n: int) -> list[int]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.started) >= n, WAIT_S), self.started
            return list(self.started)


def test_depth_fetches_run_at_once_in_epoch_order(tmp_path):
    fetches = Fetches(tmp_path, gate=threading.Barrier(4))  # 3 fetches + this thread
    p = Prefetcher(fetches, depth=3)
    p.start([5, 2, 7, 1, 0])
    assert sorted(fetches.wait_started(3)) == [2, 5, 7]  # the first three, all in flight
    fetches.gate.wait(WAIT_S)  # BrokenBarrierError unless those three block here together
    fetches.release()
    # the window is full of fetched, unused shards: shard 1 waits for a reader
    with fetches.cond:
        assert not fetches.cond.wait_for(lambda: len(fetches.started) > 3, 0.2)
    p.used(5)
    assert fetches.wait_started(4)[3] == 1
    p.used(2)
    assert fetches.wait_started(5)[4] == 0
    p.close()


@pytest.mark.parametrize("inotify", [True, False])
def test_use_by_another_process_is_seen_through_the_cache_entry(tmp_path, monkeypatch, inotify):
    if not inotify:  # another platform: the window is re-checked every 50 ms instead

        def unavailable(*args):
            raise OSError("inotify is not available on this platform")

        monkeypatch.setattr(prefetch_mod, "_AttribWatch", unavailable)
    fetches = Fetches(tmp_path)
    fetches.release()
    p = Prefetcher(fetches, depth=1)
    p.start([3, 4])
    fetches.wait_started(1)
    entry = use_mark(tmp_path / "3.arrow")
    # a process worker's cache hit touches the entry's use mark (ShardCache._hit); nothing
    # calls used().
    # Touch until shard 4 starts: a touch before the prefetcher noted the entry's mtime is
    # not a use, one after it is.
    for bump in range(1, 100):
        with fetches.cond:
            if fetches.cond.wait_for(lambda: len(fetches.started) > 1, 0.1):
                break
            if entry.exists():
                st = os.stat(entry)
                os.utime(entry, ns=(st.st_atime_ns, st.st_mtime_ns + bump * 1_000_000))
    assert fetches.wait_started(2) == [3, 4]
    assert (p._watch is not None) == (inotify and sys.platform == "linux")
    p.close()


def test_a_new_epoch_replaces_the_order_and_skips_open_shards(tmp_path):
    fetches = Fetches(tmp_path)
    fetches.release()
    p = Prefetcher(fetches, depth=2)
    p.start([0, 1])
    fetches.wait_started(2)
    p.start([1, 2, 3], used=[1])  # shard 1 is still mapped: not fetched again
    assert fetches.wait_started(4)[2:] == [2, 3]
    p.close()


@pytest.mark.parametrize("depth", [0, -1, 1.5, True])
def test_depth_must_be_a_positive_int(depth):
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(lambda k: Path("x"), depth)


@pytest.mark.parametrize("via", ["cache_dir", "KUAT_CACHE"])
def test_an_unusable_shard_cache_names_itself_the_shard_and_the_url(tmp_path, monkeypatch, via):
    """A cache directory that cannot be made (here under a file; read-only alike) raises the
    OSError subclass of its errno naming the cache, the shard and the URL, chained, at the
    first read; ``os.utime``'s own error named nothing."""
    import numpy as np

    import kuat
    import kuat.format as kf

    url = f"memory://kuat-test-cache-unusable-{tmp_path.name}-{via}/d.kuat"
    with kuat.Writer(url, kuat.Schema({"y": kf.int64()})) as w:
        w.write_batch({"y": np.arange(10)})
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    if via == "KUAT_CACHE":
        monkeypatch.delenv("KUAT_CACHE_DIR", raising=False)
        monkeypatch.setenv("KUAT_CACHE", str(blocker / "root"))
        ds, where = kuat.open(url), blocker / "root" / "shards"
    else:
        ds, where = kuat.open(url, cache_dir=blocker / "c"), blocker / "c"
    with pytest.raises(NotADirectoryError) as info:
        ds[3]
    message = str(info.value)
    assert f"shard cache {where} " in message and "shard-00000.arrow" in message
    assert f"{url}/shard-00000.arrow" in message
    assert isinstance(info.value.__cause__, NotADirectoryError)
