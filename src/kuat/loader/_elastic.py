"""Elastic resume: a state's global position and layout, and what another layout can continue.

A loader state (:mod:`kuat.loader._state`) says where an epoch stands in two ways: per rank
(``batches_served_in_epoch``, exact on the layout it was saved with) and globally:

* ``samples_consumed``: how many positions of the epoch's global order were consumed. For the
  loader's own sampler, ``k`` batches of ``B`` per rank over ``W`` ranks in
  ``DistributedSampler``'s strided layout consume exactly the first ``k * B * W`` positions
  of the epoch's (padded) order, on every rank alike; for a user ``sampler=`` with
  ``batch_size``, ``k * B`` of its order (torchdata's ``samples_yielded``); for a kuat stream
  that can start from a position (:func:`stream_starts`: iterable mixes, shuffle buffers, HF
  streams split by position, packed rows), ``k * B * W`` of the epoch's stream. ``None``
  where no such count exists (a user ``batch_sampler``, other iterable sources).
* ``layout``: the fingerprint of who read what: ``world_size`` (the loader's data-parallel
  share count), ``batch_size`` (per rank), ``num_workers``; plus ``sampler_replicas`` (a user
  ``DistributedSampler``'s ``num_replicas``) and, for iterable sources, ``processes`` (the
  process group's size, by which an iterable dataset may split itself).

:func:`resume_offset` decides, when a state is loaded, whether the epoch continues from a
global offset (the loader's own sampler and kuat streams: whatever the layout; a user
``sampler=`` whose batch size changed: counting samples, as torchdata's
``StatefulDataLoader``), from the served batches as before (nothing that matters changed), or
cannot continue exactly, which raises ``ValueError`` naming what changed; :func:`rest_indices`
is the loader's own sampler's share of the rest, :func:`start_stream` tells a stream where its
epoch starts. docs/distributed.md, "Elastic resume"."""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

from kuat import distributed
from kuat.sampling import EpochSampler, exact_count, exact_share
from kuat.sources import protocol

__all__ = ["layout", "samples_consumed", "resume_offset", "same_stride", "stride", "stream_starts",
           "start_stream", "rest_size", "rest_of", "rest_indices", "rest_iter"]


# --- the loader's own sampler: the rest of an epoch after a global offset -------------------
def rest_size(sampler: EpochSampler, start: int) -> int:
    """This rank's number of indices of :func:`rest_of` (``len(sampler)`` at ``start`` 0)."""
    left, world = max(0, sampler.n - start), sampler.num_replicas
    if world == 1:
        return left
    if sampler.exact:
        return exact_count(left, world, sampler.exact_batch_size)
    return left // world if sampler.drop_last else -(-left // world)


