"""``benchmarks.gil_reader``: it finds a child's GIL word and reads it from outside.

Children whose GIL state is known at every instant: one spinning in pure Python holds it all
the time (the reading holds however busy the machine is: a preempted holder still holds it),
one sleeping in ``time.sleep`` (which releases it) almost never. Nothing is timed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import gil_reader  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

# prints where its GIL is, then (argv[1]) spins or sleeps; "fork": a worker process spins;
# "thread": another thread spins while the main thread sleeps
CHILD = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[2])
from benchmarks import gil_reader
import ctypes
PHASE = ctypes.c_int32(0)
where = gil_reader.locate()
if where is not None:
    where["phase"] = ctypes.addressof(PHASE)
print(json.dumps(where), flush=True)
mode = sys.argv[1]
if mode == "fork" and os.fork() == 0:
    mode = "spin"
if mode == "thread":
    def spin():
        while True:
            pass
    threading.Thread(target=spin, daemon=True).start()
    mode = "sleep"
t0 = time.monotonic()
while time.monotonic() - t0 < 20:
    if mode == "phases":  # spins all the time, saying 1 for 20 ms, then 2 for 20 ms
        PHASE.value = 1 + (int((time.monotonic() - t0) / 0.02) & 1)
        for _ in range(1000):
            pass
    elif mode == "spin":
        for _ in range(10000):
            pass
    else:
        time.sleep(0.05)
"""


def _child(mode: str):
    p = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(REPO)],
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    return p, json.loads(p.stdout.readline())


def _read(mode: str, seconds: float = 0.5) -> tuple[dict, dict, int]:
    p, where = _child(mode)
    try:
        assert where is not None, "locate() found no GIL struct in this CPython"
        targets = {p.pid: gil_reader.address_in(p.pid, where)}
        if mode == "fork":
            import time

            for _ in range(200):  # the worker process appears
                kids = gil_reader.descendants(p.pid)
                if kids:
                    break
                time.sleep(0.01)
            targets.update({k: gil_reader.address_in(k, where) for k in kids})
        thread = (p.pid, where["main_thread"])
        phase = where["phase"] if mode == "phases" else None
        return gil_reader.sample(targets, seconds, thread=thread, phase=phase), targets, p.pid
    finally:
        for k in gil_reader.descendants(p.pid):
            subprocess.run(["kill", "-9", str(k)], check=False)
        p.kill()
        p.wait()


def test_locate_names_a_file_mapped_in_this_process() -> None:
    import os

    p, where = _child("sleep")
    p.kill()
    p.wait()
    assert where is not None and Path(where["path"]).is_file() and where["offset"] > 0
    assert where["python"] == sys.version.split()[0]
    # the same build mapped here: the word's address here reads this process's GIL, held now
    import ctypes

    addr = gil_reader.address_in(os.getpid(), where)
    assert addr is not None and ctypes.c_int.from_address(addr).value == 1
    assert gil_reader.address_in(os.getpid(), {**where, "path": "/nonexistent"}) is None


def test_a_spinning_process_holds_its_gil_and_a_sleeping_one_does_not() -> None:
    spin, _, pid = _read("spin")
    assert spin["readings"] >= 100 and spin["errors"][pid] == 0
    assert spin["held"][pid] / spin["readings"] > 0.97
    assert spin["thread_held"] / spin["held"][pid] > 0.97  # by its main thread
    idle, _, pid = _read("sleep")
    assert idle["held"][pid] / idle["readings"] < 0.05


def test_the_main_threads_share_is_told_from_other_threads() -> None:
    r, _, pid = _read("thread")
    # the spinning thread (not all the time: each time the main thread wakes and asks for the
    # GIL, it is free until the main thread gets a core, which a busy machine delays)
    assert r["held"][pid] / r["readings"] > 0.5
    assert r["thread_held"] / r["held"][pid] < 0.05  # not the sleeping main thread


def test_the_loop_threads_readings_are_told_apart_by_its_phase_word() -> None:
    """The child spins (holding its GIL) and says 1 for 20 ms, then 2 for 20 ms: each held
    reading carries the phase word read in the same call, so both show, about half each,
    and nothing else."""
    r, _, pid = _read("phases", seconds=1.0)
    by = r["thread_held_by_phase"]
    assert set(by) <= {1, 2} and sum(by.values()) == r["thread_held"] > 0.97 * r["readings"]
    assert 0.25 < by.get(1, 0) / r["thread_held"] < 0.75
    # without a phase word, no split; a phase word needs the thread's process
    assert _read("spin")[0]["thread_held_by_phase"] == {}
    with pytest.raises(ValueError, match="phase needs thread"):
        gil_reader.sample({pid: 4096}, 0.01, phase=4096)
    # a readable GIL word (this process's own memory) with an unmapped phase word raises
    # instead of reading that process as idle
    import ctypes
    import os

    word = ctypes.create_string_buffer(16)
    me, addr = os.getpid(), ctypes.addressof(word) + 8
    assert gil_reader.sample({me: addr}, 0.01, thread=(me, 0))["errors"][me] == 0
    with pytest.raises(OSError, match="GIL word reads but its phase word at 0x10 does not"):
        gil_reader.sample({me: addr}, 0.01, thread=(me, 0), phase=0x10)
    # a process it cannot read at all is not blamed on the phase word
    with pytest.raises(OSError, match=r"process_vm_readv of pids \[4"):
        gil_reader.sample({2**22 + 12345: 4096}, 0.01, thread=(2**22 + 12345, 0), phase=4096)


