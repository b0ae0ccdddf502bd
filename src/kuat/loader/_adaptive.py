"""The loader's adaptive choices within an epoch, as one policy the iterator consults.

None of them changes a batch (same samples, order, pixels and random streams); they change
where and how far ahead batches are fetched:

* **prefetch depth**: with workers and ``prefetch_factor`` not given, up to
  :data:`CHEAP_PREFETCH` batches per worker are kept in flight while batches are cheap (under
  :data:`CHEAP_BATCH_S` of the worker's CPU and :data:`CHEAP_WALL_FACTOR` times that of wall
  time), so each worker wakes once per several batches instead of once per batch
  (``benchmarks/bench_overhead.py``: a no-op batch costs ~48 us inline, ~80 us with 2 threads
  at depth 2, ~55 us at depth 8, on a loaded 2-core machine);
* **inline fetching**: after :data:`INLINE_PROBE` batches, when most were cheap, the loop
  waited for them and its own time between batches is under :data:`INLINE_MAX_LOOP_SHARE` of
  their work, thread workers hand over to the consumer thread (a hand-off costs more than the
  work); and at once, in this and every later epoch, when the worker choice
  (:mod:`kuat.loader._auto`) found the work GIL-bound with no spare core for processes;
* **threads -> processes** (``worker_type=None``): once the dataset is seen to draw from the
  global random generators, or the first batches show work that holds the GIL
  (:mod:`kuat.loader._auto`, which also picks ``num_workers="auto"``'s count), the epoch
  continues on the chosen workers (a map-style epoch; an iterable's next epoch);
* **first-batch split**: an epoch's first batch of a source whose batch kernel splits
  (``kuat_splits_batches``) is fetched alone with every worker's width, the others held back
  until it is out.

Not thread-safe: the consumer thread's (one policy per epoch iterator).
"""

from __future__ import annotations

import math
import time

__all__ = ["Adaptation", "CHEAP_BATCH_S", "CHEAP_PREFETCH", "INLINE_PROBE"]

# Batches whose fetch + collate take less than this of CPU (the worker thread's own time:
# waiting for the GIL held by the other threads inflates wall times several-fold on a busy
# machine) and less than CHEAP_WALL_FACTOR times it of wall time (a batch waiting on I/O is not
# cheap) are "cheap"
CHEAP_BATCH_S = 0.5e-3
CHEAP_WALL_FACTOR = 4
CHEAP_PREFETCH = 8  # batches in flight per worker while batches are cheap
INLINE_PROBE = 16  # batches observed before deciding to fetch cheap batches in the consumer
INLINE_MIN_SHARE = 0.75  # ... of which at least this share cheap, and waited for by the loop
_INLINE_MIN_CHEAP = math.ceil(INLINE_MIN_SHARE * INLINE_PROBE)  # (cheap ones among the probe's)
# ... and only while the training loop's own time per batch (between next() calls) is under this
# share of the batch's fetch + collate work: worker threads could hide at most that much
INLINE_MAX_LOOP_SHARE = 0.25

NO, WAIT, NOW = 0, 1, 2  # answers of the switch questions: no / once the in-flight batches end / now


