"""Equal steps under kuat's sharding (#28, docs/distributed.md "Equal steps and exact
evaluation"): ``len(loader)`` and the batches yielded agree on every rank for map-style data
(lengths 1, a prime, dp x bs - 1, dp x bs + 1, with and without ``drop_last``), token budgets,
packed rows and mixtures, with an ``all_reduce`` every step on 2-4 gloo ranks; what kuat cannot
even out is refused at construction, and a fully skipped batch raises instead of leaving a rank
short."""

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler

import kuat
from kuat.text import TokenBudgetBatchSampler
from tests._gloo import run_ranks

BS = 3


def _lengths(world_size):
    return sorted({1, 13, world_size * BS - 1, world_size * BS + 1})


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_map_style_steps_are_torch_distributed_samplers(world_size, drop_last, shuffle):
    for n in _lengths(world_size):
        for rank in range(world_size):
            theirs = BatchSampler(DistributedSampler(range(n), world_size, rank, shuffle=shuffle,
                                                     seed=0, drop_last=drop_last), BS, drop_last)
            loader = kuat.DataLoader(list(range(n)), batch_size=BS, shuffle=shuffle, seed=0,
                                     drop_last=drop_last, rank=rank, world_size=world_size)
            assert len(loader) == len(theirs) == sum(1 for _ in loader), (n, rank)


def _docs(n):
    lengths = np.random.default_rng(n).integers(1, 20, n)
    return [{"input_ids": torch.arange(int(k))} for k in lengths], lengths


def _kinds(world_size):
    """(name, make loader) of every kind of source kuat shards, small."""
    pack_collate = kuat.pack_collate()
    stream_items = type("Items", (torch.utils.data.IterableDataset,),
                        {"__iter__": lambda self: iter(range(11))})
    kinds = []
    for n in _lengths(world_size):
        for dl in (False, True):
            kinds.append((f"map n={n} drop_last={dl}", lambda n=n, dl=dl, **kw: kuat.DataLoader(
                list(range(n)), batch_size=BS, shuffle=True, seed=0, drop_last=dl, **kw)))
    docs, lengths = _docs(13)
    for dl in (False, True):
        kinds.append((f"token budget drop_last={dl}", lambda dl=dl, **kw: kuat.DataLoader(
            docs, batch_sampler=TokenBudgetBatchSampler(lengths, 40, seed=0, drop_last=dl),
            collate_fn=len, **kw)))
    for known in (False, True):
        for strategy in ("concat", "best_fit"):
            for dl in (False, True):
                def packed(known=known, strategy=strategy, dl=dl, **kw):
                    rows = kuat.pack(docs, 16, strategy, lengths=lengths if known else None)
                    return kuat.DataLoader(rows, batch_size=2, drop_last=dl,
                                           collate_fn=pack_collate, **kw)
                kinds.append((f"pack {strategy} known={known} drop_last={dl}", packed))
    kinds.append(("map mix", lambda **kw: kuat.DataLoader(
        kuat.mix([list(range(7)), list(range(100, 110))], [1, 2], "all_exhausted"),
        batch_size=BS, shuffle=True, seed=0, **kw)))
    for dl in (False, True):
        kinds.append((f"stream mix drop_last={dl}", lambda dl=dl, **kw: kuat.DataLoader(
            kuat.mix([stream_items(), list(range(100, 105))], [1, 2], "all_exhausted"),
            batch_size=BS, drop_last=dl, **kw)))
    kinds.append(("exact eval", lambda **kw: kuat.DataLoader(
        [{"i": i} for i in range(13)], batch_size=BS, exact_eval=True, **kw)))
    return kinds


def _steps_body(rank, world_size, kw):
    import torch.distributed as dist

    torch.set_num_threads(1)  # forked: no OpenMP pool from the parent
    warnings.simplefilter("ignore")  # (the seed=None notice)
    out = {}
    for name, make in _kinds(world_size):
        loader = make(shard=True, **kw)
        steps = 0
        for _ in loader:  # a rank a step short would leave the others waiting here
            ranks_here = torch.ones(1)
            dist.all_reduce(ranks_here)
            assert ranks_here.item() == world_size
            steps += 1
        try:
            length = len(loader)
        except TypeError:  # a stream: no length, as torch's loader over an IterableDataset
            length = None
        out[name] = (length, steps)
    return out


