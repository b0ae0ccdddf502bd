"""The Ray engine of the converters (``engine="ray"``, ``kuat convert --engine ray``).

The only kuat module that imports Ray (``pip install kuat[ray]``). The converter plans on
the driver as in the local engine (lists the files; a table converter lets Ray tasks infer
each file's column types, :func:`map_on_ray`, and unifies them) and cuts the input into
*parts* (ImageFolder: ``rows_per_task`` consecutive images; tables: one input file); then:

1. one Ray Data task per part runs the converter's own code for that part (``write_part``:
   read, probe, re-encode, the same ``--on-error`` policy) into a :class:`kuat.Writer` of the
   part's own directory: whole shards, then a *part manifest*, written last, which is the
   part's record of being finished (its metadata names the part's inputs and the
   fingerprint of inputs and options, :func:`part_fingerprint`);
2. the driver, once every part exists, assembles the dataset and writes its manifest last:
   O(number of shards), no shard byte is read or rewritten.

Where the parts go depends on the destination:

* a local path (one machine, or a shared file system such as NFS or Lustre mounted at the
  same path on every node): a staging folder beside it (``.<dst name>.kuat-ray/part-NNNNN``,
  the same file system); the driver moves each part's shards into ``dst`` by rename
  (:meth:`kuat.Writer.add_shard`) and deletes the staging folder. The dataset looks exactly
  like one the local engine wrote (``shard-NNNNN.arrow``).
* a URL (``s3://bucket/train.kuat``, any fsspec URL; ``storage_options`` reach the tasks): the
  parts are written *in place*, ``<dst>/part-NNNNN/shard-MMMMM.arrow``, and the manifest
  names them so. Object stores have no rename (a "move" is a server-side copy of every byte
  plus a delete), so deterministic part-based names make assembling free; the names are
  unique because each part has one writer at a time (a retried task rewrites its own part).
  The driver deletes the part manifests once the dataset's manifest is written.

Either way the dataset's manifest comes last, so a reader never sees a partial dataset.

Resume: a rerun of the same conversion (a killed driver, a failed task, an unreadable sample
with ``on_error="raise"``) keeps every part whose record is there, whose fingerprint matches
and whose shards have the recorded sizes; every other part is written again. The result has
the same rows in the same order as an uninterrupted run. ``restart=True`` (``--restart``)
deletes the parts of earlier runs first.

Failures: a part whose write raises ``OSError`` (a storage hiccup) is written again inside
its task, at most ``TASK_RETRIES`` attempts in all; a task whose worker or node dies is
rerun by Ray Data (bounded by ``TASK_RETRIES`` where the installed Ray takes ``max_retries``
as a named ``map_batches`` parameter; Ray Data's default otherwise). A sample that fails
follows ``on_error`` inside its task, as locally.

Progress is Ray Data's own (rows and rows/s per operator, across the cluster); the driver
logs the total rows/s and MB/s at the end.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import pickle
import re
import shutil
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kuat.convert._driver import ConvertOptions, ConvertReport, log_skipped
from kuat.engine.failure import Failure
from kuat.errors import FormatError, KuatError, require
from kuat.format import Schema, Writer
from kuat.format.fs import is_url, local_path, open_remote, retry
from kuat.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    member_path,
    read_manifest,
    write_manifest,
)

__all__ = [
    "convert_on_ray",
    "map_on_ray",
    "part_fingerprint",
    "ray_session",
    "staging_dir",
    "PART_RECORD",
    "TASK_RETRIES",
]

log = logging.getLogger("kuat.convert.ray")

# Attempts at one part: an OSError while writing it (a storage hiccup) is retried inside the
# task, and a dead worker by Ray where it can be bounded. Bounded, unlike Ray Data's default
# of infinite retries: a full disk would otherwise retry forever.
TASK_RETRIES = 3
_RETRY_DELAY_S = 0.5  # backoff before attempt k: 0.5 * (k - 1) s

# the key of a part manifest's metadata that makes it the part's record
PART_RECORD = "kuat.ray.part"

# written where the parts go once a task reports an unreadable sample (on_error="raise"):
# tasks not yet started return at once, so the driver's wait for the running ones is short
_ABORTED = "ABORTED"
_PART_RE = re.compile(r"^part-\d{5,}$")


def staging_dir(dst: str | os.PathLike) -> Path:
    """Where the tasks of a conversion into the local ``dst`` write their parts: a hidden
    sibling of ``dst`` (the same file system, so moving a shard into ``dst`` is a rename)."""
    dst = Path(dst).absolute()
    return dst.parent / f".{dst.name}.kuat-ray"


def _part_name(k: int) -> str:
    return f"part-{k:05d}"


# -- where the parts live -------------------------------------------------------------------
@dataclass(frozen=True)
class _Parts:
    """The folder (local) or prefix (URL) holding the parts of one conversion, and its
    records. Plain data, so it pickles into the tasks; each process opens the file system
    itself."""

    root: str
    storage_options: Mapping | None = None

    @classmethod
    def of(cls, dst: str | os.PathLike, storage_options: Mapping | None) -> _Parts:
        if is_url(os.fspath(dst)):
            return cls(os.fspath(dst).rstrip("/"), dict(storage_options or {}))
        return cls(str(staging_dir(local_path(dst))))  # file:// URLs are local paths

    @property
    def remote(self) -> bool:
        return is_url(self.root)

    def part(self, k: int) -> str:
        return f"{self.root}/{_part_name(k)}"

    def _fs(self):
        r = open_remote(self.root, self.storage_options)
        return r.fs, r.path.rstrip("/")

    def names(self) -> list[str]:
        """The entries directly below the root (none if it does not exist)."""
        if not self.remote:
            try:
                return sorted(os.listdir(self.root))
            except FileNotFoundError:
                return []
        fs, path = self._fs()

        def listing() -> list[str]:
            try:
                fs.invalidate_cache(path)
                return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
            except FileNotFoundError:
                return []

        return retry(listing, what="listing", url=self.root)

    def remove(self, name: str) -> None:
        """Delete the entry ``name`` (a part, recursively; or a marker), if there."""
        if not self.remote:
            p = os.path.join(self.root, name)
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            elif os.path.lexists(p):
                os.unlink(p)
            return
        fs, path = self._fs()

        def rm() -> None:
            try:
                fs.rm(f"{path}/{name}", recursive=True)
            except FileNotFoundError:
                pass

        retry(rm, what="deleting", url=f"{self.root}/{name}")

    def touch(self, name: str) -> None:
        if not self.remote:
            os.makedirs(self.root, exist_ok=True)
            Path(self.root, name).touch()
            return
        fs, path = self._fs()
        retry(
            lambda: fs.pipe_file(f"{path}/{name}", b""), what="writing", url=f"{self.root}/{name}"
        )

    def exists(self, name: str) -> bool:
        if not self.remote:
            return os.path.exists(os.path.join(self.root, name))
        fs, path = self._fs()
        return retry(
            lambda: fs.exists(f"{path}/{name}"), what="checking", url=f"{self.root}/{name}"
        )

    def finished(self, k: int, fingerprint: str) -> tuple[Manifest | None, str]:
        """``(part k's manifest, "")`` if it is a finished part of this conversion: its
        record carries ``fingerprint`` and every shard it lists is there with its recorded
        size. Otherwise ``(None, why)``: ``""`` when there is no record (never written, or
        interrupted before its manifest), else why it cannot be used (other inputs or
        options, shards moved away by an interrupted assembly)."""
        where = self.part(k)
        try:
            m = read_manifest(where, storage_options=self.storage_options or None)
        except FormatError:
            return None, ""
        record = m.metadata.get(PART_RECORD)
        if not isinstance(record, dict) or record.get("fingerprint") != fingerprint:
            return None, f"{where} was written from other inputs or options"
        if self.remote:
            fs, path = self._fs()
            prefix = f"{path}/{_part_name(k)}"
            fs.invalidate_cache(prefix)
            sizes = {
                e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size")
                for e in retry(lambda: fs.ls(prefix, detail=True), what="listing", url=where)
            }
        else:
            sizes = {}
            for info in m.shards:
                try:
                    sizes[info.file] = os.path.getsize(os.path.join(where, info.file))
                except OSError:
                    pass
        missing = [s.file for s in m.shards if sizes.get(s.file) != s.bytes]
        if missing:
            return None, f"{where} lacks shard {missing[0]} (or its size differs)"
        return m, ""


def part_fingerprint(spec: bytes, inputs: Sequence[str]) -> str:
    """The fingerprint a part's record carries: SHA-256 over ``spec`` (what the driver
    decided: the part's description, the schema, the options that shape the shards) and each
    local input file's path, size and modification time (``st_mtime_ns``), so an edited
    input, other options or another cut of the input all change it. A URL input counts by
    its name only. Returns ``"sha256:<64 hex digits>"``."""
    h = hashlib.sha256(spec)
    for p in inputs:
        p = os.fspath(p)
        if is_url(p):
            h.update(f"{p}\0url\n".encode())
            continue
        try:
            st = os.stat(p)
        except OSError:
            h.update(f"{p}\0missing\n".encode())
            continue
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"sha256:{h.hexdigest()}"


def _spec(payload: bytes, schema: Schema, opts: ConvertOptions) -> bytes:
    shaping = {
        "schema": schema.to_json(),
        "on_error": opts.on_error,
        "resize_shorter": opts.resize_shorter,
        "quality": opts.quality,
        "decode_check": opts.decode_check,
        "shard_bytes": opts.shard_bytes,
    }
    return payload + json.dumps(shaping, sort_keys=True).encode()


# -- the tasks ------------------------------------------------------------------------------
def _write_part(
    part: object,
    k: int,
    payload: bytes,
    *,
    write_part: Callable,
    inputs_of: Callable[[object], Sequence[str]] | None,
    schema: Schema,
    opts: ConvertOptions,
    parts: _Parts,
) -> dict:
    """One part -> its directory of shards plus its manifest (the record, written last).
    Returns ``{"dir", "skipped", "resumed", "why"}`` (``why``: the reason an earlier run's
    record of this part was not used, if there was one)."""
    inputs = [os.fspath(p) for p in inputs_of(part)] if inputs_of is not None else []
    fingerprint = part_fingerprint(_spec(payload, schema, opts), inputs)
    part_dir = parts.part(k)
    done, why = parts.finished(k, fingerprint)  # none after a restart: _begin deleted them
    if done is not None:
        skipped = [tuple(s) for s in done.metadata[PART_RECORD].get("skipped", [])]
        return {"dir": part_dir, "skipped": skipped, "resumed": True, "why": ""}
    record = {
        "part": k,
        "fingerprint": fingerprint,
        "inputs": len(inputs),
        "first_input": inputs[0] if inputs else None,
        "last_input": inputs[-1] if inputs else None,
    }
    kw = opts.writer_kwargs(part_dir)
    kw["overwrite"] = True  # an earlier attempt's files are here
    for attempt in range(1, TASK_RETRIES + 1):
        report = ConvertReport(part_dir)
        try:
            with Writer(part_dir, schema, metadata={PART_RECORD: record}, **kw) as w:
                write_part(w, part, opts, report)
                w.metadata[PART_RECORD]["skipped"] = [[str(s), str(r)] for s, r in report.skipped]
            break
        except OSError as e:
            # a storage hiccup, or kuat.RemoteError (a URL after kuat's own retries); an
            # unreadable sample (DecodeError, SchemaError: ValueErrors) is the data's and
            # goes to the driver as it is
            if attempt == TASK_RETRIES:
                raise
            log.warning(
                "writing %s failed (%s: %s); attempt %d/%d",
                part_dir, type(e).__name__, e, attempt + 1, TASK_RETRIES,
            )  # fmt: skip
            time.sleep(_RETRY_DELAY_S * attempt)  # backoff, not synchronisation
    return {"dir": part_dir, "skipped": list(report.skipped), "resumed": False, "why": why}


def _task(batch: dict, *, fn: Callable, fn_kwargs: dict, marker: _Parts | None) -> dict:
    """Ray Data task body: one item (a batch of one row ``{"item", "payload"}``) ->
    ``{"item", "result", "error"}``, each pickled. ``error``: the ``KuatError`` the item
    raised (an unreadable sample with ``on_error="raise"``, a schema conflict): deterministic,
    so not for Ray to retry, and returned as data because Ray Data hands the driver only the
    message of what a task raises. It travels as the loader's worker errors do
    (:class:`kuat.engine.failure.Failure`): the driver raises its equal (type, args,
    attributes, chain), with a note naming this task and its traceback."""
    (k,) = batch["item"]
    k = int(k)
    if marker is not None and marker.exists(_ABORTED):
        return {"item": [k], "result": [b""], "error": [b""]}
    (payload,) = batch["payload"]
    try:
        result = fn(pickle.loads(payload), k, payload, **fn_kwargs)
    except KuatError as e:
        where = f"process {os.getpid()} on {socket.gethostname()}"
        failure = Failure(e, f"Ray task {k} ({where})",
                          f"Raised in kuat's Ray task for item {k} ({where}).")
        return {"item": [k], "result": [b""], "error": [pickle.dumps(failure)]}
    return {"item": [k], "result": [pickle.dumps(result)], "error": [b""]}


def _import_ray():
    require("ray.data", extra="ray", needed_for="engine='ray' (Ray Data)")
    import ray

    return ray


def _retry_args(map_batches: Callable) -> dict:
    """How to bound Ray's reruns of a task whose worker died, on the installed Ray.

    Ray 2.60 deprecates ``map_batches(**ray_remote_args)`` (removed in 2.64) and names no
    ``max_retries`` parameter, so there the default stands (Ray Data reruns such a task until
    it succeeds); a Ray that names it gets ``TASK_RETRIES``. OSError retries never depend on
    this: they happen inside the task (:func:`_write_part`)."""
    params = inspect.signature(map_batches).parameters
    return {"max_retries": TASK_RETRIES} if "max_retries" in params else {}


@contextlib.contextmanager
def ray_session():
    """The Ray instance to run on for the block: the running one, or the cluster
    ``ray.init()`` finds (``RAY_ADDRESS``), or a local one; one this started is shut down at
    the end. Nested blocks share it.

    Raises:
        ImportError: Ray Data is not installed.
    """
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(log_to_driver=False)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def map_on_ray(
    fn: Callable,
    items: Sequence,
    opts: ConvertOptions,
    *,
    fn_kwargs: Mapping | None = None,
    marker: _Parts | None = None,
) -> list:
    """``[fn(item, k, payload, **fn_kwargs) for k, item in enumerate(items)]``, one Ray Data
    task per item (``payload``: the item pickled), on the running Ray instance, or on the
    cluster ``ray.init()`` finds (``RAY_ADDRESS``), or on a local one started here and shut
    down at the end.

    ``fn``, ``items``, ``fn_kwargs`` and the results must pickle (closures do, with
    cloudpickle). Each task asks for one CPU.

    Raises:
        kuat.KuatError: the first an item raised, in item order (as a local loop would);
            the tasks not yet started then return at once (``marker``, where given, is
            where the abort is announced) and the running ones are waited for.
        ray.exceptions.RayError: a task failed for another reason.
    """
    with ray_session() as ray:
        return _map(ray, fn, items, opts, dict(fn_kwargs or {}), marker)


def _map(ray, fn, items, opts, fn_kwargs, marker, on_result=None) -> list:
    ctx = ray.data.DataContext.get_current()
    saved = (ctx.enable_progress_bars, ctx.execution_options.preserve_order)
    ctx.enable_progress_bars = opts.progress
    ctx.execution_options.preserve_order = True
    payloads = [{"item": k, "payload": pickle.dumps(p)} for k, p in enumerate(items)]
    try:
        ds = ray.data.from_items(payloads, override_num_blocks=max(1, len(payloads)))
        ds = ds.map_batches(
            _task,
            batch_size=1,
            batch_format="numpy",
            num_cpus=1,
            fn_kwargs={"fn": fn, "fn_kwargs": fn_kwargs, "marker": marker},
            **_retry_args(ds.map_batches),
        )
        results, error = {}, None
        # in item order (preserve_order): the first error met is the first in item order,
        # the one the local engine raises. The loop still drains the rest (tasks that have
        # not started see _ABORTED and return at once): Ray Data does not wait for running
        # tasks when the driver stops reading, and they would write on after the driver
        # has returned.
        for row in ds.iter_rows():
            if error is None and row["error"]:
                error = pickle.loads(row["error"]).exception()
                if marker is not None:
                    marker.touch(_ABORTED)
            elif error is None:
                k = int(row["item"])
                results[k] = pickle.loads(row["result"])
                if on_result is not None:
                    on_result(k, results[k])
        if marker is not None and error is not None:
            marker.remove(_ABORTED)
        if error is not None:
            raise error
        log.debug("ray data stats:\n%s", ds.stats())
    finally:
        ctx.enable_progress_bars, ctx.execution_options.preserve_order = saved
    if sorted(results) != list(range(len(items))):
        raise RuntimeError(f"Ray returned items {sorted(results)}, expected 0..{len(items) - 1}")
    return [results[k] for k in range(len(items))]


# -- the driver -----------------------------------------------------------------------------
def convert_on_ray(
    dst: str | os.PathLike,
    schema: Schema,
    metadata: dict,
    opts: ConvertOptions,
    parts: Sequence,
    write_part: Callable[[Writer, object, ConvertOptions, ConvertReport], None],
    inputs_of: Callable[[object], Sequence[str]] | None = None,
) -> ConvertReport:
    """Convert ``parts`` into the dataset ``dst``, one Ray Data task per part.

    The Ray counterpart of a converter's ``with converting(...) as (w, report)`` block (see
    the module docstring). Runs on the Ray instance :func:`map_on_ray` finds or starts.

    Args:
        dst: a local path every node reaches, or a URL (``opts.storage_options`` are passed
            to every task).
        schema, metadata: the dataset's, as the local engine would write them.
        opts: the conversion options; each task gets them with ``num_workers=1`` (Ray
            gives each task one CPU) and no progress bar (Ray Data shows its own).
            ``opts.restart`` starts over instead of resuming the parts of an earlier run.
        parts: picklable descriptions of the work (lists of files, a file path), in the
            order their rows go into the dataset.
        write_part: ``write_part(writer, part, task_opts, report)`` writes every row of one
            part with the task's options and records skipped samples in ``report.skipped``;
            runs in the tasks, so it must pickle (closures do, with cloudpickle).
        inputs_of: ``inputs_of(part)``: the files the part reads; their sizes and
            modification times go into its fingerprint (see :func:`part_fingerprint`).

    Returns:
        the :class:`kuat.convert.ConvertReport`: rows, skipped samples (in input order),
        seconds.

    Raises:
        kuat.DecodeError, kuat.SchemaError: an unreadable sample with ``on_error="raise"``,
            the first in input order (as locally); the finished parts are kept for a rerun.
        FileExistsError: ``dst`` is a dataset and ``overwrite`` is False, or a non-empty
            directory/prefix that is not one, or (locally) is being written.
        kuat.format.fs.RemoteError: a URL destination cannot be reached (after retries).
        ImportError: Ray Data is not installed.
        ray.exceptions.RayError: a task failed for another reason after its retries.
    """
    store = _Parts.of(dst, opts.storage_options)
    task_opts = replace(opts, num_workers=1, progress=False)
    report = ConvertReport(str(dst))
    fn_kwargs = {
        "write_part": write_part,
        "inputs_of": inputs_of,
        "schema": schema,
        "opts": task_opts,
        "parts": store,
    }
    t0 = time.perf_counter()
    with ray_session() as ray:
        convert = _convert_to_url if store.remote else _convert_to_path
        manifest = convert(ray, dst, schema, metadata, opts, parts, store, fn_kwargs, report)
    seconds = report.seconds = time.perf_counter() - t0
    log_skipped(report)
    mb = manifest.num_bytes / 1e6
    log.info(
        "ray: %d rows, %.1f MB in %d parts, %.1f s (%.0f rows/s, %.1f MB/s)",
        report.rows,
        mb,
        len(parts),
        seconds,
        report.rows / seconds if seconds else 0.0,
        mb / seconds if seconds else 0.0,
    )
    return report


def _begin(store: _Parts, n_parts: int, restart: bool) -> None:
    """Clear what an earlier run left that this one cannot use: every part with
    ``restart``, else the parts past this run's last and a stale abort marker."""
    for name in store.names():
        stale = name == _ABORTED or (
            _PART_RE.match(name) and (restart or int(name[len("part-") :]) >= n_parts)
        )
        if stale:
            store.remove(name)


