"""The user's ``datasets.IterableDataset`` follows the loader's progress without workers.

``datasets`` keeps a stream's position on the dataset object: ``ds.state_dict()`` is "the
state at the latest example it yielded", and its documentation resumes a loop with
``ds.load_state_dict(state)``. torch's DataLoader with ``num_workers=0`` iterates the user's
object itself, so that recipe works there (with workers it does not: they iterate copies).
kuat reads a private copy (two readers of one object would disturb each other), so without
this module ``ds.state_dict()`` stayed at the epoch's start and a resume from it read the epoch
again. In the main process, one reader of the whole stream (world size 1, or the user's own
``split_dataset_by_node``), the user's object now answers as under torch:

* the row path: its ``_state_dict`` is the copy's live state (``datasets`` updates it in place
  as rows are read, the state of the latest row the loader took);
* the columnar path (Arrow batches, no per-row state kept): a stand-in, :class:`Replayed`,
  that ``ds.state_dict()`` turns into ``datasets``' own state after the rows the loader has
  taken, by reading that many rows of a fresh copy with ``datasets``' iteration (cost: the
  epoch's rows so far at ``datasets``' row rate, paid only when a state is asked for).

A state given to the user's ``load_state_dict`` names the epoch the loader starts next
(:func:`epoch_request`), also when the loader has counted its own epochs past it.

Thread-safety: called in the consumer thread only (``num_workers=0``; :func:`epoch_request`:
the loader's main process).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice

import torch

__all__ = ["Replayed", "epoch_request", "following", "follows", "live_rows", "memo"]


def follows(stream) -> bool:
    """Whether ``stream``'s user object should follow the loader: no worker, world size 1."""
    return torch.utils.data.get_worker_info() is None and stream._rank_and_world()[1] == 1


def epoch_request(stream) -> int | None:
    """``HFIterableSource.kuat_epoch_request``: the epoch ``stream.dataset.set_epoch`` set since
    the last call (or since construction, from datasets' epoch 0; a ``set_epoch`` to the value
    already seen is not seen), else the epoch of a state given to its ``load_state_dict``
    since then, else ``None``.

    A loaded state names the epoch it was saved in (``datasets`` resumes it only at that
    epoch). Under torch that is the dataset's own epoch; kuat's loader counts its epochs
    itself (0, 1, 2... without ``set_epoch``), so a state saved in its epoch 1, or loaded
    after an epoch ran, was dropped by ``datasets`` and the epoch read again from its start
    (silent duplicates): it now makes its epoch the next. Both changed: ``set_epoch`` decides
    (the state resumes only if it is of that epoch, as in ``datasets``)."""
    epoch = int(getattr(stream.dataset, "epoch", 0))
    state = getattr(stream.dataset, "_starting_state_dict", None)
    new_state = state is not None and state is not stream._seen_state
    stream._seen_state = state
    if epoch != stream._seen_epoch:
        stream._seen_epoch = epoch
        return epoch
    saved = state.get("epoch") if new_state and isinstance(state, dict) else None
    return saved if isinstance(saved, int) else None


def memo(dataset) -> dict:
    """``copy.deepcopy`` memo entries for kuat's own copies of ``dataset``: a
    :class:`Replayed` state is not copied (its copy replays rows; a copy's own iteration makes
    its own state)."""
    state = getattr(dataset, "_state_dict", None)
    return {id(state): None} if isinstance(state, Replayed) else {}


def following(stream, ds, rows: Iterable, live: bool) -> Iterator:
    """``rows``, the row path's share of the epoch read from ``ds`` (the stream's copy), with
    the user's object following them where it should (:func:`follows`): reading the copy's
    live state (``live``: ``datasets``' own iteration of ``ds``), else a :class:`Replayed`
    count of the rows taken, those an elastic resume skipped included (the rows were read
    past ``datasets``' iteration: ``kuat.sources._hf_split`` runs a filter or map only on
    the rows kept, which keeps no state)."""
    if not follows(stream):
        return iter(rows)
    if live:
        return live_rows(stream, ds, rows)
    start = getattr(stream, "_start", None)
    skipped = start[1] if start is not None and start[0] == stream._epoch else 0
    return Replayed(stream, stream._epoch, skipped).counted_rows(rows)


def live_rows(stream, ds, rows: Iterable) -> Iterator:
    """``rows`` (read from ``ds``, the stream's copy); once the first is read (``datasets``
    has made the copy's state), the user's object reads that state."""
    it = iter(rows)
    for first in it:
        stream.dataset._state_dict = ds._state_dict
        yield first
        yield from it
        return
    stream.dataset._state_dict = ds._state_dict  # an empty epoch


class Replayed:
    """The user's ``_state_dict`` while the columnar path reads epoch ``epoch``: ``rows``
    rows taken so far. ``datasets`` deep-copies it in ``state_dict()``: the copy is the
    state ``datasets`` has after yielding that many rows."""

    def __init__(self, stream, epoch: int, rows: int = 0):
        self.stream, self.epoch = stream, epoch
        self.rows: int | None = rows  # None: the stream's end was read (torch's fetcher read it)

    def state(self) -> dict:
        ds = self.stream._copy(self.epoch)
        ds._starting_state_dict = None  # (the rows counted are from the epoch's start)
        it = iter(ds)
        deque(islice(it, self.rows), maxlen=0)
        return ds.state_dict()

    def __deepcopy__(self, memo) -> dict:
        return self.state()

    def __reduce__(self):
        # pickled (a process worker's copy of the dataset): no state, as a dataset never
        # iterated; its iteration starts its own (a replay here would read the stream again)
        return type(None), ()

    def counted_rows(self, rows: Iterable) -> Iterator:
        """``rows``, counting them as they are taken; their end means the stream's end."""
        self.stream.dataset._state_dict = self
        for row in rows:
            self.rows += 1
            yield row
        self.rows = None

    def counted(self, batches: Iterable, batch_size: int) -> Iterator:
        """``(rows, batch)`` pairs of ``batches``, counting the rows as they are taken; a
        short batch, or the end, means the stream's end was read (as torch's fetcher reads
        it, filling that batch)."""
        self.stream.dataset._state_dict = self
        for rows, batch in batches:
            ended = self.rows is None or rows < batch_size
            self.rows = None if ended else self.rows + rows
            yield rows, batch
        self.rows = None