@pytest.mark.parametrize("world_size, kw", [(2, {}), (3, {"num_workers": 2}), (4, {})],
                         ids=["2-inline", "3-threads", "4-inline"])
def test_every_kind_of_source_runs_equal_steps_with_an_all_reduce_each_step(world_size, kw):
    results = run_ranks(_steps_body, world_size, args=(kw,), timeout=150)
    for name in results[0]:
        per_rank = [r[name] for r in results]
        assert len(set(per_rank)) == 1, (name, per_rank)  # every rank: same len, same steps
        length, steps = per_rank[0]
        assert length in (None, steps), (name, per_rank)


class _Items(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(7))


@pytest.mark.parametrize("sharding", [dict(rank=0, world_size=2), dict(shard=True)])
def test_sources_kuat_cannot_even_out_are_refused_at_construction(sharding):
    from torch.utils.data.datapipes.iter import IterableWrapper

    with pytest.raises(ValueError, match="_Items is an IterableDataset kuat cannot split"):
        kuat.DataLoader(_Items(), batch_size=2, **sharding)
    with pytest.raises(ValueError, match="IterableDataset kuat cannot split"):
        kuat.DataLoader(IterableWrapper(range(7)).sharding_filter(), batch_size=2, **sharding)
    with pytest.raises(ValueError, match="on_error='skip'"):
        kuat.DataLoader(kuat.mix([_Items()]), batch_size=2, on_error="skip", **sharding)
    # without kuat's sharding: torch's semantics, every rank reads what it is given
    assert [b.tolist() for b in kuat.DataLoader(_Items(), batch_size=4)] == [[0, 1, 2, 3],
                                                                             [4, 5, 6]]
    # the way out the message names: a kuat stream splits any iterable in equal shares
    shares = [[x for b in kuat.DataLoader(kuat.mix([_Items()]), batch_size=2, rank=r,
                                          world_size=2) for x in b.tolist()] for r in range(2)]
    assert shares == [[0, 2, 4, 6], [1, 3, 5, 0]]  # DistributedSampler's wrap-around


class _FailsFrom(torch.utils.data.Dataset):
    def __len__(self):
        return 9

    def __getitem__(self, i):
        if i >= 6:
            raise ValueError(f"bad sample {i}")
        return i


def test_a_fully_skipped_batch_raises_under_sharding_instead_of_a_short_rank():
    # rank 0 of 2 reads 0 2 4 6 8 -> batches [0, 2] [4, 6] [8]: [8] fails whole; rank 1's
    # [1, 3] [5, 7] [0] all yield. Dropping [8] left rank 0 one step short (an all_reduce hang).
    with pytest.warns(RuntimeWarning, match="skipped sample"):
        rank1 = [b.tolist() for b in kuat.DataLoader(_FailsFrom(), batch_size=2, rank=1,
                                                     world_size=2, on_error="skip")]
    assert rank1 == [[1, 3], [5], [0]]  # a partly failed batch is yielded, smaller
    loader = kuat.DataLoader(_FailsFrom(), batch_size=2, rank=0, world_size=2, on_error="skip")
    with pytest.warns(RuntimeWarning), pytest.raises(
            RuntimeError, match=r"dropped every sample of the batch \[8\]: ValueError: bad sample 8.*a step short"):
        list(loader)
    # unsharded, as before: the empty batch is not yielded (no peer waits for it)
    with pytest.warns(RuntimeWarning):
        alone = [b.tolist() for b in kuat.DataLoader(_FailsFrom(), batch_size=3, on_error="skip")]
    assert alone == [[0, 1, 2], [3, 4, 5]]


class _SizedStream(kuat.sources.stream.Stream):
    def samples(self, epoch):
        return iter(range(11))

    def __len__(self):
        return 11


@pytest.mark.parametrize("drop_last", [False, True])
def test_len_of_a_sharded_stream_with_a_length_is_this_ranks_share(drop_last):
    for world_size in (2, 3, 4):
        for rank in range(world_size):
            loader = kuat.DataLoader(_SizedStream(), batch_size=2, drop_last=drop_last,
                                     rank=rank, world_size=world_size)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # nor torch's "reported to be" warning
                assert len(loader) == sum(1 for _ in loader)
    assert len(kuat.DataLoader(_SizedStream(), batch_size=2)) == 6  # unsharded: as torch
