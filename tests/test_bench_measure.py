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
