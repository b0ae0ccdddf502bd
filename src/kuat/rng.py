"""Per-sample random generators, so that augmentations do not depend on threads or workers.

A sample's random draws come from generators seeded by ``(seed, epoch, sample index)``
(docs/loader.md, "Seeds, generators and order"). The loader sets ``seed`` and ``epoch`` for the
thread (or process) that fetches a batch; code inside a dataset calls :func:`sample_rng`
to get the generators of the sample it is producing. The result is the same whatever the
number of workers, whether they are threads or processes, and in what order they run.

Outside a loader, the seed and epoch default to 0, so a dataset can be indexed directly and
still gets reproducible draws. Thread-safety: the context is thread-local; each
:class:`SampleRNG` is owned by one sample and must not be shared between threads.
"""

from __future__ import annotations

import operator
import random
import threading
from collections.abc import Sequence

import numpy as np
from numpy.random.bit_generator import ISpawnableSeedSequence

from kuat import _seedseq

__all__ = [
    "BatchGenerators", "SampleRNG", "sample_rng", "sample_rngs", "sample_seed", "epoch_context",
    "sample_context", "map_samples", "use_native_words", "derive_seed", "derive_generator",
    "worker_base_seed", "global_rng_seed",
]

_MASK64, _MASK32 = (1 << 64) - 1, (1 << 32) - 1

# --- every seed kuat derives, in one place ------------------------------------------------------
# Each family of random streams mixes its own salt into NumPy's SeedSequence, so no two families
# ever share a stream (a sample's generators, an epoch's shuffle, a mix's schedule...). A salt is
# an ASCII tag read as an int; changing one changes every order and augmentation of that family.
SALT_WORKER_BASE = 0x57524B52  # "WRKR": per-epoch base of the per-worker seeds (torch's base_seed)
SALT_SHUFFLE = 0x5348554646  # "SHUFF": an epoch's permutation (kuat.sampling.shuffle_seed)
SALT_SHUFFLE_BUFFER = 0x53425546  # "SBUF": kuat.shuffle_buffer's draws
SALT_MIX = 0x4D4958  # "MIX": kuat.mix's schedule and per-source sample seeds
SALT_TOKEN_BATCHES = 0x544F4B42  # "TOKB": TokenBudgetBatchSampler's batch order


def derive_seed(*words: int, bits: int = 64) -> int:
    """A ``bits``-bit seed from ``words`` (integers, NumPy's too, each modulo 2**64; else a
    TypeError): the first two 32-bit words of NumPy's ``SeedSequence(words).generate_state``
    (hash mixing: neighbouring inputs give unrelated seeds). Every per-sample, per-epoch and
    per-source seed of kuat is one (salts above); 20 us in NumPy (90 cold), a few in C."""
    if _native_seed is not None and len(words) <= 16:
        return _native_seed(words) & ((1 << bits) - 1)
    ss = np.random.SeedSequence([operator.index(w) & _MASK64 for w in words])
    lo, hi = ss.generate_state(2, np.uint32)
    return (int(lo) | (int(hi) << 32)) & ((1 << bits) - 1)


def derive_generator(*words: int) -> np.random.Generator:
    """``numpy.random.Generator(PCG64(SeedSequence(words)))``, each word taken modulo 2**64:
    the generator of a stream family (a mix's schedule, a shuffle buffer's draws)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([w & _MASK64 for w in words])))


def worker_base_seed(seed: int, epoch: int) -> int:
    """The per-epoch base of the per-worker seeds (worker ``w`` is seeded ``base + w``, as torch
    seeds its workers from ``base_seed``): 55 bits, so ``base + w`` stays a valid int64 seed."""
    return derive_seed(seed, epoch, SALT_WORKER_BASE, bits=55)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def global_rng_seed(seed: int, epoch: int, index: int) -> int:
    """Seed of the global RNGs for one sample (global-RNG isolation, ``kuat.engine.isolate``):
    SplitMix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number generators", 2014)
    chained over ``(seed, epoch, index)``. A few microseconds (:func:`derive_seed`'s
    SeedSequence costs ~20-100 us, too much per sample); the streams it seeds are distinct
    from :func:`sample_rng`'s."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (epoch & _MASK64))
    return _splitmix64(h ^ (index & _MASK64))


