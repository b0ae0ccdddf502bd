"""The exceptions kuat raises. Every one derives from :class:`KuatError`.

Errors carry their location (file or shard path, row, sample index, worker name) both in the
message and as attributes, so that a training script can log or act on them, and they chain the
original exception (``raise ... from e``).
"""

from __future__ import annotations

import importlib

__all__ = [
    "KuatError",
    "FormatError",
    "SchemaError",
    "DecodeError",
    "WorkerError",
    "LoaderTimeoutError",
    "SharedMemoryError",
    "RemoteError",
    "MissingDependencyError",
    "require",
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


class WorkerError(KuatError, RuntimeError):
    """A worker failed with an exception whose type could not be rebuilt in the consumer, or a
    worker process died (a crash, a signal: ``stage`` is then ``""``).

    A ``RuntimeError`` as well, because that is what torch's DataLoader raises for both (its
    ``ExceptionWrapper`` falls back to ``RuntimeError``; a dead worker raises ``RuntimeError:
    DataLoader worker (pid N) is killed by signal: ...``): ``except RuntimeError`` in an
    existing training script keeps working.

    Attributes:
        original_type: qualified name of the original exception type.
        worker: name of the worker thread or process.
        indices: the sample indices of the batch being fetched, or ``None``.
        worker_traceback: the formatted traceback from the worker.
        stage: what the worker was doing: ``"worker_init_fn"``, ``"fetch"`` (the dataset),
            ``"collate_fn"``, ``"pin_memory"``, ``"send"`` (handing the batch over), or
            ``""`` when unknown (a worker that died).
    """

    def __init__(
        self,
        message: str,
        *,
        original_type: str = "",
        worker: str = "",
        indices: list[int] | None = None,
        worker_traceback: str = "",
        stage: str = "",
    ):
        super().__init__(message)
        self.original_type = original_type
        self.worker = worker
        self.indices = indices
        self.worker_traceback = worker_traceback
        self.stage = stage


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


class MissingDependencyError(KuatError, ModuleNotFoundError):
    """An optional package that a feature needs is not installed.

    A ``ModuleNotFoundError`` (so ``except ImportError`` keeps working) whose message names the
    feature, the package and the ``pip install 'kuat[extra]'`` that brings it; the ``kuat``
    command prints it as one line instead of a traceback.

    Attributes:
        name: the top-level package that failed to import (``"ray"`` for ``ray.data``).
        extra: the kuat extra that installs it (``"text"``, ``"remote"``, ...).
    """

    def __init__(self, message: str, *, name: str | None = None, extra: str | None = None):
        super().__init__(message)
        self.name = name
        self.extra = extra


def require(module: str, *, extra: str, needed_for: str):
    """Import and return ``module``, or raise :class:`MissingDependencyError` naming it.

    Args:
        module: the module to import (``"tokenizers"``, ``"ray.data"``).
        extra: the kuat extra that installs it (``pip install 'kuat[<extra>]'``).
        needed_for: what needs it, for the message (``"kuat.text.corpus.train_bpe"``).

    Raises:
        MissingDependencyError: ``module`` (or a package it imports) is not installed; chains
            the original ``ModuleNotFoundError``. Other import failures (a broken install)
            propagate unchanged.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = (e.name or module).partition(".")[0]  # the package to install
        raise MissingDependencyError(
            f"{needed_for} needs the {missing!r} package, which is not installed: "
            f"pip install 'kuat[{extra}]'",
            name=missing,
            extra=extra,
        ) from e
