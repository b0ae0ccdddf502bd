"""The file-system seam of ``kuat.format``: local paths or fsspec URLs, and retries.

Every file a kuat dataset consists of is reached through here:

* a local path (``"train.kuat"``, ``Path(...)``) or a ``file://`` URL stays a local path: shards
  are memory-mapped in place (the fast path; nothing is copied);
* any other URL (``s3://bucket/train.kuat``, ``gs://``, ``az://``, ``http(s)://``,
  ``memory://``) is a :class:`Remote`: an fsspec file system plus the dataset's root below it.
  Storage options (credentials, ``endpoint_url``, ``anon``, ...) are passed as fsspec users pass
  them, ``storage_options={"endpoint_url": ...}``, or come from the backend's own environment
  (``AWS_*`` variables for ``s3://``). Remote shards are read through
  :class:`kuat.format.cache.ShardCache`.

Remote calls go through :func:`retry`: transient errors (a dropped connection, a timeout, a
throttling reply) are retried with exponential backoff and jitter; a persistent one is raised as
:class:`kuat.errors.RemoteError` naming what was attempted and the URL, with the last error
chained.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kuat.errors import FormatError, MissingDependencyError, RemoteError, require

__all__ = [
    "Remote",
    "RemoteError",
    "is_url",
    "local_path",
    "open_remote",
    "download",
    "retry",
    "RETRY_ATTEMPTS",
]

log = logging.getLogger("kuat.format.fs")

_T = TypeVar("_T")
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

# fsspec backends that are separate packages: scheme -> what to `pip install`
_BACKENDS = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "http": "aiohttp",
    "https": "aiohttp",
    "hf": "huggingface_hub",
}

# Retries of one remote call: 5 attempts, 0.2 s doubling to at most 5 s between them, so a
# persistent failure is reported after about 3 s (s3fs and botocore retry inside each attempt
# too). Overridable by KUAT_REMOTE_RETRIES for slow links.
RETRY_ATTEMPTS = 5
_BASE_DELAY_S = 0.2
_MAX_DELAY_S = 5.0


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL kuat reads through fsspec (any scheme but ``file://``)."""
    if not isinstance(path, str):
        return False
    m = _URL.match(path)
    return m is not None and m.group(1).lower() != "file"


def local_path(path: str | os.PathLike) -> str:
    """``path`` as a local path string (``file:///d/x`` -> ``/d/x``); a remote URL is refused.

    Raises:
        ValueError: ``path`` is a remote URL.
    """
    path = os.fspath(path)
    if is_url(path):
        raise ValueError(f"{path!r} is a remote URL, not a local path")
    if path.lower().startswith("file://"):
        return path[len("file://") :]
    return path


def _import_fsspec():
    return require("fsspec", extra="remote", needed_for="reading and writing URLs")


@dataclass(frozen=True)
class Remote:
    """A dataset root (or a single file) at a URL: an fsspec file system and its path there.

    Attributes:
        url: the URL as given, without a trailing ``/`` (``s3://bucket/train.kuat``).
        fs: the ``fsspec.AbstractFileSystem`` (picklable; rebuilt from its options in a
            worker process).
        path: ``url`` in the file system's own terms (``bucket/train.kuat``).
        storage_options: what ``fs`` was made with (kept for messages and copies).

    Thread-safety: fsspec file systems may be shared by threads.
    """

    url: str
    fs: Any = field(repr=False)
    path: str
    storage_options: Mapping = field(default_factory=dict, repr=False)

    def url_of(self, name: str) -> str:
        """The URL of the member ``name`` (already checked by ``member_path``)."""
        return f"{self.url}/{name}"

    def path_of(self, name: str) -> str:
        """The file-system path of the member ``name``."""
        return f"{self.path.rstrip('/')}/{name}"


