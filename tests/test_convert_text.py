"""Tokenize at ingest (kuat.convert.from_text) and on the fly (kuat.text.tokenize)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import kuat
from kuat.testing import assert_same_batch
from kuat.text import encode_chat, pack, tokenize
from kuat.text.corpus import EOS, chat_samples, python_docs_corpus, train_bpe
from kuat.text.tokenize import as_tokenizer, token_dtype

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def corpus():
    return python_docs_corpus()[:300]


@pytest.fixture(scope="module")
def tok(corpus):
    return train_bpe(corpus, vocab_size=1000)


def stored(path, field="input_ids"):
    ds = kuat.open(path)
    return [np.asarray(ds[i][field]) for i in range(len(ds))]


def test_token_dtype():
    assert token_dtype(256) == np.uint8 and token_dtype(257) == np.uint16
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt", "hf", "records"])
def test_text_sources_tokenize_like_the_tokenizer(kind, corpus, tok, tmp_path):
    texts = [t.replace("\n", " ") for t in corpus[:120]]
    if kind == "jsonl":
        src = tmp_path / "a.jsonl"
        src.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)))
    elif kind == "parquet":
        src = tmp_path / "a.parquet"
        pq.write_table(pa.table({"text": texts}), src)
    elif kind == "txt":
        src = tmp_path / "a.txt"
        src.write_text("\n\n".join(texts) + "\n")  # one record per non-empty line
    elif kind == "hf":
        datasets = pytest.importorskip("datasets")
        src = datasets.Dataset.from_dict({"text": texts})
    else:
        src = iter(texts)
    eos = tok.token_to_id(EOS)
    report = kuat.convert.from_text(
        src if kind in ("hf", "records") else str(src),
        tmp_path / "out",
        tok,
        eos_id=eos,
        batch_size=16,
        num_workers=2,
        progress=False,
    )
    assert report.rows == len(texts)
    rows = stored(tmp_path / "out")
    assert all(r.dtype == np.uint16 for r in rows)  # vocabulary 1000 < 65,536
    for r, t in zip(rows, texts, strict=True):
        assert r.tolist() == tok.encode(t, add_special_tokens=False).ids + [eos]
    # bytes per stored token: 2 for the ids, plus the 4-byte row offsets
    tokens = sum(len(r) for r in rows)
    shard_bytes = sum(
        f.stat().st_size for f in (tmp_path / "out").iterdir() if f.suffix == ".arrow"
    )
    assert shard_bytes / tokens < 2.5


def test_chat_loss_mask_and_packed_labels(corpus, tok, tmp_path):
    """SFT labels are -100 exactly on system/user messages, template tokens and boundaries."""
    t = as_tokenizer(tok, tok.token_to_id(EOS))
    samples = chat_samples(corpus[:20])
    src = tmp_path / "chat.jsonl"
    src.write_text("\n".join(json.dumps(s) for s in samples))
    kuat.convert.from_text(str(src), tmp_path / "out", t, progress=False)
    ds = kuat.open(tmp_path / "out")
    assert ds.schema.names == ["input_ids", "loss_mask"]
    for i in (0, 7):
        ids, mask = np.asarray(ds[i]["input_ids"]), np.asarray(ds[i]["loss_mask"])
        # by hand: each message is header, content (+ eos), "\n"; only the assistant's trained
        want_ids, want_mask = [], []
        for m in samples[i]["messages"]:
            header = tok.encode(f"<|{m['role']}|>\n", add_special_tokens=False).ids
            body = tok.encode(m["content"], add_special_tokens=False).ids + [t.eos_id]
            sep = tok.encode("\n", add_special_tokens=False).ids
            on = int(m["role"] == "assistant")
            want_ids += header + body + sep
            want_mask += [0] * len(header) + [on] * len(body) + [0] * len(sep)
        assert ids.tolist() == want_ids and mask.tolist() == want_mask
        assert encode_chat(t, samples[i]["messages"]) == (want_ids, want_mask)
    # packed: labels = ids where the mask is 1, -100 elsewhere and at each document's start
    rows = list(pack(ds, 1024, "best_fit", buffer_size=8, too_long="drop"))
    docs = {tuple(np.asarray(ds[i]["input_ids"]).tolist()): i for i in range(len(ds))}
    seen = 0
    for row in rows:
        at = 0
        for n in row["document_lengths"].tolist():
            i = docs[tuple(row["input_ids"][at : at + n].tolist())]  # whole documents only
            mask = torch.from_numpy(np.asarray(ds[i]["loss_mask"]).astype(bool))
            want = torch.where(mask, row["input_ids"][at : at + n], -100)
            want[0] = -100
            assert torch.equal(row["labels"][at : at + n], want)
            at += n
            seen += 1
    assert seen == len(ds)


def test_transformers_tokenizer_gives_the_same_rows(corpus, tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    texts = corpus[:30]
    kuat.convert.from_text(texts, tmp_path / "a", fast, progress=False)
    kuat.convert.from_text(texts, tmp_path / "b", tok, eos_id=fast.eos_token_id, progress=False)
    a, b = stored(tmp_path / "a"), stored(tmp_path / "b")
    assert [x.tolist() for x in a] == [x.tolist() for x in b]


def test_on_the_fly_tokenize_then_pack_equals_ingest(corpus, tok, tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = corpus[:80]
    eos = tok.token_to_id(EOS)
    kuat.convert.from_text(texts, tmp_path / "out", tok, eos_id=eos, progress=False)
    ingested = list(pack(kuat.open(tmp_path / "out"), 128, "concat"))
    stream = datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset(num_shards=2)
    fly = list(pack(tokenize(stream, tok, eos_id=eos, batch_size=7), 128, "concat"))
    assert len(fly) == len(ingested)
    for a, b in zip(fly, ingested, strict=True):
        assert_same_batch(a, b)


def test_errors_name_the_record(tok, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no field 'text'"):
        kuat.convert.from_text(str(src), tmp_path / "o1", tok, progress=False)
    src.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object"):
        kuat.convert.from_text(str(src), tmp_path / "o2", tok, progress=False)
    with pytest.raises(TypeError, match="tokenizer should be"):
        kuat.convert.from_text(["a"], tmp_path / "o3", object(), progress=False)
    with pytest.raises(ValueError, match="message 1 should be"):
        encode_chat(as_tokenizer(tok), [{"role": "user", "content": "x"}, {"role": "bot"}])


def test_cli_convert_with_a_tokenizer(corpus, tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    src = tmp_path / "a.jsonl"
    src.write_text("\n".join(json.dumps({"body": t}) for t in corpus[:25]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-m", "kuat.cli", "convert", str(src), str(tmp_path / "out"),
         "--tokenizer", str(path), "--text-field", "body", "--eos-id", "0", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "wrote 25 rows" in out.stdout
    rows = stored(tmp_path / "out")
    assert rows[3].tolist() == tok.encode(corpus[3], add_special_tokens=False).ids + [0]


class _CountingTokenizer:
    """A tokenizers.Tokenizer that counts the texts it encodes (threads share the count)."""

    def __init__(self, tok):
        self.tok, self.texts = tok, []

    def encode_batch(self, texts, add_special_tokens=False):
        self.texts.extend(texts)
        return self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)

    def get_vocab_size(self, with_added_tokens=True):
        return self.tok.get_vocab_size(with_added_tokens=with_added_tokens)


@pytest.mark.parametrize("world_size", [1, 2])
def test_on_the_fly_tokenize_splits_before_encoding(corpus, tok, world_size):
    """Each rank and worker tokenizes only its own share, and together they give exactly the
    batches a whole-stream tokenization split afterwards would."""
    texts = [{"text": t} for t in corpus[:90]]
    eos = tok.token_to_id(EOS)
    whole = [s["input_ids"] for s in tokenize(texts, tok, eos_id=eos).samples(0)]
    counting = _CountingTokenizer(tok)
    served = []
    for rank in range(world_size):
        loader = kuat.DataLoader(
            tokenize(texts, counting, eos_id=eos, batch_size=4),
            batch_size=5,
            num_workers=2,
            collate_fn=kuat.pad_collate(),
            rank=rank,
            world_size=world_size,
            seed=0,
        )
        for batch in loader:
            served += [row[:n] for row, n in zip(batch["input_ids"], batch["input_ids_lengths"])]
    assert len(counting.texts) == len(texts)  # every text tokenized once, by one worker
    assert sorted(map(tuple, (s.tolist() for s in served))) == sorted(
        map(tuple, (np.asarray(w).tolist() for w in whole))
    )


def test_on_error_skip_lists_malformed_records(tok, tmp_path):
    """on_error="skip" (ConvertOptions, shared by every converter): bad JSON lines, records
    without the field and non-string fields are left out and named in the report."""
    src = tmp_path / "mixed.jsonl"
    lines = ['{"text": "alpha"}', '{"body": "b"}', '{"text": ', '{"text": 3}', '{"text": "omega"}']
    src.write_text("\n".join(lines) + "\n")
    report = kuat.convert.from_text(
        str(src), tmp_path / "o", tok, on_error="skip", progress=False, batch_size=2
    )
    assert report.rows == 2
    assert [w for w, _ in report.skipped] == [f"{src}:2", f"{src}:3", f"{src}:4"]
    assert "no field 'text'" in report.skipped[0][1]
    assert "not a JSON object" in report.skipped[1][1]
    rows = stored(tmp_path / "o")
    eos = []  # a tokenizers.Tokenizer without eos_id= adds none
    for row, text in zip(rows, ["alpha", "omega"], strict=True):
        assert row.tolist() == tok.encode(text, add_special_tokens=False).ids + eos
    with pytest.raises(ValueError, match="on_error="):
        kuat.convert.from_text(str(src), tmp_path / "o2", tok, on_error="ignore")


def test_progress_lines_when_stderr_is_not_a_terminal(corpus, tok, tmp_path, caplog):
    """Progress as every converter shows it: INFO lines counting records, not batches."""
    import logging

    with caplog.at_level(logging.INFO, logger="kuat.convert"):
        kuat.convert.from_text(
            corpus[:50], tmp_path / "o", tok, progress_interval_s=0, batch_size=8
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenize:")]
    assert lines and "50 samples" in lines[-1] and "samples/s" in lines[-1]


def test_a_tokenizer_without_eos_warns_that_documents_get_no_boundary(tmp_path):
    import warnings

    from kuat.text import tokenize
    from kuat.text.corpus import python_docs_corpus, train_bpe

    texts = python_docs_corpus()[:20]
    tok = train_bpe(texts, vocab_size=300)  # a tokenizers.Tokenizer: it names no eos itself
    with pytest.warns(UserWarning, match="no eos token"):
        kuat.convert.from_text(texts, tmp_path / "a", tok, progress=False)
    with pytest.warns(UserWarning, match="no eos token"):
        tokenize([{"text": t} for t in texts], tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an eos_id, or add_eos=False on purpose: no warning
        kuat.convert.from_text(texts, tmp_path / "b", tok, eos_id=0, progress=False)
        kuat.convert.from_text(texts, tmp_path / "c", tok, add_eos=False, progress=False)
        tokenize([{"text": t} for t in texts], tok, eos_id=0)


def test_tokenize_decides_chat_or_text_per_sample(corpus, tok):
    """A source mixing plain texts, bare strings and chats (text first, chat in mid-batch):
    each sample is tokenized by its own keys; the right ids come from the tokenizer itself."""
    eos = tok.token_to_id(EOS)
    chats = chat_samples(corpus[:3])
    mixed = [{"text": corpus[10]}, chats[0], corpus[11], chats[1], {"text": corpus[12], "id": 3},
             chats[2]]

    def chat_by_hand(messages):
        ids, mask = [], []
        for m in messages:
            header = tok.encode(f"<|{m['role']}|>\n", add_special_tokens=False).ids
            body = tok.encode(m["content"], add_special_tokens=False).ids + [eos]
            sep = tok.encode("\n", add_special_tokens=False).ids
            on = int(m["role"] == "assistant")
            ids += header + body + sep
            mask += [0] * len(header) + [on] * len(body) + [0] * len(sep)
        return ids, mask

    for batch_size in (1, 4, 256):
        got = list(tokenize(mixed, tok, eos_id=eos, batch_size=batch_size).samples(0))
        assert len(got) == len(mixed)
        for sample, out in zip(mixed, got):
            if isinstance(sample, dict) and "messages" in sample:
                ids, mask = chat_by_hand(sample["messages"])
                assert out["input_ids"].tolist() == ids and out["loss_mask"].tolist() == mask
            else:
                text = sample if isinstance(sample, str) else sample["text"]
                assert set(out) == {"input_ids"}
                assert out["input_ids"].tolist() == tok.encode(text, add_special_tokens=False).ids + [eos]
    bad = mixed[:4] + [{"body": "no known key"}] + mixed[4:]
    with pytest.raises(ValueError, match=r"sample 4 .*neither 'messages' \(a chat\) nor 'text'.*body"):
        list(tokenize(bad, tok, eos_id=eos, batch_size=3).samples(0))
    with pytest.raises(ValueError, match="sample 1 .*'text' should be a string, got int"):
        list(tokenize([{"text": "a"}, {"text": 5}], tok, eos_id=eos).samples(0))


def test_from_text_refuses_a_mix_naming_the_record_and_the_rule(corpus, tok, tmp_path):
    # one schema per dataset: the first record decides; the other kind is named, not a KeyError
    eos = tok.token_to_id(EOS)
    for first, other, kind in (({"text": "a b"}, chat_samples(corpus[:1])[0], "text"),
                               (chat_samples(corpus[:1])[0], {"text": "a b"}, "chat")):
        src = tmp_path / f"{kind}.jsonl"
        src.write_text("\n".join(json.dumps(r) for r in (first, first, other)))
        with pytest.raises(ValueError, match=rf"{kind}.jsonl:3.*first record made this a {kind}"):
            kuat.convert.from_text(str(src), tmp_path / f"out-{kind}", tok, eos_id=eos, progress=False)


@pytest.mark.parametrize("ext", ["txt", "jsonl"])
def test_bytes_that_are_not_utf8_are_a_named_skippable_line(tok, tmp_path, ext):
    eos = tok.token_to_id(EOS)
    texts = ["first line", None, "third line"]  # None: a line holding a byte that is not UTF-8
    bad = b"bad \xff" if ext == "txt" else b'{"text": "bad \xff"}'
    good = (lambda t: t.encode()) if ext == "txt" else (lambda t: json.dumps({"text": t}).encode())
    raw = b"\n".join(good(t) if t else bad for t in texts) + b"\n"
    src = tmp_path / f"in.{ext}"
    src.write_bytes(raw)
    with pytest.raises(UnicodeDecodeError):  # the reference reader refuses the file
        raw.decode("utf-8")
    with pytest.raises(ValueError, match=rf"in\.{ext}:2: not valid UTF-8 text \(bytes b'\\xff'"):
        kuat.convert.from_text(str(src), tmp_path / "raised", tok, eos_id=eos, progress=False)
    report = kuat.convert.from_text(str(src), tmp_path / "o", tok, eos_id=eos, progress=False,
                                    on_error="skip")
    assert report.rows == 2 and report.skipped[0][0].endswith(f"in.{ext}:2")
    want = [tok.encode(t, add_special_tokens=False).ids + [eos] for t in texts if t]
    assert [a.tolist() for a in stored(tmp_path / "o")] == want
