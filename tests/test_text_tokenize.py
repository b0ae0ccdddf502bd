"""``kuat.text.tokenize.Tokenizer`` reads a transformers fast tokenizer through its Rust backend:
the ids must be exactly those of ``tok(texts, add_special_tokens=False)["input_ids"]``.

Tokenizers are trained here (``tokenizers`` trainers, nothing downloaded) and wrapped in
``transformers.PreTrainedTokenizerFast`` with special tokens, a post-processor that adds bos/eos
(so ``add_special_tokens`` matters) and the settings ``__call__`` overrides.
"""

from __future__ import annotations

import pickle

import pytest

from kuat.text.corpus import python_docs_corpus
from kuat.text.tokenize import Tokenizer, as_tokenizer

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

SPECIAL = ["<s>", "</s>", "<unk>", "<pad>", "<|im_start|>"]


def _bpe(texts):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def _wordpiece(texts):
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)  # strips accents, CJK split
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=600, special_tokens=SPECIAL,
                                        show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def _wrap(backend, **kwargs):
    from tokenizers.processors import TemplateProcessing

    backend.post_processor = TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>",
        special_tokens=[("<s>", backend.token_to_id("<s>")), ("</s>", backend.token_to_id("</s>"))],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", additional_special_tokens=["<|im_start|>"], **kwargs,
    )


@pytest.fixture(scope="module")
def docs():
    return python_docs_corpus()[:200]


@pytest.fixture(scope="module")
def texts(docs):
    """Unicode, empty and whitespace-only strings, long documents, special tokens in text."""
    return [
        "",
        "   ",
        "\n\n\t",
        "Grüße aus Köln: café, naïve, Ångström, e\u0301 (combining)",
        "東京都の天気は晴れです。北京欢迎你。서울특별시",
        "emoji 👩‍👩‍👧‍👦🏳️‍🌈 and RTL: مرحبا بالعالم שלום",
        "zero\u200bwidth\u00a0nbsp \ufeffbom",
        "a special token inside: <s> hello </s> and <|im_start|>user\nhi<pad><unk>",
        "<s></s>",
        "</s>",
        "x" * 5000,
        " ".join(docs) * 3,  # a long document, ~100k characters
        *docs[:50],
        "",
    ]


@pytest.fixture(scope="module", params=["bpe", "wordpiece"])
def backend(request, docs):
    return (_bpe if request.param == "bpe" else _wordpiece)(docs)


def _reference(tok, texts):
    return [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


def _no_call(monkeypatch, tok):
    """Make the ``__call__`` path fail, so a test sees that the backend path was taken."""
    def refuse(*args, **kwargs):
        raise AssertionError("went through transformers' __call__")

    monkeypatch.setattr(tok, "_encode_plus", refuse)
    if hasattr(tok, "_batch_encode_plus"):
        monkeypatch.setattr(tok, "_batch_encode_plus", refuse)


@pytest.mark.parametrize("split_special_tokens", [False, True])
def test_backend_ids_equal_call(backend, texts, monkeypatch, split_special_tokens):
    fast = _wrap(backend, split_special_tokens=split_special_tokens)
    want = _reference(fast, texts)
    assert any(want) and want[0] == []  # the corpus is encoded, the empty string to nothing
    assert want != [list(e.ids) for e in fast.backend_tokenizer.encode_batch(texts)]  # bos/eos

    kt = as_tokenizer(fast)
    assert kt.eos_id == fast.eos_token_id and kt.vocab_size == len(fast)
    _no_call(monkeypatch, fast)
    assert kt.encode_batch(texts) == want
    assert kt.encode_batch(tuple(texts[3:5])) == want[3:5]
    assert kt.encode_batch([]) == []

    # a pickled copy (process workers, ingest on all cores): the backend's pickle drops
    # encode_special_tokens, which __call__ sets again, so a first batch may take __call__
    copy = pickle.loads(pickle.dumps(as_tokenizer(_wrap(backend, split_special_tokens=split_special_tokens))))
    assert copy.encode_batch(texts) == want
    _no_call(monkeypatch, copy.tok)
    assert copy.encode_batch(texts) == want


def test_settings_call_would_override_go_through_call_first(backend, texts, monkeypatch):
    """A backend with truncation and padding set (as a tokenizer.json may have them) and
    ``split_special_tokens`` changed after construction: ``__call__`` resets all three before
    it encodes, so the first batch goes through it, the next ones through the backend."""
    backend = tokenizers.Tokenizer.from_str(backend.to_str())
    backend.enable_truncation(max_length=8)
    backend.enable_padding(pad_id=backend.token_to_id("<pad>"), pad_token="<pad>")
    fast = _wrap(backend)
    assert fast.backend_tokenizer.truncation is not None  # transformers kept them
    fast.split_special_tokens = True
    kt = Tokenizer(fast)

    probe = _wrap(tokenizers.Tokenizer.from_str(backend.to_str()))  # same settings, own object
    probe.split_special_tokens = True
    want = _reference(probe, texts)
    assert max(map(len, want)) > 8  # not truncated

    assert kt.encode_batch(texts) == want  # through __call__, which resets the backend
    assert fast.backend_tokenizer.truncation is None and fast.backend_tokenizer.padding is None
    _no_call(monkeypatch, fast)
    assert kt.encode_batch(texts) == want


def test_subclass_that_overrides_the_call_chain_uses_call(backend, texts):
    calls = []

    class Custom(transformers.PreTrainedTokenizerFast):
        def _encode_plus(self, *args, **kwargs):  # e.g. code_llama's infilling
            calls.append(1)
            return super()._encode_plus(*args, **kwargs)

    fast = Custom(tokenizer_object=backend, eos_token="</s>")
    assert Tokenizer(fast).encode_batch(texts[:6]) == _reference(fast, texts[:6][:])
    assert len(calls) == 2  # kuat's call and the reference's
