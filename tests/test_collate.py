import collections

import numpy as np
import pytest
import torch
from _same import assert_same
from torch.utils.data import default_collate as torch_collate

from kuat.collate import batch_scope, default_collate, map_structure, new_batch_buffer

Point = collections.namedtuple("Point", "x y")


def test_structures_match_torch_collate():
    samples = [
        {
            "img": torch.arange(6, dtype=torch.uint8).reshape(2, 3) + i,
            "arr": np.full((2,), i, dtype=np.float32),
            "label": i,
            "weight": 0.5 * i,
            "name": f"s{i}",
            "pt": Point(i, torch.tensor([i, -i])),
            "nested": {"a": [i, i + 1], "b": (np.int64(i),)},
        }
        for i in range(4)
    ]
    assert_same(default_collate(samples), torch_collate(samples))


def test_consecutive_views_of_the_batchs_own_buffer_are_returned_without_copy():
    with batch_scope():
        buf = new_batch_buffer((4, 3, 2, 2), torch.uint8)  # (B, C, H, W)
        buf.copy_(torch.arange(buf.numel(), dtype=torch.uint8).reshape(buf.shape))
        batch = default_collate([{"image": buf[i], "label": i} for i in range(4)])
        assert batch["image"].data_ptr() == buf.data_ptr()
        assert torch.equal(batch["image"], buf)
        part = default_collate([buf[1], buf[2]])  # a run in the middle of the buffer
        assert part.data_ptr() == buf[1].data_ptr() and torch.equal(part, buf[1:3])
    # the same views outside the batch's scope (or of memory kuat did not allocate) are copied
    out = default_collate([buf[i] for i in range(4)])
    assert out.data_ptr() != buf.data_ptr() and torch.equal(out, buf)
    user = torch.arange(24).reshape(8, 3)
    with batch_scope():
        new_batch_buffer((4, 3), torch.int64)
        out = default_collate([user[i] for i in range(4)])
    assert out.data_ptr() != user.data_ptr() and torch.equal(out, user[:4])


def test_non_consecutive_views_are_copied():
    buf = torch.arange(12.0).reshape(4, 3)
    out = default_collate([buf[2], buf[0]])
    assert out.data_ptr() != buf.data_ptr()
    assert torch.equal(out, torch.stack([buf[2], buf[0]]))
    out2 = default_collate([buf[0], buf[0]])
    assert torch.equal(out2, torch.stack([buf[0], buf[0]]))


def test_shape_mismatch_lists_every_elements_shape_and_dtype():
    with pytest.raises(RuntimeError) as info:
        default_collate([torch.zeros(3, 4), torch.zeros(3, 5, dtype=torch.float64), torch.zeros(3, 4)])
    msg = str(info.value)
    assert "element 0: shape (3, 4) dtype torch.float32" in msg
    assert "element 1: shape (3, 5) dtype torch.float64" in msg
    assert "element 2: shape (3, 4)" in msg


def test_map_structure_keeps_containers():
    data = {"a": [torch.ones(1), "s"], "p": Point(torch.zeros(1), 3)}
    out = map_structure(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, data)
    assert isinstance(out["p"], Point) and out["a"][1] == "s"
    assert torch.equal(out["a"][0], torch.full((1,), 2.0))


def test_tensor_and_dict_of_tensors_fast_paths_give_torchs_results_and_errors():
    # B tensors and B dicts of tensors skip torch's type walk; what comes out (values, dtypes,
    # key order, and the exception type when samples disagree) stays torch's
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 9, (5,), generator=g, dtype=torch.int64) for _ in range(4)]
    dicts = [{"b": t.to(torch.uint8), "a": t.float()} for t in tensors]
    for batch in (tensors, dicts, [{"a": t, "n": 1} for t in tensors]):
        got, want = default_collate(batch), torch_collate(batch)
        if isinstance(want, dict):
            assert type(got) is dict and list(got) == list(want)
            got, want = list(got.values()), list(want.values())
        else:
            got, want = [got], [want]
        for x, y in zip(got, want):
            assert x.dtype == y.dtype and torch.equal(x, y)
    for bad in ([dicts[0], {"a": tensors[0]}], [dicts[0], {**dicts[1], "b": 3}],
                [tensors[0], torch.zeros(6, dtype=torch.int64)]):
        with pytest.raises(Exception) as want:
            torch_collate(bad)
        with pytest.raises(want.type):
            default_collate(bad)
