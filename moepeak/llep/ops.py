"""PipelinedLLEP: an MoE layer whose dispatch peak grows with neither routing
imbalance nor tokens (docs/design.md "PipelinedLLEP").

Ops (in order: custom_op, register_fake, register_autograd; the public API over them,
llep_moe and PipelinedLLEPMoE, is moepeak/llep/moe.py):
  moepeak::llep_dispatch(x [T, H], topk_ids [T, K], topk_weights [T, K],
                         w_gate_up [E_local, H, 2I], w_down [E_local, I, H], ...,
                         w_up=None, b_gate_up=None, b_down=None, activation="swiglu",
                         one_chunk_rows=0, keep_one_chunk=False, grouped_mm="auto", stats="")
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
      (moepeak/llep/one_chunk.py: standard EP's dispatch, grouped GEMMs and
      combine); with keep_one_chunk its cache is then [1, R*(2I + H)] (h and
      the R grouped x rows this rank receives: backward recomputes nothing
      and re-sends no x), else [save_slots, C*2I].
  moepeak::llep_dispatch_backward(dy, x, ...) -> (dx, d topk_weights, dW_gate_up, dW_down, dW_up,
                                                  db_gate_up, db_down)  (empty [0] where absent)
  moepeak::llep_combine_(acc, y, idx, w, div): acc[idx // div] += w[idx] * y (fp32 acc)

The schedule arguments (chunk_rows, alpha, min_tokens_per_gemm,
imbalance_threshold, grouped_mm) are LLEPOptions' fields (moepeak/llep/options.py;
chunk_rows the launch's C, an int): each op call rebuilds the options from them,
checked, and the per-call context (context.Ctx) takes that object.

Process groups cannot be op arguments, so the group travels as a key
(moepeak/core/process_groups.register_group) resolved in this process; a key
whose group was destroyed raises a clear error. The same for `stats`: the key
of an LLEPStats (moepeak/llep/stats.py; "" for none) that receives the call's
record, forward's from llep_dispatch, backward's from the backward ops.

Weights may have any strides: moepeak's own [E, H, 2I] / [E, I, H], or
Hugging Face's gate_up_proj [E, 2I, H] / down_proj [E, H, I] seen through
transpose(1, 2), are used as they are (sliced per expert, never copied
whole); their gradients come back with the weights' shape and strides.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..core.ext import check_tensor
from ..core.process_groups import lookup_group
from ..core.transport_choice import get_transport
from . import gemm
from . import plan as lp
from . import sched
from .context import ACTIVATIONS, Ctx
from .options import LLEPOptions
from .sizes import slot_elems
from .stats import publish

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x, y and weights


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
         imbalance_threshold, w_up, b_gate_up, b_down, activation, grouped_mm, plan_state=None, one_chunk_rows=0,
         keep_one_chunk=False):
    if activation not in ACTIVATIONS:
        raise ValueError(f"moepeak: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not (isinstance(one_chunk_rows, int) and one_chunk_rows >= 0):
        raise ValueError(f"moepeak: one_chunk_rows must be an int >= 0, got {one_chunk_rows!r}")
    options = LLEPOptions(chunk_rows=chunk_rows, alpha=alpha, min_tokens_per_gemm=min_tokens_per_gemm,
                          imbalance_threshold=imbalance_threshold, grouped_mm=grouped_mm)
    gemm.check_grouped_request(x, (w_gate_up, w_down, w_up), x.shape[1], w_down.shape[1], grouped_mm)
    return Ctx(x, topk_ids, topk_weights, (w_gate_up, w_down, w_up), (b_gate_up, b_down), activation,
                     _transport(group), options, plan_state, one_chunk_rows, keep_one_chunk)


@torch.library.custom_op("moepeak::llep_dispatch", mutates_args=())
def llep_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, group: str, chunk_rows: int, alpha: float, min_tokens_per_gemm: int,
                  imbalance_threshold: float, save_slots: int = 0, w_up: Optional[torch.Tensor] = None,
                  b_gate_up: Optional[torch.Tensor] = None, b_down: Optional[torch.Tensor] = None,
                  activation: str = "swiglu", one_chunk_rows: int = 0, keep_one_chunk: bool = False,
                  grouped_mm: str = "auto", stats: str = ""
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (y [T, H], activation cache [save_slots, C*2I] (or the kept
    one-chunk cache [1, R*(2I + H)]), load [P, E] int64 CPU, send_index
    [T*K] int64): the last three are for backward."""
    ctx = _ctx(x, topk_ids, topk_weights, w_gate_up, w_down, group, chunk_rows, alpha, min_tokens_per_gemm,
               imbalance_threshold, w_up, b_gate_up, b_down, activation, grouped_mm, one_chunk_rows=one_chunk_rows,
               keep_one_chunk=keep_one_chunk)
    keep = keep_one_chunk and ctx.one_chunk
    if keep:
        cache = x.new_empty(1, ctx.recv_rows * (2 * ctx.I + ctx.H))
    else:
        cache = _new_cache(x, w_down, chunk_rows, save_slots)
    y = sched.forward(ctx, cache, keep)
    publish(stats, "forward", ctx.stats)
    return y, cache, ctx.load, ctx.send_index


def _new_cache(x, w_down, chunk_rows, save_slots):
    """Activation cache [save_slots, C*2I] (x dtype): fixed at launch by
    the slot count (from the byte budget), never by the routing."""
    if save_slots < 0:
        raise ValueError(f"moepeak: save_slots must be >= 0, got {save_slots}")
    return x.new_empty(save_slots, slot_elems(chunk_rows, w_down.shape[1]))  # w_down: [E, I, H]


