"""Run a function on N forked ranks of a gloo process group (127.0.0.1 only), bounded in time.

    from tests._gloo import run_ranks

    def body(rank, world_size, *args):   # runs in each rank, process group initialised
        ...
        return something_picklable

    results = run_ranks(body, 4, args=(...,), timeout=60)   # [result of rank 0, 1, ...]

Ranks are forked (the test's module-level functions and closures need no pickling), rendezvous
through a file in a fresh temporary directory (no port is opened by the rendezvous; gloo's own
sockets bind the loopback interface: ``GLOO_SOCKET_IFNAME=lo``), and each rank's exception is
re-raised in the test with its traceback text. A rank that does not report within ``timeout``
seconds fails the test and every rank is killed: no test hangs.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import tempfile
import time
import traceback

__all__ = ["run_ranks"]


def _rank_main(fn, rank, world_size, init_file, args, out):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      GLOO_SOCKET_IFNAME="lo")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60))
    except RuntimeError:  # the group never formed (gloo's mesh connect): the test retries
        out.put((rank, None, traceback.format_exc()))
        return
    try:
        try:
            out.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # reported to the test, with the rank's traceback
        out.put((rank, False, traceback.format_exc()))


class _GroupNotFormed(Exception):
    pass


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 90.0) -> list:
    """``[fn(rank, world_size, *args) for every rank]``, each in its own forked process inside an
    initialised gloo process group. Raises ``AssertionError`` naming the rank that failed (with
    its traceback) or that did not finish within ``timeout`` seconds.

    A group that fails to form (gloo's ``connectFullMesh`` on a loaded machine: "Connection
    closed by peer", seen rarely, under heavy load) is started again, twice at
    most, before ``fn`` ran anywhere; an error of ``fn`` is never retried."""
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout)
        except _GroupNotFormed as e:
            if attempt == 2:
                raise AssertionError(f"the gloo group of {world_size} ranks did not form in 3 "
                                     f"tries:\n{e}") from None
    raise AssertionError("unreachable")


def _run_once(fn, world_size: int, args: tuple, timeout: float) -> list:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, init_file, args, out),
                             daemon=False) for r in range(world_size)]  # (may fork workers)
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size:
                try:
                    rank, ok, value = out.get(timeout=0.5)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                            and r not in results]
                    assert not dead, f"rank(s) {dead} died (exit codes " \
                        f"{[procs[r].exitcode for r in dead]})"
                    assert time.monotonic() < deadline, \
                        f"ranks {sorted(set(range(world_size)) - set(results))} did not finish " \
                        f"within {timeout} s"
                    continue
                if ok is None:
                    raise _GroupNotFormed(f"rank {rank}: {value}")
                assert ok, f"rank {rank} failed:\n{value}"
                results[rank] = value
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
    return [results[r] for r in range(world_size)]
