"""Global-RNG isolation: reproducible draws from ``random``/``np.random``/``torch``, paid only
by datasets that draw.

Python's ``random``, NumPy's legacy global generator and torch's default CPU generator are
process-wide. A plain torch dataset that draws from them (torchvision's transforms do) gives
draws that depend on which worker ran which sample, unless the loader reseeds them per sample.
Reseeding costs about 7 us per sample (``random.seed`` 3.8, ``np.random.seed`` 1.6,
``torch.manual_seed`` 1.1 on a 2-core machine), 40 times what ``range(n)[i]`` costs, so it is
done only for datasets seen to draw:

1. **Probe.** A worker process's first batch (and the first batch fetched without workers)
   runs isolated (reseeded per sample under the exclusive lock) and each sample's
   :func:`fingerprint` is compared before and after it. A change means the dataset draws:
   :attr:`RngUse.draws` becomes True for good. Thread workers do not probe while the watch is
   on: their first batches are watched (2.), since a probe's reseeds would stall the other
   threads or make their batches run again, and a sample with side effects must run once, as
   under torch (``tests/test_parity_workers.py``). A probe still runs where a watched batch
   saw the generators change (its batch fetched again isolated, below).
   A sample that waits for another worker (a barrier across workers, as in torch's own
   tests) cannot finish under the exclusive lock: once the lock has been held for
   :data:`STALL_S`, a waiter whose dataset is not known to draw fetches its batch watched
   without the lock (which lets the holder go on), then fetches it again isolated, since what
   it read of the generators meanwhile was the holder's sample's; a holder still there
   :data:`STALL_GRACE_S` later is stuck on something else (a slow read), and the unlocked
   result stands when nothing drew. A batch that must run isolated keeps waiting, with a
   warning (:func:`warn_stalled`).
   While a probe runs, no other worker waits for it (its sample may be slow): the probe
   *opens* the lock, and the other threads' batches (first ones included) are fetched watched
   *beside* it, on the shared side joined while it holds the exclusive one. Such a batch
   stands when the generators did not change and the prober did not reseed them meanwhile
   (:attr:`SharedExclusiveLock.generation`); otherwise it is fetched again as it would have
   been (isolated once something drew). A probed sample whose generators changed while a batch
   was fetched beside it cannot tell whose draw it saw (and a draw beside it may have taken
   its own): the prober closes the lock, lets those fetches end and fetches the sample again.
2. **Watch.** Later batches of a dataset not (yet) seen drawing run without reseeding, under
   the shared side of :data:`GLOBAL_RNG_LOCK`, with one fingerprint before and one after the
   batch (under 1 us each). If they differ, something drew: the batch is fetched again,
   isolated and probed (so its samples get exactly the draws isolation gives them) and its
   first result is dropped. Only a dataset whose own samples draw in that re-fetch is marked;
   draws of another thread (the training loop's) are not the dataset's. (So a sample runs
   twice only where the generators changed while its batch ran: a dataset that draws, its
   first batches; the training loop's draws, up to :data:`MAX_FALSE_ALARMS` batches.) In
   thread mode the training loop may draw while a batch runs; after :data:`MAX_FALSE_ALARMS` re-fetches that
   found no draw, watching stops for that loader (logged at INFO), and only the probe decides.
3. **Isolated.** A dataset that draws runs every sample (``__getitem__`` path) or every batch
   (``__getitems__`` path, seeded from the batch's indices, which do not depend on the worker
   count) reseeded from ``(seed, epoch, key)`` under the exclusive lock.

The result is the same whatever the number and type of workers; the caller's own generator
states are saved and restored around isolated runs in thread and inline mode, and draws of thread
workers' watched batches begun before the loop had its epoch's first batch are rewound
(:attr:`RngUse.caller_state`; the loop's first batch waits for those batches to end, so that
it cannot draw before the rewind): the training loop's stream stays torch's. A batch found
drawing while it waited for the lock (another worker's probe saw the draws) is fetched
isolated, not watched. Not covered: a dataset whose first draw comes in a batch begun after
the loop's first batch (the loop may have drawn by then): that batch's draws stay in the
caller's generators, as any draw another thread makes.

Fingerprints read the generators' states in place, without copying them through an accessor:
NumPy's MT19937 through ``MT19937.ctypes`` (public); Python's ``random``, the legacy
``RandomState``'s cached normal sample and torch's CPU generator (its MT19937 and cached
normal samples) through their objects' memory at offsets found once by calibration on fresh
instances of the same types, each falling back to its accessor (``random.getstate()``,
``np.random.get_state()``, ``torch.default_generator.get_state()``) when calibration fails.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import sys
import threading
import time

import numpy as np
import torch

from kuat.engine.rng_lock import JOINED, SharedExclusiveLock

__all__ = ["CALLER_WAIT_MIN_S", "CALLER_WAIT_S", "GLOBAL_RNG_LOCK", "JOINED", "RngUse",
           "STALL_S", "STALL_GRACE_S", "fingerprint", "late_draws",
           "seed_globals_cpu", "save", "restore", "warn_stalled"]

log = logging.getLogger("kuat.engine")

MAX_FALSE_ALARMS = 3
# The longest the loop's first batch of an epoch waits for thread workers' fetches begun
# before it (RngUse.loop_has_batch: otherwise as long again as the first batch took)
CALLER_WAIT_S = 10.0
CALLER_WAIT_MIN_S = 0.05  # (so that a very short first batch does not leave the others)
_late_logged = False  # late_draws's note, once per process


def late_draws() -> None:
    """A thread worker's batch begun before the loop had its epoch's first batch drew after
    the loop stopped waiting for it (:meth:`RngUse.loop_has_batch`): its draws stay in the
    caller's generators. Logged once per process."""
    global _late_logged
    if not _late_logged:
        _late_logged = True
        log.info("kuat: a thread worker's batch begun before the loop's first batch of the "
                 "epoch drew from the global random generators after the loop stopped waiting "
                 "for it: those draws reached the training loop's stream (worker_type="
                 "'process' keeps them apart)")