def open_remote(url: str, storage_options: Mapping | None = None) -> Remote:
    """Resolve ``url`` to a :class:`Remote` (``fsspec.url_to_fs(url, **storage_options)``).

    Raises:
        ImportError: fsspec, or the backend of the URL's scheme, is not installed (names the
            package to install: ``s3fs`` for ``s3://``, ``gcsfs`` for ``gs://``, ``adlfs`` for
            ``az://``, ``aiohttp`` for ``http(s)://``).
        TypeError: ``storage_options`` is not a mapping.
        ValueError: the scheme is unknown to fsspec.
    """
    if storage_options is None:
        storage_options = {}
    if not isinstance(storage_options, Mapping):
        raise TypeError(
            f"storage_options must be a dict of fsspec options, got "
            f"{type(storage_options).__name__}"
        )
    fsspec = _import_fsspec()
    scheme = _URL.match(url).group(1).lower()
    url = url.rstrip("/")
    options = dict(storage_options)
    if scheme in ("s3", "s3a"):
        # one retry layer, kuat's (bounded, logged): s3fs and botocore would each retry
        # again inside every attempt (a closed port took ~35 s to report instead of ~3 s)
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
        config.setdefault("connect_timeout", 10)
        options["config_kwargs"] = config
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        package = _BACKENDS.get(scheme, f"the fsspec backend for {scheme}://")
        raise MissingDependencyError(
            f"cannot open {url}: {scheme}:// needs the {package} package, which is not "
            f"installed (pip install {package})",
            name=getattr(e, "name", None),
            extra="remote",
        ) from e
    except ValueError as e:
        if "Protocol not known" in str(e) or "not known" in str(e):
            raise ValueError(f"cannot open {url}: fsspec knows no {scheme}:// file system") from e
        raise
    if scheme in ("s3", "s3a") and hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's own retry loop (a class attribute, no constructor option)
    return Remote(url, fs, path, dict(storage_options))


# -- retries ----------------------------------------------------------------------------------
_PERMANENT = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
    FormatError,
    ValueError,
    TypeError,
    ImportError,
)


def is_transient(e: BaseException) -> bool:
    """Whether retrying may help: connection, timeout and throttling errors (fsspec backends
    raise ``OSError`` subclasses, ``TimeoutError`` or their client library's errors for these);
    not a missing file, a refused permission or bad data."""
    if isinstance(e, _PERMANENT):
        return False
    status = getattr(e, "status", None)  # an HTTP reply (aiohttp.ClientResponseError)
    if isinstance(status, int):
        return status in (408, 429) or status >= 500  # timeout, throttling, server errors
    if isinstance(e, (OSError, TimeoutError, ConnectionError)):
        return True
    name = type(e).__name__
    # aiohttp.ClientError, botocore's EndpointConnectionError / ReadTimeoutError, throttling
    return any(s in name for s in ("Connect", "Timeout", "ClientError", "Throttl", "SlowDown"))


def retry(
    fn: Callable[[], _T],
    *,
    what: str,
    url: str,
    attempts: int | None = None,
) -> _T:
    """``fn()``, retried on transient errors with exponential backoff (0.2 s doubling, at most
    5 s, jittered by up to half) for ``attempts`` tries (``KUAT_REMOTE_RETRIES``, default 5).

    Raises:
        RemoteError: a transient error persisted through every attempt, naming ``what``,
            ``url`` and the attempts; the last error is chained.
        Exception: a permanent error (``FileNotFoundError``, ``PermissionError``, a
            ``FormatError`` ...) is re-raised at once, unchanged.
    """
    if attempts is None:
        attempts = int(os.environ.get("KUAT_REMOTE_RETRIES", RETRY_ATTEMPTS))
    attempts = max(1, attempts)
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                if hasattr(e, "add_note") and url not in str(e):  # 3.11+: name the URL without changing the type
                    # (a backend's NoCredentialsError says nothing of which URL it was for)
                    e.add_note(f"kuat: {what} {url}")
                raise
            if attempt == attempts:
                raise RemoteError(
                    f"{what} {url} failed after {attempts} attempts: {type(e).__name__}: {e}",
                    url=url,
                ) from e
            delay = min(_MAX_DELAY_S, _BASE_DELAY_S * 2 ** (attempt - 1))
            delay *= 1 - random.random() / 2  # jitter: readers retrying together spread out
            log.warning(
                "%s %s failed (%s: %s); retry %d/%d in %.2f s",
                what, url, type(e).__name__, e, attempt, attempts - 1, delay,
            )  # fmt: skip
            time.sleep(delay)  # backoff, not synchronisation
    raise AssertionError("unreachable")


def download(url: str, directory: str | os.PathLike, storage_options: Mapping | None = None) -> str:
    """Download the file at ``url`` into ``directory`` (with :func:`retry`), keeping its base
    name; returns the local path (a source file to parse, not a shard: shards go through
    :class:`kuat.format.cache.ShardCache`).

    Raises:
        FileNotFoundError: nothing at ``url`` (names it).
        RemoteError: the download failed after retries.
    """
    remote = open_remote(url, storage_options)
    name = url.rstrip("/").rsplit("/", 1)[-1] or "file"
    local = os.path.join(os.fspath(directory), name)
    n = 1
    while os.path.exists(local):  # two sources with one base name
        local = os.path.join(os.fspath(directory), f"{n}-{name}")
        n += 1
    try:
        retry(lambda: remote.fs.get_file(remote.path, local), what="downloading", url=url)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"no such file: {url}") from e
    return local
