"""Rank and world size: the one place kuat resolves them.

Every consumer (the loader's sampler and its iterable sources, ``kuat.text``'s token-budget
sampler, streams, mixtures) asks :func:`resolve`, so one process never holds two answers (a
``TokenBudgetBatchSampler`` reading rank 0 of 1 while the loader reads ``RANK=3``).

The rule, in order:

1. an explicit ``rank=``/``world_size=`` pair given to the consumer (checked by
   :func:`check_explicit`);
2. ``torch.distributed`` when it is available and its default process group is initialised
   (``get_rank()``, ``get_world_size()``);
3. the ``RANK``/``WORLD_SIZE`` environment variables, when both are set (torchrun, Lightning's
   and Accelerate's launchers set them before ``init_process_group``), with one warning per
   process when ``WORLD_SIZE > 1`` (the process group is not up yet);
4. otherwise rank 0 of 1.

Resolution is cheap (a few microseconds) and is done again whenever a consumer needs it (each
epoch start), so an object built before ``init_process_group`` reads the group's answer
later. Thread-safe.
"""

from __future__ import annotations

import logging
import os

__all__ = ["check_explicit", "resolve", "from_environment"]

log = logging.getLogger("kuat.distributed")

_warned_env = False  # the RANK/WORLD_SIZE warning, once per process


def check_explicit(rank, world_size) -> tuple[int | None, int | None]:
    """Validate an explicit ``rank``/``world_size`` pair: both ints, or both ``None``.

    Returns:
        ``(rank, world_size)`` as Python ints, or ``(None, None)``.

    Raises:
        ValueError: only one of them given, ``world_size < 1`` or ``rank`` outside
            ``[0, world_size)``.
        TypeError: a value that is not an int (``bool`` included).
    """
    import numpy as np

    if (rank is None) != (world_size is None):
        raise ValueError(f"give both rank and world_size or neither, got {rank=} {world_size=}")
    if rank is None:
        return None, None
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} should be an int or None, got {name}={value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank should be in [0, world_size), got {rank=} {world_size=}")
    return int(rank), int(world_size)


def resolve(rank: int | None = None, world_size: int | None = None, *,
            warn: bool = False) -> tuple[int, int]:
    """``(rank, world_size)`` by the module's rule; an explicit pair wins.

    Args:
        rank, world_size: the consumer's explicit values (already checked), or ``None``.
        warn: log the one-per-process warning when the answer comes from the environment.

    Raises:
        ValueError: ``RANK``/``WORLD_SIZE`` are set but are not ints, or out of range.
    """
    if rank is not None and world_size is not None:
        return rank, world_size
    import torch

    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return from_environment(warn)


def from_environment(warn: bool = False) -> tuple[int, int]:
    """``(rank, world_size)`` from ``RANK``/``WORLD_SIZE``; ``(0, 1)`` when either is unset.

    Raises:
        ValueError: the variables are not ints, or ``RANK`` is outside ``[0, WORLD_SIZE)``.
    """
    global _warned_env
    rank, world_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world_size is None:
        return 0, 1
    try:
        rank, world_size = int(rank), int(world_size)
    except ValueError as e:
        raise ValueError(f"RANK={rank!r} and WORLD_SIZE={world_size!r} should be ints") from e
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"environment RANK={rank} should be in [0, WORLD_SIZE={world_size})")
    if warn and world_size > 1 and not _warned_env:
        _warned_env = True
        log.warning("kuat.DataLoader: torch.distributed is not initialised; reading rank %d of "
                    "%d from the RANK/WORLD_SIZE environment variables", rank, world_size)
    return rank, world_size
