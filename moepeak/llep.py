"""PipelinedLLEP: an MoE layer whose dispatch peak grows with neither routing
imbalance nor tokens (DESIGN.md "PipelinedLLEP").

Ops (in order: custom_op, register_fake, register_autograd, then the public API):
  moepeak::llep_dispatch(x [T, H], topk_ids [T, K], topk_weights [T, K],
                         w_gate_up [E_local, H, 2I], w_down [E_local, I, H], ...,
                         w_up=None, b_gate_up=None, b_down=None, activation="swiglu",
                         one_chunk_rows=0, keep_one_chunk=False)
      -> (y [T, H], cache, load [P, E] int64 CPU, send_index [T*K] int64)
      y[t] = sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t]),
      expert_e(v) = act(v @ Wgu_e + bgu_e) @ Wd_e + bd_e; act "swiglu":
      silu(gate) * up with gate/up the column halves; "gpt_oss": Hugging
      Face GPT-OSS's clamped activation on interleaved columns. With w_up,
      w_gate_up is the gate [E_local, H, I] and w_up the up projection.
      Rank r owns experts [r*E_local, (r+1)*E_local). cache, load and
      send_index are kept for backward (load and send_index: the plan's
      inputs, so backward has no host round trip). At P > 1, when no rank
      sends or receives more than one_chunk_rows rows, the step is one chunk
      (moepeak/llep_one_chunk.py: standard EP's dispatch, grouped GEMMs and
      combine); with keep_one_chunk its cache is then [1, R*(2I + H)] (h and
      the R grouped x rows this rank receives: backward recomputes nothing
      and re-sends no x), else [save_slots, C*2I].
  moepeak::llep_dispatch_backward(dy, x, ...) -> (dx, d topk_weights, dW_gate_up, dW_down, dW_up,
                                                  db_gate_up, db_down)  (empty [0] where absent)
  moepeak::llep_combine_(acc, y, idx, w, div): acc[idx // div] += w[idx] * y (fp32 acc)

Process groups cannot be op arguments, so the group travels as a key
(moepeak/core/process_groups.register_group) resolved in this process; a key
whose group was destroyed raises a clear error.

Weights may have any strides: moepeak's own [E, H, 2I] / [E, I, H], or
Hugging Face's gate_up_proj [E, 2I, H] / down_proj [E, H, I] seen through
transpose(1, 2), are used as they are (sliced per expert, never copied
whole); their gradients come back with the weights' shape and strides.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import llep_plan as lp
from . import llep_sched as sched
from .llep_context import ACTIVATIONS
from .llep_experts import lean_ok_static
from .llep_workspace import (capped_save_bytes, effective_chunk_rows, ep_cache_room, one_chunk_ep_rows,
                             one_chunk_fits)
from .core.ext import check_tensor
from .core.process_groups import lookup_group, register_group
from .core.transport_choice import get_transport

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Activation-cache budget (save_budget_mb=None picks it from the group size):
# on one rank it keeps the peak bounded while caching every chunk of short
# inputs; on several ranks no cache beyond the room the single-buffered
# dispatch leaves within the chunk budget's bound (llep_workspace.ep_cache_room),
# so the cache never raises the peak bound there.
DEFAULT_SAVE_BUDGET_MB = 1536


def default_save_budget_mb(P: int) -> int:
    """The activation-cache budget (MiB) save_budget_mb=None picks for P
    ranks beyond the chunk budget's own room (llep_workspace.ep_cache_room at
    P > 1, which the bound b*C*(16H + 7I) already holds)."""
    return DEFAULT_SAVE_BUDGET_MB if P == 1 else 0


# Testing hook (moepeak.testing.llep_transport): a function that wraps the transport
# every llep op call talks to (None: the transport itself).
_TRANSPORT_WRAPPER = {"fn": None}


def set_transport_wrapper(fn):
    """Every llep op call's transport becomes fn(transport) (None: unwrapped);
    returns the previous wrapper. For tests (moepeak.testing.llep_transport)."""
    prev = _TRANSPORT_WRAPPER["fn"]
    _TRANSPORT_WRAPPER["fn"] = fn
    return prev


def _transport(key: str):
    """The transport of the group registered under `key` (None for "": one rank)."""
    group = lookup_group(key)
    if group is None:
        return None
    tr = get_transport(group)
    wrap = _TRANSPORT_WRAPPER["fn"]
    return wrap(tr) if wrap is not None else tr


# ---------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------
def _ctx(x, topk_ids, topk_weights, w_gate_up, w_down, group, chunk_rows, alpha, min_tokens_per_gemm,
         imbalance_threshold, w_up, b_gate_up, b_down, activation, plan_state=None, one_chunk_rows=0,
         keep_one_chunk=False):
    if activation not in ACTIVATIONS:
        raise ValueError(f"moepeak: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not (isinstance(one_chunk_rows, int) and one_chunk_rows >= 0):
        raise ValueError(f"moepeak: one_chunk_rows must be an int >= 0, got {one_chunk_rows!r}")
    return sched.Ctx(x, topk_ids, topk_weights, (w_gate_up, w_down, w_up), (b_gate_up, b_down), activation,
                     _transport(group), chunk_rows, alpha, min_tokens_per_gemm, imbalance_threshold, plan_state,
                     one_chunk_rows, keep_one_chunk)


@torch.library.custom_op("moepeak::llep_dispatch", mutates_args=())
def llep_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, group: str, chunk_rows: int, alpha: float, min_tokens_per_gemm: int,
                  imbalance_threshold: float, save_slots: int = 0, w_up: Optional[torch.Tensor] = None,
                  b_gate_up: Optional[torch.Tensor] = None, b_down: Optional[torch.Tensor] = None,
                  activation: str = "swiglu", one_chunk_rows: int = 0, keep_one_chunk: bool = False
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (y [T, H], activation cache [save_slots, C*2I] (or the kept
    one-chunk cache [1, R*(2I + H)]), load [P, E] int64 CPU, send_index
    [T*K] int64): the last three are for backward."""
    ctx = _ctx(x, topk_ids, topk_weights, w_gate_up, w_down, group, chunk_rows, alpha, min_tokens_per_gemm,
               imbalance_threshold, w_up, b_gate_up, b_down, activation, one_chunk_rows=one_chunk_rows,
               keep_one_chunk=keep_one_chunk)
    keep = keep_one_chunk and ctx.one_chunk
    if keep:
        cache = x.new_empty(1, ctx.recv_rows * (2 * ctx.I + ctx.H))
    else:
        cache = _new_cache(x, w_down, chunk_rows, save_slots)
    return sched.forward(ctx, cache, keep), cache, ctx.load, ctx.send_index


