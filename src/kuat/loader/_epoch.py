"""Where the epoch order is decided: turn the loader's position into an :class:`EpochPlan`.

When an epoch starts (its iterator's first ``next()``; with ``num_workers=0`` over a torch
``IterableDataset``, ``iter()``: :func:`opens_at_iter`), :func:`plan_epoch`

1. resolves rank and world size (:mod:`kuat.distributed`) and hands them to the loader's
   sampler or iterable source (:func:`apply_distributed`);
2. picks the epoch and what to skip (:func:`next_epoch`): a pending ``load_state_dict`` or
   ``set_epoch`` (the loader's, or the sampler's own ``set_epoch``, the later request wins),
   else the epoch after the last one, plus a ``skip_first_batches`` copy's skip;
3. restores or snapshots the order's states (``generator=``, a user sampler's), and draws
   what torch's DataLoader draws from torch's generators when it creates an iterator
   (``base_seed``; ``RandomSampler``'s seed with ``shuffle=True``), so swapping the class
   leaves every other user of those generators with torch's numbers;
4. builds the epoch's keys (:func:`epoch_keys`): batches of the loader's own sampler (prefetched
   in that order when the source can), or a user sampler's replayed order, from the first
   batch not yet served;
5. leases the engine (:mod:`kuat.loader._workers`) and sets the adaptive policy.

The plan is all the iterator reads (:mod:`kuat.loader._iterator`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import warnings
from typing import Any

import torch

from kuat import distributed
from kuat._sampler_order import distributed_hook, epoch_hook, order_state, restore_order
from kuat.engine.base import ResumeAt, Seeded, WorkerResume
from kuat.engine.inline import InlineEngine
from kuat.engine.thread import ThreadEngine
from kuat.loader import _elastic, _notices
from kuat.loader._adaptive import Adaptation
from kuat.loader._plan import EpochPlan, LoaderEvents
from kuat.loader._state import KeysDone, Pending, Position, WorkerStates, persists, skip_done
from kuat.loader._workers import Lease
from kuat.rng import epoch_context, worker_base_seed
from kuat.sampling import EpochSampler
from kuat.sources import protocol as _protocol
from kuat.sources.stream import Stream

__all__ = ["apply_distributed", "next_epoch", "plan_epoch", "opens_at_iter", "epoch_keys", "batched"]

log = logging.getLogger("kuat.loader")


def apply_distributed(loader) -> tuple[int, int]:
    """Resolve the loader's share (:mod:`kuat.distributed`; ``(0, 1)`` unsharded) and hand it
    to its sampler, iterable source and kuat batch sampler. An ``IterDataPipe`` is sharded over
    torch's process group, as torch's DataLoader does (a sharded loader refuses one)."""
    sharding = loader._options.sharding
    rank, world_size = sharding.resolve(warn=True)
    if isinstance(loader.sampler, EpochSampler):
        loader.sampler.set_distributed(rank, world_size)
    if loader._job.datapipe:  # workers shard its graph over torch's ranks, then workers
        # (asked at every epoch start, as torch's iterator does: the group may come up after
        # the loader is built; kuat's own sharding refuses a datapipe: _options.check_equal_steps)
        group = distributed.torch_group()
        if group != loader._job.shard:
            loader._job.shard = group
            loader._workers.drop_persistent()
    if (rank, world_size) != loader._dist_applied:
        if loader._traits.iterable and loader._traits.distributed:
            loader._source.kuat_set_distributed(rank, world_size)
            loader._workers.drop_persistent()  # persistent workers hold the old share
        hook = distributed_hook(loader.batch_sampler)
        if sharding.sharded and hook is not None:  # e.g. kuat.text.TokenBudgetBatchSampler
            hook(rank, world_size)
        if (world_size > 1 and loader._options.seed_was_none and loader._traits.own_sampler
                and getattr(loader.sampler, "shuffle", True)):  # an unshuffled order agrees
            log.warning("kuat.DataLoader on rank %d of %d drew its seed from torch's default "
                        "generator; pass the same seed= on every rank so that all ranks "
                        "shuffle alike", rank, world_size)
        loader._dist_applied = (rank, world_size)
    return rank, world_size


def epoch_length(loader) -> int:
    """``len(loader)`` before a ``skip_first_batches`` skip: batches of the index sampler, or
    of an iterable's ``len()`` (this rank's share of it when kuat shards the source), as torch
    counts them (``TypeError`` from an iterable without ``__len__``)."""
    if not loader._traits.iterable:
        return len(loader._index_sampler)
    length = len(loader._source)
    if loader._options.sharding.sharded and loader._traits.distributed:  # this rank's share
        ws = loader._resolve_distributed(warn=False)[1]
        length = length // ws if loader.drop_last else -(-length // ws)
    loader._IterableDataset_len_called = length
    if loader.batch_size is not None:
        length = length // loader.batch_size if loader.drop_last else -(-length // loader.batch_size)
    return length


def next_epoch(loader) -> tuple[int, int, dict, Pending | None]:
    """``(epoch, batches to skip, states to restore, the pending record it comes from)`` of
    the epoch about to start."""
    st = loader._state
    pending, st.pending = st.pending, None
    request = getattr(loader.sampler, "epoch_request", None) if loader._traits.own_sampler else None
    if request is not None:
        loader.sampler.epoch_request = None
        if pending is None or (request[0] > pending.request and request[1] != pending.epoch):
            return request[1], 0, {}, None
    asked = dataset_epoch_request(loader)  # later than the loader's calls, which consume it
    if asked is not None and (pending is None or asked != pending.epoch):
        return asked, 0, {}, None
    if pending is not None:
        return pending.epoch, pending.served, pending.rng, pending
    return st.following_epoch(), 0, {}, None


def dataset_epoch_request(loader) -> int | None:
    """The epoch a stream's own ``set_epoch`` set since last asked (``kuat_epoch_request``)."""
    return _protocol.epoch_request(loader._source)


