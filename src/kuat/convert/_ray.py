"""Running converter work on Ray Data: the only kuat module that imports Ray (``pip install
kuat[ray]``).

:func:`ray_session` is the Ray instance to run on (the running one, the cluster ``ray.init()``
finds, or a local one it starts and stops); :func:`map_on_ray` runs one Ray Data task per item,
in item order, and brings back each item's result, or the first :class:`kuat.KuatError` in item
order with its chain (as :class:`kuat.engine.failure.Failure` carries the loader's worker
errors). The Ray engine of the converters, built on these, is :mod:`kuat.convert._ray_convert`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import pickle
import socket
from collections.abc import Callable, Mapping, Sequence

from kuat.convert._driver import ConvertOptions
from kuat.convert._ray_parts import ABORTED, Parts
from kuat.engine.failure import Failure
from kuat.errors import KuatError, require

__all__ = ["map_on_ray", "ray_session", "TASK_RETRIES"]

log = logging.getLogger("kuat.convert.ray")

# Attempts at one part: an OSError while writing it (a storage hiccup) is retried inside the
# task, and a dead worker by Ray where it can be bounded. Bounded, unlike Ray Data's default
# of infinite retries: a full disk would otherwise retry forever.
TASK_RETRIES = 3


def _task(batch: dict, *, fn: Callable, fn_kwargs: dict, marker: Parts | None) -> dict:
    """Ray Data task body: one item (a batch of one row ``{"item", "payload"}``) ->
    ``{"item", "result", "error"}``, each pickled. ``error``: the ``KuatError`` the item
    raised (an unreadable sample with ``on_error="raise"``, a schema conflict): deterministic,
    so not for Ray to retry, and returned as data because Ray Data hands the driver only the
    message of what a task raises. It travels as the loader's worker errors do
    (:class:`kuat.engine.failure.Failure`): the driver raises its equal (type, args,
    attributes, chain), with a note naming this task and its traceback."""
    (k,) = batch["item"]
    k = int(k)
    if marker is not None and marker.exists(ABORTED):
        return {"item": [k], "result": [b""], "error": [b""]}
    (payload,) = batch["payload"]
    try:
        result = fn(pickle.loads(payload), k, payload, **fn_kwargs)
    except KuatError as e:
        where = f"process {os.getpid()} on {socket.gethostname()}"
        failure = Failure(
            e, f"Ray task {k} ({where})", f"Raised in kuat's Ray task for item {k} ({where})."
        )
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
    this: they happen inside the part task (:mod:`kuat.convert._ray_convert`)."""
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
    marker: Parts | None = None,
    on_result: Callable[[int, object], None] | None = None,
) -> list:
    """``[fn(item, k, payload, **fn_kwargs) for k, item in enumerate(items)]``, one Ray Data
    task per item (``payload``: the item pickled), on the running Ray instance, or on the
    cluster ``ray.init()`` finds (``RAY_ADDRESS``), or on a local one started here and shut
    down at the end.

    ``fn``, ``items``, ``fn_kwargs`` and the results must pickle (closures do, with
    cloudpickle). Each task asks for one CPU. ``on_result(k, result)``, where given, sees each
    result on the driver as it arrives (in item order).

    Raises:
        kuat.KuatError: the first an item raised, in item order (as a local loop would);
            the tasks not yet started then return at once (``marker``, where given, is
            where the abort is announced) and the running ones are waited for.
        ray.exceptions.RayError: a task failed for another reason.
    """
    with ray_session() as ray:
        return _map(ray, fn, items, opts, dict(fn_kwargs or {}), marker, on_result)


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
        # not started see ABORTED and return at once): Ray Data does not wait for running
        # tasks when the driver stops reading, and they would write on after the driver
        # has returned.
        for row in ds.iter_rows():
            if error is None and row["error"]:
                error = pickle.loads(row["error"]).exception()
                if marker is not None:
                    marker.touch(ABORTED)
            elif error is None:
                k = int(row["item"])
                results[k] = pickle.loads(row["result"])
                if on_result is not None:
                    on_result(k, results[k])
        if marker is not None and error is not None:
            marker.remove(ABORTED)
        if error is not None:
            raise error
        log.debug("ray data stats:\n%s", ds.stats())
    finally:
        ctx.enable_progress_bars, ctx.execution_options.preserve_order = saved
    if sorted(results) != list(range(len(items))):
        raise RuntimeError(f"Ray returned items {sorted(results)}, expected 0..{len(items) - 1}")
    return [results[k] for k in range(len(items))]