class _Current:
    """What this thread is fetching: the loader's ``(seed, epoch)`` and the sample ``index``
    (plain slots: cheaper to set than thread-local attributes, and set once per sample)."""

    __slots__ = ("seed", "epoch", "index")

    def __init__(self):
        self.seed = self.epoch = self.index = None


class _Local(threading.local):
    def __init__(self):
        self.current = _Current()
        self.failed = None  # (exception, position) of the last note_failed()


_local = _Local()


def thread_state() -> _Local:  # internal: FetchScope (kuat.engine) sets .current's seed, epoch
    return _local


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of sample ``index`` in ``epoch`` of a run seeded with ``seed``.

    Derived with NumPy's ``SeedSequence`` (hash-based mixing, so neighbouring indices or
    epochs give independent streams). ``index`` must be >= 0.
    """
    return derive_seed(seed, epoch, index)


class SampleRNG:
    """The random generators of one sample, all derived from one 64-bit seed.

    Attributes:
        seed: the 64-bit seed (see :func:`sample_seed`).
        numpy: a ``numpy.random.Generator`` (PCG64), created on first use.
        torch: a CPU ``torch.Generator``, created on first use.
        python: a ``random.Random``, created on first use.
    """

    __slots__ = ("seed", "_numpy", "_torch", "_python", "_pcg_words")

    def __init__(self, seed: int, _pcg_words: np.ndarray | None = None):
        self.seed = seed
        self._numpy = None
        self._torch = None
        self._python = None
        self._pcg_words = _pcg_words  # PCG64's seeding words when precomputed (sample_rngs)

    @property
    def numpy(self) -> np.random.Generator:
        if self._numpy is None:
            if self._pcg_words is None:
                self._numpy = np.random.Generator(np.random.PCG64(self.seed))
            else:  # the same generator, without hashing the seed again
                self._numpy = np.random.Generator(
                    np.random.PCG64(_PrecomputedSeedSequence(self.seed, self._pcg_words))
                )
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


def current_epoch() -> tuple[int, int]:
    """``(seed, epoch)`` of the loader running in this thread, ``(0, 0)`` outside one."""
    cur = _local.current
    return (0, 0) if cur.seed is None else (cur.seed, cur.epoch)


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
    seed, epoch = current_epoch()
    return SampleRNG(sample_seed(seed, epoch, index))


def sample_rngs(indices) -> list[SampleRNG]:
    """``[sample_rng(i) for i in indices]``, hashed for the whole batch at once.

    Equal generators (same seeds, same streams) at a fraction of the cost: both of
    ``SeedSequence``'s hashes run once for the whole batch (in C when a native hash is
    registered, see :func:`use_native_words`; else as NumPy arithmetic, ``kuat._seedseq``),
    and each ``.numpy`` generator is seeded from the precomputed words. Measured for a batch
    of 64 on a 2-core machine: 8.6 us per sample in NumPy, under 1 in C, against 52 one by one.
    Its ``bit_generator.seed_seq`` is a stand-in that answers like ``SeedSequence(seed)``
    (``generate_state``, ``spawn``, ``entropy``... from a real one made on first use).

    Args:
        indices: sample indices (ints >= 0, any iterable; NumPy integer arrays too).

    Returns:
        one :class:`SampleRNG` per index, in order.

    Raises:
        ValueError: an index is negative.
    """
    seeds, words = _batch_words(indices)
    return [SampleRNG(s, w) for s, w in zip(seeds.tolist(), words)]


class BatchGenerators(Sequence):
    """The ``numpy.random.Generator`` of each sample of a batch, ``sample_rng(i).numpy`` for
    each of ``indices`` in order, each made on first access.

    What a batch-filling transform gets as its ``rngs``: it can index and iterate it as a
    list, and a transform that draws its samples' boxes itself (``kuat.vision.Compose``, in
    C) reads ``pcg_words`` instead and makes no generator at all (about 3.4 us each).

    Attributes:
        seeds: ``(B,)`` uint64, the samples' seeds (:func:`sample_seed`).
        pcg_words: ``(B, 4)`` uint64, each generator's PCG64 seeding words
            (``SeedSequence(seed).generate_state(4, np.uint64)``, read-only).

    Both are hashed on first access, from the ``(seed, epoch)`` current at construction (a
    planner that hashes them itself without the GIL, ``_roijpeg.c``'s ``plan_decode_rrc``,
    reads :attr:`_unhashed` instead and they are never made).

    Raises (at construction):
        ValueError: an index is negative.

    Thread-safety: owned by the thread fetching the batch, like the samples' generators.
    """

    __slots__ = ("_idx", "_context", "_seeds", "_words", "_gens", "_drawn", "_made")

    def __init__(self, indices):
        idx = np.ascontiguousarray(np.asarray(indices, dtype=np.int64).reshape(-1))  # (B,)
        if idx.size and _min(idx) < 0:  # (the ufunc: ndarray.min's Python wrapper costs more)
            raise ValueError(f"sample indices must be >= 0, got {int(idx.min())}")
        self._idx = idx
        self._context = current_epoch()  # (seed, epoch): this epoch's streams, whenever hashed
        self._seeds = self._words = None
        self._gens: list[np.random.Generator | None] = [None] * idx.size
        self._drawn: np.ndarray | None = None  # (B,) int64, see _drew
        self._made = False  # a generator was made (a stream may have been drawn from)

    @property
    def seeds(self) -> np.ndarray:
        if self._seeds is None:
            self._hash()
        return self._seeds

    @property
    def pcg_words(self) -> np.ndarray:
        if self._words is None:
            self._hash()
        return self._words

    def _hash(self) -> None:
        seeds, words = _batch_words(self._idx, self._context)
        words.flags.writeable = False
        self._seeds, self._words = seeds, words

    @property
    def _unhashed(self) -> tuple[int, int, np.ndarray] | None:
        """``(seed, epoch, indices)`` (64-bit seed and epoch, ``(B,)`` int64 indices) while
        neither ``seeds`` nor ``pcg_words`` has been made: what a C planner hashes itself
        (``kuat.vision.Compose``). ``None`` once they are. Internal."""
        if self._words is not None:
            return None
        seed, epoch = self._context
        return seed & _MASK64, epoch & _MASK64, self._idx

    @property
    def _fresh(self) -> bool:
        """Whether every stream is still at its start (no generator made, nothing drawn):
        what a planner reading ``pcg_words`` instead of the generators needs. O(1): read
        once per batch, with the GIL held."""
        return self._drawn is None and not self._made

    def _drew(self, draws: np.ndarray) -> None:
        """``draws[j]`` doubles were drawn from sample j's stream without its generator (the C
        planner, from ``pcg_words``): a generator made later continues after them, where the
        Python planner leaves a generator it drew from. Internal (kuat.vision.Compose)."""
        self._drawn = draws

    def __len__(self) -> int:
        return len(self._gens)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        g = self._gens[j]
        if g is None:
            self._made = True
            g = self._gens[j] = SampleRNG(int(self.seeds[j]), self.pcg_words[j]).numpy
            if self._drawn is not None and self._drawn[j]:
                g.bit_generator.advance(int(self._drawn[j]))  # one step per double
        return g

    def __repr__(self) -> str:
        return f"BatchGenerators(B={len(self)})"


_min = np.minimum.reduce
_native_words = _native_seed = None  # C sample_words and derive_seed, once registered


def use_native_words(fn, seed_fn=None) -> None:
    """Hash the batch's seeds with ``fn(seed, epoch, indices, seeds_out, words_out)`` (and
    :func:`derive_seed`'s with ``seed_fn(words)``): NumPy's values, computed in C (``_roijpeg``'s
    ``sample_words``, ``derive_seed``; registered when it loads; tested). Not for users."""
    global _native_words, _native_seed
    _native_words, _native_seed = fn, seed_fn


def _batch_words(indices, context: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(seeds (B,) uint64, pcg_words (B, 4) uint64)`` of the samples ``indices`` in
    ``context`` (``(seed, epoch)``; default: this thread's current one)."""
    idx = np.ascontiguousarray(np.asarray(indices, dtype=np.int64).reshape(-1))  # (B,)
    if idx.size == 0:
        return np.empty(0, np.uint64), np.empty((0, 4), np.uint64)
    if _min(idx) < 0:  # (the ufunc itself: ndarray.min's Python wrapper costs more, per batch)
        raise ValueError(f"sample indices must be >= 0, got {int(idx.min())}")
    seed, epoch = current_epoch() if context is None else context
    if _native_words is not None:
        seeds = np.empty(idx.size, np.uint64)
        words = np.empty((idx.size, 4), np.uint64)
        _native_words(seed & _MASK64, epoch & _MASK64, idx, seeds, words)
        return seeds, words
    prefix = _seedseq.int_words(seed & _MASK64) + _seedseq.int_words(epoch & _MASK64)
    seeds = _hash_batch(prefix, idx.astype(np.uint64), 2).view("<u8")[:, 0]  # (B,) uint64
    words = _hash_batch([], seeds, 8).view("<u8")  # (B, 4) uint64: PCG64's generate_state(4)
    return seeds, words


