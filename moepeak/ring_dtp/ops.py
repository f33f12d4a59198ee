"""Ring-DTP's ops (moepeak.ring_dtp's docstring has the contract): moepeak::ring_dtp_ce and
moepeak::ring_dtp_ce_backward, in order custom_op, register_fake, register_autograd. The
single-device loss the public function linear_cross_entropy (moepeak/ring_dtp/loss.py)
calls; the schedules they run are moepeak/ring_dtp/sched.py's.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import blocks as B
from . import sched
from .labels import PENDING, check_labels, sanitize_labels
from .sched import FUSED_MODES, MODES

__all__ = ["ring_dtp_ce", "ring_dtp_ce_backward"]


# ---------------------------------------------------------------------------
# The ops: custom_op, register_fake, register_autograd, in that order.
# ---------------------------------------------------------------------------
@torch.library.custom_op("moepeak::ring_dtp_ce", mutates_args=())
def ring_dtp_ce(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], ignore_index: int,
                reduction: int, label_smoothing: float, z_loss: float, softcap: float, mode: int,
                chunk_tokens: int, chunk_vocab: int, dw_finish: bool, dx_finish: bool, center_chunks: int,
                fused_colsum: bool, grads: bool
                ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """hidden [T, H], weight [V, H], labels [T] int64, bias [V] or None; the loss definition
    (ignore_index, REDUCTIONS code, label_smoothing, z_loss, softcap: 0 for none), the schedule
    (mode .. fused_colsum: RingDTPOptions.op_args()), grads: make the gradients if the mode
    can. Returns (loss: [] or [T] x fp32, m: [T] x fp32, ls = log s: [T] x fp32 (lse = m + ls),
    q = 1 - p_y: [T] x fp32, dX [T, H], dW [V, H], dbias [V] x fp32);
    dX/dW/dbias are gradients for a unit upstream grad when
    the resolved mode is 'fused', else empty."""
    if hidden.shape[0] == 0:
        return _empty_batch(hidden, weight, bias, reduction, mode, grads)
    with B.autocast_off(hidden.device):
        return _ce_forward(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, z_loss, softcap,
                           mode, chunk_tokens, chunk_vocab, dw_finish, center_chunks, fused_colsum, grads)


def _ce_forward(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, mode,
                chunk_tokens, chunk_vocab, dw_finish, center_chunks, fused_colsum, grads):
    """ring_dtp_ce's body for T >= 1 (the op's arguments and outputs)."""
    T, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    # Inside the op (opaque to torch.compile, so no graph break): earlier calls' label flags
    # are read here, this call's checked or recorded.
    y, valid, bad = sanitize_labels(labels, V, ignore_index)
    resolved = sched.pick_mode(mode, grads, reduction, T, H, V, hidden.dtype, chunk_tokens)
    ct, cv = sched.chunk_sizes(T, H, V, hidden.dtype, resolved, chunk_tokens or None, chunk_vocab or None)
    dx, dw, db = hidden.new_empty(0), hidden.new_empty(0), torch.empty(0, dtype=torch.float32, device=dev)
    if resolved in FUSED_MODES and grads:
        if reduction == 1:
            g = (1.0 / valid.sum().clamp_min(1).to(torch.float32)).reshape(1)
        else:
            g = torch.ones(1, dtype=torch.float32, device=dev)
        st, dx, dw, dbb = sched.fused(hidden, weight, bias, y, ignore_index, softcap, label_smoothing, z_loss, g, ct,
                                      lowp_logits=resolved == MODES["fused_lowp"], dw_finish=dw_finish,
                                      center_chunks=center_chunks, fused_colsum=fused_colsum)
        if dbb is not None:
            db = dbb
    else:
        st = sched.fold_all(hidden, weight, bias, y, ignore_index, softcap, ct, cv)
    m, ls, q = B.fin(st)
    rows = B.row_losses(m, ls, st[2], st[3], st[4], valid, bad, label_smoothing, V, z_loss)
    loss = sched.reduce_rows(rows, valid, reduction)
    return loss, m, ls, q, dx, dw, db


def _empty_batch(hidden, weight, bias, reduction, mode, grads):
    """ring_dtp_ce's outputs for T = 0, as torch gives them: loss NaN (mean over no
    token, F.cross_entropy's), 0 (sum) or [0] (none); zero gradients."""
    H, V = hidden.shape[1], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    loss = torch.empty(0, **f32) if reduction == 0 else torch.full((), math.nan if reduction == 1 else 0.0, **f32)
    if sched.pick_mode(mode, grads, reduction, 0, H, V, hidden.dtype) in FUSED_MODES and grads:
        dx, dw = torch.empty_like(hidden), torch.zeros_like(weight)
        db = torch.zeros(V if bias is not None else 0, **f32)
    else:
        dx, dw, db = hidden.new_empty(0), hidden.new_empty(0), torch.empty(0, **f32)
    return loss, torch.empty(0, **f32), torch.empty(0, **f32), torch.empty(0, **f32), dx, dw, db


