"""The dataset directory's layout: which names are the dataset's, the writer lock, and clearing
a directory (or URL prefix) before a dataset is written into it.

A kuat dataset directory holds ``manifest.json`` and ``shard-NNNNN.arrow`` files. While a
dataset is being written it also holds temporary files (``.shard-NNNNN.arrow.tmp-<pid>``,
``.manifest.json.tmp-<pid>``), renamed into place once complete, and the writer lock
(``.kuat-writer.lock``, not part of the dataset). :class:`kuat.Writer` and
:func:`kuat.format.merge.merge` both write datasets, so both follow the rules here: what a
dataset's file is called, what may be deleted before writing (the old manifest's shards and the
leftovers of an interrupted write, never anything else), and who may write (one writer per
directory at a time).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from pathlib import Path

from kuat.errors import FormatError
from kuat.format.fs import Remote, retry
from kuat.format.manifest import read_manifest
from kuat.format.members import MANIFEST_NAME, member_path

__all__ = [
    "LOCK_NAME",
    "shard_name",
    "temporary_path",
    "is_shard_file",
    "foreign_names",
    "check_writable",
    "clear_directory",
    "remove_leftovers",
    "lock_directory",
    "unlock_directory",
    "prepare_remote",
]

# the writer's logger: taking the lock is the first step of a write
log = logging.getLogger("kuat.format.writer")

# a dataset's shards, and the temporary files of a write in progress (or interrupted)
_SHARD_RE = re.compile(
    r"^(shard-\d{5,}\.arrow|\.shard-\d{5,}\.arrow\.tmp.*|\.manifest\.json\.tmp.*)$"
)

# held (flock) by the one Writer writing into a directory; not part of the dataset
LOCK_NAME = ".kuat-writer.lock"


def shard_name(i: int) -> str:
    """The file name of shard ``i`` of a dataset kuat writes: ``shard-00000.arrow``."""
    return f"shard-{i:05d}.arrow"


def temporary_path(final: Path) -> Path:
    """Where a file bound for ``final`` is written before it is renamed into place:
    ``.<name>.tmp-<pid>`` beside it (hidden, so no manifest can name it, and cleared by
    :func:`remove_leftovers` if the write is interrupted)."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def is_shard_file(name: str) -> bool:
    """Whether ``name`` (a directory entry) is a shard or a temporary file of a write, which a
    new write into the directory may delete."""
    return _SHARD_RE.match(name) is not None


def foreign_names(directory: Path) -> list[str]:
    """The entries of ``directory`` that are neither a shard, a write's temporary file nor
    the writer lock: files a write must not delete without ``overwrite``."""
    return [
        e.name for e in os.scandir(directory) if not is_shard_file(e.name) and e.name != LOCK_NAME
    ]


def _dataset_exists(where: object) -> FileExistsError:
    return FileExistsError(
        f"{where} is already a kuat dataset; pass overwrite=True (--overwrite) to replace it"
    )


def _not_a_dataset(where: object, first: str) -> FileExistsError:
    return FileExistsError(
        f"{where} is a non-empty directory that is not a kuat dataset ({first!r}, ...); "
        "pass overwrite=True (--overwrite) to write into it anyway"
    )


def check_writable(directory: Path, overwrite: bool) -> None:
    """Refuse to write a dataset into ``directory`` (which need not exist) unless
    ``overwrite``: it is a dataset, or a non-empty directory holding other files. Changes
    nothing.

    Raises:
        FileExistsError: as above, naming ``directory`` (and the first other file).
    """
    if overwrite:
        return
    if (directory / MANIFEST_NAME).exists():
        raise _dataset_exists(directory)
    if directory.is_dir():
        others = foreign_names(directory)
        if others:
            raise _not_a_dataset(directory, others[0])


