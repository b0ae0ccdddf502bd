"""Global-RNG isolation: reproducible draws from ``random``/``np.random``/``torch``, paid only
by datasets that draw.

Python's ``random``, NumPy's legacy global generator and torch's default CPU generator are
process-wide. A plain torch dataset that draws from them (torchvision's transforms do) gives
draws that depend on which worker ran which sample, unless the loader reseeds them per sample.
Reseeding costs about 7 us per sample (``random.seed`` 3.8, ``np.random.seed`` 1.6,
``torch.manual_seed`` 1.1 on a 2-core machine), 40 times what ``range(n)[i]`` costs, so it is
done only for datasets seen to draw:

1. **Probe.** Each worker's first batch runs isolated (reseeded per sample under the
   exclusive lock) and each sample's :func:`fingerprint` is compared before and after it.
   A change means the dataset draws: :attr:`RngUse.draws` becomes True for good.
2. **Watch.** Later batches of a dataset not (yet) seen drawing run without reseeding, under
   the shared side of :data:`GLOBAL_RNG_LOCK`, with one fingerprint before and one after the
   batch (about 2 us each). If they differ, something drew: the batch is fetched again,
   isolated and probed (so its samples get exactly the draws isolation gives them) and its
   first result is dropped. Only a dataset whose own samples draw in that re-fetch is marked;
   draws of another thread (the training loop's) are not the dataset's.  In thread mode the
   training loop may draw while a batch runs; after :data:`MAX_FALSE_ALARMS` re-fetches that
   found no draw, watching stops for that loader (logged at INFO), and only the probe decides.
3. **Isolated.** A dataset that draws runs every sample (``__getitem__`` path) or every batch
   (``__getitems__`` path, seeded from the batch's indices, which do not depend on the worker
   count) reseeded from ``(seed, epoch, key)`` under the exclusive lock.

The result is the same whatever the number and type of workers; the caller's own generator
states are saved and restored around isolated runs in thread and inline mode.

Fingerprints read the generators' position counters, not their 2.5-5 KB states: NumPy's
through ``MT19937.ctypes`` (public), Python's ``random`` through its object's memory at an
offset found once by calibration on CPython (falling back to ``random.getstate()``), torch's
from the counters and cached normal samples in ``get_state()``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import sys
import threading

import numpy as np
import torch

__all__ = ["GLOBAL_RNG_LOCK", "RngUse", "fingerprint", "seed_globals_cpu", "save", "restore"]

log = logging.getLogger("kuat.engine")

MAX_FALSE_ALARMS = 3
_MASK32 = (1 << 32) - 1


class _SharedExclusiveLock:
    """Many holders of the shared side at once, or one holder of the exclusive side."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # threads waiting for the exclusive side

    def acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if not self._shared and self._waiting:
                self._cond.notify_all()

    def acquire(self) -> None:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True

    def release(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# Exclusive: a sample runs with reseeded global RNGs. Shared: a batch runs un-isolated and
# watched (nothing may reseed meanwhile, or the watch would blame the dataset).
GLOBAL_RNG_LOCK = _SharedExclusiveLock()


def _reset_lock_in_child() -> None:
    # A fork while another thread held the lock would leave it held forever in the child.
    global GLOBAL_RNG_LOCK
    GLOBAL_RNG_LOCK = _SharedExclusiveLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_in_child)


def seed_globals_cpu(seed: int) -> None:
    """Seed ``random``, NumPy's global generator and torch's default *CPU* generator.

    Unlike ``torch.manual_seed`` this leaves CUDA generators alone (the training loop owns them).
    """
    random.seed(seed)
    np.random.seed(seed & _MASK32 ^ (seed >> 32))
    torch.default_generator.manual_seed(seed & ((1 << 63) - 1))


def save() -> tuple:
    """The three global generators' states (about 80 us: NumPy's copy dominates)."""
    return random.getstate(), np.random.get_state(), torch.default_generator.get_state()


def restore(state: tuple) -> None:
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.default_generator.set_state(state[2])