@ring_dtp_ce.register_fake
def _(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, mode,
      chunk_tokens, chunk_vocab, dw_finish, dx_finish, center_chunks, fused_colsum, grads):
    T = hidden.shape[0]
    loss = hidden.new_empty((T,) if reduction == 0 else (), dtype=torch.float32)
    lse = hidden.new_empty((T,), dtype=torch.float32)
    q = hidden.new_empty((T,), dtype=torch.float32)
    ls = hidden.new_empty((T,), dtype=torch.float32)
    # dX/dW are either full gradients (fused) or empty: data-dependent in size only via
    # the mode choice, which depends on static arguments, so resolve it here the same way.
    resolved = sched.pick_mode(mode, grads, reduction, T, hidden.shape[1], weight.shape[0], hidden.dtype,
                               chunk_tokens)
    if resolved in FUSED_MODES and grads:
        dx, dw = torch.empty_like(hidden), torch.empty_like(weight)
        db = hidden.new_empty((weight.shape[0] if bias is not None else 0,), dtype=torch.float32)
    else:
        dx, dw = hidden.new_empty(0), hidden.new_empty(0)
        db = hidden.new_empty((0,), dtype=torch.float32)
    return loss, lse, ls, q, dx, dw, db


@torch.library.custom_op("moepeak::ring_dtp_ce_backward", mutates_args=())
def ring_dtp_ce_backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor],
                         m: Tensor, ls: Tensor, q: Tensor, ignore_index: int, reduction: int, label_smoothing: float,
                         z_loss: float, softcap: float, mode: int, chunk_tokens: int, chunk_vocab: int, dw_finish: bool,
                         dx_finish: bool, center_chunks: int, fused_colsum: bool
                         ) -> Tuple[Tensor, Tensor, Tensor]:
    """Recompute-and-accumulate backward (the 4-GEMM modes; a fused mode's second backward).
    grad_loss: [] or [T]; the other arguments ring_dtp_ce's and its outputs m, ls, q (of the
    schedule, dw_finish, center_chunks and fused_colsum are forward's only: not used here).
    Returns dX [T, H], dW [V, H], dbias [V] x fp32 (or [0])."""
    T, H = hidden.shape
    V = weight.shape[0]
    if T == 0:
        db = torch.zeros(V if bias is not None else 0, dtype=torch.float32, device=hidden.device)
        return torch.empty_like(hidden), torch.zeros_like(weight), db
    with B.autocast_off(hidden.device):
        return _ce_backward(grad_loss, hidden, weight, labels, bias, m, ls, q, ignore_index, reduction,
                            label_smoothing, z_loss, softcap, mode, chunk_tokens, chunk_vocab, dx_finish)


def _ce_backward(grad_loss, hidden, weight, labels, bias, m, ls, q, ignore_index, reduction, label_smoothing, z_loss,
                 softcap, mode, chunk_tokens, chunk_vocab, dx_finish):
    """ring_dtp_ce_backward's body for T >= 1 (the op's arguments and outputs)."""
    T, H = hidden.shape
    V = weight.shape[0]
    ign = labels == ignore_index
    y = torch.where(ign | (labels < 0) | (labels >= V), torch.full_like(labels, ignore_index), labels).contiguous()
    gl = grad_loss.to(torch.float32)
    if reduction == 0:
        g = gl.reshape(T).contiguous()
    elif reduction == 2:
        g = gl.reshape(1).contiguous()
    else:
        g = (gl / (~ign).sum().clamp_min(1).to(torch.float32)).reshape(1).contiguous()
    resolved = sched.pick_mode(mode, True, reduction, T, H, V, hidden.dtype, chunk_tokens)  # as forward resolved it
    order = {MODES["token_outer"]: "token_outer",
             MODES["vocab_outer_lowp"]: "vocab_outer_lowp"}.get(resolved, "vocab_outer")
    ct, cv = sched.chunk_sizes(T, H, V, hidden.dtype, MODES[order], chunk_tokens or None, chunk_vocab or None)
    dx, dw, db = sched.backward_blocked(hidden, weight, bias, y, m.contiguous(), ls.contiguous(), q.contiguous(), g,
                                        ignore_index, softcap, label_smoothing, z_loss, ct, cv, order,
                                        dx_finish=dx_finish)
    if db is None:
        db = torch.empty(0, dtype=torch.float32, device=hidden.device)
    return dx, dw, db


@ring_dtp_ce_backward.register_fake
def _(grad_loss, hidden, weight, labels, bias, m, ls, q, ignore_index, reduction, label_smoothing, z_loss, softcap,
      mode, chunk_tokens, chunk_vocab, dw_finish, dx_finish, center_chunks, fused_colsum):
    db = hidden.new_empty((weight.shape[0] if bias is not None else 0,), dtype=torch.float32)
    return torch.empty_like(hidden), torch.empty_like(weight), db


