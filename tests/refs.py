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
# (references for sco_offload go here)


# ---------------------------------------------------------------------------
# PipelinedLLEP (MoE dispatch)
# ---------------------------------------------------------------------------
# (references for llep_dispatch go here)


# ---------------------------------------------------------------------------
# Composed model (demo / end-to-end)
# ---------------------------------------------------------------------------
# (references for the end-to-end model go here)
