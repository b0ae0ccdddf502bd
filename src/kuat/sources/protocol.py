"""What :class:`kuat.DataLoader` may ask of a source: the one list of hooks.

A *source* is what the loader reads (``kuat.sources.as_source(dataset)``): a kuat dataset, a
torch map-style or iterable dataset, a Hugging Face dataset, a mix, a shuffle buffer, a text
packer. It is one of (:data:`Source`):

* map-style (:class:`MapSource`): ``__len__`` and ``__getitem__(index)``; the loader's sampler
  chooses, shards (by rank) and resumes the indices, so a map-style source needs nothing else;
* iterable: an instance of ``torch.utils.data.IterableDataset``; each worker iterates its own
  copy and shards itself with ``torch.utils.data.get_worker_info()`` (per thread in thread
  mode), unless it takes the loader's rank and batching through the hooks below.

Every hook below is optional; the loader looks for each with :func:`provides` (methods) or the
accessor named here (attributes), and nowhere else (``grep kuat_ src/kuat`` finds the
providers: ``sources.dataset``, ``sources.mixture``, ``sources.shuffle``, ``sources.stream``,
``sources.hf``, ``text.pack``). Each capability is its own ``runtime_checkable`` protocol, which type checkers
and ``isinstance`` understand; :func:`provides` is the loader's exact test (every method of the
protocol is callable on the object, so a hook set to ``None`` on an instance is absent, which
``isinstance`` does not see when the class defines it). The loader checks hooks when it is
built or when an epoch starts, never per batch.

==========================  =====================  =============================================
hook                        protocol / accessor    when the loader calls or reads it
==========================  =====================  =============================================
``__getitems__``            :class:`BatchFetch`    per batch, in a worker (torch's contract)
``kuat_fetch_collated``     :func:`fetch_collated` per batch, in a worker, with the default collate
``kuat_iter_collated``      :class:`CollatedStream` each epoch start, in every worker (iterable)
``kuat_thread_agnostic``    :func:`thread_agnostic` construction: may fetch in the consumer thread
``kuat_uses_sample_rng``    :func:`uses_sample_rng` construction: default of ``isolate_global_rng``
``kuat_splits_batches``     :func:`splits_batches`  each epoch start: its first batch gets all workers
``kuat_batch_transform``    :func:`batch_transform` construction; applied per batch after the copy
``kuat_prefetch``           :func:`prefetcher`      each epoch start (map-style, loader's sampler)
``set_epoch``               :class:`EpochAware`    each epoch start, in every worker (iterable)
``kuat_set_distributed``    :class:`Distributed`   each epoch start whose rank/world size changed
``kuat_set_batching``       :class:`Batching`      construction (iterable, loader's sampler)
``kuat_unequal_shares``     :func:`unequal_shares` construction, sharded: a reason refuses it
``kuat_epoch_request``      :func:`epoch_request`  epoch start, ``set_epoch``, ``load_state_dict``
``kuat_resumed``            (method)               epoch start: resumed from the loader's state?
``state_dict``/``load_…``   :class:`Stateful`      ``loader.state_dict()`` / ``load_state_dict()``
``kuat_iter_from``          :class:`ResumableIterable` epoch start after ``load_state_dict()``, in
                                                   every worker, instead of ``iter()`` (iterable)
``kuat_state_at``           :class:`PlanState`     ``loader.state_dict()`` (iterable)
==========================  =====================  =============================================

Samplers have one hook of their own, ``kuat_set_epoch(epoch)`` (see :mod:`kuat.sampling`).
Wrappers: torch's map-style wrappers (``Subset``, ``StackDataset``, ``ConcatDataset``) cannot
carry kuat's hooks, so the accessors above see through them; ``README.md`` beside this module
says what passes through each, and how kuat's own wrappers declare theirs.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, Union, runtime_checkable

if TYPE_CHECKING:
    from torch.utils.data import IterableDataset

__all__ = [
    "Source", "Batching", "BatchFetch", "CollatedFetch", "CollatedStream", "Distributed",
    "EpochAware", "MapSource", "PlanState", "Prefetching", "ResumableIterable", "Stateful",
    "all_use_sample_rng", "batch_transform", "common_batch_transform", "fetch_collated",
    "never_draws", "prefetcher", "provides", "resumed", "splits_batches", "thread_agnostic",
    "uses_sample_rng",
]


@runtime_checkable
class MapSource(Protocol):
    """A map-style source: ``len(source)`` samples, ``source[i]`` for ``0 <= i < len``.

    Thread-safety: in thread mode every worker holds its own shallow copy of the source
    (``copy.copy``), so ``__getitem__`` may run in several threads at once on copies that
    share the source's attributes; it must not mutate shared state without a lock.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


