"""PipelinedLLEP schedules: forward and backward, readable top to bottom.

Per call (forward, and again in backward: nothing routing-sized is saved):
the per-call state (moepeak/llep_context.py: counts, plan, send list, lent
weights), then the chunk loop. Forward: dispatch(j+1) is issued before
GEMM(j), combine(j) is issued after GEMM(j) and finished after GEMM(j+1).
Backward: the same with chunks in reverse order and x, dy and the pick weights
travelling; dx rows and d(topk_weights) come back; borrowed experts' weight
gradients return to their owner at the end and are summed there.

The buffers are allocated once per call from C, never from the routing
(moepeak/llep_workspace.py lists them); the GEMMs are moepeak/llep_gemm.py.
Per chunk the host does no device read: offsets come from the chunk layout
(host) in one copy per GEMM grouping. Backward never recomputes o = a W_down:
d(pick weight) = <dy, o> = <dy W_down^T, a>, and dy W_down^T is the GEMM
backward makes anyway (see compute() in backward).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import llep_gemm as gemm
from . import llep_plan as lp
from .llep_context import GPT_OSS_ALPHA, GPT_OSS_LIMIT, LAST_STATS, Ctx
from .llep_workspace import Workspace, cache_slots, slot_elems, workspace_bytes, working_set_bound

# Backward divides d(weight) sums by the pick weight w; below this |w| (and at
# w = 0, and for a non-finite w) dy is left unscaled instead and the row scaled
# by w afterwards. With |w| >= 2^-24, w * dy stays a normal bf16/fp32 number
# for any |dy| > 2^-102. A NaN or infinite w thus never enters d(weight) =
# <dy, o>, which is finite whenever dy and o are (as in the dense reference).
_TINY_W = 2.0 ** -24


class _Bufs:
    """The working-set buffers one call's expert compute uses (names as in
    moepeak/llep_workspace.py); None where a path does not need one."""

    def __init__(self, ctx, ws, gmm, backward):
        C, H, I, dt = ctx.C, ctx.H, ctx.I, ctx.x.dtype
        gate_up_out = ws.alloc if ctx.split else (lambda shape, dtype: ws.gemm_out(shape, dtype, gmm))
        self.h = gate_up_out((C, 2 * I), dt)
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


def _gate_views(ctx, hh):
    """(gate, up) views [rows, I] of h [rows, 2I] in ctx.activation's layout."""
    I = ctx.I
    if ctx.activation == "gpt_oss" and not ctx.split:
        return hh[:, 0::2], hh[:, 1::2]
    return hh[:, :I], hh[:, I:]


def _gate_up(ctx, xg, grp, buf, slot):
    """h [rows, 2I] = xg W_gate_up (+ b_gate_up per row's expert), written to
    the cache slot when there is one (for backward, no recompute)."""
    rows, I = xg.shape[0], ctx.I
    if ctx.split:  # two GEMMs into the column halves of one [C, 2I] buffer
        dst = buf.h if slot is None else slot
        _keep(gemm.mm(ctx, xg, grp, 0, False, dst[:, :I]), dst[:rows, :I])
        _keep(gemm.mm(ctx, xg, grp, 2, False, dst[:, I:]), dst[:rows, I:])
        hh = dst[:rows]
    else:
        hh = gemm.mm(ctx, xg, grp, 0, False, buf.h if slot is None else slot)
        if slot is not None:
            hh = _keep(hh, slot[:rows])
    if ctx.has_bias:
        hh.add_(_bias_rows(ctx, grp, buf, 0, rows))
    return hh


def _bias_rows(ctx, grp, buf, which, rows):
    """[rows, N] (x dtype, in the bias scratch): each grouped row's expert's
    b_gate_up (which 0) or b_down (1)."""
    table = ctx.bias_table[0 if which == 0 else 1]
    out = buf.scratch(rows, table.shape[1], ctx.x.dtype)
    return torch.index_select(table, 0, grp.row_table_index(), out=out)


