"""text: tokenize, pack and batch, against torchtune's and TRL's packing (issue 13).

Data: the Python documentation corpus that every Python ships (``kuat.text.corpus``), its
paragraphs repeated to ``--docs`` documents, tokenized with a byte-level BPE (vocabulary
8,192) trained on it; nothing is downloaded. Workloads, each timed ``--repeats`` times with the
loaders interleaved (A B C A B C ...), medians and min-max spread reported:

* **pack**: documents/s and tokens/s of a full pass, and time to the first packed row, in two
  families compared only within themselves:

  - *pre-tokenized*: kuat's ``concat``, ``first_fit`` and ``best_fit`` over a kuat dataset;
    torchtune's ``PackedDataset`` (eager: its first row comes after its whole pass) and TRL's
    ``pack_dataset`` (``bfd`` and ``wrapped``) over the same token lists;
  - *from raw text*, the same texts and tokenizer (the bench's BPE, saved as a
    ``tokenizer.json`` for the peers) and the same eos handling (ids, then eos): kuat's
    ``best_fit`` over ``kuat.text.tokenize`` (batches tokenized on the fly); torchtune's
    ``PackedDataset`` over a dataset whose ``__getitem__`` tokenizes one text with torchtune's
    ``HuggingFaceBaseTokenizer`` (its ``TextCompletionDataset`` flow); TRL's
    ``Dataset.map(tokenize, batched=True)`` then ``pack_dataset`` ``bfd``.

  The peers run in ``benchmarks/text_peers.py`` in the bench environment ``text``
  (``benchmarks/envs.py``: torchtune 0.6.1 imports with torch 2.14 only beside
  ``torchao==0.10.0``; trl 1.16), created by ``--setup-envs``, one child per round so the
  rounds interleave with kuat's. Every packer must put every token of the dataset in its
  rows exactly once (padding excluded): the bench checks the totals and prints them. Reported:
  each packer's rate, CPU seconds and time to its first row, and each kuat packer's time ratio
  to each peer of its family within every round (wall and CPU), median and min-max of the
  rounds. Without that environment the child runs in this interpreter, and the peers are
  reported where they import (for example from a directory on ``PYTHONPATH``)::

      pip install --target PEERS --no-deps trl==1.16.0 torchtune==0.6.1 torchao==0.10.0 \
          omegaconf antlr4-python3-runtime==4.9.3 sentencepiece tiktoken blobfile
      PYTHONPATH=src:PEERS .venv/bin/python -m benchmarks.bench_text

* **waste**: % of row tokens that are padding: naive per-sample padding (batches of 8 in order)
  and each packing strategy, at ``--seq-len``;
* **memory**: bytes per stored token on disk, in parts (``kuat.text.token_storage``): token
  values per token, list offsets per document, whole files per token; what nanoGPT (flat
  uint16, no index) and Megatron's indexed dataset (20 bytes of index per document) would
  store for the same documents; peak traced bytes per token (``tracemalloc``,
  which NumPy reports to) held while packing a pass, against a list of all rows (what an eager
  packer keeps);
* **resume**: ms from a packer state at 10%, 50% and 90% of the epoch to the next row; and
  through ``kuat.DataLoader`` (rank 0 of 2, 2 thread workers, batches of 8): ms from
  ``load_state_dict`` at 10%, 50%, 90% of the epoch to the first batch, per strategy;
* **shares**: per-consumer work at 2 ranks x 2 workers: ms and tokens read by each consumer
  when it plans from the lengths and reads its own rows, against packing the whole epoch
  (what every consumer does without the lengths).

Not a test; prints a table::

    .venv/bin/python -m benchmarks.bench_text --docs 20000 --seq-len 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

SEQ_LEN = 2048
NAIVE_BATCH = 8
PEERS = ("torchtune PackedDataset", "trl pack_dataset bfd", "trl pack_dataset wrapped")
RAW_PEERS = ("torchtune PackedDataset (raw text)", "trl map + pack_dataset bfd (raw text)")
RAW = "(raw text)"  # the suffix of every packer name that tokenizes as it packs


def prepare(cache_dir: Path, num_docs: int) -> dict:
    """Tokenize (once) the corpus repeated to ``num_docs`` documents into a kuat dataset.

    Returns ``{"path", "texts", "tokenizer", "tokenizer_path", "eos_id"}``
    (``tokenizer_path``: the tokenizer saved as a ``tokenizer.json``, for the peers)."""
    import kuat
    from kuat.text.corpus import EOS, python_docs_corpus, train_bpe

    base = python_docs_corpus()
    texts = [base[i % len(base)] for i in range(num_docs)]
    tok = train_bpe(base, vocab_size=8192)
    eos = tok.token_to_id(EOS)
    path = Path(cache_dir) / f"text-{num_docs}.kuat"
    if not (path / "manifest.json").exists():
        kuat.convert.from_text(texts, path, tok, eos_id=eos, progress=False)
    tok_path = Path(cache_dir) / "text-bpe-8192.json"
    tok.save(str(tok_path))
    return {"path": path, "texts": texts, "tokenizer": tok, "tokenizer_path": tok_path,
            "eos_id": eos}  # fmt: skip


def pack_runs(data: dict, seq_len: int) -> dict:
    """name -> a callable returning an iterator of packed rows (one full pass)."""
    import kuat
    from kuat.text import pack, tokenize

    ds = kuat.open(data["path"])
    runs = {}
    for strategy in ("concat", "first_fit", "best_fit"):
        runs[f"kuat {strategy} (tokenized)"] = lambda s=strategy: iter(
            pack(ds, seq_len, s, buffer_size=1024)
        )
    texts = [{"text": t} for t in data["texts"]]
    runs[f"kuat best_fit {RAW}"] = lambda: iter(
        pack(tokenize(texts, data["tokenizer"], eos_id=data["eos_id"]), seq_len, "best_fit")
    )
    return runs


def peers_python(setup_envs: bool, log_dir: Path) -> tuple[str, str]:
    """``(interpreter, where)`` for the peers: the ``text`` bench environment when it exists
    (or ``setup_envs`` creates it), else this interpreter."""
    from benchmarks import envs

    try:
        py = envs.ensure("text", create=setup_envs, log_path=log_dir / "env-text.log")
        return str(py), f"environment {py.parent.parent}"
    except envs.EnvUnavailable as e:
        return sys.executable, f"this interpreter ({e})"


def peer_round(python: str, tokens: Path, seq_len: int, work: Path, texts: Path,
               tokenizer: Path) -> dict:  # fmt: skip
    """One timed pass of every peer, in a child process of ``python`` (see text_peers.py)."""
    out = work / "peers.json"
    out.unlink(missing_ok=True)
    script = Path(__file__).with_name("text_peers.py")
    raw = ["--texts", str(texts), "--tokenizer", str(tokenizer)]
    proc = subprocess.run(
        [python, str(script), str(tokens), str(seq_len), str(out), *raw],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"runs": {}, "versions": {}, "unavailable": {"peers": f"child failed: {tail[0]}"}}
    return json.loads(out.read_text())


def _kuat_tokens(row) -> int:
    return int(row["document_lengths"].sum())  # the row's documents (pieces); padding excluded


def check_tokens(samples: dict, tokens: int) -> None:
    """Raise ``RuntimeError`` naming the packer and round when a pass's rows did not hold
    exactly the dataset's ``tokens`` (padding excluded): its rate would count other work."""
    for name, runs in samples.items():
        for k, run in enumerate(runs):
            if run[3] != tokens:
                raise RuntimeError(
                    f"{name}, round {k}: its rows hold {run[3]} tokens, the dataset {tokens}: "
                    "the packers did not pack the same documents"
                )