def _shuffles_as_torch(loader) -> bool:
    """The loader's own sampler shuffles one process's indices: torch's ``RandomSampler``
    draws a seed from the default generator for it every epoch (kuat draws it too)."""
    sampler = loader.sampler
    return (loader.generator is None and isinstance(sampler, EpochSampler) and sampler.shuffle
            and sampler.num_replicas == 1)


def epoch_draws(loader) -> tuple[int, int | None, int | None]:
    """What torch's DataLoader draws from torch's generators when an epoch's iterator starts,
    in its order: for an ``IterDataPipe``, the graph's shared seed (from ``generator=``, else
    the default generator; drawn again, unused, when worker processes start); ``base_seed``
    (:func:`draw_base_seed`); then, with ``shuffle=True``, the ``RandomSampler``'s seed.
    Returns ``(base_seed, shuffle seed or None, shared seed or None)``."""
    shared = None
    if loader._job.datapipe:
        shared = _draw(loader.generator)
    fresh = not (loader.persistent_workers and loader._torch_base_seed is not None)
    base_seed = draw_base_seed(loader)
    if shared is not None and loader.num_workers and fresh:
        _draw(loader.generator)  # torch's _reset(first_iter=True) draws it again
    if not _shuffles_as_torch(loader):
        return base_seed, None, shared
    return base_seed, _draw(None), shared


def _draw(generator) -> int:
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def draw_ahead(loader) -> None:
    """``state_dict()`` where the next batch starts an epoch (before the first ``next()``, or
    after an epoch ran out), without ``generator=``: make now, once, the draws that epoch's
    start makes from torch's default generator, and keep them for it, so that the state names
    its order (the shuffle seed; with ``seed=None``, the run seed) and a resume elsewhere
    replays it (torchdata's ``RandomSampler`` keeps a generator for this; kuat keeps torch's
    draws, made earlier). The draws are the ones torch makes, in its order; only their time
    moves, from the epoch's first ``next()`` to this call."""
    st = loader._state
    pending = st.pending
    if loader.generator is not None:
        return  # its state is saved instead, as torchdata saves it
    if pending is not None:
        if pending.loaded is not None or pending.drawn is not None or pending.served:
            return
    elif st.position is not None and not st.position.exhausted:
        return  # an epoch is under way: its draws are made and saved
    apply_distributed(loader)
    base_seed, shuffle_seed, shared_seed = epoch_draws(loader)
    if loader.seed is None:  # seed=None: the run seed is the first epoch's torch base_seed
        loader._set_seed(base_seed)
    rng = dict(pending.rng) if pending is not None else {}
    if shuffle_seed is not None and loader._torch_order:
        rng["sampler_seed"] = shuffle_seed
    if shared_seed is not None:
        rng["shared_seed"] = shared_seed
    if pending is not None:
        epoch, request, workers = pending.epoch, pending.request, pending.workers
    else:  # not a request: a later sampler.set_epoch() still wins (kuat.sampling.next_request)
        epoch, request, workers = st.following_epoch(), -1, following_workers(loader)
    st.pending = Pending(request, epoch, 0, rng, workers=workers,
                         drawn=(base_seed, shuffle_seed, shared_seed))


