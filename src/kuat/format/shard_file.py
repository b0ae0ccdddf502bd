"""Writing one shard file: checksummed as it is written, variable-length values gathered
straight from their ``bytes`` objects.

A shard of encoded images is mostly one Arrow binary data buffer, the concatenation of every
image's bytes. Building it with ``b"".join`` copies the whole shard once more in memory
(and touches a fresh 128 MiB allocation page by page), and hashing the written file reads it
back: two extra passes over every byte, on the single writer thread, that a plain
"read each file, write it out" copy does not make. Here the data buffer is a *deferred*
placeholder of the right size (allocated, never written or read): when pyarrow's IPC writer
hands it to :class:`ShardFile`, its values are written from the original ``bytes`` objects
with ``os.writev`` (the GIL released), and every byte written is hashed on the way out.

The file is byte-identical to what ``pa.ipc.new_stream`` writes from a joined buffer
(``tests/test_writer.py`` checks it); if pyarrow ever passed the placeholder in another form
(a copy, a slice), :meth:`ShardFile.close` raises instead of leaving a wrong shard.
"""

from __future__ import annotations

import functools
import logging
import os
import struct

import pyarrow as pa

from kuat.errors import FormatError
from kuat.format.manifest import Checksum

__all__ = ["ShardFile", "DEFER_MIN_BYTES", "deferring_works"]

log = logging.getLogger("kuat.format.writer")

# below this a join is cheaper than the bookkeeping (and small buffers may share addresses)
DEFER_MIN_BYTES = 1 << 20
# values per writev call: at most IOV_MAX (1024 on Linux and macOS)
_IOV = 1024


@functools.cache
def deferring_works() -> bool:
    """Whether this pyarrow hands a record batch's body buffers to a Python file as the
    ``pa.Buffer`` objects themselves (what deferring relies on; pyarrow 26 does). Checked
    once per process on a tiny batch; where it does not, shards join their values instead."""
    seen = []

    class _Probe:
        closed = False

        def write(self, data) -> int:
            seen.append(data.address if isinstance(data, pa.Buffer) else None)
            return len(memoryview(data))

        def flush(self) -> None:
            pass

    placeholder = pa.allocate_buffer(64)
    offsets = pa.py_buffer(struct.pack("<2i", 0, 64))
    arr = pa.Array.from_buffers(pa.binary(), 1, [None, offsets, placeholder])
    batch = pa.RecordBatch.from_arrays([arr], names=["x"])
    try:
        with pa.ipc.new_stream(pa.PythonFile(_Probe(), mode="w"), batch.schema) as w:
            w.write_batch(batch)
    except (pa.ArrowException, OSError, TypeError, ValueError) as e:
        log.debug("pyarrow cannot write to a Python file object here (%s); not deferring", e)
        return False
    return seen.count(placeholder.address) == 1


class ShardFile:
    """A write-only binary file for ``pa.ipc.new_stream(pa.PythonFile(shard_file), schema)``.

    Args:
        path: the file to create (truncated if it exists).

    Not thread-safe; one shard, one writer thread.
    """

    closed = False  # read by pa.PythonFile

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._checksum = Checksum()
        self._deferred: dict[int, tuple[list, int]] = {}  # placeholder address -> (values, size)
        self._pos = 0

    def defer(self, values: list, size: int) -> pa.Buffer:
        """A placeholder buffer standing for ``b"".join(values)`` (``size`` bytes, > 0).

        Only its address and size are used: its contents are never read or written.
        """
        buf = pa.allocate_buffer(size)
        self._deferred[buf.address] = (values, size)
        return buf

    # -- the file protocol pyarrow uses ----------------------------------------------------
    def write(self, data) -> int:
        if isinstance(data, pa.Buffer) and data.address in self._deferred:
            values, size = self._deferred[data.address]
            if data.size != size:
                raise FormatError(
                    f"{self.path}: pyarrow wrote {data.size} of a deferred {size}-byte buffer"
                )
            del self._deferred[data.address]
        else:
            values = [data]
        for i in range(0, len(values), _IOV):
            self._writev(values[i : i + _IOV])
        return len(memoryview(data))

    def _writev(self, pieces: list) -> None:
        views = [memoryview(p).cast("B") for p in pieces]
        for v in views:
            self._checksum.update(v)
        while views:
            n = os.writev(self._fd, views)
            self._pos += n
            while views and n >= len(views[0]):  # drop what was written; keep a partial rest
                n -= len(views[0])
                views.pop(0)
            if n:
                views[0] = views[0][n:]

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass  # unbuffered

    # -- ending ----------------------------------------------------------------------------
    def sync(self) -> str:
        """``fsync`` the file and return its checksum (``"xxh3_64:<hex>"``).

        Raises:
            kuat.FormatError: a deferred buffer was never written (the shard would be wrong).
        """
        if self._deferred:
            raise FormatError(
                f"{self.path}: pyarrow did not write {len(self._deferred)} deferred buffer(s) "
                "as handed to it; the shard is not written"
            )
        os.fsync(self._fd)
        return self._checksum.value()

    def close(self) -> None:
        """Close the descriptor. Idempotent."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
            self._deferred.clear()

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
