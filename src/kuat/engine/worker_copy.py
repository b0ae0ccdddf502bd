"""The dataset object a thread worker reads: its own copy, as each of torch's worker processes.

A torch worker process reads its own copy of the dataset (forked or unpickled), so what a
worker does to it (``worker_init_fn`` narrowing ``get_worker_info().dataset``, a file handle or
connection opened lazily in ``__getitem__``, a counter, a per-worker cache) stays in that
worker. Thread workers keep that: each gets :func:`worker_dataset` when it starts (once per
worker per engine: each epoch, or once with persistent workers), taken after the main thread's
last change:

* ``copy.copy(dataset)``: attributes *assigned* in a worker are its own; tensors, arrays,
  memory-mapped shards and every other object an attribute points to stay shared (read-only
  data, shared at no cost);
* then each attribute that is a container of plain Python types (``list``, ``dict``, ``set``,
  ``bytearray``, ``collections.deque``/``OrderedDict``/``defaultdict``/``Counter``), nested
  ones included, is copied as well when it holds at most :data:`OWN_CONTAINER_LIMIT` elements
  in all: a counter list or dict, a cache dict, a list of seen indices created in ``__init__``
  and mutated in ``__getitem__`` then counts per worker, as under torch. Their elements that are
  not such containers (strings, tensors, objects) are shared; two attributes naming the same
  container still name one (per worker). Larger containers (file lists, label tables: data
  read, not written, by workers) stay shared, as do containers inside other objects (the
  ``dataset`` of a ``Subset``).

Not copied: a dataset whose class defines ``__copy__`` gets exactly what that returns (a class
that wants no copy, or a deeper one, says so there); kuat's own sources (``kuat.*`` classes),
which are thread-safe and share their caches on purpose. One that cannot be copied is shared,
with a warning. In process mode (the worker has its own copy already) and inline mode (torch's
``num_workers=0`` reads the dataset itself) nothing is copied.

Cost (loaded 2-core dev machine, median of 2000): ``copy.copy`` alone about 3 us for a
``TensorDataset``, an ``ImageFolder`` or a kuat dataset; with the container pass 4.6 us for a
``TensorDataset`` (no containers), 42 us for an ``ImageFolder``-like dataset of 900 files (its
sample lists are copied), 1.3 ms for a 60,000-entry list: once per worker start (numbers in
``tests/test_parity_threads.py``).
"""

from __future__ import annotations

import collections
import copy
import logging

__all__ = ["worker_dataset", "OWN_CONTAINER_LIMIT"]

log = logging.getLogger("kuat.engine")

# elements (items of every nested container, counted once) up to which an attribute's
# containers are copied per thread worker; above it the attribute stays shared
OWN_CONTAINER_LIMIT = 65536

_SEQUENCES = (list, set, bytearray, collections.deque)
_MAPPINGS = (dict, collections.OrderedDict, collections.defaultdict, collections.Counter)
_CONTAINERS = frozenset(_SEQUENCES + _MAPPINGS)


class _TooLarge(Exception):
    pass


def _own(value, memo: dict, budget: list):
    """A copy of the plain container ``value`` and of the plain containers nested in it
    (``memo``: id -> copy, so shared ones stay shared); raises ``_TooLarge`` past ``budget``."""
    done = memo.get(id(value))
    if done is not None:
        return done
    budget[0] -= len(value)
    if budget[0] < 0:
        raise _TooLarge
    t = type(value)
    if t in _MAPPINGS:
        new = copy.copy(value)  # keeps a defaultdict's factory, an OrderedDict's order
        memo[id(value)] = new
        if not _CONTAINERS.isdisjoint(map(type, value.values())):
            for k, v in new.items():
                if type(v) in _CONTAINERS:
                    new[k] = _own(v, memo, budget)
        return new
    if t is bytearray:
        new = bytearray(value)
        memo[id(value)] = new
        return new
    if t is set:  # elements are hashable: never mutable containers
        new = set(value)
        memo[id(value)] = new
        return new
    nested = not _CONTAINERS.isdisjoint(map(type, value))
    new = t(value) if t is list else collections.deque(value, value.maxlen)
    memo[id(value)] = new
    if nested:
        for i, v in enumerate(new):
            if type(v) in _CONTAINERS:
                new[i] = _own(v, memo, budget)
    return new


def _own_containers(obj) -> None:
    """Give ``obj`` (a fresh shallow copy) its own copies of its plain containers."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return
    memo: dict = {}
    for name, value in list(attrs.items()):
        if type(value) not in _CONTAINERS:
            continue
        try:
            attrs[name] = _own(value, memo, [OWN_CONTAINER_LIMIT])
        except _TooLarge:  # data, not state: shared (copies already made for it stay unused)
            continue


def worker_dataset(dataset, method: str):
    """The dataset object one worker reads: its own copy in a thread worker (module docstring)."""
    if method != "thread":
        return dataset
    try:
        new = copy.copy(dataset)
    except Exception as e:  # un-copyable (a C extension type, a __reduce__ that refuses)
        log.warning(
            "kuat thread workers share one %s object: copy.copy() failed (%s: %s), so state a "
            "worker sets on it is seen by every worker. Define __copy__ on the dataset, or use "
            "worker_type='process'", type(dataset).__name__, type(e).__name__, e,
        )
        return dataset
    cls = type(dataset)
    if (new is not dataset and getattr(cls, "__copy__", None) is None
            and not cls.__module__.startswith("kuat.")):
        _own_containers(new)
    return new
