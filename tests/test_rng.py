import numpy as np
import pytest

from kuat import rng


def test_sample_seed_depends_on_seed_epoch_and_index():
    seeds = {rng.sample_seed(s, e, i) for s in range(3) for e in range(3) for i in range(50)}
    assert len(seeds) == 3 * 3 * 50
    assert rng.sample_seed(7, 1, 5) == rng.sample_seed(7, 1, 5)


def test_sample_rng_uses_thread_context():
    outside = rng.sample_rng(3).numpy.integers(0, 2**31, size=4)
    with rng.epoch_context(seed=0, epoch=0):
        same = rng.sample_rng(3).numpy.integers(0, 2**31, size=4)
    with rng.epoch_context(seed=1, epoch=0):
        other_seed = rng.sample_rng(3).numpy.integers(0, 2**31, size=4)
        with rng.sample_context(3):
            implicit = rng.sample_rng().numpy.integers(0, 2**31, size=4)
    np.testing.assert_array_equal(outside, same)
    np.testing.assert_array_equal(other_seed, implicit)
    assert not np.array_equal(outside, other_seed)
    assert rng.current_epoch() == (0, 0)


def test_sample_rng_without_index_outside_a_sample_raises():
    with pytest.raises(RuntimeError, match="pass the index"):
        rng.sample_rng()


def test_torch_and_python_generators_are_seeded():
    import torch

    a, b = rng.sample_rng(11), rng.sample_rng(11)
    assert torch.equal(torch.rand(3, generator=a.torch), torch.rand(3, generator=b.torch))
    assert a.python.random() == b.python.random()

