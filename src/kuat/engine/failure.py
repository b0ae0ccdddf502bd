"""Error transport: an exception raised in a worker, raised again in the consumer.

In the worker's own process (thread workers, ``num_workers=0``, the consumer's take-over of
cheap batches) nothing needs pickling: the consumer raises the original object itself, as
torch's ``num_workers=0`` does, whatever its ``__reduce__`` does, with its traceback (the
worker's frames, shown under the consumer's) and its chain, plus one note.

From a worker process it is raised as the original's *equal*: the same type, the same
``args``, the same attributes (the instance ``__dict__``, ``__notes__`` included, and what the
type's own reduction carries, such as ``OSError.filename`` or ``ImportError.name``) and the same
chain (``__cause__``, ``__context__``), plus one note. A ``DecodeError`` keeps its ``index``
and ``source``, a ``CalledProcessError`` its ``returncode`` and ``stderr``.

The note is one sentence the caller writes (the engine: ``engine/base.py:failure`` names the
worker, the stage that failed and the sample indices; the Ray converter names its task), and,
from a process, the worker's formatted traceback (tracebacks do not pickle) and the attributes
left behind. This module knows nothing of tasks, so anything that runs work in another process
can use it.

How an exception is rebuilt (:func:`_rebuild`): from its ``__reduce_ex__``, ``(callable, args,
state)``, as ``copy.copy`` and ``pickle`` do: ``callable(*args)``, then ``__setstate__(state)``.
Where the type's ``__init__`` refuses its own ``args`` (a user exception with a required
keyword argument, ``__init__(self, msg, *, code)``), the instance is made with
``type.__new__(type, *args)`` and given its state: pickle's own route for objects that do not
reduce themselves, so the type and every attribute survive. ``args`` are set back to the
original's when an ``__init__`` rewrote them (``super().__init__(f"code {code}")``). The
reduction is pickled in the worker (:class:`_Packed`) and checked there by rebuilding it once;
attributes that do not pickle are dropped and named in the note. The chain is packed the same
way, up to ``_CHAIN_DEPTH`` links. Everything is unpickled lazily in the consumer, so an
exception type the consumer cannot import never breaks the result pipe.

What cannot cross (an unpicklable or unimportable type, a ``__reduce__`` that raises or whose
result cannot be rebuilt, a ``__new__`` that refuses its ``args``; every process exception on
Python < 3.11, where notes are not shown) becomes a :class:`kuat.WorkerError` that names the
original type, the message, the worker, the stage, the indices and the worker's traceback.

For comparison, torch's DataLoader (``torch._utils.ExceptionWrapper.reraise``) raises
``type(msg)`` with the formatted traceback as the only argument, and ``RuntimeError`` when the
type does not take one argument (``UnicodeDecodeError``, ``CalledProcessError``): every
attribute and the chain are lost, and ``args`` are replaced. kuat raises the original type in
every case where torch does, and in those too.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from typing import Any, NamedTuple

from kuat.errors import WorkerError

__all__ = ["Failure", "add_note"]

_CHAIN_DEPTH = 8  # cause/context links packed for a process worker's exception


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as e:  # a __str__ that fails must not hide the error being reported
        return f"<str() failed: {type(e).__name__}: {e}>"


def _reduce(exc: BaseException) -> tuple[Any, tuple, dict | None]:
    """``(callable, args, state)`` of ``exc``, its state a copy (``__notes__`` a new list)."""
    rv = exc.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    if isinstance(rv, str) or len(rv) < 2:
        raise TypeError(f"{_type_name(type(exc))} reduces to {rv!r}")
    fn, args = rv[0], tuple(rv[1])
    state = rv[2] if len(rv) > 2 else None
    if isinstance(state, dict):
        state = dict(state)
        if isinstance(state.get("__notes__"), list):
            state["__notes__"] = list(state["__notes__"])
    return fn, args, state


def _rebuild(fn, args: tuple, state, exc_args: tuple) -> BaseException:
    """The exception ``(fn, args, state)`` describes, its ``args`` equal to ``exc_args``.

    Raises whatever the rebuild raises, or ``TypeError`` when it does not give an exception.
    """
    try:
        exc = fn(*args)
    except Exception:
        if not (isinstance(fn, type) and issubclass(fn, BaseException)):
            raise
        exc = fn.__new__(fn, *args)  # __init__ refuses its own args: pickle's __newobj__ route
    if not isinstance(exc, BaseException):
        raise TypeError(f"rebuilding an exception gave a {type(exc).__name__}")
    if state:
        exc.__setstate__(state)  # BaseException.__setstate__: setattr for each item
    try:
        same = bool(exc.args == exc_args)
    except Exception:
        same = False
    if not same:
        exc.args = exc_args
    return exc


class _Packed(NamedTuple):
    """A picklable description of one exception and its chain (process workers)."""

    blob: bytes | None  # pickled (callable, args, state, exc.args); None: cannot be rebuilt
    type_name: str
    message: str
    dropped: tuple[str, ...]  # attributes left out because they do not pickle
    cause: _Packed | None
    context: _Packed | None
    suppress_context: bool


def _dumps_checked(fn, args, state, exc_args, type_name: str) -> bytes:
    blob = pickle.dumps((fn, args, state, exc_args), pickle.HIGHEST_PROTOCOL)
    back = _rebuild(*pickle.loads(blob))  # what the consumer will do: fail here, not there
    if _type_name(type(back)) != type_name:
        raise TypeError(f"{type_name} rebuilds as {_type_name(type(back))}")
    return blob


def _pack(exc: BaseException, depth: int = 0, seen: set[int] | None = None) -> _Packed:
    seen = set() if seen is None else seen
    seen.add(id(exc))
    name = _type_name(type(exc))
    blob, dropped = None, ()
    try:
        fn, args, state = _reduce(exc)
        try:
            blob = _dumps_checked(fn, args, state, exc.args, name)
        except Exception:
            if not isinstance(state, dict):
                raise
            kept = {}
            for k, v in state.items():  # keep the attributes that pickle on their own
                try:
                    pickle.dumps(v, pickle.HIGHEST_PROTOCOL)
                except Exception:
                    continue
                kept[k] = v
            dropped = tuple(k for k in state if k not in kept)
            blob = _dumps_checked(fn, args, kept, exc.args, name)
    except Exception:
        blob, dropped = None, ()

    def link(e: BaseException | None) -> _Packed | None:
        if e is None or depth + 1 >= _CHAIN_DEPTH or id(e) in seen:
            return None
        return _pack(e, depth + 1, seen)

    return _Packed(blob, name, _message(exc), dropped, link(exc.__cause__),
                   link(exc.__context__), exc.__suppress_context__)


def _unpack(p: _Packed) -> BaseException | None:
    """The exception ``p`` describes with its chain; None when it cannot be rebuilt (links
    that cannot be rebuilt become :class:`WorkerError`\\ s naming their type and message)."""
    exc = None
    if p.blob is not None:
        try:
            exc = _rebuild(*pickle.loads(p.blob))
        except Exception:
            exc = None
        if exc is not None and _type_name(type(exc)) != p.type_name:
            exc = None
    if exc is None:
        return None

    def link(q: _Packed | None) -> BaseException | None:
        if q is None:
            return None
        e = _unpack(q)
        if e is None:
            e = WorkerError(f"{q.type_name}: {q.message}", original_type=q.type_name)
        return e

    exc.__cause__, exc.__context__ = link(p.cause), link(p.context)
    exc.__suppress_context__ = p.suppress_context
    return exc


class Failure:
    """A picklable description of an exception raised in a worker (see the module docstring).

    Args:
        exc: the exception.
        worker: the worker's name (``kuat.WorkerError.worker``).
        note: where it was raised, one sentence, added to the exception in the consumer. The
            engine writes it (``engine/base.py:failure``): this module knows nothing of tasks.
        indices: the sample indices of the failed work, or None (``WorkerError.indices``).
        stage: what the worker was doing (``engine/base.py``'s stages; ``WorkerError.stage``).

    Thread-safety: made in the worker, read by the consumer after it is handed over; not
    shared otherwise.
    """

    def __init__(self, exc: BaseException, worker: str, note: str, *,
                 indices: list | None = None, stage: str = ""):
        self.type_name = _type_name(type(exc))
        self.message = _message(exc)
        self.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.worker = worker
        self.note = note
        self.indices = indices
        self.stage = stage
        # SystemExit, KeyboardInterrupt: the worker stops after reporting it (engine/base.py)
        self.ends_worker = not isinstance(exc, Exception)
        self.original = exc  # kept in the worker's process, packed when pickled (process mode)
        self._tb = exc.__traceback__  # the worker's frames (raising it again adds others)
        self.packed: _Packed | None = None

    def __getstate__(self):
        state = dict(self.__dict__)
        if self.original is not None:
            state["packed"] = _pack(self.original)
        state["original"] = state["_tb"] = None  # tracebacks do not pickle
        return state

    def exception(self) -> BaseException:
        """The exception to raise in the consumer, with the note added.

        In the worker's own process (thread workers, ``num_workers=0``, the consumer's
        take-over): the original object itself, whatever its ``__reduce__`` does (nothing is
        pickled), its traceback reset to the worker's frames, which show under the consumer's
        when it is raised. A failure raised for several tasks (a ``worker_init_fn`` error) is
        the same object each time, with one note.

        From a process: a new exception each call, the original's equal when it can be rebuilt
        (its traceback, which does not pickle, as text in the note), otherwise a
        :class:`kuat.WorkerError` naming its type, message, stage and traceback.
        """
        if self.original is not None:
            exc = self.original.with_traceback(self._tb)
            add_note(exc, self.note)
            return exc
        note = self.note
        exc = _unpack(self.packed) if self.packed is not None else None
        if exc is not None and self.packed.dropped:
            note += (f"\nAttributes left in the worker (they do not pickle): "
                     f"{', '.join(self.packed.dropped)}.")
        note += f"\nWorker traceback:\n{self.traceback}"
        if exc is None or sys.version_info < (3, 11):  # before 3.11 a note is not shown
            return WorkerError(
                f"{self.type_name}: {self.message}\n{note}",
                original_type=self.type_name,
                worker=self.worker,
                indices=self.indices,
                worker_traceback=self.traceback,
                stage=self.stage,
            )
        exc.add_note(note)
        return exc


class _Note(str):
    """A note this module added (a ``str``): replaced, not repeated, on the next raise."""


def add_note(exc: BaseException, note: str) -> None:
    """Add ``note`` to ``exc`` in place of one this module added before: the same object raised
    again (a ``worker_init_fn`` failure raised for every task, a dataset that raises one stored
    exception for every batch) shows the note of this raise only."""
    try:
        notes = getattr(exc, "__notes__", None)
        if isinstance(notes, list):
            notes[:] = [n for n in notes if not isinstance(n, _Note)]
        if hasattr(exc, "add_note"):
            exc.add_note(_Note(note))
        else:  # Python 3.10: kept where 3.11 keeps notes (not shown in the traceback)
            exc.__notes__ = [*(notes or ()), _Note(note)]
    except Exception:  # a __notes__ that is not a list, an exception without a __dict__
        pass
