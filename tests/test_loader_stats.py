"""``DataLoader.stats()``: what it reports is what the training loop saw (#11.12)."""

import time

import pytest
import torch

import kuat
from kuat.vision.transforms import Normalize


class Images(torch.utils.data.Dataset):
    """uint8 images, normalised on the CPU by the loader's batch step (no ``device=``)."""

    kuat_batch_transform = Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return 48

    def __getitem__(self, i):
        return torch.full((3, 128, 128), i % 256, dtype=torch.uint8)  # (C, H, W)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_input_bound_fraction_counts_every_second_inside_next(num_workers):
    """The training loop times its own next() calls; the loader must report the same share.

    Before, only the wait for a worker's result counted: the batch step (Normalize on the CPU),
    copies and pinning ran inside next() but were reported as the loop's own time.
    """
    loader = kuat.DataLoader(Images(), batch_size=8, num_workers=num_workers)
    inside = 0.0
    it = iter(loader)
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            inside += time.perf_counter() - t0
            break
        inside += time.perf_counter() - t0
        assert batch.dtype == torch.float32  # the batch step ran
        time.sleep(0.002)  # the "training step"
    total = time.perf_counter() - start
    s = loader.stats()
    # the loader's intervals lie within the loop's (a few microseconds of call overhead apart)
    assert s["consumer_wait_s"] == pytest.approx(inside, rel=0.05, abs=2e-3)
    assert s["elapsed_s"] == pytest.approx(total, rel=0.05, abs=2e-3)
    assert s["input_bound_fraction"] == pytest.approx(inside / total, abs=0.05)
    assert s["worker_wait_s"] <= s["consumer_wait_s"]
    assert s["busy_s"]["batch_transform"] <= s["consumer_wait_s"]


class Skips(torch.utils.data.Dataset):
    """Sample ``i`` is ``i``; every 7th raises (skipped with ``on_error="skip"``)."""

    def __len__(self):
        return 400

    def __getitem__(self, i):
        if i % 7 == 3:
            raise ValueError(f"bad sample {i}")
        return i


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_counts_are_exact_at_every_batch_whether_or_not_the_work_was_summed_yet(worker_type):
    """The workers' results are queued and summed in groups (``LoaderStats.fold``, issue 31):
    ``stats()`` at any batch, before, at and after a group is summed, and a pickled loader's,
    count every sample returned and every sample skipped so far, as the loop counts them."""
    import pickle
    import warnings

    loader = kuat.DataLoader(Skips(), batch_size=3, num_workers=2, worker_type=worker_type,
                             on_error="skip")
    seen = skipped = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the first skip's warning)
        for k, batch in enumerate(loader, 1):
            seen += len(batch)
            skipped = sum(1 for i in range(3 * k) if i % 7 == 3)  # batch k covers 3k samples
            st = loader.stats()
            assert (st["batches"], st["samples"], st["skipped_samples"]) == (k, seen, skipped)
            if k == 40:  # past a group (kuat.loader._stats.FOLD_EVERY)
                copy = pickle.loads(pickle.dumps(loader._stats))
                assert (copy.samples, copy.skipped, len(copy.work)) == (seen, skipped, 0)
    assert seen == 400 - skipped and k == 134
