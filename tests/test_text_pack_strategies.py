"""kuat.text.pack._strategies: each bin-packing strategy alone, against the plain definition.

The strategies are vectorised (first-fit bin by bin, best-fit a run of equal sizes at a time,
concat-split by binary search); each is checked here against a reference written the slow,
obvious way: one item at a time (first-fit, best-fit) or one document piece at a time
(concat-split), over random lengths and capacities (hypothesis, derandomized, and a few
seeded NumPy draws with many repeated sizes).
"""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kuat.text.pack._strategies import (  # noqa: E402
    FIT_STRATEGIES,
    STRATEGIES,
    ConcatSplit,
    best_fit,
    first_fit,
)

SETTINGS = dict(
    deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


# --- references: one item at a time ------------------------------------------------------------


def first_fit_reference(sizes, capacity):
    """Each item, in arrival order, into the lowest-numbered bin with room, else a new one."""
    free, bins = [], []
    for i, s in enumerate(sizes):
        b = next((b for b, f in enumerate(free) if f >= s), len(free))
        if b == len(free):
            free.append(capacity)
            bins.append([])
        free[b] -= s
        bins[b].append(i)
    return bins, [capacity - f for f in free]


def best_fit_reference(sizes, capacity):
    """Longest first (ties by arrival), each into the bin with the least room that holds it
    (ties: the lowest-numbered), else a new one; each bin lists its items in arrival order."""
    free, bins = [], []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        fits = [(f, b) for b, f in enumerate(free) if f >= sizes[i]]
        b = min(fits)[1] if fits else len(free)
        if b == len(free):
            free.append(capacity)
            bins.append([])
        free[b] -= sizes[i]
        bins[b].append(i)
    return [sorted(b) for b in bins], [capacity - f for f in free]


def concat_reference(lens, capacity):
    """The documents, one piece at a time, into the current row until it is full, then a new
    row: each row a list of ``(document, offset in it, tokens)``."""
    rows = [[]]
    fill = 0
    for doc, n in enumerate(lens):
        off = 0
        while off < n:
            if fill == capacity:
                rows.append([])
                fill = 0
            take = min(n - off, capacity - fill)
            rows[-1].append((doc, off, take))
            fill += take
            off += take
    return rows if rows[-1] else rows[:-1]


# --- inputs --------------------------------------------------------------------------------------


@st.composite
def sizes_and_capacity(draw):
    """A capacity and item sizes in [1, capacity]: any sizes, or a few sizes repeated often
    (the runs best-fit places at once)."""
    capacity = draw(st.integers(1, 64))
    size = st.integers(1, capacity)
    pool = draw(st.lists(size, min_size=1, max_size=4))
    sizes = draw(st.lists(size, max_size=120) | st.lists(st.sampled_from(pool), max_size=120))
    return sizes, capacity


def _seeded_sizes(rng, capacity):
    """Random item sizes in [1, capacity]: uniform, or mostly small with many repeats."""
    n = int(rng.integers(0, 200))
    if rng.random() < 0.5:
        return rng.integers(1, capacity + 1, n).tolist()
    return np.minimum(rng.geometric(0.15, n), capacity).tolist()


def test_the_strategies_by_name():
    assert STRATEGIES == ("concat", "first_fit", "best_fit")
    assert FIT_STRATEGIES == {"first_fit": first_fit, "best_fit": best_fit}


# --- first-fit, best-fit --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fit, reference", [(first_fit, first_fit_reference), (best_fit, best_fit_reference)]
)
@given(case=sizes_and_capacity())
@settings(max_examples=300, **SETTINGS)
def test_fit_against_one_item_at_a_time(fit, reference, case):
    sizes, capacity = case
    bins, fills = fit(np.asarray(sizes, np.int64), capacity)
    assert (bins, fills) == reference(sizes, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))  # each item once
    assert all(0 < f <= capacity for f in fills)


@pytest.mark.parametrize(
    "fit, reference", [(first_fit, first_fit_reference), (best_fit, best_fit_reference)]
)
def test_fit_against_one_item_at_a_time_on_seeded_draws(fit, reference):
    rng = np.random.default_rng(6)
    for capacity in (1, 7, 64):
        for _ in range(60):
            sizes = _seeded_sizes(rng, capacity)
            assert fit(np.asarray(sizes, np.int64), capacity) == reference(sizes, capacity)


def test_fit_by_hand():
    sizes = [5, 3, 4, 2, 6]
    # first-fit: 5 -> 0, 3 -> 0 (8), 4 -> 1, 2 -> 0 (10), 6 -> 1 (10)
    assert first_fit(np.asarray(sizes, np.int64), 10) == ([[0, 1, 3], [2, 4]], [10, 10])
    # best-fit decreasing: 6 -> 0, 5 -> 1, 4 -> 0 (10), 3 -> 1 (8), 2 -> 1 (10)
    assert best_fit(np.asarray(sizes, np.int64), 10) == ([[2, 4], [0, 1, 3]], [10, 10])
    assert first_fit(np.empty(0, np.int64), 4) == best_fit(np.empty(0, np.int64), 4) == ([], [])


# --- concat-split ---------------------------------------------------------------------------------


@given(
    lens=st.lists(st.integers(0, 100), max_size=60),
    capacity=st.integers(1, 40),
    data=st.data(),
)
@settings(max_examples=300, **SETTINGS)
def test_concat_split_against_one_piece_at_a_time(lens, capacity, data):
    """Any rows asked, in any order (a rank's rows with wrap-around padding come back to the
    first ones): each row's pieces are those of the reference, in order."""
    split = ConcatSplit(np.asarray(lens, np.int64), capacity)
    ref = concat_reference(lens, capacity)
    assert split.rows == len(ref) and split.total == sum(lens)
    if not ref:
        return
    want = data.draw(st.lists(st.integers(0, len(ref) - 1), min_size=1, max_size=20))
    seg_row, seg_ord, seg_off, seg_len, fills = split.pieces(np.asarray(want, np.int64))
    got = [[] for _ in want]
    for r, o, off, n in zip(seg_row.tolist(), seg_ord.tolist(), seg_off.tolist(), seg_len.tolist()):
        got[r].append((o, off, n))
    assert got == [ref[r] for r in want]
    assert seg_row.tolist() == sorted(seg_row.tolist())  # pieces sorted by row, then column
    assert fills.tolist() == [sum(n for _, _, n in ref[r]) for r in want]


def test_concat_split_by_hand():
    # documents of 3, 0, 5 and 2 tokens in rows of 4: [0:0-3 | 2:0-1] [2:1-5] [3:0-2]
    split = ConcatSplit(np.array([3, 0, 5, 2], np.int64), 4)
    assert (split.rows, split.total, split.cum.tolist()) == (3, 10, [0, 3, 3, 8, 10])
    seg_row, seg_ord, seg_off, seg_len, fills = split.pieces(np.array([2, 0, 1], np.int64))
    assert seg_row.tolist() == [0, 1, 1, 2]
    assert seg_ord.tolist() == [3, 0, 2, 2]
    assert seg_off.tolist() == [0, 0, 0, 1]
    assert seg_len.tolist() == [2, 3, 1, 4]
    assert fills.tolist() == [2, 4, 4]
