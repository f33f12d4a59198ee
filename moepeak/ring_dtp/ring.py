"""Ring-DTP over P ranks (docs/design.md section 2): the vocabulary is sharded on
dim 0 (rank r holds W_r: [V_r, H], global vocab ids [off_r, off_r + V_r)), the
tokens are per rank (X_r: [T_r, H]). Each rank's loss is the loss of its own
tokens against the full vocabulary (the same as the single-device op on
(X_r, W)); each rank's weight gradient is that of the *sum* of all ranks'
losses with respect to its shard (what a data-parallel all-reduce would give).

Two ring variants, chosen by `ring` ("weights", "activations", "auto"), and a third
schedule that is not a ring (`ring="gather"`, below):
 (a) weights circulate: step k, rank r holds the shard of owner o = (r-k) % P,
     received from r-1 while step k-1 computed, and folds it into its own
     tokens' state. Backward circulates W again; a dW accumulator
     [V_max, H] x fp32 travels with each shard, each rank adds its tokens'
     contribution, and the last hop lands it at the owner.
 (b) activations circulate: X_j with its labels and per-token state
     (m, s, zy, zsum, sx): [5, T_max] x fp32 travels; each rank folds its own
     shard into it; the state returns home on the P-th hop. Backward: X_j,
     labels, (m, log s, 1 - p_y, g): [4, T_max] x fp32 and a dX accumulator
     [T_max, H] x fp32 travel; dW_r accumulates locally in fp32.
 "auto" moves the smaller of V_max*H and T_max*H per hop (both variants carry
 fp32 accumulators of the same shapes in backward, so the ratio holds there).

Double buffering: the payload for step k+1 (the shard, or X and labels) is
posted with send_recv before step k's compute and waited for after it. The
forward state (activations variant) is sent after step k and waited for just
before step k+1 touches it ([5, T_max] x fp32: a latency, not a bandwidth).
The backward's fp32 accumulators travel in pieces (_AccRing): piece i (cv
vocab rows of dW, or ct token rows of dX) is sent as soon as this rank has
added its last block to it, and step k+1 waits only for piece i before adding
to it, so by the schedule only the last piece's hop waits. (The transfers overlap
the compute; what remains exposed is contention: NCCL's kernels hold SMs while
a GEMM runs beside them. benchmarks/profile_ring_dist.py traces both streams.)
Buffers: two payload buffers, two accumulator buffers, the block workspace. Shards of unequal size (V % P != 0,
e.g. FSDP2's ceil-split) are padded to V_max rows of zeros in the travelling
buffers, and the columns past a shard's real rows are masked (-inf logits,
zero gradient) by the kernels' v_valid bound; tokens are padded likewise with
ignore_index labels. Shapes are exchanged once per call with an all_gather of a few ints
(moepeak/ring_dtp/group.py's Geometry: shard rows, tokens, H and dtype, which must agree;
the labels' range; the options every rank must pass alike, AGREED; and whether a rank
refused its arguments, so a refusal or mismatch on one rank raises on every rank and none
waits in an exchange). It is a host sync on GPU, once per call; the schedule itself has none.

Every rank must call backward, and with the same create_graph (it decides the exchanges).
With create_graph=True the backward is not the ring: the whole weight is gathered and the
gradients are formed with torch ops over this rank's [T, V] logits (_differentiable_grads),
differentiable to any order.

ring="gather" (never chosen by "auto"): all-gather the shards into the whole weight
[V, H], run the single-device op on this rank's tokens (its 3-GEMM fused schedule, `mode`
applies), and send each shard's rows of this rank's weight gradient to the owner, who sums
the P contributions in fp32 (all_to_all_v, then one rounding). It holds the whole weight
and its whole gradient, 2 V H elements, where the rings hold a shard: the choice when those
fit and speed matters (benchmarks/bench_ring_dtp_dist.py measures both); at larger P or
V x H the rings' 1/P shard wins on memory.

Process groups: `group` is resolved once per call through moepeak.core.process_groups
(group_info: rank, size) and the transport is built on it (moepeak.core.transport).
"""
from __future__ import annotations

import math

import torch

