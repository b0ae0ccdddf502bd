"""A batch's memory: which buffers belong to the batch being built, and the loader's pool that
reuses a batch's memory once nothing views it any more.

Whose buffer it is: :class:`batch_scope` (the loader's workers open one around each batch's
fetch and collate) records, per thread, the buffers allocated for that batch with
:func:`new_batch_buffer` (or declared with :func:`own_batch_buffer`): memory no user object
references. ``kuat.collate.default_collate`` returns a view of such a buffer instead of a copy
(:func:`is_batch_buffer`); any other memory it copies, so in-place edits of a batch never reach
the user's data. A kuat dataset whose fused image transform fills one ``(B, 3, H, W)`` buffer
returns that buffer itself as the collated batch (``kuat_fetch_collated``): nothing to find.

The pool: a decoded image batch is one large buffer (``(64, 3, 224, 224)`` uint8 is 9.2 MiB)
per batch. Allocated with ``malloc``, such buffers end up in glibc's per-thread arenas (its mmap
threshold rises to the size of the first freed one), which keep freed memory resident: with
2 worker threads the loader's anonymous memory grew to about twice what the batches in flight
need (measured: +86 MiB over 2 epochs at batch 64, +39 MiB with buffers that go back to the OS
on free). The pool instead maps each buffer with ``mmap`` (never part of an arena) and, when
the last tensor viewing it is freed, keeps it for the next batch of the same size: no page
faults, no zeroing, and at most ``max_free`` idle buffers per size. ``clear()`` (the loader's
``close()``) unmaps the idle ones; buffers still in use go back to the OS when freed.

How a buffer comes back: :meth:`take` returns a fresh NumPy array object viewing the mapping;
``torch.from_numpy`` keeps that array alive for as long as any tensor (the batch, a view of
it, a slice the user keeps) uses the memory; when it dies, a weak reference's callback puts
the mapping back on the free list. So reuse can never overwrite memory the user still holds.
(A plain ``weakref.ref`` with a callback, kept in the pool, rather than ``weakref.finalize``,
whose registry bookkeeping is Python: both ends run once per batch, with the GIL held.)
:meth:`BufferPool.take_array` goes one step further for a batch's arrays of a known shape and
dtype (a kuat dataset's image buffer and labels, ``kuat.sources._rows_fetch``): the callback
makes the next lease and its tensor in the thread that freed the batch (the training
loop's, where torch is warm), so a worker thread takes its batch's tensors with no NumPy or
torch call, which cost tens of microseconds each in a worker right after a batch decode has
evicted the caches (issue 31). It makes them ``refill`` buffers at a time, for every layout
at once: only the first NumPy and torch calls of a run are cold (49 us for a
``torch.from_numpy`` after the loop thread waited for its batch, 2 us for the next one, on a
2-core VM), so freeing a batch of a thread-worker loader took 95-114 us of the loop thread's
CPU with ``refill=3`` against 123-140 with each pair made as its memory came back
(``benchmarks/gil_floor.py``, 1 worker, batch 64, 2026-12-03).

Thread-safety: :meth:`take` and the callbacks may run in any thread (a lock guards the lists).
Pickling gives an empty pool (process workers each keep their own). A scope is the thread's own.
"""

from __future__ import annotations

import math
import mmap
import sys
import threading
import weakref

import numpy as np
import torch

__all__ = [
    "BufferPool", "MIN_POOLED_BYTES", "batch_scope", "has_batch_buffers", "is_batch_buffer",
    "new_batch_array", "new_batch_buffer", "own_batch_buffer",
]

# Below this, malloc is cheap and its arenas hold little: the pool is for batch-sized buffers.
MIN_POOLED_BYTES = 1 << 20
_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_U8 = np.dtype(np.uint8)


