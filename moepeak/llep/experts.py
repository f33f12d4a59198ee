"""PipelinedLLEP's expert arithmetic on grouped rows: what one chunk (or the
whole step, on the one-chunk paths) computes once its rows are grouped
expert-ascending. The schedules (moepeak/llep/sched.py, the chunk loops;
moepeak/llep/one_chunk.py, the one-chunk steps) decide where rows come from
and go to; this module only computes.

  forward   h = x W_gate_up (+ b_gate_up); a = act(h); o = a W_down (+ b_down)
  backward  (rows_backward) da = (w dy) W_down^T, d(pick weight) = <dy, o>,
            dh = act'(h) da, dx rows = dh W_gate_up^T, weight (and bias)
            gradients summed into Grads.

Buffers (`Bufs`, names as in moepeak/llep/sizes.py) are sized for a row
count fixed before the rows exist (the chunk budget C, or the one-chunk
step's rows); the GEMMs are moepeak/llep/gemm.py.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import gemm
from . import plan as lp
from .context import GPT_OSS_ALPHA, GPT_OSS_LIMIT, Ctx

# Backward divides d(weight) sums by the pick weight w; below this |w| (and at
# w = 0, and for a non-finite w) dy is left unscaled instead and the row scaled
# by w afterwards. With |w| >= 2^-24, w * dy stays a normal bf16/fp32 number
# for any |dy| > 2^-102. A NaN or infinite w thus never enters d(weight) =
# <dy, o>, which is finite whenever dy and o are (as in the dense reference).
TINY_W = 2.0 ** -24


class Bufs:
    """The buffers one call's expert compute uses for up to `rows` grouped
    rows (default: the chunk budget C); None where a path does not need one.
    with_h=False: h lives elsewhere (an activation-cache view), not counted.
    h_in_cache: every chunk's h goes to its cache slot, so h [C, 2I] is only
    counted (it stands for the GEMM outputs copied into the slot), never
    allocated: the working set stays what sizes.workspace_bytes says, an
    upper bound."""

    def __init__(self, ctx: Ctx, ws, gmm: bool, backward: bool, rows: Optional[int] = None, with_h: bool = True,
                 h_in_cache: bool = False):
        C = ctx.C if rows is None else rows
        H, I, dt = ctx.H, ctx.I, ctx.x.dtype
        if h_in_cache:
            def gate_up_out(shape, dtype):
                return ws.gemm_out(shape, dtype, True)
        elif ctx.split:  # two GEMMs write the halves of one allocated h
            gate_up_out = ws.alloc
        else:
            def gate_up_out(shape, dtype):
                return ws.gemm_out(shape, dtype, gmm)
        self.h = gate_up_out((C, 2 * I), dt) if with_h else None
        self.a = ws.alloc((C, I), dt)
        self.s = ws.alloc((C, I), dt) if backward or ctx.activation == "gpt_oss" else None
        self.o = ws.gemm_out((C, H), dt, gmm)
        self.t = self.mask = None
        if backward:
            self.dh, self.da, self.do = ws.alloc((C, 2 * I), dt), ws.gemm_out((C, I), dt, gmm), ws.alloc((C, H), dt)
            self.wp, self.dwr = ws.alloc((C,), torch.float32), ws.alloc((C,), torch.float32)
            if ctx.activation == "gpt_oss":
                self.t, self.mask = ws.alloc((C, I), dt), ws.alloc((C, I), torch.bool)
        # bias scratch: C * max(2I, H) elements of x's dtype (also read as fp32 blocks)
        self.scr = ws.alloc((C * max(2 * I, H) * ctx.x.element_size(),), torch.uint8) if ctx.has_bias else None

    def scratch(self, rows, N, dtype):
        return self.scr.view(dtype)[:rows * N].view(rows, N)


class DyRows(NamedTuple):
    """A chunk's grouped dy rows not yet gathered: row i is src[idx[i] // div]; `out`
    [>= rows, H] takes them where they are needed unscaled (fp16, biases). Otherwise
    rows_backward gathers them straight into w*dy (plan.gather_rows with a scale):
    one pass instead of a gather and a mixed-dtype multiply."""
    src: torch.Tensor
    idx: torch.Tensor
    div: int
    out: torch.Tensor

    def gather(self, out=None, scale=None) -> torch.Tensor:
        return lp.gather_rows(self.src, self.idx, self.div, self.out if out is None else out, scale=scale)


class Grads:
    """One backward call's gradient sums.

    dW: a list indexed by weight kind (None until written; param dtype).
    It starts uninitialised (no full-size memset): the first grouped
    weight-gradient GEMM returns it (gemm.dw_accumulate), otherwise it
    is allocated there; an expert's first rows write it, later ones add;
    experts that got no rows are zeroed at the end (zero_untouched).
    dWb[which][i]: borrowed slot i's gradient, a view of bgrad [nb, per]
    (param dtype; one row per borrowed expert, laid out as Ctx.bflat rows).
    dbias: fp32 [El + nb, 2I + H] (rows as ctx.bias_table's), or None."""

    def __init__(self, ctx: Ctx, need_dw: bool):
        self.need_dw = need_dw
        self.dW = [None, None, None]
        nb = len(ctx.borrowed)
        self.bgrad = None
        self.dWb = ([], [], [])
        if nb:
            self.bgrad = torch.empty(nb, ctx.bias_off, dtype=ctx.wgu.dtype, device=ctx.x.device)
            for which in ctx.kinds:
                a0, N = ctx.dims(which)
                o = ctx.flat_off[which]
                self.dWb[which].extend(self.bgrad[i, o:o + a0 * N].view(a0, N) for i in range(nb))
        self.dbias = (torch.zeros(ctx.El + nb, 2 * ctx.I + ctx.H, dtype=torch.float32, device=ctx.x.device)
                      if ctx.has_bias else None)


def gate_views(ctx: Ctx, hh):
    """(gate, up) views [rows, I] of h [rows, 2I] in ctx.activation's layout."""
    I = ctx.I
    if ctx.activation == "gpt_oss" and not ctx.split:
        return hh[:, 0::2], hh[:, 1::2]
    return hh[:, :I], hh[:, I:]


def store(res, dst):
    """res stored in dst (a copy only when the GEMM did not write dst)."""
    if res.data_ptr() != dst.data_ptr():
        dst.copy_(res)
    return dst


def gate_up(ctx: Ctx, xg, grp, buf: Bufs, slot):
    """h [rows, 2I] = xg W_gate_up (+ b_gate_up per row's expert), written to
    `slot` (an activation-cache view [>= rows, 2I]) when there is one (for
    backward, no recompute)."""
    rows, I = xg.shape[0], ctx.I
    if ctx.split:  # two GEMMs into the column halves of one [C, 2I] buffer
        dst = buf.h if slot is None else slot
        store(gemm.mm(ctx, xg, grp, 0, False, dst[:, :I]), dst[:rows, :I])
        store(gemm.mm(ctx, xg, grp, 2, False, dst[:, I:]), dst[:rows, I:])
        hh = dst[:rows]
    else:
        hh = gemm.mm(ctx, xg, grp, 0, False, buf.h if slot is None else slot)
        if slot is not None:
            hh = store(hh, slot[:rows])
    if ctx.has_bias:
        hh.add_(bias_rows(ctx, grp, buf, 0, rows))
    return hh


def bias_rows(ctx: Ctx, grp, buf: Bufs, which: int, rows: int):
    """[rows, N] (x dtype, in the bias scratch): each grouped row's expert's
    b_gate_up (which 0) or b_down (1)."""
    table = ctx.bias_table[0 if which == 0 else 1]
    out = buf.scratch(rows, table.shape[1], ctx.x.dtype)
    return torch.index_select(table, 0, grp.row_table_index(), out=out)


def act(ctx: Ctx, hh, buf, rows: int):
    """a [rows, I] = act(gate, up) into buf.a; swiglu also leaves s = silu(gate)
    in buf.s (backward uses it) when buf.s exists. gpt_oss, in Hugging Face's
    order of ops: g = gate.clamp(max=7); glu = g * sigmoid(g * 1.702);
    a = (up.clamp(-7, 7) + 1) * glu."""
    a = buf.a[:rows]
    if ctx.activation == "swiglu":  # silu then mul, one pass (plan.swiglu_fwd)
        return lp.swiglu_fwd(hh, a, None if buf.s is None else buf.s[:rows])
    gate, up = gate_views(ctx, hh)
    s = buf.s[:rows]
    torch.clamp(gate, max=GPT_OSS_LIMIT, out=s)                      # g
    torch.mul(s, GPT_OSS_ALPHA, out=a)
    torch.sigmoid(a, out=a)
    a.mul_(s)                                                        # glu = g * sigmoid(g * alpha)
    torch.clamp(up, min=-GPT_OSS_LIMIT, max=GPT_OSS_LIMIT, out=s)
    s.add_(1)
    a.mul_(s)                                                        # a = (u + 1) * glu
    return a


def act_bwd(ctx: Ctx, hh, dda, buf: Bufs, rows: int):
    """dh [rows, 2I] (buf.dh, h's layout) from da = dda [rows, I] (dda is
    overwritten); swiglu reads buf.s = silu(gate) left by act. The
    gradients through clamp are zero outside the clamp range (bounds
    included in it), as torch's."""
    if ctx.activation == "swiglu":  # d up = da * silu(gate), d gate through silu of da * up: one pass
        return lp.swiglu_bwd(hh, dda, buf.s[:rows], buf.dh[:rows])
    gate, up = gate_views(ctx, hh)
    dgate, dup = gate_views(ctx, buf.dh[:rows])
    s, a, t, mask = buf.s[:rows], buf.a[:rows], buf.t[:rows], buf.mask[:rows]
    lim, alpha = GPT_OSS_LIMIT, GPT_OSS_ALPHA
    torch.clamp(gate, max=lim, out=s)                                # g
    torch.mul(s, alpha, out=a)
    torch.sigmoid(a, out=a)                                          # sig = sigmoid(g * alpha)
    torch.mul(s, a, out=dup)                                         # glu
    dup.mul_(dda)                                                    # d(u + 1) = da * glu
    torch.abs(up, out=t)
    torch.le(t, lim, out=mask)
    dup.masked_fill_(mask.logical_not_(), 0.0)                       # d up: 0 outside [-lim, lim]
    torch.clamp(up, min=-lim, max=lim, out=t)
    t.add_(1)
    t.mul_(dda)                                                      # d glu = da * (u + 1)
    torch.mul(t, s, out=dda)                                         # d sig = d glu * g
    torch.ops.aten.sigmoid_backward.grad_input(dda, a, grad_input=dda)
    dda.mul_(alpha)                                                  # d g through sigmoid(g * alpha)
    t.mul_(a)                                                        # d g through glu = g * sig
    t.add_(dda)
    torch.le(gate, lim, out=mask)
    dgate.copy_(t).masked_fill_(mask.logical_not_(), 0.0)            # d gate: 0 above lim
    return buf.dh[:rows]


def experts_fwd(ctx: Ctx, xg, ecount, buf: Bufs, slot=None):
    """Expert outputs [rows, H] (b_down included) of the grouped rows xg.
    With a cache slot [>= rows, 2I] the gate/up GEMM's output h (bias
    included) lands in it for backward to use instead of a recompute; the
    values are the very same either way."""
    rows = xg.shape[0]
    grp = gemm.Groups(ctx, ecount)
    hh = gate_up(ctx, xg, grp, buf, slot)
    a = act(ctx, hh, buf, rows)
    hh = None
    o = gemm.mm(ctx, a, grp, 1, False, buf.o)
    if ctx.has_bias:
        o.add_(bias_rows(ctx, grp, buf, 1, rows))
    return o


def segment_sum(buf: Bufs, src, ratio, rti, dst):
    """dst [table rows, N] fp32 += per-row-expert sums of src [rows, N] rows
    (each row scaled by ratio[row] when given), in fp32 blocks of the bias
    scratch: row r adds into dst[rti[r]]."""
    rows, N = src.shape
    blk = max(1, buf.scr.numel() // (4 * N))
    for a in range(0, rows, blk):
        b = min(rows, a + blk)
        t = buf.scratch(b - a, N, torch.float32)
        t.copy_(src[a:b])
        if ratio is not None:
            t.mul_(ratio[a:b].unsqueeze(1))
        dst.index_add_(0, rti[a:b], t)


def rows_backward(ctx: Ctx, buf: Bufs, g: Grads, xg, gg, wg, ecount, hcached=None):
    """Backward of the grouped rows xg [rows, H] (x), gg [rows, H] (dy; or a
    DyRows that says where to gather them from), wg [rows] fp32 (pick
    weights): returns the dx rows [rows, H] and leaves
    d(pick weight) in buf.dwr[:rows]; weight and bias gradients are summed
    into g. h = x W_gate_up (+ bias) is recomputed, or taken from hcached
    [>= rows, 2I] (what forward left there: the same values; only read).
    One grouping (offsets copied to the device once) serves all GEMMs; h
    stays alive from the recompute to the last use.
    o = a W_down is never recomputed: d(weight) = <dy, o> = <dy W_down^T, a>
    (+ <dy, b_down>), and (w dy) W_down^T is the GEMM that makes da anyway,
    so d(weight) = <da, a> / w. Rows with |w| < TINY_W (0 included) or a
    non-finite w take wp = 1 instead of w (dy unscaled) and are scaled by w
    afterwards (plan.down_bwd), so nothing is divided by a tiny number
    and a NaN weight leaves <dy, o> finite. da keeps exactly the rounding
    PyTorch's autograd has (bf16(w dy), then the GEMM; tiny-w rows add one
    rounding); d(weight) sums <da, a> in fp32. fp16 is the exception: w dy
    leaves fp16's normal range already at |w dy| < 2^-14, so there d(weight)
    comes from a recomputed o (one GEMM more)."""
    I, dt = ctx.I, ctx.x.dtype
    rows = xg.shape[0]
    dy_src = gg if isinstance(gg, DyRows) else None
    if dy_src is not None:  # gathered unscaled only where the unscaled rows are used
        gg = dy_src.gather() if dt == torch.float16 or ctx.has_bias else None
    grp = gemm.Groups(ctx, ecount)
    hh = gate_up(ctx, xg, grp, buf, None) if hcached is None else hcached[:rows]
    a = act(ctx, hh, buf, rows)
    do, w1, dwr = buf.do[:rows], buf.wp[:rows], buf.dwr
    if dt == torch.float16:
        oo = gemm.mm(ctx, a, grp, 1, False, buf.o)                   # [rows, H]
        if ctx.has_bias:
            oo.add_(bias_rows(ctx, grp, buf, 1, rows))
        torch.mul(oo, gg, out=do)                                    # dy . expert output, per row
        torch.sum(do, 1, dtype=torch.float32, out=dwr[:rows])
        oo = None
        torch.mul(gg, wg.unsqueeze(1), out=do)                       # d(expert output) = w * dy
        dda = gemm.mm(ctx, do, grp, 1, True, buf.da)                 # [rows, I]
        ratio = None
    else:
        w1.copy_(wg).masked_fill_(~(wg.abs() >= TINY_W) | torch.isinf(wg), 1.0)  # wp: w, or 1
        if gg is None:
            dy_src.gather(do, scale=w1)                              # d(expert output) = wp * dy, one pass
        else:
            torch.mul(gg, w1.unsqueeze(1), out=do)                   # d(expert output) = wp * dy
        dda = gemm.mm(ctx, do, grp, 1, True, buf.da)                 # [rows, I]: (wp dy) W_down^T
        lp.down_bwd(dda, a, wg, w1, dwr)                             # d(weight); tiny-w rows rescaled
        ratio = torch.div(wg, w1, out=w1) if ctx.has_bias else None  # w / wp: 1 but on replaced rows
    if ctx.has_bias:
        rti = grp.row_table_index()
        segment_sum(buf, do, ratio, rti, g.dbias[:, 2 * I:])        # d b_down = sum of w dy rows
        bd = bias_rows(ctx, grp, buf, 1, rows).mul_(gg)
        if dt != torch.float16:                                      # d(weight) += <dy, b_down>
            dwr[:rows].add_(torch.sum(bd, 1, dtype=torch.float32, out=w1))
        bd = None
    if g.need_dw:
        gemm.dw_accumulate(ctx, a, do, grp, 1, g.dW, g.dWb)          # a rows already carry w / wp
    dh = act_bwd(ctx, hh, dda, buf, rows)
    dda = hh = None
    if ctx.has_bias:
        segment_sum(buf, dh, None, grp.row_table_index(), g.dbias[:, :2 * I])
    if not ctx.split:
        if g.need_dw:
            gemm.dw_accumulate(ctx, xg, dh, grp, 0, g.dW, g.dWb)
        return gemm.mm(ctx, dh, grp, 0, True, buf.o)                 # dx rows [rows, H]
    if g.need_dw:
        gemm.dw_accumulate(ctx, xg, dh[:, :I], grp, 0, g.dW, g.dWb)
        gemm.dw_accumulate(ctx, xg, dh[:, I:], grp, 2, g.dW, g.dWb)
    dxr = gemm.mm(ctx, dh[:, :I], grp, 0, True, buf.o)               # dx = dh_gate W_gate^T + dh_up W_up^T
    return dxr.add_(gemm.mm(ctx, dh[:, I:], grp, 2, True, buf.do))


def lean_ok_static(activation: str, split: bool, bias: bool, dtype: torch.dtype) -> bool:
    """lean_rows_backward applies: swiglu, no biases, not fp16 (gate/up
    weights fused or split)."""
    del split  # both forms: h [rows, 2I] = [gate | up] either way
    return activation == "swiglu" and not bias and dtype != torch.float16


def lean_ok(ctx: Ctx) -> bool:
    """lean_ok_static for this call."""
    return lean_ok_static(ctx.activation, ctx.split, ctx.has_bias, ctx.x.dtype)


class _RowBufs:
    """a and s [rows, I] for act on the lean path."""

    def __init__(self, a, s):
        self.a, self.s = a, s


def lean_rows_backward(ctx: Ctx, hh, make_do, wg, ecount, g: Grads, held, on_dx, xg_rows):
    """rows_backward for a whole step with h cached (lean_ok configs): each
    buffer is allocated at its first use and dropped after its last, as
    permute + grouped_mm's autograd does, and dh [rows, 2I] is written over
    h (hh [rows, 2I], a view of the op's mutable cache). make_do(wp) returns
    the grouped dy rows scaled by wp [rows] fp32, [rows, H] (owned here:
    dropped after their last use; plan.gather_rows with a scale makes them
    in one pass, the values of torch's wp * dy); wg [rows] fp32 the pick weights;
    on_dx(dx rows [rows, H]) consumes the dx rows before they are dropped;
    xg_rows() returns the grouped x rows [rows, H] for dW_gate_up (called
    last). held (workspace.Held) accounts for every buffer allocated
    here. Values: the same ops as rows_backward on the same operands (only
    where results are written differs), so the same bits. Returns
    d(pick weight) [rows] fp32 (counted in held).
    Buffers (rows x ., x dtype unless said): w1, dwr [rows] fp32; do
    [rows, H]; a, s, da [rows, I] (a then reused for d silu(gate)); dx rows
    [rows, H] (split gate/up weights: two, the second added into the first);
    whatever xg_rows() allocates."""
    x, rows, I = ctx.x, hh.shape[0], ctx.I
    grp = gemm.Groups(ctx, ecount)
    w1 = held.new((rows,), torch.float32)
    w1.copy_(wg).masked_fill_(~(wg.abs() >= TINY_W) | torch.isinf(wg), 1.0)  # wp: w, or 1
    do = make_do(w1)                                                 # d(expert output) = wp * dy
    rb = _RowBufs(held.new((rows, I), x.dtype), held.new((rows, I), x.dtype))
    a = act(ctx, hh, rb, rows)
    dda = held.gemm(gemm.mm(ctx, do, grp, 1, True, None))           # [rows, I]: (wp dy) W_down^T
    dwr = held.new((rows,), torch.float32)
    lp.down_bwd(dda, a, wg, w1, dwr)                                 # d(weight); tiny-w rows rescaled
    held.drop(w1)
    w1 = None
    if g.need_dw:
        gemm.dw_accumulate(ctx, a, do, grp, 1, g.dW, g.dWb)
    held.drop(do)
    do = a = None
    lp.swiglu_bwd(hh, dda, rb.s, hh)                                 # dh over h, in place (act_bwd's values)
    held.drop(rb.a, rb.s, dda)
    rb = dda = None
    dxr = _lean_dx(ctx, hh, grp, held)
    on_dx(dxr)
    held.drop(dxr)
    dxr = None
    if g.need_dw:
        xg = xg_rows()
        if ctx.split:
            gemm.dw_accumulate(ctx, xg, hh[:, :I], grp, 0, g.dW, g.dWb)
            gemm.dw_accumulate(ctx, xg, hh[:, I:], grp, 2, g.dW, g.dWb)
        else:
            gemm.dw_accumulate(ctx, xg, hh, grp, 0, g.dW, g.dWb)
    return dwr


def _lean_dx(ctx: Ctx, dh, grp, held):
    """dx rows [rows, H] = dh W_gate_up^T (split: dh_gate W_gate^T + dh_up W_up^T,
    summed as rows_backward sums them), counted in held."""
    I = ctx.I
    if not ctx.split:
        return held.gemm(gemm.mm(ctx, dh, grp, 0, True, None))
    dxr = held.gemm(gemm.mm(ctx, dh[:, :I], grp, 0, True, None))
    up = held.gemm(gemm.mm(ctx, dh[:, I:], grp, 2, True, None))
    dxr.add_(up)
    held.drop(up)
    return dxr


def zero_untouched(ctx: Ctx, g: Grads):
    """Weight gradients of experts that received no rows in this call: 0
    (dW[which] is allocated here when no chunk wrote it)."""
    for which in ctx.kinds:
        if g.dW[which] is None:
            g.dW[which] = ctx.new_dw(which)
        t = ctx.touched[which]
        for le in range(ctx.El):
            if le + ctx.r * ctx.El not in t:
                g.dW[which][le].zero_()
        for e in ctx.borrowed:
            if e not in t:
                g.dWb[which][ctx.slot[e]].zero_()


def return_lent_grads(ctx: Ctx, g: Grads):
    """Weight (and bias) gradients of lent experts come home and are summed
    there: one all-to-all-v in the param dtype, one in fp32 for biases."""
    P, tr, nb = ctx.P, ctx.tr, len(ctx.borrowed)
    send = g.bgrad.reshape(-1) if nb else ctx.wgu.new_empty(0)
    per = ctx.bias_off
    owners = [sum(1 for e in ctx.borrowed if e // ctx.El == o) for o in range(P)]
    lent = [len(l) for l in ctx.lend]
    recv = ctx.wgu.new_empty(sum(lent) * per)
    tr.all_to_all_v(send, [n * per for n in owners], recv, [n * per for n in lent]).wait()
    recv = recv.view(-1, per)
    les = [e - ctx.r * ctx.El for d in range(P) for e in ctx.lend[d]]
    for i, le in enumerate(les):
        for which in ctx.kinds:
            a0, N = ctx.dims(which)
            o = ctx.flat_off[which]
            g.dW[which][le].add_(recv[i, o:o + a0 * N].view(a0, N))
    if g.dbias is not None:
        nbias = g.dbias.shape[1]
        rb = g.dbias.new_empty(sum(lent) * nbias)
        tr.all_to_all_v(g.dbias[ctx.El:].reshape(-1), [n * nbias for n in owners], rb,
                        [n * nbias for n in lent]).wait()
        if les:
            g.dbias[:ctx.El].index_add_(0, torch.tensor(les, dtype=torch.int64, device=g.dbias.device),
                                        rb.view(-1, nbias))


def finish(ctx: Ctx, g: Grads, dx, dtw):
    """The backward's result: (dx [T, H] x dtype, d(topk_weights) [T*K]
    fp32, dW (list by weight kind), d b_gate_up, d b_down): untouched
    experts' gradients zeroed, lent experts' gradients summed in, bias
    gradients in the biases' dtype, shapes and strides (None without
    biases)."""
    zero_untouched(ctx, g)  # before lent experts' gradients are added in
    if ctx.plan.spilled and g.need_dw:
        return_lent_grads(ctx, g)
    if g.dbias is None:
        dbgu = dbd = None
    else:
        dbgu, dbd = torch.empty_like(ctx.bgu_local), torch.empty_like(ctx.bd_local)
        dbgu.copy_(g.dbias[:ctx.El, :2 * ctx.I])
        dbd.copy_(g.dbias[:ctx.El, 2 * ctx.I:])
    return dx.to(ctx.x.dtype), dtw, g.dW, dbgu, dbd
