"""A converter's input files: which files a source names (:func:`expand_paths`: paths, globs,
URLs), local copies of URLs to parse (:func:`local_copy`, :func:`local_copies`), and errors that
name each file as the user named it, not its temporary copy (:func:`named_as_given`).
"""

from __future__ import annotations

import contextlib
import copy
import glob
import os
import tempfile
from collections.abc import Iterator, Sequence

from kuat.format.fs import download, is_url, open_remote

__all__ = ["expand_paths", "local_copies", "local_copy", "named_as_given"]


def expand_paths(
    paths: str | os.PathLike | Sequence, storage_options: dict | None = None
) -> list[str]:
    """Files named by ``paths`` (a path, a glob, or a list of either; ``str``, ``bytes`` or
    ``os.PathLike``, returned as ``str``), sorted within a glob.
    URLs (``s3://b/*.parquet``, ``http://host/x.csv``) stay URLs; their globs are expanded by
    their fsspec file system (not over HTTP, which cannot list).

    Raises:
        FileNotFoundError: a path does not exist or a glob matches nothing.
    """
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    out = []
    for p in paths:
        p = os.fsdecode(p)  # a bytes path (a name that is not UTF-8) as Python's str for it
        if is_url(p):
            if glob.has_magic(p) and not p.startswith(("http://", "https://")):
                remote = open_remote(p, storage_options)
                protocol = p.split("://", 1)[0]
                matched = sorted(f"{protocol}://{m}" for m in remote.fs.glob(remote.path))
                if not matched:
                    raise FileNotFoundError(f"no file matches {p!r}")
                out.extend(matched)
            else:
                out.append(p)
        elif glob.has_magic(p):
            matched = sorted(glob.glob(p))
            if not matched:
                raise FileNotFoundError(f"no file matches {p!r}")
            out.extend(matched)
        elif os.path.exists(p):
            out.append(p)
        else:
            raise FileNotFoundError(f"no such file: {p}")
    if not out:
        raise FileNotFoundError("no input files given")
    return out


@contextlib.contextmanager
def local_copies(files: list[str], storage_options: dict | None) -> Iterator[list[str]]:
    """``files``, each URL among them downloaded into one temporary directory for the block."""
    with tempfile.TemporaryDirectory(prefix="kuat-sources-") as stage:
        yield [download(f, stage, storage_options) if is_url(f) else f for f in files]


@contextlib.contextmanager
def local_copy(path: str, storage_options: dict | None) -> Iterator[str]:
    """``path`` itself, or a URL downloaded into a temporary directory for the block."""
    if not is_url(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="kuat-sources-") as stage:
        yield download(path, stage, storage_options)


def named_as_given(e: Exception, urls: dict[str, str]) -> Exception | None:
    """``e`` again, its message and ``path``/``source`` naming each URL the user gave where
    they named the temporary local copy it was parsed from (the copy is gone when the error
    is read, and the user never named it); ``None`` when ``e`` names no copy.

    Every parse, inference and conversion error of a staged file passes through here, so no
    error site needs to know whether its file was downloaded."""
    message = str(e)
    copies = [c for c in urls if c in message]
    if not copies:
        return None
    for c in copies:
        message = message.replace(c, urls[c])
    named = copy.copy(e)  # same type and attributes (row, field, index ...)
    named.args = (message, *e.args[1:])
    for attr in ("path", "source"):
        value = getattr(named, attr, None)
        if isinstance(value, str) and value in urls:
            setattr(named, attr, urls[value])
    return named
