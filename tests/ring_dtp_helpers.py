"""Shared helpers of the Ring-DTP single-device tests (test_ring_dtp_*.py): problem
makers, gradient runners and the tolerance check against the fp64 reference.

Tolerance rule (docs/design.md section 4): relative error (norm of the difference /
norm of the fp64 result) of loss, dX, dW, dbias at most 2x that of the naive
computation in the same dtype (F.linear in the input dtype, then .float()),
plus a small floor for fp32 (where both are at rounding level).
"""
import math

import torch

import moepeak
import moepeak.ring_dtp  # noqa: F401  (registers the ops)
from tests.refs import naive_linear_cross_entropy, ref_linear_cross_entropy

FLOOR = {torch.float32: 2e-6, torch.bfloat16: 1e-3, torch.float16: 2e-4}


def relerr(a, b):
    a, b = a.double(), b.double()
    n = b.norm()
    return ((a - b).norm() / (n if n > 0 else 1.0)).item()


def make(T, H, V, dtype, seed=0, scale=0.5, bias=False, ignore_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * scale / math.sqrt(H) * 4).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    if ignore_frac:
        y[torch.rand(T, generator=g) < ignore_frac] = -100
    b = (torch.randn(V, generator=g) * 0.1).to(dtype) if bias else None
    return x, w, y, b


def grads(fn, x, w, y, b, gout=None, **kw):
    xs = x.detach().clone().requires_grad_()
    ws = w.detach().clone().requires_grad_()
    bs = b.detach().clone().requires_grad_() if b is not None else None
    loss = fn(xs, ws, y, bias=bs, **kw)
    loss.backward(gout if gout is not None else None)
    return loss.detach(), xs.grad, ws.grad, (bs.grad if bs is not None else None)


def check(x, w, y, b=None, mode="auto", gout=None, chunk_tokens=None, chunk_vocab=None, options=None, **kw):
    """Ring-DTP's loss and gradients (mode, chunk sizes, options: its schedule; kw: the loss
    definition) within 2x naive's error against the fp64 reference."""
    dtype = x.dtype
    ours = grads(moepeak.linear_cross_entropy, x, w, y, b, gout, mode=mode, chunk_tokens=chunk_tokens,
                 chunk_vocab=chunk_vocab, options=options, **kw)
    ref = grads(ref_linear_cross_entropy, x.double(), w.double(), y, None if b is None else b.double(),
                None if gout is None else gout.double(), **kw)
    naive = grads(naive_linear_cross_entropy, x, w, y, b, gout, **kw)
    names = ("loss", "dX", "dW", "dbias")
    for name, o, r, n in zip(names, ours, ref, naive):
        if r is None:
            continue
        assert o.shape == r.shape, (name, o.shape, r.shape)
        assert torch.isfinite(o).all(), f"{name}: non-finite values"
        eo, en = relerr(o, r), relerr(n, r)
        assert eo <= 2 * en + FLOOR[dtype], (
            f"{name} ({dtype}, mode={mode}): ours {eo:.3e} vs naive {en:.3e}; "
            f"max abs diff {(o.double() - r).abs().max().item():.3e}")
    return ours, ref


MODES = ["fused", "fused_lowp", "vocab_outer", "token_outer", "vocab_outer_lowp"]


def _head_problem(T, H, V, labels, seed, x_mean=0.0, ignore_every=0):
    """bf16 hidden states randn [T, H] (+ x_mean times one shared random direction), weight
    randn / sqrt(H) [V, H], labels uniform or Zipf(1.1) over V (every ignore_every-th
    ignored); with the fp64 reference's and naive bf16's (loss, dX, dW)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    if x_mean:
        x = x + x_mean * torch.randn(1, H, generator=g)
    x = x.to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H)).to(torch.bfloat16)
    if labels == "zipf":
        p = torch.arange(1, V + 1, dtype=torch.float64) ** -1.1
        y = torch.multinomial(p / p.sum(), T, replacement=True, generator=g)
    else:
        y = torch.randint(0, V, (T,), generator=g)
    if ignore_every:
        y[::ignore_every] = -100
    ref = grads(ref_linear_cross_entropy, x.double(), w.double(), y, None)
    naive = grads(naive_linear_cross_entropy, x, w, y, None)
    return x, w, y, ref, naive


