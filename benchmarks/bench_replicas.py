"""Feeding replica groups: every rank reads (``replicas="read"``) vs one leader per group reads
and broadcasts (``replicas="broadcast"``), on gloo over 127.0.0.1 (issue #28).

Not a test: prints a table. ``python -m benchmarks.bench_replicas [--world 4] [--tp 4]
[--batches 30] [--rounds 5] [--size 128] [--workers 0] [--dataset crops|fixed]``
(``fixed``: samples that cost nothing, so broadcast's column is the transport's cost).

Each rank of a ``("dp", "tp")`` mesh (``world / tp`` by ``tp``; forked processes, a gloo process
group on 127.0.0.1 through a file rendezvous) builds a ``kuat.DataLoader`` over a dataset that
crops and resizes a 256 x 256 image per sample (``kuat.vision.RandomResizedCrop(size)``,
``(3, size, size)`` uint8), batch 32, and times ``batches`` batches after 3 warm-up ones.
Columns per mode: ``wall ms/batch`` (the slowest rank's: a training step waits for it),
``CPU ms/batch`` (process CPU time, all threads, summed over ranks: the cores input costs the
host), and ``MB/s`` of collated batches each rank received. Rounds are interleaved (read,
broadcast, read, ...), so drift on a shared machine hits both alike; the table shows the
median over rounds and the spread (max - min) in parentheses.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import statistics
import tempfile
import time

import numpy as np
import torch

BATCH = 32
WARMUP = 3


class Crops(torch.utils.data.Dataset):
    """``{"image": (3, size, size) uint8, "label": int}``: a random resized crop of one
    256 x 256 image (the sample's generator: replicas crop alike)."""

    def __init__(self, size: int, n: int = 100_000):
        from kuat.vision import RandomResizedCrop

        self.n, self.crop = n, RandomResizedCrop(size)
        rng = np.random.default_rng(0)
        self.img = torch.from_numpy(rng.integers(0, 256, (3, 256, 256), dtype=np.uint8))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"image": self.crop(self.img), "label": i % 1000}  # (3, size, size) uint8


class Fixed(torch.utils.data.Dataset):
    """``{"image": (3, size, size) uint8, "label": int}`` at no cost (one tensor, shared): what
    is left is collation and, in broadcast mode, the transport."""

    def __init__(self, size: int, n: int = 100_000):
        self.n, self.img = n, torch.zeros((3, size, size), dtype=torch.uint8)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"image": self.img, "label": i % 1000}


def _rank(rank, world, tp, init_file, args, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import kuat

    os.environ.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    kw = {"num_workers": args.workers, "worker_type": "thread"} if args.workers else {}
    rows = []
    for _ in range(args.rounds):
        for mode in ("read", "broadcast"):
            dataset = (Crops if args.dataset == "crops" else Fixed)(args.size)
            loader = kuat.DataLoader(dataset, batch_size=BATCH, shuffle=True, seed=0,
                                     mesh=mesh, replicas=mode, **kw)
            it = iter(loader)
            for _ in range(WARMUP):
                next(it)
            dist.barrier()
            nbytes, t0, c0 = 0, time.perf_counter(), time.process_time()
            for _ in range(args.batches):
                nbytes += next(it)["image"].numel()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            dist.barrier()
            rows.append((mode, wall, cpu, nbytes))
            del it
            loader.close()
    dist.destroy_process_group()
    out.put((rank, rows))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--tp", type=int, default=4, help="replicas per group (the tp dimension)")
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", type=int, default=128, help="crop side, pixels")
    p.add_argument("--workers", type=int, default=0, help="thread workers per rank")
    p.add_argument("--dataset", choices=("crops", "fixed"), default="crops",
                   help="crops: a random resized crop per sample; fixed: no work per sample")
    args = p.parse_args(argv)
    if args.world % args.tp:
        p.error(f"--world {args.world} is not a multiple of --tp {args.tp}")
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank, args=(r, args.world, args.tp, init, args, out))
                 for r in range(args.world)]
        for proc in procs:
            proc.start()
        results = dict(out.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join(30)
    cells: dict[str, dict[str, list[float]]] = {}
    for i in range(len(results[0])):
        mode = results[0][i][0]
        ranks = [results[r][i] for r in range(args.world)]
        c = cells.setdefault(mode, {"wall": [], "cpu": [], "mbs": []})
        c["wall"].append(max(r[1] for r in ranks) / args.batches * 1e3)
        c["cpu"].append(sum(r[2] for r in ranks) / args.batches * 1e3)
        c["mbs"].append(statistics.median(r[3] / r[1] for r in ranks) / 1e6)
    print(f"gloo, {args.world} ranks, mesh (dp={args.world // args.tp}, tp={args.tp}), batch "
          f"{BATCH} x (3, {args.size}, {args.size}) uint8 ({BATCH * 3 * args.size ** 2 / 1e6:.1f}"
          f" MB), {args.dataset}, {args.workers} thread workers, {args.batches} batches x {args.rounds} rounds")
    print(f"{'mode':<10} {'wall ms/batch':>18} {'CPU ms/batch (all ranks)':>26} {'MB/s per rank':>16}")

    def fmt(v):
        return f"{statistics.median(v):.1f} ({max(v) - min(v):.1f})"

    for mode, c in cells.items():
        print(f"{mode:<10} {fmt(c['wall']):>18} {fmt(c['cpu']):>26} {fmt(c['mbs']):>16}")


if __name__ == "__main__":
    main()
