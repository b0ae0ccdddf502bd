"""What an epoch's iterator is handed: the :class:`EpochPlan` and the seams it calls.

The iterator (:mod:`kuat.loader._iterator`) reads nothing of the loader: everything it needs
for one epoch is in the plan, made by :func:`kuat.loader._epoch.plan_epoch` when the epoch
starts (the iterator's first ``next()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kuat.loader._adaptive import Adaptation
    from kuat.loader._state import Position
    from kuat.loader._stats import LoaderStats
    from kuat.loader._workers import Lease

__all__ = ["BatchFeed", "EpochPlan", "EpochObserver", "LoaderEvents"]


class EpochObserver(Protocol):
    """A framework's view of an epoch (``kuat.integrations``: Accelerate's ``GradientState``).

    Made per epoch by the factory the integration gave the loader; called by the iterator in
    the consumer thread.
    """

    def epoch_started(self, batches: int | None) -> None:
        """The epoch starts; it has ``batches`` batches, or ``None`` when unknown (the
        iterator then looks one batch ahead, so that :meth:`last_batch` comes before the last
        batch is returned)."""

    def last_batch(self) -> None:
        """The batch about to be returned (or just returned) is the epoch's last."""

    def epoch_ended(self) -> None:
        """The iterator is done with the epoch (called once)."""


class BatchFeed(Protocol):
    """Where each batch of a replica group comes from (:mod:`kuat.replicas`: ``replicas=``,
    ``replica_check_every=``). Called by the iterator in the consumer thread, once per batch,
    on every rank of the group in the same order (it may run collectives)."""

    def next(self, fetch: Callable[[], Any], dataset_error: type[BaseException]) -> Any:
        """The next batch: ``fetch()``'s (this rank reads), or the one the group's leader
        fetched (this rank is a peer: ``fetch`` is not called). Raises ``StopIteration`` at
        the end of the epoch; a ``dataset_error`` (its ``exc`` the dataset's exception; built
        as ``dataset_error(exc)`` on peers) when the dataset raised; anything else ends the
        epoch."""


@dataclass(frozen=True)
class LoaderEvents:
    """Callbacks to the loader for what it reports once (warnings, advice)."""

    skipped: Callable[[list], None]  # samples dropped by on_error="skip": (index, type, message)
    unsplit_iterable: Callable[[], None]  # an IterableDataset never asked get_worker_info()
    finished: Callable[[], None]  # the epoch ran out (advice from the statistics)


@dataclass(frozen=True)
class EpochPlan:
    """One epoch, as decided when it starts.

    Attributes:
        epoch: the epoch number.
        base_seed: per-worker seeds are ``base_seed + worker_id`` (as torch).
        keys: the epoch's task keys, from the first one to fetch: batches of indices (or one
            index without auto-collation), ``None`` per batch (iterable), or a
            ``kuat.engine.base.ResumeAt`` (an iterable source resuming itself).
        discard: results to fetch and drop first (an iterable source resumed by replay).
        pace: ``(ahead, count)``: pull keys no later than torch's multi-worker iterator pulls
            them (``ahead = prefetch_factor * num_workers`` at the start, ``count`` keys in the
            epoch or ``None``); ``None`` without workers.
        position: the loader's position record this epoch advances (``kuat.loader._state``).
        lease: the engine (``kuat.loader._workers.Lease``).
        adaptation: the epoch's adaptive policy (``kuat.loader._adaptive.Adaptation``).
        in_order, timeout: as the loader's arguments.
        stats: the loader's ``LoaderStats``.
        device: copy batches there on a side stream (``None``: host batches).
        transform: the source's batch transform, applied after the copy, or ``None``.
        observer: a framework's :class:`EpochObserver`, or ``None``.
        batches: the epoch's number of batches, when an observer needs it (else ``None``).
        events: :class:`LoaderEvents`.
        iterable: an iterable source (warnings differ).
        first_worker: the worker the epoch's first task goes to (then round-robin): the one
            after the last batch served, when a torch IterableDataset resumes mid-epoch.
        feed: the replica group's :class:`BatchFeed`, or ``None`` (this rank reads alone).
    """

    epoch: int
    base_seed: int
    keys: Iterator
    discard: int
    pace: tuple[int, int | None] | None
    position: Position
    lease: Lease
    adaptation: Adaptation
    in_order: bool
    timeout: float
    stats: LoaderStats
    device: Any  # torch.device | None
    transform: Callable[[Any], Any] | None
    observer: EpochObserver | None
    batches: int | None
    events: LoaderEvents
    iterable: bool
    first_worker: int = 0
    feed: BatchFeed | None = None
