"""kuat.pack: rows never mix documents, every token once per epoch, exact resume per strategy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kuat
from kuat.format.schema import sequence
from kuat.testing import check_resume
from kuat.text import STRATEGIES, document_mask, flex_block_mask, pack, pack_collate

STRIDE = 10_000  # token t of document d is d * STRIDE + t: every token says where it came from


def make_docs(n=60, seed=0, longest=30):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, longest + 1, n)
    lengths[5] = 0  # an empty document
    lengths[7] = 80  # longer than the rows below
    return [{"input_ids": (d * STRIDE + np.arange(k)).tolist()} for d, k in enumerate(lengths)]


class MapDocs(torch.utils.data.Dataset):
    """A map-style source that counts the documents it is asked for."""

    def __init__(self, docs):
        self.docs = docs
        self.reads = 0

    def __len__(self):
        return len(self.docs)

    def __getitems__(self, indices):
        self.reads += len(indices)
        return [self.docs[i] for i in indices]

    def __getitem__(self, i):
        return self.__getitems__([i])[0]


class IterDocs(torch.utils.data.IterableDataset):
    def __init__(self, docs):
        self.docs = docs

    def __iter__(self):
        return iter(self.docs)


def real_tokens(row) -> list[int]:
    n = int(row["document_lengths"].sum())
    return row["input_ids"][:n].tolist()


def check_row(row, seq_len, pad_id=0):
    """A row's documents are whole pieces, positions restart, labels -100 at each boundary."""
    ids, labels, pos = row["input_ids"], row["labels"], row["position_ids"]
    assert ids.shape == labels.shape == pos.shape == (seq_len,)
    assert ids.dtype == labels.dtype == pos.dtype == torch.int64
    assert row["document_lengths"].dtype == torch.int32
    at = 0
    for n in row["document_lengths"].tolist():
        piece = ids[at : at + n]
        assert n > 0 and len(set((piece // STRIDE).tolist())) == 1  # one document per piece
        assert torch.equal(piece[1:] - piece[:-1], torch.ones(n - 1, dtype=torch.int64))
        assert torch.equal(pos[at : at + n], torch.arange(n))  # positions restart at 0
        assert labels[at] == -100  # nothing predicts across the boundary
        assert torch.equal(labels[at + 1 : at + n], ids[at + 1 : at + n])
        at += n
    assert (ids[at:] == pad_id).all() and (labels[at:] == -100).all()
    assert torch.equal(pos[at:], torch.arange(seq_len - at))


def pieces_by_document(rows) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for row in rows:
        for t in real_tokens(row):
            out.setdefault(t // STRIDE, []).append(t % STRIDE)
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_rows_hold_every_token_once(strategy, kind):
    docs = make_docs()
    source = MapDocs(docs) if kind == "map" else IterDocs(docs)
    packed = pack(source, 32, strategy, buffer_size=8)
    rows = list(packed)
    for row in rows:
        check_row(row, 32)
    got = pieces_by_document(rows)
    for d, doc in enumerate(docs):  # every token of every document, exactly once
        assert sorted(got.get(d, [])) == [t % STRIDE for t in doc["input_ids"]], d
    stats = packed.stats()
    total = sum(len(d["input_ids"]) for d in docs)
    assert stats["documents"] == len(docs) and stats["tokens"] == total
    assert stats["rows"] == len(rows)
    assert stats["pad_tokens"] == 32 * len(rows) - total
    if strategy == "concat":  # documents continue across rows, in order; one padded row at most
        assert [t for r in rows for t in real_tokens(r)] == [
            t for d in docs for t in d["input_ids"]
        ]
        assert stats["pad_tokens"] < 32
    else:
        assert stats["split_documents"] == 1  # document 7 (80 tokens) -> 32 + 32 + 16


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit"])
def test_too_long_documents_dropped_and_counted(strategy):
    docs = make_docs()
    packed = pack(MapDocs(docs), 32, strategy, buffer_size=8, too_long="drop")
    got = pieces_by_document(list(packed))
    assert 7 not in got
    assert packed.stats()["dropped_documents"] == 1
    assert packed.stats()["dropped_tokens"] == len(docs[7]["input_ids"])
    assert set(got) == {d for d, doc in enumerate(docs) if 0 < len(doc["input_ids"]) <= 32}


def test_first_fit_and_best_fit_by_hand():
    # one buffer (the whole input): sizes 5, 4, 3, 3, 2, 2, 1 into rows of 8
    docs = [
        {"input_ids": [d * STRIDE + t for t in range(k)]}
        for d, k in enumerate([5, 4, 3, 3, 2, 2, 1])
    ]
    rows = list(pack(docs, 8, "first_fit", buffer_size=100))
    assert [[t // STRIDE for t in real_tokens(r)][::1] for r in rows] == [
        [0] * 5 + [2] * 3, [1] * 4 + [3] * 3 + [6], [4] * 2 + [5] * 2
    ]  # fmt: skip
    rows = list(pack(docs, 8, "best_fit", buffer_size=100))
    # decreasing: 5 -> row0, 4 -> row1, 3 -> row0 (full), 3 -> row1, 2 -> row2, 2 -> row2, 1 -> row1
    assert [sorted({t // STRIDE for t in real_tokens(r)}) for r in rows] == [
        [0, 2],
        [1, 3, 6],
        [4, 5],
    ]


def test_sft_labels_from_a_loss_mask():
    """A chat sample: prompt and template tokens masked, the answer trained on."""
    prompt, answer = [11, 12, 13, 14], [21, 22, 23]
    sample = {"input_ids": prompt + answer, "loss_mask": [0] * 4 + [1] * 3}
    other = {"input_ids": [31, 32], "labels": [-100, 32]}
    rows = list(pack([sample, other], 12, "first_fit"))
    assert len(rows) == 1
    row = rows[0]
    assert row["input_ids"].tolist() == [11, 12, 13, 14, 21, 22, 23, 31, 32, 0, 0, 0]
    # hand-computed: -100 on the prompt, the boundary (first token of each document) and padding
    assert row["labels"].tolist() == [-100] * 4 + [21, 22, 23] + [-100, 32] + [-100] * 3
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 0, 1, 2]
    # the loss over the packed row equals the sum of the per-document losses
    logits = torch.randn(1, 12, 40, generator=torch.Generator().manual_seed(0))
    packed_loss = F.cross_entropy(
        logits[0, :-1], row["labels"][1:], ignore_index=-100, reduction="sum"
    )
    a = F.cross_entropy(logits[0, 3:6], torch.tensor([21, 22, 23]), reduction="sum")
    b = F.cross_entropy(logits[0, 7:8], torch.tensor([32]), reduction="sum")
    torch.testing.assert_close(packed_loss, a + b)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collate_masks_block_documents(strategy):
    rows = list(pack(make_docs(20, seed=1), 24, strategy, buffer_size=6))[:3]
    batch = pack_collate(document_mask=True)(rows)
    ids = batch["input_ids"]  # (B, L)
    B, L = ids.shape
    assert batch["cu_seqlens"].dtype == torch.int32 and int(batch["cu_seqlens"][-1]) == B * L
    # cu_seqlens: exactly where position_ids restart (transformers' flash-attention convention)
    starts = torch.nonzero(batch["position_ids"].reshape(-1) == 0).flatten()
    assert batch["cu_seqlens"][:-1].tolist() == starts.tolist()
    assert batch["max_seqlen"] == int(torch.diff(batch["cu_seqlens"]).max())
    # document ids: segment s repeated over its slots, as torch.repeat_interleave gives them
    segments = torch.diff(batch["cu_seqlens"])
    want = torch.repeat_interleave(torch.arange(len(segments), dtype=torch.int32), segments)
    assert batch["document_ids"].dtype == torch.int32
    assert torch.equal(batch["document_ids"], want.reshape(B, L))
    mask = batch["attention_mask"]  # (B, 1, L, L)
    doc = torch.where(batch["labels"] == -100, -1, ids // STRIDE)  # for the brute force below
    for b in range(B):
        for q in range(L):
            for k in range(L):
                want = k <= q and batch["document_ids"][b, q] == batch["document_ids"][b, k]
                assert bool(mask[b, 0, q, k]) == bool(want)
                if want and doc[b, q] >= 0 and doc[b, k] >= 0:
                    assert doc[b, q] == doc[b, k]  # never across two documents
    # flex attention's BlockMask gives the same attention as the dense mask
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, 2, L, 16) for _ in range(3))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    from torch.nn.attention.flex_attention import flex_attention

    flex = flex_attention(q, k, v, block_mask=flex_block_mask(batch["document_ids"], block_size=8))
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
    assert torch.equal(document_mask(batch["document_ids"]), mask)


def test_padding_free_collate():
    rows = list(pack(make_docs(20, seed=2), 24, "best_fit", buffer_size=6))[:4]
    batch = pack_collate(padding_free=True)(rows)
    want = torch.cat([torch.tensor(real_tokens(r)) for r in rows])
    assert torch.equal(batch["input_ids"], want[None])  # (1, T), no pad tokens
    lengths = torch.cat([r["document_lengths"] for r in rows])
    assert torch.equal(torch.diff(batch["cu_seqlens"]), lengths)
    assert batch["position_ids"].shape == (1, len(want))
    for s, e in zip(
        batch["cu_seqlens"][:-1].tolist(), batch["cu_seqlens"][1:].tolist(), strict=True
    ):
        assert batch["position_ids"][0, s:e].tolist() == list(range(e - s))
        assert batch["labels"][0, s] == -100


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_from_a_small_state(strategy, shuffle):
    """The packer's own state: exact at every row, and a resume reads at most one buffer."""
    docs = make_docs(80, seed=3)
    packed = pack(MapDocs(docs), 32, strategy, buffer_size=8, shuffle=shuffle, seed=5)
    reference = list(packed.iter_rows(epoch=1))
    it = packed.iter_rows(epoch=1)
    states = [it.state_dict()]
    for _ in it:
        states.append(it.state_dict())
    assert len(states) == len(reference) + 1
    for k in [0, 1, len(reference) // 3, len(reference) // 2, len(reference) - 1, len(reference)]:
        source = MapDocs(docs)
        resumed = pack(source, 32, strategy, buffer_size=8, shuffle=shuffle, seed=5)
        rest = resumed.iter_rows(state=states[k])
        first = next(rest, None)
        if k < len(reference):
            # rebuilding costs the carried row and one buffer, whatever k is
            assert source.reads <= 8 + 32 + (8 if strategy != "concat" else 0) + 256
            kuat.testing.assert_same_batch(first, reference[k], f"row {k}")
        else:
            assert first is None
        for j, row in enumerate(rest, k + 1):
            kuat.testing.assert_same_batch(row, reference[j], f"row {j}")
    assert len(str(states[len(states) // 2])) < 400  # a handful of ints, not the buffer


def test_resume_reads_only_a_buffer_from_a_large_source():
    docs = [{"input_ids": list(range(d % 50 + 1))} for d in range(5000)]
    packed = pack(MapDocs(docs), 64, "best_fit", buffer_size=16)
    it = packed.iter_rows()
    for _ in range(1000):
        next(it)
    state = it.state_dict()
    source = MapDocs(docs)
    row = next(pack(source, 64, "best_fit", buffer_size=16).iter_rows(state=state))
    kuat.testing.assert_same_batch(row, next(it))
    assert source.reads <= 16 + 64 + 256  # carried row + one buffer (read in chunks of 256)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_first_row_reads_one_buffer_whatever_the_dataset_size(strategy):
    """No eager pass: the first row costs one buffer (read in chunks of 256), not the epoch."""
    for n in (2_000, 20_000):
        source = MapDocs([{"input_ids": list(range(d % 50 + 1))} for d in range(n)])
        next(iter(pack(source, 64, strategy, buffer_size=100)))
        assert source.reads <= 256


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    "workers, planned",
    [
        ((0, "thread", 2, "thread"), True),
        ((2, "thread", 0, "thread"), True),
        ((2, "process", 3, "thread"), True),
        ((2, "thread", 2, "process"), False),  # no lengths: each consumer reads the stream
    ],
)
def test_loader_resume_is_exact(strategy, workers, planned):
    """kuat.DataLoader resumes a packer through its kuat_iter_from hook: exact at several points
    of two epochs, for rank 1 of 2, also with another number and type of workers."""
    docs = make_docs(50, seed=4)
    lengths = [len(d["input_ids"]) for d in docs] if planned else None
    num_workers, worker_type, resumed_workers, resumed_type = workers

    def make(n=num_workers, kind=worker_type):
        return kuat.DataLoader(
            pack(MapDocs(docs), 16, strategy, buffer_size=6, lengths=lengths),
            batch_size=3,
            num_workers=n,
            worker_type=kind,
            collate_fn=pack_collate(),
            rank=1,
            world_size=2,
        )

    per_epoch = len(list(make(0)))
    ref = check_resume(
        make,
        midpoints=[0, 1, 4, per_epoch - 1, per_epoch + 2],
        epochs=2,
        make_resumed=lambda: make(resumed_workers, resumed_type),
    )
    assert len(ref) == 2 * per_epoch and per_epoch > 4


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loader_resume_reads_only_what_follows(strategy):
    """Resumed at the epoch's last batch, a planned packer reads only that batch's documents
    (not the epoch's first batches again, as a replay would)."""
    docs = make_docs(200, seed=8)
    lengths = [len(d["input_ids"]) for d in docs]

    def make(source):
        return kuat.DataLoader(
            pack(source, 16, strategy, buffer_size=6, lengths=lengths),
            batch_size=2,
            num_workers=2,
            collate_fn=pack_collate(),
        )

    full = MapDocs(docs)
    batches = list(make(full))
    loader = make(MapDocs(docs))
    it = iter(loader)
    for _ in range(len(batches) - 1):
        next(it)
    state = loader.state_dict()
    del it, loader
    # fit strategies: the plan's checkpoint (the buffer holding the next row); concat: nothing
    assert (state["source"] is None) == (strategy == "concat")
    source = MapDocs(docs)
    resumed = make(source)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == 1
    kuat.testing.assert_same_batch(rest[0], batches[-1])
    assert 0 < source.reads <= int(batches[-1]["document_lengths"].numel()) < full.reads // 10


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit"])
def test_plan_checkpoints_do_not_depend_on_the_order_asked(strategy):
    """kuat_state_at continues its plan from the last point asked: asked in any order, it
    says what a fresh packer says, and the rows from there are the uninterrupted rows."""
    docs = make_docs(300, seed=9)
    lengths = [len(d["input_ids"]) for d in docs]
    packed = pack(MapDocs(docs), 32, strategy, buffer_size=10, lengths=lengths)
    packed.kuat_set_batching(2, False)
    rows = list(packed)
    for served in (40, 3, 0, 41, 90, 200, 7):
        fresh = pack(MapDocs(docs), 32, strategy, buffer_size=10, lengths=lengths)
        fresh.kuat_set_batching(2, False)
        state = packed.kuat_state_at(1, served, 1, 3)
        assert state == fresh.kuat_state_at(1, served, 1, 3)
        if state is not None:
            assert state["first_row"] <= 1 + 3 * 2 * served
        rest = list(fresh.kuat_iter_from(0, served, packed.kuat_state_at(0, served, 0, 1)))
        assert len(rest) == max(0, len(rows) - 2 * served)
        for got, want in zip(rest, rows[2 * served :]):
            kuat.testing.assert_same_batch(got, want)
    with pytest.raises(ValueError, match="plan state of epoch 2"):
        next(packed.kuat_iter_from(2, 5, packed.kuat_state_at(1, 5, 0, 1)))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("planned", [False, True])
def test_every_token_once_across_ranks_and_workers(strategy, world_size, drop_last, planned):
    """Rank and worker shares; ``planned``: with the documents' lengths, where each consumer
    plans from the lengths and reads only the documents of its own rows."""
    docs = make_docs(70, seed=6)
    lengths = [len(d["input_ids"]) for d in docs] if planned else None
    packed = pack(MapDocs(docs), 32, strategy, buffer_size=8)
    unsplit = list(packed)
    per_rank = []
    for rank in range(world_size):
        source = MapDocs(docs)
        loader = kuat.DataLoader(
            pack(source, 32, strategy, buffer_size=8, lengths=lengths),
            batch_size=2,
            num_workers=2,
            collate_fn=pack_collate(),
            rank=rank,
            world_size=world_size,
            seed=0,
            drop_last=drop_last,
        )
        rows = []
        for batch in loader:
            rows.extend(batch["input_ids"])
        per_rank.append(rows)
        if planned:  # each document piece of the rank's rows read at most once; nothing else
            pieces = sum(
                len(unsplit[p % len(unsplit)]["document_lengths"])
                for p in range(rank, len(unsplit) + world_size, world_size)
            )
            assert 0 < source.reads <= pieces < len(docs)
        else:  # the rank's two workers each read the whole epoch
            assert source.reads == 2 * len(docs)
    counts = {len(rows) for rows in per_rank}
    assert len(counts) == 1  # equal shares: the same number of rows (and batches) per rank
    # rank r holds rows r, r + W, ... of the unsplit epoch (DistributedSampler's split)
    n = len(unsplit)
    served = n // world_size * world_size if drop_last else -(-n // world_size) * world_size
    for rank, rows in enumerate(per_rank):
        want = [unsplit[p % n]["input_ids"] for p in range(rank, served, world_size)]
        if drop_last:  # the loader also drops each rank's incomplete last batch (torch's rule)
            want = want[: len(want) // 2 * 2]
        assert len(rows) == len(want)
        for got, w in zip(rows, want, strict=True):
            assert torch.equal(got, w)
    if drop_last:
        return
    # so every token appears exactly once across ranks and workers (plus the wrap-around rows
    # that even out the ranks, as DistributedSampler pads)
    tokens = sorted(t for rows in per_rank for r in rows for t in r[r != 0].tolist())
    real = [t for d in docs for t in d["input_ids"] if t != 0]
    wrapped = [t for r in unsplit[: served - n] for t in real_tokens(r) if t != 0]
    assert tokens == sorted(real + wrapped)


def test_hf_datasets_sources():
    datasets = pytest.importorskip("datasets")
    docs = make_docs(30, seed=7)
    ds = datasets.Dataset.from_list(docs)
    for fmt in (None, "numpy", "torch", "arrow"):
        if fmt == "arrow":
            continue  # one-row tables are not documents
        rows = list(pack(ds.with_format(fmt), 32, "best_fit", buffer_size=8))
        ref = list(pack(docs, 32, "best_fit", buffer_size=8))
        assert len(rows) == len(ref)
        for a, b in zip(rows, ref, strict=True):
            kuat.testing.assert_same_batch(a, b)
    stream = ds.to_iterable_dataset(num_shards=3)
    rows = list(pack(stream, 32, "concat"))
    assert sorted(t for r in rows for t in real_tokens(r)) == sorted(
        t for d in docs for t in d["input_ids"]
    )


def test_argument_and_document_errors():
    with pytest.raises(ValueError, match="seq_len.*0"):
        pack([], 0)
    with pytest.raises(ValueError, match="strategy.*'bfd'"):
        pack([], 8, "bfd")
    with pytest.raises(ValueError, match="too_long.*'cut'"):
        pack([], 8, too_long="cut")
    with pytest.raises(ValueError, match="buffer_size"):
        pack([], 8, buffer_size=0)
    with pytest.raises(TypeError, match="pad_id"):
        pack([], 8, pad_id=1.5)
    with pytest.raises(ValueError, match=r"document 1 \(source index 1\).*labels has 2 values"):
        list(pack([{"input_ids": [1]}, {"input_ids": [1, 2, 3], "labels": [1, 2]}], 8))
    with pytest.raises(ValueError, match=r"document 0 .*no field 'input_ids'"):
        list(pack([{"text": "hi"}], 8))
    with pytest.raises(ValueError, match="1-d sequence of integers"):
        list(pack([{"input_ids": [0.5, 1.5]}], 8))
    with pytest.raises(ValueError, match="not a 'concat' packer state"):
        pack([], 8, "concat").iter_rows(state={"version": 1, "strategy": "best_fit"})
    with pytest.raises(ValueError, match="rows of different lengths"):
        pack_collate()([next(iter(pack([[1, 2]], 4))), next(iter(pack([[1, 2]], 5)))])


def _same_rows(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("too_long", ["split", "drop"])
def test_kuat_dataset_read_column_wise_gives_the_same_rows(tmp_path, strategy, too_long):
    """The column-wise read of a kuat dataset (one read_batch per block, uint16 tokens, a
    uint8 loss mask) packs exactly as the per-document path over the same samples."""
    rng = np.random.default_rng(3)
    docs = make_docs(n=700, seed=3, longest=40)
    masks = [rng.integers(0, 2, len(d["input_ids"])).astype(np.uint8) for d in docs]
    ids = [np.asarray(d["input_ids"], np.int64) % 60_000 for d in docs]
    schema = {
        "input_ids": sequence("uint16"),
        "loss_mask": sequence("uint8"),
    }
    with kuat.Writer(tmp_path / "d", schema) as w:
        w.write_batch({"input_ids": [i.astype(np.uint16) for i in ids], "loss_mask": masks})
    ds = kuat.open(tmp_path / "d")
    plain = [{"input_ids": i, "loss_mask": m} for i, m in zip(ids, masks, strict=True)]
    for shuffle in (False, True):
        kw = dict(buffer_size=100, too_long=too_long, shuffle=shuffle, seed=5)
        got = list(pack(ds, 64, strategy, **kw))
        _same_rows(got, list(pack(MapDocs(plain), 64, strategy, **kw)))
        assert len(got) > 10
        # one consumer of a kuat dataset packs in order; with lengths given it follows the
        # plan (documents fetched per buffer, checked against the lengths): the same rows
        lengths = kuat.text.lengths_of(ds)
        planned = pack(ds, 64, strategy, lengths=lengths, **kw)
        _same_rows(got, list(planned))
        assert planned.stats()["read_documents"] < len(ds)  # (only the non-empty are fetched)


def test_concat_matches_a_per_token_reference():
    """concat rows against a plain per-token reference: cut every L tokens, a segment starts
    at each document's first token and at each row start."""
    docs = make_docs(n=300, seed=4, longest=50)
    seq_len = 32
    flat, first = [], []
    for d in docs:
        for t, tok in enumerate(d["input_ids"]):
            flat.append(tok)
            first.append(t == 0)
    rows = list(pack(docs, seq_len, "concat"))
    assert len(rows) == -(-len(flat) // seq_len)
    for r, row in enumerate(rows):
        ids = flat[r * seq_len : (r + 1) * seq_len]
        starts = [c == 0 or first[r * seq_len + c] for c in range(len(ids))]
        pos, lengths = [], []
        for s in starts:
            pos.append(0 if s else pos[-1] + 1)
            if s:
                lengths.append(0)
            lengths[-1] += 1
        pad = seq_len - len(ids)
        assert row["input_ids"].tolist() == ids + [0] * pad
        assert (
            row["labels"].tolist()
            == [-100 if s else t for t, s in zip(ids, starts, strict=True)] + [-100] * pad
        )
        assert row["position_ids"].tolist() == pos + list(range(pad))
        assert row["document_lengths"].tolist() == lengths


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_map_style_mix_reads_the_packers_epoch_outside_the_loader(strategy):
    """A map-style mix reads a new window of a cut source each epoch. The packer's epoch must
    reach it however the packer is driven: iter_rows(epoch), a resume state from a later epoch,
    and torch's DataLoader after set_epoch (not only kuat's loader, which sets its own)."""

    def build():
        long = MapDocs(make_docs(40, seed=1))  # cut to 6 documents per epoch by the mix
        short = MapDocs(
            [{"input_ids": (900 * STRIDE + 10 * i + np.arange(5)).tolist()} for i in range(6)]
        )
        return kuat.mix([long, short], stopping="first_exhausted", seed=0)

    def truth(epoch):  # the mix's documents of that epoch, packed as a plain list
        m = build()
        m.set_epoch(epoch)
        docs = MapDocs([m[i] for i in range(len(m))])
        return [r["input_ids"] for r in pack(docs, 16, strategy, buffer_size=5).iter_rows(epoch)]

    want = [truth(e) for e in range(3)]
    assert want[1] != want[0] or len(want[1]) != len(want[0])  # windows move on
    packed = pack(build(), 16, strategy, buffer_size=5)
    for epoch in range(3):
        got = [r["input_ids"] for r in packed.iter_rows(epoch)]
        assert len(got) == len(want[epoch]) and all(map(torch.equal, got, want[epoch]))
    it = packed.iter_rows(2)
    next(it)
    rest = [r["input_ids"] for r in packed.iter_rows(state=it.state_dict())]
    assert len(rest) == len(want[2]) - 1 and all(map(torch.equal, rest, want[2][1:]))
    loader = torch.utils.data.DataLoader(packed, batch_size=None)
    for epoch in range(3):
        packed.set_epoch(epoch)
        got = list(b["input_ids"] for b in loader)
        assert len(got) == len(want[epoch]) and all(map(torch.equal, got, want[epoch]))


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit"])
def test_thread_workers_share_one_plan_per_epoch(strategy, monkeypatch):
    """A loader's thread workers read one fit plan per epoch: the bin choice runs once per
    buffer, not once per worker, and the batches are those of a loader without workers."""
    import copy

    from kuat.text.pack._strategies import FIT_STRATEGIES

    real, calls = FIT_STRATEGIES[strategy], []
    monkeypatch.setitem(FIT_STRATEGIES, strategy, lambda s, c: calls.append(len(s)) or real(s, c))
    docs = make_docs(300, seed=9)
    lengths = [len(d["input_ids"]) for d in docs]

    def make(n):
        return kuat.DataLoader(
            pack(MapDocs(docs), 16, strategy, buffer_size=20, lengths=lengths),
            batch_size=3,
            num_workers=n,
            worker_type="thread",
            collate_fn=pack_collate(),
        )

    want = [b["input_ids"] for b in make(0)]
    per_epoch, calls[:] = list(calls), []
    loader = make(3)
    for _epoch in range(2):
        got = [b["input_ids"] for b in loader]
        assert len(got) == len(want) and all(map(torch.equal, got, want))
        assert calls == per_epoch  # every buffer's bin choice once, for all 3 workers
        calls.clear()
    packed = pack(MapDocs(docs), 16, strategy, lengths=lengths)
    assert copy.copy(packed)._plans is packed._plans  # what a thread worker gets
    import pickle

    assert pickle.loads(pickle.dumps(packed))._plans is not packed._plans  # a process worker


def test_shared_plan_drops_what_every_reader_passed_and_a_late_reader_plans_alone():
    from kuat.text.pack._plan import START, SharedPlan, fit_plan
    from kuat.text.pack._stats import PackStats

    docs = make_docs(200, seed=3)
    lens = np.array([len(d["input_ids"]) for d in docs], np.int64)
    packed = pack(docs, 16, "best_fit", buffer_size=10, lengths=lens)

    def make(stats):
        return fit_plan(lens, packed, stats, START)

    alone_stats = PackStats(16)
    alone = [(first, buf.bins) for first, buf in make(alone_stats)]
    plan = SharedPlan(make, readers=2)
    stats = [PackStats(16), PackStats(16)]
    readers = [plan.read(s) for s in stats]
    got = [[], []]
    for a, b in zip(*readers, strict=True):  # in step: each buffer is dropped once both read it
        got[0].append((a[0], a[1].bins))
        got[1].append((b[0], b[1].bins))
        assert len(plan._buffers) <= 1
    assert got[0] == got[1] == alone and len(alone) > 5
    assert stats[0].as_dict() == stats[1].as_dict() == alone_stats.as_dict()
    late = PackStats(16)  # a third reader, after buffers were dropped: plans on its own
    assert [(first, buf.bins) for first, buf in plan.read(late)] == alone
    assert late.as_dict() == alone_stats.as_dict()
