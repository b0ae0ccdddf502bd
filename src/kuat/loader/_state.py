"""Where a loader is: its position in the epoch order, a pending resume, and the state dict.

A loader's position is four small records (docs/loader.md, "Resume"):

* :class:`Position`: the epoch being served (or last served), how many batches of it were
  served, whether it ran out, and the states its order started from. The running iterator
  advances it; ``state_dict()`` reads it; a ``skip_first_batches`` copy shares it with the
  loader it skips for.
* :class:`WorkerStates`: a torch ``IterableDataset``'s per-worker dataset states as of the
  batches served (torchdata's ``StatefulDataLoader`` rule), held by the position.
* :class:`Pending`: what the next epoch started must begin from (``set_epoch``,
  ``load_state_dict``, or the draws ``state_dict()`` made ahead at an epoch's start), until an
  epoch starts.
* :class:`SourceAt`: the source's own state loaded with a position (iterable sources resume
  from it when the same position starts).

:func:`state_dict` and :func:`load_state_dict` are the bodies of the loader's methods of those
names; they read the loader's face and its :class:`LoaderState`.
"""

from __future__ import annotations

import collections
import pickle
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kuat._sampler_order import describe_sampler, order_state, sampler_generator
from kuat.loader._elastic import layout, resume_offset, same_stride, samples_consumed, stride
from kuat.sources import protocol as _protocol

__all__ = ["Position", "KeysDone", "skip_done", "WorkerStates", "Pending", "SourceAt", "LoaderState", "STATE_VERSION",
           "persists", "state_dict", "load_state_dict"]

STATE_VERSION = 1


class WorkerStates:
    """Each worker's own dataset state (a torch ``IterableDataset`` or its iterator with
    ``state_dict``/``load_state_dict``), as of the batches served: what torchdata's
    ``StatefulDataLoader`` keeps per worker (``dataset_state``, the iterator's state and
    whether it ran out), so that each worker resumes its own copy where it was.

    Workers report a state (pickled, ``kuat.engine.job``) with every result; the epoch's
    iterator hands each one over with :meth:`took` when it takes the result and commits it
    with :meth:`served_one` when the batch is returned, so a state never runs ahead of the
    batches the user received (prefetch, the device copy one batch ahead, look-ahead).
    """

    __slots__ = ("num_workers", "states", "last", "_taken")

    def __init__(self, num_workers: int, states: list | None = None, last: int = -1):
        self.num_workers = num_workers
        self.states: list[bytes | None] = list(states) if states else [None] * max(1, num_workers)
        self.last = last  # the worker of the last batch served in the epoch (-1: none yet)
        self._taken: collections.deque = collections.deque()  # (worker, state, is a batch)

    def took(self, worker_id: int, state: bytes, batch: bool) -> None:
        self._taken.append((worker_id, state, batch))

    def served_one(self) -> None:
        """A batch was returned: commit the states taken up to and including its own."""
        while self._taken:
            w, state, batch = self._taken.popleft()
            self.states[w] = state
            if batch:
                self.last = w
                return

    def next_epoch(self) -> WorkerStates:
        """The states a next epoch of the same worker copies starts from, once this epoch ran
        out: each one as its iterator ended. A worker resuming from one loads it, then starts
        the epoch with a new ``iter()`` (as torchdata's worker does: the state's side effects,
        a restored RNG, carry over; its position does not)."""
        while self._taken:  # the workers' ends, taken after the last batch
            w, state, _ = self._taken.popleft()
            self.states[w] = state
        return WorkerStates(self.num_workers, self.states)

    def to_state(self) -> dict | None:
        """``state_dict()["workers"]``: ``num_workers``, ``last`` and ``states`` (per worker
        ``{"dataset", "iterator", "ended"}`` or ``None``); ``None`` when no worker had one."""
        if all(b is None for b in self.states):
            return None
        return {"num_workers": self.num_workers, "last": self.last,
                "states": [None if b is None else pickle.loads(b) for b in self.states]}

    @classmethod
    def from_state(cls, saved: dict) -> WorkerStates:
        states = [None if s is None else pickle.dumps(s) for s in saved["states"]]
        return cls(int(saved["num_workers"]), states, int(saved["last"]))


