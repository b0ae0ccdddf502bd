"""Dataset.read_flat and Dataset.sequence_lengths: the sequence reads the packer relies on."""

from __future__ import annotations

import numpy as np
import pytest

import kuat
from kuat.format.schema import int64, sequence


@pytest.fixture
def ds(tmp_path):
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 60_000, rng.integers(0, 40)).astype(np.uint16) for _ in range(300)]
    with kuat.Writer(tmp_path / "d", {"ids": sequence("uint16"), "n": int64()},
                     shard_bytes=2_000) as w:  # fmt: skip
        w.write_batch({"ids": rows, "n": [len(r) for r in rows]})
    d = kuat.open(tmp_path / "d")
    assert d.num_shards > 3  # rows of one read come from several shards
    return d, rows


def test_read_flat_matches_read_batch_in_any_order(ds):
    d, rows = ds
    rng = np.random.default_rng(1)
    for indices in (np.arange(300), np.arange(40, 90), rng.permutation(300)[:120], [7], []):
        lengths, flat = d.read_flat(indices, "ids")
        want = d.read_batch(indices, ["ids"])["ids"]
        assert lengths.dtype == np.int64 and flat.dtype == np.uint16
        assert lengths.tolist() == [len(w) for w in want]
        expected = np.concatenate(want) if len(want) else np.empty(0, np.uint16)
        assert np.array_equal(flat, expected)


def test_sequence_lengths_are_the_offsets(ds):
    d, rows = ds
    assert d.sequence_lengths("ids").tolist() == [len(r) for r in rows]
    assert kuat.text.lengths_of(d, "ids").tolist() == [len(r) for r in rows]


def test_not_a_sequence_field(ds):
    d, _ = ds
    with pytest.raises(ValueError, match="'n' is not a sequence field"):
        d.read_flat([0], "n")
    with pytest.raises(ValueError, match="'nope' is not a sequence field"):
        d.sequence_lengths("nope")
    with pytest.raises(IndexError):
        d.read_flat([300], "ids")
