"""Plain-PyTorch reference implementations shared by tests and benchmarks.

Every reference is the obvious, unscheduled computation in fp64 or fp32, with
shapes documented; the ops under test must match them (DESIGN.md section 4).
Sections are per component; keep each component's references in its section.
"""
from __future__ import annotations

import torch

# ---------------------------------------------------------------------------
# OffloadStreamAdamW
# ---------------------------------------------------------------------------
# (references for stream_adamw go here)


# ---------------------------------------------------------------------------
# Ring-DTP (linear + cross-entropy)
# ---------------------------------------------------------------------------
# (references for ring_dtp_ce go here)


# ---------------------------------------------------------------------------
# SCO (checkpoint offload)
# ---------------------------------------------------------------------------
# (references for sco_offload go here)


# ---------------------------------------------------------------------------
# PipelinedLLEP (MoE dispatch)
# ---------------------------------------------------------------------------
# (references for llep_dispatch go here)


# ---------------------------------------------------------------------------
# Composed model (demo / end-to-end)
# ---------------------------------------------------------------------------
# The model's MoE block and attention written out token by token / with an
# explicit mask, in the caller's dtype (pass fp64 for ground truth).

def ref_moe(x, router_w, w_gate_up, w_down, top_k, norm_topk_prob=True):
    """x: [N, H]; router_w: [E, H]; w_gate_up: [E, H, 2I] ([:I] gate, [I:] up);
    w_down: [E, I, H]. Softmax over all E router logits, top-k, renormalised when
    norm_topk_prob; y[n] = sum_k w[n,k] * (silu(x W_g) * (x W_u)) W_d of expert ids[n,k].
    Returns (y [N, H], logits [N, E])."""
    I = w_down.shape[1]
    logits = x @ router_w.t()
    probs = logits.softmax(-1)
    w, ids = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(top_k):
            e = int(ids[n, k])
            h = x[n] @ w_gate_up[e]
            y[n] += w[n, k] * ((torch.nn.functional.silu(h[:I]) * h[I:]) @ w_down[e])
    return y, logits


def ref_causal_attention(q, k, v):
    """q: [B, nh, T, d]; k, v: [B, nkv, T, d] (nkv divides nh, head j uses kv head
    j // (nh/nkv)). softmax(q k^T / sqrt(d) + causal mask) v: [B, nh, T, d]."""
    r = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(r, dim=1)
    v = v.repeat_interleave(r, dim=1)
    T = q.shape[2]
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return s.masked_fill(mask, float("-inf")).softmax(-1) @ v
