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
def llep_plan_ref(load, alpha, min_tokens, lam):
    """The LLEP plan in plain Python (must equal csrc/llep_plan.c exactly).

    load: P x E nested lists of ints (rows rank s routes to expert e).
    Returns (Q [E][P], A [E][P][P], S [P][P], spilled): rows of expert e run
    on rank d; rows of e sent s -> d; rows sent s -> d.
    """
    import math

    P, E = len(load), len(load[0])
    if E % P:
        raise ValueError("num_experts must be a multiple of the number of ranks")
    El = E // P
    L = [sum(load[s][e] for s in range(P)) for e in range(E)]
    total = sum(L)
    nat = [sum(L[e] for e in range(r * El, (r + 1) * El)) for r in range(P)]
    Q = [[0] * P for _ in range(E)]
    spilled = False
    if P == 1 or total == 0 or float(max(nat)) * P < lam * float(total):
        for e in range(E):
            Q[e][e // El] = L[e]
    else:
        cap = max(1, math.ceil(alpha * float(total) / float(P)))
        assigned = [0] * P

        def least(exclude):
            cands = [d for d in range(P) if d != exclude]
            return min(cands, key=lambda d: (assigned[d], d))

        for e in sorted(range(E), key=lambda e: (-L[e], e)):
            o = e // El
            keep = min(L[e], max(0, cap - assigned[o]))
            Q[e][o] += keep
            assigned[o] += keep
            R = L[e] - keep
            while R > 0:
                d = least(o)
                room = cap - assigned[d]
                if room >= R:
                    take = R
                elif room >= min_tokens and room > 0:
                    take = room
                else:
                    d, take = least(None), R
                Q[e][d] += take
                assigned[d] += take
                R -= take
                spilled = spilled or d != o
    A = [[[0] * P for _ in range(P)] for _ in range(E)]
    S = [[0] * P for _ in range(P)]
    for e in range(E):
        src_lo = 0
        for s in range(P):
            src_hi = src_lo + load[s][e]
            seg_lo = 0
            for d in range(P):
                seg_hi = seg_lo + Q[e][d]
                ov = min(src_hi, seg_hi) - max(src_lo, seg_lo)
                if ov > 0:
                    A[e][s][d] = ov
                    S[s][d] += ov
                seg_lo = seg_hi
            src_lo = src_hi
    return Q, A, S, spilled


def llep_num_chunks_ref(S, C):
    """n = max over pairs of ceil(S[s][d] / floor(C / P))."""
    q = C // len(S)
    return max([-(-v // q) for row in S for v in row] + [0])


def llep_chunk_layout_ref(A, S, r, n, j):
    """Chunk j of n on rank r: (send_start, send_len, recv_len, perm, ecount).
    Pair (s, d)'s slice j is [j*S//n, (j+1)*S//n); the send list is dst-major,
    the receive buffer src-major, grouped rows expert-major then src-major."""
    P, E = len(S), len(A)
    sl_ = lambda v: (v * j // n, v * (j + 1) // n)  # noqa: E731
    send_start, send_len, base = [], [], 0
    for d in range(P):
        lo, hi = sl_(S[r][d])
        send_start.append(base + lo)
        send_len.append(hi - lo)
        base += S[r][d]
    recv_len, pieces, roff = [], {}, 0
    for s in range(P):
        lo, hi = sl_(S[s][r])
        recv_len.append(hi - lo)
        eoff = 0
        for e in range(E):
            a = A[e][s][r]
            x0, x1 = max(lo, eoff), min(hi, eoff + a)
            if x1 > x0:
                pieces[(e, s)] = list(range(roff + x0 - lo, roff + x1 - lo))
            eoff += a
        roff += hi - lo
    perm, ecount = [], [0] * E
    for e in range(E):
        for s in range(P):
            p = pieces.get((e, s), [])
            perm += p
            ecount[e] += len(p)
    return send_start, send_len, recv_len, perm, ecount


def moe_dense_ref(x, topk_ids, topk_weights, w_gate_up, w_down):
    """y [T, H] = sum_k w[t, k] * expert_{ids[t, k]}(x[t]); all E experts'
    weights w_gate_up [E, H, 2I] (gate | up), w_down [E, I, H]; a plain loop
    over tokens' picks grouped by expert, in the dtype of x (use fp64 for a
    ground truth). Differentiable in x, topk_weights and the weights."""
    T, H = x.shape
    I = w_down.shape[1]
    y = torch.zeros(T, H, dtype=x.dtype, device=x.device)
    for e in range(w_gate_up.shape[0]):
        t, k = (topk_ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        h = x[t] @ w_gate_up[e]
        o = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ w_down[e]
        y = y.index_add(0, t, topk_weights[t, k].to(o.dtype).unsqueeze(1) * o)
    return y


def moe_block_ref(x, router_weight, w_gate_up, w_down, top_k, norm_topk_prob=True):
    """Router (fp32 logits) + top-k + dense experts; returns (y, logits)."""
    logits = torch.nn.functional.linear(x.float(), router_weight.float())
    tw, ti = logits.softmax(-1).topk(top_k, dim=-1)
    if norm_topk_prob:
        tw = tw / tw.sum(-1, keepdim=True)
    return moe_dense_ref(x, ti, tw, w_gate_up, w_down), logits


def skewed_topk_ids(T, E, K, frac, generator=None, hot=4):
    """Routing where a fraction `frac` of tokens send all K picks to experts
    0..hot-1 (K distinct picks among them when K <= hot, else hot + random
    others), the rest K distinct uniform picks. [T, K] int64."""
    g = generator
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.empty(0, K, dtype=torch.int64)
    nh = int(round(frac * T))
    for t in range(nh):
        if K <= hot:
            ids[t] = torch.randperm(hot, generator=g)[:K]
        else:
            rest = torch.randperm(E - hot, generator=g)[:K - hot] + hot
            ids[t] = torch.cat([torch.arange(hot), rest])
    return ids


# ---------------------------------------------------------------------------
# Composed model (demo / end-to-end)
# ---------------------------------------------------------------------------
# (references for the end-to-end model go here)
