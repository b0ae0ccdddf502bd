"""``assert_same``: exact equality of two batches, for tests that compare kuat with a reference
(torch's ``default_collate``, the per-sample path, a thread run against a process run).

Stricter than :func:`kuat.testing.assert_same_batch`: every container, tensor and array type
must match exactly (a ``dict`` is not an ``OrderedDict``), and NaN never equals itself.
"""

from __future__ import annotations

import numpy as np
import torch


def assert_same(a, b) -> None:
    """Assert ``a`` and ``b`` have the same types, keys, lengths, dtypes, shapes and values."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b
