"""What a loader tells its user once: warnings and advice drawn from what it saw.

Each function takes the loader's face and remembers on it that it spoke (``_warned``,
``_advised``, ``_warned_unsplit``), so each notice is given once per loader (per distinct
error for skipped samples). Called from the consumer thread (the iterator's events).
"""

from __future__ import annotations

import logging
import os
import re
import warnings

__all__ = ["advise", "iterable_length", "unsplit_iterable", "skipped", "worker_number"]

log = logging.getLogger("kuat.loader")


def advise(loader) -> None:
    """Once per loader: say so when global-RNG isolation serialises thread workers."""
    if (loader._advised or loader.worker_type != "thread" or loader.num_workers < 2
            or loader._options.auto_worker_type):
        return
    s = loader._stats
    if s.rng_wait_s > 0.25 * max(s.fetch_s, 1e-9) and s.rng_wait_s > 0.1:
        loader._advised = True
        log.warning(
            "kuat.DataLoader: thread workers spent %.1f s of %.1f s of fetching waiting for "
            "global-RNG isolation (samples run one at a time so that random/np.random/torch "
            "draws are reproducible). If the dataset draws no global randomness pass "
            "isolate_global_rng=False; otherwise draw from kuat.sample_rng(index) and set "
            "kuat_uses_sample_rng = True on the dataset, or use worker_type='process'.",
            s.rng_wait_s, s.fetch_s,
        )


def iterable_length(loader, reported: int, yielded: int) -> None:
    """torch's warning, word for word, at every batch an epoch's iterator returns past the
    ``len(dataset)`` that ``len(loader)`` read (torch compares that number of samples with
    the number of batches yielded: so does kuat)."""
    if yielded <= reported:
        return
    msg = (f"Length of IterableDataset {loader.dataset} was reported to be {reported}"
           f"(when accessing len(dataloader)), but {yielded} samples have been fetched. ")
    if loader.num_workers > 0:
        msg += ("For multiprocessing data-loading, this could be caused by not properly "
                "configuring the IterableDataset replica at each worker. Please see "
                "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                "for examples.")
    warnings.warn(msg, stacklevel=4)


def unsplit_iterable(loader) -> None:
    """Once per loader: an IterableDataset that never asked which worker it runs in. Not for
    one with ``__len__``: torch's own warning (:func:`iterable_length`) speaks for those, and
    kuat says what torch says."""
    if loader._warned_unsplit or callable(getattr(loader.dataset, "__len__", None)):
        return
    loader._warned_unsplit = True
    warnings.warn(
        f"kuat DataLoader: the IterableDataset {type(loader.dataset).__name__} never called "
        f"torch.utils.data.get_worker_info() in its workers, so each of the "
        f"{loader.num_workers} workers yields the whole dataset and every item arrives "
        f"{loader.num_workers} times (as with torch's DataLoader). Split the items in __iter__ "
        "by get_worker_info().id and .num_workers (or in worker_init_fn, the recipe in "
        "torch's IterableDataset documentation), or use num_workers=1",
        UserWarning,
        stacklevel=4,
    )


def skipped(loader, samples) -> None:
    """Warn once per distinct error (digits ignored) of samples dropped by ``on_error="skip"``;
    ``samples``: ``(index, exception type name, message)`` tuples."""
    for index, type_name, message in samples:
        key = (type_name, re.sub(r"\d+", "#", message))
        if key not in loader._warned:
            loader._warned.add(key)
            warnings.warn(
                f"kuat DataLoader skipped sample {index}: {type_name}: {message} "
                "(on_error='skip'; later samples failing the same way are only counted in "
                "stats()['skipped_samples'])",
                RuntimeWarning,
                stacklevel=4,
            )


def worker_number(loader) -> None:
    """Warn, as torch does and in torch's words, when more worker *processes* than usable
    CPUs are asked for (``DataLoader.check_worker_number_rationality``). Thread workers are
    not counted: they are cheap and mostly wait on work that releases the GIL."""
    if not loader.num_workers or loader.worker_type != "process":
        return
    # torch's count: the CPUs this process may run on where os.sched_getaffinity exists
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cpus is not None and loader.num_workers <= cpus:
        return
    cpuset = "" if hasattr(os, "sched_getaffinity") else " (`cpuset` is not taken into account)"
    suggest = (f"Our suggested max number of worker in current system is {cpus}{cpuset}, "
               "which is smaller than what this DataLoader is going to create."
               if cpus is not None else
               "DataLoader is not able to compute a suggested max number of worker in "
               "current system.")
    warnings.warn(
        f"This DataLoader will create {loader.num_workers} worker processes in total. "
        f"{suggest} Please be aware that excessive worker creation might get DataLoader "
        "running slow or even freeze, lower the worker number to avoid potential "
        "slowness/freeze if necessary.",
        stacklevel=5,
    )