from . import blocks as B
from . import gemm as G
from .group import Geometry, agreed_options, ring_transport
from .options import RINGS, RingDTPOptions
from .sched import REDUCTIONS, reduce_rows


def _fold_into(x, w, y, v_off, v_valid, st, ignore_index, softcap, ct, cv):
    """Fold w: [Vw, H] (global ids [v_off, v_off + Vw)) into the state rows of x: [T, H]."""
    T, Vw = x.shape[0], w.shape[0]
    for t0 in range(0, T, ct):
        t1 = min(T, t0 + ct)
        part = tuple(a[t0:t1] for a in st)
        for b0 in range(0, Vw, cv):
            b1 = min(Vw, b0 + cv)
            z = B.logits_block(x[t0:t1], w[b0:b1], None)
            B.fold(z, v_off + b0, v_valid, y[t0:t1], ignore_index, softcap, *part)


def _grad_block(x, w, y, v_off, v_valid, V, m, ls, q, g, dx_acc, dw_acc, ignore_index, softcap, eps, zloss,
                t0, t1, b0, b1):
    """One block: dx_acc[t0:t1] (fp32) += dZ W[b0:b1]; dw_acc[b0:b1] (fp32) += dZ^T X[t0:t1]."""
    if t1 <= t0 or b1 <= b0:
        return
    z = B.logits_block(x[t0:t1], w[b0:b1], None)
    dz = B.grad_block(z, v_off + b0, v_valid, y[t0:t1], ignore_index, softcap, m[t0:t1], ls[t0:t1],
                      q[t0:t1], g if g.numel() == 1 else g[t0:t1], eps, V, zloss, x.dtype)
    del z
    G.mm_f32_acc_(dx_acc[t0:t1], dz, w[b0:b1], first=False)
    G.mm_f32_acc_(dw_acc[b0:b1], dz.t(), x[t0:t1], first=False)


