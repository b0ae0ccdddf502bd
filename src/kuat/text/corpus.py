"""A real text corpus that every Python ships, and a tokenizer trained on it: the data of
``kuat demo text``, the text benchmarks and the tests (nothing is downloaded).

The corpus is the Python documentation's topic pages that ``pydoc`` serves offline
(``pydoc_data.topics``, part of the standard library: about 465 KB of English prose and code in
~2,000 paragraphs).
"""

from __future__ import annotations

__all__ = ["python_docs_corpus", "train_bpe", "chat_samples", "EOS"]

EOS = "<|endoftext|>"


def python_docs_corpus(min_chars: int = 40) -> list[str]:
    """The paragraphs (blank-line separated) of ``pydoc_data.topics`` with at least
    ``min_chars`` characters, topics in name order (deterministic)."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            if len(para.strip()) >= min_chars:
                out.append(para.strip())
    return out


def train_bpe(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``, with :data:`EOS` as
    token 0. Takes about a second on the whole corpus.

    Raises:
        kuat.MissingDependencyError: the ``tokenizers`` package is missing (an
            ``ImportError`` naming ``pip install 'kuat[text]'``).
    """
    from kuat.errors import require

    require("tokenizers", extra="text", needed_for="kuat.text.corpus.train_bpe")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def chat_samples(texts: list[str]) -> list[dict]:
    """SFT conversations built from paragraphs: a system prompt, a user question naming the
    paragraph's first words, and the paragraph as the assistant's answer."""
    out = []
    for text in texts:
        topic = " ".join(text.split()[:4])
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "You answer questions about Python."},
                    {"role": "user", "content": f"Explain: {topic}"},
                    {"role": "assistant", "content": text},
                ]
            }
        )
    return out