@llep_dispatch.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down, group, chunk_rows, alpha, min_tokens_per_gemm,
      imbalance_threshold, save_slots=0, w_up=None, b_gate_up=None, b_down=None, activation="swiglu",
      one_chunk_rows=0, keep_one_chunk=False, grouped_mm="auto", stats=""):
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
                       load, send_index, one_chunk_rows, keep_one_chunk, grouped_mm, stats, overwrite_cache):
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
               imbalance_threshold, w_up, b_gate_up, b_down, activation, grouped_mm, plan_state, one_chunk_rows)
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
        se = slot_elems(chunk_rows, w_down.shape[1])
        if not kept and cache.shape[1] != se:
            raise ValueError(f"moepeak: cache must be [slots, {se}] (chunk_rows*2I), got {tuple(cache.shape)}")
    dx, dtw, dW, dbgu, dbd = sched.backward(ctx, grad_y.contiguous(), cache=cache,
                                           overwrite_cache=overwrite_cache, kept=kept)
    publish(stats, "backward", ctx.stats)
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
           one_chunk_rows: int = 0, keep_one_chunk: bool = False, grouped_mm: str = "auto", stats: str = ""
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                      torch.Tensor]:
        return _dispatch_backward(grad_y, x, topk_ids, topk_weights, w_gate_up, w_down, group, chunk_rows, alpha,
                                  min_tokens_per_gemm, imbalance_threshold, cache, w_up, b_gate_up, b_down,
                                  activation, load, send_index, one_chunk_rows, keep_one_chunk, grouped_mm, stats,
                                  overwrite_cache)
    op.__name__ = op.__qualname__ = name.split("::")[1]
    op.__doc__ = doc
    return torch.library.custom_op(name, op, mutates_args=("cache",) if overwrite_cache else ())


llep_dispatch_backward = _backward_op(
    "moepeak::llep_dispatch_backward", False,
    """-> (dx, d topk_weights, dW_gate_up, dW_down, dW_up, db_gate_up, db_down);
    the last three are empty [0] tensors where w_up / the biases are absent.
    load and send_index: forward's (llep_dispatch's 3rd and 4th outputs);
    without them backward counts and routes again. cache: forward's
    activation cache (only read). one_chunk_rows, keep_one_chunk,
    grouped_mm, stats: forward's.""")

llep_dispatch_backward_lean_ = _backward_op(
    "moepeak::llep_dispatch_backward_lean_", True,
    """llep_dispatch_backward, except that on the one-chunk paths
    (sched.lean_one_chunk at P = 1; the kept one-chunk step at P > 1,
    one_chunk.backward_ep) dh is written over the cached h, so that
    backward holds no second [R, 2I] (sizes.one_chunk_peak_bytes):
    the cache serves one backward (a second one over a retained graph raises
    autograd's in-place modification error). Eager autograd uses it; traced
    graphs (torch.compile) use llep_dispatch_backward: the same values.""")


@llep_dispatch_backward.register_fake
def _dispatch_backward_fake(grad_y, x, topk_ids, topk_weights, w_gate_up, w_down, group, chunk_rows, alpha,
                            min_tokens_per_gemm, imbalance_threshold, cache=None, w_up=None, b_gate_up=None,
                            b_down=None, activation="swiglu", load=None, send_index=None, one_chunk_rows=0,
                            keep_one_chunk=False, grouped_mm="auto", stats=""):
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
    ctx.launch = inputs[15:19]  # (one_chunk_rows, keep_one_chunk, grouped_mm, stats)
    ctx.mark_non_differentiable(*output[1:])
    # No zero-filled gradient for the cache output (it would cost the whole
    # cache budget again in backward).
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_y, *grad_rest):
    if grad_y is None:  # y did not reach the loss: nothing flows back
        return (None,) * 19
    x, topk_ids, topk_weights, w_gate_up, w_down, cache, w_up, b_gate_up, b_down, load, send_index = \
        ctx.saved_tensors
    # the lean op overwrites the cache: eager only (a traced graph keeps it read-only)
    # (no test of the cache's size while tracing: the kept one-chunk cache's is data-dependent)
    lean = not torch.compiler.is_compiling() and type(grad_y) is torch.Tensor and cache.shape[0] > 0
    dx, dtw, dwgu, dwd, dwu, dbgu, dbd = (llep_dispatch_backward_lean_ if lean else llep_dispatch_backward)(
        grad_y, x, topk_ids, topk_weights, w_gate_up, w_down, *ctx.args, cache,
        w_up, b_gate_up, b_down, ctx.activation, load, send_index, *ctx.launch)
    return (dx, None, dtw, dwgu, dwd, None, None, None, None, None, None, dwu if w_up is not None else None,
            dbgu if b_gate_up is not None else None, dbd if b_down is not None else None, None, None, None, None,
            None)


llep_dispatch.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("moepeak::llep_combine_", mutates_args=("acc",))
def llep_combine_(acc: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, w: Optional[torch.Tensor],
                  div: int) -> None:
    """acc [T, H] fp32 += w[idx[i]] * y[i] at row idx[i] // div (w None: 1)."""
    check_tensor("acc", acc, dtypes=(torch.float32,), ndim=2, contiguous=True)
    check_tensor("y", y, dtypes=FLOAT_DTYPES, ndim=2, device=acc.device, contiguous=True)
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


__all__ = ["llep_dispatch", "llep_dispatch_backward", "llep_dispatch_backward_lean_", "llep_combine_",
           "set_transport_wrapper", "FLOAT_DTYPES"]
