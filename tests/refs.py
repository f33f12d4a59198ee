"""Plain-PyTorch reference implementations shared by tests and benchmarks.

Every reference is the obvious, unscheduled computation in fp64 or fp32, with
shapes documented; the ops under test must match them (docs/design.md section 4).
Sections are per component; keep each component's references in its section.
"""
from __future__ import annotations

import torch

# ---------------------------------------------------------------------------
# StreamAdamW
# ---------------------------------------------------------------------------
def adamw_step_ref(p, g, m, v, step, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
    """One decoupled-weight-decay AdamW step in fp64, in place.

    p, m, v: [n] float64 (param, exp_avg, exp_avg_sq), updated in place;
    g: [n] any float dtype (widened to fp64); step: the step number after
    incrementing (1 on the first step). Same math as torch.optim.AdamW."""
    b1, b2 = betas
    g = g.to(torch.float64)
    p.mul_(1 - lr * weight_decay)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / (1 - b2 ** step) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - b1 ** step))


def adamw_fused_step_ref(p, m32, v32, vm32, g32, step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=1e-2,
                         maximize=False):
    """torch.optim.AdamW(fused=True), one step (number `step`, 1 = the first) from fp32 state
    [n] (vm32: amsgrad's max, or None): returns the new (p, m, v, vm), fp32, inputs untouched."""
    ref = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=lr, betas=betas, eps=eps, weight_decay=wd, amsgrad=vm32 is not None,
                            maximize=maximize, fused=True)
    state = {"step": torch.tensor(float(step - 1)), "exp_avg": m32.clone(), "exp_avg_sq": v32.clone()}
    if vm32 is not None:
        state["max_exp_avg_sq"] = vm32.clone()
    opt.state[ref] = state
    ref.grad = g32.clone()
    opt.step()
    return ref.detach(), state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq")


# The stochastic rounding of bf16 optimizer state (csrc/adamw_kernels.h), emulated in Python
# ints (keys) and numpy uint32 (per element): SR(x) = (bits(x) + r) >> 16 with r from a
# counter hash of (seed, step, element index within the parameter).
_M64 = (1 << 64) - 1


def sr_mix64(z):
    """splitmix64's finalizer (uint64, wrapping)."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def sr_mix32(x):
    """Wellons' lowbias32 finalizer on a numpy uint32 array."""
    import numpy as np
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def sr_hash(idx, seed, step):
    """h (numpy uint32) of the element indices idx (int64 array) for one parameter's (seed, step)."""
    import struct

    import numpy as np
    step_bits = struct.unpack("<Q", struct.pack("<d", float(step)))[0]
    key = sr_mix64(sr_mix64(seed & _M64) ^ step_bits)
    idx = np.asarray(idx, dtype=np.int64)
    h = np.empty(idx.shape, dtype=np.uint32)
    for hi in np.unique(idx >> 32):
        k = sr_mix64((key + int(hi)) & _M64)
        sel = (idx >> 32) == hi
        lo = (idx[sel] & 0xFFFFFFFF).astype(np.uint32)
        h[sel] = sr_mix32(sr_mix32(lo ^ np.uint32(k & 0xFFFFFFFF)) ^ np.uint32(k >> 32))
    return h


def sr_round(x, r):
    """bf16 tensor: SR of the fp32 tensor x with the 16-bit draws r (numpy uint32 array)."""
    import numpy as np
    bits = x.contiguous().view(torch.int32).numpy().view(np.uint32).astype(np.uint64)
    out = ((bits + r.astype(np.uint64).reshape(bits.shape)) >> np.uint64(16)).astype(np.uint16)
    out[np.isnan(x.numpy())] = 0x7FC0
    return torch.from_numpy(out.view(np.int16).copy()).view(torch.bfloat16)


def sr_expected(m32, v32, vm32, seed, step, first=0):
    """The bf16 (m, v, vm) the kernel stores for fp32 results m32, v32, vm32 (or None) of
    elements first.. of a parameter with this rounding seed at this step: m takes the hash's
    high 16 bits, v and vm its low 16 bits."""
    import numpy as np
    h = sr_hash(np.arange(first, first + m32.numel(), dtype=np.int64), seed, step)
    rv = h & np.uint32(0xFFFF)
    return sr_round(m32, h >> np.uint32(16)), sr_round(v32, rv), None if vm32 is None else sr_round(vm32, rv)


