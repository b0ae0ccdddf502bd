"""Per-sample random generators, so that augmentations do not depend on threads or workers.

A sample's random draws come from generators seeded by ``(seed, epoch, sample index)``
(see DESIGN.md, "Determinism and state"). The loader sets ``seed`` and ``epoch`` for the
thread (or process) that fetches a batch; code inside a dataset calls :func:`sample_rng`
to get the generators of the sample it is producing. The result is the same whatever the
number of workers, whether they are threads or processes, and in what order they run.

Outside a loader, the seed and epoch default to 0, so a dataset can be indexed directly
and still gets reproducible draws.

Thread-safety: the context is thread-local; each :class:`SampleRNG` is owned by one sample
and must not be shared between threads.
"""

from __future__ import annotations

import random
import threading

import numpy as np

__all__ = [
    "SampleRNG", "sample_rng", "sample_seed", "epoch_context", "sample_context", "map_samples",
]

_MASK64 = (1 << 64) - 1


class _Current:
    """What this thread is fetching: the loader's ``(seed, epoch)`` and the sample ``index``
    (plain slots: cheaper to set than thread-local attributes, and set once per sample)."""

    __slots__ = ("seed", "epoch", "index")

    def __init__(self):
        self.seed = self.epoch = self.index = None


class _Local(threading.local):
    def __init__(self):
        self.current = _Current()


_local = _Local()


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of sample ``index`` in ``epoch`` of a run seeded with ``seed``.

    Derived with NumPy's ``SeedSequence`` (hash-based mixing, so neighbouring indices or
    epochs give independent streams). ``index`` must be >= 0.
    """
    ss = np.random.SeedSequence([seed & _MASK64, epoch & _MASK64, index & _MASK64])
    lo, hi = ss.generate_state(2, np.uint32)
    return int(lo) | (int(hi) << 32)


class SampleRNG:
    """The random generators of one sample, all derived from one 64-bit seed.

    Attributes:
        seed: the 64-bit seed (see :func:`sample_seed`).
        numpy: a ``numpy.random.Generator`` (PCG64), created on first use.
        torch: a CPU ``torch.Generator``, created on first use.
        python: a ``random.Random``, created on first use.
    """

    __slots__ = ("seed", "_numpy", "_torch", "_python")

    def __init__(self, seed: int):
        self.seed = seed
        self._numpy = None
        self._torch = None
        self._python = None

    @property
    def numpy(self) -> np.random.Generator:
        if self._numpy is None:
            self._numpy = np.random.Generator(np.random.PCG64(self.seed))
        return self._numpy

    @property
    def torch(self):
        if self._torch is None:
            import torch

            g = torch.Generator()
            g.manual_seed(self.seed & ((1 << 63) - 1))
            self._torch = g
        return self._torch

    @property
    def python(self) -> random.Random:
        if self._python is None:
            self._python = random.Random(self.seed)
        return self._python

    def __repr__(self) -> str:
        return f"SampleRNG(seed={self.seed:#018x})"


def _context() -> tuple[int, int]:
    cur = _local.current
    return (0, 0) if cur.seed is None else (cur.seed, cur.epoch)


def current_epoch() -> tuple[int, int]:
    """``(seed, epoch)`` of the loader running in this thread, ``(0, 0)`` outside one."""
    return _context()


def sample_rng(index: int | None = None) -> SampleRNG:
    """The generators of sample ``index`` in the current ``(seed, epoch)``.

    Args:
        index: the sample's index in its dataset. ``None`` means the sample the loader is
            fetching in this thread right now (set while it calls ``__getitem__``).

    Raises:
        RuntimeError: ``index`` is ``None`` and no sample is being fetched in this thread.
    """
    if index is None:
        index = _local.current.index
        if index is None:
            raise RuntimeError(
                "kuat.sample_rng() without an index must be called while a kuat loader "
                "fetches a sample (inside the dataset's __getitem__); pass the index explicitly"
            )
    seed, epoch = _context()
    return SampleRNG(sample_seed(seed, epoch, index))


class epoch_context:  # noqa: N801 (a context manager used like a function)
    """Set ``(seed, epoch)`` for :func:`sample_rng` in this thread, restoring it after.

    A class rather than a generator-based context manager: it runs once per batch."""

    __slots__ = ("_seed", "_epoch", "_old")

    def __init__(self, seed: int, epoch: int):
        self._seed, self._epoch = seed, epoch

    def __enter__(self) -> None:
        cur = _local.current
        self._old = (cur.seed, cur.epoch)
        cur.seed, cur.epoch = self._seed, self._epoch

    def __exit__(self, *exc) -> None:
        cur = _local.current
        cur.seed, cur.epoch = self._old


class sample_context:  # noqa: N801
    """Mark ``index`` as the sample being fetched in this thread (for ``sample_rng()``)."""

    __slots__ = ("_index", "_old")

    def __init__(self, index: int | None):
        self._index = index

    def __enter__(self) -> None:
        cur = _local.current
        self._old, cur.index = cur.index, self._index

    def __exit__(self, *exc) -> None:
        _local.current.index = self._old


def map_samples(fn, indices) -> list:
    """``[fn(i) for i in indices]``, each call made with ``i`` as this thread's current sample
    (what ``sample_rng()`` without an index uses), as :func:`sample_context` per call would,
    at a fraction of its cost (one attribute store per sample, not a context manager)."""
    cur = _local.current
    old = cur.index
    out = []
    append = out.append
    try:
        for i in indices:
            cur.index = i
            append(fn(i))
    finally:
        cur.index = old
    return out


def seed_global_rngs(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's default generator.

    Used once in each process worker with ``base_seed + worker_id``, as torch seeds its worker
    processes (per-sample isolation uses ``kuat.engine.isolate.seed_globals_cpu``, which leaves
    CUDA generators alone). NumPy's legacy seeding takes 32 bits, so it gets a mixed 32-bit
    value of ``seed``; torch's all CUDA generators too (``torch.manual_seed``).
    """
    import torch

    random.seed(seed)
    np.random.seed(int(np.random.SeedSequence(seed & _MASK64).generate_state(1, np.uint32)[0]))
    torch.manual_seed(seed & ((1 << 63) - 1))