def _new_cache(x, w_down, chunk_rows, save_slots):
    """Activation cache [save_slots, C*2I] (x dtype): fixed at launch by
    the slot count (from the byte budget), never by the routing."""
    if save_slots < 0:
        raise ValueError(f"moepeak: save_slots must be >= 0, got {save_slots}")
    return x.new_empty(save_slots, sched.slot_elems(chunk_rows, w_down.shape[1]))  # w_down: [E, I, H]


@llep_dispatch.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down, group, chunk_rows, alpha, min_tokens_per_gemm,
      imbalance_threshold, save_slots=0, w_up=None, b_gate_up=None, b_down=None, activation="swiglu",
      one_chunk_rows=0, keep_one_chunk=False):
    tr = _transport(group)
    P = tr.world_size if tr is not None else 1
    load = torch.empty(P, w_gate_up.shape[0] * P, dtype=torch.int64, device="cpu")
    send_index = topk_ids.new_empty(topk_ids.numel(), dtype=torch.int64)
    if keep_one_chunk:  # the kept one-chunk cache's size depends on the routing
        fake = torch.library.get_ctx()
        cache = x.new_empty(fake.new_dynamic_size(), fake.new_dynamic_size())
    else:
        cache = _new_cache(x, w_down, chunk_rows, save_slots)
    return torch.empty_like(x), cache, load, send_index