class Adaptation:
    """One epoch's adaptive state (see the module docstring).

    Args:
        num_workers: workers of the epoch's engine (1 for the inline engine).
        inline: the engine is the inline one (``num_workers=0``).
        prefetch_factor: batches in flight per worker (the fixed bound).
        adaptive: ``prefetch_factor`` was not given (the loader may prefetch deeper and go inline).
        thread_engine: the engine is thread workers.
        consumer_may_fetch: map-style, no ``worker_init_fn`` (``FetchJob.consumer_may_fetch``).
        agnostic: any thread may fetch a batch (``FetchJob.thread_agnostic``).
        split_first: the source splits batches and this is a map-style epoch.
        auto_processes: ``worker_type=None`` with workers.
        rng_use: the job's ``kuat.engine.isolate.RngUse`` (``draws`` once seen drawing).
        isolates: the job fetches with global-RNG isolation (``FetchJob.isolate_rng``); only
            then do thread workers' first batches of an epoch run watched, and their draws
            get rewound (:meth:`threads_start`, :meth:`loop_has_batch`).
        choice: the loader's ``_auto.WorkerChoice`` while it measures, else ``None``.
        probe: the job's ``SchedProbe`` (on while ``choice`` measures thread workers).
        iterable: an iterable dataset's epoch (moved mid-epoch only when ``replay``).
        replay: the iterable is a deterministic stream per epoch (``kuat.sources.stream.Stream``:
            HF streaming, mixes, shuffle buffers), so new workers may replay the epoch's first
            batches and skip them.
        persistent: ``persistent_workers``.

    ``watching``: whether the iterator must call :meth:`loop_resumed` and :meth:`loop_paused`
    around each batch (False once neither the cheap-batch test nor the worker choice can use
    the loop's time; it never becomes True again).
    """

    def __init__(self, *, num_workers: int, inline: bool, prefetch_factor: int, adaptive: bool,
                 thread_engine: bool, consumer_may_fetch: bool, agnostic: bool,
                 split_first: bool, auto_processes: bool, rng_use, isolates: bool = True,
                 choice=None, probe=None, iterable: bool = False, persistent: bool = False,
                 replay: bool = False):
        self.num_workers = num_workers
        self.max_inflight = 1 if inline else max(1, prefetch_factor * num_workers)
        self._base_inflight = self.max_inflight
        self._prefetch_factor = prefetch_factor
        self._adapt = adaptive and not inline
        self.may_go_inline = self._adapt and thread_engine and consumer_may_fetch
        self._cheap_policy = True  # the cheap-batch test may still send the epoch inline
        self._agnostic = agnostic
        self.first_width = num_workers if num_workers > 1 and not inline and split_first else 1
        self.holding: int | None = None  # task id of the split first batch while it is fetched
        self._auto_processes = auto_processes and thread_engine
        self._engine_kind = "thread" if thread_engine else "process"
        self._rng_use = rng_use
        # the caller's generators kept at an epoch's start: only where a watched fetch may
        # rewind them (a save reads all three generators: about 80 us, with cold caches more)
        self._keeps_caller = thread_engine and not inline and rng_use is not None and isolates
        self._seen = self._cheap = self.blocked = 0
        self._work_s = self._loop_s = 0.0  # of the batches seen: their work; the loop's own time
        self._loop_mark: float | None = None  # thread_time() when next() last returned
        self._choice = choice if choice is not None and choice.probing and not inline else None
        self._probe, self._iterable, self._persistent = probe, iterable, persistent
        self._replay = iterable and replay
        if probe is not None:
            probe.on = self._choice is not None and thread_engine
            if probe.on:
                self._choice.start_probe(probe)
        self._watch()
        self._wall_mark: float | None = None  # perf_counter() when next() last returned
        self._move: tuple[str, int] | None = None  # (type, count) the choice wants now
        # the choice decided on inline fetching (GIL-bound, no core for processes): go at once
        self._inline_chosen = choice is not None and choice.decided and choice.inline

    # --- the training loop's own time (for the inline decision) ------------------------------
    def _watch(self) -> None:
        # whether the loop's time is still wanted: by the cheap-batch test while it may still
        # send the epoch inline, or by the worker choice while it measures (both only ever
        # stop wanting it, so the iterator skips the two calls per batch from then on)
        self.watching = (self.may_go_inline and self._cheap_policy) or self._choice is not None

    def loop_resumed(self) -> None:
        """``next()`` was called: count the loop's CPU time since the last batch (its wall time
        would count the time the workers held the GIL). Needed only while :attr:`watching`."""
        if self._loop_mark is None:
            return
        cpu = time.thread_time() - self._loop_mark
        if self.may_go_inline:
            self._loop_s += cpu
        if self._choice is not None and self._wall_mark is not None:
            self._choice.loop(time.perf_counter() - self._wall_mark, cpu)

    def threads_start(self) -> None:
        """The epoch's thread workers are about to get their first tasks: the caller's
        generator states are kept until the loop has its first batch
        (``kuat.engine.isolate.RngUse.caller_state``)."""
        if self._keeps_caller:
            self._rng_use.threads_start()

    def loop_has_batch(self) -> None:
        """The loop got the epoch's first batch (it may draw from here on): once the thread
        workers' fetches begun before it have ended (``RngUse.loop_has_batch``)."""
        if self._keeps_caller:
            self._rng_use.loop_has_batch()

    def loop_paused(self) -> None:
        """``next()`` returns a batch."""
        if self.may_go_inline or self._choice is not None:
            self._loop_mark = time.thread_time()
        if self._choice is not None:
            self._wall_mark = time.perf_counter()

    # --- results -----------------------------------------------------------------------------
    def on_result(self, st) -> None:
        """A worker's result arrived with its ``WorkStats``: measure it for the worker choice
        and adapt the prefetch depth."""
        if self._choice is not None and self._choice.observe(st):
            self._decide()
        if not self._adapt:
            return
        # Cheap batches (the work takes less than a worker hand-off and wake-up costs many
        # times over): keep more in flight so each worker wakes once per several batches.
        work = st.fetch_s + st.collate_s
        cheap = (st.fetch_cpu_s + st.collate_s < CHEAP_BATCH_S
                 and work < CHEAP_WALL_FACTOR * CHEAP_BATCH_S)
        self.max_inflight = self.num_workers * CHEAP_PREFETCH if cheap else self._base_inflight
        self._seen += 1
        self._cheap += cheap
        self._work_s += work
        if (self._cheap_policy and self._seen <= INLINE_PROBE
                and self._seen - self._cheap > INLINE_PROBE - _INLINE_MIN_CHEAP):
            # more of the first INLINE_PROBE batches were not cheap than inline_wanted allows:
            # its answer is NO already, so stop timing the loop now, not after the probe (the
            # image path's batches: from the 5th, not the 16th, of every epoch)
            self._cheap_policy = False
            self._watch()
        if st.worker_info_consulted and not self._agnostic:
            self.may_go_inline = False  # its batches may depend on the worker
            self._watch()

    def _decide(self) -> None:
        choice, self._choice = self._choice, None
        self._watch()
        if self._probe is not None:
            self._probe.on = False
        kind, count = choice.decide(num_workers=self.num_workers, iterable=self._iterable,
                                    persistent=self._persistent and not self._replay)
        if choice.inline and not self.may_go_inline:
            choice.inline = False
            choice.reason += (" (not inline: this loader may not fetch in the loop's thread: "
                              "prefetch_factor given, a worker_init_fn, or batches that depend "
                              "on the worker; threads kept)")
        self._inline_chosen = choice.inline
        if ((not self._iterable or self._replay)
                and (kind, count) != (self._engine_kind, self.num_workers)):
            self._move = (kind, count)  # (another iterable's next epoch starts on them)

    # --- switches ----------------------------------------------------------------------------
    @property
    def move_to(self) -> tuple[str, int]:
        """``(worker_type, num_workers)`` :meth:`processes_wanted` asks for."""
        return self._move if self._move is not None else ("process", self.num_workers)

    def processes_wanted(self, busy: bool) -> int:
        """``NOW`` to move to other workers: process workers under ``worker_type=None`` once the
        dataset draws from the global RNGs, or the workers :mod:`._auto` chose (:attr:`move_to`);
        ``WAIT`` while batches are in flight (``busy``), else ``NO``."""
        if self._move is not None:
            return WAIT if busy else NOW
        use = self._rng_use
        # not while workers draw from the streams their worker_init_fn seeded: new workers
        # would start them again (the next epoch's workers are processes: _workers.py)
        if not (self._auto_processes and use.draws) or use.worker_seeded:
            return NO
        return WAIT if busy else NOW

    def moved_to_processes(self, num_workers: int, kind: str | None = None) -> None:
        """The move :meth:`processes_wanted` asked for is done, to ``num_workers`` workers of
        ``kind`` (default :attr:`move_to`'s; threads where processes could not start)."""
        kind = kind or self.move_to[0]
        if self._move is None and self._choice is not None:  # moved for the RNG: no more
            self._choice = None  # measuring (the loader's choice says why: _workers.py)
            if self._probe is not None:
                self._probe.on = False
        self.num_workers, self._move, self._engine_kind = num_workers, None, kind
        self.may_go_inline = self.may_go_inline and kind == "thread"
        self._auto_processes = False
        self.max_inflight = self._base_inflight = max(1, self._prefetch_factor * num_workers)
        self._watch()

    def inline_wanted(self, busy: bool) -> int:
        """``NOW`` to fetch the rest of the epoch in the consumer thread, ``WAIT`` while worker
        batches are in flight (``busy``), ``NO`` otherwise (and never again this epoch for cheap
        batches).
        Under the worker choice's inline decision, ``NOW`` (or ``WAIT``) from the first batch,
        whatever the batches cost (its measurement stands for the loader)."""
        if not self.may_go_inline:
            return NO
        if self._inline_chosen:
            return WAIT if busy else NOW
        if not (self._cheap_policy and self._seen >= INLINE_PROBE):
            return NO
        need = INLINE_MIN_SHARE * self._seen
        if (self._cheap < need or self.blocked < need
                or self._loop_s > INLINE_MAX_LOOP_SHARE * self._work_s):
            self._cheap_policy = False  # (the worker choice may still decide on inline)
            self._watch()
            return NO
        return WAIT if busy else NOW

    def steady(self) -> bool:
        """Whether :meth:`processes_wanted` and :meth:`inline_wanted` would both answer ``NO``
        now and change nothing (the usual case, checked once per batch instead of asking
        both); ``False`` when either may answer otherwise (then ask them)."""
        if self._move is not None:
            return False
        use = self._rng_use
        if self._auto_processes and use.draws and not use.worker_seeded:
            return False
        return not (self.may_go_inline and (self._inline_chosen or (
            self._cheap_policy and self._seen >= INLINE_PROBE)))

    def moved_inline(self) -> None:
        self.num_workers = 1
        self.max_inflight, self._adapt, self.may_go_inline = 1, False, False
        self._auto_processes = False
        self._watch()

    @property
    def base_inflight(self) -> int:
        """The fixed prefetch bound, ``prefetch_factor * num_workers`` (not the deeper one
        kept while batches are cheap)."""
        return self._base_inflight

    @property
    def agnostic(self) -> bool:
        """Any thread may fetch a batch (``FetchJob.thread_agnostic``)."""
        return self._agnostic

    @property
    def adaptive(self) -> bool:
        """The prefetch depth still adapts (workers, ``prefetch_factor`` not given)."""
        return self._adapt

    @property
    def cheap(self) -> int:
        """Batches seen so far that were cheap."""
        return self._cheap

    def first_batch_width(self, returned: int, in_flight: int, ready: int) -> int:
        """Threads for the task about to be submitted: all workers' for the epoch's first batch
        of a splitting source (nothing else in flight), else 1."""
        if self.first_width > 1 and returned == 0 and in_flight == 1 and not ready:
            return self.first_width
        return 1
