"""NumPy's ``SeedSequence`` hashing for a whole batch of seeds at once (exact, vectorised).

``kuat.sample_rng(i)`` seeds each sample with ``SeedSequence([seed, epoch, i])`` and builds
``Generator(PCG64(sample_seed))``, which hashes again: two ``SeedSequence`` constructions,
about 17 us of Python-level work per sample (1.5-2% of a fused 224x224 JPEG crop, more once
its cache pollution of the decode that follows is counted). The loader fetches a batch of
indices at once, so both hashes run here as NumPy array arithmetic over the batch (about 100
array operations per batch, whatever its size) and each generator is seeded from the
precomputed words. When the ROI decoder is built, ``kuat.rng`` hashes in C instead
(``_roijpeg.c`` ``sample_words``, registered with ``kuat.rng.use_native_words``: under 1 us per
sample against 8.6 here); this module stays the reference the tests compare it with, and the
path without the extension.

The algorithm is NumPy's (``numpy/random/bit_generator.pyx``: ``_coerce_to_uint32_array``,
``mix_entropy`` with ``hashmix``/``mix``, ``generate_state``), which itself is Melissa
O'Neill's seed_seq design. ``tests/test_vision_loop.py`` checks it against
``np.random.SeedSequence`` over edge values (0, 2**32 - 1, 2**32, 2**64 - 1 ...).
"""

from __future__ import annotations

import numpy as np

__all__ = ["generate_state", "int_words"]

_POOL = 4  # DEFAULT_POOL_SIZE
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_M32 = 0xFFFFFFFF


def int_words(n: int) -> list[int]:
    """``n >= 0`` as little-endian 32-bit words, ``[0]`` for 0 (``_int_to_uint32_array``)."""
    if n == 0:
        return [0]
    words = []
    while n > 0:
        words.append(n & _M32)
        n >>= 32
    return words


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    r = x * np.uint32(_MIX_L) - y * np.uint32(_MIX_R)  # wraps mod 2**32, as C's uint32_t
    return r ^ (r >> np.uint32(16))


class _Hash:
    """``hashmix`` with its running constant (the same for every element of the batch)."""

    __slots__ = ("const",)

    def __init__(self):
        self.const = _INIT_A

    def __call__(self, value: np.ndarray) -> np.ndarray:
        value = value ^ np.uint32(self.const)
        self.const = (self.const * _MULT_A) & _M32
        value = value * np.uint32(self.const)
        return value ^ (value >> np.uint32(16))


def generate_state(entropy: list[np.ndarray], n_words: int) -> np.ndarray:
    """``SeedSequence(e).generate_state(n_words, np.uint32)`` for each column ``e`` of
    ``entropy``: a list of ``(B,)`` uint32 arrays, word ``k`` of every element's assembled
    entropy (so every element has the same number of words). Returns ``(B, n_words)`` uint32.
    (For ``np.uint64`` output take ``2 * n`` words and ``.view("<u8")``.)
    """
    b = len(entropy[0])
    with np.errstate(over="ignore"):
        h = _Hash()
        zero = np.zeros(b, np.uint32)
        pool = [h(entropy[i] if i < len(entropy) else zero) for i in range(_POOL)]
        for src in range(_POOL):
            for dst in range(_POOL):
                if src != dst:
                    pool[dst] = _mix(pool[dst], h(pool[src]))
        for src in range(_POOL, len(entropy)):
            for dst in range(_POOL):
                pool[dst] = _mix(pool[dst], h(entropy[src]))
        out = np.empty((b, n_words), np.uint32)
        const = _INIT_B
        for k in range(n_words):
            v = pool[k % _POOL] ^ np.uint32(const)
            const = (const * _MULT_B) & _M32
            v = v * np.uint32(const)
            out[:, k] = v ^ (v >> np.uint32(16))
    return out
