"""PipelinedLLEP's public API (exported by moepeak.llep): llep_moe, the experts of an MoE
layer on this rank's weights, PipelinedLLEP-scheduled, and PipelinedLLEPMoE, router +
SwiGLU experts as an nn.Module. Both take the schedule options as an LLEPOptions (or its
fields as keywords; moepeak/llep/options.py), validate the tensors, size the launch
(moepeak/llep/launch.py, from shapes and options alone) and call the op
moepeak::llep_dispatch (moepeak/llep/ops.py). An LLEPStats given as `stats` receives
each call's forward and backward statistics (moepeak/llep/stats.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.ext import check_tensor
from ..core.process_groups import register_group
from ..core.transport_choice import get_transport
from .context import ACTIVATIONS
from .launch import Shapes, size_launch
from .ops import FLOAT_DTYPES, llep_dispatch
from .options import LLEPOptions
from .stats import LLEPStats, stats_key


def _gate_up_pair(w_gate_up):
    """(w_gate_up, None) for a fused tensor, (w_gate, w_up) for the pair."""
    if isinstance(w_gate_up, (tuple, list)):
        if len(w_gate_up) != 2:
            raise ValueError(f"moepeak: w_gate_up must be a tensor or a (w_gate, w_up) pair, got "
                             f"{len(w_gate_up)} tensors")
        return w_gate_up[0], w_gate_up[1]
    return w_gate_up, None


def _gate_up_weights(w_gate_up, w_up, I):
    """(name, tensor, its last dim's name, its size) of the gate/up weights: the fused
    w_gate_up [E_local, H, 2I], or the pair w_gate, w_up [E_local, H, I]."""
    if w_up is None:
        return (("w_gate_up", w_gate_up, "2*I", 2 * I),)
    return (("w_gate", w_gate_up, "I", I), ("w_up", w_up, "I", I))


def _validate_biases(x, b_gate_up, b_down, El, I, H):
    """Both biases or neither; b_gate_up [E_local, 2I], b_down [E_local, H]."""
    if (b_gate_up is None) != (b_down is None):
        raise ValueError("moepeak: pass both b_gate_up and b_down, or neither")
    if b_gate_up is None:
        return
    for name, b, n in (("b_gate_up", b_gate_up, 2 * I), ("b_down", b_down, H)):
        check_tensor(name, b, dtypes=(x.dtype,), ndim=2, device=x.device)
        if tuple(b.shape) != (El, n):
            raise ValueError(f"moepeak: {name} must be [E_local={El}, {n}], got {tuple(b.shape)}")


def _validate_weights(x, w_gate_up, w_down, w_up, b_gate_up, b_down):
    """Checks the experts' tensors against w_down [E_local, I, H]; returns (E_local, I, H)."""
    check_tensor("w_down", w_down, dtypes=(x.dtype,), ndim=3, device=x.device)
    El, I, H = w_down.shape
    if I < 1:
        raise ValueError(f"moepeak: w_down must be [E_local, I, H] with I >= 1, got {tuple(w_down.shape)}")
    for name, w, last, n in _gate_up_weights(w_gate_up, w_up, I):
        check_tensor(name, w, dtypes=(x.dtype,), ndim=3, device=x.device)
        if tuple(w.shape) != (El, H, n):
            raise ValueError(f"moepeak: {name} must be [E_local={El}, H={H}, {last}={n}] to match w_down "
                             f"{tuple(w_down.shape)}, got {tuple(w.shape)}")
    if El < 1:
        raise ValueError("moepeak: the weights must hold at least one expert")
    _validate_biases(x, b_gate_up, b_down, El, I, H)
    return El, I, H


def _validate(x, topk_ids, topk_weights, w_gate_up, w_down, w_up, b_gate_up, b_down, activation, P):
    """Checks every tensor and the activation; returns (T, K, E_local, I, H)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if activation not in ACTIVATIONS:
        raise ValueError(f"moepeak: activation must be one of {ACTIVATIONS}, got {activation!r}")
    El, I, H = _validate_weights(x, w_gate_up, w_down, w_up, b_gate_up, b_down)
    if x.dim() < 1 or x.shape[-1] != H:  # the experts' hidden size
        raise ValueError(f"moepeak: x must be [..., H] with H = {H} (w_down [E_local, I, H] is "
                         f"{tuple(w_down.shape)}), got {tuple(x.shape)}")
    T = x.numel() // H if H else 0
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int64, torch.int32), ndim=2, device=x.device)
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_DTYPES, ndim=2, device=x.device)
    if topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"moepeak: topk_ids and topk_weights must both be [T={T}, K], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    K = topk_ids.shape[1]
    if K < 1 or K > El * P:
        raise ValueError(f"moepeak: top_k ({K}) must be in [1, num_experts={El * P}]")
    return T, K, El, I, H


def llep_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up, w_down: torch.Tensor,
             *, b_gate_up: Optional[torch.Tensor] = None, b_down: Optional[torch.Tensor] = None,
             activation: str = "swiglu", group=None, options: Optional[LLEPOptions] = None,
             chunk_rows: Optional[int] = None, alpha: Optional[float] = None,
             min_tokens_per_gemm: Optional[int] = None, imbalance_threshold: Optional[float] = None,
             save_budget_mb: Optional[int] = None, grouped_mm: Optional[str] = None,
             stats: Optional[LLEPStats] = None) -> torch.Tensor:
    """The MoE experts on this rank's local weights, PipelinedLLEP-scheduled.

    x [..., H]; topk_ids, topk_weights [T, K] (T = x.numel() // H; ids are
    global expert ids in [0, E_local * P)); w_gate_up [E_local, H, 2I], or
    the pair (w_gate, w_up), each [E_local, H, I] (gate and up kept apart,
    e.g. torchtitan's w1/w3 seen through transpose(1, 2): no fused copy);
    w_down [E_local, I, H]. Returns y shaped like x:
        h = x W_gate_up (+ b_gate_up[e]);  a = act(gate, up);
        y[t] = sum_k topk_weights[t, k] * (a W_down + b_down[e]), e = ids[t, k].
    activation: "swiglu": a = silu(gate) * up with gate = h[:, :I], up =
    h[:, I:]; "gpt_oss" (Hugging Face GPT-OSS): gate = h[:, 0::2], up =
    h[:, 1::2] (interleaved columns of a fused w_gate_up; the pair's own
    outputs when split), a = (up.clamp(-7, 7) + 1) * g * sigmoid(1.702 g),
    g = gate.clamp(max=7). b_gate_up [E_local, 2I] (columns as h's) and
    b_down [E_local, H]: optional, both or neither; added per row by the
    row's expert; their gradients are summed in fp32.
    The weights and biases may have any strides and are never copied whole:
    Hugging Face's gate_up_proj [E, 2I, H] and down_proj [E, H, I] are
    passed as gate_up_proj.transpose(1, 2) and down_proj.transpose(1, 2);
    gradients have the parameters' strides.
    Every rank of `group` must call it (with its own tokens; T may differ).
    Differentiable in x, topk_weights, the weights and the biases.
    options: an LLEPOptions (None: the defaults); the keywords chunk_rows,
    alpha, min_tokens_per_gemm, imbalance_threshold, save_budget_mb and
    grouped_mm set its fields (None: the options' value):
    alpha, min_tokens_per_gemm, imbalance_threshold: the LLEP plan
    (csrc/llep_plan.c): nothing moves while the max/mean rank load is below
    imbalance_threshold; otherwise each rank has room for alpha x the mean
    load, keeps its smallest experts first, and the residuals of its largest
    go to the least-loaded ranks in shares of at least min_tokens_per_gemm
    (a smaller residual stays home), so only hot experts' weights (and
    biases) travel.
    chunk_rows: rows per destination per chunk (None: 32768 on one rank,
    16384 on several; sizes.default_chunk_rows). On one rank it is
    lowered to T*K when that is smaller (one chunk, buffers no larger than
    the rows); with chunk_rows=None it is also raised to T*K when one chunk
    with its whole h cached peaks no higher than permute + grouped GEMM
    (sizes.one_chunk_fits; swiglu, no biases, not fp16): backward then
    recomputes nothing. On several ranks the step runs
    as one chunk (standard EP's one dispatch, grouped GEMMs and combine,
    moepeak/llep/one_chunk.py) when no rank sends or receives more rows than
    fit the chunked working-set bound at chunk_rows
    (sizes.one_chunk_ep_rows) and, with an explicit chunk_rows,
    than chunk_rows itself (the budget covers the step's rows).
    save_budget_mb: bytes (MiB) fixed at launch for an activation cache: the
    first chunks whose [C, 2I] forward intermediates fit are kept for
    backward, which recomputes only the others (0: recompute all; no cache
    when no gradient is needed; None: sizes.default_save_budget_mb: on one
    rank no budget of its own, so the cache takes what keeps the layer's
    peak at or under permute + grouped GEMM's for the same T). At P > 1
    the one-chunk step keeps h and its grouped x rows whole for backward
    unless save_budget_mb=0 (counted within the bound,
    sizes.one_chunk_ep_rows). The cache is also capped so that it and the
    backward working set together stay within what permute + grouped GEMM
    holds at its peak for the same T (sizes.capped_save_bytes). Results
    are identical either way.
    grouped_mm: "auto" | "on" | "off", torch._grouped_mm for the expert
    GEMMs (options.GROUPED_MM_MODES).
    The cache lives from this call's forward to its backward: a model keeps
    one per MoE layer whose backward is pending (none under activation
    checkpointing's no-grad forward), so budget it per resident layer.
    stats: an LLEPStats that receives this call's forward and backward
    statistics (moepeak/llep/stats.py)."""
    options = LLEPOptions.resolve(options, chunk_rows=chunk_rows, alpha=alpha,
                                  min_tokens_per_gemm=min_tokens_per_gemm, imbalance_threshold=imbalance_threshold,
                                  save_budget_mb=save_budget_mb, grouped_mm=grouped_mm)
    key = stats_key(stats)
    tr = get_transport(group)
    P = tr.world_size if tr is not None else 1
    w_gate_up, w_up = _gate_up_pair(w_gate_up)
    T, K, El, I, H = _validate(x, topk_ids, topk_weights, w_gate_up, w_down, w_up, b_gate_up, b_down, activation, P)
    params = (x, topk_weights, w_gate_up, w_down, w_up, b_gate_up, b_down)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in params)
    launch = size_launch(options, Shapes(P=P, T=T, K=K, E_local=El, H=H, I=I, dtype=x.dtype, grad=grad,
                                         activation=activation, split=w_up is not None, bias=b_gate_up is not None))
    y = llep_dispatch(x.reshape(T, H).contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), w_gate_up,
                      w_down, register_group(group), w_up=w_up, b_gate_up=b_gate_up, b_down=b_down,
                      activation=activation, stats=key, **launch.op_kwargs())[0]
    return y.view(x.shape)


class PipelinedLLEPMoE(nn.Module):
    """Router + SwiGLU experts, experts split over the ranks of `group`.

    Parameters: router = nn.Linear(H, E, bias=False) (replicated; its logits
    are computed in fp32: F.linear(x.float(), router.weight.float())),
    w_gate_up [E_local, H, 2I] (columns [:I] gate, [I:] up; act =
    silu(gate) * up), w_down [E_local, I, H]; E_local = E / P and rank r owns
    experts [r*E_local, (r+1)*E_local). forward(x [..., H]) returns
    (y [..., H], router_logits [N, E] fp32). top-k is taken on softmax
    probabilities, renormalised to sum 1 when norm_topk_prob. options (or
    its fields as keywords): the schedule's LLEPOptions, kept as
    self.options; self.last_stats (an LLEPStats) holds the last forward's
    and backward's statistics."""

    def __init__(self, hidden_size, intermediate_size, num_experts, top_k, *, group=None,
                 options: Optional[LLEPOptions] = None, chunk_rows=None, alpha=None, min_tokens_per_gemm=None,
                 imbalance_threshold=None, save_budget_mb=None, grouped_mm=None, norm_topk_prob=True, device=None,
                 dtype=None):
        super().__init__()
        P = get_transport(group).world_size if group is not None else 1
        if num_experts % P:
            raise ValueError(f"moepeak: num_experts ({num_experts}) must be a multiple of the group size ({P})")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moepeak: top_k ({top_k}) must be in [1, num_experts={num_experts}]")
        self.options = LLEPOptions.resolve(options, chunk_rows=chunk_rows, alpha=alpha,
                                           min_tokens_per_gemm=min_tokens_per_gemm,
                                           imbalance_threshold=imbalance_threshold, save_budget_mb=save_budget_mb,
                                           grouped_mm=grouped_mm)
        self.last_stats = LLEPStats()  # the last forward's and backward's statistics
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.group, self.world = num_experts, top_k, group, P
        self.num_local_experts = num_experts // P
        self.norm_topk_prob = norm_topk_prob
        kw = dict(device=device, dtype=dtype)
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **kw)
        self.w_gate_up = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, 2 * intermediate_size, **kw))
        self.w_down = nn.Parameter(torch.empty(self.num_local_experts, intermediate_size, hidden_size, **kw))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.w_gate_up, std=self.hidden_size ** -0.5)
        nn.init.normal_(self.w_down, std=self.intermediate_size ** -0.5)
        self.router.reset_parameters()

    def route(self, x2):
        # fp32 logits even under autocast (which would run F.linear in bf16)
        with torch.autocast(x2.device.type, enabled=False):
            logits = F.linear(x2.float(), self.router.weight.float())
        probs = logits.softmax(-1)
        tw, ti = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            tw = tw / tw.sum(-1, keepdim=True)
        return logits, ti, tw

    def _tokens(self, x):
        """x [..., hidden_size] as [N, hidden_size] (a reshape of another width would mix tokens)."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"moepeak: PipelinedLLEPMoE(hidden_size={self.hidden_size}) takes x "
                             f"[..., {self.hidden_size}], got {got}")
        return x.reshape(-1, self.hidden_size)

    def forward(self, x):
        x2 = self._tokens(x)
        logits, ti, tw = self.route(x2)
        y = llep_moe(x2, ti, tw, self.w_gate_up, self.w_down, group=self.group, options=self.options,
                     stats=self.last_stats)
        return y.view(x.shape), logits


__all__ = ["llep_moe", "PipelinedLLEPMoE"]