#: What the loader reads: a map-style source or a torch ``IterableDataset``, either with any of
#: the optional hooks below. (A name for annotations; this module imports no torch.)
Source = Union[MapSource, "IterableDataset"]


@runtime_checkable
class BatchFetch(Protocol):
    """``__getitems__(indices)``: torch's batched fetch, one call per batch of B indices.

    Called in a worker with a ``list`` of B ints (the batch sampler's batch); returns a list of
    B samples, which the collate function assembles (as ``torch.utils.data.DataLoader`` does).
    Same thread-safety as ``__getitem__``.
    """

    def __getitems__(self, indices: list[int]) -> list: ...


@runtime_checkable
class CollatedFetch(Protocol):
    """``kuat_fetch_collated(indices)``: a whole batch, already collated.

    Called instead of ``__getitems__`` when the loader's collate is the default one
    (``kuat.default_collate`` or torch's) and ``on_error="raise"``. It must return exactly
    ``default_collate(self.__getitems__(indices))`` (same structures, dtypes, shapes and
    values, e.g. ``{field: (B, ...) tensor}``) and may skip building per-sample objects.
    Same thread-safety as ``__getitems__``.
    """

    def kuat_fetch_collated(self, indices: Sequence[int]) -> Any: ...


@runtime_checkable
class CollatedStream(Protocol):
    """``kuat_iter_collated(collate_fn, batch_size, drop_last)``: each epoch, in every worker,
    instead of ``iter()`` (``on_error="raise"``): ``(rows, batch)`` pairs, ``batch`` exactly
    ``collate_fn`` of the ``rows`` samples ``iter()`` gives this worker there, or ``None``: read
    rows (``kuat.sources.hf``: a Hugging Face stream read as Arrow, column by column)."""

    def kuat_iter_collated(self, collate_fn: Any, batch_size: int, drop_last: bool) -> Any: ...


@runtime_checkable
class Prefetching(Protocol):
    """``kuat_prefetch(indices)``: the epoch's order, told in advance (map-style sources).

    Called once at the start of each epoch when the loader owns the sampler (and by
    ``kuat.ShardShuffleSampler`` on each ``iter()``), on the loader's copy of the source, with
    this rank's sample indices (a sequence of N ints) in the order the epoch reads them (after
    a resume, from the resume point). Remote storage starts fetching shards in that order. Must
    return at once (work in the background) and be safe to call from any thread.
    """

    def kuat_prefetch(self, indices: Sequence[int]) -> None: ...


@runtime_checkable
class EpochAware(Protocol):
    """``set_epoch(epoch)`` (iterable sources): called in every worker, on that worker's copy,
    before it iterates epoch ``epoch`` (persistent workers included); the epoch's order may
    depend on it."""

    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class Distributed(Protocol):
    """``kuat_set_distributed(rank, world_size)`` (iterable sources): called on the loader's
    source when an epoch starts and the loader's share (``(0, 1)`` unless the loader was asked
    to shard: :mod:`kuat.distributed`) differs from the last call; the source then yields only
    rank ``rank``'s share (equal shares, padded as
    ``DistributedSampler`` pads, truncated with ``drop_last``). Workers started before get a
    new copy."""

    def kuat_set_distributed(self, rank: int, world_size: int) -> None: ...