_MASK32 = (1 << 32) - 1


# Exclusive: a sample runs with reseeded global RNGs. Shared: a batch runs un-isolated and
# watched (nothing may reseed meanwhile, or the watch would blame the dataset).
GLOBAL_RNG_LOCK = SharedExclusiveLock()


# How long the lock may be held before a waiter suspects that the holder's sample is waiting
# for it (a ``__getitem__`` that synchronises with the other workers, as torch's own test
# datasets do): a batch whose dataset is not known to draw is then fetched without the lock
# (watched, job.py); one that must run isolated keeps waiting, after a warning.
STALL_S = 2.0
# After such a fetch, how long to wait for the holder to finish (it was waiting for that fetch)
# before taking the holder to be stuck on something else
STALL_GRACE_S = 0.5
_stall_warned: set[str] = set()


def warn_stalled(what: str) -> None:
    """Warn (once per ``what``) that a thread has waited ``STALL_S`` for the exclusive lock."""
    if what in _stall_warned:
        return
    _stall_warned.add(what)
    log.warning(
        "kuat: %s has waited over %.0f s for the global-RNG lock, held by another thread "
        "worker while its worker_init_fn, or a sample that must run with the global random "
        "generators to itself, runs. If that waits for this worker, this never ends: pass "
        "isolate_global_rng=False or worker_type='process' to the DataLoader", what, STALL_S)


def _reset_lock_in_child() -> None:
    # A fork while another thread held the lock would leave it held forever in the child.
    global GLOBAL_RNG_LOCK
    GLOBAL_RNG_LOCK = SharedExclusiveLock()


_forking_np_lock = None  # the NumPy global generator's lock, held by the forking thread


def _hold_numpy_lock() -> None:
    # A thread worker saving or seeding NumPy's global generator (isolation, worker_rng.py)
    # holds its lock for microseconds; a fork at that moment would leave it held for ever in
    # the child, whose first np.random.seed (seed_worker_globals) would then never return.
    global _forking_np_lock
    try:
        lock = np.random.mtrand._rand._bit_generator.lock
    except AttributeError:
        return
    lock.acquire()
    _forking_np_lock = lock


def _release_numpy_lock() -> None:
    global _forking_np_lock
    lock, _forking_np_lock = _forking_np_lock, None
    if lock is not None:
        lock.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_hold_numpy_lock, after_in_parent=_release_numpy_lock,
                        after_in_child=_release_numpy_lock)
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


_restores = 0  # restore() calls so far (a change detector: see restores())


def restore(state: tuple) -> None:
    global _restores
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.default_generator.set_state(state[2])
    _restores += 1