def following_workers(loader) -> WorkerStates | None:
    """The worker dataset states the epoch after the last one starts from: the ones its
    workers ended with when their copies persist (:func:`kuat.loader._state.persists`)."""
    pos = loader._state.position
    if pos is None or pos.workers is None or not persists(loader):
        return None
    return pos.workers.next_epoch()


def draw_base_seed(loader) -> int:
    """torch's ``base_seed``: one int64 from ``generator`` (torch's default generator
    without one) each time torch creates an iterator, i.e. every epoch, but only for the
    first epoch with ``persistent_workers`` (torch then keeps one iterator and resets
    it). Drawn exactly so, so that swapping torch's DataLoader for kuat's leaves every
    other user of those generators (model initialisation, a ``RandomSampler`` without a
    generator, augmentations in the loop) with the numbers it had."""
    if loader.persistent_workers and loader._torch_base_seed is not None:
        return loader._torch_base_seed
    drawn = torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
    loader._torch_base_seed = int(drawn.item())
    return loader._torch_base_seed


def _set_sampler_epoch(loader, epoch: int) -> None:
    if isinstance(loader.sampler, EpochSampler):
        loader.sampler.epoch = epoch  # (not set_epoch: that is a request from outside)
        return
    # e.g. kuat.text.TokenBudgetBatchSampler (the batch sampler), or kuat.ShardShuffleSampler
    # inside torch's BatchSampler
    hook = epoch_hook(loader._index_sampler, loader.sampler)
    if hook is not None:
        hook(epoch)


