"""Exact evaluation (``exact_eval=True``, docs/distributed.md "Equal steps and exact
evaluation"): every sample once over all ranks, equal steps, padding flagged ``is_padding`` and
laid out where Accelerate's ``gather_for_metrics`` truncates; the documented metric equals a
single-process evaluation on 2, 3 and 4 gloo ranks."""

import re
from pathlib import Path

import pytest
import torch

import kuat
from kuat.sampling import PaddingIndex
from tests._gloo import run_ranks

DOC = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"


class Dicts(torch.utils.data.Dataset):
    """Sample i: {"i": i, "x": 4 features, "y": a class in [0, 3)} (deterministic)."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(n)
        self.x = torch.randn(n, 4, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"i": i, "x": self.x[i], "y": self.y[i]}


def _ranks_batches(n, world_size, batch_size, **kw):
    out = []
    for rank in range(world_size):
        loader = kuat.DataLoader(Dicts(n), batch_size=batch_size, seed=5, rank=rank,
                                 world_size=world_size, exact_eval=True, **kw)
        batches = [(b["i"].tolist(), b["is_padding"]) for b in loader]
        assert len(batches) == len(loader)
        out.append(batches)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("batch_size", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_block_layout_each_sample_once_padding_last(world_size, batch_size, shuffle):
    wb = world_size * batch_size
    for n in sorted({1, 2, 13, wb - 1, wb, wb + 1, 3 * wb + 2} - {0}):
        # the epoch's order: the unsharded loader's, same seed
        order = [i for b in kuat.DataLoader(list(range(n)), batch_size=n, shuffle=shuffle, seed=5)
                 for i in b.tolist()]
        ranks = _ranks_batches(n, world_size, batch_size, shuffle=shuffle)
        steps = {len(r) for r in ranks}
        assert steps == {-(-n // wb)}  # equal steps: full steps plus one for the rest
        gathered, flags = [], []
        for k in range(len(ranks[0])):
            step = [ranks[r][k] for r in range(world_size)]
            assert len({len(ids) for ids, _ in step}) == 1  # same shapes: gather works
            for ids, pad in step:
                assert pad.dtype == torch.bool and pad.shape == (len(ids),)
                gathered += ids
                flags += pad.tolist()
        valid = [i for i, p in zip(gathered, flags) if not p]
        assert valid == order  # every sample once, in the epoch's order
        assert flags == sorted(flags)  # padding only at the end of the last step
        assert sum(flags) < world_size
        remainder = n % wb  # what gather_for_metrics keeps of the last step
        last = world_size * len(ranks[0][-1][0])
        kept = gathered[: len(gathered) - last + remainder] if remainder else gathered
        assert kept == order
        padded = [i for i, p in zip(gathered, flags) if p]
        assert padded == (order * world_size)[: len(padded)]  # wrap-around


def test_sampler_marks_padding_and_process_workers_flag_it():
    loader = kuat.DataLoader(Dicts(7), batch_size=2, rank=1, world_size=3, exact_eval=True)
    assert loader.sampler.indices(0) == [2, 3, PaddingIndex(0)]
    assert isinstance(loader.sampler.indices(0)[2], PaddingIndex)
    assert len(loader.sampler) == 3 and len(loader) == 2
    for kw in ({"num_workers": 2, "worker_type": "process"}, {"num_workers": 2}):
        got = _ranks_batches(7, 3, 2, **kw)
        assert [[(ids, pad.tolist()) for ids, pad in r] for r in got] == [
            [([0, 1], [False, False]), ([6], [False])],
            [([2, 3], [False, False]), ([0], [True])],
            [([4, 5], [False, False]), ([1], [True])],
        ]


def test_kuat_dataset_collated_fetch_is_flagged(tmp_path):
    import kuat.format as kf

    with kuat.Writer(tmp_path / "d", {"v": kf.int64()}) as w:
        for i in range(5):
            w.write({"v": i})
    ds = kuat.open(tmp_path / "d")
    got = []
    for rank in range(2):
        loader = kuat.DataLoader(ds, batch_size=2, rank=rank, world_size=2, exact_eval=True)
        got.append([(b["v"].tolist(), b["is_padding"].tolist()) for b in loader])
    assert got == [[([0, 1], [False, False]), ([4], [False])],
                   [([2, 3], [False, False]), ([0], [True])]]


def test_what_exact_eval_cannot_serve_is_refused_naming_why():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    cases = [
        (dict(dataset=Stream()), "IterableDataset"),
        (dict(sampler=torch.utils.data.SequentialSampler(range(5))), "sampler"),
        (dict(batch_sampler=[[0, 1]], batch_size=1), "sampler"),
        (dict(drop_last=True), "drop_last"),
        (dict(batch_size=None), "batch_size"),
        (dict(on_error="skip"), "on_error"),
        (dict(num_workers=2, in_order=False), "in_order"),
    ]
    for kw, words in cases:
        kw = {"dataset": Dicts(5), "batch_size": 2} | kw
        with pytest.raises(ValueError, match=f"exact_eval=True.*{words}"):
            kuat.DataLoader(exact_eval=True, rank=0, world_size=2, **kw)
    with pytest.raises(TypeError, match="exact_eval should be a bool"):
        kuat.DataLoader(Dicts(5), exact_eval="pad")
    with pytest.raises(TypeError, match="batch is a Tensor"):  # not dict samples
        next(iter(kuat.DataLoader(list(range(5)), batch_size=2, exact_eval=True)))
    with pytest.raises(TypeError, match="batch is a list"):  # tuple samples collate to a list
        next(iter(kuat.DataLoader([(i, i) for i in range(5)], batch_size=2, exact_eval=True)))
    with pytest.raises(ValueError, match="already has one"):
        next(iter(kuat.DataLoader([{"is_padding": 0}] * 3, batch_size=2, exact_eval=True)))


def _doc_example():
    section = DOC.read_text().split("## Equal steps and exact evaluation", 1)[1].split("\n## ")[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    namespace = {"__name__": "distributed_md"}
    exec(compile(code, "docs/distributed.md", "exec"), namespace)
    return namespace["evaluate"]


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


N_EVAL = 23  # prime: every world size and batch size leaves a remainder


def _doc_metric_body(rank, world_size, n):
    import torch.distributed as dist

    torch.set_num_threads(1)  # forked after the parent ran OpenMP kernels: no thread pool here
    evaluate = _doc_example()
    loader = kuat.DataLoader(Dicts(n), batch_size=4, shard=True, exact_eval=True)
    steps = 0
    for _ in loader:  # an all_reduce every step completes on every rank
        ranks_here = torch.ones(1)
        dist.all_reduce(ranks_here)
        assert ranks_here.item() == world_size
        steps += 1
    assert steps == len(loader)
    return evaluate(_model(), Dicts(n)), steps


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_documented_metric_equals_single_process(world_size):
    evaluate = _doc_example()
    single = evaluate(_model(), Dicts(N_EVAL))
    # the single-process value by hand: every sample once
    with torch.no_grad():
        data = Dicts(N_EVAL)
        logits = _model()(data.x)
        loss = torch.nn.functional.cross_entropy(logits, data.y, reduction="none")
    assert single[2] == N_EVAL
    assert single[0] == pytest.approx(loss.double().mean().item(), rel=1e-6)
    assert single[1] == pytest.approx((logits.argmax(1) == data.y).double().mean().item())
    results = run_ranks(_doc_metric_body, world_size, args=(N_EVAL,), timeout=120)
    for (loss_mean, accuracy, count), steps in results:
        assert count == N_EVAL and accuracy == single[1]
        assert loss_mean == pytest.approx(single[0], rel=1e-6)
        assert steps == -(-N_EVAL // (4 * world_size))


def _accelerate_body(rank, world_size, n, batch_size, shuffle):
    from accelerate import Accelerator

    torch.set_num_threads(1)  # (as above)
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world_size
    loader = accelerator.prepare(kuat.DataLoader(Dicts(n), batch_size=batch_size, shuffle=shuffle,
                                                 seed=1, shard=True, exact_eval=True))
    got = []
    for batch in loader:
        got += accelerator.gather_for_metrics(batch["i"]).tolist()
    return got


@pytest.mark.parametrize("world_size, n, batch_size, shuffle",
                         [(4, 14, 2, False), (3, 10, 4, True), (2, 5, 4, False)])
def test_accelerate_gather_for_metrics_returns_the_dataset_once(world_size, n, batch_size, shuffle):
    pytest.importorskip("accelerate")
    results = run_ranks(_accelerate_body, world_size, args=(n, batch_size, shuffle), timeout=120)
    order = [i for b in kuat.DataLoader(list(range(n)), batch_size=n, shuffle=shuffle, seed=1)
             for i in b.tolist()]
    for got in results:
        assert got == order  # every sample once, in the epoch's order (the #28 row: 14 of 14)


def test_resume_mid_epoch_keeps_the_layout_and_the_flags():
    def make():
        return kuat.DataLoader(Dicts(11), batch_size=2, shuffle=True, seed=3, rank=2,
                               world_size=3, exact_eval=True)

    def flat(batches):
        return [(b["i"].tolist(), b["is_padding"].tolist()) for b in batches]

    whole = flat(make())
    assert len(whole) == 2 and any(whole[-1][1])  # 11 = 6 + 5: the last step pads one
    loader = make()
    it = iter(loader)
    first = flat([next(it)])
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert first + flat(resumed) == whole


def _mesh_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    loader = kuat.DataLoader(Dicts(9), batch_size=2, shuffle=True, seed=4, mesh=mesh,
                             exact_eval=True, num_workers=2)
    return mesh.get_coordinate(), [(b["i"].tolist(), b["is_padding"].tolist()) for b in loader]


def test_exact_eval_on_a_mesh_splits_over_dp_and_replicates_tp():
    results = run_ranks(_mesh_body, 4, timeout=120)
    by_dp = {}
    for (_tp, dp), batches in results:
        by_dp.setdefault(dp, []).append(batches)
    for peers in by_dp.values():  # tensor-parallel peers: identical batches, flags included
        assert peers[0] == peers[1]
    valid = [i for dp in (0, 1) for ids, pad in by_dp[dp][0] for i, p in zip(ids, pad) if not p]
    assert sorted(valid) == list(range(9))
    assert len(by_dp[0][0]) == len(by_dp[1][0]) == 3  # ceil(9 / (2 x 2)) steps each