# ---------------------------------------------------------------------------
# Ring-DTP (linear + cross-entropy)
# ---------------------------------------------------------------------------
def ref_linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean",
                             label_smoothing=0.0, z_loss=0.0, softcap=None, dtype=torch.float64):
    """The unscheduled computation in `dtype` (default fp64).
    hidden [T, H], weight [V, H], labels [T] int64, bias [V] or None.
    logits = hidden @ weight.T + bias: [T, V]; optional softcap c*tanh(z/c);
    loss_i = CE with label smoothing + z_loss * lse_i^2 (0 for ignored tokens).
    reduction "mean" divides by the number of non-ignored tokens: NaN (0 / 0) when
    every label is ignored or T = 0, with zero gradients, as torch's F.cross_entropy.
    Returns the loss ([] or [T])."""
    z = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    return _ce_of_logits(z, labels, ignore_index, reduction, label_smoothing, z_loss, softcap)


def _ce_of_logits(z, labels, ignore_index, reduction, label_smoothing, z_loss, softcap):
    """The loss of logits z [T, V] (softcap, CE with smoothing, z-loss on
    non-ignored rows, reduction; "mean" over non-ignored rows, NaN if none)."""
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    rows = torch.nn.functional.cross_entropy(z, labels, ignore_index=ignore_index, reduction="none",
                                             label_smoothing=label_smoothing)
    valid = labels != ignore_index
    if z_loss:
        lse = torch.logsumexp(z, dim=-1)
        rows = rows + torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / valid.sum()  # no valid row: 0 / 0 = NaN, as torch's mean of nothing


def naive_linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, z_loss=0.0, softcap=None):
    """What users write today (logits in the input dtype, then .float()): the
    error yardstick for low precision (docs/design.md: at most 2x its error)."""
    z = torch.nn.functional.linear(hidden, weight, bias).float()
    return _ce_of_logits(z, labels, ignore_index, reduction, label_smoothing, z_loss, softcap)


def label_rows_ref(dw, x, labels, tc, v0=0, cs=None, mu=None):
    """Ring-DTP's dW finish in fp64: dw[r] [+ cs[r] * mu] + sum over the tokens t with
    labels[t] == v0 + r of tc[t] * x[t] (labels outside [v0, v0 + nv) add nothing). Returns
    (result, the sum of |terms|: the scale of the fp32 summation's rounding)."""
    nv, H = dw.shape
    xd, yc, tcd = x.double().cpu(), labels.cpu(), tc.double().cpu()
    mine = (yc >= v0) & (yc < v0 + nv)
    terms = tcd[mine, None] * xd[mine]
    add = torch.zeros(nv, H, dtype=torch.float64).index_add_(0, yc[mine] - v0, terms)
    mag = torch.zeros(nv, H, dtype=torch.float64).index_add_(0, yc[mine] - v0, terms.abs())
    if cs is not None:
        r1 = cs.double().cpu()[:, None] * mu.double().cpu()[None, :]
        add, mag = add + r1, mag + r1.abs()
    return dw.double().cpu() + add, mag


def label_rows_dx_ref(dx, w, labels, tc, v0=0):
    """Ring-DTP's dX finish (vocab_outer_lowp) in fp64: dx[t] + tc[t] * w[labels[t] - v0] for
    the tokens whose label is one of w's rows v0 .. v0 + nv - 1; other rows dx[t]."""
    nv = w.shape[0]
    out, yc = dx.double().cpu().clone(), labels.cpu()
    mine = (yc >= v0) & (yc < v0 + nv)
    out[mine] += tc.double().cpu()[mine, None] * w.double().cpu()[yc[mine] - v0]
    return out


