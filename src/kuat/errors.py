"""The exceptions kuat raises. Every one derives from :class:`KuatError`.

Errors carry their location (file or shard path, row, sample index, worker name) both in the
message and as attributes, so that a training script can log or act on them, and they chain the
original exception (``raise ... from e``).
"""

from __future__ import annotations

__all__ = [
    "KuatError",
    "FormatError",
    "SchemaError",
    "DecodeError",
    "WorkerError",
    "LoaderTimeoutError",
    "SharedMemoryError",
]


class KuatError(Exception):
    """Base class of every error kuat raises on purpose."""


class FormatError(KuatError):
    """A kuat dataset on disk is missing, truncated, corrupt or of an unknown version.

    Attributes:
        path: the manifest or shard path concerned, or ``None``.
        row: the row within the shard, or ``None`` when the whole file is concerned.
    """

    def __init__(self, message: str, *, path: object = None, row: int | None = None):
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.row = row


class SchemaError(KuatError, ValueError):
    """A value or a schema does not match what a dataset declares.

    Attributes:
        field: the field name concerned, or ``None``.
    """

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class DecodeError(KuatError, ValueError):
    """Image bytes could not be decoded (truncated, corrupt, not an image, or too large).

    Attributes:
        index: the sample index in its dataset, or ``None`` when unknown.
        source: the file or shard path the bytes came from, or ``None``.
    """

    def __init__(self, message: str, *, index: int | None = None, source: object = None):
        super().__init__(message)
        self.index = index
        self.source = None if source is None else str(source)


class WorkerError(KuatError):
    """A worker failed with an exception whose type could not be rebuilt in the consumer.

    Attributes:
        original_type: qualified name of the original exception type.
        worker: name of the worker thread or process.
        indices: the sample indices of the batch being fetched, or ``None``.
        worker_traceback: the formatted traceback from the worker.
    """

    def __init__(
        self,
        message: str,
        *,
        original_type: str = "",
        worker: str = "",
        indices: list[int] | None = None,
        worker_traceback: str = "",
    ):
        super().__init__(message)
        self.original_type = original_type
        self.worker = worker
        self.indices = indices
        self.worker_traceback = worker_traceback


class LoaderTimeoutError(KuatError, RuntimeError, TimeoutError):
    """The loader waited longer than its ``timeout`` (seconds) for a batch.

    A ``RuntimeError`` as well, because that is what torch's DataLoader raises on a time-out:
    ``except RuntimeError`` in an existing training script keeps working.
    """


class SharedMemoryError(KuatError, OSError):
    """Shared memory (``/dev/shm``) is too small or unavailable for process workers."""


class RemoteError(KuatError, OSError):
    """A remote read or write (``s3://``, ``http://``, ...) failed persistently, after retries.

    Attributes:
        url: the URL concerned.
    """

    def __init__(self, message: str, *, url: str | None = None):
        super().__init__(message)
        self.url = url