def _dispatch_backward(grad_y, x, topk_ids, topk_weights, w_gate_up, w_down, group, chunk_rows, alpha,
                       min_tokens_per_gemm, imbalance_threshold, cache, w_up, b_gate_up, b_down, activation,
                       load, send_index, one_chunk_rows, keep_one_chunk, overwrite_cache):
    """Both backward ops' body (overwrite_cache: the lean op's in-place dh)."""
    plan_state = None
    if load is not None or send_index is not None:
        if load is None or send_index is None:
            raise ValueError("moepeak: pass both load and send_index (forward's plan state) or neither")
        check_tensor("load", load, dtypes=(torch.int64,), ndim=2, device=torch.device("cpu"), contiguous=True)
        check_tensor("send_index", send_index, dtypes=(torch.int64,), ndim=1, device=x.device, contiguous=True)
        if send_index.numel() != topk_ids.numel():
            raise ValueError(f"moepeak: send_index must have T*K = {topk_ids.numel()} entries, "
                             f"got {send_index.numel()}")
        plan_state = (load, send_index)
    ctx = _ctx(x, topk_ids, topk_weights, w_gate_up, w_down, group, chunk_rows, alpha, min_tokens_per_gemm,
               imbalance_threshold, w_up, b_gate_up, b_down, activation, plan_state, one_chunk_rows)
    if plan_state is not None and tuple(load.shape) != (ctx.P, ctx.E):
        raise ValueError(f"moepeak: load must be [P={ctx.P}, E={ctx.E}], got {tuple(load.shape)}")
    kept = keep_one_chunk and ctx.one_chunk
    if kept:
        want = (1, ctx.recv_rows * (2 * ctx.I + ctx.H))
        if cache is None or tuple(cache.shape) != want:
            raise ValueError(f"moepeak: the kept one-chunk cache must be {list(want)} (forward's), got "
                             f"{None if cache is None else tuple(cache.shape)}")
    if cache is not None:
        check_tensor("cache", cache, dtypes=(x.dtype,), ndim=2, device=x.device, contiguous=True)
        se = sched.slot_elems(chunk_rows, w_down.shape[1])
        if not kept and cache.shape[1] != se:
            raise ValueError(f"moepeak: cache must be [slots, {se}] (chunk_rows*2I), got {tuple(cache.shape)}")
    dx, dtw, dW, dbgu, dbd = sched.backward(ctx, grad_y.contiguous(), cache=cache,
                                           overwrite_cache=overwrite_cache, kept=kept)
    def or_empty(t):
        return t if t is not None else x.new_empty(0)
    return (dx, dtw.view(topk_weights.shape).to(topk_weights.dtype), dW[0], dW[1],
            or_empty(dW[2] if w_up is not None else None), or_empty(dbgu), or_empty(dbd))




def _backward_op(name: str, overwrite_cache: bool, doc: str):
    """One of the two backward ops: the same schema, `overwrite_cache` fixed per op
    (the in-place one declares the cache mutated)."""
    def op(grad_y: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
           w_gate_up: torch.Tensor, w_down: torch.Tensor, group: str, chunk_rows: int, alpha: float,
           min_tokens_per_gemm: int, imbalance_threshold: float, cache: Optional[torch.Tensor] = None,
           w_up: Optional[torch.Tensor] = None, b_gate_up: Optional[torch.Tensor] = None,
           b_down: Optional[torch.Tensor] = None, activation: str = "swiglu",
           load: Optional[torch.Tensor] = None, send_index: Optional[torch.Tensor] = None,
           one_chunk_rows: int = 0, keep_one_chunk: bool = False
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                      torch.Tensor]:
        return _dispatch_backward(grad_y, x, topk_ids, topk_weights, w_gate_up, w_down, group, chunk_rows, alpha,
                                  min_tokens_per_gemm, imbalance_threshold, cache, w_up, b_gate_up, b_down,
                                  activation, load, send_index, one_chunk_rows, keep_one_chunk, overwrite_cache)
    op.__name__ = op.__qualname__ = name.split("::")[1]
    op.__doc__ = doc
    return torch.library.custom_op(name, op, mutates_args=("cache",) if overwrite_cache else ())


llep_dispatch_backward = _backward_op(
    "moepeak::llep_dispatch_backward", False,
    """-> (dx, d topk_weights, dW_gate_up, dW_down, dW_up, db_gate_up, db_down);
    the last three are empty [0] tensors where w_up / the biases are absent.
    load and send_index: forward's (llep_dispatch's 3rd and 4th outputs);
    without them backward counts and routes again. cache: forward's
    activation cache (only read). one_chunk_rows, keep_one_chunk:
    forward's.""")

llep_dispatch_backward_lean_ = _backward_op(
    "moepeak::llep_dispatch_backward_lean_", True,
    """llep_dispatch_backward, except that on the one-chunk paths
    (llep_sched.lean_one_chunk at P = 1; the kept one-chunk step at P > 1,
    llep_one_chunk.backward_ep) dh is written over the cached h, so that
    backward holds no second [R, 2I] (llep_workspace.one_chunk_peak_bytes):
    the cache serves one backward (a second one over a retained graph raises
    autograd's in-place modification error). Eager autograd uses it; traced
    graphs (torch.compile) use llep_dispatch_backward: the same values.""")


