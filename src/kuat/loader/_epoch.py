"""Where the epoch order is decided: turn the loader's position into an :class:`EpochPlan`.

When an epoch starts (its iterator's first ``next()``), :func:`plan_epoch`

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

from kuat.engine.base import ResumeAt
from kuat.engine.inline import InlineEngine
from kuat.engine.thread import ThreadEngine
from kuat.loader import _notices
from kuat.loader._adaptive import Adaptation
from kuat.loader._plan import EpochPlan, LoaderEvents
from kuat.loader._state import Position
from kuat.rng import epoch_context, worker_base_seed
from kuat.sampling import EpochSampler, epoch_hook, order_state, restore_order
from kuat.sources import protocol as _protocol

__all__ = ["apply_distributed", "next_epoch", "plan_epoch", "epoch_keys", "batched"]

log = logging.getLogger("kuat.loader")


def apply_distributed(loader) -> tuple[int, int]:
    """Resolve rank and world size and hand them to the sampler / iterable source."""
    rank, world_size = loader._resolve_distributed()
    if isinstance(loader.sampler, EpochSampler):
        loader.sampler.set_distributed(rank, world_size)
    if (rank, world_size) != loader._dist_applied:
        if loader._traits.iterable and loader._traits.distributed:
            loader._source.kuat_set_distributed(rank, world_size)
            loader._workers.job_changed()  # spawned workers get the source with its new share
            loader._workers.drop_persistent()  # persistent workers hold the old share
        if world_size > 1 and loader._options.seed_was_none and loader._traits.own_sampler:
            log.warning("kuat.DataLoader on rank %d of %d drew its seed from torch's default "
                        "generator; pass the same seed= on every rank so that all ranks "
                        "shuffle alike", rank, world_size)
        loader._dist_applied = (rank, world_size)
    return rank, world_size


def next_epoch(loader) -> tuple[int, int, dict]:
    """``(epoch, batches to skip, states to restore)`` of the epoch about to start."""
    st = loader._state
    pending, st.pending = st.pending, None
    request = getattr(loader.sampler, "epoch_request", None) if loader._traits.own_sampler else None
    if request is not None:
        loader.sampler.epoch_request = None
        if pending is None or (request[0] > pending.request and request[1] != pending.epoch):
            return request[1], 0, {}
    if pending is not None:
        return pending.epoch, pending.served, pending.rng
    return st.following_epoch(), 0, {}


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
    """Start the epoch of iterator ``it`` (its first ``next()``) and describe it."""
    if loader._closed:
        raise RuntimeError("this kuat DataLoader was closed")
    apply_distributed(loader)
    st, traits = loader._state, loader._traits
    epoch, skip, restore = next_epoch(loader)
    if st.skip_first:  # a skip_first_batches copy: its first epoch skips that many
        skip, st.skip_first = st.skip_first, 0
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
    base_seed = draw_base_seed(loader)  # then the sampler's draws, as torch
    if loader.seed is None:  # seed=None: the run seed is the first epoch's torch base_seed
        loader._set_seed(base_seed)
    if loader.generator is None:
        base_seed = worker_base_seed(loader.seed, epoch)
        sampler = loader.sampler
        if isinstance(sampler, EpochSampler) and sampler.shuffle and sampler.num_replicas == 1:
            # in torch, shuffle=True is a RandomSampler, which draws its own seed from the
            # default generator every epoch and shuffles with it: kuat makes the same draw
            # and, with seed=None, shuffles as torch does (saved at the epoch's start for
            # resume); with seed= the order stays a function of (seed, epoch)
            drawn = int(torch.empty((), dtype=torch.int64).random_().item())
            if loader._torch_order:
                at_start.setdefault("sampler_seed", drawn)
                sampler.torch_seed = (epoch, int(at_start["sampler_seed"]))
    if "sampler" not in at_start and not traits.own_sampler and not traits.iterable:
        at_start["sampler"] = order_state(loader._index_sampler)  # as it starts: after base_seed
    if traits.iterable and skip and traits.resumable:
        saved = st.source_at.state if (st.source_at is not None and (
            st.source_at.epoch, st.source_at.served) == (epoch, skip)) else None
        keys, discard = itertools.repeat(ResumeAt(skip, saved)), 0  # the source starts there
    elif traits.iterable:
        keys, discard = itertools.repeat(None), skip
    else:
        keys, discard = epoch_keys(loader, epoch, skip, restore.get("sampler")), 0
    lease = loader._workers.lease(loader, base_seed, it)
    position = st.position = Position(epoch, skip, False, at_start)
    owner = st.owner() if st.owner is not None else None
    if owner is not None:  # the loader this copy skips for follows on from its position
        owner._state.position, owner._state.pending = position, None
        if owner.seed is None:  # and from the seed the copy's first epoch drew
            owner._set_seed(loader.seed)
    return _plan(loader, epoch, base_seed, keys, discard, position, lease)


def _plan(loader, epoch, base_seed, keys, discard, position, lease) -> EpochPlan:
    opts, traits, job = loader._options, loader._traits, loader._job
    nw = loader.num_workers
    pace = None
    if nw:  # torch pulls ahead only with workers (its single-process iterator pulls per batch)
        count = None
        if not traits.iterable and position.served == 0:
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
        rng_use=job.rng_use,
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
        batches=loader._batches_per_epoch() if observer is not None else None,
        events=LoaderEvents(skipped=functools.partial(_notices.skipped, loader),
                            unsplit_iterable=functools.partial(_notices.unsplit_iterable, loader),
                            finished=functools.partial(_notices.advise, loader)),
        iterable=traits.iterable,
    )


def epoch_keys(loader, epoch: int, skip: int, sampler_state: dict | None):
    """The epoch's batches of indices (or indices), from batch ``skip`` on."""
    if loader._traits.own_sampler:
        prefetch = _protocol.prefetcher(loader._source)  # the source's, or a torch wrapper's
        if prefetch is not None:
            indices = loader.sampler.indices(epoch)  # drawn whole: remote shards in this order
            with epoch_context(loader._job.seed, epoch):  # a mix reads this epoch's window
                prefetch(indices[skip * (loader.batch_size or 1):])
        else:  # drawn lazily, as torch's RandomSampler draws from a generator
            indices = loader.sampler.iter_epoch(epoch)
        if loader.batch_size is not None:
            indices = batched(indices, loader.batch_size, loader.drop_last)
        return itertools.islice(indices, skip, None)
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
