"""N worker processes: one pipe each; batch payloads come back through shared-memory slots.

The job (dataset, collate_fn, worker_init_fn) reaches the workers once: inherited by ``fork``
(the default on Linux before Python 3.14, as in torch), or pickled by multiprocessing as each
``spawn``/``forkserver`` worker starts (inside its spawning context, as torch, so datasets
holding ``multiprocessing.Value`` or locks work). Tasks and results are small records over a
``multiprocessing.Pipe`` per worker; the consumer waits on all pipes and on the processes'
sentinels at once (``multiprocessing.connection.wait``, in the consumer's own ``get()``: no
receiver thread, so each batch costs one wake-up), so a worker that dies is noticed at once and
reported with its exit code and the sample indices it was fetching. Large tensors are handed to
the consumer as views of their slot (no copy; the slot goes back to its worker once they are all
gone), small ones (< 256 KiB) are copied so that keeping, say, the labels never pins a slot; with
pinning, the batch is copied once, straight into pinned memory. Slots have no name (see
``shm.py``), so nothing is left behind whichever process dies. Workers poll for their parent
every second and exit when it is gone.

Shutdown (``close()``, idempotent; also at interpreter exit): each worker is asked to stop; one
busy with a task is terminated at once (its work is abandoned: a time-out, an error or Ctrl-C
must not wait for a sleeping ``__getitem__``) and killed if still there after 0.1 s; an idle one
exits by itself (milliseconds; it is given 1 s before it is terminated, so that it can flush
what it printed). Workers do not run the parent's Python signal handlers (``_worker_signals``):
a framework's SIGTERM handler never sees the termination.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import pickle
import queue
import secrets
import sys
import time
import warnings
from multiprocessing.connection import wait
from multiprocessing.reduction import recv_handle, send_handle

from kuat.engine import shm
from kuat.engine.base import (
    FAIL,
    OK,
    PIN,
    SEND,
    ClosedOnExit,
    Failure,
    Result,
    Task,
    describe_failure,
    describe_key,
    describe_worker,
    failure,
    key_indices,
    serve,
)
from kuat.engine.failure import add_note
from kuat.errors import WorkerError

log = logging.getLogger("kuat.engine.process")

__all__ = ["ProcessEngine"]

_JOIN_S = 1.0  # close(): how long an idle worker may take to exit before it is terminated
_KILL_S = 0.1  # close(): how long a terminated worker may take to end before it is killed


def _worker_signals() -> None:
    """A worker's signal handlers: torch's worker ones, not the parent's.

    A forked worker inherits the parent's Python signal handlers: a framework's SIGTERM handler
    (Lightning's logs "Received SIGTERM" and lets the process go on) would then run in every
    busy worker that ``close()`` terminates, and keep it alive until it is killed. As torch's
    workers (``torch.utils.data._utils.worker._worker_loop``), SIGTERM is reset to its default
    and torch's C handlers are installed: SIGTERM from the parent exits quietly, SIGSEGV, SIGBUS
    and SIGFPE print which worker crashed before the process dies of the signal.
    """
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        from torch.utils.data._utils import signal_handling

        signal_handling._set_worker_signal_handlers()
    except Exception:  # a torch without them: the default SIGTERM is enough
        pass


_YOUNG = 10_000  # a worker's young-generation threshold (CPython's default: 700)


def _young_threshold(gc) -> None:
    """Raise the worker's young-generation collection threshold to ``_YOUNG`` containers.

    A worker builds batches of short-lived containers (rows, lists of token ids, samples)
    that live for a block or a batch: at CPython's default (700) a young collection runs every
    700 of them still alive, and traverses every one (each list's items too, which misses the
    caches) before it dies; on a streamed Hugging Face dataset with a batched ``map`` that was
    about a quarter of a worker's CPU (docs/benchmarks.md). Garbage without reference cycles
    is freed by reference counting either way; cyclic garbage waits for at most ``_YOUNG``
    containers instead of 700. A threshold already at or above ``_YOUNG``, or automatic
    collection off (threshold 0, ``gc.disable()``), inherited from the parent by ``fork``, is
    kept; ``worker_init_fn`` runs after this and may set its own."""
    young, older, oldest = gc.get_threshold()
    if 0 < young < _YOUNG:
        gc.set_threshold(_YOUNG, older, oldest)


def _worker_main(payload, worker_id, num_workers, name, base_seed, conn, prefix, parent_pid):
    """Entry point of a worker process."""
    import gc
    import pickle

    _worker_signals()
    # Objects inherited through fork are never garbage: keep the collector off them, so it
    # neither spends time on the parent's heap nor touches (copies) its pages.
    gc.freeze()
    _young_threshold(gc)  # before worker_init_fn (job.start), which may set its own
    job = pickle.loads(payload) if isinstance(payload, bytes) else payload
    writer = shm.SlotWriter(prefix, worker_id)
    current: dict = {}

    # The loader's death shows as this process being re-parented. Its parent at start is the
    # loader with fork and spawn, but the forkserver's server with forkserver (whose pid is not
    # parent_pid), so compare with the parent it had, as torch's ManagerWatchdog does.
    first_parent = os.getppid()

    def recv():
        while not conn.poll(1.0):
            if os.getppid() != first_parent:
                return None
        msg = conn.recv()
        if msg is None:
            return None
        current["task"], current["slot"] = msg
        return current["task"]

    def send(result: Result):
        # Synchronous: a result is on the wire before the next batch starts, so a worker that
        # crashes later loses nothing it finished.
        fd = None
        try:
            if result.kind == OK:
                result.value, fd = writer.write(result.value, current["slot"])
            conn.send(result)
            if fd is not None:  # a new slot: its descriptor follows the result that names it
                send_handle(conn, fd, parent_pid)
        except (BrokenPipeError, EOFError, ConnectionError):
            raise
        except Exception as e:
            conn.send(Result(result.task_id, worker_id, FAIL,
                             failure(e, name, describe_worker(name, "process"), SEND,
                                     current["task"].key), None))
        finally:
            if fd is not None:
                os.close(fd)

    try:
        serve(job, worker_id, num_workers, "process", name, base_seed, recv, send)
    except (KeyboardInterrupt, BrokenPipeError, EOFError, ConnectionError):
        pass  # the consumer raises its own KeyboardInterrupt, or is gone
    finally:
        writer.close()
        conn.close()
    # Skip interpreter finalisation (torch's is slow): nothing of the worker's needs it.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)


def _signal_name(signum: int) -> str:
    """``"Segmentation fault"`` for 11 (``strsignal``, as torch's message), else its number."""
    import signal

    try:
        return signal.strsignal(signum) or f"signal {signum}"
    except ValueError:
        return f"signal {signum}"


class ProcessEngine(ClosedOnExit):
    """``num_workers`` processes running ``job``; see the package docstring for the API.

    Args:
        payload: the job (or, from older callers, the job pickled into bytes).
        num_workers: number of processes.
        base_seed: seed of the first epoch (per-worker global RNGs: ``base_seed + worker id``).
        context: a ``multiprocessing`` context.
        pin: copy batches out of shared memory straight into pinned (page-locked) memory.
        warn_pickle: warn (torch's words) before re-raising a pickling error of a worker's
            start; False where the caller falls back to other workers (``_workers.py``).

    Raises:
        TypeError, AttributeError, pickle.PicklingError: the job cannot be pickled for a
            ``spawn``/``forkserver`` context (the workers started so far are closed).
    """

    def __init__(self, payload, num_workers: int, base_seed: int, context, *, pin: bool = False,
                 name: str = "kuat-worker", warn_pickle: bool = True):
        self.num_workers = num_workers
        self.pin = pin
        self._closed = False
        self._prefix = f"kuat-{os.getpid()}-{secrets.token_hex(4)}"
        reaped = shm.reap_orphans()
        if reaped:
            log.warning(
                "removed %d shared-memory slot(s) left in %s by loaders whose process was killed",
                len(reaped),
                shm.SHM_DIR,
            )
        # per worker, its slots ready for its next task: ((worker, n), size)
        self._free: list[list[tuple[tuple[int, int], int]]] = [[] for _ in range(num_workers)]
        self._maps: dict[tuple[int, int], object] = {}  # slot -> the consumer's mapping
        self._pending: list[collections.deque] = [collections.deque() for _ in range(num_workers)]
        self._conns, self._procs = [], []
        self._results: collections.deque[Result] = collections.deque()  # received, not yet taken
        self._dead: int | None = None  # a worker found dead while results were still queued
        self._ended: dict[int, Failure] = {}  # worker -> the SystemExit/KeyboardInterrupt it ended on
        self._track()
        try:
            for i in range(num_workers):
                parent, child = context.Pipe(duplex=True)
                p = context.Process(
                    target=_worker_main,
                    args=(payload, i, num_workers, f"{name}-{i}", base_seed, child, self._prefix,
                          os.getpid()),
                    name=f"{name}-{i}",
                    daemon=True,
                )
                try:
                    p.start()
                except (TypeError, AttributeError, pickle.PicklingError):
                    if not warn_pickle:
                        raise
                    warnings.warn(  # torch's words (its test matches them)
                        "Got pickle error when attempting to start a worker Process. "
                        "This might be because the worker Process arguments are not picklable. "
                        "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX "
                        "platforms to 'forkserver', which requires the worker Process arguments "
                        "to be picklable. You can also try multiprocessing.set_start_method('fork').",
                        stacklevel=4,
                    )
                    raise
                child.close()
                self._conns.append(parent)
                self._procs.append(p)
        except BaseException:
            self.close()
            raise
        self._by_conn = {c: i for i, c in enumerate(self._conns)}
        self._by_sentinel = {p.sentinel: i for i, p in enumerate(self._procs)}
        self._waitables = self._conns + list(self._by_sentinel)

    def worker_name(self, worker_id: int) -> str:
        return self._procs[worker_id].name

    def submit(self, worker_id: int, task: Task) -> None:
        free = self._free[worker_id]
        slot = free.pop() if free else None
        self._pending[worker_id].append((task, slot))
        try:
            self._conns[worker_id].send((task, slot))
        except (BrokenPipeError, ConnectionResetError):
            # The worker has ended: after a SystemExit or KeyboardInterrupt in its task it
            # sends that failure and exits; a crash sends nothing. get() raises either one
            # (the failure it finds in the pipe, else a WorkerError naming this pending task),
            # not this BrokenPipeError, which names neither the worker nor the sample.
            pass

    def get(self, timeout_s: float | None = None) -> Result:
        """The next result to arrive, its batch already mapped out of shared memory.

        Waits in the calling (consumer) thread on every pipe and every process sentinel at once.
        There is no receiver thread: a result costs one wake-up of the consumer, not a wake-up
        of a receiver thread plus a GIL hand-over to the consumer (on a busy machine each
        wake-up can cost a scheduler tick). Every pipe found ready is drained in one go. Call
        from one consumer thread only.

        Raises:
            queue.Empty: nothing arrived within ``timeout_s`` seconds.
            WorkerError: a worker process died (its exit code and pending indices named).
            RuntimeError: the engine was closed.
        """
        if self._results:
            return self._results.popleft()
        if self._closed:
            raise RuntimeError("this kuat ProcessEngine was closed (its workers are stopped)")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._dead is not None:
                self._raise_dead(self._dead)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(self._waitables, remaining)
            if not ready:
                raise queue.Empty
            for obj in ready:  # results first: a worker may have sent and then died
                w = self._by_conn.get(obj)
                if w is not None:
                    try:
                        self._results.append(self._receive(w))
                    except (EOFError, ConnectionError):  # ConnectionResetError: it ended
                        self._dead = w                    # with tasks of ours still unread
                else:
                    w = self._by_sentinel[obj]
                    if not self._conns[w].poll():
                        self._dead = w
            if self._results:  # a death found here is raised once these are taken
                return self._results.popleft()

    def _receive(self, w: int) -> Result:
        r: Result = self._conns[w].recv()
        task, slot = self._pending[w].popleft()
        if r.kind == FAIL and r.value.ends_worker:
            self._ended[w] = r.value
        value = r.value
        if isinstance(value, shm.ShmBatch):
            if value.new:  # the worker made a new slot (none given, or too small)
                fd = recv_handle(self._conns[w])
                try:
                    self._maps[value.slot] = shm.map_fd(fd, value.size)
                finally:
                    os.close(fd)
                if slot is not None:
                    self._retire(slot[0])
                slot = (value.slot, value.size)
            mm = self._maps[value.slot]
            if self.pin:  # one copy, straight into pinned memory
                try:
                    r.value = shm.read_batch(value, mm, pin=True)
                except Exception as e:  # pinned memory exhausted, no accelerator: which batch
                    add_note(e, f"Raised in the kuat DataLoader's own thread "
                                f"{describe_failure(PIN, task.key)}, reading it from kuat "
                                f"worker {self._procs[w].name}.")
                    raise
            else:  # zero-copy: the slot comes back when the batch's large tensors are gone
                r.value = shm.view_batch(value, mm, functools.partial(self._free[w].append, slot))
                return r
        if slot is not None:
            self._free[w].append(slot)
        return r

    def _retire(self, sid: tuple[int, int]) -> None:
        mm = self._maps.pop(sid, None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views of it are still alive; unmapped when they go
                pass

    def _raise_dead(self, w: int):
        ended = self._ended.get(w)
        if ended is not None:  # it reported why it ended: raise that, not "exit code 0"
            self.close()
            raise ended.exception()
        p = self._procs[w]
        p.join(0.1)
        name, pid, code = p.name, p.pid, p.exitcode
        keys = [describe_key(t.key) for t, _ in self._pending[w]]
        indices = [i for t, _ in self._pending[w] for i in (key_indices(t.key) or [])]
        self.close()
        what = f"while fetching {', '.join(keys) or 'nothing'}"
        if code is not None and code < 0:  # torch's words for a signal, then where it was
            message = (f"DataLoader worker (pid {pid}) is killed by signal: "
                       f"{_signal_name(-code)}. kuat worker process {name} died {what}")
        else:
            message = (f"kuat worker process {name} (pid {pid}) exited unexpectedly with exit "
                       f"code {code} {what}")
        raise WorkerError(
            message,
            original_type="",
            worker=name,
            indices=indices or None,
        )

    @staticmethod
    def _end(procs, deadline: float) -> None:
        """Wait for terminated ``procs`` until ``deadline``, then kill those still there (a
        SIGTERM handler inherited from the parent can keep a worker in the dataset)."""
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(1.0)

    def close(self) -> None:
        """Stop the workers and unmap every slot. Idempotent.

        A worker busy with a task is terminated at once (killed after ``_KILL_S``), so that an
        error path never waits for the dataset; an idle worker exits by itself (``_JOIN_S`` at
        most). The memory of slots whose batches the caller still holds stays mapped until
        those tensors are gone.
        """
        if self._closed:
            return
        self._closed = True
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, ValueError):
                pass
        busy = [p for w, p in enumerate(self._procs) if self._pending[w]]
        idle = [p for w, p in enumerate(self._procs) if not self._pending[w]]
        for p in busy:
            p.terminate()
        self._end(busy, time.monotonic() + _KILL_S)
        deadline = time.monotonic() + _JOIN_S
        for p in idle:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in idle:
            if p.is_alive():
                p.terminate()
        self._end(idle, time.monotonic() + _KILL_S)
        for c in self._conns:
            c.close()
        for p in self._procs:
            try:
                p.close()
            except ValueError:
                pass
        for sid in list(self._maps):
            self._retire(sid)
        shm.unlink_prefix(self._prefix)
        for free in self._free:
            free.clear()
        self._results.clear()
        self._untrack()
