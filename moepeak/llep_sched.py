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
from .llep_context import LAST_STATS, Ctx
from .llep_workspace import Workspace, cache_slots, slot_elems, workspace_bytes, working_set_bound

# Backward divides d(weight) sums by the pick weight w; below this |w| (and at
# w = 0) dy is left unscaled instead and the row scaled by w afterwards. With
# |w| >= 2^-24, w * dy stays a normal bf16/fp32 number for any |dy| > 2^-102.
_TINY_W = 2.0 ** -24


def _act(h, I, s, a, rows):
    """s = silu(gate), a = s * up  (h = [gate | up], [rows, 2I])."""
    torch.ops.aten.silu.out(h[:rows, :I], out=s[:rows])
    torch.mul(s[:rows], h[:rows, I:], out=a[:rows])


def forward(ctx: Ctx, cache: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [T, H] (x dtype). cache [slots, C*2I] (x dtype, may have 0
    slots): chunk j < slots leaves its h there for backward."""
    x, H, I, C, K, P = ctx.x, ctx.H, ctx.I, ctx.C, ctx.K, ctx.P
    LAST_STATS.update(cached_chunks=min(ctx.n, cache.shape[0] if cache is not None else 0),
                      cache_bytes=cache.numel() * cache.element_size() if cache is not None else 0)
    acc = torch.zeros(ctx.T, H, dtype=torch.float32, device=x.device)
    ws = Workspace(x.device)
    gmm = gemm.grouped_ok(ctx)
    h = ws.gemm_out((C, 2 * I), x.dtype, gmm)
    a = ws.alloc((C, I), x.dtype)
    o = ws.gemm_out((C, H), x.dtype, gmm)
    if P == 1:
        xr = ws.alloc((C, H), x.dtype)
        ws.frozen = True
        for j in range(ctx.n):
            lay = ctx.layout(j)
            idx = ctx.send_idx(lay, None)
            xg = lp.gather_rows(x, idx, K, xr)
            slot = _slot_views(ctx, cache, j)
            y = _experts_fwd(ctx, xg, lay.ecount, h, a, o, slot)
            _zero_tail(slot, idx.numel())
            lp.combine_rows(acc, y, idx, ctx.wflat, K)
            y = None
        _zero_unused(ctx, cache)
        LAST_STATS.update(workspace_bytes=ws.nbytes)
        xr = h = a = o = None  # release the working set before the output copy
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
        hc, idx, buf = p
        hc.wait()
        lp.combine_rows(acc, buf[:idx.numel()], idx, ctx.wflat, K)

    cur, pend = (dispatch(0) if ctx.n else None), None
    for j in range(ctx.n):
        nxt = dispatch(j + 1) if j + 1 < ctx.n else None
        lay, idx, hd = cur
        hd.wait()
        rows = lay.rows
        if rows:
            perm, inv = _perms(lay, permb, invb)
            xg = lp.gather_rows(rx[j % 2], perm, 1, gx)
            y = _experts_fwd(ctx, xg, lay.ecount, h, a, o, _slot_views(ctx, cache, j))
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
    sx = rx = yb = back = gx = h = a = o = cur = pend = None  # release the working set
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


def _experts_fwd(ctx, xg, ecount, h, a, o, slot=None):
    """Expert outputs [rows, H] of the grouped rows xg (h, o: workspace
    buffers or None on the grouped path). With a cache slot [C, 2I] the gate/up
    GEMM's output h lands in it (written there directly, or copied from
    torch._grouped_mm's own output) for backward to use instead of a
    recompute; the values are the very same either way."""
    rows, I = xg.shape[0], ctx.I
    grp = gemm.Groups(ctx, ecount)
    hh = gemm.mm(ctx, xg, grp, 0, False, h if slot is None else slot)
    if slot is not None:
        hh = _keep(hh, slot[:rows])
    torch.ops.aten.silu.out(hh[:, :I], out=a[:rows])
    a[:rows].mul_(hh[:, I:])                                         # a = silu(gate) * up
    hh = None
    return gemm.mm(ctx, a[:rows], grp, 1, False, o)


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
    for which in (0, 1):
        if dW[which] is None:
            dW[which] = ctx.new_dw(which)
        t = ctx.touched[which]
        for le in range(ctx.El):
            if le + ctx.r * ctx.El not in t:
                dW[which][le].zero_()
        for e in ctx.borrowed:
            if e not in t:
                dWb[which][ctx.slot[e]].zero_()


def backward(ctx: Ctx, gy: torch.Tensor, need_dw: bool = True, cache: Optional[torch.Tensor] = None):
    """Returns dx [T, H] (x dtype), d(topk_weights) [T*K] fp32, dW_gate_up and
    dW_down (param dtype; weight gradients of lent experts summed in).
    cache: forward's activation cache (chunks j < slots skip the recompute)."""
    x, H, I, C, K, P = ctx.x, ctx.H, ctx.I, ctx.C, ctx.K, ctx.P
    dev, dt = x.device, x.dtype
    LAST_STATS.update(recomputed_chunks=ctx.n - min(ctx.n, cache.shape[0] if cache is not None else 0))
    dx = torch.zeros(ctx.T, H, dtype=torch.float32, device=dev)
    dtw = torch.zeros(ctx.T * K, dtype=torch.float32, device=dev)
    # dW starts uninitialised (no full-size memset): the first chunk's grouped
    # weight-gradient GEMM returns it (Ctx.dw_accumulate), otherwise it is
    # allocated there; an expert's first rows write it (that GEMM, a copy of a
    # grouped result, or torch.mm(out=)), later ones add; experts that got no
    # rows are zeroed at the end (_zero_untouched).
    dW = [None, None]
    nb = len(ctx.borrowed)
    bgrad = None
    dWb = ([], [])
    if nb:
        bgrad = torch.empty(nb, ctx.per, dtype=ctx.wgu.dtype, device=dev)
        n1 = H * 2 * I
        dWb = ([bgrad[i, :n1].view(H, 2 * I) for i in range(nb)], [bgrad[i, n1:].view(I, H) for i in range(nb)])

    ws = Workspace(dev)
    gmm = gemm.grouped_ok(ctx)
    h, dh = ws.gemm_out((C, 2 * I), dt, gmm), ws.alloc((C, 2 * I), dt)
    s, a, da = ws.alloc((C, I), dt), ws.alloc((C, I), dt), ws.gemm_out((C, I), dt, gmm)
    o, do = ws.gemm_out((C, H), dt, gmm), ws.alloc((C, H), dt)
    wr, wp, dwr = ws.alloc((C,), torch.float32), ws.alloc((C,), torch.float32), ws.alloc((C,), torch.float32)

    def compute(xg, gg, wg, ecount, slot):
        """Recompute h = x W_gate_up for these grouped rows (or, with a cache
        slot, take the h forward left there: the same values), then their
        backward. Returns the dx rows [rows, H]; leaves d(weight) rows in dwr.
        One grouping (offsets copied to the device once) serves all five
        GEMMs of the chunk; h stays alive from the recompute to the last use.
        o = a W_down is never recomputed: d(weight) = <dy, o> = <dy W_down^T, a>,
        and (w dy) W_down^T is the GEMM that makes da anyway, so d(weight) =
        <da, a> / w. Rows with |w| < _TINY_W (0 included) take wp = 1 instead
        of w (dy unscaled) and are scaled by w afterwards (llep_plan.down_bwd),
        so nothing is divided by a tiny number. da keeps exactly the rounding
        PyTorch's autograd has (bf16(w dy), then the GEMM; tiny-w rows add one
        rounding); d(weight) sums <da, a> in fp32. fp16 is the exception: w dy
        leaves fp16's normal range already at |w dy| < 2^-14, so there d(weight)
        comes from a recomputed o (one GEMM more), as before."""
        rows = xg.shape[0]
        grp = gemm.Groups(ctx, ecount)
        if slot is None:
            hh = gemm.mm(ctx, xg, grp, 0, False, h)                        # [rows, 2I]
        else:
            hh = slot[:rows]                                         # (the cache is only read)
        _act(hh, I, s, a, rows)
        if dt == torch.float16:
            oo = gemm.mm(ctx, a[:rows], grp, 1, False, o)                  # [rows, H]
            torch.mul(oo, gg, out=do[:rows])                         # dy . expert output, per row
            torch.sum(do[:rows], 1, dtype=torch.float32, out=dwr[:rows])
            oo = None
            torch.mul(gg, wg.unsqueeze(1), out=do[:rows])            # d(expert output) = w * dy
            dda = gemm.mm(ctx, do[:rows], grp, 1, True, da)                # [rows, I]
        else:
            w1 = wp[:rows]
            w1.copy_(wg).masked_fill_(wg.abs() < _TINY_W, 1.0)       # wp: w, or 1 for tiny |w|
            torch.mul(gg, w1.unsqueeze(1), out=do[:rows])            # d(expert output) = wp * dy
            dda = gemm.mm(ctx, do[:rows], grp, 1, True, da)                # [rows, I]: (wp dy) W_down^T
            lp.down_bwd(dda, a[:rows], wg, w1, dwr)                  # d(weight); tiny-w rows rescaled
        if need_dw:
            gemm.dw_accumulate(ctx, a[:rows], do[:rows], grp, 1, dW, dWb)  # a rows already carry w / wp
        torch.mul(dda, s[:rows], out=dh[:rows, I:])                  # d up = da * silu(gate)
        torch.mul(dda, hh[:, I:], out=s[:rows])                      # d silu(gate) = da * up
        dda = None
        torch.ops.aten.silu_backward.grad_input(s[:rows], hh[:, :I], grad_input=dh[:rows, :I])
        hh = None
        if need_dw:
            gemm.dw_accumulate(ctx, xg, dh[:rows], grp, 0, dW, dWb)
        return gemm.mm(ctx, dh[:rows], grp, 0, True, o)                    # dx rows [rows, H]

    if P == 1:
        xr, gr = ws.alloc((C, H), dt), ws.alloc((C, H), dt)
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
            dtw.index_copy_(0, idx, dwr[:rows])
        LAST_STATS.update(workspace_bytes_bwd=ws.nbytes)
        # release the working set (closure cells included) before the dx copy
        h = dh = s = a = da = o = do = wr = wp = dwr = xr = gr = None
        _zero_untouched(ctx, dW, dWb)
        return dx.to(dt), dtw, dW[0], dW[1]

    tr = ctx.tr
    sx, sg, rx, rg, dxb, back = (ws.ring(2, (C, H), dt) for _ in range(6))
    gx, gg_ = ws.alloc((C, H), dt), ws.alloc((C, H), dt)
    sw, rw, dwb, dwback = (ws.ring(2, (C,), torch.float32) for _ in range(4))
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
            torch.index_select(dwr[:rows], 0, inv, out=dwb[b][:rows])
        ns = idx.numel()
        hc = [tr.all_to_all_v(dxb[b][:rows], lay.recv_len, back[b][:ns], lay.send_len),
              tr.all_to_all_v(dwb[b][:rows], lay.recv_len, dwback[b][:ns], lay.send_len)]
        if pend is not None:
            finish(pend)
        pend, cur = (hc, idx, b), nxt
    if pend is not None:
        finish(pend)
    LAST_STATS.update(workspace_bytes_bwd=ws.nbytes)
    h = dh = s = a = da = o = do = wr = wp = dwr = None
    sx = sg = rx = rg = dxb = back = gx = gg_ = sw = rw = dwb = dwback = cur = pend = None
    _zero_untouched(ctx, dW, dWb)  # before lent experts' gradients are added in

    if ctx.plan.spilled and need_dw:
        # Weight gradients of lent experts come home and are summed there.
        send = bgrad.reshape(-1) if nb else ctx.wgu.new_empty(0)
        send_counts = [sum(1 for e in ctx.borrowed if e // ctx.El == o) * ctx.per for o in range(P)]
        recv_counts = [len(l) * ctx.per for l in ctx.lend]
        recv = ctx.wgu.new_empty(sum(recv_counts))
        tr.all_to_all_v(send, send_counts, recv, recv_counts).wait()
        recv = recv.view(-1, ctx.per)
        n1 = H * 2 * I
        i = 0
        for d in range(P):
            for e in ctx.lend[d]:
                le = e - ctx.r * ctx.El
                dW[0][le].add_(recv[i, :n1].view(H, 2 * I))
                dW[1][le].add_(recv[i, n1:].view(I, H))
                i += 1
    return dx.to(dt), dtw, dW[0], dW[1]

__all__ = ["Ctx", "LAST_STATS", "forward", "backward", "cache_slots", "slot_elems", "workspace_bytes",
           "working_set_bound"]
