"""The Ray engine of the converters (``engine="ray"``, ``kuat convert --engine ray``).

Ray itself is run by :mod:`kuat.convert._ray` (``pip install kuat[ray]``); where the parts
live and how a finished one is recognised is :mod:`kuat.convert._ray_parts`. The converter plans
on the driver as in the local engine (lists the files; a table converter lets Ray tasks infer
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

import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from kuat.convert._driver import ConvertOptions, ConvertReport, check_storable, log_skipped
from kuat.convert._ray import TASK_RETRIES, map_on_ray, ray_session
from kuat.convert._ray_parts import (
    PART_RECORD,
    Parts,
    clear_stale,
    part_fingerprint,
    part_name,
    part_spec,
    prepare_url,
)
from kuat.errors import FormatError
from kuat.format import Schema, Writer
from kuat.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    read_manifest,
    write_manifest,
)

__all__ = ["convert_on_ray"]

log = logging.getLogger("kuat.convert.ray")

_RETRY_DELAY_S = 0.5  # backoff before attempt k: 0.5 * (k - 1) s


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
    check_storable(schema, metadata)  # before any task runs
    store = Parts.of(dst, opts.storage_options)
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
    with ray_session():  # one Ray instance for every task
        convert = _convert_to_url if store.remote else _convert_to_path
        manifest = convert(dst, schema, metadata, opts, parts, store, fn_kwargs, report)
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


# -- the part task --------------------------------------------------------------------------
def _write_part(
    part: object,
    k: int,
    payload: bytes,
    *,
    write_part: Callable,
    inputs_of: Callable[[object], Sequence[str]] | None,
    schema: Schema,
    opts: ConvertOptions,
    parts: Parts,
) -> dict:
    """One part -> its directory of shards plus its manifest (the record, written last).
    Returns ``{"dir", "skipped", "resumed", "why"}`` (``why``: the reason an earlier run's
    record of this part was not used, if there was one)."""
    inputs = [os.fspath(p) for p in inputs_of(part)] if inputs_of is not None else []
    fingerprint = part_fingerprint(part_spec(payload, schema, opts), inputs)
    part_dir = parts.part(k)
    done, why = parts.finished(k, fingerprint)  # none after a restart: clear_stale deleted them
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


# -- the driver -----------------------------------------------------------------------------
def _write_parts(parts, opts, store, fn_kwargs, report) -> list[tuple[str, Manifest]]:
    """Run the part tasks; ``[(part dir, part manifest)]`` in part order."""
    resumed: list[int] = []

    def seen(k: int, r: dict) -> None:
        if r["resumed"]:
            resumed.append(k)
        elif r["why"]:
            log.info("%s: written again", r["why"])

    try:
        results = map_on_ray(
            _write_part, parts, opts, fn_kwargs=fn_kwargs, marker=store, on_result=seen
        )
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


def _convert_to_path(dst, schema, metadata, opts, parts, store, fn_kwargs, report):
    kw = opts.writer_kwargs(dst)
    # The Writer takes dst's lock for the whole run (a second driver is refused), refuses or
    # clears what is there, and writes the manifest only on a clean exit; on an error it
    # deletes the shards moved in so far (their parts are then written again on a rerun).
    with Writer(dst, schema, metadata=metadata, **kw) as w:
        os.makedirs(store.root, exist_ok=True)
        clear_stale(store, len(parts), opts.restart)
        try:
            for part_dir, part in _write_parts(parts, opts, store, fn_kwargs, report):
                for info in part.shards:
                    w.add_shard(Path(part_dir) / info.file, info)
        except BaseException:
            log.info("kept the finished parts in %s: rerun to resume", store.root)
            raise
        report.rows = w.num_rows
    shutil.rmtree(store.root, ignore_errors=True)
    return w.manifest


def _convert_to_url(dst, schema, metadata, opts, parts, store, fn_kwargs, report):
    prepare_url(store, opts.overwrite)
    clear_stale(store, len(parts), opts.restart)
    shards = []
    for part_dir, part in _write_parts(parts, opts, store, fn_kwargs, report):
        name = part_dir.rsplit("/", 1)[-1]
        shards += [ShardInfo(f"{name}/{s.file}", s.rows, s.bytes, s.checksum) for s in part.shards]
    from kuat import __version__

    manifest = Manifest(schema, tuple(shards), dict(metadata), created_by=f"kuat {__version__}")
    write_manifest(store.root, manifest, storage_options=store.storage_options)
    report.rows = manifest.num_rows
    fs, path = store.filesystem()
    records = [f"{path}/{part_name(k)}/{MANIFEST_NAME}" for k in range(len(parts))]
    try:  # the parts' records are no part of the dataset (one bulk delete where fsspec can)
        fs.rm(records)
    except Exception as e:  # best effort: a leftover record harms no reader
        log.debug("cannot delete the part records of %s: %s", store.root, e)
    return manifest