def rest_of(sampler: EpochSampler, order: list[int], start: int) -> list[int]:
    """This rank's share of ``order[start:]``, an epoch's global order after ``start``
    positions consumed under any layout, laid out as ``DistributedSampler`` lays out a whole
    epoch: padded by wrapping around to ``order``'s start (samples consumed earlier), or with
    ``drop_last`` truncated, to a multiple of ``world_size``; rank ``r`` takes every
    ``world_size``-th from ``r`` (exact evaluation: its block layout, padding flagged). With
    ``start`` a multiple of ``world_size`` (the saved layout) this is the rest of the
    uninterrupted share, padding included; on another layout every remaining position is
    served once over all ranks."""
    world = sampler.num_replicas
    if world == 1:
        return order[start:]
    if sampler.exact:
        return exact_share(order, sampler.rank, world, sampler.exact_batch_size, start)
    rest, total = order[start:], rest_size(sampler, start) * world
    if total > len(rest):
        rest += (order * -(-(total - len(rest)) // len(order)))[: total - len(rest)]
    return rest[sampler.rank : total : world]


def rest_indices(sampler: EpochSampler, epoch: int, start: int) -> list[int]:
    """:meth:`EpochSampler.indices` of the rest of ``epoch`` after ``start`` positions."""
    if sampler.num_replicas == 1:
        return sampler.indices(epoch)[start:]
    whole = copy.copy(sampler)  # the epoch's global order: the sampler's, unsharded
    whole.set_distributed(0, 1)
    return rest_of(sampler, whole.indices(epoch), start)


def rest_iter(sampler: EpochSampler, epoch: int, start: int) -> Iterator[int]:
    """:meth:`EpochSampler.iter_epoch` of the rest (lazy draws from ``generator`` kept)."""
    if sampler.num_replicas == 1:
        return itertools.islice(sampler.iter_epoch(epoch), start, None)
    return iter(rest_indices(sampler, epoch, start))


def _int_or_none(value) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _user_replicas(loader) -> int | None:
    """``num_replicas`` of a user ``DistributedSampler`` (given as ``sampler=``, or inside a
    ``batch_sampler=``), else ``None``."""
    for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        replicas = _int_or_none(getattr(s, "num_replicas", None))
        if replicas is not None:
            return replicas
    return None


def layout(loader, world_size: int) -> dict[str, Any]:
    """``state_dict()["layout"]``: the fingerprint of the layout a state is saved with (see
    the module docstring); ``world_size`` is the loader's resolved share count."""
    traits = loader._traits
    batch_size = loader.batch_size
    if batch_size is None:  # a user batch_sampler: its own batch_size, when it says
        batch_size = _int_or_none(getattr(loader.batch_sampler, "batch_size", None))
    out: dict[str, Any] = {"world_size": int(world_size), "batch_size": batch_size,
                           "num_workers": int(loader.num_workers)}
    if not traits.own_sampler and not traits.iterable:
        replicas = _user_replicas(loader)
        if replicas is not None:
            out["sampler_replicas"] = replicas
    if traits.iterable:
        out["processes"] = distributed.resolve(warn=False)[1]
    return out


def stride(loader, world_size: int) -> int:
    """Positions of the epoch's global order one batch on every rank consumes: ``B * W`` for
    the loader's own sampler and kuat streams, ``B`` for a user ``sampler=`` (not sharded by
    kuat)."""
    b = loader.batch_size or 1
    return b * world_size if loader._traits.own_sampler or loader._traits.iterable else b


def stream_starts(source, traits) -> bool:
    """Whether an iterable source can start an epoch from a global position (a kuat stream
    that honours ``start_at``: iterated by :meth:`kuat.sources.stream.Stream.__iter__`
    (iterable mixes, shuffle buffers, HF streaming split by position and not already split by
    node), or packed rows. Tokenized streams and HF streams split by shards iterate otherwise."""
    from kuat.sources.hf import HFIterableSource
    from kuat.sources.stream import Stream

    if not isinstance(source, Stream):
        return False
    if traits.resumable:  # kuat.text.Packed (kuat_iter_from): its plan's rows
        return True
    if isinstance(source, HFIterableSource):
        return source.split == "position" and getattr(source.dataset, "_distributed", None) is None
    return type(source).__iter__ is Stream.__iter__


def _workers_keep_batches(source, traits) -> bool:
    """Whether an iterable source's batches are the same whatever the worker count (kuat
    streams: workers take whole batches; not an HF stream split by shards)."""
    from kuat.sources.hf import HFIterableSource

    if isinstance(source, HFIterableSource):
        return source.split == "position"
    return traits.batching  # kuat_set_batching: workers take whole batches


def samples_consumed(loader, served: int, offset: int = 0, base: int = 0) -> int | None:
    """``state_dict()["samples_consumed"]``: positions of the epoch's global order consumed
    after ``served`` batches, ``base`` of them counted before ``offset`` positions (a resume
    from a global offset); ``None`` where no such count exists (module docstring)."""
    traits = loader._traits
    if traits.iterable:
        if not stream_starts(loader._source, traits):
            return None
        world = loader._resolve_distributed(warn=False)[1]
        return offset + (served - base) * (loader.batch_size or 1) * world
    if traits.own_sampler:
        sampler = loader.sampler
        world = sampler.num_replicas
        consumed = offset + (served - base) * (loader.batch_size or 1) * world
        # the last batch may be short: at most the positions the epoch's rest has
        return min(consumed, offset + rest_size(sampler, offset) * world)
    if loader.batch_size is None:  # a user batch_sampler: batches of sizes kuat cannot know
        return None
    return offset + (served - base) * loader.batch_size


def same_stride(loader, state: dict, world_size: int) -> bool:
    """Whether the state was saved with this loader's batch size and world size (a resume
    from its global offset then counts the batches served as the saved state does)."""
    saved = state.get("layout") or {}
    now = layout(loader, world_size)
    return all(saved.get(k) == now[k] for k in ("world_size", "batch_size"))


def _changes(saved: dict, now: dict, keys) -> str:
    return ", ".join(f"{k}={saved.get(k)!r} -> {now.get(k)!r}" for k in keys)


def _cannot(state: dict, saved: dict, now: dict, keys, why: str, way: str) -> ValueError:
    return ValueError(
        f"kuat DataLoader: cannot continue epoch {state.get('epoch')} exactly: the state was "
        f"saved after {state.get('batches_served_in_epoch')} batches of it and the layout "
        f"changed ({_changes(saved, now, keys)}): {why}. {way}, or resume from a state taken "
        "at an epoch boundary (the next epoch is then the normal epoch of the new layout)")


def resume_offset(loader, state: dict, served: int, world_size: int) -> int | None:
    """Where the loaded epoch continues: a global offset (positions of the epoch's order
    consumed), or ``None`` to skip the ``served`` batches as saved (nothing that matters
    changed, an epoch boundary, or a state without ``layout``).

    Raises:
        ValueError: the saved layout differs from this loader's in a way the epoch cannot
            continue exactly from: a torch ``IterableDataset`` with another ``num_workers``
            (each worker copy reads its own part of the stream; torchdata's
            ``StatefulDataLoader`` refuses too), another batch size or world size (or process
            group size) for any iterable source, another batch size for a user
            ``batch_sampler``, another ``num_replicas`` for a user ``DistributedSampler``.
    """
    saved = state.get("layout")
    if not isinstance(saved, dict):
        return None
    traits, source = loader._traits, loader._source
    consumed = state.get("samples_consumed")
    consumed = None if consumed is None else int(consumed)
    # the loader's own sampler and kuat streams read by position: always from the global
    # position, whatever the layout (on the saved one this is the uninterrupted run's rest)
    now = layout(loader, world_size)
    if traits.own_sampler:
        done = state.get("keys_done")  # batches served out of order (in_order=False)
        if done is None:
            return consumed
        if all(saved.get(k) == now.get(k) for k in set(saved) | set(now)):
            return None  # on the saved layout the keys done say exactly which (_epoch.py)
        warnings.warn(
            "kuat DataLoader: resuming on another layout a state whose batches were served "
            f"out of order (in_order=False): the epoch continues after its first "
            f"{int(done['prefix'])} batches, so the {len(done['ahead'])} served after them "
            "are served again", stacklevel=4)
        return int(done["prefix"]) * int(saved.get("batch_size") or 1) * int(saved.get("world_size") or 1)
    if traits.iterable and consumed and stream_starts(source, traits):
        same = all(saved.get(k) == now[k] for k in ("world_size", "batch_size"))
        if (traits.resumable and same
                and consumed == served * (loader.batch_size or 1) * world_size):
            return None  # packed rows on their layout: from the saved plan checkpoint
        return consumed
    changed = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if not traits.iterable:
        # a position off the batch grid: the state was saved after a resume with another
        # batch size, so the saved batches do not say where the epoch stands
        off_grid = (consumed is not None and loader.batch_size is not None
                    and consumed != served * saved.get("batch_size", loader.batch_size))
        if not served and not consumed or not changed and not off_grid:
            return None
        if "sampler_replicas" in changed:
            raise _cannot(state, saved, now, ["sampler_replicas"],
                          "the user DistributedSampler's shares are its own, and which samples "
                          "its other ranks served under the old num_replicas is not in the "
                          "state", "Resume with the saved num_replicas")
        if "batch_size" in changed or off_grid:
            if loader.batch_size is None or consumed is None:
                raise _cannot(state, saved, now, ["batch_size"],
                              "a user batch_sampler makes its own batches, so kuat cannot tell "
                              "which samples the served batches held in the new batching",
                              "Resume with a batch sampler of the saved batch size")
            return consumed  # the sampler's order from its consumed samples (torchdata)
        return None  # workers and the loader's share do not change a user sampler's batches
    if served == 0 or not changed:
        return None
    # iterable sources: replayed (or resumed) per rank from the served batches
    # kuat streams: workers take whole batches; per-worker dataset states: refused (naming
    # num_workers) by _state.load_state_dict, each worker resuming its own copy
    keep = _workers_keep_batches(source, traits) or state.get("workers") is not None
    allowed = {"num_workers"} if keep else set()
    wrong = [k for k in changed if k not in allowed]
    if not wrong:
        return None
    if wrong == ["num_workers"]:
        why = ("a torch IterableDataset is read by one copy per worker, each taking its own "
               "part of the stream (get_worker_info()), so replaying the served batches with "
               "another worker count serves some samples twice and skips others (torchdata's "
               "StatefulDataLoader refuses this too)")
        way = f"Resume with num_workers={saved.get('num_workers')}"
    else:
        why = ("an iterable source is split by rank and batched as it streams, so which of "
               "its samples the served batches held under the old layout is not in the state")
        way = ("Resume with the saved layout (to replay the served batches anyway, exact only "
               "if the stream does not depend on what changed, delete state['layout'])")
    raise _cannot(state, saved, now, wrong, why, way)


def start_stream(loader, epoch: int, start: int | None, resumed: bool = False) -> None:
    """Tell a kuat stream where the epoch starting now begins (``None``: at its start), and
    a source with ``kuat_resumed`` whether the loader resumes it from its own state
    (``resumed``: its ``load_state_dict`` skips the batches served; a stream's own resumed
    state then is not applied too, as torchdata applies the position once)."""
    if loader._traits.iterable and stream_starts(loader._source, loader._traits):
        loader._source.start_at(epoch, start or 0)
    protocol.resumed(loader._source, epoch, resumed)