def restores() -> int:
    """How many :func:`restore` calls have run (a thread's swap of generator states in or out):
    a fingerprint that changed while this did may have seen a swap, not a draw."""
    return _restores


# -- fingerprints ---------------------------------------------------------------------------
# Each generator's state is read in place, through a ctypes window over its C struct, found by
# calibration on a fresh instance of the same type (never by touching the process's own
# generators, which another thread may be drawing from) and checked there against draws of
# every kind; where that fails, the generator's public accessor is read instead (slower).
_MT_WORDS = 624  # MT19937's state, in 32-bit words (Python's random, NumPy, torch's CPU generator)


def _window(address: int, size: int):
    return (ctypes.c_char * size).from_address(address)


def _changes_on_every_draw(read, draws) -> bool:
    """Whether ``read()`` gives different bytes after each of ``draws`` (calibration check)."""
    for draw in draws:
        before = read()
        draw()
        if read() == before:
            return False
    return True


def _python_random_offset() -> int | None:
    """Offset of ``index`` in CPython's ``RandomObject`` (``{PyObject_HEAD; int index; uint32_t
    state[624]; ...}``), found on a fresh ``random.Random``: after ``seed()`` it is 624, after
    one 32-bit draw 1, after two 2 (the generator refills its block on the first draw)."""
    if sys.implementation.name != "cpython" or type(random._inst) is not random.Random:
        return None
    inst = random.Random()
    base = id(inst)
    size = _MT_WORDS * 4 + 4
    inst.seed(0x6B756174)
    cands = [o for o in range(8, 8 * 16, 4) if ctypes.c_int.from_address(base + o).value == 624]
    for expected in (1, 2):
        inst.getrandbits(32)
        cands = [o for o in cands if ctypes.c_int.from_address(base + o).value == expected]
    if len(cands) != 1 or cands[0] + size > type(inst).__basicsize__:
        return None
    w = _window(base + cands[0], size)
    draws = (inst.random, lambda: inst.getrandbits(32 * _MT_WORDS), lambda: inst.seed(1))
    return cands[0] if _changes_on_every_draw(lambda: w.raw, draws) else None


def _numpy_gauss_offset() -> int | None:
    """Offset of ``{int has_gauss; double gauss}`` (NumPy's ``aug_bitgen_t``: the legacy
    ``RandomState``'s cached normal sample, outside the MT19937 state) in a ``RandomState``,
    found on a fresh one from the cached value ``get_state()`` reports."""
    import struct

    rs = np.random.RandomState(0x6B7561)
    if type(np.random.mtrand._rand) is not type(rs):
        return None
    rs.standard_normal()
    has_gauss, gauss = rs.get_state()[3:5]
    blob = ctypes.string_at(id(rs), type(rs).__basicsize__)
    at = blob.find(struct.pack("<d", gauss))
    if has_gauss != 1 or at < 8 or blob.find(struct.pack("<d", gauss), at + 1) >= 0:
        return None
    if struct.unpack_from("<i", blob, at - 8)[0] != 1:
        return None
    w = _window(id(rs) + at - 8, 16)
    draws = (rs.standard_normal, rs.standard_normal, lambda: rs.seed(1), rs.standard_normal)
    return at - 8 if _changes_on_every_draw(lambda: w.raw, draws) else None


def _torch_cpu_offset() -> int | None:
    """Offset of ``mt19937 engine_`` and the cached normal samples that follow it in torch's
    ``CPUGeneratorImpl`` (``{uint64 seed; int left; bool seeded; uint32 next; uint32
    state[624]}``, ``optional<float>``, ``optional<double>``), found on a fresh
    ``torch.Generator`` from its seed."""
    import struct

    g = torch.Generator()
    seed = 0x6B7561746B756174
    g.manual_seed(seed)
    impl = ctypes.c_void_p.from_address(id(g) + object.__basicsize__).value
    if not impl:
        return None
    blob = ctypes.string_at(impl, 512)
    at = blob.find(struct.pack("<Q", seed))
    if at < 0 or blob.find(struct.pack("<Q", seed), at + 1) >= 0:
        return None
    w = _window(impl + at, _TORCH_WINDOW)
    draws = (lambda: torch.rand(1, generator=g), lambda: torch.randn(1, generator=g),
             lambda: torch.randn(1, generator=g),  # the second: a cached normal sample
             lambda: torch.randn(1, dtype=torch.float32, generator=g),
             lambda: torch.randint(0, 10, (_MT_WORDS,), generator=g),
             lambda: g.manual_seed(1), lambda: g.set_state(torch.Generator().get_state()))
    return at if _changes_on_every_draw(lambda: w.raw, draws) else None