def plan_epoch(loader, it) -> EpochPlan:
    """Start the epoch of iterator ``it`` (at its first ``next()``, or when it is made:
    :func:`opens_at_iter`) and describe it."""
    if loader._closed:
        raise RuntimeError("this kuat DataLoader was closed")
    apply_distributed(loader)
    st, traits = loader._state, loader._traits
    previous, skip_first = st.position, st.skip_first
    epoch, skip, restore, pending = next_epoch(loader)
    # elastic resume: the epoch continues after this many positions of its global order
    start = pending.offset if pending is not None else None
    if st.skip_first:  # a skip_first_batches copy: its first epoch skips that many
        skip, st.skip_first, start = st.skip_first, 0, None
    if "generator" in restore:
        loader.generator.set_state(restore["generator"])
    elif loader.generator is not None and epoch != st.following_epoch():
        last = 'no epoch' if st.position is None else f'epoch {st.position.epoch}'
        warnings.warn(
            f"kuat DataLoader: starting epoch {epoch} after {last} with "
            "generator=: the order comes from the generator's current state, not from epoch "
            f"{epoch}'s, so it is not the order an uninterrupted run had. Resume with "
            "load_state_dict() (which restores the generator), or pass seed= instead",
            stacklevel=4,
        )
    _set_sampler_epoch(loader, epoch)
    at_start: dict[str, Any] = dict(restore)
    if loader.generator is not None:
        at_start.setdefault("generator", loader.generator.get_state())
    # base_seed, then the sampler's draws, as torch (or as state_dict() drew them ahead, or
    # as the loaded state names them: the uninterrupted run made them before its state)
    drawn = pending.drawn if pending is not None and pending.drawn is not None else None
    if drawn is None and pending is not None and _state_names_draws(loader, pending):
        drawn = (None, pending.rng.get("sampler_seed"), pending.rng.get("shared_seed"))
    base_seed, shuffle_seed, shared_seed = drawn if drawn is not None else epoch_draws(loader)
    if loader.seed is None:  # seed=None: the run seed is the first epoch's torch base_seed
        loader._set_seed(base_seed)
    if loader.generator is None:
        base_seed = worker_base_seed(loader.seed, epoch)
        if shuffle_seed is not None and loader._torch_order:
            # in torch, shuffle=True is a RandomSampler, which draws its own seed from the
            # default generator every epoch and shuffles with it: kuat makes the same draw
            # and, with seed=None, shuffles as torch does (saved at the epoch's start for
            # resume); with seed= the order stays a function of (seed, epoch)
            at_start.setdefault("sampler_seed", shuffle_seed)
            loader.sampler.torch_seed = (epoch, int(at_start["sampler_seed"]))
    if "sampler" not in at_start and not traits.own_sampler and not traits.iterable:
        at_start["sampler"] = order_state(loader._index_sampler)  # as it starts: after base_seed
    workers, first_worker, restore_workers = _worker_states(loader, previous, pending, skip)
    done = pending.keys_done if pending is not None else None  # (prefix, ahead): map-style
    if restore_workers:  # each worker resumes its own copy (torchdata's rule): no replay
        keys, discard = itertools.repeat(ResumeAt(skip, WorkerResume(tuple(workers.states)))), 0
    elif traits.iterable and start is not None:  # a kuat stream from a global position
        keys, discard = itertools.repeat(None), 0
    elif traits.iterable and skip and traits.resumable:
        saved = st.source_at.state if (st.source_at is not None and (
            st.source_at.epoch, st.source_at.served) == (epoch, skip)) else None
        keys, discard = itertools.repeat(ResumeAt(skip, saved)), 0  # the source starts there
    elif traits.iterable:
        keys, discard = itertools.repeat(None), skip
    elif start is not None:  # elastic: the rest of the epoch (a layout change; out-of-order
        # holes of the saved layout are not carried: its in-flight batches are read again)
        keys, discard = epoch_keys(loader, epoch, 0, restore.get("sampler"), start), 0
        done = None
    else:  # map-style: from the first key not done (out-of-order resume skips the others)
        keys = epoch_keys(loader, epoch, skip if done is None else done[0], restore.get("sampler"))
        keys, discard = (keys if done is None else skip_done(keys, *done)), 0
    if shared_seed is not None:  # an IterDataPipe: every worker seeds its graph with it
        shared_seed = at_start.setdefault("shared_seed", shared_seed)  # (saved, or restored)
        keys = (Seeded(int(shared_seed), key) for key in keys)
    _elastic.start_stream(loader, epoch, start, pending is not None and bool(skip or start))
    feed = loader._feed
    peer = feed is not None and feed.is_peer()  # replicas="broadcast": the leader reads for it
    if peer:
        lease = Lease(loader._workers, loader, InlineEngine(loader._job, base_seed), True, base_seed)
    else:
        lease = loader._workers.lease(loader, base_seed, it)
    position = Position(epoch, skip, False, at_start, workers)
    if start is not None:  # (skip: the batches counted as served before the offset)
        position.offset, position.base = start, skip
    # which keys are done, as batches come back (in order or not; an iterable's: whether)
    position.keys = KeysDone(*(done if done is not None else (skip,)))
    if opens_at_iter(loader) and not peer:
        try:
            keys = _open(lease, epoch, base_seed, keys, position)
        except BaseException:  # not started: a loaded or requested position still waits
            st.pending, st.skip_first = pending, skip_first
            raise
    st.position = position
    reported = loader._IterableDataset_len_called
    if traits.iterable and reported is not None:  # torch's warning when more batches come
        position.on_batch = functools.partial(_notices.iterable_length, loader, reported)
    owner = st.owner() if st.owner is not None else None
    if owner is not None:  # the loader this copy skips for follows on from its position
        owner._state.position, owner._state.pending = position, None
        if owner.seed is None:  # and from the seed the copy's first epoch drew
            owner._set_seed(loader.seed)
    return _plan(loader, epoch, base_seed, keys, discard, position, lease, first_worker)


