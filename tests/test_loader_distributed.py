"""Rank and world size from an initialised torch.distributed (gloo, two forked processes):
``shard=True`` splits by the group's ranks; the default, as torch's DataLoader, splits nothing."""

import multiprocessing
import queue

import torch
import torch.distributed as dist

import kuat


def _rank_main(rank, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        results = {}
        for drop_last in (False, True):
            dl = kuat.DataLoader(list(range(26)), batch_size=6, shuffle=True, seed=5,
                                 drop_last=drop_last, num_workers=1, shard=True)
            results[drop_last] = (dl.rank, dl.world_size, len(dl),
                                  [[b.tolist() for b in dl] for _ in range(2)])
        plain = kuat.DataLoader(list(range(26)), batch_size=6, num_workers=1)
        torch_plain = torch.utils.data.DataLoader(list(range(26)), batch_size=6, num_workers=1)
        results["unsharded"] = ([b.tolist() for b in plain], [b.tolist() for b in torch_plain])
        out.put((rank, results))
    finally:
        dist.destroy_process_group()


def test_ranks_read_from_torch_distributed_get_equal_shares(tmp_path):
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path / "init"), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    while len(got) < 2:
        try:
            rank, results = out.get(timeout=1)
            got[rank] = results
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not failed, f"a rank failed with exit code {failed}"
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for drop_last in (False, True):
        (r0, ws0, n0, e0), (r1, ws1, n1, e1) = got[0][drop_last], got[1][drop_last]
        assert (r0, ws0, r1, ws1) == (0, 2, 1, 2)
        assert n0 == n1 == len(e0[0]) == len(e1[0])  # equal batch counts, as len() says
        for epoch in range(2):
            seen = [x for b in e0[epoch] + e1[epoch] for x in b]
            assert all(len(b) > 0 for b in e0[epoch] + e1[epoch])
            if drop_last:
                assert len(seen) == len(set(seen)) == 26 - 26 % 12  # 13 per rank -> 2 batches of 6
            else:
                assert set(seen) == set(range(26)) and len(seen) == 26
        assert e0[0] != e0[1]  # a new order each epoch
    for r in (0, 1):  # torch's DataLoader shards nothing: every rank reads all 26
        ours, torchs = got[r]["unsharded"]
        assert ours == torchs and sum(map(len, ours)) == 26
    assert not dist.is_initialized()