# seed, left, seeded, next (20 bytes), state (2496), optional<float> (8), optional<double> (16)
_TORCH_WINDOW = 20 + _MT_WORDS * 4 + 8 + 16

_py_window = None  # ctypes windows over the process's generators (None: accessor fallback)
_np_window = None  # (bit generator, MT19937 key + pos window, has_gauss + gauss window or None)
_torch_window = None
_init_lock = threading.Lock()
_ready = False


def _calibrated(find, what: str):
    try:
        return find()
    except Exception as e:  # any surprise: the accessor fallback
        log.debug("kuat.isolate: no in-place view of %s (%s: %s)", what, type(e).__name__, e)
        return None


def _init() -> None:
    global _py_window, _torch_window, _ready
    with _init_lock:
        if _ready:
            return
        off = _calibrated(_python_random_offset, "random's state")
        if off is not None:
            _py_window = _window(id(random._inst) + off, _MT_WORDS * 4 + 4)
        off = _calibrated(_torch_cpu_offset, "torch's CPU generator")
        if off is not None:
            impl = ctypes.c_void_p.from_address(
                id(torch.default_generator) + object.__basicsize__).value
            _torch_window = _window(impl + off, _TORCH_WINDOW)
            if _torch_window.raw[:8] != torch.default_generator.initial_seed().to_bytes(8, "little"):
                _torch_window = None  # not laid out as the fresh generator was
        _refresh_numpy()
        _ready = True


def fingerprint() -> tuple:
    """Something that changes whenever any of the three global generators draws or is seeded.

    About 0.5 us (each generator's state is read in place: see the calibration above; up to
    4 us where an accessor must copy it). Call it only while holding
    :data:`GLOBAL_RNG_LOCK` (either side), so no reseeding runs meanwhile.
    """
    if not _ready:
        _init()
    # Python's gauss() caches its second sample in a Python attribute, not in the C state
    inst = random._inst
    py = _py_window.raw if _py_window is not None else inst.getstate()
    npw = _np_window
    if npw is None or np.random.mtrand._rand._bit_generator is not npw[0]:
        npw = _refresh_numpy()
    if npw is None:
        nps = np.random.get_state()
    else:  # legacy gauss cache: its accessor copies the whole state, so only without a window
        nps = (npw[1].raw, npw[2].raw if npw[2] is not None else np.random.get_state()[3:])
    if _torch_window is not None:
        ts = _torch_window.raw
    else:  # (5056,) uint8, a fresh copy: seed, counters and state[0] (bytes 0-31), cached
        st = torch.default_generator.get_state().numpy()  # normal samples (the last 40 bytes)
        ts = (st[:32].tobytes(), st[-40:].tobytes())
    return py, inst.gauss_next, nps, ts


_NP_GAUSS = None  # offset of has_gauss + gauss in a RandomState (found once)


def _refresh_numpy():
    """Windows over the current global ``RandomState`` (``np.random.mtrand._rand``, which
    ``np.random.set_state`` keeps but a user may replace) or None."""
    global _np_window, _NP_GAUSS
    try:
        rs = np.random.mtrand._rand
        bg = rs._bit_generator
        mt = _window(bg.ctypes.state_address, _MT_WORDS * 4 + 4)  # {uint32 key[624]; int pos}
        if _NP_GAUSS is None:
            found = _calibrated(_numpy_gauss_offset, "NumPy's cached normal")
            _NP_GAUSS = -1 if found is None else found
        gauss = _window(id(rs) + _NP_GAUSS, 16) if _NP_GAUSS >= 0 else None
        _np_window = (bg, mt, gauss)
    except Exception:
        _np_window = None
    return _np_window