def _act(ctx, hh, buf, rows):
    """a [rows, I] = act(gate, up) into buf.a; swiglu also leaves s = silu(gate)
    in buf.s (backward uses it). gpt_oss, in Hugging Face's order of ops:
    g = gate.clamp(max=7); glu = g * sigmoid(g * 1.702); a = (up.clamp(-7, 7) + 1) * glu."""
    gate, up = _gate_views(ctx, hh)
    a = buf.a[:rows]
    if ctx.activation == "swiglu":
        if buf.s is None:
            torch.ops.aten.silu.out(gate, out=a)
            a.mul_(up)
        else:
            s = buf.s[:rows]
            torch.ops.aten.silu.out(gate, out=s)
            torch.mul(s, up, out=a)
        return a
    s = buf.s[:rows]
    torch.clamp(gate, max=GPT_OSS_LIMIT, out=s)                      # g
    torch.mul(s, GPT_OSS_ALPHA, out=a)
    torch.sigmoid(a, out=a)
    a.mul_(s)                                                        # glu = g * sigmoid(g * alpha)
    torch.clamp(up, min=-GPT_OSS_LIMIT, max=GPT_OSS_LIMIT, out=s)
    s.add_(1)
    a.mul_(s)                                                        # a = (u + 1) * glu
    return a


def _act_bwd(ctx, hh, dda, buf, rows):
    """dh [rows, 2I] (buf.dh, h's layout) from da = dda [rows, I] (dda is
    overwritten); swiglu reads buf.s = silu(gate) left by _act. The
    gradients through clamp are zero outside the clamp range (bounds
    included in it), as torch's."""
    gate, up = _gate_views(ctx, hh)
    dgate, dup = _gate_views(ctx, buf.dh[:rows])
    if ctx.activation == "swiglu":
        s = buf.s[:rows]
        torch.mul(dda, s, out=dup)                                   # d up = da * silu(gate)
        torch.mul(dda, up, out=s)                                    # d silu(gate) = da * up
        torch.ops.aten.silu_backward.grad_input(s, gate, grad_input=dgate)
        return buf.dh[:rows]
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