@llep_dispatch_backward.register_fake
def _dispatch_backward_fake(grad_y, x, topk_ids, topk_weights, w_gate_up, w_down, group, chunk_rows, alpha,
                            min_tokens_per_gemm, imbalance_threshold, cache=None, w_up=None, b_gate_up=None,
                            b_down=None, activation="swiglu", load=None, send_index=None, one_chunk_rows=0,
                            keep_one_chunk=False):
    def like(t):
        return torch.empty_like(t) if t is not None else x.new_empty(0)
    return (torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w_gate_up),
            torch.empty_like(w_down), like(w_up), like(b_gate_up), like(b_down))


llep_dispatch_backward_lean_.register_fake(_dispatch_backward_fake)


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w_gate_up, w_down = inputs[:5]
    w_up, b_gate_up, b_down = inputs[11:14]
    ctx.save_for_backward(x, topk_ids, topk_weights, w_gate_up, w_down, output[1], w_up, b_gate_up, b_down,
                          output[2], output[3])
    ctx.args = inputs[5:10]
    ctx.activation = inputs[14]
    ctx.one_chunk = inputs[15:17]  # (one_chunk_rows, keep_one_chunk)
    ctx.mark_non_differentiable(*output[1:])
    # No zero-filled gradient for the cache output (it would cost the whole
    # cache budget again in backward).
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_y, *grad_rest):
    if grad_y is None:  # y did not reach the loss: nothing flows back
        return (None,) * 17
    x, topk_ids, topk_weights, w_gate_up, w_down, cache, w_up, b_gate_up, b_down, load, send_index = \
        ctx.saved_tensors
    # the lean op overwrites the cache: eager only (a traced graph keeps it read-only)
    # (no test of the cache's size while tracing: the kept one-chunk cache's is data-dependent)
    lean = not torch.compiler.is_compiling() and type(grad_y) is torch.Tensor and cache.shape[0] > 0
    dx, dtw, dwgu, dwd, dwu, dbgu, dbd = (llep_dispatch_backward_lean_ if lean else llep_dispatch_backward)(
        grad_y, x, topk_ids, topk_weights, w_gate_up, w_down, *ctx.args, cache,
        w_up, b_gate_up, b_down, ctx.activation, load, send_index, *ctx.one_chunk)
    return (dx, None, dtw, dwgu, dwd, None, None, None, None, None, None, dwu if w_up is not None else None,
            dbgu if b_gate_up is not None else None, dbd if b_down is not None else None, None, None, None)


llep_dispatch.register_autograd(_backward, setup_context=_setup_context)