def _write_parts(ray, parts, opts, store, fn_kwargs, report) -> list[tuple[str, Manifest]]:
    """Run the part tasks; ``[(part dir, part manifest)]`` in part order."""
    resumed: list[int] = []

    def seen(k: int, r: dict) -> None:
        if r["resumed"]:
            resumed.append(k)
        elif r["why"]:
            log.info("%s: written again", r["why"])

    try:
        results = _map(ray, _write_part, parts, opts, fn_kwargs, store, on_result=seen)
    finally:  # also when a part failed: the rerun's parts that came from the one before
        if resumed:
            log.info("resumed %d of %d parts from an earlier run", len(resumed), len(parts))
    out = []
    for k, r in enumerate(results):
        try:
            part = read_manifest(r["dir"], storage_options=store.storage_options or None)
        except FormatError as e:
            raise FormatError(
                f"part {k} of {report.path} has no valid manifest in {r['dir']}: {e}",
                path=r["dir"],
            ) from e
        diff = fn_kwargs["schema"].difference(part.schema)
        if diff is not None:
            raise FormatError(f"part {r['dir']} has another schema: {diff}", path=r["dir"])
        report.skipped.extend(r["skipped"])
        out.append((r["dir"], part))
    return out


def _convert_to_path(ray, dst, schema, metadata, opts, parts, store, fn_kwargs, report):
    kw = opts.writer_kwargs(dst)
    # The Writer takes dst's lock for the whole run (a second driver is refused), refuses or
    # clears what is there, and writes the manifest only on a clean exit; on an error it
    # deletes the shards moved in so far (their parts are then written again on a rerun).
    with Writer(dst, schema, metadata=metadata, **kw) as w:
        os.makedirs(store.root, exist_ok=True)
        _begin(store, len(parts), opts.restart)
        try:
            for part_dir, part in _write_parts(ray, parts, opts, store, fn_kwargs, report):
                for info in part.shards:
                    w.add_shard(Path(part_dir) / info.file, info)
        except BaseException:
            log.info("kept the finished parts in %s: rerun to resume", store.root)
            raise
        report.rows = w.num_rows
    shutil.rmtree(store.root, ignore_errors=True)
    return w.manifest