def _hash_batch(prefix: list[int], last: np.ndarray, n_words: int) -> np.ndarray:
    """``SeedSequence(prefix + [v]).generate_state(n_words)`` for each ``v`` of ``last``
    ``(B,)`` uint64: ``(B, n_words)`` uint32. Values of one and of two 32-bit words hash
    separately (their entropy lengths differ)."""
    lo = (last & np.uint64(_MASK32)).astype(np.uint32)  # (B,)
    hi = (last >> np.uint64(32)).astype(np.uint32)
    out = np.empty((len(last), n_words), np.uint32)
    consts = [np.full(len(last), w, np.uint32) for w in prefix]
    one = hi == 0
    if one.all():
        return _seedseq.generate_state(consts + [lo], n_words)
    for mask, cols in ((one, [lo]), (~one, [lo, hi])):
        if mask.any():
            out[mask] = _seedseq.generate_state([c[mask] for c in consts + cols], n_words)
    return out


class _PrecomputedSeedSequence(ISpawnableSeedSequence):
    """``SeedSequence(seed)`` whose ``generate_state(4, np.uint64)`` (what PCG64 asks for) is
    already known; anything else is answered by a real ``SeedSequence(seed)``, made on first
    use (so ``spawn`` and its children match an ordinary ``PCG64(seed)``)."""

    def __init__(self, seed: int, pcg_words: np.ndarray):
        self._seed = seed
        self._words = pcg_words  # (4,) uint64
        self._real = None

    def _seq(self) -> np.random.SeedSequence:
        if self._real is None:
            self._real = np.random.SeedSequence(self._seed)
        return self._real

    def generate_state(self, n_words, dtype=np.uint32):
        if n_words == 4 and np.dtype(dtype) == np.uint64:
            return self._words.copy()
        return self._seq().generate_state(n_words, dtype)

    def spawn(self, n_children):
        return self._seq().spawn(n_children)

    def __getattr__(self, name):  # entropy, spawn_key, pool, n_children_spawned, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._seq(), name)

    def __repr__(self) -> str:
        return repr(self._seq())


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
    at a fraction of its cost (one attribute store per sample, not a context manager). The
    sample whose ``fn(i)`` raised is then :func:`failed_sample`'s answer, in this thread."""
    cur = _local.current
    old = cur.index
    out = []
    append = out.append
    try:
        for i in indices:
            cur.index = i
            try:
                append(fn(i))
            except Exception as e:  # the failing sample, for the error's note (engine.base)
                note_failed(e, i)
                raise
    finally:
        cur.index = old
    return out


