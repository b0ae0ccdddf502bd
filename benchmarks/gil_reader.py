"""An outside reader of a CPython process's GIL, for ``kuat bench --scaling`` (issue 31).

**What it reads.** CPython keeps its GIL in a ``struct _gil_runtime_state``
(``Include/internal/pycore_gil.h``, 3.9 to 3.13) whose first three fields are ``interval``
(the switch interval in microseconds, ``unsigned long``), ``last_holder`` (the thread state
that took it last) and ``locked`` (an ``int``: 1 while some thread holds the GIL, 0 while none
does). The main interpreter's copy lives in the static ``_PyRuntime`` (3.11:
``_PyRuntime.ceval.gil``; 3.12+: ``_PyRuntime._main_interpreter._gil``), at the same offset from
the executable's (or ``libpython``'s) load address in every process of that build.

**Where.** The target process finds it itself (:func:`locate`): it scans ``_PyRuntime`` for
three words ``[switch interval][its own thread state][1]`` whose last reads 0 while it has
released the GIL (a ``ctypes`` call into libc releases it, and reads the word meanwhile). It
passes ``(file, offset from that file's load address)`` to the reader, which finds the file's
load address in ``/proc/PID/maps`` of the target and of each of its worker processes.

**How it samples.** :func:`sample` reads each process's ``locked`` with ``process_vm_readv(2)``
(through ctypes: no compiler; unlike py-spy's default mode it never stops the process) every
``interval_s`` (default 200 us, about 5,000 readings a second against py-spy's 100 to 500), and
counts the readings that find it set. ``held / readings`` estimates the share of wall time the
GIL was held (and, from ``last_holder`` read in the same call, the share one thread held it:
the training loop's, the main thread); the binomial 95% interval of that estimate is reported
with it, because at a fraction of 0.3% (about 3 us per image at 1,000 images/s) py-spy's 1,000
to 2,000 instants give 3 to 6 held samples, and its reading then varies more with its own rate
and mode than with the code (docs/benchmarks.md, "The bench's own reading of the GIL").

Needs Linux, CPython 3.9+ with a GIL (not the free-threaded build) and permission to read the
target's memory (the same as py-spy's: the reader is its parent, or ``ptrace_scope`` 0, or
``CAP_SYS_PTRACE``). :func:`locate` returns ``None`` where the struct is not found; the bench
then uses py-spy.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import time

__all__ = ["locate", "address_in", "descendants", "sample", "binomial_ci95"]

_SCAN_BYTES = 1 << 20  # how far into _PyRuntime to look (3.11's struct: ~100 KiB)


def _maps(pid: int | str, perms: bool = False) -> list[tuple]:
    """``(start, end, file offset, path)`` of each mapping of ``pid`` (``"self"``), with
    ``perms`` (``"rw-p"``...) after them when asked."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            m = (lo, hi, int(parts[2], 16), parts[5].strip() if len(parts) > 5 else "")
            out.append((*m, parts[1]) if perms else m)
    return out


def _scan_end(maps, runtime: int) -> int | None:
    """Where the scan of ``_PyRuntime`` at ``runtime`` stops: ``_SCAN_BYTES`` on, or the end
    of the mapping holding it and of those right after it that continue the same object's
    data, readable: its own file's next mapping or an anonymous one (its ``.bss``). Not
    another file's, and not an unreadable one (a thread stack's guard page placed right after
    the ``.bss``: reading it would kill the process). None where no mapping holds it."""
    here = next((m for m in maps if m[0] <= runtime < m[1]), None)
    if here is None:
        return None
    end = min(here[1], runtime + _SCAN_BYTES)
    for lo, hi, _, path, perms in maps:  # (sorted by address, as /proc lists them)
        if lo == end and hi > end and perms.startswith("r") and path in ("", here[3]):
            end = min(hi, runtime + _SCAN_BYTES)
    return end


def _load_base(maps, path: str) -> int | None:
    """Where ``path`` is mapped from its first byte (its load address), or None."""
    starts = [lo for lo, _, off, p in maps if p == path and off == 0]
    return min(starts) if starts else None


