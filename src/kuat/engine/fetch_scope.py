"""One worker's per-batch thread settings, set and restored as one context (``FetchJob.run``).

Around each batch's fetch a worker sets four thread-local settings: the batch's own buffers
(:class:`kuat._buffers.batch_scope`, with the loader's pool), the loader's ``(seed, epoch)``
for ``kuat.sample_rng`` (:class:`kuat.rng.epoch_context`), the threads the fetch may use
(:class:`kuat._parallel.share`) and, in a thread worker, what ``torch.initial_seed()``
answers (:class:`kuat.engine.seed_view.showing`). Opened as four context managers they cost
four objects and a dozen Python calls per batch, each touched cold after a batch decode has
evicted the caches; :class:`FetchScope` is one object per worker, re-entered per batch, that
sets and restores the same values (tests compare them inside and after the body).
"""

from __future__ import annotations

from kuat import _buffers, _parallel
from kuat import rng as krng
from kuat.engine import seed_view

__all__ = ["FetchScope"]

# the modules' per-thread states (threading.local objects: their attributes are per thread)
_OWNED, _PAR, _RNG, _VIEW = (_buffers.thread_state(), _parallel.thread_state(),
                             krng.thread_state(), seed_view.current())


class FetchScope:
    """The four per-batch settings of one worker (see the module), as one context.

    Set ``epoch`` (the batch's), ``width`` (threads its fetch may use, >= 1) and ``shown``
    (``torch.initial_seed()``'s answer in this thread, or ``None`` to leave it) before each
    ``with scope:``; ``pool`` (a :class:`kuat._buffers.BufferPool` or ``None``) and ``seed``
    are the loader's. Entering sets them for the calling thread, :meth:`end_fetch` restores
    the epoch and width (the fetch is done), exiting restores all that was set before
    (nestable inside other scopes, not inside itself: one batch at a time).

    Thread-safety: one per worker, used by that worker's thread only.
    """

    __slots__ = ("pool", "seed", "epoch", "width", "shown", "_old", "_installed")

    def __init__(self, pool, seed: int):
        self.pool, self.seed = pool, seed
        self.epoch, self.width, self.shown = 0, 1, None
        self._installed = False  # seed_view.install() called (once: it is idempotent)

    def __enter__(self) -> FetchScope:
        own, par, cur = _OWNED, _PAR, _RNG.current
        shown = self.shown
        if shown is not None:
            if not self._installed:
                seed_view.install()
                self._installed = True
            view = _VIEW
            self._old = (own.buffers, own.pool, par.width, cur.seed, cur.epoch, view.shown,
                         view.hidden)
            view.shown, view.hidden = shown, None
        else:
            self._old = (own.buffers, own.pool, par.width, cur.seed, cur.epoch)
        own.buffers, own.pool = [], self.pool
        par.width = self.width
        cur.seed, cur.epoch = self.seed, self.epoch
        return self

    def end_fetch(self) -> None:
        """Restore the ``(seed, epoch)`` and the width now, the buffers' scope and the seed's
        view staying set (what a worker's collate and state run in); ``__exit__`` restores
        all, whether or not this ran."""
        old = self._old
        cur = _RNG.current
        _PAR.width, cur.seed, cur.epoch = old[2:5]

    def __exit__(self, *exc) -> None:
        old = self._old
        own, cur = _OWNED, _RNG.current
        own.buffers, own.pool, _PAR.width, cur.seed, cur.epoch = old[:5]
        if len(old) > 5:
            _VIEW.shown, _VIEW.hidden = old[5], old[6]
