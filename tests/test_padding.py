"""pad_collate: identical to the per-row Python padding loop, on every kind of input."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import default_collate

import kuat
from kuat.padding import pad_collate, pad_rows


def reference_collate(samples, pad_value=0, fields=("ids",)):
    """The usual per-row collate: pad_sequence on each field's rows, default_collate the rest."""
    out = {}
    for key in samples[0]:
        if key in fields:
            rows = [torch.as_tensor(s[key]) for s in samples]
            out[key] = pad_sequence(rows, batch_first=True, padding_value=pad_value)
            out[key + "_lengths"] = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        else:
            out[key] = default_collate([s[key] for s in samples])
    return out


def assert_batches_equal(a, b):
    assert list(a) == list(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype, k
            assert a[k].shape == b[k].shape, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _samples(kind, n=7, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 12, n)
    lens[2] = 11  # a longest row
    rows = [rng.integers(-9, 9, k) for k in lens]
    if kind == "views":  # one buffer, rows back to back (what kuat's sources hand out)
        flat = torch.from_numpy(np.concatenate(rows))
        bounds = np.concatenate([[0], np.cumsum(lens)]).tolist()
        ids = [flat[bounds[i] : bounds[i + 1]] for i in range(n)]
    elif kind == "views_shuffled":  # one buffer, rows in another order
        flat = torch.from_numpy(np.concatenate(rows[::-1]))
        bounds = np.concatenate([[0], np.cumsum(lens[::-1])]).tolist()
        ids = [flat[bounds[i] : bounds[i + 1]] for i in range(n)][::-1]
    elif kind == "numpy_views":
        flat = np.concatenate(rows).astype(np.int32)
        bounds = np.concatenate([[0], np.cumsum(lens)]).tolist()
        ids = [flat[bounds[i] : bounds[i + 1]] for i in range(n)]
    elif kind == "tensors":
        ids = [torch.from_numpy(r.astype(np.int16)) for r in rows]
    elif kind == "arrays":
        ids = [r.astype(np.float32) for r in rows]
    elif kind == "lists":
        ids = [r.tolist() for r in rows]
    else:
        raise AssertionError(kind)
    return [{"ids": ids[i], "label": int(i), "name": f"s{i}"} for i in range(n)]


@pytest.mark.parametrize(
    "kind", ["views", "views_shuffled", "numpy_views", "tensors", "arrays", "lists"]
)
@pytest.mark.parametrize("pad_value", [0, -100])
def test_same_as_per_row_padding(kind, pad_value):
    samples = _samples(kind)
    got = kuat.pad_collate(pad_value=pad_value)(samples)
    assert_batches_equal(got, reference_collate(samples, pad_value))
    assert got["ids"].shape == (7, 11)
    assert got["ids_lengths"].tolist() == [len(s["ids"]) for s in samples]


def test_rows_with_feature_dims():
    rows = [torch.arange(k * 3, dtype=torch.float32).reshape(k, 3) for k in (2, 5, 1)]
    padded, lengths = pad_rows(rows, -1.0)
    assert padded.shape == (3, 5, 3) and lengths.tolist() == [2, 5, 1]
    assert torch.equal(padded, pad_sequence(rows, batch_first=True, padding_value=-1.0))


def test_bare_sequences_and_explicit_fields():
    padded, lengths = kuat.pad_collate()([torch.tensor([1, 2]), torch.tensor([3])])
    assert padded.tolist() == [[1, 2], [3, 0]] and lengths.tolist() == [2, 1]
    samples = [{"a": [1, 2, 3], "b": [4]}, {"a": [5], "b": [6]}]
    out = pad_collate(fields=["a"], lengths_suffix="_len")(samples)
    assert out["a"].tolist() == [[1, 2, 3], [5, 0, 0]] and out["a_len"].tolist() == [3, 1]
    assert [t.tolist() for t in out["b"]] == [[4, 6]]  # default_collate of lists


def test_errors_name_the_rows():
    with pytest.raises(ValueError, match=r"1: \(2, 3\) torch.float32"):
        pad_rows([torch.zeros(2, 2), torch.zeros(2, 3)], 0, "x")
    with pytest.raises(ValueError, match="empty batch"):
        pad_collate()([])
    with pytest.raises(ValueError, match="already a field"):
        pad_collate()([{"x": [1], "x_lengths": 3}])
    with pytest.raises(KeyError, match="'y'"):
        pad_collate(fields=["y"])([{"x": [1]}])
    with pytest.raises(TypeError, match="pad_value"):
        pad_collate(pad_value="0")


def test_arrow_rows_and_tables():
    table = pa.table(
        {
            "ids": pa.array([[1, 2], [], [3, 4, 5], [6]], pa.list_(pa.int32())),
            "label": pa.array([0, 1, 2, 3], pa.int64()),
            "name": ["a", "b", "c", "d"],
        }
    )
    rows = [table.slice(i, 1) for i in (2, 0, 3)]
    out = pad_collate(pad_value=9)(rows)
    assert out["ids"].dtype == torch.int32
    assert out["ids"].tolist() == [[3, 4, 5], [1, 2, 9], [6, 9, 9]]
    assert out["ids_lengths"].tolist() == [3, 2, 1]
    assert out["label"].tolist() == [2, 0, 3] and out["name"] == ["c", "a", "d"]
    whole = pad_collate()(table)
    assert whole["ids"].tolist() == [[1, 2, 0], [0, 0, 0], [3, 4, 5], [6, 0, 0]]


def test_hf_dataset_same_padded_outputs_for_same_indices():
    """Over a datasets.Dataset: kuat's source + pad_collate == per-row torch padding."""
    datasets = pytest.importorskip("datasets")
    from kuat.sources import as_source

    rng = np.random.default_rng(3)
    data = {
        "input_ids": [
            rng.integers(0, 1000, k).astype(np.int32).tolist() for k in rng.integers(1, 40, 50)
        ],
        "label": rng.integers(0, 4, 50).tolist(),
    }
    features = datasets.Features(
        {"input_ids": datasets.List(datasets.Value("int32")), "label": datasets.Value("int64")}
    )
    ds = datasets.Dataset.from_dict(data, features=features)
    order = rng.permutation(50).tolist()
    collate = pad_collate()
    for fmt in ("torch", "numpy", None, "arrow"):
        src = as_source(ds.with_format(fmt))
        ref_ds = ds.with_format("torch")
        for i in range(0, 50, 16):
            idx = order[i : i + 16]
            got = collate(src.__getitems__(idx))
            ref = reference_collate(ref_ds.__getitems__(idx), fields=("input_ids",))
            if fmt == "arrow":  # Arrow keeps the stored int32; datasets' formats make int64
                assert got["input_ids"].dtype == torch.int32
                got["input_ids"] = got["input_ids"].long()
            assert_batches_equal(got, ref)


def test_one_op_paths_are_taken_for_views():
    from kuat.padding._rows import _views_of_one_array, _views_of_one_tensor

    views = [s["ids"] for s in _samples("views")]
    values, starts, lengths = _views_of_one_tensor(views)
    assert starts.tolist() == np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    assert _views_of_one_array([s["ids"] for s in _samples("numpy_views")]) is not None
    assert _views_of_one_tensor([s["ids"] for s in _samples("tensors")]) is None
    strided = torch.arange(20)[::2]
    assert _views_of_one_tensor([strided[0:3], strided[3:5]]) is None


def test_samples_columns_are_used_only_while_the_samples_hold_them():
    from kuat.padding import BatchColumn, Samples

    flat = torch.arange(10)
    offsets = np.array([0, 3, 3, 10])
    rows = list(flat.split(np.diff(offsets).tolist()))
    labels = torch.tensor([7, 8, 9])
    label_rows = list(labels.unbind(0))
    samples = Samples(
        [{"ids": r, "label": lab} for r, lab in zip(rows, label_rows, strict=True)],
        {"ids": BatchColumn(flat, offsets, rows), "label": BatchColumn(labels, None, label_rows)},
    )
    assert isinstance(samples, list) and len(samples) == 3
    out = pad_collate(pad_value=-1)(samples)
    assert out["ids"].tolist() == [[0, 1, 2, -1, -1, -1, -1], [-1] * 7, [3, 4, 5, 6, 7, 8, 9]]
    assert out["ids_lengths"].tolist() == [3, 0, 7] and out["label"] is labels
    assert_batches_equal(out, reference_collate(list(samples), -1))
    # a sample replaced after the source made the batch: the columns are not trusted
    samples[1] = {"ids": torch.tensor([5, 5]), "label": torch.tensor(1)}
    out = pad_collate(pad_value=-1)(samples)
    assert out["ids"][1].tolist() == [5, 5, -1, -1, -1, -1, -1]
    assert out["label"].tolist() == [7, 1, 9]
    assert_batches_equal(out, reference_collate(list(samples), -1))
    assert torch.equal(default_collate([s["label"] for s in samples]), out["label"])


def test_hf_source_returns_samples_with_columns():
    datasets = pytest.importorskip("datasets")
    from kuat.padding import Samples
    from kuat.sources import as_source

    ds = datasets.Dataset.from_dict({"ids": [[1, 2], [3], [4, 5, 6]], "y": [0, 1, 2]})
    got = as_source(ds.with_format("torch")).__getitems__([2, 0])
    assert isinstance(got, Samples) and set(got.kuat_columns) == {"ids", "y"}
    out = pad_collate()(got)
    assert out["ids"].tolist() == [[4, 5, 6], [1, 2, 0]] and out["y"].tolist() == [2, 0]


# --- per-field values, attention mask, truncation, multiples, sides, 2-d and empty rows ------


def _reference_rows(rows, value, max_length=None, multiple=None, side="right", cut="right"):
    """torch's answer: cut each row, pad_sequence on that side, widen to the multiple."""
    rows = [torch.as_tensor(r) for r in rows]
    if max_length is not None:
        rows = [
            r[:max_length] if cut == "right" else r[max(0, len(r) - max_length) :] for r in rows
        ]
    padded = pad_sequence(rows, batch_first=True, padding_value=value, padding_side=side)
    width = padded.shape[1]
    if multiple and width % multiple:
        extra = multiple - width % multiple
        fill = torch.full((len(rows), extra, *padded.shape[2:]), value, dtype=padded.dtype)
        padded = torch.cat([padded, fill] if side == "right" else [fill, padded], dim=1)
    return padded, torch.tensor([len(r) for r in rows], dtype=torch.int64)


@pytest.mark.parametrize("kind", ["views", "views_shuffled", "numpy_views", "tensors", "lists"])
@pytest.mark.parametrize(
    "options",
    [
        {"max_length": 5},
        {"max_length": 5, "truncation_side": "left"},
        {"pad_to_multiple_of": 8},
        {"padding_side": "left"},
        {"padding_side": "left", "max_length": 4, "pad_to_multiple_of": 3},
        {"max_length": 64, "pad_to_multiple_of": 4},  # longer than every row: nothing cut
    ],
)
def test_truncation_multiples_and_sides_match_torch(kind, options):
    samples = _samples(kind)
    for s in samples:  # labels: same lengths as ids, padded with another value
        s["labels"] = torch.as_tensor(s["ids"]).to(torch.int64) + 1000
    collate = pad_collate(
        pad_value={"ids": 7, "labels": -100}, return_attention_mask=True, **options
    )
    out = collate(samples)
    side = options.get("padding_side", "right")
    cut = options.get("truncation_side", "right")
    args = (options.get("max_length"), options.get("pad_to_multiple_of"), side, cut)
    want_ids, want_len = _reference_rows([s["ids"] for s in samples], 7, *args)
    want_labels, _ = _reference_rows([s["labels"] for s in samples], -100, *args)
    assert torch.equal(out["ids"], want_ids.to(out["ids"].dtype))
    assert torch.equal(out["ids_lengths"], want_len)
    assert torch.equal(out["labels"], want_labels) and out["labels"].dtype == torch.int64
    if options.get("pad_to_multiple_of"):
        assert out["ids"].shape[1] % options["pad_to_multiple_of"] == 0
    # attention_mask: 1 exactly where ids hold data (from "ids", the first padded field)
    ones = [torch.ones(int(n), dtype=torch.int64) for n in want_len]
    want_mask, _ = _reference_rows(ones, 0, None, options.get("pad_to_multiple_of"), side)
    assert out["attention_mask"].dtype == torch.int64
    assert torch.equal(out["attention_mask"], want_mask)


def test_per_field_pad_values_from_the_issue():
    samples = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [8], "labels": [8]},
    ]
    out = kuat.pad_collate(pad_value={"input_ids": 0, "labels": -100}, return_attention_mask=True)(
        samples
    )
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["input_ids_lengths"].tolist() == [3, 1]
    # a field the mapping does not name pads with 0; an existing attention_mask is padded
    samples = [{"x": [1, 2], "attention_mask": [1, 1]}, {"x": [3], "attention_mask": [1]}]
    out = pad_collate(pad_value={"y": 9}, return_attention_mask=True)(samples)
    assert out["x"].tolist() == [[1, 2], [3, 0]]
    assert out["attention_mask"].tolist() == [[1, 1], [1, 0]]