class KeysDone:
    """Which of an epoch's keys (a map-style dataset's batches, each named by its ordinal in
    the epoch's key order, resumed ones included) are done: every one before ``prefix`` and
    those in ``ahead``. Batches served out of order (``in_order=False``) leave holes: a state
    taken then names exactly the keys served, so that resume fetches exactly the others (the
    batches in flight when it was taken included). A key whose batch failed or came out empty
    (``on_error="skip"``) is done when taken: resume does not fetch it again.

    The epoch's iterator names each key's ordinal when it dispatches it (:meth:`dispatched`),
    hands it over when it takes its result (:meth:`took`) and commits it when the batch is
    returned (:meth:`returned`), so the record never runs ahead of what the user received.
    Not thread-safe (the consumer thread's)."""

    __slots__ = ("prefix", "ahead", "_next", "_taken")

    def __init__(self, prefix: int, ahead=()):
        self.prefix = prefix
        self.ahead: set[int] = set(ahead)
        self._next = prefix  # the ordinal of the next key dispatched
        self._taken: collections.deque[int] = collections.deque()

    def dispatched(self) -> int:
        """The ordinal of the next key pulled from the epoch's (resumed) key order."""
        while self._next in self.ahead:
            self._next += 1
        self._next += 1
        return self._next - 1

    def took(self, ordinal: int, batch: bool) -> None:
        """The iterator took the result of key ``ordinal``: a batch to return (committed by
        :meth:`returned`), or not (failed, or empty: done now)."""
        if batch:
            self._taken.append(ordinal)
        else:
            self._done(ordinal)

    def returned(self) -> None:
        if self._taken:
            ordinal = self._taken.popleft()
            if ordinal == self.prefix and not self.ahead:  # (in order: _done's first step)
                self.prefix += 1
            else:
                self._done(ordinal)

    def _done(self, ordinal: int) -> None:
        if ordinal != self.prefix:
            self.ahead.add(ordinal)
            return
        self.prefix += 1
        while self.prefix in self.ahead:
            self.ahead.remove(self.prefix)
            self.prefix += 1

    def to_state(self, served: int) -> dict | None:
        """``state_dict()["keys_done"]``: ``{"prefix", "ahead"}`` when it says more than
        ``served`` (the first ``served`` keys done), else None."""
        if self.prefix == served and not self.ahead:
            return None
        return {"prefix": self.prefix, "ahead": sorted(self.ahead)}


def skip_done(keys, prefix: int, ahead) -> Iterator:
    """The keys of ``keys`` (the epoch's order from key ``prefix`` on) whose ordinals are not
    in ``ahead``."""
    ahead = set(ahead)
    return (k for o, k in enumerate(keys, prefix) if o not in ahead)


@dataclass
class Position:
    """The epoch being served and how far (mutated by the epoch's iterator only)."""

    epoch: int
    served: int  # batches of the epoch served (skipped ones on resume included)
    exhausted: bool = False  # the epoch's iterator ran out
    at_start: dict[str, Any] = field(default_factory=dict)  # states the order started from
    workers: WorkerStates | None = None  # per-worker dataset states (stateful iterables)
    yielded: int = 0  # batches this epoch's iterator returned
    # elastic resume (:func:`samples_consumed`): positions of the epoch's global order consumed
    # before this layout's first batch, and ``served`` then (batches counted as served before)
    offset: int = 0
    base: int = 0
    # called with ``yielded`` after each batch (torch's IterableDataset length warning)
    on_batch: Callable[[int], None] | None = None
    # which keys are done (map-style; None: the first ``served``); the epoch's iterator names
    # each key it dispatches and takes to it (KeysDone.dispatched, took)
    keys: KeysDone | None = None
    # started by iter() (num_workers=0 over a torch IterableDataset: _epoch.opens_at_iter) and
    # not next()-ed yet: an iterator dropped unused leaves the epoch to the next one started
    opened: bool = False

    def took(self, worker_id: int, state: bytes, batch: bool) -> None:
        """The iterator took a result carrying worker ``worker_id``'s dataset state."""
        if self.workers is not None:
            self.workers.took(worker_id, state, batch)

    def advance(self) -> None:
        """The iterator returned a batch."""
        self.served += 1
        self.yielded += 1
        if self.keys is not None:
            self.keys.returned()
        if self.workers is not None:
            self.workers.served_one()
        if self.on_batch is not None:
            self.on_batch(self.yielded)


@dataclass(frozen=True)
class Pending:
    """The position the next epoch started begins from (``set_epoch``/``load_state_dict``).

    ``request`` orders it against a sampler's ``set_epoch`` (``kuat.sampling.next_request``:
    the later request wins); ``rng``: states to restore (``generator``, ``sampler``,
    ``sampler_seed``)."""

    request: int
    epoch: int
    served: int
    rng: dict[str, Any]
    workers: WorkerStates | None = None  # each worker's dataset state to resume from
    loaded: dict | None = None  # the state given to load_state_dict (state_dict() returns it)
    keys_done: tuple | None = None  # (prefix, ahead) of KeysDone when served out of order
    drawn: tuple | None = None  # draws made for the epoch by state_dict() (_epoch.epoch_draws)
    # elastic resume: the epoch starts after this many positions of its global order (the
    # loader's own sampler, a kuat stream, a user sampler= resumed with another batch size);
    # ``served`` is then the batches counted as served before them (_elastic.resume_offset)
    offset: int | None = None


