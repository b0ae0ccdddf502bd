"""The bin-packing strategies of :func:`kuat.pack`, as pure functions over document lengths.

No tokens, no documents, no state: each strategy maps lengths (and a row capacity) to which
pieces go to which row, deterministically. The rest of the packer decides what to feed them
(buffers, carried rows: ``_inorder.py``) and builds the rows they choose (``_rows.py``); each
is checked alone against a one-item-at-a-time reference in
``tests/test_text_pack_strategies.py``.

* :class:`ConcatSplit`: the documents concatenated and cut every ``capacity`` tokens; any row's
  pieces by arithmetic on the running sum (``"concat"``).
* :func:`first_fit`: greedy first-fit in arrival order (``"first_fit"``).
* :func:`best_fit`: best-fit decreasing (``"best_fit"``).
"""

from __future__ import annotations

import bisect

import numpy as np

__all__ = ["STRATEGIES", "FIT_STRATEGIES", "ConcatSplit", "first_fit", "best_fit"]

STRATEGIES = ("concat", "first_fit", "best_fit")
_EMPTY = np.empty(0, np.int64)


class ConcatSplit:
    """Concat-split over the lengths ``lens`` ``(N,) int64`` of an epoch's documents, in order:
    row ``p`` is the tokens ``[p C, (p + 1) C)`` of their concatenation (``C``: ``capacity``),
    so a document may continue in the next row and only the last row is short.

    ``rows``: rows in the epoch; ``total``: its tokens; ``cum`` ``(N + 1,)``: where each
    document starts, then ``total``."""

    def __init__(self, lens: np.ndarray, capacity: int):
        self.capacity = capacity
        self.cum = np.concatenate([[0], np.cumsum(lens)])  # (N + 1,) where each document starts
        self.total = int(self.cum[-1])
        self.rows = -(-self.total // capacity)
        self._doc_starts = self.cum[:-1][lens > 0]  # (N',) starts of non-empty documents

    def pieces(self, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """The pieces of rows ``rows`` ``(R,)`` (row numbers in ``[0, self.rows)``, any order),
        each from a binary search over the documents' starts: ``(seg_row, seg_ord, seg_off,
        seg_len, fills)``, pieces ``(S,)`` sorted by row (its position in ``rows``) then
        column, piece ``s`` being tokens ``seg_off[s] .. seg_off[s] + seg_len[s]`` of document
        ``seg_ord[s]`` (a non-empty one); ``fills (R,)``: tokens per row."""
        length, total, cum, doc_starts = self.capacity, self.total, self.cum, self._doc_starts
        p = rows
        begin = p * length  # (R,) first token of each row in the epoch
        end = np.minimum(begin + length, total)  # (R,)
        a = np.searchsorted(doc_starts, begin, "right")  # documents starting inside the row
        b = np.searchsorted(doc_starts, end, "left")
        count = b - a + 1  # (R,) pieces per row: the row's start, then each document start
        seg_row = np.repeat(np.arange(len(p)), count)  # (S,)
        j = np.arange(len(seg_row)) - np.repeat(np.cumsum(count) - count, count)  # (S,)
        inner = doc_starts[np.maximum(a[seg_row] + j - 1, 0)]
        point = np.where(j == 0, begin[seg_row], inner)  # (S,) first token of each piece
        nxt = np.append(point[1:], 0)
        last = np.append(seg_row[1:] != seg_row[:-1], True)  # (S,) the row's last piece
        seg_len = np.where(last, end[seg_row], nxt) - point
        seg_ord = np.searchsorted(cum, point, "right") - 1  # (S,) the non-empty document there
        return seg_row, seg_ord, point - cum[seg_ord], seg_len, end - begin


def first_fit(sizes, capacity: int) -> tuple[list[list[int]], list[int]]:
    """Greedy first-fit in arrival order: each item into the lowest-numbered bin with room.
    ``sizes``: ``(n,)`` ints in ``[1, capacity]``. Returns the bins (item positions, in
    arrival order) and their fills.

    Computed bin by bin, which gives the same bins: an item goes to bin ``b`` exactly when it
    fits there and in no earlier bin, and a bin's room depends only on its own items, so bin
    ``b`` is a greedy in-order pass over the items the earlier bins left. Each pass takes the
    longest prefix that fits with one ``cumsum``, then the later items that still fit, each
    found as the first later item no larger than the room left (one vectorised search per item
    taken: few, as the room is smaller than the item that ended the prefix).
    """
    left = np.arange(len(sizes))  # (m,) items in no bin yet, in arrival order
    rest = np.asarray(sizes, np.int64)  # (m,) their sizes
    bins: list[list[int]] = []
    fills: list[int] = []
    # (ndarray methods rather than np.* functions: this loop runs once per row, and NumPy's
    # Python-level wrappers cost as much as the work on ~1,000 sizes)
    while len(left):
        total = rest[:capacity].cumsum()  # (<= capacity,): a bin holds at most that many
        j = int(total.searchsorted(capacity, "right"))  # items 0 .. j - 1 fit together
        room = capacity - int(total[j - 1])
        if room and j + 1 < len(rest):
            after = (rest[j + 1 :] <= room).nonzero()[0]  # (c,) the only later ones that may
        else:  # fit, from j + 1 on
            after = _EMPTY
        if not len(after):  # the prefix is the bin
            bins.append(left[:j].tolist())
            fills.append(capacity - room)
            left, rest = left[j:], rest[j:]
            continue
        after += j + 1  # (c,) positions in ``left``
        later = rest[after]  # (c,)
        picked = []
        k = 0  # position in ``after`` to search from
        while room and k < len(later):
            fits = later[k:] <= room  # (c - k,)
            hit = int(fits.argmax())
            if not fits[hit]:
                break
            picked.append(k + hit)
            room -= int(later[k + hit])
            k += hit + 1
        take = after[picked].tolist()  # (t,) positions in ``left`` of the later items taken
        bins.append(left[:j].tolist() + left[take].tolist())
        fills.append(capacity - room)
        starts, ends = [j, *(t + 1 for t in take)], [*take, len(left)]  # what stays: slices
        left = np.concatenate([left[a:b] for a, b in zip(starts, ends)])
        rest = np.concatenate([rest[a:b] for a, b in zip(starts, ends)])
    return bins, fills


def best_fit(sizes, capacity: int) -> tuple[list[list[int]], list[int]]:
    """Best-fit decreasing: longest first (ties in arrival order), each into the open bin with
    the least free space that still holds it (ties: the lowest-numbered), else a new bin.
    ``sizes``: ``(n,)`` ints in ``[1, capacity]``. Returns the bins (item positions, each in
    arrival order) and their fills.

    Items of equal size are placed a run at a time, with the same result as one at a time:
    the bin that takes an item of size ``s`` with ``f`` free stays the tightest for the next
    one while ``f - s >= s``, so it takes ``min(k, f // s)`` of a run of ``k``. The Python loop
    runs once per distinct size and bin filled, not once per item.
    """
    sizes = np.asarray(sizes, np.int64)
    n = len(sizes)
    order = np.argsort(-sizes, kind="stable")  # (n,) longest first, ties in arrival order
    ordered = sizes[order]
    run_start = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if n else order
    run_len = np.diff(np.r_[run_start, n])
    owner = np.empty(n, np.int64)  # (n,) the bin of each item, in ``order``
    free: list[tuple[int, int]] = []  # sorted (free space, bin) of bins that are not full
    fills: list[int] = []
    for pos, k, s in zip(run_start.tolist(), run_len.tolist(), ordered[run_start].tolist()):
        while k:
            j = bisect.bisect_left(free, (s, -1))
            if j < len(free):
                space, b = free.pop(j)
            else:
                space, b = capacity, len(fills)
                fills.append(0)
            m = min(k, space // s)
            owner[pos : pos + m] = b
            pos, k = pos + m, k - m
            fills[b] += m * s
            if space - m * s:
                bisect.insort(free, (space - m * s, b))
    item_bin = np.empty(n, np.int64)
    item_bin[order] = owner  # (n,) bin of each item, by arrival
    by_bin = np.argsort(item_bin, kind="stable")  # (n,) items by bin, then arrival
    cuts = np.searchsorted(item_bin[by_bin], np.arange(len(fills) + 1)).tolist()
    members = by_bin.tolist()
    return [members[cuts[b] : cuts[b + 1]] for b in range(len(fills))], fills


# the fit strategies by name: (sizes, capacity) -> (bins, fills); looked up at each buffer
FIT_STRATEGIES = {"first_fit": first_fit, "best_fit": best_fit}