@pytest.mark.parametrize("kind", ["lists", "tensors", "arrays"])
def test_empty_and_2d_rows(kind):
    """The issue's case: boxes (2, 4), (0, 4), (1, 4) -> (3, 2, 4), lengths [2, 0, 1]."""
    boxes = [
        np.arange(8, dtype=np.float32).reshape(2, 4),
        np.zeros((0, 4), np.float32),
        np.full((1, 4), 5, np.float32),
    ]
    if kind == "lists":  # JSON: an empty row is just []
        rows = [b.tolist() for b in boxes]
    elif kind == "tensors":
        rows = [torch.from_numpy(b) for b in boxes]
    else:
        rows = boxes
    samples = [{"boxes": r, "label": i} for i, r in enumerate(rows)]
    out = pad_collate(pad_value=-1)(samples)
    want = pad_sequence([torch.from_numpy(b) for b in boxes], batch_first=True, padding_value=-1)
    assert out["boxes"].shape == (3, 2, 4) and out["boxes"].dtype == torch.float32
    assert torch.equal(out["boxes"], want)
    assert out["boxes_lengths"].tolist() == [2, 0, 1]
    left = pad_collate(pad_value=-1, padding_side="left")(samples)
    want = pad_sequence([torch.from_numpy(b) for b in boxes], True, -1, padding_side="left")
    assert torch.equal(left["boxes"], want)
    # all rows empty: (B, 0)
    out = pad_collate()([{"ids": []}, {"ids": []}])
    assert out["ids"].shape == (2, 0) and out["ids_lengths"].tolist() == [0, 0]


