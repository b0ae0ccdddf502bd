"""What a manifest may name, and how a name becomes a file: the trust rule of a kuat dataset
(``docs/format.md``, "Trust").

Datasets are untrusted input (they are downloaded from shared buckets and hubs): every name a
manifest gives is checked by :func:`check_member_name` when the manifest is parsed, and turned
into something to open, link, copy or delete by :func:`member_path` and nothing else, so no
manifest can make kuat read, link or write a file outside its own dataset.
:func:`check_regular_file` refuses a FIFO, device or directory before it is opened.
"""

from __future__ import annotations

import os
import re
import stat

from kuat.errors import FormatError

__all__ = ["MANIFEST_NAME", "check_member_name", "member_path", "check_regular_file"]

# the one name every dataset holds, which no manifest gives (and errors show)
MANIFEST_NAME = "manifest.json"

# POSIX's portable file name characters: no separators other than "/", no "%" (URL-decoded into
# "../" by some servers), no ":" (schemes, Windows drives), no "\\" (Windows separators), no
# NUL or control characters, no look-alike Unicode (a name shown to a user is the name opened).
_NAME_PART = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_MAX_NAME_CHARS = 1024  # S3's key limit; local file systems allow 4096 per path
_MAX_PART_CHARS = 255  # NAME_MAX of every common local file system
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def check_member_name(name: object, *, where: str = "manifest") -> str:
    """The rule for what a manifest may name: a relative path below the dataset root.

    Allowed: ``/``-separated parts of POSIX portable characters (``A-Z a-z 0-9 . _ -``), each
    part 1-255 characters and not starting with ``.`` (so never ``.`` or ``..``, nor the
    writer's hidden temporary files), at most 1024 characters in all. Hence never absolute
    (``/x``, ``C:\\x``), never a URL or scheme (``http://127.0.0.1/x``, ``file:x``), never
    ``..``, ``%2e%2e`` or ``\\``, never NUL, control or non-ASCII characters. The same rule holds
    for a local directory and for a URL prefix: a name that passes is a key below the prefix.

    Args:
        name: the value read from the manifest (any JSON value).
        where: the manifest and field, for the error (``"manifest /d/manifest.json: shard 3
            'file'"``).

    Returns:
        ``name``, unchanged.

    Raises:
        kuat.FormatError: ``name`` breaks the rule; the message names ``where`` and the value.
    """
    if not isinstance(name, str):
        raise FormatError(f"{where} must be a string, got {type(name).__name__} {name!r:.80}")
    ok = (
        0 < len(name) <= _MAX_NAME_CHARS
        and name.isascii()
        and all(
            len(part) <= _MAX_PART_CHARS and _NAME_PART.fullmatch(part) for part in name.split("/")
        )
    )
    if not ok:
        raise FormatError(
            f"{where} is {name!r:.200}: a shard must be named by a relative path below the "
            "dataset root made of A-Z a-z 0-9 . _ - and '/' (no absolute path, URL, '..', "
            "leading '.', or other characters); refusing to read outside the dataset"
        )
    return name


def member_path(root: str | os.PathLike, name: object, *, where: str | None = None) -> str:
    """The path or URL of the file ``name`` of the dataset at ``root``; the only way kuat turns
    a name read from a manifest into something to open, link, copy or delete.

    ``name`` must pass :func:`check_member_name`. For a local ``root`` (a path or a
    ``file://`` URL) the file is also resolved through symbolic links, which must stay inside
    the resolved root (a link to a file inside the dataset is fine). For any other URL
    (``s3://bucket/train.kuat``) the result is ``root`` + ``/`` + ``name``: a key below the
    dataset's prefix on the same host and bucket.

    Args:
        root: the dataset directory or URL prefix.
        name: the shard (or other member) name read from the manifest.
        where: what to name in the error; by default ``"<root>/manifest.json: 'file'"``.

    Returns:
        ``os.path.join(root, name)`` (the unresolved path, as a string) locally, the joined URL
        remotely.

    Raises:
        kuat.FormatError: ``name`` breaks the rule, or resolves outside ``root`` through a
            symbolic link (names the link, its target and the root).

    Thread-safety: safe; it reads only the file system's links.
    """
    root = os.fspath(root)
    remote = _URL.match(root) is not None and not root.startswith("file://")
    if where is None:
        where = f"manifest {_join(root, MANIFEST_NAME, remote)}: 'file'"
    check_member_name(name, where=where)
    if remote:
        return _join(root, name, remote)
    local_root = root[len("file://") :] if root.startswith("file://") else root
    path = os.path.join(local_root, name)
    real_root = os.path.realpath(local_root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root or real == real_root:
        raise FormatError(
            f"{where} is {name!r}, a symbolic link that resolves to {real}, outside the dataset "
            f"root {real_root}; refusing to read outside the dataset",
            path=path,
        )
    return path


def _join(root: str, name: str, remote: bool) -> str:
    return f"{root.rstrip('/')}/{name}" if remote else os.path.join(root, name)


def check_regular_file(path: str, what: str) -> os.stat_result:
    """``os.stat(path)``, refusing anything but a regular file: opening a FIFO named by a
    (corrupt or crafted) manifest would block forever, a directory or device is no shard.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        OSError: it cannot be stat'ed.
        kuat.FormatError: it is not a regular file (names it).
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{what} {path} is not a regular file", path=path)
    return st