@dataclass(frozen=True)
class SourceAt:
    """A source's own state saved at ``(epoch, served)`` (``kuat_state_at``/``state_dict``)."""

    epoch: int
    served: int
    state: Any


@dataclass
class LoaderState:
    """A loader's position records (one per loader; see the module docstring)."""

    position: Position | None = None  # of the last epoch started
    pending: Pending | None = None
    source_at: SourceAt | None = None
    skip_first: int = 0  # batches the next epoch skips (a skip_first_batches copy)
    owner: Any = None  # weakref to the loader a skip_first_batches copy reports its position to

    def following_epoch(self) -> int:
        """The epoch after the last one started (0 before any; an epoch opened by ``iter()``
        whose iterator saw no ``next()`` was not started: it comes again)."""
        if self.position is None:
            return 0
        return self.position.epoch + (not self.position.opened)


def order_at_start(loader) -> dict[str, Any]:
    """The states an epoch started now would begin from (``state_dict()`` between epochs).

    A user sampler's state is left out when it follows from others: when it draws from
    torch's global RNG (a fresh epoch draws from it as it will be then) or from the loader's
    own ``generator`` (restored, then drawn from as in the uninterrupted run).
    """
    rng: dict[str, Any] = {}
    if loader.generator is not None:
        rng["generator"] = loader.generator.get_state()
    if not loader._traits.own_sampler and not loader._traits.iterable:
        state = order_state(loader._index_sampler)
        follows = state is not None and (
            "global_rng" in state
            or (loader.generator is not None
                and sampler_generator(loader._index_sampler) is loader.generator)
        )
        if not follows:
            rng["sampler"] = state
    return rng


def persists(loader) -> bool:
    """Whether the dataset copies workers read carry over to the next epoch: persistent
    workers' copies, or the loader's own dataset read with ``num_workers=0`` (as torch)."""
    return bool(loader.persistent_workers) or loader.num_workers == 0


def state_dict(loader) -> dict[str, Any]:
    """:meth:`kuat.DataLoader.state_dict`'s body (see there)."""
    st: LoaderState = loader._state
    if st.pending is not None and st.pending.loaded is not None:
        return dict(st.pending.loaded)  # nothing moved since load_state_dict (as torchdata)
    workers = keys_done = None
    offset = base = 0  # (elastic resume: samples_consumed)
    if st.pending is not None:
        epoch, served, rng = st.pending.epoch, st.pending.served, st.pending.rng
        workers = st.pending.workers
        if st.pending.offset is not None:
            offset, base = st.pending.offset, st.pending.served
        if st.pending.keys_done is not None:
            keys_done = {"prefix": st.pending.keys_done[0], "ahead": list(st.pending.keys_done[1])}
    elif st.position is None:
        epoch, served, rng = 0, 0, None
    else:
        pos = st.position
        epoch, served, rng, workers = pos.epoch, pos.served, pos.at_start, pos.workers
        offset, base = pos.offset, pos.base
        keys_done = pos.keys.to_state(served) if pos.keys is not None else None
        if keys_done is not None and loader._traits.iterable:  # (its keys name no batches)
            per_worker = pos.workers is not None and any(b is not None for b in pos.workers.states)
            if keys_done["ahead"] and not per_worker and not pos.exhausted:
                warnings.warn(
                    "kuat DataLoader: batches of this IterableDataset were returned out of "
                    "order (in_order=False) and neither it nor its iterator has state_dict(): "
                    "the state counts the batches served, not which, so a resume from it is "
                    "not exact", stacklevel=3)
            keys_done = None
        # Only an epoch that ran out points at the next one: a state taken after the last
        # batch, inside the loop, resumes to an empty rest of the epoch (torchdata #1439)
        if pos.exhausted:
            epoch, served, rng, keys_done = epoch + 1, 0, None, None
            offset = base = 0
            workers = workers.next_epoch() if workers is not None and persists(loader) else None
    if rng is None or not rng:  # the next epoch starts from the states as they are now
        rng = order_at_start(loader)
    rank, world_size = loader._resolve_distributed(warn=False)
    state = {
        "version": STATE_VERSION,
        "seed": loader.seed,
        "torch_order": loader._torch_order,
        "epoch": epoch,
        "batches_served_in_epoch": served,
        "rank": rank,
        "world_size": world_size,
        **rng,
        "samples_consumed": samples_consumed(loader, served, offset, base),
        "layout": layout(loader, world_size),
    }
    if keys_done is not None:  # served out of order: which keys (batch_served_in_epoch: how many)
        state["keys_done"] = keys_done
    source, traits = loader._source, loader._traits
    if traits.iterable and not traits.resumable:  # a torch IterableDataset: per worker
        saved = workers.to_state() if workers is not None else None
        if (saved is None and loader.num_workers == 0 and served == 0
                and _protocol.provides(source, _protocol.Stateful)):
            # num_workers=0 reads the loader's own dataset (as torch): before the epoch's first
            # batch its state is the dataset's as it is now (torchdata takes it at iter())
            saved = {"num_workers": 0, "last": -1,
                     "states": [{"dataset": source.state_dict(), "iterator": None,
                                 "ended": False}]}
        if saved is not None:
            state["workers"] = saved
    elif traits.iterable and traits.plan_state:
        state["source"] = source.kuat_state_at(epoch, served, rank, world_size)
    elif traits.stateful:
        state["source"] = source.state_dict()
    return state


