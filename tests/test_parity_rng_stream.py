"""Swapping torch's DataLoader for kuat's leaves torch's random streams as they were.

torch's DataLoader draws one int64 ``base_seed`` per iterator from ``generator`` (else from the
default generator; with ``persistent_workers`` only the first iterator is created), and
``shuffle=True`` is a ``RandomSampler`` that draws its own seed from the default generator
each epoch unless given a generator. Everything else that uses those generators (model
initialisation between constructing the loader and training, a user ``RandomSampler``,
augmentations in the training loop) sees those draws, so kuat makes the same ones. Expected
values come from torch's DataLoader in the same test.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import RandomSampler

import kuat

MODES = [  # (num_workers, worker_type, persistent_workers)
    (0, None, False),
    (2, "thread", False),
    (2, "thread", True),
    (2, "process", True),
]


def _run(cls, order_from, generator, num_workers, worker_type, persistent, epochs=3):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7) if generator else None
    kw = dict(batch_size=16, num_workers=num_workers, persistent_workers=persistent, generator=g)
    if cls is kuat.DataLoader and worker_type is not None:
        kw["worker_type"] = worker_type
    if order_from == "shuffle":
        dl = cls(range(16), shuffle=True, **kw)
    else:
        dl = cls(range(16), sampler=RandomSampler(range(16)), **kw)
    init = torch.randn(3).tolist()  # e.g. model initialisation after building the loader
    orders, stream = [], [init]
    for _ in range(epochs):
        orders.append(next(iter(dl)).tolist())
        stream.append(torch.randint(0, 2**31, (2,)).tolist())  # e.g. augmentation in the loop
    if g is not None:
        stream.append(torch.randint(0, 2**31, (2,), generator=g).tolist())
    return orders, stream


@pytest.mark.parametrize("num_workers,worker_type,persistent", MODES)
@pytest.mark.parametrize("generator", [False, True], ids=["default-generator", "generator"])
@pytest.mark.parametrize("order_from", ["shuffle", "user-RandomSampler"])
def test_random_streams_and_orders_equal_torchs(order_from, generator, num_workers, worker_type, persistent):
    t_orders, t_stream = _run(TorchDataLoader, order_from, generator, num_workers, None, persistent)
    k_orders, k_stream = _run(kuat.DataLoader, order_from, generator, num_workers, worker_type, persistent)
    assert k_stream == t_stream  # the default generator's (and generator's) draws after each epoch
    assert k_orders == t_orders


def test_seed_none_is_the_first_epochs_base_seed_and_reproducible():
    def orders():
        torch.manual_seed(3)
        dl = kuat.DataLoader(range(32), batch_size=8, shuffle=True)
        assert dl.seed is None  # not drawn before the first epoch, as torch draws nothing then
        out = [[b.tolist() for b in dl] for _ in range(2)]
        return dl.seed, out

    seed_a, a = orders()
    seed_b, b = orders()
    assert seed_a == seed_b and isinstance(seed_a, int) and a == b and a[0] != a[1]
    torch.manual_seed(3)
    assert seed_a == int(torch.empty((), dtype=torch.int64).random_().item())


def test_state_saved_before_the_first_epoch_resumes_from_the_start():
    torch.manual_seed(5)
    base_seed = int(torch.empty((), dtype=torch.int64).random_().item())  # torch's first draw
    torch.manual_seed(5)
    a = kuat.DataLoader(range(12), batch_size=4, shuffle=True)
    state = a.state_dict()  # draws the first epoch's seeds ahead: the state names its order
    assert state["seed"] == base_seed and state["epoch"] == 0 and "sampler_seed" in state
    order = [x.tolist() for x in a]
    torch.manual_seed(5)
    b = kuat.DataLoader(range(12), batch_size=4, shuffle=True)
    b.load_state_dict(state)
    assert [x.tolist() for x in b] == order


def test_a_skip_first_batches_copy_hands_its_drawn_seed_to_the_loader_it_skips_for():
    torch.manual_seed(9)
    whole = kuat.DataLoader(range(24), batch_size=4, shuffle=True)
    first = [b.tolist() for b in whole]
    rng_after_first = torch.get_rng_state()
    second = [b.tolist() for b in whole]

    torch.manual_seed(9)
    dl = kuat.DataLoader(range(24), batch_size=4, shuffle=True)
    skipping = dl._skip_first_batches(2)  # what Accelerate's skip_first_batches returns
    assert [b.tolist() for b in skipping] == first[2:]
    assert dl.seed == skipping.seed == whole.seed  # the run seed: the first epoch's draw
    assert torch.equal(torch.get_rng_state(), rng_after_first)  # torch's draws, no more
    assert [b.tolist() for b in dl] == second  # the loader it skipped for goes on as the run


def test_explicit_seed_keeps_kuats_order_and_torchs_stream():
    """seed= asks for kuat's order, a function of (seed, epoch) whatever the global generator;
    the draws torch makes are made all the same."""

    def run(pre_draws):
        torch.manual_seed(0)
        torch.rand(pre_draws)
        dl = kuat.DataLoader(range(16), batch_size=16, shuffle=True, seed=123)
        return [next(iter(dl)).tolist() for _ in range(2)]

    assert run(0) == run(5) and run(0)[0] != run(0)[1]
    torch.manual_seed(0)
    list(kuat.DataLoader(range(16), batch_size=16, shuffle=True, seed=123))
    after_kuat = torch.rand(2)
    torch.manual_seed(0)
    list(TorchDataLoader(range(16), batch_size=16, shuffle=True))
    assert torch.equal(after_kuat, torch.rand(2))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torch_order_resumes_mid_epoch_from_the_saved_sampler_seed(num_workers):
    torch.manual_seed(4)
    want = [b.tolist() for b in TorchDataLoader(range(40), batch_size=4, shuffle=True)]
    torch.manual_seed(4)
    dl = kuat.DataLoader(range(40), batch_size=4, shuffle=True, num_workers=num_workers)
    it = iter(dl)
    head = [next(it).tolist() for _ in range(3)]
    state = dl.state_dict()
    torch.manual_seed(99)  # another global state: the resumed order comes from the saved seed
    resumed = kuat.DataLoader(range(40), batch_size=4, shuffle=True, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == want


@pytest.mark.parametrize("num_workers,worker_type,persistent", MODES)
@pytest.mark.parametrize("order_from", ["shuffle-generator", "user-RandomSampler-generator"])
@pytest.mark.parametrize("take", [1, 10, 13])
def test_an_epoch_left_early_leaves_the_generator_as_torchs(order_from, take, num_workers, worker_type, persistent):
    """A loop that leaves an epoch after ``take`` of its 16 batches (``limit_train_batches``,
    ``break``): torch's iterator has pulled ``prefetch_factor * num_workers + take`` batches from
    the sampler, and the pull that exhausts a ``RandomSampler`` draws one more ``randperm`` from
    its generator; kuat pulls on demand (and further ahead for cheap batches), so it paces the
    pulls to torch's. The next epoch's order and the generator's draws after it equal torch's."""

    def run(cls):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(7)
        kw = dict(batch_size=4, num_workers=num_workers, persistent_workers=persistent)
        if cls is kuat.DataLoader and worker_type is not None:
            kw["worker_type"] = worker_type
        if order_from == "shuffle-generator":
            dl = cls(range(64), shuffle=True, generator=g, **kw)
        else:
            dl = cls(range(64), sampler=RandomSampler(range(64), generator=g), **kw)
        out = []
        for _ in range(3):
            it = iter(dl)
            out.append([next(it).tolist() for _ in range(take)])
            del it
            out.append(torch.randint(0, 2**31, (2,), generator=g).tolist())
            out.append(torch.randint(0, 2**31, (2,)).tolist())
        return out

    assert run(kuat.DataLoader) == run(TorchDataLoader)


class DrawsPerSample(torch.utils.data.Dataset):
    """Draws from torch's default generator in every ``__getitem__`` (as torchvision's random
    transforms do): in torch that is each worker process's own generator."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor([i, 0]) + torch.rand(2)


