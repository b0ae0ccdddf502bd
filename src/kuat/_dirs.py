"""Where kuat keeps what it caches on disk: one root, one precedence.

Every cache kuat writes lives under one root, so that ``KUAT_CACHE=/big/disk`` moves all of it:

==========================  ======================================================================
what                        directory (first that applies)
==========================  ======================================================================
the root                    ``$KUAT_CACHE``; ``$XDG_CACHE_HOME/kuat``; ``~/.cache/kuat``
remote shards               ``cache_dir=`` of ``kuat.open``; ``$KUAT_CACHE_DIR`` (the shard directory
                            itself); ``<root>/shards``
demo images and datasets    ``--cache-dir DIR`` (a root: ``DIR/demo``); ``<root>/demo``
``kuat bench`` data         ``--cache-dir DIR``; ``<root>/bench``
``kuat bench`` peer envs    ``$KUAT_BENCH_ENVS``; ``<root>/bench-envs``
==========================  ======================================================================

An empty variable counts as unset (as the XDG Base Directory specification says of
``XDG_CACHE_HOME``), and a leading ``~`` is expanded. A relative ``KUAT_CACHE`` or
``KUAT_CACHE_DIR`` is taken against the working directory at the call and returned absolute
(a process or a peer interpreter that starts elsewhere then still finds the same cache); a
relative ``XDG_CACHE_HOME`` is ignored, as the specification says it must be. Nothing here creates a directory; each
user creates its own when it first writes. Temporary work (conversion and merge staging, upload
buffers) goes to ``tempfile``'s directory (``$TMPDIR``), not to the cache: it is deleted when
the work ends. Process workers' shared memory lives in ``/dev/shm`` (or ``tempfile``'s directory
where there is none), nameless.

This module imports nothing from kuat, so that the format, the CLI and ``benchmarks/`` can all
ask it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root", "shard_cache_dir"]


def _env_path(name: str) -> Path | None:
    """``$name`` as an absolute path (``~`` expanded, a relative one against the working
    directory), or None where it is unset or empty."""
    value = os.environ.get(name)
    return Path(os.path.abspath(Path(value).expanduser())) if value else None


def cache_root() -> Path:
    """kuat's cache root: ``$KUAT_CACHE``, else ``$XDG_CACHE_HOME/kuat`` (where absolute), else
    ``~/.cache/kuat``; an absolute path.

    Read from the environment at each call (a test or a launcher may set it late).
    """
    root = _env_path("KUAT_CACHE")
    if root is not None:
        return root
    xdg = os.environ.get("XDG_CACHE_HOME")
    xdg = Path(xdg).expanduser() if xdg else None
    if xdg is not None and not xdg.is_absolute():
        xdg = None  # "a relative path ... should be considered invalid and ignored" (XDG spec)
    return (xdg if xdg is not None else Path.home() / ".cache") / "kuat"


def shard_cache_dir() -> Path:
    """The default directory of cached remote shards: ``$KUAT_CACHE_DIR`` (the directory
    itself, an explicit override), else ``cache_root() / "shards"``."""
    explicit = _env_path("KUAT_CACHE_DIR")
    return explicit if explicit is not None else cache_root() / "shards"
