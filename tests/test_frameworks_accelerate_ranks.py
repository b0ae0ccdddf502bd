"""kuat.DataLoader under Accelerate on 2 and 4 CPU ranks (gloo, forked, 127.0.0.1), each row
against torch's DataLoader prepared by the same Accelerator in the same rank (issue #28):
Accelerate's own sharding (``BatchSamplerShard``, ``even_batches``, ``split_batches``,
``IterableDatasetShard``, its synchronised generator) decides who reads what, as for torch's.

Each rank builds torch's loader and kuat's under the same ``torch.manual_seed``, so where the
order comes from torch's default generator (``seed=None``, a user ``RandomSampler``) the two
must be equal, not only alike.
"""

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import IterableDataset, RandomSampler

import kuat
from tests._gloo import run_ranks

pytest.importorskip("accelerate")


def _ids(loader) -> list[int]:
    return [int(x) for batch in loader for x in batch]


def _batches(loader) -> list[list[int]]:
    return [[int(x) for x in batch] for batch in loader]


class Stream(IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _both(accelerator, make, seed: int) -> tuple:
    """``(torch's, kuat's)`` loader made by ``make(cls)`` and prepared under the same seed."""
    torch.manual_seed(seed)
    theirs = accelerator.prepare(make(TorchLoader))
    torch.manual_seed(seed)
    ours = accelerator.prepare(make(kuat.DataLoader))
    assert isinstance(ours, kuat.DataLoader)
    return theirs, ours


def _two_ranks(rank, world_size, tmp):
    from accelerate import Accelerator, DataLoaderConfiguration

    accelerator = Accelerator(cpu=True)
    ds = list(range(24))
    out = {"type": str(accelerator.distributed_type)}
    # a user RandomSampler (Accelerate gives it a generator synchronised from process 0)
    theirs, ours = _both(accelerator, lambda cls: cls(ds, batch_size=4, sampler=RandomSampler(ds)), 10 + rank)
    out["random_sampler"] = (_batches(theirs), _batches(ours))
    # shuffle=True, seed=None: kuat's own sampler shuffles as RandomSampler, from that generator
    theirs, ours = _both(accelerator, lambda cls: cls(ds, batch_size=4, shuffle=True), 20 + rank)
    out["shuffle"] = ([_batches(theirs) for _ in range(2)], [_batches(ours) for _ in range(2)])
    # resume mid-epoch 1 through state_dict (what accelerator.save_state stores)
    it = iter(ours)
    head = [next(it).tolist() for _ in range(2)]
    state = ours.state_dict()
    rest = _batches(it)
    torch.manual_seed(99 + rank)
    resumed = accelerator.prepare(kuat.DataLoader(ds, batch_size=4, shuffle=True))
    resumed.load_state_dict(state)
    out["resume"] = (head, rest, _batches(resumed))
    # seed=3: kuat's (seed, epoch) order, the same on every rank, then Accelerate's shares
    ours = accelerator.prepare(kuat.DataLoader(ds, batch_size=4, shuffle=True, seed=3, num_workers=2))
    out["seeded"] = [_ids(ours) for _ in range(2)]
    # skip_first_batches: a kuat loader over the same shard, its next epoch (2) from batch 1
    skipped = accelerator.skip_first_batches(ours, 1)
    reference = accelerator.prepare(kuat.DataLoader(ds, batch_size=4, shuffle=True, seed=3))
    reference.set_epoch(2)
    out["skipped"] = (isinstance(skipped, kuat.DataLoader), _batches(skipped), _batches(reference)[1:])
    # use_seedable_sampler (the HF Trainer's default), seed=None: the order is torch's initial
    # seed's (set alike on every rank, as set_seed does) and the epoch's, as SeedableRandomSampler
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    theirs, ours = _both(acc, lambda cls: cls(ds, batch_size=4, shuffle=True), 5)
    out["seedable"] = [_ids(ours) for _ in range(2)]
    out["seedable_torch"] = [_ids(theirs) for _ in range(2)]
    # even_batches=False (25 samples), split_batches=True; an IterableDataset (22 items):
    # Accelerate's IterableDatasetShard (without dispatching, which kuat does not do)
    for name, config, data in (("uneven", {"even_batches": False}, list(range(25))),
                               ("split", {"split_batches": True}, list(range(25))),
                               ("iterable", {"dispatch_batches": False}, Stream(22))):
        acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
        theirs, ours = _both(acc, lambda cls, data=data: cls(data, batch_size=4), 0)
        out[name] = (_batches(theirs), _batches(ours), len(theirs) if name != "iterable" else 0,
                     len(ours) if name != "iterable" else 0)
        acc.save_state(f"{tmp}/{name}")  # (it asks a loader over an IterableDatasetShard for its sampler)
    return out


def _assert_shares(per_rank: list[list[int]], n: int) -> None:
    """Disjoint shares of ``range(n)``, covering it (each rank's list has no repeats)."""
    seen = [x for share in per_rank for x in share]
    assert sorted(seen) == list(range(n)), per_rank


@pytest.mark.slow
def test_accelerate_shards_kuat_as_torch_on_two_ranks(tmp_path):
    results = run_ranks(_two_ranks, 2, args=(str(tmp_path),), timeout=240)
    assert all(r["type"] == "DistributedType.MULTI_CPU" for r in results)
    for row in ("random_sampler", "iterable", "uneven", "split"):
        for r in results:
            assert r[row][0] == r[row][1], (row, r[row])  # kuat's batches are torch's
    # Accelerate's user RandomSampler: 12 / 12, disjoint (the row; before: 24 / 24)
    _assert_shares([[x for b in r["random_sampler"][1] for x in b] for r in results], 24)
    for epoch in range(2):  # seed=None: ranks agree on the order, as torch's under Accelerate
        for r in results:
            assert r["shuffle"][1][epoch] == r["shuffle"][0][epoch]
        _assert_shares([[x for b in r["shuffle"][1][epoch] for x in b] for r in results], 24)
    for r in results:  # resumed from its state: the rest of the epoch, in the same order
        head, rest, resumed = r["resume"]
        assert resumed == rest and len(head) + len(rest) == 3
    for r in results:  # Accelerate's SeedableRandomSampler replaces kuat's, as torch's
        assert r["seedable"] == r["seedable_torch"]
    for run in ("seeded", "seedable"):  # the same order on every rank: disjoint shares
        for epoch in range(2):
            _assert_shares([r[run][epoch] for r in results], 24)
        assert results[0][run][0] != results[0][run][1]  # epochs differ
    for r in results:
        is_kuat, skipped, expected = r["skipped"]
        assert is_kuat and skipped == expected and len(skipped) == 2
    # even_batches=False: 25 of 25 (the row; before: 26, "ignored")
    assert sorted(x for r in results for b in r["uneven"][1] for x in b) == list(range(25))
    assert [r["uneven"][3] for r in results] == [4, 3]
    # split_batches=True: each batch of 4 split in halves, padded at the end as Accelerate does
    assert all(len(b) == 2 for r in results for b in r["split"][1])
    # the stream: rank r takes the r-th 4 of every 8, the last 8 completed from the first
    assert [x for r in results for x in r["iterable"][1][-1]] == [16, 17, 18, 19, 20, 21, 0, 1]


def _gather(rank, world_size):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    out = {}
    for name, cls in (("torch", TorchLoader), ("kuat", kuat.DataLoader)):
        loader = accelerator.prepare(cls(torch.arange(14), batch_size=2))
        gathered = []
        for batch in loader:
            gathered += accelerator.gather_for_metrics(batch).tolist()
        out[name] = gathered
    return out


@pytest.mark.slow
def test_gather_for_metrics_is_exact_on_four_ranks():
    """4 ranks, 14 samples, batch 2: exactly the 14 (the issue's row; before: sample 0 twice,
    11 missing, from kuat's interleaved padding)."""
    results = run_ranks(_gather, 4, timeout=240)
    for r in results:
        assert r["kuat"] == r["torch"]
        assert sorted(r["kuat"]) == list(range(14))
