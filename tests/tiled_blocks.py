"""Test-only blocks for tests/test_tiled.py: a pre-norm MoE decoder block written as the
plain untiled forward, with the arithmetic of moepeak's demo Block (RMSNorm in fp32,
rotate-half RoPE in fp32, GQA read in place by causal SDPA, fp32 router, dense top-k
SwiGLU experts accumulated in fp32), and the same attribute names, so that
moepeak.demo.tiled.demo_block_spec applies to it."""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._python_dispatch
import torch.utils._pytree


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class Rotary:
    def __init__(self, head_dim, theta=1e6):
        self.head_dim, self.theta = head_dim, theta

    def tables(self, T, device, offset=0):
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
                                    / self.head_dim))
        ang = torch.outer(torch.arange(offset, offset + T, device=device, dtype=torch.float32), inv)
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    d = x.shape[-1] // 2
    rot = torch.cat([-x[..., d:], x[..., :d]], dim=-1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


def sdpa_causal(q, k, v):
    """q [B, hq, T, d], k/v [B, hkv, T, d]: GQA read in place (the demo model's core)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def linear_causal_core(q, k, v):
    """A position-mixing core with O(T) memory (prefix means of sigmoid(k) * v, gated by q; GQA
    by repetition): the memory test's stand-in for flash attention (CPU SDPA materialises [T, T])."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    T = v.shape[2]
    pos = torch.arange(1, T + 1, device=v.device, dtype=v.dtype).view(1, 1, T, 1)
    return torch.sigmoid(q) * ((torch.sigmoid(k) * v).cumsum(2) / pos)


class Attention(nn.Module):
    def __init__(self, H, nh, nkv, rotary, core, dtype):
        super().__init__()
        self.nh, self.nkv, self.d = nh, nkv, H // nh
        d = self.d
        self.q_proj = nn.Linear(H, nh * d, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(H, nkv * d, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(H, nkv * d, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(nh * d, H, bias=False, dtype=dtype)
        self.rotary, self.core, self.cp = rotary, core, None

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        cos, sin = self.rotary.tables(T, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.attend(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.d))

    def attend(self, q, k, v):
        return self.core(q, k, v)


class DenseMoE(nn.Module):
    def __init__(self, H, I, E, K, dtype):
        super().__init__()
        self.H, self.I, self.E, self.K = H, I, E, K
        self.router = nn.Linear(H, E, bias=False, dtype=dtype)
        self.w_gate_up = nn.Parameter(torch.empty(E, H, 2 * I, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(E, I, H, dtype=dtype))

    def forward(self, x):
        x2 = x.reshape(-1, self.H)
        acc = torch.promote_types(x2.dtype, torch.float32)
        logits = F.linear(x2.to(acc), self.router.weight.to(acc))
        w, ids = logits.softmax(-1).topk(self.K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        y = torch.zeros(x2.shape, dtype=acc, device=x2.device)
        for e in range(self.E):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            h = x2[tok] @ self.w_gate_up[e]
            a = F.silu(h[:, :self.I]) * h[:, self.I:]
            y = y.index_add(0, tok, (a @ self.w_down[e]).to(acc) * w[tok, slot, None])
        return y.to(x.dtype).view(x.shape), logits


class RefBlock(nn.Module):
    """x + Attn(RMSNorm(x)); then + MoE(RMSNorm(.)): x [B, T, H] -> [B, T, H]."""

    def __init__(self, H=32, nh=4, nkv=2, E=4, K=2, I=24, dtype=torch.float32, core=sdpa_causal, seed=0):
        super().__init__()
        self.attn_norm = RMSNorm(H, dtype=dtype)
        self.attn = Attention(H, nh, nkv, Rotary(H // nh), core, dtype)
        self.mlp_norm = RMSNorm(H, dtype=dtype)
        self.moe = DenseMoE(H, I, E, K, dtype)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                scale = 0.3 if name.endswith("norm.weight") else 1.0 / math.sqrt(p.shape[-2] if p.dim() > 1 else 1)
                base = 1.0 if name.endswith("norm.weight") else 0.0
                p.copy_((base + scale * torch.randn(p.shape, generator=g)).to(dtype))

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        y, _ = self.moe(self.mlp_norm(x))
        return x + y


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Max live bytes of the storages created by ops run under this mode (allocator-
    independent: each new storage counts from its creation until Python's last
    reference to it dies)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen = set()

    def _release(self, key, nbytes):
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = id(st)
                if key in self._seen or st.nbytes() == 0:
                    continue
                self._seen.add(key)
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._release, key, st.nbytes())
        return out