def opens_at_iter(loader) -> bool:
    """Whether ``iter(loader)`` starts the epoch, where it otherwise starts at the first
    ``next()``: ``num_workers=0`` over a torch ``IterableDataset`` (not a kuat stream), as
    torch's single-process iterator calls ``iter(dataset)`` when it is made (and torchdata's
    restores the saved iterator there), so that a state taken before the first batch holds
    that iterator's state. Workers start nothing (none), and an iterator dropped unused leaves
    the epoch to the next one (``Position.opened``)."""
    return loader.num_workers == 0 and loader._job.worker_state


def _open(lease, epoch: int, base_seed: int, keys, position: Position):
    """Begin the epoch in the inline engine now (:func:`opens_at_iter`); the keys, unchanged.
    The dataset state then is the position's until a batch is served. Raises what ``iter()``
    of the dataset (or its restore) raises, after releasing the engine."""
    first = next(keys)
    try:
        state = lease.engine.open_epoch(epoch, base_seed, first)
    except BaseException:
        lease.release(broken=True)
        raise
    position.opened = True
    if state is not None:
        position.workers.states[0] = state
    return itertools.chain((first,), keys)


def _state_names_draws(loader, pending) -> bool:
    """Whether a loaded state names everything the epoch's draws from torch's default
    generator decide (the run seed, the shuffle seed, an IterDataPipe's seed): the epoch then
    draws nothing, as the uninterrupted run, which drew them before its state was taken, draws
    nothing there (so a training loop that restores torch's RNG state with the checkpoint goes
    on with the uninterrupted run's numbers). With ``generator=`` its restored state is drawn
    from again, as torchdata does."""
    rng = pending.rng
    return (pending.loaded is not None and loader.generator is None and loader.seed is not None
            and (not _shuffles_as_torch(loader) or not loader._torch_order or "sampler_seed" in rng)
            and (not loader._job.datapipe or "shared_seed" in rng))


def _worker_states(loader, previous, pending, skip):
    """``(states, first worker, restore)`` of an epoch: a torch IterableDataset's workers'
    own dataset states it starts from (``None`` for other sources), the worker its first
    batch comes from (the one after the last batch served, when resumed mid-epoch), and
    whether the workers must load them (a ``load_state_dict``; persistent copies that carry
    their state over from the last epoch need not)."""
    if not loader._job.worker_state:
        # map-style, resumed from a loaded state: the round-robin goes on where it was (batch
        # k to worker k % W, as torchdata's resume advances its worker cycle), so data that
        # depends on the worker (get_worker_info(), the worker's generators) is the same
        # (an iterable's workers split it themselves: its batches start at worker 0)
        loaded = pending is not None and pending.loaded is not None and not loader._traits.iterable
        return None, (skip % loader.num_workers if loaded and loader.num_workers else 0), False
    workers = pending.workers if pending is not None else None
    loaded = pending is not None and pending.loaded is not None
    if workers is None and not loaded and previous is not None and previous.exhausted:
        workers = following_workers(loader)  # (a loaded state without any: fresh copies)
    if workers is None:
        return WorkerStates(loader.num_workers), 0, False
    if pending is None or pending.loaded is None:
        return workers, 0, False
    first = (workers.last + 1) % max(1, loader.num_workers) if skip else 0
    return WorkerStates(loader.num_workers, workers.states, workers.last if skip else -1), first, True


