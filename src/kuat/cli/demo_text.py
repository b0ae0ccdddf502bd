"""kuat demo --text: the language-model path, end to end, on text that every Python ships.

1. the corpus (``kuat.text.corpus.demo_corpus``): the ~2,000 paragraphs of Python's offline
   documentation (``pydoc_data``) and the docstrings of 34 standard-library modules, ~5,800
   paragraphs that every Python ships;
2. train a byte-level BPE tokenizer on it (``tokenizers``) and tokenize it at ingest into a
   kuat dataset of uint16 token sequences;
3. padding waste of naive per-sample padding against packing (concat, first-fit, best-fit),
   at the training row length and at 2,048;
4. train a small causal transformer on packed rows for a bounded time, attention kept inside
   documents by the block-causal document mask, printing tokens/s and the time to the first
   batch.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import kuat
from kuat.demo_data import default_cache_dir
from kuat.text import pack, pack_collate
from kuat.text.corpus import EOS, demo_corpus, train_bpe


def run_text(args) -> int:
    """``kuat demo --text``: see the module docstring. Prints; returns the exit status."""
    seq_len = args.seq_len
    cache = Path(args.cache_dir or default_cache_dir()) / "demo"  # beside the image demo's
    cache.mkdir(parents=True, exist_ok=True)
    out = {}
    t0 = time.perf_counter()
    texts = demo_corpus()
    tok = train_bpe(texts, vocab_size=8192)
    eos = tok.token_to_id(EOS)
    out["tokenizer_train_s"] = time.perf_counter() - t0
    dst = cache / "text-demo.kuat"
    t0 = time.perf_counter()
    kuat.convert.from_text(
        texts, dst, tok, eos_id=eos, overwrite=True, num_workers=max(1, args.workers)
    )
    out["ingest_s"] = time.perf_counter() - t0
    ds = kuat.open(dst)
    lengths = kuat.text.lengths_of(ds)
    tokens = int(lengths.sum())
    stored = kuat.text.token_storage(dst)
    out.update(
        documents=len(ds),
        tokens=tokens,
        token_bytes_per_token=stored["token_bytes"] / tokens,
        index_bytes_per_document=stored["index_bytes"] / len(ds),
        stored_bytes_per_token=stored["file_bytes"] / tokens,
    )
    print(
        f"corpus: {len(ds)} documents, {tokens} tokens ({tokens / len(ds):.1f} per document); "
        f"BPE trained in {out['tokenizer_train_s']:.2f} s, tokenized at ingest in "
        f"{out['ingest_s']:.2f} s ({tokens / out['ingest_s']:.0f} tokens/s)\n"
        f"stored: token values {out['token_bytes_per_token']:.2f} bytes per token + list "
        f"offsets {out['index_bytes_per_document']:.2f} bytes per document + "
        f"{stored['other_bytes']} bytes of Arrow framing = {out['stored_bytes_per_token']:.3f} "
        "bytes per stored token"
    )

    print(f"\npadding waste (% of row tokens that are padding), batch {args.batch_size}:")
    waste = {}
    for length in sorted({seq_len, 2048}):
        naive = _naive_waste(lengths, args.batch_size, length)
        row = {"naive": naive}
        for strategy in ("concat", "first_fit", "best_fit"):
            packed = pack(ds, length, strategy, buffer_size=1024)
            t0 = time.perf_counter()
            n = sum(1 for _ in packed)
            dt = time.perf_counter() - t0
            stats = packed.stats()
            row[strategy] = stats["padding_fraction"]
            row[f"{strategy}_docs_per_s"] = stats["documents"] / dt
            row[f"{strategy}_rows"] = n
        waste[length] = row
        # the fewest rows any packer needs is ceil(tokens / L): padding below what that leaves
        # in the last row is impossible, so a small corpus cannot reach 1% at a large L
        optimum = 1 - tokens / (math.ceil(tokens / length) * length)
        row["best_fit_over_optimum"] = row["best_fit"] - optimum
        print(
            f"  L={length:5d}: naive per-sample {100 * naive:5.1f}%   concat "
            f"{100 * row['concat']:4.2f}%   first-fit {100 * row['first_fit']:4.2f}%   best-fit "
            f"{100 * row['best_fit']:4.2f}%; best-fit packs {row['best_fit_docs_per_s']:.0f} "
            f"documents/s\n           the corpus is {tokens / length:.2f} rows of {length}: any "
            f"packer pads at least {100 * optimum:.2f}% (the last row); best-fit pads "
            f"{100 * row['best_fit_over_optimum']:.2f}% beyond that"
        )
    out["padding_waste"] = waste

    if args.train_seconds > 0:

        def make_loader():
            return kuat.DataLoader(
                pack(ds, seq_len, "best_fit", buffer_size=512, shuffle=True, seed=args.seed),
                batch_size=args.batch_size,
                num_workers=min(args.workers, 2),
                collate_fn=pack_collate(document_mask=True),
                seed=args.seed,
            )

        out.update(_train(make_loader, tok.get_vocab_size(), args.train_seconds, args.seed))
    if args.json is not None:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float))
    return 0


def _naive_waste(lengths, batch_size: int, max_length: int) -> float:
    """Padding share of batches of ``batch_size`` documents in order, each padded to its
    longest (documents cut to ``max_length``): what a plain ``pad_collate`` costs."""
    cut = np.minimum(lengths, max_length)  # (N,)
    real = padded = 0
    for lo in range(0, len(cut), batch_size):
        chunk = cut[lo : lo + batch_size]
        real += int(chunk.sum())
        padded += len(chunk) * int(chunk.max())
    return 1 - real / padded if padded else 0.0


def _train(make_loader, vocab: int, seconds: float, seed: int) -> dict:
    """Train :class:`_TinyLM` for ``seconds`` on the loader ``make_loader()`` builds (timed from
    its construction to its first batch)."""
    torch.manual_seed(seed)
    model = _TinyLM(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    print(f"\ntraining a {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter "
          f"causal transformer on packed rows for {seconds:.0f} s")  # fmt: skip
    steps = tokens = 0
    first_batch_s = None
    wait = 0.0
    t_built = time.perf_counter()
    loader = make_loader()
    t0 = time.perf_counter()
    losses = []
    while time.perf_counter() - t0 < seconds:
        tw = time.perf_counter()
        for batch in loader:
            now = time.perf_counter()
            wait += now - tw
            if first_batch_s is None:
                first_batch_s = now - t_built
            logits = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
            loss = F.cross_entropy(  # (B, L - 1, V) vs (B, L - 1): the labels, shifted
                logits[:, :-1].reshape(-1, vocab), batch["labels"][:, 1:].reshape(-1)
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            tokens += int((batch["labels"] != -100).sum())
            losses.append(loss.item())
            if steps % 20 == 0:
                print(f"  step {steps:4d}  loss {loss.item():.3f}")
            tw = time.perf_counter()
            if tw - t0 >= seconds:
                break
    elapsed = time.perf_counter() - t0
    result = {
        "steps": steps,
        "trained_tokens_per_s": tokens / elapsed,
        "time_to_first_batch_s": first_batch_s,
        "input_wait_fraction": wait / elapsed,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
    }
    print(
        f"  {steps} steps, {result['trained_tokens_per_s']:.0f} trained tokens/s, first batch "
        f"after {first_batch_s:.2f} s, {100 * result['input_wait_fraction']:.1f}% of the time "
        "waiting for data"
    )
    return result


class _Block(nn.Module):
    """Pre-norm attention (SDPA under the document mask) and MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, c // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, L, H, D) -> (B, H, L, D)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, L, D)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, c))  # (B, L, C)
        return x + self.mlp(self.ln2(x))


class _TinyLM(nn.Module):
    """Token + learned position embeddings (positions restart per document), 2 blocks."""

    def __init__(self, vocab: int, dim: int = 128, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(4096, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, ids, positions, mask):
        x = self.tok(ids) + self.pos(positions)  # (B, L) int64 -> (B, L, C)
        for block in self.blocks:
            x = block(x, mask)  # mask: (B, 1, L, L) bool, block-causal per document
        return self.head(self.ln(x))  # (B, L, V)
