"""Child entry point of the text benchmark: torchtune's and TRL's packing, in their environment.

``python -m benchmarks.text_peers TOKENS SEQ_LEN OUT`` (or ``python text_peers.py ...``: it
imports nothing from kuat or ``benchmarks``, so the peers' environment needs no kuat):

* ``TOKENS``: a ``.npz`` with ``tokens (T,)`` and ``offsets (N + 1,) int64``, the documents
  end to end, written by :func:`write_tokens` from the same kuat dataset kuat packs;
* ``OUT``: a JSON file written with ``{"versions": {...}, "runs": {name: [seconds, seconds
  to the first row, rows, tokens, CPU seconds]}, "unavailable": {name: reason}}``, one timed
  pass of each
  peer (the parent calls it once per round, so rounds interleave with kuat's).

Peers: torchtune's ``PackedDataset`` (eager: its first row comes after its whole pass;
``split_across_pack=False``, or ``True`` when a document is longer than ``SEQ_LEN``, which the
other mode refuses) and TRL's ``pack_dataset`` (``bfd`` and ``wrapped``) over a
``datasets.Dataset`` of the token lists. Converting the tokens to lists and tables is not
timed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def write_tokens(path: Path, docs: list[np.ndarray]) -> None:
    """Write documents (1-d integer arrays) as ``TOKENS`` for this script."""
    lengths = np.fromiter(map(len, docs), np.int64, len(docs))
    offsets = np.concatenate([[0], np.cumsum(lengths)])  # (N + 1,)
    tokens = np.concatenate(docs) if docs else np.empty(0, np.int64)  # (T,)
    np.savez(path, tokens=tokens, offsets=offsets)


def timed(make_rows) -> list:
    """``[seconds, seconds to the first row, rows, tokens, CPU seconds]`` of ``make_rows()``
    and iterating what it returns: an eager packer's construction is inside the time, as it is
    for a user. CPU seconds are this process's (all its threads: ``time.process_time``), which
    other processes on a loaded machine do not inflate."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    first = None
    n = tokens = 0
    for row in make_rows():
        if first is None:
            first = time.perf_counter() - t0
        n += 1
        tokens += len(row["input_ids"] if "input_ids" in row else row["tokens"])
    return [time.perf_counter() - t0, first or 0.0, n, tokens, time.process_time() - c0]


def run(tokens_path: Path, seq_len: int) -> dict:
    data = np.load(tokens_path)
    tokens, offsets = data["tokens"], data["offsets"]
    ids = [tokens[a:b].astype(np.int64).tolist() for a, b in zip(offsets[:-1], offsets[1:])]
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
        split = bool(len(ids)) and int(np.diff(offsets).max()) > seq_len
        out["runs"]["torchtune PackedDataset"] = timed(
            lambda: PackedDataset(_Tokens(), max_seq_len=seq_len, split_across_pack=split)
        )
    except Exception as e:  # ImportError, or the peer failing on this data: say which
        out["unavailable"]["torchtune PackedDataset"] = f"{type(e).__name__}: {e}"
    try:
        import datasets
        import trl
        from trl import pack_dataset

        out["versions"]["trl"] = trl.__version__
        table = datasets.Dataset.from_dict({"input_ids": ids})
    except Exception as e:
        table, why = None, f"{type(e).__name__}: {e}"
    for strategy in ("bfd", "wrapped"):
        name = f"trl pack_dataset {strategy}"
        if table is None:
            out["unavailable"][name] = why
            continue
        try:
            out["runs"][name] = timed(lambda s=strategy: pack_dataset(table, seq_len, strategy=s))
        except Exception as e:
            out["unavailable"][name] = f"{type(e).__name__}: {e}"
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: text_peers.py TOKENS SEQ_LEN OUT", file=sys.stderr)
        return 2
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    result = run(Path(argv[0]), int(argv[1]))
    Path(argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
