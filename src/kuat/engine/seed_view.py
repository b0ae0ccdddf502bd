"""``torch.initial_seed()`` in a kuat worker answers the worker's seed, as in torch's workers.

In each of torch's worker processes ``torch.initial_seed()`` is ``base_seed + worker_id``
(torch seeds the process's default generator with it), unless the worker reseeded the
generator itself. A dataset may read it to seed a generator of its own (torch's FAQ recipe
reads it in ``worker_init_fn``; some datasets read it lazily in ``__getitem__`` or
``__iter__``). In kuat two things would change what it reads:

- a thread worker shares the training process's default generator: it would read the training
  loop's seed (``torch.manual_seed(1234)`` -> 1234), not its own;
- global-RNG isolation (:mod:`kuat.engine.isolate`) reseeds the generator per sample (or per
  batch, or probes a worker's first batch that way): the sample would read kuat's per-sample
  seed, and a worker process's later batches the last probed sample's.

So the reading depended on which batches were probed (timing, in thread workers) and on the
worker type. This module makes it torch's answer: ``torch.initial_seed`` (the function
``torch.random.initial_seed``, which ``torch.initial_seed`` is) gets its code replaced (once,
idempotently; kuat's second patch of torch after ``get_worker_info``, :mod:`worker_info`) by a
version that reads a ``threading.local`` *view* ``(shown, hidden)``: with ``shown`` set it
answers ``shown`` while the default generator's initial seed is ``hidden`` (the seed kuat's
isolation put there), or whatever it is when ``hidden`` is None (a thread worker outside an
isolated sample: the generator is the training loop's); any other seed (the sample called
``torch.manual_seed`` itself, under isolation) is answered as is. Outside kuat's workers the
view is empty and the function answers as torch's. Worker processes need the view only under
isolation (their generator is their own, and isolation restores it after each batch).
``torch.default_generator.initial_seed()`` called directly is not covered (a C method).

Thread-safety: the view is per thread; :func:`showing` and :func:`hide` set it for the calling
thread only.
"""

from __future__ import annotations

import os
import threading

__all__ = ["showing", "hide", "current", "install"]

_MASK63 = (1 << 63) - 1


class _View(threading.local):
    shown = None  # what torch.initial_seed() answers in this thread ...
    hidden = None  # ... while the default generator's initial seed is this one


_view = _View()
_install_lock = threading.Lock()


def _reset_lock_in_child() -> None:
    # a fork while another thread held the lock would leave it held for ever in the child
    global _install_lock
    _install_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_in_child)


def _viewed_initial_seed() -> int:  # code object swapped into torch.random.initial_seed
    seed = default_generator.initial_seed()  # noqa: F821 (a global of torch.random)
    view = _kuat_seed_view  # noqa: F821 (set there by install)
    shown, hidden = view.shown, view.hidden
    return seed if shown is None or (hidden is not None and seed != hidden) else shown


_installed = False


def install() -> None:
    """Replace ``torch.random.initial_seed``'s code (once; a torch whose function is not the
    plain one is left alone: then the view is not read)."""
    global _installed
    if _installed:
        return
    import torch.random as trandom

    with _install_lock:
        if getattr(trandom, "_kuat_seed_view", None) is None and \
                not trandom.initial_seed.__code__.co_freevars:
            trandom._kuat_seed_view = _view
            trandom.initial_seed.__code__ = _viewed_initial_seed.__code__
        _installed = True


def current() -> _View:
    """This thread's view (attributes ``shown``, ``hidden``: ints or None)."""
    return _view


class showing:  # noqa: N801 (a context manager used like a function; runs once per batch)
    """For the body, ``torch.initial_seed()`` in this thread answers ``shown`` (a thread
    worker's ``base_seed + worker_id``), unless an isolated sample reseeds the generator
    itself (:func:`hide`). Restores the previous view on exit."""

    __slots__ = ("_shown", "_old")

    def __init__(self, shown: int):
        self._shown = shown

    def __enter__(self) -> None:
        if not _installed:
            install()
        v = _view
        self._old = (v.shown, v.hidden)
        v.shown, v.hidden = self._shown, None

    def __exit__(self, *exc) -> None:
        _view.shown, _view.hidden = self._old


def hide(seed: int) -> None:
    """kuat has just seeded the default generator with ``seed`` (isolation, as
    ``kuat.engine.isolate.seed_globals_cpu`` does): while it stays so, ``torch.initial_seed()``
    in this thread answers what the view shows (nothing changes while none is shown)."""
    _view.hidden = seed & _MASK63