@torch.library.custom_op("moepeak::llep_combine_", mutates_args=("acc",))
def llep_combine_(acc: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, w: Optional[torch.Tensor],
                  div: int) -> None:
    """acc [T, H] fp32 += w[idx[i]] * y[i] at row idx[i] // div (w None: 1)."""
    check_tensor("acc", acc, dtypes=(torch.float32,), ndim=2, contiguous=True)
    check_tensor("y", y, dtypes=_FLOATS, ndim=2, device=acc.device, contiguous=True)
    check_tensor("idx", idx, dtypes=(torch.int64,), ndim=1, device=acc.device, contiguous=True)
    if y.shape != (idx.numel(), acc.shape[1]):
        raise ValueError(f"moepeak: y must be [{idx.numel()}, {acc.shape[1]}], got {tuple(y.shape)}")
    if div < 1:
        raise ValueError(f"moepeak: div must be >= 1, got {div}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) // div >= acc.shape[0]):
        raise ValueError(f"moepeak: idx // div must lie in [0, {acc.shape[0]})")
    if w is not None:
        check_tensor("w", w, dtypes=(torch.float32,), ndim=1, device=acc.device, contiguous=True)
        if idx.numel() and int(idx.max()) >= w.numel():
            raise ValueError(f"moepeak: idx must index w (length {w.numel()})")
    lp.combine_rows(acc, y, idx, w, div)


@llep_combine_.register_fake
def _(acc, y, idx, w, div):
    return None


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------
def _validate(x, topk_ids, topk_weights, w_gate_up, w_down, w_up, b_gate_up, b_down, activation, P, chunk_rows,
              alpha, m, lam):
    check_tensor("x", x, dtypes=_FLOATS)
    if activation not in ACTIVATIONS:
        raise ValueError(f"moepeak: activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_tensor("w_down", w_down, dtypes=(x.dtype,), ndim=3, device=x.device)
    El, I, H = w_down.shape  # the experts' hidden size H: x's last dim must be it
    if x.dim() < 1 or x.shape[-1] != H:
        raise ValueError(f"moepeak: x must be [..., H] with H = {H} (w_down [E_local, I, H] is "
                         f"{tuple(w_down.shape)}), got {tuple(x.shape)}")
    if I < 1:
        raise ValueError(f"moepeak: w_down must be [E_local, I, H] with I >= 1, got {tuple(w_down.shape)}")
    T = x.numel() // H if H else 0
    if w_up is None:
        check_tensor("w_gate_up", w_gate_up, dtypes=(x.dtype,), ndim=3, device=x.device)
        if tuple(w_gate_up.shape) != (El, H, 2 * I):
            raise ValueError(f"moepeak: w_gate_up must be [E_local={El}, H={H}, 2*I={2 * I}] to match w_down "
                             f"{tuple(w_down.shape)}, got {tuple(w_gate_up.shape)}")
    else:
        for name, w in (("w_gate", w_gate_up), ("w_up", w_up)):
            check_tensor(name, w, dtypes=(x.dtype,), ndim=3, device=x.device)
            if tuple(w.shape) != (El, H, I):
                raise ValueError(f"moepeak: {name} must be [E_local={El}, H={H}, I={I}] to match w_down "
                                 f"{tuple(w_down.shape)}, got {tuple(w.shape)}")
    if El < 1:
        raise ValueError("moepeak: the weights must hold at least one expert")
    if (b_gate_up is None) != (b_down is None):
        raise ValueError("moepeak: pass both b_gate_up and b_down, or neither")
    if b_gate_up is not None:
        for name, b, n in (("b_gate_up", b_gate_up, 2 * I), ("b_down", b_down, H)):
            check_tensor(name, b, dtypes=(x.dtype,), ndim=2, device=x.device)
            if tuple(b.shape) != (El, n):
                raise ValueError(f"moepeak: {name} must be [E_local={El}, {n}], got {tuple(b.shape)}")
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int64, torch.int32), ndim=2, device=x.device)
    check_tensor("topk_weights", topk_weights, dtypes=_FLOATS, ndim=2, device=x.device)
    E = El * P
    if topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"moepeak: topk_ids and topk_weights must both be [T={T}, K], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    K = topk_ids.shape[1]
    if K < 1 or K > E:
        raise ValueError(f"moepeak: top_k ({K}) must be in [1, num_experts={E}]")
    if not isinstance(chunk_rows, int) or chunk_rows < P:
        raise ValueError(f"moepeak: chunk_rows must be an int >= the number of ranks ({P}), got {chunk_rows!r}")
    if not alpha >= 1.0:
        raise ValueError(f"moepeak: alpha (capacity factor) must be >= 1.0, got {alpha}")
    if not (isinstance(m, int) and m >= 0):
        raise ValueError(f"moepeak: min_tokens_per_gemm must be an int >= 0, got {m!r}")
    if not lam >= 1.0:
        raise ValueError(f"moepeak: imbalance_threshold must be >= 1.0, got {lam}")
    return T, H