class RngUse:
    """What a loader knows about its dataset's global-RNG draws; shared by its worker threads
    (each worker process has its own copy)."""

    def __init__(self):
        self.draws = False
        self.false_alarms = 0
        self.watch = True
        # a batch ran isolated and probed in this process: later thread workers' first batches
        # may be watched instead of probed (job.py); not pickled: each process probes itself
        self.probed = False
        # a worker_init_fn changed the global generators: each worker draws from its own
        # stream (worker_rng.py); worker_type=None then wants process workers
        self.worker_seeded = False
        # the hold of the lock (its held_since) found stuck after a grace (job.py): later
        # fetches during it do not wait for it again
        self.stuck_hold: float | None = None
        # the caller's generator states when the consumer started thread workers on an epoch
        # (after the epoch's own draws), until the loop got its first batch: a draw first seen
        # meanwhile was the workers' (their first batches run watched, unisolated; the loop
        # waits), so the isolated re-fetch rewinds the generators to it (isolated_fetch.py)
        self.caller_state: tuple | None = None
        self._init_pending()

    def _init_pending(self) -> None:
        # thread workers' fetches begun while caller_state was kept whose unisolated part (and
        # its rewind) has not ended yet: the loop's first batch waits for them (loop_has_batch)
        self._pending = 0
        self._ended = threading.Condition(threading.Lock())
        self._since = 0.0  # time.monotonic() at threads_start
        # a thread worker's fetch of this epoch has ended: fetches begun later are not
        # counted (they began after the first batches; the loop waits for those only)
        self._one_done = False

    def __getstate__(self):
        return {"draws": self.draws, "false_alarms": self.false_alarms, "watch": self.watch,
                "worker_seeded": self.worker_seeded}

    def __setstate__(self, state):
        self.probed = False
        self.stuck_hold = self.caller_state = None
        self._init_pending()
        self.__dict__.update(state)

    def threads_start(self) -> None:
        """The consumer starts an epoch on thread workers: keep the caller's generator states
        while the dataset is not known to draw (:attr:`caller_state`; about 80 us)."""
        state = save() if self.watch and not self.draws else None
        with self._ended:
            self.caller_state, self._since = state, time.monotonic()
            self._one_done = False

    def fetch_begins(self) -> bool:
        """A thread worker begins a fetch that may run watched. True while
        :attr:`caller_state` is kept: the caller must then call :meth:`fetch_ends` once
        nothing of the fetch can draw from the caller's generators any more (it ended
        unisolated, or its isolated re-fetch rewound them and runs with them saved), which
        the loop's first batch waits for (:meth:`loop_has_batch`)."""
        if self.caller_state is None:  # (the usual case: no lock)
            return False
        with self._ended:
            if self.caller_state is None or self._one_done:
                return False
            self._pending += 1
            return True

    def fetch_done(self) -> None:
        """A thread worker's fetch ended (counted or not): fetches begun from now on are not
        the epoch's first ones and are not waited for."""
        if self.caller_state is not None and not self._one_done:
            self._one_done = True  # (a plain store: at worst one more fetch is counted)

    def fetch_ends(self) -> None:
        with self._ended:
            self._pending -= 1
            if not self._pending:
                self._ended.notify_all()

    def loop_has_batch(self) -> None:
        """The loop got its epoch's first batch and may draw from the generators from now on:
        first let the unisolated part of every thread worker's fetch begun while
        :attr:`caller_state` was kept end (:meth:`fetch_ends`), then drop that state.

        Why wait: such a fetch, watched, may draw from the generators the loop reads on (the
        dataset is not known to draw yet), and its isolated re-fetch rewinds them to
        :attr:`caller_state`. A rewind after the loop drew would undo the loop's draws, and
        none would leave the workers' draws in the loop's stream (the next epoch's shuffle
        then differs from torch's, where worker processes never touch the caller's
        generators). Which: only fetches begun before any fetch of the epoch ended (the
        other workers' first batches; a worker's next batch, begun once its first was done,
        is not waited for). How long: those take about as long as the first, so the loop
        waits at most as long again as it waited for its first batch since the epoch started
        (at least :data:`CALLER_WAIT_MIN_S`, at most :data:`CALLER_WAIT_S`); a slower one (a
        sample waiting on something, or much slower than the rest) is not waited for, as
        ``in_order=False`` never waits for a slow worker, and its draws, if its dataset draws
        for the first time there, stay in the caller's generators (:func:`late_draws` logs
        it)."""
        with self._ended:
            if self.caller_state is None:
                return
            if self._pending:
                waited = time.monotonic() - self._since
                self._ended.wait_for(lambda: not self._pending,
                                     min(CALLER_WAIT_S, max(waited, CALLER_WAIT_MIN_S)))
            self.caller_state = None

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
