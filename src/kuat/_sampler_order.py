"""What a user's sampler (or batch sampler) order depends on, so a resumed loader replays it.

:func:`order_state` takes it just before ``iter(sampler)`` starts (its ``state_dict``, its
generator, torch's global generator, its epoch), :func:`restore_order` iterates it again from
that state; the hooks kuat's own samplers answer (``kuat_set_epoch``, ``kuat_set_distributed``)
are found here too. Used by the loader's epoch planner and state (``kuat.loader._epoch``,
``kuat.loader._state``). Thread-safety: pure functions; :func:`restore_order` swaps torch's
global generator state for the duration of one draw, so call it from the thread that owns
the epoch (the loader's).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

# torch's samplers that draw from torch's global generator when their ``generator`` is None.
_GLOBAL_RNG_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def _inner(sampler):
    """The index sampler inside a batch sampler (torch's BatchSampler keeps it as ``.sampler``;
    Accelerate's ``BatchSamplerShard`` and ``SkipBatchSampler``, BatchSampler subclasses without
    one, wrap a batch sampler as ``.batch_sampler``: the one inside it)."""
    if isinstance(sampler, BatchSampler) and not hasattr(sampler, "state_dict"):
        if hasattr(sampler, "sampler"):
            return sampler.sampler
        inner = getattr(sampler, "batch_sampler", None)
        return sampler if inner is None or inner is sampler else _inner(inner)
    return sampler


def epoch_hook(*samplers):
    """The first ``kuat_set_epoch(epoch)`` hook of ``samplers`` (the one sampler hook kuat's
    loader calls, before each epoch: ``kuat.TokenBudgetBatchSampler``,
    ``kuat.ShardShuffleSampler``), or ``None``. Give the batch sampler, then the sampler."""
    for s in samplers:
        hook = getattr(s, "kuat_set_epoch", None)
        if callable(hook):
            return hook
    return None


def distributed_hook(batch_sampler):
    """A batch sampler's ``kuat_set_distributed(rank, world_size)`` hook
    (``kuat.TokenBudgetBatchSampler``), which a sharded loader calls at each epoch start, or
    ``None``."""
    hook = getattr(batch_sampler, "kuat_set_distributed", None)
    return hook if callable(hook) else None


def describe_sampler(sampler) -> str:
    """``"BatchSampler(MySampler)"``: a sampler's type, with the one inside a batch sampler."""
    inner = _inner(sampler)
    if inner is sampler:
        return type(sampler).__name__
    return f"{type(sampler).__name__}({type(inner).__name__})"


def sampler_generator(sampler) -> torch.Generator | None:
    """The ``torch.Generator`` a sampler (or the sampler inside a batch sampler) draws from."""
    gen = getattr(_inner(sampler), "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


def order_state(sampler) -> dict[str, Any] | None:
    """What the next ``iter(sampler)`` depends on, taken just before it starts; ``None`` if unknown.

    ``sampler`` is a user sampler or batch sampler. Kinds, in order of preference:

    * ``{"state_dict": ...}``: the sampler's own ``state_dict()`` (torchdata's stateful samplers);
    * ``{"generator": ByteTensor}``: the state of its ``generator`` attribute;
    * ``{"global_rng": ByteTensor}``: torch's default CPU generator, which torch's RandomSampler,
      SubsetRandomSampler and WeightedRandomSampler draw their seed from without a generator;
    * ``{"epoch": int}``: a ``DistributedSampler``'s epoch (its order is ``(seed, epoch)``);
    * ``{}``: a ``SequentialSampler`` (or a batch sampler over one), or a sampler whose order the
      loader sets through ``kuat_set_epoch(epoch)`` (``kuat.TokenBudgetBatchSampler``): nothing
      to save.

    The generator states are copies (``torch.Generator.get_state``), a few KiB.
    """
    s = _inner(sampler)
    if callable(getattr(s, "state_dict", None)) and callable(getattr(s, "load_state_dict", None)):
        return {"state_dict": s.state_dict()}
    if epoch_hook(sampler, s) is not None:
        return {}  # its order is (seed, epoch), and the loader sets the epoch
    gen = getattr(s, "generator", None)
    if isinstance(gen, torch.Generator):
        return {"generator": gen.get_state()}
    if isinstance(s, _GLOBAL_RNG_SAMPLERS):
        return {"global_rng": torch.get_rng_state()}
    if isinstance(s, DistributedSampler):
        return {"epoch": int(s.epoch)}
    if isinstance(s, SequentialSampler) or type(s) in (range, list, tuple):
        return {}
    return None


def restore_order(sampler, state: dict[str, Any]) -> Iterator:
    """``iter(sampler)`` giving the order recorded by :func:`order_state` (same sampler type).

    With ``"global_rng"`` the first element is drawn under the saved global generator state and
    the caller's state is restored afterwards (so the training loop's own randomness is not
    touched). Raises ``ValueError`` when ``state`` does not fit ``sampler``.
    """
    s = _inner(sampler)
    if "state_dict" in state:
        s.load_state_dict(state["state_dict"])
    elif "generator" in state:
        gen = getattr(s, "generator", None)
        if not isinstance(gen, torch.Generator):
            raise ValueError(
                f"the saved loader state holds the generator state of a sampler, but "
                f"{type(s).__name__} has no generator"
            )
        gen.set_state(state["generator"])
    elif "epoch" in state:
        s.set_epoch(state["epoch"])
    elif "global_rng" in state:
        caller = torch.get_rng_state()
        torch.set_rng_state(state["global_rng"])
        try:
            it = iter(sampler)
            first = list(itertools.islice(it, 1))  # the sampler draws its seed at its first element
        finally:
            torch.set_rng_state(caller)
        return itertools.chain(first, it)
    return iter(sampler)
