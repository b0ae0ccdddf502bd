"""Text (JSON Lines, Parquet, plain text, Hugging Face datasets) -> token sequences, at ingest.

Each record becomes one row: ``input_ids`` as a ``sequence`` of the smallest unsigned integer
type that holds the vocabulary (uint16 below 65,536 tokens: 2 bytes per stored token), and for
chat records (a ``messages`` list) a ``loss_mask`` sequence of uint8 (1 where the token is
trained on, see :func:`kuat.text.tokenize.encode_chat`). Records are tokenized in batches on
``num_workers`` threads (the ``tokenizers`` library releases the GIL), written in order.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from kuat.convert._driver import ConvertOptions, ConvertReport, converting, parallel_map
from kuat.format import Field, Schema
from kuat.format import schema as fs

__all__ = ["from_text", "TEXT_EXTENSIONS"]

_log = logging.getLogger("kuat.convert.text")

TEXT_EXTENSIONS = (".jsonl", ".ndjson", ".json", ".parquet", ".pq", ".txt")


def from_text(
    src,
    dst: str | os.PathLike,
    tokenizer,
    *,
    text_field: str = "text",
    messages_field: str = "messages",
    add_eos: bool = True,
    eos_id: int | None = None,
    batch_size: int = 512,
    **options,
) -> ConvertReport:
    """Tokenize text records into a kuat dataset at ``dst`` (one row per record).

    Args:
        src: ``.jsonl``/``.json`` (one JSON object per line), ``.parquet`` or ``.txt`` (one
            record per non-empty line) path(s) or glob(s); a ``datasets.Dataset`` or
            ``IterableDataset``; or an iterable of records. A record is a mapping with
            ``text_field`` (a string) or ``messages_field`` (a list of ``{"role", "content"}``),
            or a bare string. The first record decides text or chat for the whole source (one
            schema); a record of the other kind is refused naming it and this rule.
        dst: the dataset directory to write.
        tokenizer: a ``tokenizers.Tokenizer``, a ``transformers`` tokenizer or a ``tiktoken``
            encoding (see :func:`kuat.text.tokenize.as_tokenizer`).
        text_field, messages_field: the record fields to read.
        add_eos: end each text record with the tokenizer's eos token (so packed documents are
            separated); chat records always end each message with it.
        eos_id: the eos token id, when the tokenizer does not say (``tokenizers`` objects).
        batch_size: records per tokenizer call.
        options: ``num_workers``, ``progress`` (a bar on a terminal, INFO lines on the
            ``kuat.convert`` logger every ``progress_interval_s`` otherwise), ``overwrite``,
            ``shard_bytes`` and ``on_error``: see :class:`kuat.convert.ConvertOptions`. With
            ``on_error="skip"`` a malformed record (a bad JSON line, a missing or non-string
            field, a malformed chat) is left out and listed in the report's ``skipped`` as
            ``(file:line or row, reason)``.

    Returns:
        A :class:`kuat.convert.ConvertReport`; the manifest's metadata records the tokenizer's
        vocabulary size, eos id and the total number of tokens.

    Raises:
        FileNotFoundError: a path or glob that matches nothing.
        ValueError: with ``on_error="raise"``, a record without the field or a malformed JSON
            line (names the file and line); an unsupported file extension; invalid options.
        TypeError: an unsupported tokenizer.
    """
    from kuat.sources.hf import is_hf_map_dataset
    from kuat.text.tokenize import as_tokenizer, encode_chat, token_dtype, warn_if_no_eos

    tok = as_tokenizer(tokenizer, eos_id)
    warn_if_no_eos(tok, add_eos)
    opts = ConvertOptions(**options)
    skip = opts.on_error == "skip"
    dtype = token_dtype(tok.vocab_size)
    records = _records(src, keep_malformed=skip)
    first = next(records, None)
    chat = isinstance(first, tuple) and isinstance(first[1], Mapping) and messages_field in first[1]
    fields = [Field("input_ids", fs.sequence(dtype.name))]
    if chat:
        fields.append(Field("loss_mask", fs.sequence("uint8")))
    eos = [tok.eos_id] if add_eos and tok.eos_id is not None else []

    def check(where: str, rec) -> None:
        """Raise ValueError naming ``where`` unless ``rec`` holds what the encoding needs."""
        if isinstance(rec, _Malformed):
            raise ValueError(rec.reason)
        mixed = ("; the first record made this a {} conversion (one schema for the whole "
                 "dataset): convert chat and text records apart, or read the mix with "
                 "kuat.text.tokenize, which decides per sample")
        if chat:
            if not (isinstance(rec, Mapping) and messages_field in rec):
                raise ValueError(f"{where}: no field {messages_field!r} (record has "
                                 f"{_keys(rec)}){mixed.format('chat')}")
            return
        if isinstance(rec, Mapping) and messages_field in rec and text_field not in rec:
            raise ValueError(f"{where}: a chat record ({messages_field!r}){mixed.format('text')}")
        t = rec if isinstance(rec, str) else _get(rec, text_field, where)
        if not isinstance(t, str):
            raise ValueError(f"{where}: {text_field!r} should be a string, got {t!r:.80}")

    def encode(batch: list[tuple[str, object]]) -> tuple[dict, list]:
        """``(columns, skipped)`` of one batch of records (runs in a worker thread)."""
        skipped, good = [], []
        for where, rec in batch:
            try:
                check(where, rec)
            except ValueError as e:
                if not skip:
                    raise
                skipped.append((where, str(e)))
                continue
            good.append((where, rec))
        if chat:
            ids, masks = [], []
            for where, rec in good:
                try:
                    i, m = encode_chat(tok, rec[messages_field])
                except ValueError as e:
                    if not skip:
                        raise ValueError(f"{where}: {e}") from e
                    skipped.append((where, str(e)))
                    continue
                ids.append(np.asarray(i, dtype))  # (n,) list[int] -> uint
                masks.append(np.asarray(m, np.uint8))
            return {"input_ids": ids, "loss_mask": masks}, skipped
        texts = [rec if isinstance(rec, str) else rec[text_field] for _, rec in good]
        encoded = tok.encode_batch(texts) if texts else []
        return {"input_ids": [np.asarray(i + eos, dtype) for i in encoded]}, skipped

    def batches() -> Iterator[list]:
        batch = [] if first is None else [first]
        for rec in records:
            batch.append(rec)
            if len(batch) == batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    tokens = 0
    meta = {"source": "text", "tokenizer": repr(tok), "vocab_size": tok.vocab_size}
    meta["eos_id"] = tok.eos_id
    total = len(src) if is_hf_map_dataset(src) else None
    work = parallel_map(
        encode, batches(), opts, total=total, desc="tokenize", source_of=_where, size_of=len
    )
    with converting(dst, Schema(fields), opts, meta) as (w, report):
        for columns, skipped in work:
            report.skipped.extend(skipped)
            tokens += sum(len(x) for x in columns["input_ids"])
            if columns["input_ids"]:
                w.write_batch(columns)
    _log.info(
        "tokenized %d records, %d tokens (%s, %d bytes per token) into %s",
        report.rows,
        tokens,
        dtype.name,
        dtype.itemsize,
        dst,
    )
    return report


def _where(batch) -> str:
    return f"{batch[0][0]} .. {batch[-1][0]}" if batch else "empty batch"


def _get(rec, name: str, where: str):
    if not isinstance(rec, Mapping) or name not in rec:
        raise ValueError(f"{where}: no field {name!r} (record has {_keys(rec)})")
    return rec[name]


def _keys(rec):
    return list(rec) if isinstance(rec, Mapping) else type(rec).__name__


class _Malformed:
    """A record the reader could not parse, kept in its place to be skipped and reported."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _records(src, keep_malformed: bool = False) -> Iterator[tuple[str, object]]:
    """``(where, record)`` pairs; ``where`` names the file and line or the row. A malformed
    JSON line raises ValueError, or with ``keep_malformed`` comes as a :class:`_Malformed`."""
    from kuat.sources.hf import is_hf_iterable_dataset, is_hf_map_dataset

    if is_hf_map_dataset(src) or is_hf_iterable_dataset(src):
        return ((f"row {i}", r) for i, r in enumerate(src))
    if _looks_like_paths(src):
        from kuat.convert._inputs import expand_paths

        return _files(expand_paths(src), keep_malformed)
    if isinstance(src, Iterable):
        return ((f"record {i}", r) for i, r in enumerate(src))
    raise TypeError(f"src should be paths, a datasets.Dataset or an iterable, got {type(src)}")