class _AccRing:
    """The travelling fp32 accumulator of the backward, piece by piece: piece i
    of this step's accumulator is sent on (and piece i of the next one received)
    as soon as this rank has finished adding to it, and the next step waits
    only for piece i before adding to it. So the hop of piece i overlaps the
    compute of the pieces after it; only the last piece's hop is exposed.
    Every rank makes the same calls (pieces of the padded [rows_max, H] buffers),
    one send/recv pair per piece, in the same order."""

    def __init__(self, tr, nxt, prv, rows_max, H, piece, device):
        self.tr, self.nxt, self.prv, self.piece = tr, nxt, prv, piece
        self.cur = torch.zeros((rows_max, H), dtype=torch.float32, device=device)  # this step's
        self.other = torch.empty_like(self.cur)                                      # the next step's
        self.n = -(-rows_max // piece) if rows_max else 0
        self.pending = [None] * self.n

    def span(self, i):
        return i * self.piece, min(self.cur.shape[0], (i + 1) * self.piece)

    def ready(self, i) -> torch.Tensor:
        """Piece i of this step's accumulator, once it has arrived."""
        if self.pending[i] is not None:
            self.pending[i].wait()
            self.pending[i] = None
        a, b = self.span(i)
        return self.cur[a:b]

    def done(self, i) -> None:
        """This rank has finished piece i: send it on, receive the next step's piece i."""
        a, b = self.span(i)
        self.pending[i] = self.tr.send_recv(self.cur[a:b], self.nxt, self.other[a:b], self.prv)

    def next_step(self) -> None:
        self.cur, self.other = self.other, self.cur

    def home(self) -> torch.Tensor:
        """After the P-th hop: this rank's own accumulator."""
        for i in range(self.n):
            self.ready(i)
        return self.cur


def _g_rows(grad_loss, valid, reduction, T):
    gl = grad_loss.to(torch.float32)
    if reduction == 0:
        return gl.reshape(T).contiguous()
    if reduction == 2:
        return gl.reshape(1).expand(T).contiguous()
    return (gl / valid.sum().clamp_min(1).to(torch.float32)).reshape(1).expand(T).contiguous()


class _GatherShards(torch.autograd.Function):
    """Forward: the whole weight [V, H] from every rank's dim-0 shard (all_gather, shards
    padded to V_max rows when unequal, then their rows put together). Backward: each shard's
    rows of this rank's gradient summed at their owner (_ScatterSum)."""

    @staticmethod
    def forward(ctx, w, tr, geo):
        ctx.tr, ctx.geo = tr, geo
        H = w.shape[1]
        buf = torch.empty((geo.P, geo.Vmax, H), dtype=w.dtype, device=w.device)
        if w.shape[0] == geo.Vmax:
            tr.all_gather(buf, w)
        else:
            pad = torch.zeros((geo.Vmax, H), dtype=w.dtype, device=w.device)
            pad[:w.shape[0]] = w
            tr.all_gather(buf, pad)
            del pad
        if all(v == geo.Vmax for v in geo.Vs):
            return buf.view(geo.P * geo.Vmax, H)
        return torch.cat([buf[j, :geo.Vs[j]] for j in range(geo.P)])

    @staticmethod
    def backward(ctx, g):
        return _ScatterSum.apply(g, ctx.tr, ctx.geo), None, None


class _ScatterSum(torch.autograd.Function):
    """Forward: rows [off_o, off_o + V_o) of this rank's whole-weight gradient g: [V, H] go to
    owner o (all_to_all_v straight from g: the shards are consecutive in rank order), and each
    owner sums the P contributions in fp32, in rank order, and rounds once (deterministic):
    [V_r, H]. Backward: the all-gather (_GatherShards), so both are differentiable to any order."""

    @staticmethod
    def forward(ctx, g, tr, geo):
        ctx.tr, ctx.geo = tr, geo
        P, Vr, H = geo.P, geo.Vs[geo.r], g.shape[1]
        g = g.contiguous()
        recv = torch.empty((P, Vr, H), dtype=g.dtype, device=g.device)
        tr.all_to_all_v(g, geo.Vs, recv.view(P * Vr, H), [Vr] * P).wait()
        del g
        out = torch.empty((Vr, H), dtype=recv.dtype, device=recv.device)
        step = max(1, (64 << 20) // max(1, 4 * P * H))  # rows per piece: <= 64 MiB of fp32 at a time
        for b0 in range(0, Vr, step):
            b1 = min(Vr, b0 + step)
            out[b0:b1] = recv[:, b0:b1].float().sum(0)
        return out

    @staticmethod
    def backward(ctx, g):
        return _GatherShards.apply(g.contiguous(), ctx.tr, ctx.geo), None, None


def check_no_bias(bias) -> None:
    """The rings and ring="gather" have no bias: a clear error when one is given."""
    if bias is not None:
        raise ValueError("moepeak: bias is not supported with group (vocab-sharded weight); fold it into "
                         "the weight (an extra hidden column of ones) or use group=None")


def gather_vocab_shards(w, group, agreed: dict, transport, labels=None, ignore_index=-100):
    """ring="gather"'s weight: the whole [V, H] weight from this rank's dim-0 shard `w` and
    the others' (autograd, to any order: the gradient of the result is summed back onto the
    shards). agreed: the AGREED options by name, checked equal on every rank (Geometry);
    transport: RingDTPOptions.transport. labels (optional): this rank's, range-checked
    against V on every rank."""
    tr = ring_transport(transport, group, w.device)
    w = w if w.is_contiguous() else w.contiguous()
    geo = Geometry(tr, 0, w, agreed, labels, ignore_index)
    return _GatherShards.apply(w, tr, geo)


class _RingCE(torch.autograd.Function):
    """This rank's loss (and lse) over the ring; backward: the ring again, or under
    create_graph=True _differentiable_grads. Both bodies run without autocast (the inputs
    are cast already)."""

    @staticmethod
    def forward(ctx, x, w, y, bad, tr, geo, variant, ignore_index, reduction, eps, zloss, softcap, ct, cv):
        with B.autocast_off(x.device):
            loss, m, ls, q = _ring_forward(x, w, y, bad, tr, geo, variant, ignore_index, reduction, eps, zloss,
                                           softcap, ct, cv)
        ctx.save_for_backward(x, w, y, m, ls, q)
        ctx.cfg = (tr, geo, variant, ignore_index, reduction, eps, zloss, softcap, ct, cv)
        lse = B.lse_report(m, ls)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):  # lse is not differentiable
        x, w, y, m, ls, q = ctx.saved_tensors
        tr, geo, variant, ignore_index, reduction, eps, zloss, softcap, ct, cv = ctx.cfg
        with B.autocast_off(x.device):
            if torch.is_grad_enabled():  # create_graph=True (the same on every rank: it decides the exchanges)
                dx, dw = _differentiable_grads(x, w, y, grad_loss, tr, geo, ignore_index, reduction, eps, zloss,
                                               softcap)
            else:
                dx, dw = _ring_backward(x, w, y, m, ls, q, grad_loss, tr, geo, variant, ignore_index, reduction,
                                        eps, zloss, softcap, ct, cv)
        return dx, dw, None, None, None, None, None, None, None, None, None, None, None, None


def _ring_forward(x, w, y, bad, tr, geo, variant, ignore_index, reduction, eps, zloss, softcap, ct, cv):
    """(loss, m, ls, q) of this rank's tokens: the state folded over every shard, by the ring."""
    fold = _fold_weights_ring if variant == "weights" else _fold_activations_ring
    st = fold(x, w, y, tr, geo, ignore_index, softcap, ct, cv)
    m, ls, q = B.fin(st)
    valid = y != ignore_index
    rows = B.row_losses(m, ls, st[2], st[3], st[4], valid, bad, eps, geo.V, zloss)
    if x.shape[0] == 0 and reduction == REDUCTIONS["mean"]:  # the mean of no token: NaN, as torch's
        return torch.full((), math.nan, dtype=torch.float32, device=x.device), m, ls, q
    return reduce_rows(rows, valid, reduction), m, ls, q


def _fold_weights_ring(x, w, y, tr, geo, ignore_index, softcap, ct, cv):
    """This rank's tokens' state (B.new_state's rows), every shard folded in as it comes by."""
    P, r = geo.P, geo.r
    nxt, prv = (r + 1) % P, (r - 1) % P
    T, H = x.shape
    st = B.new_state(T, x.device)
    cur = torch.zeros((geo.Vmax, H), dtype=w.dtype, device=w.device)
    cur[:w.shape[0]] = w
    other = torch.empty_like(cur)
    for k in range(P):
        o = (r - k) % P
        h = tr.send_recv(cur, nxt, other, prv) if k < P - 1 else None
        _fold_into(x, cur[:geo.Vs[o]], y, geo.off[o], geo.off[o] + geo.Vs[o], st, ignore_index, softcap, ct, cv)
        if h is not None:
            h.wait()
            cur, other = other, cur
    return st


def _padded_tokens(x, y, Tmax, ignore_index):
    """This rank's tokens and labels padded to the ring's common length Tmax (the travelling
    buffers every rank sends alike); the padding rows are zeros with ignored labels."""
    T, H = x.shape
    xb = torch.zeros((Tmax, H), dtype=x.dtype, device=x.device)
    xb[:T] = x
    yb = torch.full((Tmax,), ignore_index, dtype=torch.int64, device=x.device)
    yb[:T] = y
    return xb, yb


def _fold_activations_ring(x, w, y, tr, geo, ignore_index, softcap, ct, cv):
    """This rank's tokens' state: the tokens and their state travel, each rank folds its shard
    in, and the P-th hop brings the state home."""
    P, r = geo.P, geo.r
    nxt, prv = (r + 1) % P, (r - 1) % P
    T, H = x.shape
    xb, yb = _padded_tokens(x, y, geo.Tmax, ignore_index)
    stb = torch.zeros((5, geo.Tmax), dtype=torch.float32, device=x.device)
    stb[0].fill_(-math.inf)
    xo, yo, sto = torch.empty_like(xb), torch.empty_like(yb), torch.empty_like(stb)
    hs = None
    for k in range(P):
        j = (r - k) % P
        hx = [tr.send_recv(xb, nxt, xo, prv), tr.send_recv(yb, nxt, yo, prv)] if k < P - 1 else []
        if hs is not None:
            hs.wait()
            stb, sto = sto, stb
        tj = geo.Ts[j]
        _fold_into(xb[:tj], w, yb[:tj], geo.off[r], geo.off[r] + geo.Vs[r], tuple(stb[i, :tj] for i in range(5)),
                   ignore_index, softcap, ct, cv)
        hs = tr.send_recv(stb, nxt, sto, prv)  # the P-th hop brings each state home
        for h in hx:
            h.wait()
        if hx:
            xb, xo, yb, yo = xo, xb, yo, yb
    hs.wait()
    return tuple(sto[i, :T].clone() for i in range(5))


def _ring_backward(x, w, y, m, ls, q, grad_loss, tr, geo, variant, ignore_index, reduction, eps, zloss, softcap,
                   ct, cv):
    """(dX, dW shard) by the ring (module docstring)."""
    g = _g_rows(grad_loss, y != ignore_index, reduction, x.shape[0])
    backward = _weights_ring_backward if variant == "weights" else _activations_ring_backward
    return backward(x, w, y, m, ls, q, g, tr, geo, ignore_index, softcap, eps, zloss, ct, cv)


def _weights_ring_backward(x, w, y, m, ls, q, g, tr, geo, ignore_index, softcap, eps, zloss, ct, cv):
    """(dX, dW shard): the shards circulate again, each with its fp32 dW accumulator; dX in an
    fp32 [T, H] accumulator here."""
    P, r = geo.P, geo.r
    nxt, prv = (r + 1) % P, (r - 1) % P
    T, H = x.shape
    dx_acc = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    cur = torch.zeros((geo.Vmax, H), dtype=w.dtype, device=w.device)
    cur[:w.shape[0]] = w
    other = torch.empty_like(cur)
    # dW of the shard travels with it, in vocab blocks of cv rows: vocab blocks
    # are the outer loop, so block i is final (for this rank) before the next.
    acc = _AccRing(tr, nxt, prv, geo.Vmax, H, cv, x.device)
    for k in range(P):
        o = (r - k) % P
        hw = tr.send_recv(cur, nxt, other, prv) if k < P - 1 else None
        vo = geo.Vs[o]
        for i in range(acc.n):
            b0, b1 = acc.span(i)
            dw_i = acc.ready(i)
            for t0 in range(0, T, ct):
                _grad_block(x, cur[b0:min(b1, vo)], y, geo.off[o] + b0, geo.off[o] + vo, geo.V, m, ls, q,
                            g, dx_acc, dw_i, ignore_index, softcap, eps, zloss, t0, min(T, t0 + ct), 0,
                            max(0, min(b1, vo) - b0))
            acc.done(i)  # the P-th hop lands each dW at its owner
        acc.next_step()
        if hw is not None:
            hw.wait()
            cur, other = other, cur
    dx = dx_acc.to(x.dtype)
    dw = acc.home()[:w.shape[0]].to(w.dtype)
    return dx, dw


def _activations_ring_backward(x, w, y, m, ls, q, g, tr, geo, ignore_index, softcap, eps, zloss, ct, cv):
    """(dX, dW shard): the tokens circulate again with their fp32 dX accumulator; this shard's dW
    in an fp32 accumulator here."""
    P, r = geo.P, geo.r
    nxt, prv = (r + 1) % P, (r - 1) % P
    T, H = x.shape
    xb, yb = _padded_tokens(x, y, geo.Tmax, ignore_index)
    aux = torch.zeros((4, geo.Tmax), dtype=torch.float32, device=x.device)  # m, log s, 1 - p_y, g
    aux[0, :T], aux[1, :T], aux[2, :T], aux[3, :T] = m, ls, q, g
    xo, yo, auxo = torch.empty_like(xb), torch.empty_like(yb), torch.empty_like(aux)
    # dX of the tokens travels with them (home on the P-th hop), in token
    # chunks of ct rows: chunk i is final (for this rank) after its vocab blocks.
    dxa = _AccRing(tr, nxt, prv, geo.Tmax, H, ct, x.device)
    dw_acc = torch.zeros((w.shape[0], H), dtype=torch.float32, device=x.device)
    Vr = w.shape[0]
    for k in range(P):
        j = (r - k) % P
        hx = ([tr.send_recv(xb, nxt, xo, prv), tr.send_recv(yb, nxt, yo, prv),
               tr.send_recv(aux, nxt, auxo, prv)] if k < P - 1 else [])
        tj = geo.Ts[j]
        gj = aux[3].contiguous()
        for i in range(dxa.n):
            t0, t1 = dxa.span(i)
            dx_i = dxa.ready(i)
            for b0 in range(0, Vr, cv):
                _grad_block(xb[t0:min(t1, tj)], w, yb[t0:min(t1, tj)], geo.off[r], geo.off[r] + Vr, geo.V,
                            aux[0, t0:], aux[1, t0:], aux[2, t0:], gj[t0:], dx_i, dw_acc, ignore_index,
                            softcap, eps, zloss, 0, max(0, min(t1, tj) - t0), b0, min(Vr, b0 + cv))
            dxa.done(i)
        dxa.next_step()
        for h in hx:
            h.wait()
        if hx:
            xb, xo, yb, yo, aux, auxo = xo, xb, yo, yb, auxo, aux
    dx = dxa.home()[:T].to(x.dtype)
    dw = dw_acc.to(w.dtype)
    return dx, dw


def _differentiable_grads(x, w, y, grad_loss, tr, geo, ignore_index, reduction, eps, zloss, softcap):
    """(dX, dW shard) for grad_loss as differentiable functions of x, grad_loss and every rank's
    shard (and, for dW, of every rank's tokens): the backward under create_graph=True (e.g. a
    gradient penalty). The whole weight is gathered (_GatherShards), this rank's loss formed
    over its [T, V] logits with torch ops (B.plain_rows) and differentiated with create_graph,
    and every rank's gradient of the whole weight summed onto the owners' shards
    (_ScatterSum). Those two are autograd Functions, each the other's backward, so the graph
    is differentiable to any order, and every rank makes the same exchanges. Memory: the
    plain-PyTorch loss's [T, V] logits, plus the whole weight and its gradient."""
    with torch.enable_grad():
        wl = w if w.requires_grad else w.detach().requires_grad_()
        w_full = _GatherShards.apply(wl, tr, geo)                       # [V, H]
        z = torch.nn.functional.linear(x, w_full).float()               # [T, V] x fp32
        rows = B.plain_rows(z, y, ignore_index, eps, zloss, softcap)
        total = (rows * _g_rows(grad_loss, y != ignore_index, reduction, x.shape[0])).sum()
        inputs = (x, w_full) if x.requires_grad else (w_full,)
        got = torch.autograd.grad(total, inputs, create_graph=True)
        dw = _ScatterSum.apply(got[-1], tr, geo)                        # every rank: the same exchange
    return (got[0] if x.requires_grad else None), dw


def ring_linear_cross_entropy(x, w, y, group, ignore_index, reduction, eps, zloss, softcap,
                              options: RingDTPOptions):
    """x: [T, H] (contiguous), w: [V_r, H] this rank's vocab shard, y: [T] int64; the loss
    definition (softcap 0: none) and the schedule (options: ring, chunk sizes, transport).
    Every rank of the group must pass the AGREED arguments alike (checked: a clear error on
    every rank)."""
    if options.ring not in ("auto", "weights", "activations"):  # "gather" never comes here:
        raise ValueError(f"moepeak: ring must be one of {RINGS[:3]} here, got {options.ring!r}")  # see its doc
    tr = ring_transport(options.transport, group, x.device)
    w = w if w.is_contiguous() else w.contiguous()
    agreed = agreed_options(options, ignore_index, reduction, eps, zloss, softcap)
    geo = Geometry(tr, x.shape[0], w, agreed, y, ignore_index)
    variant = options.ring
    if variant == "auto":
        variant = "weights" if geo.Vmax <= geo.Tmax else "activations"
    # Every rank's labels are in range (the exchange checked them, on every device), so no
    # token is `bad` (row_losses' mask for out-of-range labels) and no flag is deferred.
    bad = torch.zeros_like(y, dtype=torch.bool)
    ct, cv = B.blocked_chunks(max(geo.Tmax, 1), x.shape[1], x.dtype, chunk_tokens=options.chunk_tokens)
    cv = options.chunk_vocab or cv
    return _RingCE.apply(x, w, y, bad, tr, geo, variant, ignore_index, REDUCTIONS[reduction], float(eps),
                         float(zloss), float(softcap), ct, cv)