def forward(ctx: Ctx, cache: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [T, H] (x dtype). cache [slots, C*2I] (x dtype, may have 0
    slots): chunk j < slots leaves its h there for backward."""
    x, H, I, C, K, P = ctx.x, ctx.H, ctx.I, ctx.C, ctx.K, ctx.P
    LAST_STATS.update(cached_chunks=min(ctx.n, cache.shape[0] if cache is not None else 0),
                      cache_bytes=cache.numel() * cache.element_size() if cache is not None else 0)
    acc = torch.zeros(ctx.T, H, dtype=torch.float32, device=x.device)
    ws = Workspace(x.device)
    buf = _Bufs(ctx, ws, gemm.grouped_ok(ctx), backward=False)
    if P == 1:
        xr = ws.alloc((C, H), x.dtype)
        ws.frozen = True
        for j in range(ctx.n):
            lay = ctx.layout(j)
            idx = ctx.send_idx(lay, None)
            xg = lp.gather_rows(x, idx, K, xr)
            slot = _slot_views(ctx, cache, j)
            y = _experts_fwd(ctx, xg, lay.ecount, buf, slot)
            _zero_tail(slot, idx.numel())
            lp.combine_rows(acc, y, idx, ctx.wflat, K)
            y = None
        _zero_unused(ctx, cache)
        LAST_STATS.update(workspace_bytes=ws.nbytes)
        xr = buf = None  # release the working set before the output copy
        return acc.to(x.dtype)

    tr = ctx.tr
    sx, rx, yb, back = (ws.ring(2, (C, H), x.dtype) for _ in range(4))
    gx = ws.alloc((C, H), x.dtype)
    idxr = ws.ring(3, (C,), torch.int64)
    permb, invb = ws.alloc((C,), torch.int64), ws.alloc((C,), torch.int64)
    ws.frozen = True

    def dispatch(j):
        lay = ctx.layout(j)
        idx = ctx.send_idx(lay, idxr[j % 3])
        lp.gather_rows(x, idx, K, sx[j % 2])
        hd = tr.all_to_all_v(sx[j % 2][:idx.numel()], lay.send_len, rx[j % 2][:lay.rows], lay.recv_len)
        return lay, idx, hd

    def finish(p):
        hc, idx, b = p
        hc.wait()
        lp.combine_rows(acc, b[:idx.numel()], idx, ctx.wflat, K)

    cur, pend = (dispatch(0) if ctx.n else None), None
    for j in range(ctx.n):
        nxt = dispatch(j + 1) if j + 1 < ctx.n else None
        lay, idx, hd = cur
        hd.wait()
        rows = lay.rows
        if rows:
            perm, inv = _perms(lay, permb, invb)
            xg = lp.gather_rows(rx[j % 2], perm, 1, gx)
            y = _experts_fwd(ctx, xg, lay.ecount, buf, _slot_views(ctx, cache, j))
            lp.gather_rows(y, inv, 1, yb[j % 2])
            y = None
        _zero_tail(_slot_views(ctx, cache, j), rows)
        hc = tr.all_to_all_v(yb[j % 2][:rows], lay.recv_len, back[j % 2][:idx.numel()], lay.send_len)
        if pend is not None:
            finish(pend)
        pend, cur = (hc, idx, back[j % 2]), nxt
    if pend is not None:
        finish(pend)
    _zero_unused(ctx, cache)
    LAST_STATS.update(workspace_bytes=ws.nbytes)
    sx = rx = yb = back = gx = buf = cur = pend = None  # release the working set
    return acc.to(x.dtype)


def _perms(lay, permb, invb):
    """Grouped->receive permutation and its inverse, copied to the device."""
    rows = lay.rows
    inv = torch.empty(rows, dtype=torch.int64)
    inv[lay.perm] = torch.arange(rows, dtype=torch.int64)
    permb[:rows].copy_(lay.perm, non_blocking=True)
    invb[:rows].copy_(inv, non_blocking=True)
    return permb[:rows], invb[:rows]


def _slot_views(ctx, cache, j):
    """Chunk j's activation-cache view h [C, 2I] (slot j of cache
    [slots, C*2I]), or None when chunk j has no slot."""
    if cache is None or j >= cache.shape[0]:
        return None
    return cache[j].view(ctx.C, 2 * ctx.I)


def _experts_fwd(ctx, xg, ecount, buf, slot=None):
    """Expert outputs [rows, H] (b_down included) of the grouped rows xg.
    With a cache slot [C, 2I] the gate/up GEMM's output h (bias included)
    lands in it for backward to use instead of a recompute; the values are
    the very same either way."""
    rows = xg.shape[0]
    grp = gemm.Groups(ctx, ecount)
    hh = _gate_up(ctx, xg, grp, buf, slot)
    a = _act(ctx, hh, buf, rows)
    hh = None
    o = gemm.mm(ctx, a, grp, 1, False, buf.o)
    if ctx.has_bias:
        o.add_(_bias_rows(ctx, grp, buf, 1, rows))
    return o


def _zero_tail(slot, rows):
    """Rows past the chunk's own in its cache slot are zeroed, so the cache
    (an op output) is fully defined; a no-op for full chunks."""
    if slot is not None and rows < slot.shape[0]:
        slot[rows:].zero_()


def _zero_unused(ctx, cache):
    """Slots beyond the n chunks (possible at P > 1 or with T = 0): zeroed."""
    if cache is not None and cache.shape[0] > ctx.n:
        cache[ctx.n:].zero_()


def _keep(res, dst):
    """res stored in dst (a copy only when the GEMM did not write dst)."""
    if res.data_ptr() != dst.data_ptr():
        dst.copy_(res)
    return dst


def _zero_untouched(ctx, dW, dWb):
    """Weight gradients of experts that received no rows in this call: 0
    (dW[which] is allocated here when no chunk wrote it)."""
    for which in ctx.kinds:
        if dW[which] is None:
            dW[which] = ctx.new_dw(which)
        t = ctx.touched[which]
        for le in range(ctx.El):
            if le + ctx.r * ctx.El not in t:
                dW[which][le].zero_()
        for e in ctx.borrowed:
            if e not in t:
                dWb[which][ctx.slot[e]].zero_()


def _segment_sum(ctx, buf, src, ratio, rti, dst):
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


def backward(ctx: Ctx, gy: torch.Tensor, need_dw: bool = True, cache: Optional[torch.Tensor] = None,
             overwrite_cache: bool = False):
    """Returns dx [T, H] (x dtype), d(topk_weights) [T*K] fp32, dW (a list
    indexed by weight kind, None where absent; param dtype; weight gradients
    of lent experts summed in) and d biases (db_gate_up, db_down) like the
    biases (or None). cache: forward's activation cache (chunks j < slots
    skip the recompute). overwrite_cache: on the one-chunk path
    (lean_one_chunk) dh is written over the cached h (_backward_one_chunk)."""
    x, H, I, C, K, P = ctx.x, ctx.H, ctx.I, ctx.C, ctx.K, ctx.P
    dev, dt = x.device, x.dtype
    LAST_STATS.update(recomputed_chunks=ctx.n - min(ctx.n, cache.shape[0] if cache is not None else 0),
                      lean_one_chunk=False)
    dx = torch.zeros(ctx.T, H, dtype=torch.float32, device=dev)
    dtw = torch.zeros(ctx.T * K, dtype=torch.float32, device=dev)
    # dW starts uninitialised (no full-size memset): the first chunk's grouped
    # weight-gradient GEMM returns it (Ctx.dw_accumulate), otherwise it is
    # allocated there; an expert's first rows write it (that GEMM, a copy of a
    # grouped result, or torch.mm(out=)), later ones add; experts that got no
    # rows are zeroed at the end (_zero_untouched).
    dW = [None, None, None]
    nb = len(ctx.borrowed)
    bgrad = None
    dWb = ([], [], [])
    if nb:
        bgrad = torch.empty(nb, ctx.bias_off, dtype=ctx.wgu.dtype, device=dev)
        for which in ctx.kinds:
            a0, N = ctx.dims(which)
            o = ctx.flat_off[which]
            dWb[which].extend(bgrad[i, o:o + a0 * N].view(a0, N) for i in range(nb))
    # bias gradients, fp32, rows as ctx.bias_table's (local experts, then borrowed slots)
    dbias = torch.zeros(ctx.El + nb, 2 * I + H, dtype=torch.float32, device=dev) if ctx.has_bias else None

    if overwrite_cache and lean_one_chunk(ctx, cache):
        _backward_one_chunk(ctx, gy, need_dw, cache[0].view(C, 2 * I), dx, dtw, dW, dWb)
        _zero_untouched(ctx, dW, dWb)
        return (dx.to(dt), dtw, dW) + _bias_grads(ctx, dbias)

    ws = Workspace(dev)
    buf = _Bufs(ctx, ws, gemm.grouped_ok(ctx), backward=True)

    def compute(xg, gg, wg, ecount, slot):
        """Recompute h = x W_gate_up (+ bias) for these grouped rows (or, with a
        cache slot, take the h forward left there: the same values), then
        their backward. Returns the dx rows [rows, H]; leaves d(weight) rows
        in dwr. One grouping (offsets copied to the device once) serves all
        GEMMs of the chunk; h stays alive from the recompute to the last use.
        o = a W_down is never recomputed: d(weight) = <dy, o> = <dy W_down^T, a>
        (+ <dy, b_down>), and (w dy) W_down^T is the GEMM that makes da
        anyway, so d(weight) = <da, a> / w. Rows with |w| < _TINY_W (0
        included) or a non-finite w take wp = 1 instead of w (dy unscaled)
        and are scaled by w afterwards (llep_plan.down_bwd), so nothing is
        divided by a tiny number and a NaN weight leaves <dy, o> finite. da
        keeps exactly the rounding PyTorch's autograd has (bf16(w dy), then
        the GEMM; tiny-w rows add one rounding); d(weight) sums <da, a> in
        fp32. fp16 is the exception: w dy leaves fp16's normal range already
        at |w dy| < 2^-14, so there d(weight) comes from a recomputed o (one
        GEMM more)."""
        rows = xg.shape[0]
        grp = gemm.Groups(ctx, ecount)
        hh = _gate_up(ctx, xg, grp, buf, None) if slot is None else slot[:rows]  # (the cache is only read)
        a = _act(ctx, hh, buf, rows)
        do, w1, dwr = buf.do[:rows], buf.wp[:rows], buf.dwr
        if dt == torch.float16:
            oo = gemm.mm(ctx, a, grp, 1, False, buf.o)               # [rows, H]
            if ctx.has_bias:
                oo.add_(_bias_rows(ctx, grp, buf, 1, rows))
            torch.mul(oo, gg, out=do)                                # dy . expert output, per row
            torch.sum(do, 1, dtype=torch.float32, out=dwr[:rows])
            oo = None
            torch.mul(gg, wg.unsqueeze(1), out=do)                   # d(expert output) = w * dy
            dda = gemm.mm(ctx, do, grp, 1, True, buf.da)             # [rows, I]
            ratio = None
        else:
            w1.copy_(wg).masked_fill_(~(wg.abs() >= _TINY_W) | torch.isinf(wg), 1.0)  # wp: w, or 1
            torch.mul(gg, w1.unsqueeze(1), out=do)                   # d(expert output) = wp * dy
            dda = gemm.mm(ctx, do, grp, 1, True, buf.da)             # [rows, I]: (wp dy) W_down^T
            lp.down_bwd(dda, a, wg, w1, dwr)                         # d(weight); tiny-w rows rescaled
            ratio = torch.div(wg, w1, out=w1) if ctx.has_bias else None  # w / wp: 1 but on replaced rows
        if ctx.has_bias:
            rti = grp.row_table_index()
            _segment_sum(ctx, buf, do, ratio, rti, dbias[:, 2 * I:])  # d b_down = sum of w dy rows
            bd = _bias_rows(ctx, grp, buf, 1, rows).mul_(gg)
            if dt != torch.float16:                                  # d(weight) += <dy, b_down>
                dwr[:rows].add_(torch.sum(bd, 1, dtype=torch.float32, out=w1))
            bd = None
        if need_dw:
            gemm.dw_accumulate(ctx, a, do, grp, 1, dW, dWb)          # a rows already carry w / wp
        dh = _act_bwd(ctx, hh, dda, buf, rows)
        dda = hh = None
        if ctx.has_bias:
            _segment_sum(ctx, buf, dh, None, grp.row_table_index(), dbias[:, :2 * I])
        if not ctx.split:
            if need_dw:
                gemm.dw_accumulate(ctx, xg, dh, grp, 0, dW, dWb)
            return gemm.mm(ctx, dh, grp, 0, True, buf.o)             # dx rows [rows, H]
        if need_dw:
            gemm.dw_accumulate(ctx, xg, dh[:, :I], grp, 0, dW, dWb)
            gemm.dw_accumulate(ctx, xg, dh[:, I:], grp, 2, dW, dWb)
        dxr = gemm.mm(ctx, dh[:, :I], grp, 0, True, buf.o)           # dx = dh_gate W_gate^T + dh_up W_up^T
        return dxr.add_(gemm.mm(ctx, dh[:, I:], grp, 2, True, buf.do))

    if P == 1:
        xr, gr = ws.alloc((C, H), dt), ws.alloc((C, H), dt)
        wr = ws.alloc((C,), torch.float32)
        ws.frozen = True
        for j in reversed(range(ctx.n)):
            lay = ctx.layout(j)
            idx = ctx.send_idx(lay, None)
            rows = idx.numel()
            xg = lp.gather_rows(x, idx, K, xr)
            gg = lp.gather_rows(gy, idx, K, gr)
            torch.index_select(ctx.wflat, 0, idx, out=wr[:rows])
            dxr = compute(xg, gg, wr[:rows], lay.ecount, _slot_views(ctx, cache, j))
            lp.combine_rows(dx, dxr, idx, None, K)
            dxr = None
            dtw.index_copy_(0, idx, buf.dwr[:rows])
        LAST_STATS.update(workspace_bytes_bwd=ws.nbytes)
        # release the working set (closure cells included) before the dx copy
        buf = xr = gr = wr = None
        _zero_untouched(ctx, dW, dWb)
        return (dx.to(dt), dtw, dW) + _bias_grads(ctx, dbias)

    tr = ctx.tr
    sx, sg, rx, rg, dxb, back = (ws.ring(2, (C, H), dt) for _ in range(6))
    gx, gg_ = ws.alloc((C, H), dt), ws.alloc((C, H), dt)
    sw, rw, dwb, dwback = (ws.ring(2, (C,), torch.float32) for _ in range(4))
    wr = ws.alloc((C,), torch.float32)
    idxr = ws.ring(3, (C,), torch.int64)
    permb, invb = ws.alloc((C,), torch.int64), ws.alloc((C,), torch.int64)
    ws.frozen = True

    def dispatch(j):
        lay = ctx.layout(j)
        b = j % 2
        idx = ctx.send_idx(lay, idxr[j % 3])
        ns = idx.numel()
        lp.gather_rows(x, idx, K, sx[b])
        lp.gather_rows(gy, idx, K, sg[b])
        torch.index_select(ctx.wflat, 0, idx, out=sw[b][:ns])
        hs = [tr.all_to_all_v(sx[b][:ns], lay.send_len, rx[b][:lay.rows], lay.recv_len),
              tr.all_to_all_v(sg[b][:ns], lay.send_len, rg[b][:lay.rows], lay.recv_len),
              tr.all_to_all_v(sw[b][:ns], lay.send_len, rw[b][:lay.rows], lay.recv_len)]
        return lay, idx, hs

    def finish(p):
        hs, idx, b = p
        for hnd in hs:
            hnd.wait()
        ns = idx.numel()
        lp.combine_rows(dx, back[b][:ns], idx, None, K)
        dtw.index_copy_(0, idx, dwback[b][:ns])

    order = list(reversed(range(ctx.n)))
    cur, pend = (dispatch(order[0]) if order else None), None
    for i, j in enumerate(order):
        nxt = dispatch(order[i + 1]) if i + 1 < len(order) else None
        lay, idx, hs = cur
        for hnd in hs:
            hnd.wait()
        b, rows = j % 2, lay.rows
        if rows:
            perm, inv = _perms(lay, permb, invb)
            xg = lp.gather_rows(rx[b], perm, 1, gx)
            gg = lp.gather_rows(rg[b], perm, 1, gg_)
            torch.index_select(rw[b][:rows], 0, perm, out=wr[:rows])
            dxr = compute(xg, gg, wr[:rows], lay.ecount, _slot_views(ctx, cache, j))
            lp.gather_rows(dxr, inv, 1, dxb[b])
            dxr = None
            torch.index_select(buf.dwr[:rows], 0, inv, out=dwb[b][:rows])
        ns = idx.numel()
        hc = [tr.all_to_all_v(dxb[b][:rows], lay.recv_len, back[b][:ns], lay.send_len),
              tr.all_to_all_v(dwb[b][:rows], lay.recv_len, dwback[b][:ns], lay.send_len)]
        if pend is not None:
            finish(pend)
        pend, cur = (hc, idx, b), nxt
    if pend is not None:
        finish(pend)
    LAST_STATS.update(workspace_bytes_bwd=ws.nbytes)
    buf = wr = None
    sx = sg = rx = rg = dxb = back = gx = gg_ = sw = rw = dwb = dwback = cur = pend = None
    _zero_untouched(ctx, dW, dWb)  # before lent experts' gradients are added in

    if ctx.plan.spilled and need_dw:
        _return_lent_grads(ctx, bgrad, dW, dbias)
    return (dx.to(dt), dtw, dW) + _bias_grads(ctx, dbias)


def lean_one_chunk(ctx: Ctx, cache: Optional[torch.Tensor]) -> bool:
    """Backward takes the one-chunk path (_backward_one_chunk): one rank, one
    chunk, its h cached, swiglu on fused gate/up weights, no biases, not fp16."""
    return (ctx.P == 1 and ctx.n == 1 and cache is not None and cache.shape[0] >= 1
            and ctx.activation == "swiglu" and not ctx.split and not ctx.has_bias
            and ctx.x.dtype != torch.float16)


class _RowBufs:
    """a and s [rows, I] for _act / _act_bwd on the one-chunk path."""

    def __init__(self, a, s):
        self.a, self.s = a, s


def _backward_one_chunk(ctx, gy, need_dw, hcache, dx, dtw, dW, dWb):
    """Backward of one chunk (rows = T*K) at P = 1 with h cached: each buffer
    is allocated at its first use and dropped after its last, as permute +
    grouped_mm's autograd does, and dh [rows, 2I] is written over the cached
    h (hcache [C, 2I], the op's mutable cache), so the peak is
    llep_workspace.one_chunk_peak_bytes. Values: the same ops as compute()
    on the same operands (only where results are written differs), so the
    same bits.
    Buffers (rows x ., x dtype unless said): do [rows, H] (gathered dy,
    then w*dy in place); a, s, da [rows, I] (a then reused for d silu(gate));
    wg, w1, dwr [rows] fp32; dx rows [rows, H]; gathered x [rows, H] last."""
    x, H, K = ctx.x, ctx.H, ctx.K
    lay = ctx.layout(0)
    idx = ctx.send_idx(lay, None)
    rows = idx.numel()
    grp = gemm.Groups(ctx, lay.ecount)
    hh = hcache[:rows]
    wg = torch.index_select(ctx.wflat, 0, idx)
    w1 = wg.clone().masked_fill_(~(wg.abs() >= _TINY_W) | torch.isinf(wg), 1.0)  # wp: w, or 1
    do = lp.gather_rows(gy, idx, K, gy.new_empty(rows, H))
    torch.mul(do, w1.unsqueeze(1), out=do)                           # d(expert output) = wp * dy
    rb = _RowBufs(x.new_empty(rows, ctx.I), x.new_empty(rows, ctx.I))
    a = _act(ctx, hh, rb, rows)
    dda = gemm.mm(ctx, do, grp, 1, True, None)                       # [rows, I]: (wp dy) W_down^T
    dwr = torch.empty(rows, dtype=torch.float32, device=x.device)
    lp.down_bwd(dda, a, wg, w1, dwr)                                 # d(weight); tiny-w rows rescaled
    if need_dw:
        gemm.dw_accumulate(ctx, a, do, grp, 1, dW, dWb)
    do = a = None
    gate, up = _gate_views(ctx, hh)                                  # dh over h, in place:
    torch.mul(dda, up, out=rb.a)                                     # d silu(gate) = da * up
    torch.mul(dda, rb.s, out=up)                                     # d up = da * silu(gate)
    torch.ops.aten.silu_backward.grad_input(rb.a, gate, grad_input=gate)
    rb = dda = None
    dxr = gemm.mm(ctx, hh, grp, 0, True, None)                       # dx rows [rows, H]
    lp.combine_rows(dx, dxr, idx, None, K)
    dxr = None
    dtw.index_copy_(0, idx, dwr)
    if need_dw:
        xg = lp.gather_rows(x, idx, K, x.new_empty(rows, H))
        gemm.dw_accumulate(ctx, xg, hh, grp, 0, dW, dWb)
    # the largest phase's buffers (do, a, s, da); the cache holds h, then dh
    LAST_STATS.update(workspace_bytes_bwd=x.element_size() * rows * (H + 3 * ctx.I), lean_one_chunk=True)


def _return_lent_grads(ctx, bgrad, dW, dbias):
    """Weight (and bias) gradients of lent experts come home and are summed
    there: one all-to-all-v in the param dtype, one in fp32 for biases."""
    P, tr, nb = ctx.P, ctx.tr, len(ctx.borrowed)
    send = bgrad.reshape(-1) if nb else ctx.wgu.new_empty(0)
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
            dW[which][le].add_(recv[i, o:o + a0 * N].view(a0, N))
    if dbias is not None:
        nbias = dbias.shape[1]
        rb = dbias.new_empty(sum(lent) * nbias)
        tr.all_to_all_v(dbias[ctx.El:].reshape(-1), [n * nbias for n in owners], rb,
                        [n * nbias for n in lent]).wait()
        if les:
            dbias[:ctx.El].index_add_(0, torch.tensor(les, dtype=torch.int64, device=dbias.device),
                                      rb.view(-1, nbias))


def _bias_grads(ctx, dbias):
    """(d b_gate_up, d b_down) with the biases' shapes and strides (param
    dtype), from the fp32 sums of this rank's experts; (None, None) without biases."""
    if dbias is None:
        return None, None
    dbgu, dbd = torch.empty_like(ctx.bgu_local), torch.empty_like(ctx.bd_local)
    dbgu.copy_(dbias[:ctx.El, :2 * ctx.I])
    dbd.copy_(dbias[:ctx.El, 2 * ctx.I:])
    return dbgu, dbd


__all__ = ["Ctx", "LAST_STATS", "forward", "backward", "lean_one_chunk", "cache_slots", "slot_elems", "workspace_bytes",
           "working_set_bound"]
