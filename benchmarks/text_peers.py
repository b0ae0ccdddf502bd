"""Child entry point of the text benchmark: torchtune's and TRL's packing, in their environment.

``python text_peers.py TOKENS SEQ_LEN OUT [--texts TEXTS --tokenizer TOKENIZER_JSON]`` (a
script: it imports nothing from kuat or ``benchmarks``, so the peers' environment needs no
kuat):

* ``TOKENS``: a ``.npz`` with ``tokens (T,)`` and ``offsets (N + 1,) int64``, the documents
  end to end, written by :func:`write_tokens` from the same kuat dataset kuat packs;
* ``TEXTS`` (optional): a JSON file ``{"texts": [str, ...], "eos_id": int}``, the same
  documents as raw text, and ``TOKENIZER_JSON`` the ``tokenizers`` tokenizer (a
  ``tokenizer.json``) that made ``TOKENS`` from them (each document's ids, then ``eos_id``);
* ``OUT``: a JSON file written with ``{"versions": {...}, "runs": {name: [seconds, seconds
  to the first row, rows, tokens, CPU seconds]}, "unavailable": {name: reason}}``, one timed
  pass of each peer (the parent calls it once per round, so rounds interleave with kuat's).
  ``tokens`` counts the documents' tokens in the rows, padding excluded: every peer must
  report the dataset's total (the parent checks it).

Peers on the token lists: torchtune's ``PackedDataset`` (eager: its first row comes after its
whole pass; ``split_across_pack=False``, or ``True`` when a document is longer than
``SEQ_LEN``, which the other mode refuses) and TRL's ``pack_dataset`` (``bfd``, or
``bfd_split`` when a document is longer than ``SEQ_LEN``, which ``bfd`` would truncate; and
``wrapped``) over a ``datasets.Dataset`` of the token lists. Converting the tokens to lists and
tables is not timed.

Peers from raw text (with ``--texts``), each in its library's own flow, with the same tokenizer
and the same eos handling (ids of the text, then ``eos_id``; no BOS: the bench's BPE has none):

* torchtune: ``PackedDataset`` over a map-style dataset whose ``__getitem__`` tokenizes one
  text and returns ``{"tokens", "labels"}``, as ``TextCompletionDataset._prepare_sample`` does,
  with torchtune's own ``HuggingFaceBaseTokenizer`` (``encode(text, add_bos=False,
  add_eos=True)``, one ``tokenizers`` call per text). torchtune's ``TextCompletionDataset``
  itself would also read each text from a Hugging Face table; here the texts are a Python
  list, as they are for kuat.
* TRL: ``Dataset.map(tokenize, batched=True)`` then ``pack_dataset`` (the flow of TRL's
  packing docs), ``tokenize`` calling the tokenizer's batch encoder on each 1,000-text batch of
  ``map`` (``encode_batch_fast`` where the ``tokenizers`` version has it, as kuat does; TRL's
  own ``SFTTrainer`` maps one example at a time through a ``transformers`` tokenizer, which is
  slower, so this row is TRL at its fastest).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

IGNORE_INDEX = -100  # torchtune's CROSS_ENTROPY_IGNORE_IDX: its pack's padded labels


def write_tokens(path: Path, docs: list[np.ndarray]) -> None:
    """Write documents (1-d integer arrays) as ``TOKENS`` for this script."""
    lengths = np.fromiter(map(len, docs), np.int64, len(docs))
    offsets = np.concatenate([[0], np.cumsum(lengths)])  # (N + 1,)
    tokens = np.concatenate(docs) if docs else np.empty(0, np.int64)  # (T,)
    np.savez(path, tokens=tokens, offsets=offsets)


def write_texts(path: Path, texts: list[str], eos_id: int) -> None:
    """Write raw documents and the eos id as ``TEXTS`` for this script."""
    Path(path).write_text(json.dumps({"texts": list(texts), "eos_id": int(eos_id)}))


def timed(make_rows, count_tokens) -> list:
    """``[seconds, seconds to the first row, rows, tokens, CPU seconds]`` of ``make_rows()``
    and iterating what it returns: an eager packer's construction is inside the time, as it is
    for a user. ``tokens`` sums ``count_tokens(row)`` (the documents' tokens in a row, padding
    excluded). CPU seconds are this process's (all its threads: ``time.process_time``), which
    other processes on a loaded machine do not inflate."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    first = None
    n = tokens = 0
    for row in make_rows():
        if first is None:
            first = time.perf_counter() - t0
        n += 1
        tokens += count_tokens(row)
    return [time.perf_counter() - t0, first or 0.0, n, tokens, time.process_time() - c0]


def _torchtune_tokens(row) -> int:
    # a pack is padded to SEQ_LEN with labels IGNORE_INDEX; the bench's labels are the tokens
    return int((row["labels"] != IGNORE_INDEX).sum())


def _trl_tokens(row) -> int:
    return len(row["input_ids"])  # TRL's rows are not padded (its collator pads)