# ring_dtp_ce's arguments: hidden, weight, labels, bias, the loss definition (5), the schedule
# (RingDTPOptions.op_args(): 7), grads. Backward returns one gradient (or None) for each.
_N_INPUTS = 4 + 5 + 7 + 1


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, bias = inputs[:4]
    args = inputs[4:-1]  # the loss definition, then the schedule (grads, the last, is forward's)
    loss, m, ls, q, dx, dw, db = output
    # Only `loss` is differentiable. Without these two lines autograd would hand
    # backward zero-filled gradients for every other output (materialize_grads):
    # a [T, H] and a [V, H] buffer, dX + dW a second time (at T = 32k, H = 4096,
    # V = 151936 in bf16: 1.41 GiB more at the peak).
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(m, ls, q, dx, dw, db)
    ctx.args = tuple(args)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    # The fused modes' gradients (unit upstream grad), handed out by the first backward and
    # then dropped (a ctx attribute, not a saved tensor: scaled in place and given to
    # autograd, they are no longer this node's). The inputs are saved in every mode (plain
    # F.linear saves them too): a second backward (retain_graph) recomputes, and
    # create_graph differentiates through torch ops (_double_backward_grads).
    ctx.fused_grads = [dx, dw, db] if dw.numel() > 0 else None
    # Whether any token has a label: without one the fused gradients are exact zeros and stay
    # so for any upstream gradient, inf or NaN included (torch's cross-entropy backward). Made
    # here, so that backward allocates nothing of T elements.
    ctx.any_label = (labels != args[0]).any() if ctx.fused_grads is not None else None
    ctx.save_for_backward(hidden, weight, labels, bias, m, ls, q)


def _backward(ctx, grad_loss, *_non_differentiable):
    if grad_loss is None:  # nothing flowed into loss (grads are not materialized)
        return (None,) * _N_INPUTS
    hidden, weight, labels, bias, m, ls, q = ctx.saved_tensors
    if PENDING and type(labels) is torch.Tensor and not torch.compiler.is_compiling():
        # CUDA labels are checked without a sync in forward; before any gradient is written,
        # wait for the pending flags, this call's included (one host wait on the forward's
        # event), and raise if one is set. Not while the backward is traced (fake or
        # functional tensors under torch.compile): the flags are real tensors, and the
        # compiled backward's op bodies run eagerly, where the next call checks them.
        check_labels()
    fused, ctx.fused_grads = ctx.fused_grads, None
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True
        dx, dw, db = _double_backward_grads(grad_loss, hidden, weight, labels, bias, *ctx.args[:5])
    elif fused is not None:
        dx, dw, db = fused
        g = grad_loss.to(torch.float32)
        g = torch.where(ctx.any_label, g, torch.zeros_like(g))  # no label: zeros stay zeros
        if torch.compiler.is_compiling() or type(dx) is not torch.Tensor:  # traced (functional/fake tensors)
            dx, dw = (dx.float() * g).to(dx.dtype), (dw.float() * g).to(dw.dtype)
            db = db * g
        else:
            for t in (dx, dw):  # in place: this node holds them no more (fused_grads dropped)
                B.scale_(t, g)
            db = db * g
    else:  # 4-GEMM modes, and a second backward of a fused call (retain_graph): recompute
        dx, dw, db = ring_dtp_ce_backward(grad_loss, hidden, weight, labels, bias, m, ls, q, *ctx.args)
    dbias = db.to(ctx.bias_dtype) if ctx.has_bias and db is not None else None
    return (dx, dw, None, dbias) + (None,) * (_N_INPUTS - 4)


def _double_backward_grads(grad_loss, hidden, weight, labels, bias, ignore_index, reduction, eps, zloss, softcap):
    """(dX, dW, dbias) of the loss for the upstream grad_loss as a differentiable function of
    hidden, weight, bias and grad_loss (backward under create_graph=True, e.g. a gradient
    penalty): the plain-torch loss over the whole [T, V] logits, differentiated with
    create_graph. Second-order graphs need those logits, so this path has the memory of
    the plain-PyTorch loss (only create_graph takes it)."""
    inputs = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    if not inputs:
        return None, None, None
    with torch.enable_grad():
        z = torch.nn.functional.linear(hidden, weight, bias).float()       # [T, V] x fp32
        rows = B.plain_rows(z, labels, ignore_index, eps, zloss, softcap)
        ign = labels == ignore_index
        g = grad_loss.to(torch.float32)
        if reduction == 1:
            g = g / (~ign).sum().clamp_min(1).to(torch.float32)
        total = (rows * g).sum()
        got = iter(torch.autograd.grad(total, inputs, create_graph=True))
    dx, dw, db = (next(got) if t is not None and t.requires_grad else None for t in (hidden, weight, bias))
    return dx, dw, db


ring_dtp_ce.register_autograd(_backward, setup_context=_setup_context)
