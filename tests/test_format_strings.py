"""The ``strings`` field type (a variable-length list of UTF-8 strings per row): Writer
validation, manifest round trip, reads, and batches as torch's ``default_collate`` makes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch.utils.data

import kuat
from kuat import format as kf
from kuat.errors import SchemaError

ROWS = [["the", "cat"], ["sat", "on"], [], ["a", "mat", "🐈"], ["x", ""]]


@pytest.fixture
def strings_dir(tmp_path):
    with kuat.Writer(tmp_path / "d", {"tokens": kf.strings(), "id": kf.int64()}) as w:
        w.write({"tokens": ROWS[0], "id": 0})
        w.write({"tokens": tuple(ROWS[1]), "id": 1})
        w.write_batch({"tokens": [ROWS[2], np.array(ROWS[3])], "id": [2, 3]})
        w.write({"tokens": ROWS[4], "id": 4})
    return tmp_path / "d"


def test_strings_round_trip(strings_dir):
    ds = kuat.open(strings_dir)
    assert ds.schema["tokens"].type == kf.strings()
    assert kf.read_manifest(strings_dir).schema == ds.schema
    assert [ds[i]["tokens"] for i in range(len(ds))] == ROWS
    assert ds.read_batch([4, 0, 3])["tokens"] == [ROWS[4], ROWS[0], ROWS[3]]
    assert ds.raw(2)["tokens"] == []


def test_strings_batches_match_torch_default_collate(strings_dir):
    ds = kuat.open(strings_dir)
    same_length = [0, 1, 4]
    loader = kuat.DataLoader(ds, batch_size=3, sampler=same_length, num_workers=1)
    (batch,) = list(loader)
    want = torch.utils.data.default_collate([{"tokens": ROWS[i], "id": i} for i in same_length])
    assert batch["tokens"] == want["tokens"]  # [("the", "sat", "x"), ("cat", "on", "")]
    assert batch["id"].tolist() == want["id"].tolist()
    with pytest.raises(RuntimeError, match="each element in list of batch should be of equal"):
        list(kuat.DataLoader(ds, batch_size=2, sampler=[0, 3]))


@pytest.mark.parametrize(
    "value, detail",
    [
        ("the cat", "give a list of str"),
        (["a", 3], "item 1 is int"),
        ([["a"]], "item 0 is list"),
        (["\ud800"], "not encodable as UTF-8"),
    ],
)
def test_writer_refuses_what_is_not_a_list_of_strings(tmp_path, value, detail):
    with kuat.Writer(tmp_path / "d", {"tokens": kf.strings()}) as w:
        with pytest.raises(SchemaError, match="field 'tokens' row 0: expected sequence"):
            w.write({"tokens": value})
        with pytest.raises(SchemaError, match=detail):
            w.write({"tokens": value})