def run(tokens_path: Path, seq_len: int, texts_path: Path | None = None,
        tokenizer_path: Path | None = None) -> dict:  # fmt: skip
    data = np.load(tokens_path)
    tokens, offsets = data["tokens"], data["offsets"]
    ids = [tokens[a:b].astype(np.int64).tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    split = bool(len(ids)) and int(np.diff(offsets).max()) > seq_len
    raw = json.loads(Path(texts_path).read_text()) if texts_path is not None else None
    out: dict = {"versions": {}, "runs": {}, "unavailable": {}}
    try:
        import torchtune
        from torchtune.datasets import PackedDataset

        class _Tokens:
            def __len__(self):
                return len(ids)

            def __getitem__(self, i):
                return {"tokens": ids[i], "labels": ids[i]}

        out["versions"]["torchtune"] = torchtune.__version__
        out["runs"]["torchtune PackedDataset"] = timed(
            lambda: PackedDataset(_Tokens(), max_seq_len=seq_len, split_across_pack=split),
            _torchtune_tokens,
        )
        if raw is not None:
            tt_tok = _torchtune_tokenizer(tokenizer_path, raw["eos_id"], Path(tokens_path).parent)
            texts = raw["texts"]

            class _TextCompletion:
                """torchtune's ``TextCompletionDataset.__getitem__``, over the list of texts."""

                def __len__(self):
                    return len(texts)

                def __getitem__(self, i):
                    tokens = tt_tok.encode(text=texts[i], add_bos=False, add_eos=True)
                    return {"tokens": tokens, "labels": tokens.copy()}

            out["runs"]["torchtune PackedDataset (raw text)"] = timed(
                lambda: PackedDataset(_TextCompletion(), max_seq_len=seq_len,
                                      split_across_pack=split),
                _torchtune_tokens,
            )  # fmt: skip
    except Exception as e:  # ImportError, or the peer failing on this data: say which
        why = f"{type(e).__name__}: {e}"
        for name in ("torchtune PackedDataset", "torchtune PackedDataset (raw text)"):
            if name not in out["runs"] and (raw is not None or "raw" not in name):
                out["unavailable"][name] = why
    try:
        import datasets
        import trl
        from trl import pack_dataset

        out["versions"]["trl"] = trl.__version__
        table = datasets.Dataset.from_dict({"input_ids": ids})
    except Exception as e:
        table, why = None, f"{type(e).__name__}: {e}"
    bfd = "bfd_split" if split else "bfd"
    for strategy in (bfd, "wrapped"):
        name = f"trl pack_dataset {strategy.split('_')[0]}"
        if table is None:
            out["unavailable"][name] = why
            continue
        try:
            out["runs"][name] = timed(
                lambda s=strategy: pack_dataset(table, seq_len, strategy=s), _trl_tokens
            )
        except Exception as e:
            out["unavailable"][name] = f"{type(e).__name__}: {e}"
    if raw is not None:
        name = "trl map + pack_dataset bfd (raw text)"
        if table is None:
            out["unavailable"][name] = why
        else:
            try:
                out["runs"][name] = _trl_raw(raw, tokenizer_path, seq_len, bfd)
            except Exception as e:
                out["unavailable"][name] = f"{type(e).__name__}: {e}"
    return out


def _torchtune_tokenizer(tokenizer_path: Path, eos_id: int, work: Path):
    """torchtune's ``HuggingFaceBaseTokenizer`` over ``tokenizer_path``; it reads its BOS and
    EOS ids from a ``generation_config.json`` (the bench passes ``add_bos=False``: no BOS)."""
    from torchtune.modules.transforms.tokenizers import HuggingFaceBaseTokenizer

    config = work / "generation_config.json"
    config.write_text(json.dumps({"bos_token_id": eos_id, "eos_token_id": eos_id}))
    return HuggingFaceBaseTokenizer(str(tokenizer_path), generation_config_path=str(config))


def _trl_raw(raw: dict, tokenizer_path: Path, seq_len: int, strategy: str) -> list:
    """``map(tokenize, batched=True)`` then ``pack_dataset``, timed (see the module docstring).
    Building the table of texts is not timed."""
    import datasets
    from tokenizers import Tokenizer
    from trl import pack_dataset

    tok = Tokenizer.from_file(str(tokenizer_path))
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    eos = [raw["eos_id"]]

    def tokenize(batch):
        return {"input_ids": [e.ids + eos for e in encode(batch["text"], add_special_tokens=False)]}

    texts = datasets.Dataset.from_dict({"text": raw["texts"]})
    return timed(
        lambda: pack_dataset(
            texts.map(tokenize, batched=True, remove_columns=["text"]), seq_len, strategy=strategy
        ),
        _trl_tokens,
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="text_peers.py", description=__doc__.split("\n")[0])
    ap.add_argument("tokens", type=Path)
    ap.add_argument("seq_len", type=int)
    ap.add_argument("out", type=Path)
    ap.add_argument("--texts", type=Path, default=None)
    ap.add_argument("--tokenizer", type=Path, default=None)
    args = ap.parse_args(argv)
    if (args.texts is None) != (args.tokenizer is None):
        ap.error("--texts and --tokenizer go together")
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    result = run(args.tokens, args.seq_len, args.texts, args.tokenizer)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
