"""The Ray engine of the converters (``engine="ray"``, ``kuat convert --engine ray``).

The only kuat module that imports Ray (``pip install kuat[ray]``). The converter plans on
the driver as in the local engine (lists the files, infers the schema) and cuts the input
into *parts* (ImageFolder: ``rows_per_task`` consecutive images; tables: one input file);
then:

1. one Ray Data task per part runs the converter's own code for that part (``write_part``:
   read, probe, re-encode, the same ``--on-error`` policy) into a :class:`kuat.Writer` of its
   own directory under a staging folder next to the destination
   (``.<dst name>.kuat-ray/part-NNNNN``): whole shards and a part manifest listing them;
2. the driver, once every part exists, moves each part's shards into the destination by
   rename (:meth:`kuat.Writer.add_shard`, in part order: the rows come out in the local
   engine's order) and writes the manifest last: O(number of shards), no shard byte is read
   or rewritten.

Failures: a task whose worker or node dies is retried by Ray (Ray Data's default), and so is
a task that raises ``OSError`` (a storage hiccup while writing), at most ``TASK_RETRIES``
times; a retried task rewrites its part from scratch (the Writer clears the part directory).
A sample that fails follows ``on_error`` inside its task, as locally. The destination holds
the driver's writer lock throughout and gets its manifest only at the end, so a killed
driver leaves no dataset (a reader never sees a partial one); rerunning starts over cleanly
(the Writer deletes leftover shards, the driver the old staging folder).

The destination must be a path every node can reach (one machine, or a shared file system
such as NFS or Lustre mounted at the same path): tasks write there directly.

Progress is Ray Data's own (rows and rows/s per operator, across the cluster); the driver
logs the total rows/s and MB/s at the end.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from kuat.convert._driver import ConvertOptions, ConvertReport, log_skipped
from kuat.errors import FormatError, KuatError
from kuat.format import Schema, Writer
from kuat.format.manifest import read_manifest

__all__ = ["convert_on_ray", "staging_dir", "TASK_RETRIES"]

log = logging.getLogger("kuat.convert.ray")

# How often Ray re-runs a failed part task (worker/node death, or OSError). Bounded, unlike
# Ray Data's default of infinite retries: a full disk would otherwise retry forever.
TASK_RETRIES = 3


def staging_dir(dst: str | os.PathLike) -> Path:
    """Where the tasks of a conversion into ``dst`` write their parts: a hidden sibling of
    ``dst`` (the same file system, so moving a shard into ``dst`` is a rename)."""
    dst = Path(dst).absolute()
    return dst.parent / f".{dst.name}.kuat-ray"


# written into the staging folder once a task reports an unreadable sample (on_error="raise"):
# tasks not yet started return at once, so the driver's wait for the running ones is short
_ABORTED = "ABORTED"


def _part_name(k: int) -> str:
    return f"part-{k:05d}"


def _write_part(
    batch: dict,
    *,
    write_part: Callable,
    schema: Schema,
    opts: ConvertOptions,
    staging: str,
) -> dict:
    """Ray Data task body: one part (a batch of one row ``{"part", "payload"}``) -> its
    directory of shards plus a part manifest. Returns ``{"part", "dir", "skipped", "error"}``
    (``error``: the pickled ``KuatError`` of an unreadable sample with ``on_error="raise"``)."""
    (k,) = batch["part"]
    if (Path(staging) / _ABORTED).exists():
        return {"part": [int(k)], "dir": [""], "skipped": [b""], "error": [b""]}
    (payload,) = batch["payload"]
    part = pickle.loads(payload)
    part_dir = Path(staging) / _part_name(int(k))
    report = ConvertReport(str(part_dir))
    kw = opts.writer_kwargs()
    kw["overwrite"] = True  # a retried task finds its previous attempt's files here
    try:
        with Writer(part_dir, schema, **kw) as w:
            write_part(w, part, opts, report)
    except KuatError as e:
        # a sample error (on_error="raise"): deterministic, so not for Ray to retry; returned
        # as data because Ray Data hands the driver only the message of what a task raises
        return {"part": [int(k)], "dir": [""], "skipped": [b""], "error": [_pickle_error(e)]}
    return {
        "part": [int(k)],
        "dir": [str(part_dir)],
        "skipped": [pickle.dumps(report.skipped)],
        "error": [b""],
    }


def _pickle_error(e: KuatError) -> bytes:
    try:
        return pickle.dumps(e)
    except Exception:  # an unpicklable attribute: keep the type's message at least
        return pickle.dumps(KuatError(f"{type(e).__name__}: {e}"))


def convert_on_ray(
    dst: str | os.PathLike,
    schema: Schema,
    metadata: dict,
    opts: ConvertOptions,
    parts: Sequence,
    write_part: Callable[[Writer, object, ConvertOptions, ConvertReport], None],
) -> ConvertReport:
    """Convert ``parts`` into the dataset ``dst``, one Ray Data task per part.

    The Ray counterpart of a converter's ``with converting(...) as (w, report)`` block (see
    the module docstring). Connects to the running Ray instance, or to the cluster
    ``ray.init()`` finds (``RAY_ADDRESS``), or starts a local one (shut down at the end).

    Args:
        schema, metadata: the dataset's, as the local engine would write them.
        opts: the conversion options; each task gets them with ``num_workers=1`` (Ray
            gives each task one CPU) and no progress bar (Ray Data shows its own).
        parts: picklable descriptions of the work (lists of files, a file path), in the
            order their rows go into the dataset.
        write_part: ``write_part(writer, part, task_opts, report)`` writes every row of one
            part with the task's options and records skipped samples in ``report.skipped``;
            runs in the tasks, so it must pickle (closures do, with cloudpickle).

    Returns:
        the :class:`kuat.convert.ConvertReport`: rows, skipped samples (in input order),
        seconds.

    Raises:
        kuat.DecodeError, kuat.SchemaError: an unreadable sample with ``on_error="raise"``,
            the first in input order (as locally).
        FileExistsError: ``dst`` is a dataset and ``overwrite`` is False, or is being written.
        ValueError: ``dst`` is a URL (tasks write to a shared file system path).
        ImportError: Ray Data is not installed.
        ray.exceptions.RayError: a task failed for another reason after its retries.
    """
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise ImportError("engine='ray' needs Ray Data: pip install 'kuat[ray]'") from e

    if "://" in os.fspath(dst):
        raise ValueError(
            f"dst={os.fspath(dst)!r}: the Ray engine writes to a path every node mounts, not "
            "to a URL (convert to a shared file system, or use engine='local' for URLs)"
        )
    payloads = [{"part": k, "payload": pickle.dumps(p)} for k, p in enumerate(parts)]
    report = ConvertReport(str(dst))
    task_opts = replace(opts, num_workers=1, progress=False)
    t0 = time.perf_counter()
    # The Writer takes dst's lock, refuses or clears what is there, and writes the manifest
    # only on a clean exit; on an error it deletes the shards moved in so far.
    with Writer(dst, schema, metadata=metadata, **opts.writer_kwargs()) as w:
        staging = staging_dir(dst)
        shutil.rmtree(staging, ignore_errors=True)  # an earlier, killed run's parts
        staging.mkdir(parents=True)
        started = not ray.is_initialized()
        if started:
            ray.init(log_to_driver=False)
        try:
            results = _run_parts(ray, payloads, write_part, schema, task_opts, staging, opts)
            for r in results:
                part_dir = Path(r["dir"])
                try:
                    part = read_manifest(part_dir)
                except FormatError as e:
                    raise FormatError(
                        f"part {r['part']} of {dst} has no valid manifest in {part_dir}: {e}",
                        path=part_dir,
                    ) from e
                diff = schema.difference(part.schema)
                if diff is not None:
                    raise FormatError(f"part {part_dir} has another schema: {diff}", path=part_dir)
                for info in part.shards:
                    w.add_shard(part_dir / info.file, info)
                report.skipped.extend(pickle.loads(r["skipped"]))
            report.rows = w.num_rows
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if started:
                ray.shutdown()
    seconds = report.seconds = time.perf_counter() - t0
    log_skipped(report)
    mb = (w.manifest.num_bytes if w.manifest else 0) / 1e6
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


def _run_parts(ray, parts, write_part, schema, task_opts, staging, opts) -> list[dict]:
    """Run one Ray Data task per part; their results in part order."""
    ctx = ray.data.DataContext.get_current()
    saved = (ctx.enable_progress_bars, ctx.execution_options.preserve_order)
    ctx.enable_progress_bars = opts.progress
    ctx.execution_options.preserve_order = True
    try:
        ds = ray.data.from_items(parts, override_num_blocks=max(1, len(parts)))
        with warnings.catch_warnings():
            # retry_exceptions has no named parameter in Ray 2.60 (it goes through the
            # deprecated **ray_remote_args); without it an OSError would fail the conversion
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*")
            ds = ds.map_batches(
                _write_part,
                batch_size=1,
                batch_format="numpy",
                num_cpus=1,
                fn_kwargs={
                    "write_part": write_part,
                    "schema": schema,
                    "opts": task_opts,
                    "staging": str(staging),
                },
                max_retries=TASK_RETRIES,
                retry_exceptions=[OSError],
            )
        rows, error = [], None
        # in part order (preserve_order): the first error met is the first in item order,
        # the one the local engine raises. The loop still drains the rest (tasks that have
        # not started see _ABORTED and return at once): Ray Data does not wait for running
        # tasks when the driver stops reading, and they would write into a deleted staging
        # folder after the driver has cleaned up.
        for row in ds.iter_rows():
            if error is None and row["error"]:
                error = pickle.loads(row["error"])
                (staging / _ABORTED).touch()
            elif error is None:
                rows.append(row)
        if error is not None:
            raise error
        log.debug("ray data stats:\n%s", ds.stats())
    finally:
        ctx.enable_progress_bars, ctx.execution_options.preserve_order = saved
    rows.sort(key=lambda r: int(r["part"]))
    if [int(r["part"]) for r in rows] != list(range(len(parts))):
        raise RuntimeError(
            f"Ray returned parts {[int(r['part']) for r in rows]}, expected 0..{len(parts) - 1}"
        )
    return rows