def _looks_like_paths(src) -> bool:
    """A path, or a list of paths/globs with text extensions (a list of other strings is a list
    of records)."""
    if isinstance(src, (str, bytes, os.PathLike)):
        return True
    if not isinstance(src, (list, tuple)) or not src:
        return False
    names = [os.fsdecode(s).lower() for s in src if isinstance(s, (str, os.PathLike))]
    return len(names) == len(src) and all(n.endswith(TEXT_EXTENSIONS) for n in names)


def _not_utf8(line: str) -> str | None:
    """Why a line read with ``surrogateescape`` is not UTF-8 text (its bad bytes came in as
    lone surrogates), or ``None``."""
    if line.isascii():
        return None
    try:
        line.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        bad = line[e.start : e.end].encode("utf-8", "surrogateescape")
        return f"not valid UTF-8 text (bytes {bad!r} at character {e.start})"


def _files(paths: list[str], keep_malformed: bool) -> Iterator[tuple[str, object]]:
    for path in paths:
        ext = os.path.splitext(path.lower())[1]
        if ext in (".jsonl", ".ndjson", ".txt", ".json"):
            # bytes that are not UTF-8 are one malformed line (skippable), not a bare
            # UnicodeDecodeError that ends the conversion without saying where
            with open(path, encoding="utf-8", errors="surrogateescape") as f:
                for n, line in enumerate(f, 1):
                    why = _not_utf8(line)
                    if why is not None:
                        if not keep_malformed:
                            raise ValueError(f"{path}:{n}: {why}")
                        yield f"{path}:{n}", _Malformed(why)
                        continue
                    if ext == ".txt":
                        line = line.rstrip("\n")
                        if line.strip():
                            yield f"{path}:{n}", line
                        continue
                    if not line.strip():
                        continue
                    try:
                        yield f"{path}:{n}", json.loads(line)
                    except json.JSONDecodeError as e:
                        if not keep_malformed:
                            raise ValueError(f"{path}:{n}: not a JSON object: {e}") from e
                        yield f"{path}:{n}", _Malformed(f"not a JSON object: {e}")
        elif ext in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            row = 0
            with open(path, "rb") as f:  # any file name (pyarrow takes only UTF-8 paths)
                for batch in pq.ParquetFile(f).iter_batches(batch_size=4096):
                    for rec in batch.to_pylist():
                        yield f"{path} row {row}", rec
                        row += 1
        else:
            raise ValueError(f"{path}: not a text source (extensions {TEXT_EXTENSIONS})")