def naive_waste(lengths: np.ndarray, seq_len: int, batch: int = NAIVE_BATCH) -> float:
    cut = np.minimum(lengths, seq_len)
    padded = sum(len(c) * int(c.max()) for c in np.array_split(cut, -(-len(cut) // batch)))
    return 1 - cut.sum() / padded


def disk(path: Path) -> dict:
    """Bytes per stored token on disk, in parts, beside nanoGPT's and Megatron's layouts for
    the same documents (``kuat.text.token_storage``)."""
    from kuat.text import token_storage
    from kuat.text.storage import MEGATRON_INDEX_BYTES_PER_DOCUMENT

    s = token_storage(path)
    tokens, docs = s["tokens"], s["documents"]
    itemsize = s["token_bytes"] / tokens
    return {
        "token_bytes_per_token": itemsize,
        "index_bytes_per_document": s["index_bytes"] / docs,
        "framing_bytes": s["other_bytes"],
        "disk_bytes_per_token": s["file_bytes"] / tokens,
        "mean_tokens_per_document": tokens / docs,
        "nanogpt_bytes_per_token": itemsize,  # one flat array of the tokens, no index
        "megatron_bytes_per_token": itemsize + MEGATRON_INDEX_BYTES_PER_DOCUMENT * docs / tokens,
    }


def memory(data: dict, seq_len: int) -> dict:
    """Disk bytes per token (:func:`disk`), and peak traced bytes per token: streaming vs
    holding every row."""
    import kuat
    from kuat.text import pack

    ds = kuat.open(data["path"])
    tokens = int(kuat.text.lengths_of(ds).sum())
    out = disk(data["path"])
    for name, keep in (("streaming", False), ("all rows held", True)):
        tracemalloc.start()
        held = []
        for row in pack(ds, seq_len, "best_fit", buffer_size=1024):
            if keep:
                held.append(row)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        out[f"resident_bytes_per_token ({name})"] = peak / tokens
        out[f"peak_mb ({name})"] = peak / 2**20
        del held
    return out


def resume_ms(data: dict, seq_len: int, repeats: int) -> dict:
    import kuat
    from kuat.text import pack

    ds = kuat.open(data["path"])
    packed = pack(ds, seq_len, "best_fit", buffer_size=1024)
    it = packed.iter_rows()
    states = [it.state_dict()]
    for _ in it:
        states.append(it.state_dict())
    out = {}
    for frac in (0.1, 0.5, 0.9):
        state = states[int(frac * (len(states) - 1))]
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            next(pack(ds, seq_len, "best_fit", buffer_size=1024).iter_rows(state=state))
            times.append(1000 * (time.perf_counter() - t0))
        out[f"{int(frac * 100)}%"] = statistics.median(times)
    return out


def _consumer(packed, rank: int, worker: int, batch: int = 8) -> tuple[float, int, int]:
    """``(CPU seconds, rows, tokens read)`` of consumer (``rank`` of 2, ``worker`` of 2) of
    ``packed``, run in its own thread with the worker info the loader's thread workers see."""
    import threading

    from kuat.engine.worker_info import set_worker_info

    out = []

    def run():
        set_worker_info("thread", worker, 2, 0, packed)
        packed.kuat_set_distributed(rank, 2)
        packed.kuat_set_batching(batch, False)
        t0 = time.thread_time()  # CPU time: other processes on the machine do not count
        rows = sum(1 for _ in packed.kuat_iter_from(0, 0))
        out.append((time.thread_time() - t0, rows, packed.stats()["read_tokens"]))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def shares(data: dict, seq_len: int, repeats: int) -> dict:
    """Per-consumer CPU ms and tokens read at 2 ranks x 2 workers, planned vs whole epoch."""
    import kuat
    from kuat.text import pack

    ds = kuat.open(data["path"])
    out = {}
    for strategy in ("concat", "first_fit", "best_fit"):
        whole, planned, reads = [], [], []
        for _ in range(repeats):  # interleaved
            p = pack(ds, seq_len, strategy, buffer_size=1024)
            t0 = time.thread_time()
            for _ in p.iter_rows(0):  # what each consumer did before: pack the whole epoch
                pass
            whole.append(time.thread_time() - t0)
            per = [_consumer(pack(ds, seq_len, strategy, buffer_size=1024), r, w)
                   for r in range(2) for w in range(2)]  # fmt: skip
            planned.append(max(x[0] for x in per))
            reads = [x[2] for x in per]
        out[strategy] = {
            "whole_epoch_ms": [1000 * statistics.median(whole), 1000 * min(whole), 1000 * max(whole)],
            "planned_ms_slowest_consumer": [1000 * statistics.median(planned),
                                            1000 * min(planned), 1000 * max(planned)],
            "planned_tokens_read_per_consumer": reads,
            "whole_epoch_tokens_read": p.stats()["read_tokens"],
        }  # fmt: skip
    return out


def loader_resume_ms(data: dict, seq_len: int, repeats: int) -> dict:
    """Wall and CPU (this process, all threads) ms from ``load_state_dict`` to the first batch,
    through ``kuat.DataLoader``."""
    import kuat
    from kuat.text import pack, pack_collate

    ds = kuat.open(data["path"])
    out = {}
    for strategy in ("concat", "first_fit", "best_fit"):

        def make(s=strategy):
            return kuat.DataLoader(pack(ds, seq_len, s, buffer_size=1024), batch_size=8,
                                   num_workers=2, collate_fn=pack_collate(), rank=0,
                                   world_size=2)  # fmt: skip

        loader = make()
        n = len(list(loader))
        state = loader.state_dict()  # the start of epoch 1: rewind it into epoch 0
        planner = pack(ds, seq_len, strategy, buffer_size=1024)
        planner.kuat_set_batching(8, False)
        row = {}
        for frac in (0.0, 0.1, 0.5, 0.9):
            served = int(frac * n)  # what state_dict() says after that many batches:
            state.update(epoch=0, batches_served_in_epoch=served,
                         source=planner.kuat_state_at(0, served, 0, 2))  # fmt: skip
            times, cpu = [], []
            for _ in range(repeats):
                resumed = make()
                t0, c0 = time.perf_counter(), time.process_time()
                resumed.load_state_dict(state)
                next(iter(resumed))
                times.append(1000 * (time.perf_counter() - t0))
                cpu.append(1000 * (time.process_time() - c0))
                resumed.close()
            row[f"{int(frac * 100)}%"] = [statistics.median(times), statistics.median(cpu)]
        out[strategy] = row
    return out


def main(argv=None) -> int:
    from kuat._dirs import cache_root  # kuat is imported lazily throughout this module

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--seq-len", type=int, default=SEQ_LEN)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", type=Path, default=cache_root() / "bench",
                    help="default: bench/ under kuat's cache root ($KUAT_CACHE, ...)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--setup-envs",
        action="store_true",
        help="create the peers' environment (torchtune, TRL) when missing",
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # the peers' progress bars would garble the table
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    data = prepare(args.cache_dir, args.docs)
    runs = pack_runs(data, args.seq_len)
    samples: dict[str, list] = {name: [] for name in runs}
    import kuat
    from benchmarks.text_peers import timed, write_texts, write_tokens

    work = Path(tempfile.mkdtemp(prefix="kuat-bench-text-"))
    ds = kuat.open(data["path"])
    write_tokens(work / "tokens.npz", ds.read_batch(range(len(ds)), ["input_ids"])["input_ids"])
    write_texts(work / "texts.json", data["texts"], data["eos_id"])
    python, where = peers_python(args.setup_envs, args.cache_dir)
    peers = {"python": where, "versions": {}, "unavailable": {}}
    for _ in range(args.repeats):  # interleaved: A B C A B C ...
        for name, fn in runs.items():
            samples[name].append(tuple(timed(fn, _kuat_tokens)))
        got = peer_round(python, work / "tokens.npz", args.seq_len, work, work / "texts.json",
                         data["tokenizer_path"])  # fmt: skip
        peers["versions"].update(got["versions"])
        peers["unavailable"].update(got["unavailable"])
        for name, run in got["runs"].items():
            samples.setdefault(name, []).append(tuple(run))

    lengths = kuat.text.lengths_of(kuat.open(data["path"]))
    docs, tokens = len(lengths), int(lengths.sum())
    check_tokens(samples, tokens)
    result = {"docs": docs, "tokens": tokens, "seq_len": args.seq_len, "pack": {}}
    print(f"text: {docs} documents, {tokens} tokens, rows of {args.seq_len}, "
          f"median of {args.repeats} (min-max)\n")  # fmt: skip
    print(f"tokens in the rows (padding excluded), every packer, every round: {tokens} "
          f"(the dataset's; checked)\n")  # fmt: skip
    print(f"{'packer':40s} {'docs/s':>18s} {'tokens/s':>12s} {'CPU s':>8s} {'first row s':>12s} "
          f"{'rows':>6s}")  # fmt: skip
    for name, runs_ in samples.items():
        secs = [r[0] for r in runs_]
        med = statistics.median(secs)
        rate = docs / med
        spread = f"({docs / max(secs):.0f}-{docs / min(secs):.0f})"
        first = statistics.median(r[1] for r in runs_)
        cpu = statistics.median(r[4] for r in runs_)
        print(f"{name:40s} {rate:8.0f} {spread:>9s} {tokens / med:12.0f} {cpu:8.4f} "
              f"{first:12.4f} {runs_[0][2]:6d}")  # fmt: skip
        result["pack"][name] = {"docs_per_s": rate, "tokens_per_s": tokens / med, "cpu_s": cpu,
                                "first_row_s": first, "rows": runs_[0][2],
                                "tokens": runs_[0][3]}  # fmt: skip
    result["ratios"] = {}
    for peer in PEERS + RAW_PEERS:  # per interleaved round, then median and min-max of rounds
        ref = samples.get(peer) or []
        if len(ref) != args.repeats:
            continue
        print(f"\nx {peer}: time ratio (peer / kuat) per interleaved round, median (min-max), "
              "wall and CPU:")  # fmt: skip
        result["ratios"][peer] = {}
        for name, runs_ in samples.items():
            same_family = name.endswith(RAW) == peer.endswith(RAW)
            if not name.startswith("kuat") or not same_family or len(runs_) != len(ref):
                continue
            wall = [t[0] / k[0] for k, t in zip(runs_, ref)]
            cpu = [t[4] / k[4] for k, t in zip(runs_, ref)]
            print(f"  {name:40s} wall {statistics.median(wall):6.1f}x ({min(wall):.1f}-"
                  f"{max(wall):.1f})   CPU {statistics.median(cpu):6.1f}x ({min(cpu):.1f}-"
                  f"{max(cpu):.1f})")  # fmt: skip
            result["ratios"][peer][name] = {
                "wall": [statistics.median(wall), min(wall), max(wall)],
                "cpu": [statistics.median(cpu), min(cpu), max(cpu)],
            }
    print(f"peers ran in {peers['python']}: {peers['versions'] or 'none'}")
    for name, why in peers["unavailable"].items():
        print(f"  {name}: unavailable: {why}")
    result["peers"] = peers
    print("\npadding waste, % of row tokens:")
    from kuat.text import pack

    waste = {"naive per-sample (batch 8)": naive_waste(lengths, args.seq_len)}
    ds = kuat.open(data["path"])
    for strategy in ("concat", "first_fit", "best_fit"):
        p = pack(ds, args.seq_len, strategy, buffer_size=1024)
        for _ in p:
            pass
        waste[strategy] = p.stats()["padding_fraction"]
    for name, w in waste.items():
        print(f"  {name:28s} {100 * w:6.2f}%")
    result["waste"] = waste
    mem = memory(data, args.seq_len)
    print(f"\non disk (documents of {mem['mean_tokens_per_document']:.1f} tokens on average): "
          f"token values {mem['token_bytes_per_token']:.2f} bytes per token + list offsets "
          f"{mem['index_bytes_per_document']:.2f} bytes per document + {mem['framing_bytes']} "
          f"bytes of Arrow framing = {mem['disk_bytes_per_token']:.3f} bytes per token; for the "
          f"same documents nanoGPT (flat uint16, no index) {mem['nanogpt_bytes_per_token']:.2f}, "
          f"Megatron (+ 20 bytes of .idx per document) {mem['megatron_bytes_per_token']:.3f}")  # fmt: skip
    print("memory while packing (best_fit, buffer 1024):")
    for held in ("streaming", "all rows held"):
        name = f"resident_bytes_per_token ({held})"
        print(f"  {name:44s} {mem[name]:8.2f}")
    print(f"  {'peak traced MB while streaming a pass':44s} {mem['peak_mb (streaming)']:8.1f}")
    result["memory"] = mem
    res = resume_ms(data, args.seq_len, args.repeats)
    print("\nresume (best_fit, buffer 1024): ms to the next row from a state at "
          + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))  # fmt: skip
    result["resume_ms"] = res
    lres = loader_resume_ms(data, args.seq_len, args.repeats)
    print("resume through kuat.DataLoader (rank 0 of 2, 2 thread workers): wall / CPU ms from "
          "load_state_dict to the first batch, at 0% (a fresh start) / 10% / 50% / 90% of the epoch")  # fmt: skip
    for strategy, row in lres.items():
        print(
            f"  {strategy:10s} "
            + "  ".join(f"{k} {w:6.1f} / {c:5.1f}" for k, (w, c) in row.items())
        )
    result["loader_resume_ms"] = lres
    sh = shares(data, args.seq_len, args.repeats)
    print("\nper consumer at 2 ranks x 2 workers: CPU ms (median, min-max) and tokens read")
    for strategy, row in sh.items():
        w, p = row["whole_epoch_ms"], row["planned_ms_slowest_consumer"]
        print(f"  {strategy:10s} whole epoch per consumer {w[0]:7.1f} ({w[1]:.1f}-{w[2]:.1f}) ms, "
              f"{row['whole_epoch_tokens_read']} tokens;  planned, slowest consumer {p[0]:7.1f} "
              f"({p[1]:.1f}-{p[2]:.1f}) ms, tokens read {row['planned_tokens_read_per_consumer']}")  # fmt: skip
    result["shares"] = sh
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
