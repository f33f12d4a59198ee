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


# ---------------------------------------------------------------------------
# Ring-DTP (linear + cross-entropy)
# ---------------------------------------------------------------------------
def ref_linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean",
                             label_smoothing=0.0, z_loss=0.0, softcap=None, dtype=torch.float64):
    """The unscheduled computation in `dtype` (default fp64).
    hidden [T, H], weight [V, H], labels [T] int64, bias [V] or None.
    logits = hidden @ weight.T + bias: [T, V]; optional softcap c*tanh(z/c);
    loss_i = CE with label smoothing + z_loss * lse_i^2 (0 for ignored tokens).
    reduction "mean" divides by the number of non-ignored tokens, and is 0 (not
    NaN) when every label is ignored (moepeak's documented convention).
    Returns the loss ([] or [T])."""
    z = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
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
    return rows.sum() / valid.sum().clamp_min(1)


def naive_linear_cross_entropy(hidden, weight, labels, bias=None, **kw):
    """What users write today (logits in the input dtype, then .float()): the
    error yardstick for low precision (DESIGN.md: at most 2x its error)."""
    z = torch.nn.functional.linear(hidden, weight, bias).float()
    kw = dict(kw)
    softcap, z_loss, red = kw.pop("softcap", None), kw.pop("z_loss", 0.0), kw.pop("reduction", "mean")
    ign = kw.get("ignore_index", -100)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    rows = torch.nn.functional.cross_entropy(z, labels, reduction="none", **kw)
    valid = labels != ign
    if z_loss:
        lse = torch.logsumexp(z, dim=-1)
        rows = rows + torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    if red == "none":
        return rows
    if red == "sum":
        return rows.sum()
    return rows.sum() / valid.sum().clamp_min(1)


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
# (references for llep_dispatch go here)


# ---------------------------------------------------------------------------
# Composed model (demo / end-to-end)
# ---------------------------------------------------------------------------
# (references for the end-to-end model go here)
