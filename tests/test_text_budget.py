"""TokenBudgetBatchSampler: the budget holds, every sample once, equal batch counts per rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kuat
from kuat.testing import check_resume
from kuat.text import TokenBudgetBatchSampler, lengths_of


def make_lengths(n=500, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(1, 200, n)


class Seqs(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"input_ids": torch.full((int(self.lengths[i]),), i, dtype=torch.int64), "i": i}


def padded_tokens(batch, lengths, multiple=None):
    width = max(lengths[i] for i in batch)
    if multiple and width % multiple:
        width += multiple - width % multiple
    return len(batch) * width


@pytest.mark.parametrize("multiple", [None, 64])
@pytest.mark.parametrize("shuffle", [True, False])
def test_budget_holds_and_every_sample_once(multiple, shuffle):
    lengths = make_lengths()
    lengths[3] = 5000  # longer than the budget: a batch of its own
    sampler = TokenBudgetBatchSampler(
        lengths, 2048, shuffle=shuffle, seed=1, pad_to_multiple_of=multiple, max_batch_size=40
    )
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert [3] in batches
    for b in batches:
        assert all(isinstance(i, int) for i in b) and len(b) <= 40
        if b != [3]:
            assert padded_tokens(b, lengths, multiple) <= 2048


def test_bucketing_cuts_padding():
    lengths = make_lengths(2000, seed=2)
    # the baseline: the same budget over a random order, unsorted (greedy, as the sampler cuts)
    order = np.random.default_rng(0).permutation(len(lengths))
    random_batches, current = [], []
    for i in order.tolist():
        if current and (len(current) + 1) * max(lengths[current + [i]]) > 4096:
            random_batches.append(current)
            current = []
        current.append(i)
    random_batches.append(current)
    waste = {"random": 1 - lengths.sum() / sum(padded_tokens(b, lengths) for b in random_batches)}
    for bucket in (200, 2000):
        batches = list(TokenBudgetBatchSampler(lengths, 4096, bucket_size=bucket, seed=0))
        waste[bucket] = 1 - lengths.sum() / sum(padded_tokens(b, lengths) for b in batches)
    assert waste[2000] < waste[200] < waste["random"]
    assert waste[2000] < 0.05 and waste["random"] > 0.3, waste


def test_order_depends_on_seed_and_epoch_only():
    lengths = make_lengths()
    a = TokenBudgetBatchSampler(lengths, 1024, seed=3)
    b = TokenBudgetBatchSampler(lengths, 1024, seed=3)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)
    a.set_epoch(1)
    assert list(a) == list(b)
    assert list(TokenBudgetBatchSampler(lengths, 1024, seed=4)) != list(
        TokenBudgetBatchSampler(lengths, 1024, seed=3)
    )


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_equal_batch_counts_per_rank(world_size, drop_last):
    lengths = make_lengths(301)
    whole = TokenBudgetBatchSampler(lengths, 1500, seed=5).batches(0)
    shares = [
        list(
            TokenBudgetBatchSampler(
                lengths, 1500, seed=5, rank=r, world_size=world_size, drop_last=drop_last
            )
        )
        for r in range(world_size)
    ]
    assert len({len(s) for s in shares}) == 1  # the same number of batches on every rank
    n = len(whole)
    total = n // world_size * world_size if drop_last else -(-n // world_size) * world_size
    served = [b for p in range(total) for b in [shares[p % world_size][p // world_size]]]
    assert served == [whole[p % n] for p in range(total)]  # rounds of ranks, wrap-around padding
    if not drop_last:  # every sample at least once, and only the wrap-around twice
        seen = sorted(i for s in shares for b in s for i in b)
        extra = sorted(i for b in whole[: total - n] for i in b)
        assert seen == sorted(list(range(len(lengths))) + extra)


def test_with_torch_dataloader_and_pad_collate():
    lengths = make_lengths(120)
    sampler = TokenBudgetBatchSampler(lengths, 1024, seed=0, pad_to_multiple_of=8)
    loader = torch.utils.data.DataLoader(
        Seqs(lengths),
        batch_sampler=sampler,
        collate_fn=kuat.pad_collate(pad_value=-1, pad_to_multiple_of=8),
    )
    seen = []
    for batch, indices in zip(loader, sampler, strict=True):
        assert batch["i"].tolist() == indices
        assert batch["input_ids"].numel() <= 1024 and batch["input_ids"].shape[1] % 8 == 0
        assert batch["input_ids_lengths"].tolist() == [int(lengths[i]) for i in indices]
        seen += indices
    assert sorted(seen) == list(range(120))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_kuat_loader_resume_is_exact_across_epochs(num_workers):
    lengths = make_lengths(150, seed=7)

    def make():
        return kuat.DataLoader(
            Seqs(lengths),
            batch_sampler=TokenBudgetBatchSampler(lengths, 1000, seed=9),
            num_workers=num_workers,
            collate_fn=kuat.pad_collate(),
        )

    ref = check_resume(make, midpoints=[0, 3, 9, 11, 17], epochs=2)
    per_epoch = len(TokenBudgetBatchSampler(lengths, 1000, seed=9))
    # the loader set the sampler's epoch: epoch 1 is another order than epoch 0
    first = [b["i"].tolist() for b in ref[:per_epoch]]
    second = [b["i"].tolist() for b in ref[per_epoch:]]
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, []))


def test_lengths_of():
    datasets = pytest.importorskip("datasets")
    rows = [[1] * k for k in (3, 0, 5, 2)]
    ds = datasets.Dataset.from_dict({"input_ids": rows, "y": [0, 1, 2, 3]})
    assert lengths_of(ds).tolist() == [3, 0, 5, 2]
    assert lengths_of(ds.select([2, 0])).tolist() == [5, 3]
    assert lengths_of([{"input_ids": r} for r in rows]).tolist() == [3, 0, 5, 2]
    with pytest.raises(KeyError, match="'tokens'"):
        lengths_of(ds, "tokens")


def test_lengths_of_a_kuat_dataset(tmp_path):
    rows = [np.arange(k, dtype=np.uint16) for k in (3, 0, 5, 2, 7)]
    with kuat.Writer(tmp_path / "d", {"input_ids": kuat.format.schema.sequence("uint16")}) as w:
        w.write_batch({"input_ids": rows})
    ds = kuat.open(tmp_path / "d")
    assert lengths_of(ds).tolist() == [3, 0, 5, 2, 7]
    with pytest.raises(KeyError, match="'tokens'"):
        lengths_of(ds, "tokens")


def test_argument_errors():
    with pytest.raises(ValueError, match="max_tokens should be an int >= 1, got 0"):
        TokenBudgetBatchSampler([1, 2], 0)
    with pytest.raises(ValueError, match="lengths should be"):
        TokenBudgetBatchSampler([1.5, 2], 10)
    with pytest.raises(ValueError, match="lengths should be"):
        TokenBudgetBatchSampler([1, -2], 10)
    with pytest.raises(ValueError, match="bucket_size"):
        TokenBudgetBatchSampler([1, 2], 10, bucket_size=0)
    with pytest.raises(ValueError, match="rank=2 world_size=2"):
        TokenBudgetBatchSampler([1, 2], 10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="epoch"):
        TokenBudgetBatchSampler([1, 2], 10).set_epoch(-1)


def test_rank_without_world_size_is_refused_not_ignored():
    """rank=1 alone used to be dropped silently (rank 0's share of a world of 1: every batch on
    every rank). As kuat.DataLoader(rank=, world_size=): both or neither."""
    with pytest.raises(ValueError, match="both rank and world_size or neither.*rank=1"):
        TokenBudgetBatchSampler([1, 2, 3], 10, rank=1)
    with pytest.raises(ValueError, match="both rank and world_size or neither.*world_size=2"):
        TokenBudgetBatchSampler([1, 2, 3], 10, world_size=2)
    with pytest.raises(ValueError, match="both rank and world_size or neither"):
        kuat.DataLoader(range(3), rank=1)  # the loader's rule, which the sampler now shares


def test_lengths_of_refuses_a_null_row_naming_it():
    """A null token list in a datasets.Dataset has no length: lengths_of returned
    -9223372036854775808 for it (Arrow's null length through NaN). It is an error naming the
    row, as indexing that row and taking len() is (TypeError) in the per-sample path."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], None, [], [4]]})
    with pytest.raises(TypeError):
        len(ds[1]["input_ids"])  # the reference: the row has no length
    with pytest.raises(ValueError, match="row 1.*'input_ids'.*null"):
        lengths_of(ds)
    assert lengths_of(ds.select([0, 2, 3])).tolist() == [3, 0, 1]