def clear_directory(directory: Path, overwrite: bool) -> None:
    """Make the existing ``directory`` ready for a new dataset: refuse as
    :func:`check_writable` does, else delete the old manifest (first: from then on the
    directory is no longer a dataset), the shards it names inside the directory, and the
    leftovers of an interrupted write. Other files are left where they are.

    Raises:
        FileExistsError: see :func:`check_writable`.
    """
    check_writable(directory, overwrite)
    manifest = directory / MANIFEST_NAME
    if manifest.exists():  # only with overwrite
        try:
            old = [s.file for s in read_manifest(directory).shards]
        except FormatError:
            old = []
        manifest.unlink()  # from here on the directory is no longer a dataset
        for name in old:
            try:  # never delete outside the dataset, whatever the old manifest says
                path = member_path(directory, name)
            except FormatError:
                continue
            if os.path.isfile(path) or os.path.islink(path):
                os.unlink(path)
    remove_leftovers(directory)


def remove_leftovers(directory: Path) -> None:
    """Delete the shards and temporary files in ``directory`` (the leftovers of an interrupted
    write, or an old dataset's shards)."""
    for e in os.scandir(directory):
        if is_shard_file(e.name) and e.is_file():
            os.unlink(e.path)


def lock_directory(directory: Path) -> int | None:
    """Take ``directory``'s writer lock (an exclusive ``flock`` on ``.kuat-writer.lock``).

    Returns:
        the lock's file descriptor, for :func:`unlock_directory`; ``None`` on a file system
        without ``flock`` (some network mounts), where writing goes on unlocked.

    Raises:
        FileExistsError: another Writer or merge holds it (it would delete and rename over
            this one's shards, and this one over its).
    """
    path = directory / LOCK_NAME
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FileExistsError(
                f"another kuat Writer is writing into {directory} (it holds {path}); "
                "wait for it to finish or write elsewhere"
            ) from None
        except OSError as e:
            os.close(fd)
            log.debug("cannot lock %s (%s); writing without a lock", path, e)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder removed the file between our open and lock: again
    raise FileExistsError(f"cannot take the writer lock {path}")


def unlock_directory(directory: Path, fd: int | None) -> None:
    """Release a lock from :func:`lock_directory` (removing the file first, which the
    inode check there relies on)."""
    if fd is None:
        return
    try:
        os.unlink(directory / LOCK_NAME)
    except OSError:
        pass
    os.close(fd)


def prepare_remote(remote: Remote, overwrite: bool) -> None:
    """The remote twin of :func:`clear_directory`: refuse or clear what is at the URL (the old
    manifest first, so no reader sees a mix). Run before anything is written, so an
    unreachable destination fails here, naming the URL.

    Raises:
        FileExistsError: a dataset or other objects are there and ``overwrite`` is False.
        kuat.format.fs.RemoteError: the destination cannot be reached after retries.
    """
    url = remote.url
    fs = remote.fs

    def listing() -> list[str]:
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(remote.path, detail=False)]
        except FileNotFoundError:
            return []

    names = retry(listing, what="listing", url=url)
    if MANIFEST_NAME in names:
        if not overwrite:
            raise _dataset_exists(url)
        try:
            old = [
                s.file for s in read_manifest(url, storage_options=remote.storage_options).shards
            ]
        except FormatError:
            old = []
        manifest = remote.path_of(MANIFEST_NAME)
        retry(lambda: fs.rm_file(manifest), what="deleting the old manifest", url=url)
        names = [n for n in names if n != MANIFEST_NAME] + old
    others = [n for n in names if not is_shard_file(n)]
    if others and not overwrite:
        raise FileExistsError(
            f"{url} is a non-empty prefix that is not a kuat dataset ({others[0]!r}, ...); "
            "pass overwrite=True (--overwrite) to write into it anyway"
        )
    for name in set(n for n in names if is_shard_file(n)):
        key = member_path(url, name)  # never delete outside the dataset's prefix
        try:
            retry(lambda k=key: fs.rm_file(remote.path_of(k[len(url) + 1 :])),
                  what="deleting an old shard", url=key)  # fmt: skip
        except FileNotFoundError:
            pass