def _released_read(addr: int, size: int) -> int:
    """The ``size``-byte word at ``addr``, read by libc's ``memcpy`` called through ctypes,
    which releases the GIL around the call: what the word holds while no thread has it (none
    can take it meanwhile: :func:`locate` runs before the process starts threads)."""
    out = ctypes.c_uint64(0)
    ctypes.CDLL(None).memcpy(ctypes.byref(out), ctypes.c_void_p(addr), ctypes.c_size_t(size))
    return out.value


def locate() -> dict | None:
    """Find this process's GIL ``locked`` word; call before starting any thread.

    Returns ``{"path": file, "offset": bytes from its load address, "python": version,
    "main_thread": the calling thread's ``PyThreadState *`` (what ``last_holder`` reads while it
    holds the GIL)}`` or ``None`` (not Linux, a free-threaded or unknown build, or no single match). Thread-safety:
    call from the main thread while it is the only Python thread.
    """
    gil_enabled = getattr(sys, "_is_gil_enabled", None)  # (3.13+: False in a free-threaded run)
    if not sys.platform.startswith("linux") or (gil_enabled is not None and not gil_enabled()):
        return None
    try:
        runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    except (ValueError, AttributeError):
        return None
    get = ctypes.pythonapi.PyThreadState_Get
    get.restype = ctypes.c_size_t
    me = get()
    interval = round(sys.getswitchinterval() * 1e6)
    maps = _maps("self", perms=True)
    # the struct runs on past its mapping's end when that is a file's .data followed by .bss
    end = _scan_end(maps, runtime)
    if end is None:
        return None
    n = (end - runtime) // 8
    words = (ctypes.c_uint64 * n).from_address(runtime)
    found = []
    for i in range(1, n - 1):
        if words[i] == me and words[i - 1] == interval and (words[i + 1] & 0xFFFFFFFF) == 1:
            addr = runtime + 8 * (i + 1)
            if _released_read(addr, 4) & 0xFFFFFFFF == 0 and _released_read(runtime + 8 * i, 8) == me:
                found.append(addr)
    if len(found) != 1:
        return None
    addr = found[0]
    # the file the word is mapped from: the mapping holding it, or the file mapped just
    # before an anonymous one (a statically linked python's .bss)
    path = ""
    for lo, _, _, p, _ in maps:
        if lo > addr:
            break
        if p.startswith("/"):
            path = p
    base = _load_base([m[:4] for m in maps], path) if path else None
    if base is None:
        return None
    return {"path": path, "offset": addr - base, "python": sys.version.split()[0],
            "main_thread": me}


def address_in(pid: int, where: dict) -> int | None:
    """The address of the located word in process ``pid``: the load address of
    ``where["path"]`` in its maps, plus ``where["offset"]``; None where it is not mapped (a
    process running another program) or ``pid`` is gone."""
    try:
        base = _load_base(_maps(pid), where["path"])
    except OSError:
        return None
    return None if base is None else base + where["offset"]