def test_arrow_tables_take_the_options():
    table = pa.table({"ids": pa.array([[1, 2, 3, 4], [], [5]], pa.list_(pa.int32()))})
    out = pad_collate(
        pad_value={"ids": 9},
        max_length=3,
        pad_to_multiple_of=2,
        padding_side="left",
        truncation_side="left",
        return_attention_mask=True,
    )(table)
    assert out["ids"].tolist() == [[9, 2, 3, 4], [9, 9, 9, 9], [9, 9, 9, 5]]
    assert out["ids_lengths"].tolist() == [3, 0, 1]
    assert out["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1]]


def test_option_errors_name_the_value():
    with pytest.raises(TypeError, match="'labels': 'x'"):
        pad_collate(pad_value={"labels": "x"})
    with pytest.raises(ValueError, match="max_length.*0"):
        pad_collate(max_length=0)
    with pytest.raises(ValueError, match="pad_to_multiple_of.*2.5"):
        pad_collate(pad_to_multiple_of=2.5)
    with pytest.raises(ValueError, match="padding_side.*'middle'"):
        pad_collate(padding_side="middle")
    with pytest.raises(ValueError, match="truncation_side"):
        pad_collate(truncation_side="both")
    with pytest.raises(ValueError, match=r"2: \(1, 3\) torch.float32"):
        pad_collate()(
            [
                {"b": np.zeros((2, 4), np.float32)},
                {"b": np.zeros((0, 4), np.float32)},
                {"b": np.zeros((1, 3), np.float32)},
            ]
        )


_FILL_CASES = [
    (-100, torch.uint16),  # the issue's labels pad into uint16 token ids (kuat's ingest dtype)
    (-100, torch.uint8),
    (300, torch.uint8),
    (-1, torch.int8),
    (-129, torch.int8),
    (2**40, torch.int32),
    (float("nan"), torch.int64),
    (0.5, torch.int64),  # fractional: truncated, as torch does
    (1e6, torch.float16),
    (float("-inf"), torch.float32),
    (2, torch.bool),
]


@pytest.mark.parametrize(
    "kind,value,dtype",
    [
        (k, v, d)
        for k in ("views", "numpy_views", "tensors", "arrays", "table")
        for v, d in _FILL_CASES
        if k != "table" or d not in (torch.float16, torch.bool)  # Arrow offsets path: ints, floats
    ],
)
def test_pad_value_that_does_not_fit_the_dtype_is_refused_as_torch_does(kind, value, dtype):
    """A pad value the rows' dtype cannot hold is an error (never a wrapped-around 65436 in
    the labels); the values torch accepts give pad_sequence's result, on every path."""
    rows = [torch.tensor([1, 0, 1], dtype=dtype), torch.tensor([1], dtype=dtype)]
    try:
        want = pad_sequence(rows, batch_first=True, padding_value=value)
    except RuntimeError:
        want = None
    if kind == "views":
        flat = torch.cat(rows)
        rows = [flat[:3], flat[3:]]
    elif kind == "numpy_views":
        flat = torch.cat(rows).numpy()
        rows = [flat[:3], flat[3:]]
    elif kind == "arrays":
        rows = [r.numpy().copy() for r in rows]
    samples = [{"labels": r} for r in rows]
    if kind == "table":
        samples = pa.table({"labels": [r.tolist() for r in rows]}).cast(
            pa.schema([("labels", pa.list_(pa.from_numpy_dtype(rows[0].numpy().dtype)))])
        )
    collate = pad_collate(pad_value={"labels": value})
    if want is None:
        with pytest.raises(ValueError, match=r"'labels'.*does not fit"):
            collate(samples)
    else:
        out = collate(samples)["labels"]
        assert out.dtype == want.dtype and torch.equal(out, want)


def test_views_of_one_buffer_in_another_dtype_are_not_read_as_the_buffers():
    """Rows that view one NumPy buffer through different dtypes (a byte buffer and an int16
    view of it) are not rows of that buffer: the one-op path must not read the int16 row's
    bytes as uint8 values. As on the per-row path, mixed dtypes are refused, naming each."""
    buf = np.arange(16, dtype=np.uint8)
    rows = [buf[0:4], buf.view(np.int16)[3:4]]  # both have .base buf; the second is int16
    assert all(r.base is buf for r in rows)
    with pytest.raises(ValueError, match=r"0: \(4,\) torch.uint8, 1: \(1,\) torch.int16"):
        pad_collate()([{"x": r} for r in rows])


def test_read_only_numpy_rows_pad_without_torchs_non_writable_warning():
    # datasets' numpy format hands out read-only arrays; padding only reads them
    rows = [np.arange(n, dtype=np.int64)[::1].copy() for n in (3, 1, 2)]
    for r in rows:
        r.flags.writeable = False
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = pad_collate()([{"ids": r} for r in rows])
    want = pad_sequence([torch.tensor(r.tolist()) for r in rows], batch_first=True)
    assert torch.equal(got["ids"], want)
