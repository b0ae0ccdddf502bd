"""Child side of ``kuat bench --scaling``: one (workload, loader, worker count) point in a
fresh process.

Run as ``python -m benchmarks.scaling_child SPEC.json OUT.json`` by
:func:`benchmarks.scaling.run_point`, with two pipe ends inherited: ``ready_fd`` (this process
writes one byte when its GIL window starts) and ``done_fd`` (the parent writes one byte, or
closes it, when its sampler has finished). The spec holds ``workload`` (``imagenet-jpeg``,
``tabular``, ``packed-text``), ``loader`` (a :data:`benchmarks.adapters.LOADERS` name for the
image path; ``kuat``, ``kuat-proc`` or ``torch`` for the others), ``num_workers``,
``batch_size``, ``data`` (paths the parent prepared), ``warmup_s``, ``seconds`` (the rate
window), ``loop_iters`` (the competing training loop's pure-Python work per batch; 0: none),
``seed`` and ``locate_path`` (where to write :func:`benchmarks.gil_reader.locate`'s answer
first, for the parent's GIL reader; absent under py-spy).

While it reads batches, the training loop's thread says in :data:`PHASE` (a 4-byte int
whose address goes to the parent with ``locate()``'s answer) whether it is inside the loader's
``next()``, freeing a batch, or in its own code; the parent's reader reads it with each GIL
reading.

What it does, in order:

0. :func:`wake_probe`: how much slower this host runs a fixed snippet right after a wait;
1. with a competing loop, times that loop alone (``loop_alone_ms``: median of 15 steps, before
   the loader exists);
2. builds the loader and reads batches for ``warmup_s`` (worker start-up, first epoch's caches;
   epochs are cycled: the loaders keep persistent workers);
3. the **rate window**: ``seconds`` of batches with nothing sampling this process
   (``rate``: items/s; ``cpu_us_per_item``: CPU microseconds of the process tree per item;
   with a loop, ``loop_ms``: the loop's own time per step while the loader runs);
4. the **GIL window**: writes to ``ready_fd`` and keeps reading batches (and running the loop)
   until the parent, whose sampler (``benchmarks.gil_reader``, or py-spy) reads this
   process's GIL meanwhile, writes to ``done_fd``; ``gil_window`` gets its items and wall
   seconds, which turn the sampler's GIL fraction into microseconds per item.

``OUT.json`` gets ``{"ok": true, ...}`` or ``{"ok": false, "error", "traceback"}``.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import select
import statistics
import sys
import time
import traceback
from pathlib import Path

PACK_SEQ_LEN = 2048  # tokens per packed row (packed-text)
PACK_BUFFER = 1024  # documents in the packer's buffer

# What the training loop's thread is doing, for the parent's GIL reader (gil_reader.sample's
# ``phase``; its address goes to the parent with locate()'s answer): the reader then tells the
# loop thread's GIL time inside the loader's calls from the harness's own Python.
IN_OWN, IN_NEXT, IN_FREE = 0, 1, 2  # its own code; the loader's next(); freeing a batch
PHASE = ctypes.c_int32(IN_OWN)


def python_work(iters: int) -> int:
    """Pure-Python work holding the GIL for ``iters`` iterations: the competing training
    loop's stand-in for a model's Python dispatch (a step's module calls, hooks, optimizer
    bookkeeping). Returns a value so that nothing can skip it."""
    acc = 0
    for i in range(iters):
        acc += i & 7
    return acc


def loop_alone_ms(iters: int, steps: int = 15) -> float:
    """Median milliseconds of ``python_work(iters)`` with nothing else running here."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        python_work(iters)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def wake_probe(waits: int = 15, wait_s: float = 0.03) -> dict:
    """How much slower this host runs a fixed snippet right after the thread waited
    ``wait_s`` than back to back: the same code and data, so the difference is what the wait
    cost (caches, TLBs and branch predictors another task or the hypervisor took meanwhile,
    and the core's wake-up). A loader's training-loop thread that waits for each batch runs
    its per-batch Python in that state; on a host where the factor is large, the loop thread's
    GIL time per item is large with it (docs/benchmarks.md, "GIL per image on another day").

    The snippet: ``torch.from_numpy`` of a ``(64, 3, 224, 224)`` uint8 array (a batch's
    tensor, as kuat's pool makes one when a batch is freed) and a 100-step Python loop.
    Each wait gives one run right after it and one right after that run (the second is warm:
    only the first pass over the code and data is slow). Returns ``{"after_wait_us",
    "warm_us"}`` (the medians of the first and of the second runs over ``waits``) and
    ``wait_s``."""
    import numpy as np
    import torch

    a = np.zeros((64, 3, 224, 224), np.uint8)

    def timed() -> float:
        t0 = time.perf_counter()
        torch.from_numpy(a)
        s = 0
        for i in range(100):
            s += i
        return time.perf_counter() - t0

    cold, warm = [], []
    for _ in range(waits):
        time.sleep(wait_s)
        cold.append(timed())
        warm.append(timed())  # (one run each: like with like; only the first is slow)
    return {"after_wait_us": 1e6 * statistics.median(cold), "warm_us": 1e6 * statistics.median(warm),
            "wait_s": wait_s}  # fmt: skip