def load_state_dict(loader, state: dict[str, Any]) -> None:
    """:meth:`kuat.DataLoader.load_state_dict`'s body (see there)."""
    from kuat.sampling import next_request

    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise ValueError(f"not a kuat DataLoader state of version {STATE_VERSION}: {state!r:.200}")
    world_size = loader._resolve_distributed(warn=False)[1]
    served = int(state["batches_served_in_epoch"])
    offset = resume_offset(loader, state, served, world_size)  # raises what cannot continue
    if offset is not None and not same_stride(loader, state, world_size):
        served = offset // stride(loader, world_size)  # (batches of the new layout before it)
    if "layout" not in state and state.get("world_size") != world_size:  # an older state
        warnings.warn(f"kuat DataLoader: resuming a state saved with world_size="
                      f"{state.get('world_size')} with world_size={world_size}: rank shares "
                      "differ, resume is not exact", stacklevel=3)
    rng: dict[str, Any] = {}
    if (state.get("generator") is None) != (loader.generator is None):
        warnings.warn("kuat DataLoader: the state was saved "
                      f"{'with' if state.get('generator') is not None else 'without'} a "
                      f"generator= and this loader has {'one' if loader.generator else 'none'}: "
                      "the order of the resumed epoch is not the saved one", stacklevel=3)
    elif loader.generator is not None:
        rng["generator"] = state["generator"]
    for key in ("sampler_seed", "shared_seed"):  # the epoch's torch-style shuffle seed; an
        if state.get(key) is not None:  # IterDataPipe's graph seed
            rng[key] = state[key]
    loader._torch_order = bool(state.get("torch_order", loader._torch_order))
    traits = loader._traits
    if not traits.own_sampler and not traits.iterable:
        if "sampler" in state and state["sampler"] is not None:
            rng["sampler"] = state["sampler"]
        elif served:
            warnings.warn(
                f"kuat DataLoader: cannot tell what the order of the user "
                f"{describe_sampler(loader._index_sampler)} depends on (no state_dict(), no "
                "generator, not a torch sampler): resuming replays iter(sampler) and skips "
                f"the {served} batches served, exact only if its order repeats",
                stacklevel=3,
            )
    if state["seed"] is not None:  # None: saved before the first epoch drew it
        loader._set_seed(state["seed"])
    loader._workers.drop_persistent()  # persistent workers hold the old seed
    workers = None
    if state.get("workers") is not None and traits.iterable and not traits.resumable:
        saved = state["workers"]
        if int(saved["num_workers"]) != loader.num_workers:
            raise ValueError(
                f"kuat DataLoader: the state holds the dataset states of "
                f"num_workers={saved['num_workers']} workers of an IterableDataset, and this "
                f"loader has num_workers={loader.num_workers}: each worker resumes its own "
                "copy (its shard), so resume with the same num_workers (as torchdata's "
                "StatefulDataLoader requires)")
        workers = WorkerStates.from_state(saved)
    st: LoaderState = loader._state
    # the source's own point in its plan there, handed to kuat_iter_from (iterable sources)
    st.source_at = SourceAt(int(state["epoch"]), served, state.get("source"))
    done = state.get("keys_done")
    if done is not None and not traits.iterable:
        done = (int(done["prefix"]), tuple(int(o) for o in done["ahead"]))
    else:
        done = None
    st.pending = Pending(next_request(), int(state["epoch"]), served, rng, workers=workers,
                         loaded=dict(state), offset=offset, keys_done=done)
    _protocol.epoch_request(loader._source)  # an earlier dataset.set_epoch() is overridden
    if "source" in state and _protocol.provides(loader._source, _protocol.Stateful):
        loader._source.load_state_dict(state["source"])
