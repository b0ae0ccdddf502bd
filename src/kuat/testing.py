"""Contract checks every loader and source must pass (used by kuat's own tests; public so that
users can check their datasets and transforms too).

:func:`check_resume` is the save/resume contract of ``torchdata.nodes``' test utilities
(``run_test_save_load_state``), for a loader with ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import numbers
import pickle
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

__all__ = ["check_resume", "assert_same_batch"]


def check_resume(
    make_loader: Callable[[], object],
    midpoints: Iterable[int],
    *,
    epochs: int = 1,
    make_resumed: Callable[[], object] | None = None,
) -> list:
    """Check that resuming from ``state_dict()`` continues exactly like an uninterrupted run.

    1. Runs ``epochs`` epochs of ``make_loader()`` without interruption (each ``iter()`` is one
       epoch) and keeps every batch: the reference.
    2. For each midpoint ``k`` (a count of batches from the start of the run; ``0`` is before
       the first batch, an epoch's length is its end, and ``k`` may fall in a later epoch):
       runs a fresh ``make_loader()`` for ``k`` batches, takes ``state_dict()``, round-trips it
       through ``pickle``, builds a new loader with ``make_resumed()`` (default
       ``make_loader()``; give another to resume with, say, other ``num_workers``), calls
       ``load_state_dict(state)``, checks that its ``state_dict()`` then equals ``state``, and
       runs it to the end of the run: its batches must be exactly the reference's from ``k``
       on (same samples, order, dtypes and random augmentation values).

    Args:
        make_loader: builds a new loader, identically configured, on every call.
        midpoints: the ``k`` to test; each must be in ``[0, total batches]``.
        epochs: epochs in the run.
        make_resumed: builds the loader that resumes (default ``make_loader``).

    Returns:
        The reference batches (a list), for further checks.

    Raises:
        AssertionError: a resumed run differs; the message names the midpoint, the batch and
            where in the batch's structure.
        ValueError: ``epochs < 1`` or a midpoint outside ``[0, total batches]``.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral) or epochs < 1:
        raise ValueError(f"epochs should be an int >= 1, got {epochs=!r}")
    make_resumed = make_resumed or make_loader
    loader = make_loader()
    try:
        reference = [batch for _ in range(epochs) for batch in loader]
    finally:
        _close(loader)
    total = len(reference)
    for k in midpoints:
        if not 0 <= k <= total:
            raise ValueError(f"midpoint {k} is outside [0, {total}] (batches in {epochs} epochs)")
        state = _state_after(make_loader, k, epochs)
        resumed = make_resumed()
        try:
            resumed.load_state_dict(state)
            again = resumed.state_dict()
            assert _plain(again) == _plain(state), (
                f"midpoint {k}: state_dict() right after load_state_dict() differs from the "
                f"loaded state:\n  loaded {state}\n  now    {again}"
            )
            rest = _run_until(resumed, total - k, epochs)
        finally:
            _close(resumed)
        assert len(rest) == total - k, (
            f"midpoint {k}: the resumed loader gave {len(rest)} batches, expected {total - k}"
        )
        for j, (got, want) in enumerate(zip(rest, reference[k:], strict=True)):
            assert_same_batch(got, want, f"midpoint {k}, batch {k + j}")
    return reference


def _state_after(make_loader, k: int, epochs: int) -> dict:
    """``state_dict()`` of a fresh loader after ``k`` batches, round-tripped through pickle."""
    loader = make_loader()
    try:
        taken = 0
        for _ in range(epochs + 1):
            if taken == k:
                break
            for _batch in loader:  # one epoch; left unfinished when the midpoint is reached
                taken += 1
                if taken == k:
                    break
        state = loader.state_dict()
    finally:
        _close(loader)
    return pickle.loads(pickle.dumps(state))


def _run_until(loader, wanted: int, epochs: int) -> list:
    out: list = []
    for _ in range(epochs + 1):  # the resumed epoch may be empty (resumed at its end)
        if len(out) >= wanted:
            break
        out.extend(loader)
    return out


def _close(loader) -> None:
    close = getattr(loader, "close", None)
    if callable(close):
        close()


def _plain(state):
    return pickle.loads(pickle.dumps(state))


def assert_same_batch(got, want, where: str = "batch") -> None:
    """Assert ``got`` equals ``want`` exactly: same container types and keys, tensor/array
    dtypes, shapes and values (NaNs equal), numbers and strings.

    Raises:
        AssertionError: naming ``where`` and the path inside the structure.
    """
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__} is not a tensor"
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want) or (
            got.is_floating_point() and torch.allclose(got, want, rtol=0, atol=0, equal_nan=True)
        ), f"{where}: values differ\n  got  {got}\n  want {want}"
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: {type(got).__name__} is not an ndarray"
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
        )
        assert np.array_equal(got, want, equal_nan=got.dtype.kind in "fc"), (
            f"{where}: values differ"
        )
    elif isinstance(want, Mapping):
        assert isinstance(got, Mapping), f"{where}: {type(got).__name__} is not a mapping"
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same_batch(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_batch(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"