# ---------------------------------------------------------------------------
# SCO (checkpoint offload)
# ---------------------------------------------------------------------------
# SCO references: a small decoder stack, and the same stack checkpointed with
# torch.utils.checkpoint(use_reentrant=False), the bitwise target of SCO.
#   x: [B, T, H] (any float dtype); heads nh, head dim H/nh; MLP hidden 4H.
class SCORMSNorm(torch.nn.Module):
    def __init__(self, h, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):  # x: [.., H]
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class SCOBlock(torch.nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)); x + mlp(norm(x)).
    attention=False gives the benchmark block (RMSNorm + 4H MLP only)."""

    def __init__(self, h, nh=2, dropout=0.0, attention=True):
        super().__init__()
        self.nh, self.p, self.attention = nh, dropout, attention
        if attention:
            self.n1 = SCORMSNorm(h)
            self.qkv = torch.nn.Linear(h, 3 * h, bias=False)
            self.o = torch.nn.Linear(h, h, bias=False)
        self.n2 = SCORMSNorm(h)
        self.up = torch.nn.Linear(h, 4 * h, bias=False)
        self.down = torch.nn.Linear(4 * h, h, bias=False)

    def forward(self, x, scale=1.0):  # x: [B, T, H]; scale: a non-tensor argument
        if self.attention:
            b, t, h = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.nh, h // self.nh).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self._drop(self.o(a.transpose(1, 2).reshape(b, t, h)))
        y = self._drop(self.down(torch.nn.functional.gelu(self.up(self.n2(x)))))
        return x + (y if scale == 1.0 else scale * y)

    def _drop(self, y):  # no kernel at all when p == 0 (the benchmark block)
        return torch.nn.functional.dropout(y, self.p, self.training) if self.p > 0 else y


def sco_stack_forward(blocks, x, mode="plain", **kw):
    """Run blocks in order. mode: plain | torch (torch checkpoint, non-reentrant)."""
    import torch.utils.checkpoint as tuc

    for blk in blocks:
        if mode == "plain":
            x = blk(x, **kw)
        elif mode == "torch":
            x = tuc.checkpoint(blk, x, use_reentrant=False, **kw)
        else:
            raise ValueError(mode)
    return x


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

        R = [0] * E
        for e in sorted(range(E), key=lambda e: (L[e], e)):  # native pass: smallest first
            o = e // El
            keep = min(L[e], max(0, cap - assigned[o]))
            Q[e][o] = keep
            assigned[o] += keep
            R[e] = L[e] - keep
        for e in sorted((e for e in range(E) if R[e] > 0), key=lambda e: (-R[e], e)):  # spill pass
            o, r = e // El, R[e]
            while r > 0:
                d = least(o)
                room = cap - assigned[d]
                if r < min_tokens:
                    d, take = o, r
                elif room >= r:
                    take = r
                elif room >= min_tokens and room > 0:
                    take = room
                else:
                    d, take = least(None), r
                Q[e][d] += take
                assigned[d] += take
                r -= take
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


def moe_gpt_oss_ref(x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, alpha=1.702, limit=7.0):
    """Hugging Face GPT-OSS experts (transformers 5.17 GptOssExperts, eager):
    gate_up [E, H, 2I] with gate/up interleaved (gate = h[..., ::2], up =
    h[..., 1::2]), gate_up_bias [E, 2I], down [E, I, H], down_bias [E, H];
    h = x W + b; g = gate.clamp(max=limit); u = up.clamp(-limit, limit);
    a = (u + 1) * g * sigmoid(g * alpha); out = a W_down + b_down; y[t] +=
    out * w. A loop over experts in x's dtype (fp64 for a ground truth)."""
    T, H = x.shape
    y = torch.zeros(T, H, dtype=x.dtype, device=x.device)
    for e in range(gate_up.shape[0]):
        t, k = (topk_ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        h = x[t] @ gate_up[e] + gate_up_bias[e]
        gate, up = h[..., ::2], h[..., 1::2]
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        a = (up + 1) * (gate * torch.sigmoid(gate * alpha))
        out = a @ down[e] + down_bias[e]
        y = y.index_add(0, t, out * topk_weights[t, k].to(out.dtype).unsqueeze(1))
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
# The model's MoE block and attention written out token by token / with an
# explicit mask, in the caller's dtype (pass fp64 for ground truth).


def moe_problem(T, E, K, H, I, frac, seed):
    """One global MoE problem in fp64 (CPU): x [T, H], ids [T, K] (skewed by
    `frac`, hot tokens shuffled over the sequence so every rank gets some),
    topk weights [T, K], w_gate_up [E, H, 2I], w_down [E, I, H], dy [T, H]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    wgu = torch.randn(E, H, 2 * I, generator=g, dtype=torch.float64) / H ** 0.5
    wd = torch.randn(E, I, H, generator=g, dtype=torch.float64) / I ** 0.5
    ids = skewed_topk_ids(T, E, K, frac, generator=g)
    ids = ids[torch.randperm(T, generator=g)]
    tw = torch.rand(T, K, generator=g, dtype=torch.float64)
    gy = torch.randn(T, H, generator=g, dtype=torch.float64)
    return x, ids, tw, wgu, wd, gy

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


def rms_norm_ref(x, weight, eps):
    """Llama-style RMSNorm in fp64: x [..., H], weight [H] -> [..., H] fp64,
    weight * x / sqrt(mean(x^2) + eps) (no intermediate rounding)."""
    xd = x.double()
    return weight.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps))