def _plan(loader, epoch, base_seed, keys, discard, position, lease, first_worker) -> EpochPlan:
    opts, traits, job = loader._options, loader._traits, loader._job
    nw = loader.num_workers
    pace = None
    if nw:  # torch pulls ahead only with workers (its single-process iterator pulls per batch)
        count = None
        if not traits.iterable and position.served == 0 and not position.offset:
            try:
                count = loader._len()
            except (TypeError, NotImplementedError):
                count = None
        pace = (loader.prefetch_factor * nw, count)
    engine = lease.engine
    inline = isinstance(engine, InlineEngine)
    adaptation = Adaptation(
        num_workers=engine.num_workers,
        inline=inline,
        prefetch_factor=loader.prefetch_factor or 0,
        adaptive=opts.adaptive_prefetch,
        thread_engine=isinstance(engine, ThreadEngine),
        consumer_may_fetch=job.consumer_may_fetch,
        agnostic=job.thread_agnostic,
        split_first=(nw > 1 and not traits.iterable
                     and _protocol.splits_batches(loader._source)),
        auto_processes=opts.auto_worker_type,
        rng_use=job.rng_use, isolates=job.isolate_rng,
        choice=loader._choice,  # (measures while undecided: kuat.loader._auto)
        probe=job.sched_probe,
        iterable=traits.iterable,
        persistent=loader.persistent_workers,
        replay=isinstance(loader._source, Stream),  # one deterministic stream per epoch
    )
    factory = loader._observer_factory
    observer = factory(loader) if factory is not None else None
    return EpochPlan(
        epoch=epoch,
        base_seed=base_seed,
        keys=keys,
        discard=discard,
        pace=pace,
        position=position,
        lease=lease,
        adaptation=adaptation,
        in_order=loader.in_order,
        timeout=loader.timeout,
        stats=loader._stats,
        device=loader._device,
        transform=traits.batch_transform,
        observer=observer,
        batches=_epoch_batches(loader, position) if observer is not None else None,
        events=LoaderEvents(skipped=functools.partial(_notices.skipped, loader),
                            unsplit_iterable=functools.partial(_notices.unsplit_iterable, loader),
                            finished=functools.partial(_notices.advise, loader)),
        iterable=traits.iterable,
        first_worker=first_worker,
        feed=loader._feed,
    )


def _epoch_batches(loader, position) -> int | None:
    """The batches the epoch counts as served at its end (observers: the last batch)."""
    if not position.offset:
        return loader._batches_per_epoch()
    if loader._traits.iterable:
        return None
    if loader._traits.own_sampler:  # resumed from a global offset: what its rest holds
        rest = _elastic.rest_size(loader.sampler, position.offset)
    else:  # a user sampler= resumed with another batch size: its samples not consumed
        try:
            rest = max(0, len(loader.sampler) - position.offset)
        except TypeError:
            return None
    b = loader.batch_size or 1
    return position.base + (rest // b if loader.drop_last else -(-rest // b))


def epoch_keys(loader, epoch: int, skip: int, sampler_state: dict | None,
               start: int | None = None):
    """The epoch's batches of indices (or indices), from batch ``skip`` on; with ``start``
    (elastic resume), of the rest of the epoch's order after ``start`` positions: the loader's
    own sampler shards that rest; a user ``sampler=`` skips ``start`` samples of its order and
    batches the rest (as torchdata's ``StatefulDataLoader`` counts samples)."""
    if loader._traits.own_sampler:
        prefetch = _protocol.prefetcher(loader._source)  # the source's, or a torch wrapper's
        if prefetch is not None:
            # drawn whole: remote shards in this order
            indices = (_elastic.rest_indices(loader.sampler, epoch, start) if start
                       else loader.sampler.indices(epoch))
            with epoch_context(loader._job.seed, epoch):  # a mix reads this epoch's window
                prefetch(indices[skip * (loader.batch_size or 1):])
        else:  # drawn lazily, as torch's RandomSampler draws from a generator
            indices = (_elastic.rest_iter(loader.sampler, epoch, start) if start
                       else loader.sampler.iter_epoch(epoch))
        if loader.batch_size is not None:
            indices = batched(indices, loader.batch_size, loader.drop_last)
        return itertools.islice(indices, skip, None)
    if start is not None:  # a user sampler= resumed with another batch_size
        samples = (restore_order(loader.sampler, sampler_state) if sampler_state is not None
                   else iter(loader.sampler))
        keys = batched(itertools.islice(samples, start, None), loader.batch_size,
                       loader.drop_last)
        return itertools.islice(keys, skip, None)
    if sampler_state is not None:
        keys = restore_order(loader._index_sampler, sampler_state)
    else:
        keys = iter(loader._index_sampler)
    return itertools.islice(keys, skip, None)


def batched(indices, batch_size: int, drop_last: bool):
    """Consecutive lists of ``batch_size`` indices, drawn lazily (as torch's BatchSampler)."""
    it = iter(indices)
    while True:
        batch = list(itertools.islice(it, batch_size))
        if not batch or (drop_last and len(batch) < batch_size):
            return
        yield batch