@pytest.mark.parametrize("worker_type", ["thread", None])
def test_a_drawing_dataset_in_thread_workers_leaves_the_callers_stream_as_torch(worker_type):
    # thread workers watch their first batches unisolated: the dataset's draws there came
    # from the generator the training loop reads on (each epoch's shuffle seed), which torch's
    # worker processes never touch; the isolated re-fetch rewinds them. Before, epoch 1's order
    # and the loop's next draw differed from torch's, and from run to run
    def run(loader_cls, **kw):
        torch.manual_seed(0)
        loader = loader_cls(DrawsPerSample(), batch_size=4, shuffle=True, num_workers=2, **kw)
        epochs = [[int(i) for b in loader for i in b[:, 0]] for _ in range(2)]
        return epochs, torch.rand(3).tolist()

    expected = run(TorchDataLoader)
    for _ in range(8):  # fresh loaders: which worker saw the first draw varies
        assert run(kuat.DataLoader, worker_type=worker_type) == expected


class DrawsLateInSecondBatch(torch.utils.data.Dataset):
    """Samples 4-7 (the second batch at batch size 4, unshuffled) draw from torch's default
    generator, the first of them after 0.5 s; the others draw nothing. The first batch takes
    0.4 s: the second worker begins the second batch beside it, and the first batch reaches
    the loop, seen drawing nothing, before the second batch's first draw (and the loop waits
    up to as long again for batches begun with it: kuat.engine.isolate.RngUse)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i < 4:
            time.sleep(0.1)
        if 4 <= i < 8:
            if i == 4:
                time.sleep(0.5)
            return torch.tensor([float(i)]) + torch.rand(1)
        return torch.tensor([float(i)])


@pytest.mark.parametrize("worker_type", ["thread", None])
def test_draws_seen_after_the_loops_first_batch_are_rewound_before_it_can_draw(worker_type):
    # a thread worker's batch begun before the loop had the epoch's first batch, watched,
    # draws only after the loop got that batch: its isolated re-fetch must still rewind the
    # generators the loop reads on, and the loop must not draw before it has (before, the
    # loop's next draws were shifted by the worker's four: torch.rand after the epoch
    # differed). A batch begun after the loop's first batch is not covered: the loop may
    # have drawn by then (kuat.engine.isolate's docstring)
    def run(loader_cls, **kw):
        torch.manual_seed(0)
        loader = loader_cls(DrawsLateInSecondBatch(), batch_size=4, num_workers=2, **kw)
        firsts = [int(b[0, 0]) for b in loader]  # (the draws themselves are kuat's own)
        return firsts, torch.rand(3).tolist()

    expected = run(TorchDataLoader)
    for _ in range(2):
        assert run(kuat.DataLoader, worker_type=worker_type) == expected
