"""Training text that needs no download, and a byte-level tokenizer.

Corpus: the Python standard library's own source files (`*.py` under
sysconfig's "stdlib" path), which exist on every CPython install. Files are
taken in sorted path order, each followed by EOS, until `max_bytes`: the same
bytes on every machine with the same Python version.

Fallback (no stdlib sources, e.g. a stripped install, or `source="synthetic"`):
a synthetic language with learnable structure. A fixed random first-order
Markov chain over 256 byte tokens where each token has 4 likely successors
(probabilities 0.55, 0.25, 0.15, 0.05): its entropy is 1.6 nats/token, so
loss starts near ln(vocab) ~ 5.6 and can fall to ~1.6.

Tokenizer: token = byte value (0..255); specials BOS=256, EOS=257, PAD=258.
The model's vocab may be larger (padding rows, never targets).

Batches are a pure function of (seed, step, rank): a resumed run sees exactly
the batches the uninterrupted run would have seen.
"""
from __future__ import annotations

import os
import sysconfig
from typing import Optional, Tuple

import torch

BOS, EOS, PAD = 256, 257, 258
NUM_TOKENS = 259
IGNORE = -100


def encode(text) -> torch.Tensor:
    b = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).to(torch.int64)


def decode(ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def stdlib_corpus(max_bytes: int = 8 << 20) -> Optional[torch.Tensor]:
    """Token ids [N] int64 of the stdlib sources, or None when none are found."""
    root = sysconfig.get_paths().get("stdlib")
    if not root or not os.path.isdir(root):
        return None
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test"))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    files.sort()
    chunks, total = [], 0
    for path in files:
        try:
            with open(path, "rb") as fh:
                data = fh.read(max_bytes - total)
        except OSError:
            continue
        if not data:
            continue
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        chunks.append(t)
        chunks.append(torch.tensor([EOS]))
        total += len(data) + 1
        if total >= max_bytes:
            break
    if total < 1 << 16:
        return None
    return torch.cat(chunks)


def synthetic_corpus(n_tokens: int = 1 << 22, seed: int = 1234) -> torch.Tensor:
    """[n_tokens] int64 from the fixed Markov chain described above."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.stack([torch.randperm(256, generator=g)[:4] for _ in range(256)])  # [256, 4]
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    choice = torch.multinomial(probs, n_tokens, replacement=True, generator=g)      # [n]
    out = torch.empty(n_tokens, dtype=torch.int64)
    cur = 0
    # sequential by nature; 4M steps in Python would be slow, so walk in numpy-free
    # blocks: gather next = succ[cur, choice[i]] with a small Python loop over a list.
    s, c = succ.tolist(), choice.tolist()
    for i in range(n_tokens):
        cur = s[cur][c[i]]
        c[i] = cur
    out.copy_(torch.tensor(c))
    return out


class TokenStream:
    """Deterministic batches of (input_ids, labels), each [batch, seq_len] int64."""

    def __init__(self, source: str = "auto", *, max_bytes: int = 8 << 20, seed: int = 0):
        if source not in ("auto", "stdlib", "synthetic"):
            raise ValueError(f"moepeak: data source must be auto, stdlib or synthetic, got {source!r}")
        tokens = None
        if source in ("auto", "stdlib"):
            tokens = stdlib_corpus(max_bytes)
            if tokens is None and source == "stdlib":
                raise RuntimeError("moepeak: no Python standard-library sources found for the corpus; "
                                   "use --data synthetic")
        self.source = "stdlib" if tokens is not None else "synthetic"
        if tokens is None:
            tokens = synthetic_corpus(min(max_bytes, 1 << 20))
        self.tokens, self.seed = tokens, seed

    def __len__(self):
        return self.tokens.numel()

    def batch(self, step: int, batch: int, seq_len: int, *, rank: int = 0,
              device=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Windows of seq_len+1 tokens at offsets drawn from (seed, step, rank).
        A window longer than the corpus wraps around (the corpus is a ring)."""
        n = self.tokens.numel()
        g = torch.Generator().manual_seed((self.seed * 7919 + step) * 131 + rank)
        starts = torch.randint(0, n, (batch,), generator=g)
        idx = (starts[:, None] + torch.arange(seq_len + 1)[None, :]) % n
        win = self.tokens[idx]                               # [B, T+1]
        x, y = win[:, :-1].contiguous(), win[:, 1:].contiguous()
        if device is not None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return x, y