def test_worker_processes_are_read_apart_from_their_parent() -> None:
    r, targets, pid = _read("fork")
    (worker,) = [k for k in targets if k != pid]
    assert r["held"][worker] / r["readings"] > 0.97  # the spinning worker
    assert r["held"][pid] / r["readings"] < 0.05  # its sleeping parent


def test_an_unreadable_process_raises_instead_of_reading_zero() -> None:
    with pytest.raises(OSError, match="process_vm_readv"):
        gil_reader.sample({2**22 + 12345: 4096}, 0.01)  # no such pid


def test_binomial_interval() -> None:
    lo, hi = gil_reader.binomial_ci95(30, 10_000)
    assert lo < 0.003 < hi and hi - lo < 0.0025
    assert gil_reader.binomial_ci95(0, 100)[0] == 0.0
    assert gil_reader.binomial_ci95(100, 100)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="n=0"):
        gil_reader.binomial_ci95(0, 0)
    with pytest.raises(ValueError, match="held=5, n=3"):  # (more held than readings)
        gil_reader.binomial_ci95(5, 3)


def test_the_scan_stays_in_the_runtimes_own_readable_mappings() -> None:
    lib = "/usr/lib/libpython3.so"
    data, bss = (0x1000, 0x3000, 0x100, lib, "rw-p"), (0x3000, 0x5000, 0, "", "rw-p")
    end = gil_reader._scan_end
    assert end([data], 0x2000) == 0x3000
    assert end([data, bss], 0x2000) == 0x5000  # the .bss after the file's .data
    guard = (0x5000, 0x6000, 0, "", "---p")  # a thread stack's guard page right after it
    assert end([data, bss, guard], 0x2000) == 0x5000
    other = (0x5000, 0x6000, 0, "/usr/lib/libffi.so", "r--p")  # another file's
    assert end([data, bss, other], 0x2000) == 0x5000
    assert end([data], 0x9000) is None


# an unreadable page mapped right after the .bss holding _PyRuntime (where a thread stack's
# guard page can land): locate() used to read on into it and die of SIGSEGV
GUARDED = r"""
import ctypes, json, sys
sys.path.insert(0, sys.argv[1])
from benchmarks import gil_reader
rt = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
maps = gil_reader._maps("self")
end = next(hi for lo, hi, _, _ in maps if lo <= rt < hi)
for lo, hi, _, _ in maps:
    if lo == end:
        end = hi
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
placed = end - rt < (1 << 20) and libc.mmap(end, 4096, 0, 0x2 | 0x20 | 0x100000, -1, 0) == end
print(json.dumps([bool(placed), gil_reader.locate() if placed else None]), flush=True)
"""


def test_locate_survives_an_unreadable_page_after_the_runtime() -> None:
    p = subprocess.run([sys.executable, "-c", GUARDED, str(REPO)], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-500:]
    placed, where = json.loads(p.stdout)
    if not placed:
        pytest.skip("no free page right after _PyRuntime's mappings in this layout")
    assert where is not None and where["offset"] > 0


def test_a_late_reading_is_not_followed_by_another_at_once(monkeypatch) -> None:
    # a fake clock: sleeping advances it, one sleep oversleeps by 10 intervals (the reader
    # descheduled); each reading's instant is recorded
    now, at = [0.0], []

    class FakeTime:
        @staticmethod
        def perf_counter():
            return now[0]

        @staticmethod
        def process_time():
            return 0.0

        @staticmethod
        def sleep(s):
            now[0] += s + (10e-3 if len(at) == 5 else 0.0)

    def readv(pid, loc, n, rem, m, flags):
        at.append(now[0])
        now[0] += 1e-5  # a reading's own cost
        return 12

    monkeypatch.setattr(gil_reader, "time", FakeTime)
    monkeypatch.setattr(gil_reader, "_reader", lambda: readv)
    r = gil_reader.sample({1: 4096}, 0.05, interval_s=1e-3)
    gaps = [b - a for a, b in zip(at[1:], at[2:])]  # (the first is the permission check)
    assert r["readings"] == len(at) - 1 and min(gaps) >= 1e-3 - 1e-9
