"""Where an epoch's first batch spends its time, under the memory states a benchmark can leave.

Not a test: prints a table. Each measurement runs in a fresh interpreter (as ``kuat bench``'s
rounds do): import kuat and torch, then ``kuat.open`` + ``with_transform(Compose([
RandomResizedCrop(224), RandomHorizontalFlip()]))`` + ``kuat.DataLoader(batch_size=64,
num_workers=2, shuffle=True)`` + ``next(iter(loader))``, the rest of epoch 0, and epoch 1.
The child records, relative to ``iter()``: worker start, the first submit, the fetch, the
batch kernel and each of its parts (:mod:`kuat._parallel`), every :class:`kuat._buffers
.BufferPool` ``take`` and the first touch of each new buffer, and the result's arrival; plus
this process's page faults and CPU seconds and ``/proc/vmstat``'s compaction, reclaim and THP
counters over the first batch.

Conditions, set up by the parent just before each child starts:

- ``warm``: nothing (the shard in the page cache from earlier runs);
- ``dirty``: ``--dirty-gb`` GiB just written to a file next to the dataset, not synced (what a
  benchmark's data preparation leaves for writeback);
- ``cold``: ``sync`` then ``echo 1 > /proc/sys/vm/drop_caches`` (root only): the shard, the
  Python modules and the shared libraries are read from disk;
- ``freed``: ``--freed-gb`` GiB of anonymous memory touched and freed by another process
  ``--freed-wait-s`` seconds before (what the previous round's loader leaves): on a VM whose
  kernel reports free memory to the host (virtio-balloon free page reporting), that memory
  goes back to the host after about 2 s and the next first touch faults it in from there;
- ``full``: the page cache filled with all but ``--free-mib`` of free memory (reading a sparse file:
  no disk I/O): what a machine that ran for hours (or a benchmark that read and wrote GBs)
  looks like, where a fresh huge page needs direct reclaim and compaction.

Each condition runs with ``MADV_HUGEPAGE`` on the batch buffers (``on``, kuat's setting) and
off (``off``), interleaved, ``--repeats`` times::

    python -m benchmarks.first_batch --conditions warm full --repeats 5

What it showed (2-core VM, 2026-12-01): warm, 0.05-0.07 s (engine start 1 ms, shard open
and gather 4 ms, crop planning 5 ms, the batch kernel split over 2 threads 35-40 ms; later
that day, with the AVX2 resize and the job-by-job split, 0.037-0.048 s, the kernel 29-34 ms
with both threads ending within 0.3 ms of each other); ``dirty``
(2 GiB), ``freed`` (2 GiB), ``full`` and ``MADV_HUGEPAGE`` off: within that noise, no
compaction or reclaim stall; ``cold`` (root only): 0.28-1.66 s, spent in the crop planning
that faulted the rows in one disk read at a time, until the gather asked for them all at once
(``madvise(MADV_WILLNEED)``): 0.12-0.20 s.

(the repository root on ``PYTHONPATH``; ``--dataset`` defaults to the bench's converted
ImageNet-like corpus, which a ``kuat bench`` run prepares).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VMSTAT_KEYS = (
    "compact_stall", "compact_fail", "compact_success", "allocstall_movable", "allocstall_normal",
    "pgscan_direct", "pgsteal_direct", "thp_fault_alloc", "thp_fault_fallback", "pgmajfault",
    "nr_dirty", "nr_writeback", "nr_free_pages",
)  # fmt: skip


def vmstat() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                k, v = line.split()
                if k in VMSTAT_KEYS:
                    out[k] = int(v)
    except OSError:
        pass
    return out


# ---------------------------------------------------------------------------------------- child


def _child(cfg: dict) -> dict:
    import resource
    import threading

    import numpy as np
    import torch  # noqa: F401  (imported before the clock, as the bench's worker does)

    import kuat
    import kuat.loader  # noqa: F401
    import kuat.vision.compose as kt
    from kuat import _buffers, _parallel
    from kuat import vision as kv
    from kuat.engine import job as kjob
    from kuat.engine import thread as kthread

    if cfg.get("hugepage") is not None and not cfg["hugepage"]:
        _buffers._HUGEPAGE = None
    events: list[tuple] = []  # (name, thread, start_s, end_s, cpu_s, extra)
    t_ref = [time.perf_counter()]
    lock = threading.Lock()

    def record(name, t0, c0, extra=None):
        t1 = time.perf_counter()
        with lock:
            events.append((name, threading.current_thread().name, t0 - t_ref[0], t1 - t_ref[0],
                           time.thread_time() - c0, extra))

    def timed(name, fn):
        def wrapper(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                record(name, t0, c0)
        return wrapper

    kthread.ThreadEngine.__init__ = timed("engine start", kthread.ThreadEngine.__init__)
    kthread.ThreadEngine.submit = timed("submit", kthread.ThreadEngine.submit)
    kjob.FetchJob.start = timed("worker job.start", kjob.FetchJob.start)
    kjob.FetchJob.run = timed("job.run (fetch+collate)", kjob.FetchJob.run)
    from kuat import rng as krng
    from kuat.format import store as kstore
    from kuat.sources import dataset as kds

    kds.Dataset.kuat_fetch_collated = timed("  fetch_collated", kds.Dataset.kuat_fetch_collated)
    kstore.Store.gather = timed("    store.gather", kstore.Store.gather)
    kds.BatchGenerators = timed("    BatchGenerators", krng.BatchGenerators)
    kv.Compose.apply_encoded_many = timed("    apply_encoded_many", kv.Compose.apply_encoded_many)
    kv.Compose._plan_in_c = timed("      plan_rrc (C)", kv.Compose._plan_in_c)
    kt._decode_resize_split = timed("batch kernel (split)", kt._decode_resize_split)
    kt.decode_resize_batch = timed("  decode_resize_batch part", kt.decode_resize_batch)
    _parallel._run_part = timed("  helper part", _parallel._run_part)
    take = _buffers.BufferPool.take

    def timed_take(self, nbytes):
        created = self.created
        t0, c0 = time.perf_counter(), time.thread_time()
        lease = take(self, nbytes)
        record("pool.take", t0, c0, "new" if self.created > created else "reused")
        if self.created > created and cfg.get("touch_probe"):
            # what the kernel's first write costs: fault the fresh buffer in here, alone
            t0, c0 = time.perf_counter(), time.thread_time()
            lease[:: 4096] = 0
            record("first touch of new buffer", t0, c0)
        return lease

    _buffers.BufferPool.take = timed_take

    path = cfg["dataset"]
    ru0, vm0 = resource.getrusage(resource.RUSAGE_SELF), vmstat()
    t0 = time.perf_counter()
    ds = kuat.open(path).with_transform(
        {"image": kv.Compose([kv.RandomResizedCrop(224), kv.RandomHorizontalFlip()])}
    )
    loader = kuat.DataLoader(ds, batch_size=64, num_workers=2, shuffle=True, drop_last=True,
                             persistent_workers=True, seed=0)
    setup_s = time.perf_counter() - t0
    t_ref[0] = time.perf_counter()
    it = iter(loader)
    batch = next(it)
    ttfb_s = time.perf_counter() - t_ref[0]
    ru1, vm1 = resource.getrusage(resource.RUSAGE_SELF), vmstat()
    first_events = sorted(events, key=lambda e: e[2])
    n = int(batch["image"].shape[0])
    for b in it:
        n += int(b["image"].shape[0])
    epoch0_s = time.perf_counter() - t_ref[0]
    ru2, vm2 = resource.getrusage(resource.RUSAGE_SELF), vmstat()
    t1 = time.perf_counter()
    m = sum(int(b["image"].shape[0]) for b in loader)
    epoch1_s = time.perf_counter() - t1
    loader.close()

    def ru_delta(a, b):
        return {"minflt": b.ru_minflt - a.ru_minflt, "majflt": b.ru_majflt - a.ru_majflt,
                "utime_s": b.ru_utime - a.ru_utime, "stime_s": b.ru_stime - a.ru_stime}

    def vm_delta(a, b):
        return {k: b.get(k, 0) - a.get(k, 0) for k in VMSTAT_KEYS if not k.startswith("nr_")}

    return {
        "setup_s": setup_s, "ttfb_s": ttfb_s, "epoch0_s": epoch0_s, "epoch1_s": epoch1_s,
        "epoch0_img_s": n / epoch0_s, "epoch1_img_s": m / epoch1_s,
        "first_batch_rusage": ru_delta(ru0, ru1), "epoch0_rest_rusage": ru_delta(ru1, ru2),
        "first_batch_vmstat": vm_delta(vm0, vm1), "epoch0_rest_vmstat": vm_delta(vm1, vm2),
        "at_start": {k: vm0.get(k) for k in ("nr_dirty", "nr_writeback", "nr_free_pages")},
        "events": first_events,
        "hugepage": _buffers._HUGEPAGE is not None,
        "sum_pixels": int(np.asarray(batch["image"]).sum() % 1000),
    }


# --------------------------------------------------------------------------------------- parent


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v.split()[0]) * 1024
    return out


class _Condition:
    """Sets up one memory state before a child runs and undoes it after."""

    def __init__(self, name: str, args, scratch: Path):
        self.name, self.args, self.scratch = name, args, scratch
        self.files: list[Path] = []

    def __enter__(self):
        a = self.args
        if self.name == "dirty":
            f = self.scratch / "dirty.bin"
            chunk = os.urandom(1 << 20)
            with open(f, "wb") as fh:
                for _ in range(int(a.dirty_gb * 1024)):
                    fh.write(chunk)
            self.files.append(f)
        elif self.name == "cold":
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
        elif self.name == "freed":
            hog = ("import mmap, sys; n = int(sys.argv[1]); m = mmap.mmap(-1, n, "
                   "flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
                   "for k in range(0, n, 4096): m[k] = 1")
            subprocess.run([sys.executable, "-c", hog, str(int(a.freed_gb * 2**30))], check=True)
            time.sleep(a.freed_wait_s)
        elif self.name == "full":
            free = _meminfo()["MemFree"]
            fill = max(0, free - a.free_mib * 2**20)
            f = self.scratch / "fill.sparse"
            with open(f, "wb") as fh:
                fh.truncate(fill)
            with open(f, "rb") as fh:  # holes: page cache pages, no disk reads
                while fh.readinto(bytearray(64 << 20)):
                    pass
            self.files.append(f)
        elif self.name != "warm":
            raise ValueError(f"unknown condition={self.name!r}")
        self.free_at_start = _meminfo()["MemFree"]
        return self

    def __exit__(self, *exc):
        for f in self.files:
            f.unlink(missing_ok=True)  # the page cache of a deleted file is freed at once


def _run_child(cfg: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
        spec = f.name
    try:
        out = subprocess.run([sys.executable, "-m", "benchmarks.first_batch", "--child", spec],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        os.unlink(spec)


def _default_dataset() -> str:
    from kuat._dirs import cache_root

    bench = cache_root() / "bench/kuat/imagefolder-v2-n2000-s0-4afc0d92.kuat"
    if (bench / "manifest.json").exists():
        return str(bench)
    raise SystemExit(f"no dataset at {bench}: run kuat bench once or pass --dataset")


def _fmt_events(events) -> str:
    lines = []
    for name, thread, t0, t1, cpu, extra in events:
        lines.append(f"      {t0 * 1e3:8.1f} -> {t1 * 1e3:8.1f} ms  {(t1 - t0) * 1e3:7.1f} ms wall "
                     f"{cpu * 1e3:6.1f} ms cpu  {name} [{thread}]{' ' + extra if extra else ''}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dataset", default=None, help="a converted kuat image dataset")
    p.add_argument("--conditions", nargs="+", default=["warm", "full"],
                   choices=["warm", "dirty", "cold", "freed", "full"])
    p.add_argument("--hugepage", nargs="+", default=["on", "off"], choices=["on", "off"],
                   help="MADV_HUGEPAGE on the batch buffers (kuat's default) and/or not")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dirty-gb", type=float, default=2.0)
    p.add_argument("--freed-gb", type=float, default=2.0)
    p.add_argument("--freed-wait-s", type=float, default=3.0)
    p.add_argument("--free-mib", type=int, default=300,
                   help="'full': free memory left after filling the page cache (MiB)")
    p.add_argument("--touch-probe", action="store_true",
                   help="fault each new batch buffer in alone, timed (a separate phase)")
    p.add_argument("--events", action="store_true", help="print every run's phase timeline")
    p.add_argument("--json", help="write every run's record here")
    args = p.parse_args(argv)
    if args.child:
        cfg = json.loads(Path(args.child).read_text())
        print(json.dumps(_child(cfg)))
        return 0
    dataset = args.dataset or _default_dataset()
    scratch = Path(tempfile.mkdtemp(prefix="kuat-fb-", dir=Path(dataset).parent))
    records = []
    try:
        for rep in range(args.repeats):
            for cond in args.conditions:
                for hp in args.hugepage:
                    with _Condition(cond, args, scratch) as c:
                        free = c.free_at_start
                        r = _run_child({"dataset": dataset, "hugepage": hp == "on",
                                        "touch_probe": args.touch_probe})
                    r.update(condition=cond, hp=hp, repeat=rep, free_mib=free / 2**20)
                    records.append(r)
                    fv, fr = r["first_batch_vmstat"], r["first_batch_rusage"]
                    print(f"{rep} {cond:<5} hp={hp:<3} free {r['free_mib']:7.0f} MiB  "
                          f"setup {r['setup_s'] * 1e3:6.1f} ms  first batch "
                          f"{r['ttfb_s'] * 1e3:7.1f} ms  epoch0 {r['epoch0_s']:.2f} s  epoch1 "
                          f"{r['epoch1_s']:.2f} s | compact_stall {fv['compact_stall']} "
                          f"allocstall {fv['allocstall_movable'] + fv['allocstall_normal']} "
                          f"thp {fv['thp_fault_alloc']}/{fv['thp_fault_fallback']} (epoch 0: "
                          f"{fv['thp_fault_alloc'] + r['epoch0_rest_vmstat']['thp_fault_alloc']}) "
                          f"majflt {fr['majflt']} minflt {fr['minflt']} "
                          f"cpu u{fr['utime_s']:.2f}+s{fr['stime_s']:.2f} s", flush=True)
                    if args.events:
                        print(_fmt_events(r["events"]), flush=True)
    finally:
        for f in scratch.iterdir():
            f.unlink()
        scratch.rmdir()
    print("\nmedian [min-max] first batch (ms), epoch 0 (s):")
    for cond in args.conditions:
        for hp in args.hugepage:
            rs = [r for r in records if r["condition"] == cond and r["hp"] == hp]
            tt = sorted(r["ttfb_s"] * 1e3 for r in rs)
            e0 = sorted(r["epoch0_s"] for r in rs)
            print(f"  {cond:<5} hp={hp:<3} {tt[len(tt) // 2]:7.1f} [{tt[0]:.1f}-{tt[-1]:.1f}]"
                  f"   {e0[len(e0) // 2]:.2f} [{e0[0]:.2f}-{e0[-1]:.2f}]")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
