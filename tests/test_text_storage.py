"""kuat.text.token_storage: bytes per stored token, in parts, measured from the shards."""

from __future__ import annotations

import numpy as np
import pytest

import kuat
from kuat.text import token_storage
from kuat.text.corpus import EOS, python_docs_corpus, train_bpe

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    texts = python_docs_corpus()[:400]
    tok = train_bpe(texts, vocab_size=1000)
    path = tmp_path_factory.mktemp("storage") / "docs.kuat"
    # small shards: the offsets' one extra entry per shard and each shard's framing count
    kuat.convert.from_text(
        texts, path, tok, eos_id=tok.token_to_id(EOS), shard_bytes=8192, progress=False
    )
    return path


def test_parts_add_up_to_the_files(dataset):
    s = token_storage(dataset)
    ds = kuat.open(dataset)
    lengths = kuat.text.lengths_of(ds)
    shards = sorted(dataset.glob("*.arrow"))
    assert s["shards"] == len(shards) > 1
    assert s["documents"] == len(ds) and s["tokens"] == int(lengths.sum())
    assert s["token_bytes"] == 2 * s["tokens"]  # uint16: a vocabulary of 1,000
    assert s["index_bytes"] == 4 * (s["documents"] + s["shards"])  # int32 offsets, n + 1 a shard
    assert s["file_bytes"] == sum(f.stat().st_size for f in shards)
    assert s["other_bytes"] == s["file_bytes"] - s["token_bytes"] - s["index_bytes"] > 0
    # the token values are what read_batch returns, byte for byte
    stored = ds.read_batch(range(len(ds)), ["input_ids"])["input_ids"]
    assert sum(np.asarray(x).nbytes for x in stored) == s["token_bytes"]


def test_errors_name_the_field_or_the_url(dataset):
    with pytest.raises(ValueError, match=r"'text' is not a token-sequence field .*\['input_ids'\]"):
        token_storage(dataset, "text")
    with pytest.raises(ValueError, match="local datasets, got the URL s3://bucket/x.kuat"):
        token_storage("s3://bucket/x.kuat")
