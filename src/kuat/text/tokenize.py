"""Tokenizers behind one small interface, chat samples with a loss mask, tokenizing streams.

:func:`as_tokenizer` adapts, by what the object offers (nothing is imported for it):

* a ``tokenizers.Tokenizer`` (``encode_batch_fast`` where the version has it, 0.21 and later:
  the same ids as ``encode_batch`` without computing each token's character offsets, which
  kuat never reads, ~20% less CPU on the bench's corpus; its Rust thread pool parallelises a
  batch and releases the GIL);
* a ``transformers`` tokenizer (callable, with ``eos_token_id``): a fast one
  (``PreTrainedTokenizerFast``, whose class keeps transformers' own encode methods) is read
  through its Rust backend (``tok.backend_tokenizer.encode_batch_fast``), the call its
  ``__call__(texts, add_special_tokens=False)`` ends in, without building a ``BatchEncoding``
  (attention masks, token type ids, per-text Python dicts): the same ids (see
  :meth:`Tokenizer.encode_batch` for when ``__call__`` is used instead;
  ``tests/test_text_tokenize.py`` checks them), in 1/1.37 of the time (median of 11
  interleaved rounds, 1.18-1.90x, 256 or 1,000 texts per call, the bench's BPE-8192 on its
  1.3 M-character corpus, 2 loaded cores); other transformers tokenizers through ``__call__``;
* a ``tiktoken.Encoding`` (``encode_ordinary_batch``, ``eot_token``).

Chat samples (``messages``: a list of ``{"role", "content"}``) are rendered with a plain,
explicit template and tokenized message by message, as torchtune's ``tokenize_messages`` does,
so each token's loss-mask value is known without re-aligning strings::

    <|role|>\\n content <eos>\\n

The header (``<|role|>\\n``) and the separator are template tokens (never trained); a message's
content and its ``eos`` are trained exactly when its role is ``assistant`` (``train_on``).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from kuat.sources.reading import stream_of
from kuat.sources.stream import Stream

__all__ = [
    "Tokenize",
    "Tokenizer",
    "as_tokenizer",
    "encode_chat",
    "load_tokenizer",
    "token_dtype",
    "tokenize",
]


class Tokenizer:
    """``encode_batch(texts) -> list[list[int]]``, ``vocab_size`` and ``eos_id`` of any
    supported tokenizer (see the module docstring). Thread-safe as the wrapped tokenizer is
    (all three supported ones are)."""

    def __init__(self, tok, eos_id: int | None = None):
        self.tok = tok
        self._backend_ok = False  # a transformers fast tokenizer read through its backend
        if hasattr(tok, "encode_batch") and hasattr(tok, "get_vocab_size"):  # tokenizers
            self.kind = "tokenizers"
            self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        elif hasattr(tok, "encode_ordinary_batch"):  # tiktoken
            self.kind = "tiktoken"
            self.vocab_size = int(tok.n_vocab)
            eos_id = tok.eot_token if eos_id is None else eos_id
        elif callable(tok) and hasattr(tok, "eos_token_id"):  # transformers
            self.kind = "transformers"
            self.vocab_size = len(tok)
            eos_id = tok.eos_token_id if eos_id is None else eos_id
            self._backend_ok = _encodes_through_backend(tok)
        else:
            raise TypeError(
                "tokenizer should be a tokenizers.Tokenizer, a transformers tokenizer or a "
                f"tiktoken Encoding, got {type(tok).__name__}"
            )
        if eos_id is not None and not 0 <= int(eos_id) < self.vocab_size:
            raise ValueError(f"eos_id={eos_id} is outside the vocabulary [0, {self.vocab_size})")
        self.eos_id = None if eos_id is None else int(eos_id)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each of the N texts (``list`` of N ``list[int]``), without special
        tokens (kuat adds ``eos_id`` itself); ``[]`` for no texts.

        A ``transformers`` fast tokenizer is read through its backend with what its
        ``__call__(texts, add_special_tokens=False)`` would set there first: no truncation,
        no padding, ``encode_special_tokens = tok.split_special_tokens``. While the backend
        holds other settings (a ``tokenizer.json`` with truncation or padding, a changed
        ``split_special_tokens``), the batch goes through ``__call__``, which sets them as it
        always does, so the next batches take the backend path. Unlike ``__call__``, the
        backend path does not warn about texts longer than ``model_max_length`` (kuat packs
        or splits long documents).
        """
        texts = list(texts)
        if self.kind == "tokenizers":
            encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        if self.kind == "tiktoken":
            return self.tok.encode_ordinary_batch(texts)
        if self._backend_ok:
            backend = self.tok.backend_tokenizer
            if _backend_set_as_call_sets_it(self.tok, backend):
                encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
                return [e.ids for e in encode(texts, add_special_tokens=False)]
        if not texts:
            return []  # transformers 5's __call__ fails on an empty batch (IndexError)
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