def _count(batch, workload: str) -> int:
    """Items in a batch: images, rows, or packed rows (of ``PACK_SEQ_LEN`` tokens)."""
    if workload == "packed-text":
        return int(batch["input_ids"].shape[0])  # (B, L) int64
    if isinstance(batch, dict):
        return int(next(iter(batch.values())).shape[0])
    return int(batch[0].shape[0])


def build(spec: dict):
    """``(loader, epoch_fn)``: ``epoch_fn(e)`` iterates epoch ``e``'s batches."""
    import torch

    import kuat

    workload, loader, n = spec["workload"], spec["loader"], spec["num_workers"]
    data, bs, seed = spec["data"], spec["batch_size"], spec.get("seed", 0)
    if loader == "floor":  # the reference: kuat's batch fetch with the least Python around it
        from benchmarks.adapters.kuat import image_dataset
        from benchmarks.gil_floor import Floor

        if workload == "imagenet-jpeg":
            ds = image_dataset(data["kuat_path"])  # (the kuat adapter's)
        elif workload == "tabular":
            ds = kuat.open(data["path"])
        else:
            raise ValueError(f"scaling: the floor has no {workload} configuration")
        floor = Floor(ds, n, bs, seed)
        return floor, floor.epoch
    if workload == "imagenet-jpeg":  # the bench's own adapters: the same loaders as its table
        import importlib

        from benchmarks.adapters import LOADERS

        info = LOADERS[loader]
        adapter = importlib.import_module(f"benchmarks.adapters.{info['adapter']}")
        sub = {"options": info.get("options", {}), "num_workers": n, "batch_size": bs,
               "seed": seed}  # fmt: skip
        built = adapter.build("imagenet-jpeg", data, sub)
        return built, built.epoch
    if loader not in ("kuat", "kuat-proc", "torch"):
        raise ValueError(f"scaling: loader={loader!r} has no {workload} configuration")
    collate = None
    if workload == "tabular":
        ds = kuat.open(data["path"])
    elif workload == "packed-text":
        from kuat.text import pack, pack_collate

        ds = pack(kuat.open(data["path"]), PACK_SEQ_LEN, "best_fit", buffer_size=PACK_BUFFER)
        collate = pack_collate()
    else:
        raise ValueError(f"scaling: unknown workload={workload!r}")
    # packed rows are an iterable stream: no sampler, so shuffle and drop_last do not apply
    common = dict(batch_size=bs, num_workers=n, persistent_workers=n > 0)
    if workload == "tabular":
        common.update(shuffle=True, drop_last=True)
    if collate is not None:
        common["collate_fn"] = collate
    if loader == "torch":
        if workload == "tabular":
            common["generator"] = torch.Generator().manual_seed(seed)
        dl = torch.utils.data.DataLoader(ds, **common)
    else:
        worker_type = "process" if loader == "kuat-proc" else "thread"
        dl = kuat.DataLoader(ds, worker_type=worker_type if n else None, seed=seed, **common)
    return dl, lambda e: iter(dl)


