"""Samplers and generators against torch's DataLoader (issue #11, items 3-5).

* resume with a user-supplied sampler gives the batches an uninterrupted run gives (which for
  the first epoch are torch's own), whatever the global RNG does in between;
* ``generator=`` is consumed exactly as torch consumes it, also over abandoned epochs, in every
  place kuat replaces a torch sampler;
* the checks torch's samplers and batch sampler make raise the same errors.
"""

import pickle
import warnings

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data import DataLoader as TorchLoader

import kuat

MODES = [dict(num_workers=0), dict(num_workers=2)]  # inline, threads
MODE_IDS = ["inline", "threads"]


def ids(batches):
    return [b.tolist() for b in batches]


def take(loader, n):
    it = iter(loader)
    return [next(it).tolist() for _ in range(n)]


# --- 11.3: resume with a user sampler --------------------------------------------------------------
SAMPLERS = {
    "random": lambda ds: RandomSampler(ds),
    "random_generator": lambda ds: RandomSampler(ds, generator=torch.Generator().manual_seed(3)),
    "random_replacement": lambda ds: RandomSampler(ds, replacement=True, num_samples=36),
    "subset_random": lambda ds: SubsetRandomSampler(range(2, 38)),
    "weighted": lambda ds: WeightedRandomSampler(torch.linspace(0.1, 1.0, len(ds)), 40),
    "distributed": lambda ds: DistributedSampler(ds, num_replicas=1, rank=0, seed=4),
}


@pytest.mark.parametrize("name", list(SAMPLERS))
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_resume_with_user_sampler_is_exact_in_any_process(name, mode):
    ds = list(range(40))
    torch.manual_seed(0)
    expected = ids(TorchLoader(ds, batch_size=4, sampler=SAMPLERS[name](ds)))  # torch, epoch 0
    torch.manual_seed(0)
    loader = kuat.DataLoader(ds, batch_size=4, sampler=SAMPLERS[name](ds), **mode)
    first = take(loader, 3)
    state = pickle.loads(pickle.dumps(loader.state_dict()))  # as a checkpoint stores it
    assert first == expected[:3]

    torch.manual_seed(12345)  # "a fresh process": another global RNG state
    resumed = kuat.DataLoader(ds, batch_size=4, sampler=SAMPLERS[name](ds), **mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exact resume does not warn
        resumed.load_state_dict(state)
    rest = ids(resumed)
    assert rest == expected[3:]
    assert len({i for b in first + rest for i in b}) == len({i for b in expected for i in b})


def test_resume_with_a_stateful_sampler_uses_its_state_dict():
    class Stateful(Sampler):
        """Its order depends on `offset` only, which it saves itself."""

        def __init__(self, n):
            self.n, self.offset, self.loads = n, 0, 0

        def __iter__(self):
            self.offset += 7
            return iter([(i * 7 + self.offset) % self.n for i in range(self.n)])

        def __len__(self):
            return self.n

        def state_dict(self):
            return {"offset": self.offset}

        def load_state_dict(self, state):
            self.loads += 1
            self.offset = state["offset"]

    ds = list(range(20))
    loader = kuat.DataLoader(ds, batch_size=4, sampler=Stateful(20))
    first = take(loader, 2)
    state = loader.state_dict()
    expected_torch = ids(TorchLoader(ds, batch_size=4, sampler=Stateful(20)))
    assert first == expected_torch[:2]
    sampler = Stateful(20)
    sampler.offset = 999  # another state: only load_state_dict brings the order back
    resumed = kuat.DataLoader(ds, batch_size=4, sampler=sampler)
    resumed.load_state_dict(state)
    assert ids(resumed) == expected_torch[2:]
    assert sampler.loads == 1


def test_resume_with_an_opaque_sampler_warns_naming_it():
    class Opaque(Sampler):
        def __iter__(self):
            return iter(torch.randperm(12).tolist())

        def __len__(self):
            return 12

    loader = kuat.DataLoader(list(range(12)), batch_size=4, sampler=Opaque())
    take(loader, 1)
    state = loader.state_dict()
    assert state["sampler"] is None
    with pytest.warns(UserWarning, match="Opaque"):
        kuat.DataLoader(list(range(12)), batch_size=4, sampler=Opaque()).load_state_dict(state)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_resume_with_generator_in_epoch_one_is_exact(mode):
    ds = list(range(10))
    torch_loader = TorchLoader(ds, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5))
    expected = [ids(torch_loader) for _ in range(3)]
    loader = kuat.DataLoader(ds, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5), **mode)
    assert ids(loader) == expected[0]
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["batches_served_in_epoch"] == 2
    resumed = kuat.DataLoader(ds, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(99), **mode)
    resumed.load_state_dict(state)
    assert head + ids(resumed) == expected[1]
    assert ids(resumed) == expected[2]  # and the generator went on as torch's did


# --- 11.4: generator consumption ---------------------------------------------------------------------
def _abandon_then_two_epochs(make):
    loader = make()
    it = iter(loader)
    next(it)  # one batch of a first epoch, then abandoned
    del it
    return [ids(loader) for _ in range(2)]


KUAT_SAMPLERS = {
    "shuffle": dict(shuffle=True),
    "sampler": "sampler",
    "batch_sampler": "batch_sampler",
}