@runtime_checkable
class Batching(Protocol):
    """``kuat_set_batching(batch_size, drop_last)`` (iterable sources): called once at
    construction (``batch_size`` ``None`` when auto-batching is off). The source then splits
    workers by whole batches, so batch ``k`` of an epoch is the same whatever the number of
    workers, and the loader can resume it exactly by replaying the epoch's first batches."""

    def kuat_set_batching(self, batch_size: int | None, drop_last: bool) -> None: ...


@runtime_checkable
class Stateful(Protocol):
    """``state_dict()`` / ``load_state_dict(state)``: the source's own resumable state, saved
    under ``"source"`` in ``loader.state_dict()`` and given back by
    ``loader.load_state_dict()``, from the caller's thread (map-style sources). A torch
    ``IterableDataset`` with it (or whose iterator has it) is saved and resumed per worker, as
    torchdata's ``StatefulDataLoader`` does: each worker's copy reports its state with every
    batch and loads it back on resume (``docs/loader.md``, "Resume"). Iterable sources with
    neither it nor :class:`ResumableIterable` are resumed by replaying (fetching and dropping)
    the batches already served in the epoch."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class ResumableIterable(Protocol):
    """``kuat_iter_from(epoch, batches_served, state)`` (iterable sources): resuming mid-epoch,
    each worker starts its iterator with this instead of ``iter(source)`` (after
    ``set_epoch``), on its own copy: this rank's and this worker's share of ``epoch`` after the
    rank's first ``batches_served`` batches (split as :class:`Batching` says; batch
    ``batches_served`` goes to worker 0, the next to worker 1, ...), found without reading
    what precedes it. ``state``: what :class:`PlanState`'s ``kuat_state_at`` returned when the
    loader's state was taken, or ``None`` (the source finds the point itself). Iterable
    sources without it are resumed by replaying the served batches."""

    def kuat_iter_from(self, epoch: int, batches_served: int, state: Any = None) -> Any: ...


@runtime_checkable
class PlanState(Protocol):
    """``kuat_state_at(epoch, batches_served, rank, world_size)`` (iterable sources with
    :class:`ResumableIterable`): called on the loader's source, from the caller's thread, by
    ``loader.state_dict()``; returns a small picklable value (or ``None``) saved under
    ``"source"`` and handed to ``kuat_iter_from`` on resume, so that the resume costs the
    same wherever it is in the epoch (``kuat.pack``: the buffer of the packing plan that holds
    the next row)."""

    def kuat_state_at(self, epoch: int, batches_served: int, rank: int, world_size: int) -> Any: ...


def provides(source: object, protocol: type) -> bool:
    """Whether every method ``protocol`` names is callable on ``source`` (``None`` is absent).

    ``protocol`` is one of this module's protocols; ``provides(ds, Prefetching)`` is what the
    loader asks before calling ``ds.kuat_prefetch``. Cheap (a few ``getattr``), thread-safe.
    """
    return all(callable(getattr(source, name, None)) for name in _methods(protocol))


@functools.cache
def _methods(protocol: type) -> tuple[str, ...]:
    """The methods a protocol of this module declares (not those ``typing`` adds)."""
    names = tuple(name for name, value in vars(protocol).items()
                  if inspect.isfunction(value) and value.__module__ == __name__)
    if not names:
        raise TypeError(f"{protocol!r} is not a protocol of kuat.sources.protocol")
    return names


# -- flags and attributes: their value matters, not only their presence --------------------
def thread_agnostic(source: object) -> bool:
    """``source.kuat_thread_agnostic is True``: a batch depends only on its indices (and the
    loader's seed and epoch), never on which thread fetches it or on per-worker state, so the
    loader may fetch cheap batches in the consumer thread instead of handing them to a worker
    (from the source itself, not a copy of its own), even when a worker consulted
    ``get_worker_info()``. Also true of plain sequences (``range``, ``list``, ``tuple``, NumPy
    arrays, tensors, ``TensorDataset``: these exact types) and of torch's wrappers (see the
    module docstring) whose every wrapped dataset is.

    Not about global random generators: a thread-agnostic source that draws from them is
    still isolated (``isolate_global_rng``, see :func:`uses_sample_rng`)."""
    if getattr(source, "kuat_thread_agnostic", False) is True or never_draws(source):
        return True
    wrapped = _torch_wrapper(source)
    return wrapped is not None and all(thread_agnostic(d) for d in wrapped[1])


def never_draws(source: object) -> bool:
    """Whether indexing ``source`` can never draw random numbers (kuat's one such predicate):
    plain sequences whose indexing runs no user code: ``range``, ``list``, ``tuple``, NumPy
    arrays, tensors and torch's ``TensorDataset`` (exactly these types, not subclasses). The
    loader then never isolates global RNGs for it, and any thread may fetch its batches."""
    cls = type(source)
    if cls in (range, list, tuple):
        return True
    np_ = sys.modules.get("numpy")
    torch_ = sys.modules.get("torch")
    data = sys.modules.get("torch.utils.data")
    return ((np_ is not None and cls is np_.ndarray) or (torch_ is not None and cls is torch_.Tensor)
            or (data is not None and cls is data.TensorDataset))


def _torch_wrapper(source: object) -> tuple[str, list] | None:
    """``(kind, wrapped datasets)`` for torch's ``Subset`` (``"subset"``), ``StackDataset``
    (``"stack"``) and ``ConcatDataset`` (``"concat"``) when the class's indexing methods are
    torch's own; ``None`` for anything else."""
    data = sys.modules.get("torch.utils.data")  # a torch wrapper implies torch is imported
    if data is None:
        return None
    cls = type(source)

    def torchs(base: type, *names: str) -> bool:
        return all(getattr(cls, n, None) is getattr(base, n, None) for n in names)

    if isinstance(source, data.Subset) and torchs(data.Subset, "__getitem__", "__getitems__"):
        return "subset", [source.dataset]
    stack = getattr(data, "StackDataset", None)
    if stack is not None and isinstance(source, stack) and torchs(stack, "__getitem__",
                                                                  "__getitems__"):
        d = source.datasets
        return "stack", list(d.values()) if isinstance(d, dict) else list(d)
    if isinstance(source, data.ConcatDataset) and torchs(data.ConcatDataset, "__getitem__",
                                                         "__getitems__"):
        return "concat", list(source.datasets)
    return None


def splits_batches(source: object) -> bool:
    """``source.kuat_splits_batches is True``: a batch fetch can use more than one thread
    (its GIL-free kernel runs in ``kuat._parallel.width()`` parts, same result at every
    width). The loader then fetches an epoch's first batch with all its workers' width and
    holds the other workers back until that batch is out (so the training loop gets its first
    batch in about ``1 / num_workers`` of one batch's time).

    torch's ``Subset`` (so ``random_split``'s parts) and ``StackDataset`` cannot carry the
    flag; they split when a dataset they hand whole batches to splits
    (:func:`_batch_forwarded_to`). kuat's own wrappers (``kuat.mix``) declare the flag."""
    if getattr(source, "kuat_splits_batches", False) is True:
        return True
    return any(splits_batches(inner) for inner in _batch_forwarded_to(source))


def _batch_forwarded_to(source: object) -> list:
    """The datasets a torch wrapper hands each whole batch to, in one ``__getitems__`` call
    each, in the calling thread: ``Subset`` (``random_split``) and ``StackDataset`` (their
    ``__getitems__`` is torch's own) to each inner dataset that has one (torch then calls
    it; without one it calls ``__getitem__`` per sample, which splits nothing). Others: none.
    ``ConcatDataset`` fetches per sample."""
    wrapped = _torch_wrapper(source)
    if wrapped is None or wrapped[0] == "concat":
        return []
    return [d for d in wrapped[1] if provides(d, BatchFetch)]


def fetch_collated(source: object) -> Callable[[Sequence[int]], Any] | None:
    """The source's :class:`CollatedFetch` as a callable ``fetch(indices) -> batch``, or
    ``None``: ``source.kuat_fetch_collated``; through a torch ``Subset`` (``random_split``)
    the wrapped dataset's, with the indices mapped (``default_collate(subset.__getitems__(i))``
    is exactly that); through a ``StackDataset`` whose every part has one, each part's, as
    ``default_collate`` assembles tuple samples (a list of the parts' batches) or dict samples
    (a dict). Called per batch on the worker's own copy of the source."""
    if provides(source, CollatedFetch):
        return source.kuat_fetch_collated
    wrapped = _torch_wrapper(source)
    if wrapped is None or wrapped[0] == "concat":
        return None
    if any(fetch_collated(d) is None for d in wrapped[1]):
        return None
    if wrapped[0] == "stack":
        def fetch_stack(indices: Sequence[int]) -> Any:
            d = source.datasets
            if isinstance(d, dict):
                return {k: fetch_collated(part)(indices) for k, part in d.items()}
            return [fetch_collated(part)(indices) for part in d]

        return fetch_stack

    def fetch(indices: Sequence[int]) -> Any:  # read at each call: a worker_init_fn may narrow
        return fetch_collated(source.dataset)([source.indices[i] for i in indices])

    return fetch


def prefetcher(source: object) -> Callable[[Sequence[int]], None] | None:
    """The source's :class:`Prefetching` hook as a callable ``prefetch(indices)``, or ``None``:
    ``source.kuat_prefetch``, or through torch's wrappers the wrapped datasets' with the
    indices each reads, in the order it reads them (``Subset``: mapped through ``indices``;
    ``StackDataset``: the same; ``ConcatDataset``: each part its own share, made local).
    Returns at once, as the hooks it calls."""
    if provides(source, Prefetching):
        return source.kuat_prefetch
    wrapped = _torch_wrapper(source)
    if wrapped is None:
        return None
    kind, parts = wrapped
    hooks = [prefetcher(d) for d in parts]
    if not any(h is not None for h in hooks):
        return None
    if kind == "subset":
        return lambda indices: hooks[0]([source.indices[i] for i in indices])
    if kind == "stack":
        def stack(indices: Sequence[int]) -> None:
            for h in hooks:
                if h is not None:
                    h(indices)

        return stack

    def concat(indices: Sequence[int]) -> None:
        import bisect

        ends = source.cumulative_sizes  # ends[k]: samples in parts 0..k
        n = ends[-1] if ends else 0
        shares: list[list[int]] = [[] for _ in parts]
        for i in indices:
            i = i + n if i < 0 else i
            k = bisect.bisect_right(ends, i)
            if k < len(parts):
                shares[k].append(i - (ends[k - 1] if k else 0))
        for h, share in zip(hooks, shares, strict=True):
            if h is not None and share:
                h(share)

    return concat


def unequal_shares(source: object) -> str | None:
    """Why a stream cannot give ranks equal shares (``Stream.kuat_unequal_shares``), or None."""
    return getattr(source, "kuat_unequal_shares", None) or None


def epoch_request(source: object) -> int | None:
    """The epoch the source's own dataset was set to since last asked
    (``HFIterableSource.kuat_epoch_request``: a stream's ``set_epoch``), else None; asking
    consumes it."""
    hook = getattr(source, "kuat_epoch_request", None)
    return hook() if callable(hook) else None


def resumed(source: object, epoch: int, by_loader: bool) -> None:
    """Tell the source (``kuat_resumed``) whether the loader resumes ``epoch`` itself."""
    hook = getattr(source, "kuat_resumed", None)
    if callable(hook):
        hook(epoch, by_loader)


def uses_sample_rng(source: object) -> bool:
    """``source.kuat_uses_sample_rng`` is true: the source draws randomness only from
    ``kuat.sample_rng`` (seeded by seed, epoch and sample index), so the loader's default is
    not to isolate global RNGs per sample (``isolate_global_rng=False``). Through torch's
    wrappers (module docstring): when every wrapped dataset uses it or is a plain sequence."""
    if getattr(source, "kuat_uses_sample_rng", False):
        return True
    wrapped = _torch_wrapper(source)
    return wrapped is not None and all_use_sample_rng(wrapped[1])


def all_use_sample_rng(sources: Sequence) -> bool:
    """Whether every one of ``sources`` draws only from ``kuat.sample_rng``
    (:func:`uses_sample_rng`) or draws nothing (a plain sequence): the rule of every wrapper
    that reads them (torch's, ``kuat.mix``)."""
    return all(uses_sample_rng(s) or never_draws(s) for s in sources)


def batch_transform(source: object) -> Callable[[Any], Any] | None:
    """``source.kuat_batch_transform``: a callable the loader applies to every collated batch
    after pinning and the host-to-device copy (on ``device`` when the loader has one, on the
    host otherwise), in the consumer thread, e.g. a fused image transform's ``Normalize`` on
    ``(B, 3, H, W)`` uint8 -> float32. ``None`` (or absent): no batch step. Read once, when
    the loader is built.

    Through torch's wrappers (module docstring): a ``Subset``'s is its dataset's; a
    ``StackDataset``'s applies each part's to that part of the batch (a tuple's parts collate
    to a list, a dict's to a dict); a ``ConcatDataset``'s is :func:`common_batch_transform`
    of its parts."""
    own = getattr(source, "kuat_batch_transform", None)
    if own is not None:
        return own
    wrapped = _torch_wrapper(source)
    if wrapped is None:
        return None
    kind, parts = wrapped
    if kind == "subset":
        return batch_transform(parts[0])
    if kind == "concat":
        return common_batch_transform(parts, "ConcatDataset")
    fns = [batch_transform(d) for d in parts]
    if all(fn is None for fn in fns):
        return None
    keys = list(source.datasets) if isinstance(source.datasets, dict) else None
    return _StackTransform(fns, keys)


class _StackTransform:
    """A ``StackDataset``'s batch step: part ``k``'s transform on part ``k`` of the batch."""

    def __init__(self, fns: list, keys: list | None):
        self.fns, self.keys = fns, keys

    def __call__(self, batch):
        if self.keys is not None:  # {key: part's batch}
            fns = dict(zip(self.keys, self.fns, strict=True))
            return {k: v if fns.get(k) is None else fns[k](v) for k, v in batch.items()}
        # a list (default_collate turns tuple samples into a list of parts)
        return type(batch)(part if fn is None else fn(part)
                           for fn, part in zip(self.fns, batch, strict=True))


def common_batch_transform(sources: Sequence, what: str = "mix") -> Callable[[Any], Any] | None:
    """The one batch step of a source whose batches mix samples of ``sources`` (``kuat.mix``,
    ``ConcatDataset``): the first source's that has one. kuat cannot compare two such
    callables, so it warns (the ``kuat.sources`` logger) when several sources have one: they
    must do the same thing."""
    found = [(k, t) for k, s in enumerate(sources) if (t := batch_transform(s)) is not None]
    if len(found) > 1:
        import logging

        logging.getLogger("kuat.sources").warning(
            "%s: sources %s each have a kuat_batch_transform; the one of source %d is applied "
            "to every batch (they must do the same thing)", what, [k for k, _ in found],
            found[0][0],
        )
    return found[0][1] if found else None