# -- fingerprints ---------------------------------------------------------------------------
def _calibrate_python_random():
    """``ctypes`` view of ``random._inst``'s (index, state[0]) words, or None.

    CPython's ``RandomObject`` is ``{PyObject_HEAD; int index; uint32_t state[624]; ...}``.
    The offset of ``index`` is found, not assumed: after ``seed()`` it is 624, after one 32-bit
    draw 1, after two 2 (the generator refills its block on the first draw).
    """
    if sys.implementation.name != "cpython":
        return None
    inst = random._inst
    saved = inst.getstate()
    try:
        base = id(inst)
        offsets = range(8, 8 * 16, 4)
        inst.seed(0x6B756174)
        cands = [o for o in offsets if ctypes.c_int.from_address(base + o).value == 624]
        for expected in (1, 2):
            inst.getrandbits(32)
            cands = [o for o in cands if ctypes.c_int.from_address(base + o).value == expected]
        if len(cands) != 1:
            return None
        return (ctypes.c_int * 2).from_address(base + cands[0])  # (index, state[0] as int)
    except Exception:  # any surprise: use getstate()
        return None
    finally:
        inst.setstate(saved)


def _numpy_words():
    """``ctypes`` view of NumPy's legacy MT19937 ``(key[0], pos)``, or None."""
    try:
        bg = np.random.mtrand._rand._bit_generator
        addr = bg.ctypes.state_address  # struct {uint32 key[624]; int pos;}
        key0 = ctypes.c_uint32.from_address(addr)
        pos = ctypes.c_int.from_address(addr + 624 * 4)
        return bg, key0, pos
    except Exception:
        return None


_py_words = None
_np_words = None
_init_lock = threading.Lock()
_ready = False


def _init() -> None:
    global _py_words, _np_words, _ready
    with _init_lock:
        if not _ready:
            _py_words = _calibrate_python_random()
            _np_words = _numpy_words()
            _ready = True


def fingerprint() -> tuple:
    """Something that changes whenever any of the three global generators draws or is seeded.

    About 3 us (torch's state is copied by ``get_state``; the others are read in place). Call it only
    while holding :data:`GLOBAL_RNG_LOCK` (either side), so no reseeding runs meanwhile.
    """
    if not _ready:
        _init()
    # Python's gauss() caches its second sample in a Python attribute, not in the C state
    py = (*_py_words, random._inst.gauss_next) if _py_words is not None else random.getstate()
    npw = _np_words
    if npw is None or np.random.mtrand._rand._bit_generator is not npw[0]:
        npw = _refresh_numpy()
    nps = (npw[1].value, npw[2].value) if npw is not None else np.random.get_state()[2]
    st = torch.default_generator.get_state().numpy()  # (5056,) uint8, a fresh copy
    # CPU generator state: seed, mt19937 left/next counters and state[0] (bytes 0-31, which
    # change on every draw and refill), cached normal samples (the last 40 bytes)
    return py, nps, st[:32].tobytes(), st[-40:].tobytes()


def _refresh_numpy():
    global _np_words
    _np_words = _numpy_words()  # a replaced global RandomState (np.random.mtrand._rand)
    return _np_words


class RngUse:
    """What a loader knows about its dataset's global-RNG draws; shared by its worker threads
    (each worker process has its own copy)."""

    def __init__(self):
        self.draws = False
        self.false_alarms = 0
        self.watch = True

    def __getstate__(self):
        return {"draws": self.draws, "false_alarms": self.false_alarms, "watch": self.watch}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def false_alarm(self) -> None:
        self.false_alarms += 1
        if self.false_alarms >= MAX_FALSE_ALARMS and self.watch:
            self.watch = False
            log.info(
                "kuat: global random generators changed %d times while a batch was fetched, but "
                "the dataset did not draw when the batch was fetched again (another thread, e.g. "
                "the training loop, draws): no longer watching; only each worker's first batch "
                "decides whether the dataset needs global-RNG isolation", self.false_alarms,
            )
