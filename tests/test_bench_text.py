"""benchmarks/bench_text.py runs end to end on a small corpus and reports every workload."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")


def test_bench_text_reports_every_workload(tmp_path, capsys):
    from benchmarks import bench_text

    out = tmp_path / "r" / "text.json"
    args = ["--docs", "400", "--seq-len", "256", "--repeats", "1", "--cache-dir", str(tmp_path)]
    assert bench_text.main(args + ["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "padding waste" in printed and "resume" in printed
    result = json.loads(out.read_text())
    assert {
        "kuat concat (tokenized)",
        "kuat best_fit (tokenized)",
        "kuat best_fit (raw text)",
    } <= set(result["pack"])
    pack = result["pack"]
    # every packer put every token of the dataset in its rows (padding excluded), and says so
    assert all(p["tokens"] == result["tokens"] for p in pack.values())
    assert f"every packer, every round: {result['tokens']} " in printed
    assert pack["kuat concat (tokenized)"]["rows"] == -(-result["tokens"] // 256)  # no gaps
    assert pack["kuat best_fit (tokenized)"]["rows"] <= pack["kuat first_fit (tokenized)"]["rows"]
    assert result["waste"]["best_fit"] < result["waste"]["naive per-sample (batch 8)"]
    mem = result["memory"]
    # on disk, in parts: uint16 values (vocabulary 8,192), one int32 offset per document (one
    # shard: plus one), and the file's framing; nanoGPT stores the values only, Megatron 20
    # bytes more per document
    assert mem["token_bytes_per_token"] == 2.0
    assert mem["index_bytes_per_document"] == pytest.approx(
        4 * (result["docs"] + 1) / result["docs"]
    )
    per_doc = 4 * (result["docs"] + 1) / result["tokens"]
    assert 0 < mem["framing_bytes"] < 1024  # one shard: a schema and a record-batch message
    framing = mem["framing_bytes"] / result["tokens"]
    assert mem["disk_bytes_per_token"] == pytest.approx(2.0 + per_doc + framing)
    assert mem["nanogpt_bytes_per_token"] == 2.0
    assert mem["megatron_bytes_per_token"] == pytest.approx(
        2.0 + 20 * result["docs"] / result["tokens"]
    )
    offsets = f"{mem['index_bytes_per_document']:.2f}"
    assert f"token values 2.00 bytes per token + list offsets {offsets} bytes per doc" in printed
    assert set(result["resume_ms"]) == {"10%", "50%", "90%"}
    # the peers run in a child (their own environment when set up): reported or said why not
    peers = result["peers"]
    kuat_rows = {k for k in pack if k.startswith("kuat")}
    raw = {k for k in kuat_rows if k.endswith("(raw text)")}
    for name in bench_text.PEERS + bench_text.RAW_PEERS:
        assert name in pack or name in peers["unavailable"]
        if name in pack:  # per-round time ratios, wall and CPU, of every kuat packer of its
            ratios = result["ratios"][name]  # family (pre-tokenized or from raw text) to it
            assert set(ratios) == (raw if name in bench_text.RAW_PEERS else kuat_rows - raw)
            for r in ratios.values():
                assert r["wall"][1] <= r["wall"][0] <= r["wall"][2] and r["cpu"][0] > 0


def test_check_tokens_names_the_packer_and_round():
    from benchmarks import bench_text

    good = (1.0, 0.1, 3, 100, 1.0)
    bench_text.check_tokens({"a": [good, good]}, 100)
    with pytest.raises(RuntimeError, match="b, round 1: its rows hold 99 tokens, the dataset 100"):
        bench_text.check_tokens({"a": [good], "b": [good, (1.0, 0.1, 3, 99, 1.0)]}, 100)


def test_text_peers_child_reports_runs_or_why_not(tmp_path):
    """benchmarks/text_peers.py, as the bench runs it (a script, in whatever interpreter holds
    the peers): every peer either timed on the given tokens or named unavailable."""
    import sys

    import numpy as np

    from benchmarks.text_peers import write_tokens

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 500, rng.integers(1, 40)).astype(np.uint16) for _ in range(60)]
    write_tokens(tmp_path / "t.npz", docs)
    got = _run_child(sys.executable, tmp_path, [])
    names = {"torchtune PackedDataset", "trl pack_dataset bfd", "trl pack_dataset wrapped"}
    assert set(got["runs"]) | set(got["unavailable"]) == names
    _check_runs(got, sum(len(d) for d in docs), 64)


def _run_child(python, tmp_path, extra):
    import subprocess
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "text_peers.py"
    out = tmp_path / "o.json"
    proc = subprocess.run(
        [python, str(script), str(tmp_path / "t.npz"), "64", str(out), *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def _check_runs(got, total, seq_len):
    for name, (secs, first, rows, tokens, cpu) in got["runs"].items():
        # every token once in the rows, padding excluded (TRL bfd splits, not truncates, the
        # documents longer than seq_len; torchtune splits them across packs)
        assert tokens == total, name
        assert rows >= -(-total // seq_len) and secs >= first >= 0 and cpu > 0, name


def test_text_peers_pack_the_same_raw_text_with_the_same_tokenizer(tmp_path):
    """From raw text, torchtune (per-sample tokenizing in ``__getitem__``) and TRL (batched
    ``map`` then ``pack_dataset``) pack exactly the tokens kuat stores for those texts: the
    same tokenizer and eos. Runs the peers in the bench's ``text`` environment (torchtune
    and TRL cannot share this interpreter), where one is set up (``--setup-envs``)."""
    from benchmarks import envs
    from benchmarks.text_peers import write_texts, write_tokens
    from kuat.text import tokenize
    from kuat.text.corpus import EOS, python_docs_corpus, train_bpe

    try:
        python = envs.ensure("text", create=False, log_path=tmp_path / "env.log")
    except envs.EnvUnavailable as e:
        pytest.skip(f"no text bench environment: {e}")
    texts = python_docs_corpus()[:150]  # one of them is longer than 64 tokens: split, not cut
    tok = train_bpe(texts, vocab_size=500)
    eos = tok.token_to_id(EOS)
    tok.save(str(tmp_path / "tok.json"))
    docs = [s["input_ids"] for s in tokenize(texts, tok, eos_id=eos).samples(0)]
    assert max(map(len, docs)) > 64
    write_tokens(tmp_path / "t.npz", docs)
    write_texts(tmp_path / "texts.json", texts, eos)
    got = _run_child(str(python), tmp_path,
                     ["--texts", str(tmp_path / "texts.json"), "--tokenizer", str(tmp_path / "tok.json")])  # fmt: skip
    assert not got["unavailable"], got["unavailable"]
    assert set(got["runs"]) == {
        "torchtune PackedDataset", "trl pack_dataset bfd", "trl pack_dataset wrapped",
        "torchtune PackedDataset (raw text)", "trl map + pack_dataset bfd (raw text)",
    }  # fmt: skip
    _check_runs(got, sum(map(len, docs)), 64)
    pre, raw = (
        got["runs"]["torchtune PackedDataset"],
        got["runs"]["torchtune PackedDataset (raw text)"],
    )
    assert pre[2] == raw[2]  # the same packs: the same token lists, in the same order
