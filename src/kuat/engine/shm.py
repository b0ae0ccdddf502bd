"""Shared-memory slots that carry batches from worker processes, and the batch encoding.

A *slot* is an anonymous shared-memory file: ``memfd_create`` on Linux (no name anywhere), else
a file in ``/dev/shm`` that the worker unlinks the moment it has it open. A slot belongs to the
worker that created it and is identified by ``(worker, n)``. The worker creates a slot when a
task comes with none (or one too small: sized for the batch plus 25%), writes the batch into it
and sends the result, then the slot's file descriptor (``SCM_RIGHTS`` over the worker's pipe,
as torch's ``file_descriptor`` sharing strategy does); the consumer maps it and closes the
descriptor. From then on both sides hold a mapping and no name exists, so no death of any
process (SIGKILL of the training process by the out-of-memory killer or a scheduler included)
leaves anything behind: the kernel frees the memory with the last mapping. The consumer hands
each slot back to its worker with a later task once the batch's views are gone, so the pool is
a ring of about ``prefetch_factor`` slots per worker. Space is reserved with
``posix_fallocate`` so that running out of shared memory fails at once with
:class:`kuat.errors.SharedMemoryError` naming the bytes needed (instead of a SIGBUS later).
Memory-file slots are not limited by the size of ``/dev/shm`` (a container's ``--shm-size``).

Encoding: tensors (plain CPU ``torch.Tensor``) and NumPy arrays of numeric dtypes anywhere in
the batch's nested dicts/lists/tuples are written into the slot at 64-byte aligned offsets and
replaced by references; the rest of the structure (small) is pickled over the pipe. Tensor
payloads are never pickled.
"""

from __future__ import annotations

import errno
import glob
import mmap
import os
import re
import tempfile
import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch

from kuat.collate import map_structure
from kuat.errors import SharedMemoryError

__all__ = ["SHM_DIR", "ShmBatch", "SlotWriter", "create", "map_fd", "read_batch", "view_batch",
           "reap_orphans", "unlink_prefix"]

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_ALIGN = 64
_MEMFD = hasattr(os, "memfd_create")
# Arrays smaller than this are copied out of a slot; larger ones are handed out as views of it
# (then the slot is reused only once they are all gone). Copying small fields (labels, lengths)
# means that keeping them, e.g. for metrics, never pins a whole slot.
VIEW_MIN_BYTES = 256 * 1024


def _free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
        return st.f_bavail * st.f_frsize
    except OSError:
        return -1


def _open_anonymous(name: str) -> int:
    """A descriptor of a new, nameless shared-memory file (``name`` is a label only)."""
    if _MEMFD:
        return os.memfd_create(name, os.MFD_CLOEXEC)
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)  # nameless from here on (reap_orphans covers a death in between)
    return fd


def create(name: str, size: int) -> int:
    """A descriptor of a new nameless shared-memory file of ``size`` bytes, reserved up front.

    ``name`` labels it (``/proc/<pid>/fd``); without ``memfd_create`` it is the name the file
    has in :data:`SHM_DIR` for the few microseconds before it is unlinked. The caller closes
    the descriptor.

    Raises:
        SharedMemoryError: less than ``size`` bytes of shared memory are available.
        OSError: the file cannot be created (for example :data:`SHM_DIR` is missing).
    """
    fd = _open_anonymous(name)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                where = "memory" if _MEMFD else f"{SHM_DIR}, {_free_bytes()} bytes free"
                raise SharedMemoryError(
                    f"shared memory is too small: a batch needs {size} bytes "
                    f"({size / 2**20:.1f} MiB) ({where}). Lower batch_size, prefetch_factor or "
                    f"num_workers, enlarge the memory limit (docker: --memory, --shm-size), or "
                    f"use worker_type='thread'"
                ) from e
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            os.ftruncate(fd, size)  # a file system without fallocate
        return fd
    except BaseException:
        os.close(fd)
        raise


def map_fd(fd: int, size: int) -> mmap.mmap:
    """Map ``size`` bytes of shared-memory file ``fd`` (the mapping keeps its own reference)."""
    return mmap.mmap(fd, size)


def unlink_prefix(prefix: str) -> None:
    """Unlink files of :data:`SHM_DIR` named ``<prefix>-*`` (a worker that died between
    creating a slot file and unlinking it, on systems without ``memfd_create``)."""
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "-*")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


_ORPHAN = re.compile(r"kuat-(\d+)-[0-9a-f]+-")