def _convert_to_url(ray, dst, schema, metadata, opts, parts, store, fn_kwargs, report):
    _prepare_url(store, opts.overwrite)
    _begin(store, len(parts), opts.restart)
    shards = []
    for part_dir, part in _write_parts(ray, parts, opts, store, fn_kwargs, report):
        name = part_dir.rsplit("/", 1)[-1]
        shards += [ShardInfo(f"{name}/{s.file}", s.rows, s.bytes, s.checksum) for s in part.shards]
    from kuat import __version__

    manifest = Manifest(schema, tuple(shards), dict(metadata), created_by=f"kuat {__version__}")
    write_manifest(store.root, manifest, storage_options=store.storage_options)
    report.rows = manifest.num_rows
    fs, path = store._fs()
    records = [f"{path}/{_part_name(k)}/{MANIFEST_NAME}" for k in range(len(parts))]
    try:  # the parts' records are no part of the dataset (one bulk delete where fsspec can)
        fs.rm(records)
    except Exception as e:  # best effort: a leftover record harms no reader
        log.debug("cannot delete the part records of %s: %s", store.root, e)
    return manifest


def _prepare_url(store: _Parts, overwrite: bool) -> None:
    """Refuse or clear what is at the destination URL, as :class:`kuat.Writer` does: an old
    dataset loses its manifest first (so no reader sees a mix), then its shards; the parts of
    an earlier, unfinished run stay for resuming.

    Raises:
        FileExistsError: a dataset, or objects that are no parts, are there and ``overwrite``
            is False.
    """
    names = store.names()
    url = store.root
    if MANIFEST_NAME in names:
        if not overwrite:
            raise FileExistsError(
                f"{url} is already a kuat dataset; pass overwrite=True (--overwrite) to replace it"
            )
        try:
            old = [s.file for s in read_manifest(url, storage_options=store.storage_options).shards]
        except FormatError:
            old = []
        store.remove(MANIFEST_NAME)
        fs, path = store._fs()
        for name in old:
            key = member_path(url, name)  # never delete outside the dataset's prefix
            try:
                retry(lambda k=key: fs.rm_file(f"{path}/{k[len(url) + 1 :]}"),
                      what="deleting an old shard", url=key)  # fmt: skip
            except FileNotFoundError:
                pass
        names = [n for n in names if n != MANIFEST_NAME]
    others = [n for n in names if not _PART_RE.match(n) and n != _ABORTED]
    if others and not overwrite:
        raise FileExistsError(
            f"{url} is a non-empty prefix that is not a kuat dataset ({others[0]!r}, ...); "
            "pass overwrite=True (--overwrite) to write into it anyway"
        )
