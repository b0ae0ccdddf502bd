"""benchmarks.measure.anon_by_mapping: a process's anonymous memory, by what holds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import measure  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/smaps"),
                                reason="needs /proc/<pid>/smaps (Linux)")

BATCH = 64 * 3 * 32 * 32  # a small "batch buffer" (page multiple)


_CHILD = r"""
import mmap, os, sys, threading, json
import numpy as np
sys.path.insert(0, sys.argv[1])
from benchmarks import measure
BATCH = int(sys.argv[2])
before = measure.anon_by_mapping(os.getpid(), BATCH)
bufs = [mmap.mmap(-1, BATCH, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(3)]
for b in bufs:
    np.frombuffer(b, np.uint8)[:] = 1  # touched: resident
held = []
def grow():  # small mallocs in a new thread land in its own arena
    held.append([bytearray(1000) for _ in range(2000)])
t = threading.Thread(target=grow)
t.start()
t.join()
after = measure.anon_by_mapping(os.getpid(), BATCH)
print(json.dumps([before, after]))
"""


def test_batch_sized_mappings_and_thread_arenas_are_attributed():
    # In a fresh interpreter: in this long-lived one, glibc hands a new thread an arena that
    # an exited thread left with free space, so its 2 MB of objects need not grow anything.
    out = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), str(BATCH)], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    before, after = json.loads(out)
    assert set(before) == set(measure.ANON_KINDS) and all(v >= 0 for v in before.values())
    # the kernel may merge a buffer with a neighbouring anonymous mapping: then it is "other"
    grew = {k: after[k] - before[k] for k in after}
    assert grew["batch_sized"] + grew["other"] >= 3 * BATCH
    assert grew["arenas"] + grew["heap"] >= 1_500_000
    total = sum(after.values()) - sum(before.values())
    assert total >= 3 * BATCH + 1_500_000  # the buffers and the thread's 2 MB of objects
    assert measure.anon_by_mapping(-1) is None  # no such process


_TORCH_CHILD = r"""
import json, os, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from benchmarks import measure

class Images(torch.utils.data.Dataset):
    def __len__(self):
        return 16 * 8
    def __getitem__(self, i):
        return torch.full((64, 64, 3), i % 251, dtype=torch.uint8)

base = measure.tree_pss(os.getpid())
loader = torch.utils.data.DataLoader(Images(), batch_size=16, num_workers=2, prefetch_factor=2)
it = iter(loader)
held = next(it)
int(held.sum())  # the loop reads its batch: its pages are mapped here and resident
batch = held.numel()
deadline = time.monotonic() + 20  # workers fill their prefetch queue: bounded wait
now = measure.tree_pss(os.getpid())
while now["shm_system"] - base["shm_system"] < 5 * batch and time.monotonic() < deadline:
    time.sleep(0.05)
    now = measure.tree_pss(os.getpid())
print(json.dumps({"batch": batch, "base": base, "now": now}))
del it
"""


def test_unmapped_shared_memory_of_torch_workers_is_counted():
    """torch's process workers keep prefetched batches in /dev/shm files that no process maps
    until the loop takes them: PSS cannot see them, ``shm_system`` (and ``anon_shared``) must
    (the held batch + prefetch_factor x num_workers = 5 batches in all)."""
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", _TORCH_CHILD, str(ROOT)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    batch, base, now = r["batch"], r["base"], r["now"]
    assert set(now) == set(measure.MEMORY_KINDS)
    assert now["shm_system"] - base["shm_system"] >= 5 * batch
    # PSS sees at most the batch the loop holds (mapped): the four in flight are invisible
    assert now["shmem"] - base["shmem"] <= 1.5 * batch
    assert now["anon_shared"] == now["anon"] + now["shm_system"]