def _window(batches, workload: str, loop_iters: int, until) -> dict:
    """Read batches until ``until(elapsed_s)`` says stop; with ``loop_iters``, run the
    competing loop after every batch and time it apart."""
    from benchmarks import measure

    items = steps = 0
    loop_s = 0.0
    cpu0, t0 = measure.tree_cpu_seconds(), time.perf_counter()
    phase = PHASE
    while True:
        phase.value = IN_NEXT
        batch = next(batches)
        phase.value = IN_OWN
        items += _count(batch, workload)
        steps += 1
        if loop_iters:
            tl = time.perf_counter()
            python_work(loop_iters)
            loop_s += time.perf_counter() - tl
        phase.value = IN_FREE
        del batch  # (the loader's memory comes back here: kuat's pool, torch's shared memory)
        phase.value = IN_OWN
        if until(time.perf_counter() - t0):
            break
    wall = time.perf_counter() - t0
    out = {
        "items": items,
        "steps": steps,
        "wall_s": wall,
        "rate": items / wall,
        "cpu_us_per_item": 1e6 * (measure.tree_cpu_seconds() - cpu0) / items if items else None,
    }
    if loop_iters:
        out["loop_ms"] = 1e3 * loop_s / steps
    return out


def _python_totals(loader) -> tuple[int, dict] | None:
    """``(samples, {part: Python us in all})`` from a kuat loader's ``stats()``
    (``python_us_per_sample`` times the samples); ``None`` for other loaders."""
    stats = getattr(loader, "stats", None)
    if stats is None:
        return None
    r = stats()
    n, per = r["samples"], r.get("python_us_per_sample") or {}
    return n, {k: v * n for k, v in per.items() if v is not None}


def _python_per_item(before, after) -> dict | None:
    """kuat's ``stats()`` Python us per sample over the window between two
    :func:`_python_totals` (``workers``, ``consumer``, ``main_process``)."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    n = after[0] - before[0]
    return {k: (v - before[1].get(k, 0.0)) / n for k, v in after[1].items()}


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def run(spec: dict) -> dict:
    workload, loop_iters = spec["workload"], int(spec.get("loop_iters") or 0)
    result: dict = {}
    if spec.get("locate_path"):  # where the parent's GIL reader finds this process's GIL;
        from benchmarks import gil_reader  # (before any thread starts: gil_reader.locate)

        where = gil_reader.locate()
        if where is not None:
            where["phase"] = ctypes.addressof(PHASE)
        Path(spec["locate_path"]).write_text(json.dumps(where))
    result["wake_probe"] = wake_probe()
    if loop_iters:
        result["loop_alone_ms"] = loop_alone_ms(loop_iters)
    t0 = time.perf_counter()
    loader, epoch_fn = build(spec)
    result["setup_s"] = time.perf_counter() - t0
    batches = itertools.chain.from_iterable(epoch_fn(e) for e in itertools.count())
    try:
        warm = _window(batches, workload, loop_iters, lambda t: t >= spec["warmup_s"])
        result["warmup"] = warm
        result["rate_window"] = _window(
            batches, workload, loop_iters, lambda t: t >= spec["seconds"]
        )
        ready_fd, done_fd = spec.get("ready_fd"), spec.get("done_fd")
        if ready_fd is not None:
            os.write(ready_fd, b"1")  # the parent starts its sampler now
            limit = float(spec.get("gil_window_max_s", 600.0))
            p0 = _python_totals(loader)
            result["gil_window"] = _window(
                batches, workload, loop_iters, lambda t: t >= limit or _readable(done_fd)
            )
            # kuat's own measure over the same window (stats(): CPU outside its kernels)
            result["gil_window"]["stats_python_us"] = _python_per_item(p0, _python_totals(loader))
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result: dict = {"ok": False, "pid": os.getpid()}
    try:
        result.update(run(spec))
        result["ok"] = True
    except BaseException as e:  # reported to the parent, which records why the point failed
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    Path(argv[1]).write_text(json.dumps(result, indent=1, default=str))
    sys.stdout.flush()
    os._exit(0)  # persistent workers and peers' threads: the result is written, leave now


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
