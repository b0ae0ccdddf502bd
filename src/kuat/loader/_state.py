"""Where a loader is: its position in the epoch order, a pending resume, and the state dict.

A loader's position is three small records (docs/loader.md, "Resume"):

* :class:`Position`: the epoch being served (or last served), how many batches of it were
  served, whether it ran out, and the states its order started from. The running iterator
  advances it; ``state_dict()`` reads it; a ``skip_first_batches`` copy shares it with the
  loader it skips for.
* :class:`Pending`: what the next epoch started must begin from (``set_epoch`` or
  ``load_state_dict``), until an epoch starts.
* :class:`SourceAt`: the source's own state loaded with a position (iterable sources resume
  from it when the same position starts).

:func:`state_dict` and :func:`load_state_dict` are the bodies of the loader's methods of those
names; they read the loader's face and its :class:`LoaderState`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from kuat.sampling import describe_sampler, order_state, sampler_generator
from kuat.sources import protocol as _protocol

__all__ = ["Position", "Pending", "SourceAt", "LoaderState", "STATE_VERSION", "state_dict",
           "load_state_dict"]

STATE_VERSION = 1


@dataclass
class Position:
    """The epoch being served and how far (mutated by the epoch's iterator only)."""

    epoch: int
    served: int  # batches of the epoch served (skipped ones on resume included)
    exhausted: bool = False  # the epoch's iterator ran out
    at_start: dict[str, Any] = field(default_factory=dict)  # states the order started from


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
        """The epoch after the last one started (0 before any)."""
        return 0 if self.position is None else self.position.epoch + 1


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


def state_dict(loader) -> dict[str, Any]:
    """:meth:`kuat.DataLoader.state_dict`'s body (see there)."""
    st: LoaderState = loader._state
    if st.pending is not None:
        epoch, served, rng = st.pending.epoch, st.pending.served, st.pending.rng
    elif st.position is None:
        epoch, served, rng = 0, 0, None
    else:
        pos = st.position
        epoch, served, rng = pos.epoch, pos.served, pos.at_start
        n = loader._batches_per_epoch() if not pos.exhausted else None
        if pos.exhausted or (n is not None and served >= n):
            epoch, served, rng = epoch + 1, 0, None
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
    }
    source, traits = loader._source, loader._traits
    if traits.iterable and traits.plan_state:
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
    if state.get("world_size") != world_size:
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
    if state.get("sampler_seed") is not None:  # the epoch's torch-style shuffle seed
        rng["sampler_seed"] = state["sampler_seed"]
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
    st: LoaderState = loader._state
    # the source's own point in its plan there, handed to kuat_iter_from (iterable sources)
    st.source_at = SourceAt(int(state["epoch"]), served, state.get("source"))
    st.pending = Pending(next_request(), int(state["epoch"]), served, rng)
    if "source" in state and _protocol.provides(loader._source, _protocol.Stateful):
        loader._source.load_state_dict(state["source"])
