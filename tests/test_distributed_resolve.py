"""Every consumer of the global rank agrees, before and after ``init_process_group``
(``kuat.distributed`` is the one place it is resolved); unsharded consumers (the loader's
default, a stream without a loader's share) read everything whatever the rank, as torch's."""

import datetime
import socket

import pytest
import torch.distributed as dist

import kuat
from kuat import distributed
from kuat.text import TokenBudgetBatchSampler


def _answers():
    from kuat.sources.stream import Stream

    class Eight(Stream):
        def samples(self, epoch):
            return iter(range(8))

    loader = kuat.DataLoader(list(range(8)), batch_size=2, shard=True)
    budget = TokenBudgetBatchSampler([3] * 8, max_tokens=6)
    unsharded = kuat.DataLoader(list(range(8)), batch_size=2)
    assert (unsharded.rank, unsharded.world_size, len(unsharded)) == (0, 1, 4)
    assert Eight()._rank_and_world() == (0, 1)  # a torch IterableDataset is not split by rank
    return {
        "module": distributed.resolve(),
        "loader": (loader.rank, loader.world_size),
        "token budget sampler": budget._rank_and_world(),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_consumers_agree_before_and_after_init_process_group(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    before = _answers()
    assert set(before.values()) == {(1, 3)}, before  # the environment, for every consumer
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        monkeypatch.setenv("RANK", "2")  # the process group wins over the environment
        monkeypatch.setenv("WORLD_SIZE", "3")
        after = _answers()
        assert set(after.values()) == {(0, 1)}, after
    finally:
        dist.destroy_process_group()


def test_explicit_values_win_and_bad_ones_are_refused(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert distributed.resolve(0, 2) == (0, 2)
    assert TokenBudgetBatchSampler([3] * 8, max_tokens=6, rank=1, world_size=2)._rank_and_world() == (1, 2)
    with pytest.raises(ValueError, match="both"):
        distributed.check_explicit(1, None)
    with pytest.raises(TypeError, match="rank"):
        distributed.check_explicit(True, 2)
    with pytest.raises(ValueError, match=r"\[0, world_size\)"):
        distributed.check_explicit(2, 2)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x'"):
        distributed.resolve()
