"""kuat._buffers.BufferPool: batch buffers reused only once nothing views them (#12 B)."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest
import torch

import kuat
from kuat._buffers import MIN_POOLED_BYTES, BufferPool
from kuat.collate import batch_scope, default_collate, new_batch_buffer

SHAPE = (4, 3, 512, 512)  # 3 MiB: pooled


def _batch(pool, fill: int) -> torch.Tensor:
    with batch_scope(pool):
        buf = new_batch_buffer(SHAPE, torch.uint8)  # (B, C, H, W)
        buf.fill_(fill)
        out = default_collate(list(buf.unbind(0)))
    assert out.data_ptr() == buf.data_ptr()  # the collate returned the buffer, no copy
    return out


def test_freed_batches_are_reused_held_ones_never():
    pool = BufferPool(max_free=2)
    a = _batch(pool, 1)
    kept = a[2, 1]  # the user keeps a view of one sample's channel
    del a
    gc.collect()
    b = _batch(pool, 2)  # a's memory is still viewed: a new buffer
    assert pool.created == 2 and pool.reused == 0
    assert int(kept.min()) == int(kept.max()) == 1  # untouched by b
    del kept, b
    gc.collect()
    assert pool.idle_bytes() == 2 * int(np.prod(SHAPE))
    c = _batch(pool, 3)
    assert pool.reused == 1 and int(c.min()) == 3
    del c
    for _ in range(3):  # more idle buffers than max_free are unmapped
        _batch(pool, 4)
    gc.collect()
    assert pool.idle_bytes() <= 2 * int(np.prod(SHAPE))


def test_small_gpu_and_unscoped_buffers_are_not_pooled():
    pool = BufferPool()
    with batch_scope(pool):
        small = new_batch_buffer((MIN_POOLED_BYTES // 8 - 1,), torch.float64)
        assert small.numel() and pool.created == 0
        big = new_batch_buffer((MIN_POOLED_BYTES // 4,), torch.float32)
        assert pool.created == 1 and big.dtype == torch.float32 and big.shape == (MIN_POOLED_BYTES // 4,)
        big.copy_(torch.arange(big.numel(), dtype=torch.float32))  # writable, dtype-viewed
        assert float(big[-1]) == big.numel() - 1
    new_batch_buffer((MIN_POOLED_BYTES,), torch.uint8)  # no scope: torch.empty
    assert pool.created == 1


def test_clear_close_pickle_and_validation():
    pool = BufferPool()
    x = pool.take(MIN_POOLED_BYTES)
    x[:] = 7
    del x
    gc.collect()
    assert pool.idle_bytes() == MIN_POOLED_BYTES
    assert pickle.loads(pickle.dumps(pool)).idle_bytes() == 0  # process workers: their own
    pool.clear(close=True)
    assert pool.idle_bytes() == 0
    y = pool.take(MIN_POOLED_BYTES)
    del y
    gc.collect()
    assert pool.idle_bytes() == 0  # closed: freed buffers go back to the OS
    with pytest.raises(ValueError, match="max_free"):
        BufferPool(max_free=-1)


def test_loader_reuses_batch_buffers_and_releases_them_on_close():
    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitems__(self, indices):
            buf = new_batch_buffer((len(indices), 3, 256, 256), torch.uint8)  # 1.5 MiB
            for j, i in enumerate(indices):
                buf[j].fill_(i)
            return list(buf.unbind(0))

    for workers in (0, 2):
        loader = kuat.DataLoader(Images(), batch_size=8, num_workers=workers)
        for _ in range(3):
            for b in loader:
                assert [int(b[j, 0, 0, 0]) for j in range(len(b))] == [int(b[j].max()) for j in
                                                                        range(len(b))]
        pool = loader._job.buffer_pool
        assert pool.reused > 0 and pool.created <= 8  # 12 batches from a few buffers
        del b
        loader.close()
        assert pool.idle_bytes() == 0


def test_mapped_and_peak_bytes_follow_leases_idle_buffers_and_clear():
    nb = int(np.prod(SHAPE))
    pool = BufferPool(max_free=1)
    a, b = _batch(pool, 1), _batch(pool, 2)
    assert pool.mapped_bytes == pool.peak_bytes == 2 * nb
    del a, b  # one is kept idle (max_free=1), the other unmapped
    gc.collect()
    assert pool.mapped_bytes == pool.idle_bytes() == nb and pool.peak_bytes == 2 * nb
    c = _batch(pool, 3)  # reuses the idle one
    assert pool.mapped_bytes == nb
    pool.clear(close=True)
    del c  # after close, a freed buffer is unmapped, not kept
    gc.collect()
    assert pool.mapped_bytes == 0 and pool.idle_bytes() == 0 and pool.peak_bytes == 2 * nb


def test_take_array_keeps_at_most_max_free_ready_pairs_per_layout_and_close_drops_them():
    """Returned arrays come back ready (tensor made) up to ``max_free`` per (shape, dtype);
    the rest are unmapped (not also kept as free buffers), and ``clear(close=True)`` unmaps
    the ready ones; memory a caller still holds is never handed out again."""
    nb = int(np.prod(SHAPE))
    pool = BufferPool(max_free=1)
    pairs = [pool.take_array(SHAPE) for _ in range(3)]
    for k, (t, _a) in enumerate(pairs):
        t.fill_(k)
    held = pairs[0][0]
    del pairs, t, _a
    gc.collect()
    assert pool.mapped_bytes == 2 * nb and pool.idle_bytes() == nb  # 1 held, 1 ready
    t2, _ = pool.take_array(SHAPE)
    assert pool.reused == 1 and t2.data_ptr() != held.data_ptr() and int(held.max()) == 0
    labels, _ = pool.take_array((64,), np.dtype(np.int64))  # small: own memory, not counted
    assert labels.dtype == torch.int64 and labels.shape == (64,) and pool.created == 3
    del t2, labels
    gc.collect()
    pool.clear(close=True)
    assert pool.idle_bytes() == 0 and pool.mapped_bytes == nb  # only the held one
    del held
    gc.collect()
    assert pool.mapped_bytes == 0


@pytest.mark.parametrize("dtype", [np.dtype(np.uint8), np.dtype(np.int64)])
@pytest.mark.parametrize("shape", [SHAPE, (64,)])  # pooled (mapped) and small (own memory)
def test_take_array_memory_stays_leased_while_any_view_of_it_lives(shape, dtype):
    """Whatever a caller derives from a taken pair (a NumPy view of the array, a NumPy view
    of that view, a torch view, ``tensor.numpy()``) keeps the memory leased: the pool never
    hands it out again while one lives, on a fresh lease or a reused ready pair. (It leases
    the first array over the memory, which every NumPy view keeps as its base: a shaped
    array kept per buffer with a ``.view()`` per lease would not be, as NumPy collapses a
    view's base past such a lease.)"""
    pool = BufferPool(max_free=4)
    for round_ in range(3):  # round 0 fresh leases; then ready pairs made as memory came back
        derived = []
        for k in range(4):
            t, a = pool.take_array(shape, dtype)
            t.fill_(10 * round_ + k)
            view = [a[1:], a[1:][1:], t[1:], t.numpy()[1:]][k]
            derived.append((10 * round_ + k, view))
            del t, a
        gc.collect()
        for _ in range(4):  # while every derived view lives, no taken memory is one of theirs
            t, _a = pool.take_array(shape, dtype)
            t.fill_(-1 if dtype == np.int64 else 255)
        for want, view in derived:
            got = view if isinstance(view, np.ndarray) else view.numpy()
            assert (got == want).all(), f"a live view's memory was handed out again ({want})"
        del derived, view, t, _a
        gc.collect()


def test_take_array_memory_is_made_ready_refill_at_a_time_for_every_layout_at_once():
    """``refill=3``: a batch's image and labels come back as each batch is freed and wait
    until three of a layout's buffers are back; then every layout's memory is made ready in
    that one free (only the first tensor of a free is made cold, issue 31). At most
    ``max_free`` ready pairs and under ``max_free + refill`` idle buffers per layout;
    ``clear`` unmaps what waits; a pickle keeps both settings."""
    nb = int(np.prod(SHAPE))
    img, lab = (SHAPE, np.dtype(np.uint8)), ((64,), np.dtype(np.int64))
    pool = BufferPool(max_free=4, refill=3)
    imgs = [pool.take_array(*img) for _ in range(8)]
    labs = [pool.take_array(*lab) for _ in range(8)]
    ptrs = {t.data_ptr() for t, _ in imgs}
    assert pool.created == 8 and pool.mapped_bytes == 8 * nb
    for k in range(8):  # one batch at a time, its image then its labels (a dict's order)
        imgs[k] = None
        labs[k] = None
        gc.collect()
        ready = {layout: len(v) for layout, v in pool._ready.items()}
        if k < 2:  # nothing made ready before three are back
            assert not any(ready.values()), (k, ready)
        if k == 2:  # the third image back: both layouts made ready in this free (the labels'
            assert ready == {img: 3, lab: 2}, ready  # two back then; the third came after)
        assert max(ready.values(), default=0) <= 4 and pool.idle_bytes() < (4 + 3) * nb
    assert pool.mapped_bytes == pool.idle_bytes() <= (4 + 2) * nb
    again = [pool.take_array(*img) for _ in range(4)]  # ready pairs over freed memory
    assert {t.data_ptr() for t, _ in again} <= ptrs and pool.reused == 4 and pool.created == 8
    del again
    gc.collect()
    pool.clear()
    assert pool.mapped_bytes == pool.idle_bytes() == 0 and not pool._back
    copy = pickle.loads(pickle.dumps(pool))
    assert (copy.max_free, copy.refill) == (4, 3)
    with pytest.raises(ValueError, match="refill"):
        BufferPool(refill=0)