def note_failed(exc: BaseException, position: int) -> None:
    """Record, in this thread, that the sample at ``position`` raised ``exc``."""
    _local.failed = (exc, position)


def failed_sample(exc: BaseException) -> int | None:
    """The position (an index; an iterable item's place in its worker's epoch) recorded for
    ``exc`` in this thread, or None; forgets it (the exception is not kept alive)."""
    failed, _local.failed = _local.failed, None
    return failed[1] if failed is not None and failed[0] is exc else None


def seed_worker_globals(base_seed: int, worker_id: int, *, cuda: bool = True) -> None:
    """Seed the global generators of worker ``worker_id`` as torch seeds its worker processes
    (``torch/utils/data/_utils/worker.py``): ``random`` and torch's default generator with
    ``base_seed + worker_id`` (all CUDA generators too when ``cuda``, as ``torch.manual_seed``;
    a thread worker passes ``cuda=False``: the training loop owns them), NumPy's legacy global
    generator from torch's ``_generate_state(base_seed, worker_id)`` (four 32-bit words)."""
    import torch

    seed = base_seed + worker_id
    random.seed(seed)
    if cuda:
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)
    try:
        from torch.utils.data._utils.worker import _generate_state
    except ImportError:  # a torch without it: a mixed 32-bit seed of our own
        np.random.seed(int(np.random.SeedSequence([base_seed & _MASK64, worker_id])
                           .generate_state(1, np.uint32)[0]))
    else:
        np.random.seed(_generate_state(base_seed, worker_id))


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
