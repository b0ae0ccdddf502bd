"""The device stage: pinning, host-to-device copies on a side CUDA stream, batch steps.

:func:`pin_batch` pins every CPU tensor of a batch (same container types as torch's
DataLoader); tensors already on an accelerator (a batch decoded there, e.g. by
``Compose(decode_device="cuda")``) pass through. :class:`DeviceCopier` starts a batch's copy on its own
CUDA stream (``stage``) while the previous batch is in use, and ``wait`` makes the consumer's
current stream wait for that copy only (an event, not a host synchronisation), recording the
tensors on the current stream so the caching allocator does not reuse them early.

After the copy the loader applies the source's batch step (``kuat_batch_transform``, see
:mod:`kuat.sources.protocol`) to the batch where it now lives: :class:`FieldSteps` is the step a
kuat dataset declares for its fused image transforms (``Normalize`` on the ``(B, 3, H, W)``
uint8 image field), so normalisation runs once per batch on the device, not per sample.

Thread-safety: one copier per loader iterator, used from the consumer thread only.
"""

from __future__ import annotations

import copy
import time
from collections import abc
from typing import Any

import torch

from kuat.collate import map_structure

__all__ = ["accelerator_available", "pin_batch", "DeviceCopier", "CopiesAhead", "FieldSteps"]


def accelerator_available() -> bool:
    """Whether pinned memory is useful here (an accelerator is present), as torch decides."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


def pin_batch(batch):
    """Every CPU tensor of ``batch`` in pinned (page-locked) host memory.

    The walk is torch's ``torch.utils.data._utils.pin_memory.pin_memory`` (same order of
    checks: an object's own ``pin_memory()`` method first, then mappings, tuples, namedtuples
    and sequences, rebuilt as torch rebuilds them), except that a tensor on another device
    passes through unchanged where torch raises ``RuntimeError: cannot pin
    'torch.cuda.ByteTensor'``: a batch decoded on the GPU (``Compose(decode_device="cuda")``)
    meets the pinning the loader does whenever ``device`` is CUDA.
    """
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory() if batch.device.type == "cpu" else batch
    if hasattr(batch, "pin_memory"):
        return batch.pin_memory()
    if isinstance(batch, (str, bytes)):
        return batch
    if isinstance(batch, abc.Mapping):
        items = {k: pin_batch(v) for k, v in batch.items()}
        try:
            if isinstance(batch, abc.MutableMapping):
                clone = copy.copy(batch)  # keeps the mapping type's own attributes
                clone.update(items)
                return clone
            return type(batch)(items)
        except TypeError:
            return items
    if isinstance(batch, tuple):
        if hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*(pin_batch(x) for x in batch))
        return type(batch)(pin_batch(x) for x in batch)
    if isinstance(batch, abc.Sequence):
        try:
            if isinstance(batch, abc.MutableSequence):
                clone = copy.copy(batch)
                for i, x in enumerate(batch):
                    clone[i] = pin_batch(x)
                return clone
            return type(batch)([pin_batch(x) for x in batch])
        except TypeError:  # no copy()/__setitem__/__init__(iterable), e.g. range
            return [pin_batch(x) for x in batch]
    return batch


class DeviceCopier:
    """Copies batches to ``device``; on CUDA asynchronously, on a side stream.

    ``stage(batch)`` returns a handle with the copy in flight; ``wait(handle)`` returns the
    batch on ``device``, ordered before later work on the current stream. Tensors should be
    pinned for the copy to be truly asynchronous. Non-tensor leaves pass through.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _to(self, x):
        if isinstance(x, torch.Tensor):
            return x.to(self.device, non_blocking=True)
        return x

    def stage(self, batch):
        if self.stream is None:
            return map_structure(self._to, batch), None, None
        with torch.cuda.stream(self.stream):
            out = map_structure(self._to, batch)  # (B, ...) host -> (B, ...) device, async
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event, batch  # keep the host batch alive until the copy is waited on

    def wait(self, staged):
        out, event, _host = staged
        if event is None:
            return out
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)

        def record(x):
            if isinstance(x, torch.Tensor) and x.device.type == "cuda":
                x.record_stream(current)
            return x

        map_structure(record, out)
        return out


class CopiesAhead:
    """Batches on ``device``, one copy ahead: ``copies(next_batch)`` stages the copy of the
    host batch after the current one (``next_batch()``'s; :class:`DeviceCopier`) before it waits
    for and returns the current one, so a CUDA copy overlaps the training step. Raises
    ``StopIteration`` after the last; an error fetching the batch after the current one is
    raised at the next call. Seconds spent staging and waiting are added to ``stats.device_s``
    under ``stats.lock`` (the loader's ``LoaderStats``). ``next_batch`` is passed at each call,
    not kept: the iterator that owns this object holds no reference cycle through it. Not
    thread-safe (the loop thread's)."""

    def __init__(self, device: torch.device, stats):
        self._copier, self._stats = DeviceCopier(device), stats
        self._staged = self._deferred = None

    def __call__(self, next_batch: abc.Callable[[], Any]):
        if self._deferred is not None:
            exc, self._deferred = self._deferred, None
            raise exc
        if self._staged is None:
            self._staged = self._stage(next_batch())
        current, self._staged = self._staged, None
        try:
            self._staged = self._stage(next_batch())
        except StopIteration:
            pass
        except BaseException as e:
            self._deferred = e
        t0 = time.perf_counter()
        batch = self._copier.wait(current)
        with self._stats.lock:
            self._stats.device_s += time.perf_counter() - t0
        return batch

    def _stage(self, batch):
        t0 = time.perf_counter()
        staged = self._copier.stage(batch)
        with self._stats.lock:
            self._stats.device_s += time.perf_counter() - t0
        return staged


class FieldSteps:
    """A batch step per field of a collated dict batch: ``{field: fn}``, each ``fn`` applied to
    its field's batch where the batch is (on the loader's device after the copy).

    What :attr:`kuat.sources.dataset.Dataset.kuat_batch_transform` returns for fused image
    transforms with a ``batch_transform()`` (``Normalize``: ``(B, 3, H, W)`` uint8 ->
    ``(B, 3, H, W)`` float32 on the same device). Other fields pass through unchanged; the
    input dict is not modified (a new dict is returned).

    Raises:
        TypeError: the batch is not a mapping (a whole-sample transform changed its structure).
    """

    def __init__(self, fns: dict[str, abc.Callable]):
        self.fns = fns

    def __call__(self, batch):
        if not isinstance(batch, abc.Mapping):
            raise TypeError(
                f"kuat_batch_transform expects the collated batch to be a dict with fields "
                f"{sorted(self.fns)}, got {type(batch).__name__} (a whole-sample transform "
                "changed the sample's structure; apply the batch step yourself)"
            )
        batch = dict(batch)
        for name, fn in self.fns.items():
            batch[name] = fn(batch[name])
        return batch

    def __repr__(self) -> str:
        return f"FieldSteps({self.fns!r})"