def descendants(pid: int) -> list[int]:
    """The live descendants of ``pid`` (its worker processes, theirs, ...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _reader():
    libc = ctypes.CDLL(None, use_errno=True)
    f = libc.process_vm_readv
    f.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                  ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
    f.restype = ctypes.c_ssize_t
    return f


def sample(targets: dict[int, int], seconds: float, interval_s: float = 200e-6,
           thread: tuple[int, int] | None = None, phase: int | None = None) -> dict:
    """Read the GIL word of each ``{pid: address}`` every ``interval_s`` for ``seconds``.

    ``thread``: ``(pid, PyThreadState address)`` of one thread (the training loop's: the
    child's main thread, :func:`locate`'s ``main_thread``) whose share is counted apart, from
    ``last_holder``, read with ``locked`` in the same call (``take_gil`` sets it right after
    taking the lock, when the taker is not already the last holder).

    ``phase``: the address, in ``thread``'s process, of a 4-byte int that thread sets to say
    what it is doing (the bench's child: 1 inside the loader's ``next()``, 2 while it frees a
    batch, 0 in its own code), read in the same ``process_vm_readv`` call as the GIL word, so
    that each of ``thread``'s held readings is told apart by what it was doing at that instant.

    Returns ``{"readings": instants, "held": {pid: readings that found it held}, "errors":
    {pid: failed reads}, "thread_held": readings that found ``thread`` holding it,
    "thread_held_by_phase": {phase value: those of them with ``phase`` reading that value}
    (empty without ``phase``), "wall_s", "cpu_s": this reader's own CPU seconds,
    "interval_s"}``.
    The instants are paced from one clock and never bunched to catch up after a late wake-up,
    so they fall independently of the target's work. Raises ``OSError`` when the first reading
    of every target fails (no permission to read their memory), or when ``thread``'s GIL word
    reads but its ``phase`` word does not.
    """
    readv = _reader()
    who, whom = thread if thread is not None else (None, None)
    if phase is not None and who not in targets:
        raise ValueError("phase needs thread=(pid, tstate) with pid among the targets")
    # each reading: [last_holder (8 bytes)][locked (4)], from 8 bytes before the located word;
    # for thread's process with a phase word, then [phase (4)] in the same call (bytes 16-19)
    bufs = {pid: (ctypes.c_uint64 * 3)() for pid in targets}
    plan = []
    for pid, addr in targets.items():
        base = ctypes.addressof(bufs[pid])
        loc, rem = [_Iovec(base, 12)], [_Iovec(addr - 8, 12)]
        if pid == who and phase is not None:
            loc.append(_Iovec(base + 16, 4))
            rem.append(_Iovec(phase, 4))
        n = len(loc)
        plan.append((pid, (_Iovec * n)(*loc), n, (_Iovec * n)(*rem), 12 + 4 * (n - 1), bufs[pid]))
    held = dict.fromkeys(targets, 0)
    errors = dict.fromkeys(targets, 0)
    thread_held = 0
    by_phase: dict[int, int] = {}
    first = [readv(pid, loc, n, rem, n, 0) for pid, loc, n, rem, size, _ in plan]
    if phase is not None:
        # a phase word it cannot read fails every reading of that process, which would read as
        # an idle GIL: raise, if the GIL word alone reads (else the error below says why)
        i = list(targets).index(who)
        pid, loc, n, rem, size, _ = plan[i]
        if first[i] != size and readv(pid, loc, 1, rem, 1, 0) == 12:
            raise OSError(f"process_vm_readv of pid {pid}: its GIL word reads but its phase "
                          f"word at {phase:#x} does not ({first[i]} of {size} bytes read)")
    if targets and all(got != p[4] for got, p in zip(first, plan)):
        err = ctypes.get_errno()
        raise OSError(err, f"process_vm_readv of pids {sorted(targets)}: {os.strerror(err)}")
    readings = 0
    clock = time.perf_counter
    c0, t0 = time.process_time(), clock()
    end, due = t0 + seconds, t0
    while True:
        now = clock()
        if now >= end:
            break
        for pid, loc, n, rem, size, buf in plan:
            if readv(pid, loc, n, rem, n, 0) != size:
                errors[pid] += 1
            elif buf[1] & 0xFFFFFFFF:
                held[pid] += 1
                if pid == who and buf[0] == whom:
                    thread_held += 1
                    if n == 2:
                        p = buf[2] & 0xFFFFFFFF
                        by_phase[p] = by_phase.get(p, 0) + 1
        readings += 1
        due += interval_s
        wait = due - clock()
        if wait <= 0:  # late: the next instant is one interval from now, not a burst to
            wait = interval_s  # catch up (nor one reading right after this late one)
            due = clock() + wait
        time.sleep(wait)
    return {"readings": readings, "held": held, "errors": errors, "thread_held": thread_held,
            "thread_held_by_phase": by_phase, "wall_s": clock() - t0, "cpu_s": time.process_time() - c0,
            "interval_s": interval_s}  # fmt: skip


def binomial_ci95(held: int, n: int) -> tuple[float, float]:
    """Wilson's 95% interval of a proportion ``held / n`` (E. B. Wilson, "Probable inference,
    the law of succession, and statistical inference", JASA 22, 1927), as ``(low, high)``.

    It assumes independent readings: where the GIL is held in stretches longer than the
    interval between readings (the tabular path holds it most of the time), neighbouring
    readings agree more often than chance and the true interval is wider. Raises
    ``ValueError`` unless ``0 <= held <= n`` and ``n > 0``."""
    if n <= 0 or not 0 <= held <= n:
        raise ValueError(f"held={held}, n={n}: need 0 <= held <= n and n > 0")
    z, p = 1.959964, held / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