@pytest.mark.parametrize("how", list(KUAT_SAMPLERS))
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_generator_is_consumed_as_torch_consumes_it_over_abandoned_epochs(how, mode):
    ds = list(range(10))

    def args(g):
        if how == "sampler":
            return dict(batch_size=5, sampler=RandomSampler(ds, generator=g), generator=g)
        if how == "batch_sampler":
            return dict(batch_sampler=BatchSampler(RandomSampler(ds, generator=g), 5, False), generator=g)
        return dict(batch_size=5, shuffle=True, generator=g)

    g_torch, g_kuat = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    torch_mode = dict(num_workers=mode["num_workers"])
    expected = _abandon_then_two_epochs(lambda: TorchLoader(ds, **args(g_torch), **torch_mode))
    got = _abandon_then_two_epochs(lambda: kuat.DataLoader(ds, **args(g_kuat), **mode))
    assert got == expected
    assert torch.equal(g_kuat.get_state(), g_torch.get_state())


def test_iter_without_next_draws_nothing_from_the_generator():
    g = torch.Generator().manual_seed(1)
    before = g.get_state()
    loader = kuat.DataLoader(list(range(6)), batch_size=2, shuffle=True, generator=g)
    iter(loader)
    assert torch.equal(before, g.get_state())


# --- 11.5: torch's validation errors -------------------------------------------------------------------
def _error(make):
    try:
        make()
    except (ValueError, TypeError) as e:
        return type(e), str(e)
    return None


CASES = {
    "empty_dataset_shuffle": dict(dataset=[], shuffle=True),
    "batch_size_zero": dict(batch_size=0),
    "batch_size_negative": dict(batch_size=-3),
    "batch_size_bool": dict(batch_size=True),
    "batch_size_float": dict(batch_size=2.0),
    "drop_last_not_bool": dict(batch_size=2, drop_last="yes"),
    "sampler_and_shuffle": dict(sampler=SequentialSampler(range(4)), shuffle=True),
    "batch_sampler_and_batch_size": dict(batch_sampler=[[0, 1]], batch_size=2),
    "batch_sampler_and_drop_last": dict(batch_sampler=[[0, 1]], drop_last=True),
    "no_batch_size_and_drop_last": dict(batch_size=None, drop_last=True),
    "negative_workers": dict(num_workers=-1),
    "negative_timeout": dict(timeout=-1, num_workers=1),
    "prefetch_without_workers": dict(prefetch_factor=2),
    "persistent_without_workers": dict(persistent_workers=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_torch_validation_errors_are_mirrored(name):
    kwargs = dict(CASES[name])
    dataset = kwargs.pop("dataset", list(range(4)))
    expected = _error(lambda: TorchLoader(dataset, **kwargs))
    assert expected is not None, "the case should be invalid for torch"
    assert _error(lambda: kuat.DataLoader(dataset, **kwargs)) == expected


def test_jumping_to_an_epoch_with_a_generator_warns():
    """What the HF Trainer does on resume (set_epoch(k) on a fresh loader) cannot be exact."""
    loader = kuat.DataLoader(list(range(6)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    loader.set_epoch(1)
    with pytest.warns(UserWarning, match="generator"):
        next(iter(loader))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(loader)  # epoch 2 follows epoch 1: nothing to say


@pytest.mark.parametrize("how", ["sampler", "batch_sampler"])
def test_resume_when_the_sampler_shares_the_loaders_generator(how):
    """torch draws base_seed, then the sampler, from the one generator: resume keeps both."""
    ds = list(range(12))

    def args(g):
        if how == "sampler":
            return dict(batch_size=3, sampler=RandomSampler(ds, generator=g), generator=g)
        return dict(batch_sampler=BatchSampler(RandomSampler(ds, generator=g), 3, False), generator=g)

    g = torch.Generator().manual_seed(2)
    torch_loader = TorchLoader(ds, **args(g))
    expected = [ids(torch_loader) for _ in range(3)]
    g = torch.Generator().manual_seed(2)
    loader = kuat.DataLoader(ds, **args(g))
    assert ids(loader) == expected[0]
    state_between = loader.state_dict()  # at the start of epoch 1
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    for saved, skip in ((state, 2), (state_between, 0)):
        g = torch.Generator().manual_seed(50)
        resumed = kuat.DataLoader(ds, **args(g))
        resumed.load_state_dict(saved)
        assert head[:skip] + ids(resumed) == expected[1]
        assert ids(resumed) == expected[2]


def test_resume_with_a_global_rng_sampler_and_a_loader_generator_from_an_epoch_boundary():
    ds = list(range(12))

    def make():
        return kuat.DataLoader(ds, batch_size=3, sampler=RandomSampler(ds), generator=torch.Generator().manual_seed(1))

    loader = make()
    ids(loader)
    between = loader.state_dict()  # start of epoch 1: the generator's state, nothing else
    resumed = make()
    resumed.load_state_dict(between)
    it = iter(resumed)
    head = [next(it).tolist() for _ in range(2)]
    state = resumed.state_dict()  # mid-epoch: now also the global RNG state the sampler drew from
    rest = ids(it)
    torch.manual_seed(777)
    again = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.load_state_dict(state)
    assert ids(again) == rest and len({i for b in head + rest for i in b}) == 12


def test_resume_with_a_kuat_batch_sampler_is_exact_and_quiet():
    lengths = [(i * 7) % 13 + 1 for i in range(40)]

    def make():
        sampler = kuat.TokenBudgetBatchSampler(lengths, max_tokens=24, seed=3)
        return kuat.DataLoader(list(range(40)), batch_sampler=sampler)

    loader = make()
    ids(loader)
    it = iter(loader)  # epoch 1
    [next(it) for _ in range(2)]
    state = loader.state_dict()
    rest = ids(it)
    resumed = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(state)
    assert ids(resumed) == rest