# what a transformers fast tokenizer runs between __call__ and its backend's encode_batch (4.x
# and 5.x names); a class that overrides any of them may do more than the backend does
_CALL_CHAIN = ("__call__", "_call_one", "encode_plus", "batch_encode_plus", "_encode_plus",
               "_batch_encode_plus", "set_truncation_and_padding")


def _encodes_through_backend(tok) -> bool:
    """Whether ``tok`` is a ``transformers.PreTrainedTokenizerFast`` whose class keeps every
    method of the ``__call__`` chain as transformers defines it (so ``__call__`` ends in
    ``backend_tokenizer.encode_batch`` of the same texts), with a ``tokenizers`` backend."""
    import sys

    transformers = sys.modules.get("transformers")  # a transformers object implies it
    base = getattr(transformers, "PreTrainedTokenizerFast", None) if transformers else None
    if base is None or not isinstance(tok, base):
        return False
    cls = type(tok)
    if any(getattr(cls, name, None) is not getattr(base, name, None) for name in _CALL_CHAIN):
        return False
    backend = getattr(tok, "backend_tokenizer", None)
    return callable(getattr(backend, "encode_batch", None))


def _backend_set_as_call_sets_it(tok, backend) -> bool:
    """Whether ``backend`` already has what ``tok(texts, add_special_tokens=False)`` sets on
    it before encoding (transformers' ``set_truncation_and_padding`` and
    ``encode_special_tokens``): no truncation, no padding, special tokens split or not as
    ``tok.split_special_tokens`` says."""
    return (backend.truncation is None and backend.padding is None
            and bool(getattr(backend, "encode_special_tokens", False))
            == bool(getattr(tok, "split_special_tokens", False)))


def warn_if_no_eos(tok: Tokenizer, add_eos: bool, stacklevel: int = 3) -> None:
    """Warn (``UserWarning``) when documents are to end with an eos token but the tokenizer
    names none and no ``eos_id`` was given: packed documents would then run into each other
    with nothing marking the boundary in the token stream."""
    if add_eos and tok.eos_id is None:
        import warnings

        warnings.warn(
            f"{tok!r} names no eos token and no eos_id was given: documents get no "
            "end-of-document token, so packed documents run into each other in the token "
            "stream; pass eos_id= (kuat convert: --eos-id), or add_eos=False to mean it",
            UserWarning,
            stacklevel=stacklevel,
        )


def as_tokenizer(tok, eos_id: int | None = None) -> Tokenizer:
    """``tok`` as a :class:`Tokenizer` (unchanged if it is one)."""
    return tok if isinstance(tok, Tokenizer) else Tokenizer(tok, eos_id)