def reap_orphans() -> list[str]:
    """Unlink slot files left by loaders whose process no longer exists; return their names.

    Slots have no name once created, so only a file left by an older kuat (which named its
    slots), or by a worker killed in the microseconds between creating a slot file and
    unlinking it (without ``memfd_create``), can be found. Every new process engine calls this
    first. A file is only removed when no process has the PID in its name (a live process is
    never robbed, even if it reused the PID).
    """
    reaped = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return reaped
    alive: dict[int, bool] = {}
    for name in names:
        m = _ORPHAN.match(name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid not in alive:
            try:
                os.kill(pid, 0)
                alive[pid] = True
            except ProcessLookupError:
                alive[pid] = False
            except PermissionError:  # exists, owned by someone else
                alive[pid] = True
        if not alive[pid]:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                continue
            reaped.append(name)
    return reaped


class _Ref:
    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i

    def __reduce__(self):
        return (_Ref, (self.i,))


class ShmBatch:
    """A batch whose arrays are in slot ``slot`` (``(worker, n)``) of ``size`` bytes;
    ``specs[i] = (kind, offset, dtype, shape, nbytes)``. ``new``: the slot was created for this
    batch, and its descriptor follows the result on the pipe."""

    __slots__ = ("slot", "size", "new", "skeleton", "specs")

    def __init__(self, slot, size, new, skeleton, specs):
        self.slot, self.size, self.new, self.skeleton, self.specs = slot, size, new, skeleton, specs

    def __reduce__(self):
        return (ShmBatch, (self.slot, self.size, self.new, self.skeleton, self.specs))


def _is_shm_array(x) -> bool:
    if type(x) is torch.Tensor:
        return x.device.type == "cpu" and x.layout == torch.strided and not x.is_nested
    return isinstance(x, np.ndarray) and x.dtype.kind in "biufc" and not x.dtype.hasobject


class SlotWriter:
    """Worker side: writes batches into this worker's slots, creating them as needed.

    Keeps a mapping of every slot it created until the slot is replaced by a larger one (the
    consumer never hands a worker a slot of another worker).
    """

    def __init__(self, prefix: str, worker_id: int):
        self._prefix = f"{prefix}-{worker_id}"
        self._worker_id = worker_id
        self._count = 0
        self._maps: dict[tuple[int, int], mmap.mmap] = {}

    def write(self, batch, slot: tuple[tuple[int, int], int] | None) -> tuple[ShmBatch, int | None]:
        """Write ``batch`` into ``slot`` (``(id, size)``, or a new slot when None or too small).

        Returns ``(message, fd)``: ``fd`` is the new slot's descriptor, which the caller sends
        to the consumer after the message and then closes; None when ``slot`` was used.
        """
        arrays = []

        def strip(x):
            if _is_shm_array(x):
                arrays.append(x)
                return _Ref(len(arrays) - 1)
            return x

        skeleton = map_structure(strip, batch)
        specs, off = [], 0
        for a in arrays:
            off = -(-off // _ALIGN) * _ALIGN
            nbytes = a.nbytes if isinstance(a, np.ndarray) else a.numel() * a.element_size()
            kind = "n" if isinstance(a, np.ndarray) else "t"
            specs.append((kind, off, a.dtype, tuple(a.shape), nbytes))
            off += nbytes
        need = max(off, 1)
        fd = None
        if slot is not None and slot[1] >= need:
            sid, size = slot
            mm = self._maps[sid]
        else:
            if slot is not None:  # too small: replaced (the consumer drops it too)
                old = self._maps.pop(slot[0], None)
                if old is not None:
                    old.close()
            self._count += 1
            sid = (self._worker_id, self._count)
            size = -(-(need + need // 4) // 4096) * 4096
            fd = create(f"{self._prefix}-{self._count}", size)
            try:
                mm = self._maps[sid] = map_fd(fd, size)
            except BaseException:
                os.close(fd)
                raise
        for a, (kind, o, _dtype, _shape, nbytes) in zip(arrays, specs):
            if nbytes == 0:
                continue
            if kind == "n":
                dst = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=o)
                dst[:] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            else:
                dst = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=o)
                dst.view(a.dtype).view(a.shape).copy_(a)  # (nbytes,) u8 -> a.shape a.dtype
            del dst
        return ShmBatch(sid, size, fd is not None, skeleton, specs), fd

    def close(self) -> None:
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:
                pass
        self._maps.clear()


def read_batch(msg: ShmBatch, mm: mmap.mmap, pin: bool = False):
    """Consumer side: copy the batch's arrays out of slot mapping ``mm`` (into pinned memory
    if ``pin``)."""
    arrays = [_copy_out(kind, off, dtype, shape, nbytes, mm, pin)
              for kind, off, dtype, shape, nbytes in msg.specs]
    return map_structure(lambda x: arrays[x.i] if isinstance(x, _Ref) else x, msg.skeleton)


def view_batch(msg: ShmBatch, mm: mmap.mmap, on_release: Callable[[], None]):
    """Consumer side, zero-copy: large arrays are views of the slot, small ones are copied.

    ``on_release()`` is called (from whichever thread drops the last one) once no view of the
    slot is alive any more, so the slot can be handed out again; at once if there is none.
    """
    arrays, views = [], []
    for kind, off, dtype, shape, nbytes in msg.specs:
        if nbytes < VIEW_MIN_BYTES:
            arrays.append(_copy_out(kind, off, dtype, shape, nbytes, mm, False))
            continue
        buf = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=off)  # (nbytes,) u8 view
        if kind == "n":
            out = buf.view(dtype).reshape(shape)
        else:
            out = torch.frombuffer(buf, dtype=dtype).view(shape)  # keeps buf alive
        views.append(buf)
        arrays.append(out)
    if views:
        remaining = [len(views)]
        lock = threading.Lock()

        def one_gone():
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                on_release()

        for buf in views:
            weakref.finalize(buf, one_gone)
        del buf, views
    else:
        on_release()
    return map_structure(lambda x: arrays[x.i] if isinstance(x, _Ref) else x, msg.skeleton)


def _copy_out(kind, off, dtype, shape, nbytes, mm, pin):
    if kind == "n":
        out = np.empty(shape, dtype=dtype)
        if nbytes:
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(mm, dtype=np.uint8, count=nbytes,
                                                              offset=off)
        return out
    out = torch.empty(shape, dtype=dtype, pin_memory=pin)
    if nbytes:
        # A NumPy byte copy, not torch's copy_: a copy of more than 32 Ki elements runs on
        # torch's intra-op (OpenMP) pool, whose threads then spin-wait in the consumer process
        # and take a core from the workers (measured: 2 workers on 2 cores, 121 -> 790 batches/s).
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(
            mm, dtype=np.uint8, count=nbytes, offset=off)  # (nbytes,) u8 -> shape dtype
    return out