def llep_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up, w_down: torch.Tensor,
             *, b_gate_up: Optional[torch.Tensor] = None, b_down: Optional[torch.Tensor] = None,
             activation: str = "swiglu", group=None, chunk_rows: Optional[int] = None, alpha: float = 1.0,
             min_tokens_per_gemm: int = 1024, imbalance_threshold: float = 1.3,
             save_budget_mb: Optional[int] = None) -> torch.Tensor:
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
    alpha, min_tokens_per_gemm, imbalance_threshold: the LLEP plan
    (csrc/llep_plan.c): nothing moves while the max/mean rank load is below
    imbalance_threshold; otherwise each rank has room for alpha x the mean
    load, keeps its smallest experts first, and the residuals of its largest
    go to the least-loaded ranks in shares of at least min_tokens_per_gemm
    (a smaller residual stays home), so only hot experts' weights (and
    biases) travel.
    chunk_rows: rows per destination per chunk (None: 32768 on one rank,
    16384 on several; llep_plan.default_chunk_rows). On one rank it is
    lowered to T*K when that is smaller (one chunk, buffers no larger than
    the rows); with chunk_rows=None it is also raised to T*K when one chunk
    with its whole h cached peaks no higher than permute + grouped GEMM and
    stays within the chunked working-set bound
    (llep_workspace.one_chunk_fits; swiglu, fused gate/up, no biases, not
    fp16): backward then recomputes nothing. On several ranks the step runs
    as one chunk (standard EP's one dispatch, grouped GEMMs and combine,
    moepeak/llep_one_chunk.py) when no rank sends or receives more rows than
    fit the chunked working-set bound at chunk_rows
    (llep_workspace.one_chunk_ep_rows) and, with an explicit chunk_rows,
    than chunk_rows itself (the budget covers the step's rows).
    save_budget_mb: bytes (MiB) fixed at launch for an activation cache: the
    first chunks whose [C, 2I] forward intermediates fit are kept for
    backward, which recomputes only the others (0: recompute all; no cache
    when no gradient is needed; None: 1536 on one rank; on several the
    room the chunk budget's bound leaves, llep_workspace.ep_cache_room, see
    DEFAULT_SAVE_BUDGET_MB). At P > 1 the one-chunk step keeps h and its
    grouped x rows whole for backward unless save_budget_mb=0 (counted
    within the bound, llep_workspace.one_chunk_ep_rows). The cache is also capped so that it and the
    backward working set together stay within what permute + grouped GEMM
    holds at its peak for the same T (llep_workspace.capped_save_bytes). Results
    are identical either way.
    The cache lives from this call's forward to its backward: a model keeps
    one per MoE layer whose backward is pending (none under activation
    checkpointing's no-grad forward), so budget it per resident layer."""
    tr = get_transport(group)
    P = tr.world_size if tr is not None else 1
    C = lp.default_chunk_rows(P) if chunk_rows is None else chunk_rows
    keep_allowed = save_budget_mb != 0  # None or a budget: the P > 1 one-chunk step keeps h and grouped x
    default_budget = save_budget_mb is None
    if save_budget_mb is None:
        save_budget_mb = default_save_budget_mb(P)
    w_up = None
    if isinstance(w_gate_up, (tuple, list)):
        if len(w_gate_up) != 2:
            raise ValueError(f"moepeak: w_gate_up must be a tensor or a (w_gate, w_up) pair, got "
                             f"{len(w_gate_up)} tensors")
        w_gate_up, w_up = w_gate_up
    T, H = _validate(x, topk_ids, topk_weights, w_gate_up, w_down, w_up, b_gate_up, b_down, activation, P, C,
                     alpha, min_tokens_per_gemm, imbalance_threshold)
    if not (isinstance(save_budget_mb, int) and save_budget_mb >= 0):
        raise ValueError(f"moepeak: save_budget_mb must be an int >= 0, got {save_budget_mb!r}")
    K, I = topk_ids.shape[1], w_down.shape[1]
    C = effective_chunk_rows(C, T, K, P)  # P = 1: one chunk when T*K fits, buffers no larger than the rows
    params = (x, topk_weights, w_gate_up, w_down, w_up, b_gate_up, b_down)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in params)
    b = x.element_size()
    # P > 1, save_budget_mb=None: the cache room within the chunk budget's bound
    room = ep_cache_room(int(C), H, b) if P > 1 and default_budget else 0
    lean = (grad and P == 1 and (chunk_rows is None or T * K <= C) and activation == "swiglu" and w_up is None
            and b_gate_up is None and x.dtype != torch.float16
            and one_chunk_fits(T, K, w_down.shape[0], H, I, int(C), b, save_budget_mb << 20))
    if lean:  # one chunk, h cached whole, backward's buffers held only while used
        C, slots = T * K, 1
    else:
        budget = capped_save_bytes((save_budget_mb << 20) + room, T, K, int(C), H, I, P, b,
                                   activation=activation, bias=b_gate_up is not None, split=w_up is not None)
        slots = sched.cache_slots(budget, T, K, int(C), I, P, b) if grad else 0
    one_rows, keep = 0, False
    if P > 1:  # from shapes, options and the arguments only: the same on every rank
        keep = grad and keep_allowed
        options = dict(activation=activation, bias=b_gate_up is not None, split=w_up is not None)
        one_rows = one_chunk_ep_rows(int(C), H, I, P, b, (save_budget_mb << 20) + room, keep=keep, grad=grad,
                                     lean=lean_ok_static(activation, w_up, b_gate_up, x.dtype)
                                     and not torch.compiler.is_compiling(),
                                     grouped=x.dtype == torch.bfloat16, **options)
        if chunk_rows is not None:  # an explicit budget: one chunk only where it covers the step's rows
            one_rows = min(one_rows, int(C))
    shape = x.shape
    y = llep_dispatch(x.reshape(T, H).contiguous(), topk_ids.contiguous(), topk_weights.contiguous(),
                      w_gate_up, w_down, register_group(group), int(C), float(alpha), int(min_tokens_per_gemm),
                      float(imbalance_threshold), int(slots), w_up, b_gate_up, b_down, activation, int(one_rows),
                      bool(keep))[0]
    return y.view(shape)


def dense_moe_reference(x, topk_ids, topk_weights, w_gate_up, w_down):
    """Plain PyTorch: a loop over all experts (full weights [E, H, 2I], [E, I, H])."""
    T, H = x.reshape(-1, x.shape[-1]).shape
    xf = x.reshape(T, H)
    I = w_down.shape[1]
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in range(w_gate_up.shape[0]):
        t, k = (topk_ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        hh = xf[t] @ w_gate_up[e]
        o = (F.silu(hh[:, :I]) * hh[:, I:]) @ w_down[e]
        y = y.index_add(0, t, topk_weights[t, k].float().unsqueeze(1) * o.float())
    return y.to(x.dtype).view(x.shape)


class PipelinedLLEPMoE(nn.Module):
    """Router + SwiGLU experts, experts split over the ranks of `group`.

    Parameters: router = nn.Linear(H, E, bias=False) (replicated; its logits
    are computed in fp32: F.linear(x.float(), router.weight.float())),
    w_gate_up [E_local, H, 2I] (columns [:I] gate, [I:] up; act =
    silu(gate) * up), w_down [E_local, I, H]; E_local = E / P and rank r owns
    experts [r*E_local, (r+1)*E_local). forward(x [..., H]) returns
    (y [..., H], router_logits [N, E] fp32). top-k is taken on softmax
    probabilities, renormalised to sum 1 when norm_topk_prob."""

    def __init__(self, hidden_size, intermediate_size, num_experts, top_k, *, group=None, chunk_rows=None,
                 alpha=1.0, min_tokens_per_gemm=1024, imbalance_threshold=1.3, norm_topk_prob=True,
                 save_budget_mb=None, device=None, dtype=None):
        super().__init__()
        P = get_transport(group).world_size if group is not None else 1
        if num_experts % P:
            raise ValueError(f"moepeak: num_experts ({num_experts}) must be a multiple of the group size ({P})")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moepeak: top_k ({top_k}) must be in [1, num_experts={num_experts}]")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.group, self.world = num_experts, top_k, group, P
        self.num_local_experts = num_experts // P
        self.chunk_rows, self.alpha, self.min_tokens_per_gemm = chunk_rows, alpha, min_tokens_per_gemm
        self.imbalance_threshold, self.norm_topk_prob = imbalance_threshold, norm_topk_prob
        self.save_budget_mb = save_budget_mb
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
        y = llep_moe(x2, ti, tw, self.w_gate_up, self.w_down, group=self.group, chunk_rows=self.chunk_rows,
                     alpha=self.alpha, min_tokens_per_gemm=self.min_tokens_per_gemm,
                     imbalance_threshold=self.imbalance_threshold, save_budget_mb=self.save_budget_mb)
        return y.view(x.shape), logits

    def reference_forward(self, x):
        """The same block in plain PyTorch (a loop over experts); one rank only."""
        if self.world != 1:
            raise RuntimeError("moepeak: reference_forward needs all experts on one rank (group of size 1)")
        x2 = self._tokens(x)
        logits, ti, tw = self.route(x2)
        return dense_moe_reference(x2, ti, tw, self.w_gate_up, self.w_down).view(x.shape), logits


__all__ = ["PipelinedLLEPMoE", "llep_moe", "llep_dispatch", "llep_dispatch_backward", "llep_dispatch_backward_lean_",
           "llep_combine_", "dense_moe_reference", "default_save_budget_mb", "set_transport_wrapper"]
