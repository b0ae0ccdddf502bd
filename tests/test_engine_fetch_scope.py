"""``kuat.engine.fetch_scope.FetchScope`` (one object per worker, re-entered per batch) sets and
restores what the four context managers it replaces set and restore: the batch's own buffers
and pool, the loader's ``(seed, epoch)``, the fetch's width and ``torch.initial_seed()``'s
answer, inside, after ``end_fetch`` and after the body (also when it raises)."""

import pytest
import torch

from kuat import _buffers, _parallel
from kuat import rng as krng
from kuat.engine import seed_view
from kuat.engine.fetch_scope import FetchScope


def _settings() -> tuple:
    """This thread's four settings, as the code that reads them sees them."""
    own = _buffers.thread_state()
    return (own.buffers, own.pool, _parallel.width(),
            krng.current_epoch(), torch.initial_seed())


def _four(pool, seed, epoch, width, shown):
    """What FetchJob.run opened before FetchScope (the reference)."""
    import contextlib

    stack = contextlib.ExitStack()
    if shown is not None:
        stack.enter_context(seed_view.showing(shown))
    stack.enter_context(_buffers.batch_scope(pool))
    stack.enter_context(krng.epoch_context(seed, epoch))
    stack.enter_context(_parallel.share(width))
    return stack


@pytest.mark.parametrize("shown", [None, 1234])
def test_the_scope_sets_and_restores_what_the_four_contexts_do(shown):
    pool = _buffers.BufferPool()
    scope = FetchScope(pool, 77)
    with krng.epoch_context(5, 6), _parallel.share(3):  # an outer setting to come back to
        before = _settings()
        for epoch, width in [(0, 1), (4, 2)]:  # re-entered per batch
            with _four(pool, 77, epoch, width, shown):
                want = _settings()
            assert want[2:4] == (width, (77, epoch)) and (shown is None or want[4] == shown)
            scope.epoch, scope.width, scope.shown = epoch, width, shown
            with scope:
                got = _settings()
                assert got[1:] == want[1:] and got[0] == [] and want[0] == []
                scope.end_fetch()  # the epoch and width as before, the rest still set
                assert _settings()[1:] == (pool, 3, (5, 6), want[4])
            assert _settings() == before
        with pytest.raises(KeyError), scope:
            raise KeyError("a failed fetch")
        assert _settings() == before