def _mapped(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private anonymous memory, huge pages advised where the kernel allows."""
    # private anonymous pages (Python's default, MAP_SHARED, would be shmem: the same memory,
    # but counted as shared); munmap'ed when the last reference dies
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _HUGEPAGE is not None:
        # Transparent huge pages where the kernel allows them ("madvise" mode): a fresh
        # 9.2 MiB buffer then costs 1.9 ms of CPU to fault in instead of 4.6 (measured), most
        # of it in an epoch's first batch; the memory is the same, as every byte of a batch
        # buffer is written. Checked again when first batches stalled
        # (benchmarks/first_batch.py, a 2-core VM): 1.5-3.5 ms against 5-8 ms, an occasional
        # 20 ms, no compaction or reclaim stall even with the page cache filling memory; the
        # stalls were a cold page cache (format/shard.py).
        try:
            mm.madvise(_HUGEPAGE)
        except OSError:
            pass
    return mm


class BufferPool:
    """Reusable, mmap-backed uint8 buffers, by exact byte size (:meth:`take`), or arrays with
    their tensors made ready, by shape and dtype (:meth:`take_array`).

    Args:
        max_free: idle buffers kept per size, and ready pairs per shape and dtype (more are
            unmapped when freed).
        refill: :meth:`take_array` memory is made ready this many buffers at a time (at most
            ``max_free``): a layout's memory waits until ``refill`` of its buffers are back,
            then every layout's is made ready in that one free. Idle memory per shape and
            dtype is then under ``max_free + refill`` buffers; a loader keeps about
            ``refill`` more batches mapped than it has in flight (3 x 9.2 MiB at batch 64 of
            224 x 224 images). 1 makes each pair as its memory comes back.
    """

    def __init__(self, max_free: int = 4, refill: int = 3):
        if not isinstance(max_free, int) or max_free < 0:
            raise ValueError(f"max_free must be an int >= 0, got {max_free!r}")
        if not isinstance(refill, int) or refill < 1:
            raise ValueError(f"refill must be an int >= 1, got {refill!r}")
        self.max_free, self.refill = max_free, refill
        # reentrant: a collection triggered inside the lock may free a lease, whose callback
        # (_returned) then runs in this same thread
        self._lock = threading.RLock()
        self._free: dict[int, list[mmap.mmap]] = {}
        # id(weakref) -> (weakref to the lease, mapping, take_array's (shape, dtype) or None)
        self._leased: dict[int, tuple] = {}
        # take_array's (shape, dtype) -> ready (tensor, array) pairs, made as memory came back
        self._ready: dict[tuple, list[tuple[torch.Tensor, np.ndarray]]] = {}
        # take_array's (shape, dtype) -> memory back from its leases, not made ready yet
        self._back: dict[tuple, list] = {}
        self._closed = self._clearing = False
        self.created = self.reused = 0  # counters, for tests and stats
        # bytes mapped now (leased + idle) and the most ever mapped at once: what the pool adds
        # to the process's anonymous memory (benchmarks attribute a loader's memory with it)
        self.mapped_bytes = self.peak_bytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A ``(nbytes,)`` uint8 array, uninitialised, that returns to the pool when freed."""
        return self._lease(nbytes, None)

    def take_array(self, shape: tuple[int, ...],
                   dtype: np.dtype = _U8) -> tuple[torch.Tensor, np.ndarray]:
        """``(t, a)``: an uninitialised ``shape`` array ``a`` of ``dtype`` (a ``np.dtype``) and the tensor
        ``t`` viewing it (``torch.from_numpy(a)``); the memory returns to the pool when both
        (and every view of them) are freed. ``shape``: a tuple of ints.

        The pair is made ready when its memory comes back (:meth:`_returned`, in the thread
        that freed the last view: the training loop's, where torch is warm), so that a worker
        takes a batch's tensors with no torch call: after a batch decode has evicted the
        caches, a ``torch.from_numpy`` costs about 45 us there (measured), most of a thread
        worker's GIL time per batch. Arrays under :data:`MIN_POOLED_BYTES` (a batch's labels)
        are kept ready too, in memory of their own (not mapped, not in the counters)."""
        layout = (shape, dtype)
        ready = self._ready.get(layout)
        if ready:
            try:
                pair = ready.pop()  # (atomic under the GIL: no lock for the usual case)
            except IndexError:  # another thread took the last one
                pair = None
            if pair is not None:
                if pair[1].nbytes >= MIN_POOLED_BYTES:
                    self.reused += 1
                return pair
        a = self._lease(math.prod(shape) * dtype.itemsize, layout)
        return torch.from_numpy(a), a

    def _lease(self, nbytes: int, layout) -> np.ndarray:
        if nbytes < MIN_POOLED_BYTES:  # (take_array's small arrays: plain memory)
            mm = bytearray(nbytes)
        else:
            with self._lock:
                free = self._free.get(nbytes)
                mm = free.pop() if free else None
                if mm is None:
                    self.created += 1
                    self.mapped_bytes += nbytes
                    self.peak_bytes = max(self.peak_bytes, self.mapped_bytes)
                else:
                    self.reused += 1
            if mm is None:
                mm = _mapped(nbytes)
        return self._leased_view(mm, layout)

    def _leased_view(self, mm, layout) -> np.ndarray:
        """A new lease of ``mm``: an array over all of it, ``(nbytes,)`` uint8, or shaped as
        ``layout`` (a ``(shape, dtype)``, :meth:`take_array`'s).

        The lease is one array whose base is the mapping itself, not another array, so every
        NumPy view of it (of a view of it...) has the lease as its base and keeps it alive,
        as does a tensor made from it or from such a view (``torch.from_numpy`` holds its
        array). One ``np.ndarray`` call instead of ``frombuffer`` then ``view``/``reshape``:
        about 30 us less per batch in a loop thread that has just waited for its batch
        (issue 31). Such an array holds no buffer export of the mapping, so the pool never
        closes or resizes one: a mapping goes when its last reference does."""
        lease = np.ndarray(layout[0], layout[1], mm) if layout is not None else np.ndarray(
            (len(mm),), _U8, mm)  # (writable: mmap and bytearray are)
        ref = weakref.ref(lease, self._returned)
        self._leased[id(ref)] = (ref, mm, layout)  # (one dict store: atomic under the GIL)
        return lease

    def _returned(self, ref: weakref.ref, _finalizing=sys.is_finalizing) -> None:
        # the lease died (its last tensor was freed), in whichever thread freed it (the
        # training loop's, dropping a batch: the memory back in the pool, for take_array
        # as a ready (tensor, array) pair)
        entry = self._leased.pop(id(ref), None)
        if entry is None:  # dropped by clear() while ready
            return
        mm, layout = entry[1], entry[2]
        mapped = type(mm) is not bytearray
        if layout is not None:  # take_array's: made ready, `refill` at a time, or dropped
            todo = None
            with self._lock:
                if (self._closed or self._clearing or _finalizing()
                        or len(self._ready.get(layout, ())) >= self.max_free):
                    if mapped:  # (unmapped once this last reference goes)
                        self.mapped_bytes -= len(mm)
                    return
                back = self._back.setdefault(layout, [])
                back.append(mm)
                if len(back) >= min(self.refill, self.max_free):
                    # every layout's memory back at once (a batch's image and labels come
                    # back together: made ready in the same free, only the first pair cold)
                    todo, self._back = self._back, {}
            if todo is not None:
                for each, mms in todo.items():
                    self._make_ready(each, mms)
            return
        new_list = []  # allocated outside the lock
        with self._lock:
            free = (None if self._closed or self._clearing
                    else self._free.setdefault(len(mm), new_list))
            if mapped and free is not None and len(free) < self.max_free:
                free.append(mm)
            elif mapped:  # dropped: unmapped once this last reference goes
                self.mapped_bytes -= len(mm)

    def _make_ready(self, layout, todo: list) -> None:
        """``todo``'s memory (back from take_array leases of ``layout``) as ready pairs, made
        outside the lock, one after the other: only the first ``np.ndarray`` and
        ``torch.from_numpy`` of a batch's free run cold (after a wait, 15 and 49 us in a loop
        thread on this 2-core VM; the next ones 3 and 2, measured 2026-12-03), so making
        ``refill`` pairs each ``refill`` batches costs the batch about a ``refill``-th of it
        (issue 31). Called by :meth:`_returned` only, which calls it for no memory while
        Python shuts down (module globals are gone then)."""
        pairs = []
        for mm in todo:
            a = self._leased_view(mm, layout)
            pairs.append((torch.from_numpy(a), a))
        with self._lock:  # (checked again: a close() or other returns meanwhile)
            ready = self._ready.setdefault(layout, [])
            if not (self._closed or self._clearing):
                keep = max(0, self.max_free - len(ready))  # (the rest: unmapped)
                ready.extend(pairs[:keep])
                del pairs[:keep]
        del pairs  # (those not kept die here, outside the lock: their leases come back and
        # are dropped, as the pool is full or closed)

    def idle_bytes(self) -> int:
        """Bytes held by idle mapped buffers (ready pairs included)."""
        with self._lock:
            return (sum(len(m) for free in self._free.values() for m in free) +
                    sum(a.nbytes for ready in list(self._ready.values()) for _, a in list(ready)
                        if a.nbytes >= MIN_POOLED_BYTES) + self._back_bytes())

    def _back_bytes(self) -> int:
        """Bytes of mapped memory back from take_array leases and not made ready yet (caller
        holds the lock)."""
        return sum(len(m) for back in self._back.values() for m in back
                   if type(m) is not bytearray)

    def clear(self, close: bool = False) -> None:
        """Drop the idle buffers (their memory goes back to the OS); ``close=True`` also stops
        taking freed buffers back."""
        with self._lock:
            self._closed = self._closed or close
            self.mapped_bytes -= sum(len(m) for free in self._free.values() for m in free)
            self._free.clear()
            self.mapped_bytes -= self._back_bytes()
            self._back.clear()
            ready, self._ready = self._ready, {}
            self._clearing = True
            try:
                del ready  # the ready pairs' leases die here: _returned unmaps them
            finally:
                self._clearing = False

    def __reduce__(self):
        return (BufferPool, (self.max_free, self.refill))


class _Owned(threading.local):
    # Tensors allocated for the batch being built in this thread (strong references, so their
    # memory cannot be freed and reused while the batch is built), or None outside a scope.
    buffers: list | None = None
    pool = None  # the loader's BufferPool for large CPU buffers, if any


_owned = _Owned()


def thread_state() -> _Owned:
    """This module's per-thread state (a ``threading.local``: ``buffers``, ``pool``), for
    :class:`kuat.engine.fetch_scope.FetchScope`, which sets it as :class:`batch_scope` does
    together with the fetch's other settings. Internal."""
    return _owned


class batch_scope:  # noqa: N801 (used like a function: ``with batch_scope():``)
    """Context in which :func:`new_batch_buffer` allocations count as the batch's own.

    Nestable; thread-local. Opened by the loader's workers around one batch's fetch and
    collate; buffers allocated outside any scope are never returned without a copy. ``pool``
    (a :class:`BufferPool`, the loader's): large CPU buffers come from it and go back to it
    when the batch and every view of it are freed.
    """

    __slots__ = ("_prev", "_pool")

    def __init__(self, pool=None):
        self._pool = pool

    def __enter__(self):
        self._prev = (_owned.buffers, _owned.pool)
        _owned.buffers, _owned.pool = [], self._pool
        return self

    def __exit__(self, *exc) -> None:
        _owned.buffers, _owned.pool = self._prev


def own_batch_buffer(t: torch.Tensor) -> torch.Tensor:
    """Declare ``t`` (freshly allocated for this batch, referenced by nothing the user holds)
    the batch's own, so that collating consecutive views of it returns a view; returns ``t``."""
    owned = _owned.buffers
    if owned is not None:
        owned.append(t)
    return t


def new_batch_buffer(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, owned by the current batch (see
    :class:`batch_scope`): the collate returns views of it without copying. Inside a scope with
    a pool, a CPU buffer of at least :data:`MIN_POOLED_BYTES` is a reused one (uninitialised,
    as ``torch.empty``'s)."""
    pool = _owned.pool
    if pool is not None and (device is None or torch.device(device).type == "cpu"):
        shape = tuple(map(int, shape))
        nbytes = dtype.itemsize * math.prod(shape)
        if nbytes >= MIN_POOLED_BYTES:
            raw = torch.from_numpy(pool.take(nbytes))  # (nbytes,) uint8, keeps the lease alive
            t = (raw if dtype is torch.uint8 else raw.view(dtype)).view(shape)
            owned = _owned.buffers  # (own_batch_buffer, inlined: once per batch)
            if owned is not None:
                owned.append(t)
            return t
    return own_batch_buffer(torch.empty(shape, dtype=dtype, device=device))


def new_batch_array(shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
    """``(t, a)``: ``t = new_batch_buffer(shape, torch.uint8)`` (on the CPU) and ``a`` its
    NumPy array, the same memory: what a batch filled by NumPy or C code writes into, without
    a tensor view and a ``.numpy()`` call per batch (a pooled buffer is shaped as an array,
    then wrapped once). ``shape``: a tuple of ints, e.g. ``(B, 3, H, W)``."""
    pool = _owned.pool
    nbytes = math.prod(shape)
    if pool is not None and nbytes >= MIN_POOLED_BYTES:
        t, a = pool.take_array(shape)  # (a ready pair: no torch call here)
        owned = _owned.buffers
        if owned is not None:
            owned.append(t)
        return t, a
    t = new_batch_buffer(shape, torch.uint8)
    return t, t.numpy()


def has_batch_buffers() -> bool:
    """Whether this thread's open scope has allocated (or been given) any buffer."""
    return bool(_owned.buffers)


def is_batch_buffer(ptr: int) -> bool:
    """Whether the storage at data pointer ``ptr`` is a buffer of the batch being built in this
    thread (``tensor.untyped_storage().data_ptr()``)."""
    owned = _owned.buffers
    return bool(owned) and any(t.untyped_storage().data_ptr() == ptr for t in owned)