def load_tokenizer(path: str) -> object:
    """A tokenizer from a local file or directory (never downloads): a ``tokenizer.json``
    (``tokenizers.Tokenizer.from_file``) or a ``transformers`` tokenizer directory
    (``AutoTokenizer.from_pretrained(path, local_files_only=True)``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        kuat.MissingDependencyError: ``transformers`` (for a directory) or ``tokenizers`` (for
            a file) is not installed (an ``ImportError`` naming the pip install).
    """
    import os

    from kuat.errors import require

    if not os.path.exists(path):
        raise FileNotFoundError(f"no tokenizer at {path}")
    if os.path.isdir(path):
        transformers = require(
            "transformers", extra="frameworks", needed_for=f"the tokenizer directory {path}"
        )
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizers = require("tokenizers", extra="text", needed_for=f"the tokenizer file {path}")
    return tokenizers.Tokenizer.from_file(path)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds ids ``0 .. vocab_size - 1``: uint8 up to
    256 tokens, uint16 up to 65,536 (2 bytes per stored token, as nanoGPT's and Megatron's
    token files), else uint32."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size={vocab_size} does not fit in 32 bits")


def encode_chat(
    tok: Tokenizer, messages: Sequence[Mapping], *, train_on: Sequence[str] = ("assistant",)
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of one conversation (see the module docstring).

    Raises:
        ValueError: a message without a string ``role`` and ``content`` (names its position).
    """
    texts: list[str] = []
    trained: list[bool] = []
    for i, m in enumerate(messages):
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(
                f"message {i} should be {{'role': str, 'content': str}}, got {m!r:.100}"
            )
        texts += [f"<|{m['role']}|>\n", m["content"], "\n"]
        trained.append(m["role"] in train_on)
    encoded = tok.encode_batch(texts) if texts else []
    ids: list[int] = []
    mask: list[int] = []
    for i, on in enumerate(trained):
        header, content, sep = encoded[3 * i : 3 * i + 3]
        body = content + ([] if tok.eos_id is None else [tok.eos_id])
        ids += header + body + sep
        mask += [0] * len(header) + [int(on)] * len(body) + [0] * len(sep)
    return ids, mask


class Tokenize(Stream):
    """See :func:`tokenize`."""

    def __init__(self, source, tok: Tokenizer, text_field, messages_field, batch_size, add_eos):
        super().__init__()
        from kuat.sources import as_source

        self.source = as_source(source)
        self.tok = tok
        self._backend_ok = False  # a transformers fast tokenizer read through its backend
        self.text_field = text_field
        self.messages_field = messages_field
        self.batch_size = batch_size
        self.add_eos = add_eos

    def samples(self, epoch: int) -> Iterator[dict]:
        """Every sample of ``epoch`` tokenized, in order (what a packer reads)."""
        return self._encoded(stream_of(self.source, epoch), epoch)

    def __iter__(self) -> Iterator[dict]:
        # Tokenizing maps samples 1:1, so split the raw samples by rank and worker first (the
        # same positions Stream.__iter__ would keep) and tokenize only this share: the loader's
        # workers tokenize in parallel instead of each tokenizing the whole stream.
        raw = _RawShare(self.source)
        raw._epoch, raw._rank, raw._world_size = self._epoch, self._rank, self._world_size
        raw._batch_size, raw._drop_last = self._batch_size, self._drop_last
        return self._encoded(Stream.__iter__(raw), self._epoch)

    def _encoded(self, samples: Iterator, epoch: int) -> Iterator[dict]:
        batch: list = []
        position = 0  # of the batch's first sample in what this iterator reads
        for sample in samples:
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield from self._encode(batch, position, epoch)
                position += len(batch)
                batch = []
        if batch:
            yield from self._encode(batch, position, epoch)

    def _kind(self, sample, where: str) -> str:
        """``"chat"`` or ``"text"``, decided for each sample (sources may mix them)."""
        if isinstance(sample, str):
            return "text"
        if isinstance(sample, Mapping):
            if self.messages_field in sample:
                return "chat"
            if isinstance(sample.get(self.text_field), str):
                return "text"
            if self.text_field in sample:
                raise ValueError(
                    f"tokenize: {where}: {self.text_field!r} should be a string, got "
                    f"{type(sample[self.text_field]).__name__}")
            keys = list(sample)
        else:
            keys = type(sample).__name__
        raise ValueError(
            f"tokenize: {where} has neither {self.messages_field!r} (a chat) nor {self.text_field!r} (a text): "
            f"{keys!r:.200}")

    def _encode(self, samples: list, position: int = 0, epoch: int = 0) -> list[dict]:
        """Each sample tokenized as chat or text by its own keys, in order; the texts of the
        batch go to the tokenizer in one call."""

        def where(k: int) -> str:
            return f"sample {position + k} (of this stream's share of epoch {epoch})"

        kinds = [self._kind(s, where(k)) for k, s in enumerate(samples)]
        out: list = [None] * len(samples)
        texts, where = [], []
        for k, (s, kind) in enumerate(zip(samples, kinds)):
            if kind == "text":
                texts.append(s if isinstance(s, str) else s[self.text_field])
                where.append(k)
                continue
            try:
                ids, mask = encode_chat(self.tok, s[self.messages_field])
            except ValueError as e:
                raise ValueError(f"tokenize: {where(k)}: {e}") from e
            out[k] = {"input_ids": np.asarray(ids, np.int64),  # (n,) int64
                      "loss_mask": np.asarray(mask, np.uint8)}  # (n,) uint8
        if texts:
            eos = [self.tok.eos_id] if self.add_eos and self.tok.eos_id is not None else []
            for k, ids in zip(where, self.tok.encode_batch(texts)):
                out[k] = {"input_ids": np.asarray(ids + eos, np.int64)}  # (n,) int64
        return out

    def __repr__(self) -> str:
        return f"Tokenize({self.source!r:.60}, {self.tok!r})"


class _RawShare(Stream):
    """The untokenized samples of a source, split like any :class:`Stream`."""

    def __init__(self, source):
        super().__init__()
        self.source = source

    def samples(self, epoch: int) -> Iterator:
        return stream_of(self.source, epoch)


def tokenize(
    source,
    tokenizer,
    *,
    text_field: str = "text",
    messages_field: str = "messages",
    batch_size: int = 256,
    add_eos: bool = True,
    eos_id: int | None = None,
) -> Tokenize:
    """Tokenize a source on the fly, ``batch_size`` samples per tokenizer call.

    Each sample (a mapping with ``text_field`` (str), or ``messages_field`` (a chat), or a bare
    string) becomes ``{"input_ids": (n,) int64}`` (text, followed by the tokenizer's eos when
    ``add_eos``) or ``{"input_ids": (n,) int64, "loss_mask": (n,) uint8}`` (chat, see
    :func:`encode_chat`) -- the documents :func:`kuat.pack` takes. Use it for streaming sources
    (``datasets.IterableDataset``, :func:`kuat.mix` of streams); for data read many times,
    tokenize once with :func:`kuat.convert.from_text`.

    Returns:
        A :class:`Tokenize` stream (split across ranks and workers like every kuat stream).
        Wrapped by :func:`kuat.pack`, it is read whole by each packer (which splits rows).

    Each sample's kind is decided by its own keys (``messages_field`` first), so a source may
    mix chat and text samples.

    Raises:
        TypeError: an unsupported tokenizer.
        ValueError: ``batch_size`` not an int >= 1; while iterating, a sample with neither
            field (or a malformed chat), naming its position in the stream's share and epoch.
    """
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, numbers.Integral)
        or batch_size < 1
    ):
        raise ValueError(f"batch_size should be an int >= 1, got {batch_size!r}")
    tok = as_tokenizer(tokenizer, eos_id)
    warn_if_no_eos(tok, bool(add_eos))
    return Tokenize(
        source,
        tok,
        text_field,
        messages_field,
        int(batch_size),
        bool(add_eos),
    )
