"""PipelinedLLEP schedules: forward and backward, readable top to bottom.

Per call (forward, and again in backward: nothing routing-sized is saved):
the per-call state (moepeak/llep/context.py: counts, plan, send list, lent
weights), then either the one-chunk step (moepeak/llep/one_chunk.py: P > 1
when one chunk covers every rank's rows; P = 1's lean backward) or the chunk
loop. Forward: dispatch(j+1) is issued before GEMM(j), combine(j) is issued
after GEMM(j) and finished after GEMM(j+1), through one buffer of each kind.
Backward: the same with chunks in reverse order and x, dy and the pick
weights travelling; dx rows and d(topk_weights) come back; borrowed experts'
weight gradients return to their owner at the end and are summed there.

The buffers are allocated once per call from C, never from the routing
(moepeak/llep/sizes.py lists them); the expert arithmetic is
moepeak/llep/experts.py, the GEMMs moepeak/llep/gemm.py. Per chunk the host
does no device read: offsets and permutations come from the chunk layout
(host) in pinned host->device copies (Ctx.host_to_device, Ctx.grouped_perms).
Backward never recomputes o = a W_down (experts.rows_backward).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import gemm
from . import one_chunk as one
from . import plan as lp
from .context import Ctx
from .experts import Bufs, DyRows, Grads, experts_fwd, finish, lean_ok, rows_backward
from .workspace import Workspace


def forward(ctx: Ctx, cache: Optional[torch.Tensor] = None, keep: bool = False) -> torch.Tensor:
    """y [T, H] (x dtype). cache [slots, C*2I] (x dtype, may have 0
    slots): chunk j < slots leaves its h there for backward; on the P > 1
    one-chunk step with keep, h and the grouped x rows (one_chunk)."""
    x, H, C, K, P = ctx.x, ctx.H, ctx.C, ctx.K, ctx.P
    if ctx.one_chunk:
        return one.forward_ep(ctx, cache, keep)
    ctx.stats.update(cached_chunks=min(ctx.n, cache.shape[0] if cache is not None else 0),
                      cache_bytes=cache.numel() * cache.element_size() if cache is not None else 0)
    acc = torch.zeros(ctx.T, H, dtype=torch.float32, device=x.device)
    ws = Workspace(x.device)
    all_cached = cache is not None and cache.shape[0] >= ctx.n  # every chunk's h goes to its slot
    buf = Bufs(ctx, ws, gemm.grouped_ok(ctx), backward=False, h_in_cache=all_cached)
    if P == 1:
        xr = ws.alloc((C, H), x.dtype)
        ws.frozen = True
        for j in range(ctx.n):
            lay = ctx.layout(j)
            idx = ctx.send_idx(lay, None)
            xg = lp.gather_rows(x, idx, K, xr)
            slot = _slot_views(ctx, cache, j)
            y = experts_fwd(ctx, xg, lay.ecount, buf, slot)
            _zero_tail(slot, idx.numel())
            lp.combine_rows(acc, y, idx, ctx.wflat, K)
            y = None
        _zero_unused(ctx, cache)
        ctx.stats.update(workspace_bytes=ws.nbytes)
        xr = buf = None  # release the working set before the output copy
        return acc.to(x.dtype)

    # One send, receive, combine-send and combine-receive buffer each: chunk
    # j+1's dispatch is issued once chunk j's rows are grouped out of rx (and
    # its own send has completed), and chunk j's combine once chunk j-1's has
    # been summed in, so every buffer's next writer is ordered after its last
    # reader (on the stream, or by a wait) and both collectives still overlap
    # chunk j's GEMMs.
    tr = ctx.tr
    sx, rx, yb, back = (ws.alloc((C, H), x.dtype) for _ in range(4))
    gx = ws.alloc((C, H), x.dtype)
    idxr = ws.ring(3, (C,), torch.int64)  # send indices of chunks j-1, j, j+1
    pib = ws.alloc((2 * C,), torch.int64)  # a chunk's perm and inverse perm
    ws.frozen = True

    def dispatch(j):
        lay = ctx.layout(j)
        idx = ctx.send_idx(lay, idxr[j % 3])
        lp.gather_rows(x, idx, K, sx)
        return lay, idx, tr.all_to_all_v(sx[:idx.numel()], lay.send_len, rx[:lay.rows], lay.recv_len)

    def finish_chunk(p):
        hc, idx = p
        hc.wait()
        lp.combine_rows(acc, back[:idx.numel()], idx, ctx.wflat, K)

    cur, pend = (dispatch(0) if ctx.n else None), None
    ctx.wait_lent()
    for j in range(ctx.n):
        lay, idx, hd = cur
        hd.wait()
        rows = lay.rows
        if rows:
            perm, inv = ctx.grouped_perms(lay, pib)
            xg = lp.gather_rows(rx, perm, 1, gx)
        cur = dispatch(j + 1) if j + 1 < ctx.n else None             # overlaps GEMM(j)
        y = experts_fwd(ctx, xg, lay.ecount, buf, _slot_views(ctx, cache, j)) if rows else None
        if pend is not None:
            finish_chunk(pend)                                       # frees yb and back
        if rows:
            lp.gather_rows(y, inv, 1, yb)
            y = None
        _zero_tail(_slot_views(ctx, cache, j), rows)
        pend = (tr.all_to_all_v(yb[:rows], lay.recv_len, back[:idx.numel()], lay.send_len), idx)
    if pend is not None:
        finish_chunk(pend)
    _zero_unused(ctx, cache)
    ctx.stats.update(workspace_bytes=ws.nbytes)
    sx = rx = yb = back = gx = buf = cur = pend = None  # release the working set
    return acc.to(x.dtype)


def _slot_views(ctx, cache, j):
    """Chunk j's activation-cache view h [C, 2I] (slot j of cache
    [slots, C*2I]), or None when chunk j has no slot."""
    if cache is None or j >= cache.shape[0]:
        return None
    return cache[j].view(ctx.C, 2 * ctx.I)


def _zero_tail(slot, rows):
    """Rows past the chunk's own in its cache slot are zeroed, so the cache
    (an op output) is fully defined; a no-op for full chunks."""
    if slot is not None and rows < slot.shape[0]:
        slot[rows:].zero_()


def _zero_unused(ctx, cache):
    """Slots beyond the n chunks (possible at P > 1 or with T = 0): zeroed."""
    if cache is not None and cache.shape[0] > ctx.n:
        cache[ctx.n:].zero_()


def backward(ctx: Ctx, gy: torch.Tensor, need_dw: bool = True, cache: Optional[torch.Tensor] = None,
             overwrite_cache: bool = False, kept: bool = False):
    """Returns dx [T, H] (x dtype), d(topk_weights) [T*K] fp32, dW (a list
    indexed by weight kind, None where absent; param dtype; weight gradients
    of lent experts summed in) and d biases (db_gate_up, db_down) like the
    biases (or None). cache: forward's activation cache (chunks j < slots
    skip the recompute; on the P > 1 one-chunk step with kept, forward's h
    and grouped x rows). overwrite_cache: on the one-chunk paths dh may be
    written over the cached h (lean_one_chunk at P = 1; one_chunk)."""
    x, H, I, C, K, P = ctx.x, ctx.H, ctx.I, ctx.C, ctx.K, ctx.P
    dev, dt = x.device, x.dtype
    ctx.stats.update(recomputed_chunks=ctx.n - min(ctx.n, cache.shape[0] if cache is not None else 0),
                      lean_one_chunk=False)
    g = Grads(ctx, need_dw)
    if ctx.one_chunk:
        dx, dtw = one.backward_ep(ctx, gy, g, cache, kept, overwrite_cache)
        return finish(ctx, g, dx, dtw)
    dx = torch.zeros(ctx.T, H, dtype=torch.float32, device=dev)
    dtw = torch.zeros(ctx.T * K, dtype=torch.float32, device=dev)
    if overwrite_cache and lean_one_chunk(ctx, cache):
        one.backward_local_lean(ctx, gy, g, cache[0].view(C, 2 * I), dx, dtw)
        return finish(ctx, g, dx, dtw)

    ws = Workspace(dev)
    buf = Bufs(ctx, ws, gemm.grouped_ok(ctx), backward=True)

    if P == 1:
        xr, gr = ws.alloc((C, H), dt), ws.alloc((C, H), dt)
        wr = ws.alloc((C,), torch.float32)
        ws.frozen = True
        for j in reversed(range(ctx.n)):
            lay = ctx.layout(j)
            idx = ctx.send_idx(lay, None)
            rows = idx.numel()
            xg = lp.gather_rows(x, idx, K, xr)
            torch.index_select(ctx.wflat, 0, idx, out=wr[:rows])
            dy = DyRows(gy, idx, K, gr)  # gathered inside, scaled by the pick weights where it can
            dxr = rows_backward(ctx, buf, g, xg, dy, wr[:rows], lay.ecount, _slot_views(ctx, cache, j))
            lp.combine_rows(dx, dxr, idx, None, K)
            dxr = None
            dtw.index_copy_(0, idx, buf.dwr[:rows])
        ctx.stats.update(workspace_bytes_bwd=ws.nbytes)
        buf = xr = gr = wr = None  # release the working set before the dx copy
        return finish(ctx, g, dx, dtw)

    # One buffer each, ordered as in forward (see there).
    tr = ctx.tr
    sx, sg, rx, rg, dxb, back = (ws.alloc((C, H), dt) for _ in range(6))
    gx, gg_ = ws.alloc((C, H), dt), ws.alloc((C, H), dt)
    sw, rw, dwb, dwback = (ws.alloc((C,), torch.float32) for _ in range(4))
    wr = ws.alloc((C,), torch.float32)
    idxr = ws.ring(3, (C,), torch.int64)  # send indices of chunks j+1, j, j-1
    pib = ws.alloc((2 * C,), torch.int64)  # a chunk's perm and inverse perm
    ws.frozen = True

    def dispatch(j):
        lay = ctx.layout(j)
        idx = ctx.send_idx(lay, idxr[j % 3])
        ns = idx.numel()
        lp.gather_rows(x, idx, K, sx)
        lp.gather_rows(gy, idx, K, sg)
        torch.index_select(ctx.wflat, 0, idx, out=sw[:ns])
        hs = [tr.all_to_all_v(sx[:ns], lay.send_len, rx[:lay.rows], lay.recv_len),
              tr.all_to_all_v(sg[:ns], lay.send_len, rg[:lay.rows], lay.recv_len),
              tr.all_to_all_v(sw[:ns], lay.send_len, rw[:lay.rows], lay.recv_len)]
        return lay, idx, hs

    def finish_chunk(p):
        hs, idx = p
        for hnd in hs:
            hnd.wait()
        ns = idx.numel()
        lp.combine_rows(dx, back[:ns], idx, None, K)
        dtw.index_copy_(0, idx, dwback[:ns])

    order = list(reversed(range(ctx.n)))
    cur, pend = (dispatch(order[0]) if order else None), None
    ctx.wait_lent()
    for i, j in enumerate(order):
        lay, idx, hs = cur
        for hnd in hs:
            hnd.wait()
        rows = lay.rows
        if rows:
            perm, inv = ctx.grouped_perms(lay, pib)
            xg = lp.gather_rows(rx, perm, 1, gx)
            gg = lp.gather_rows(rg, perm, 1, gg_)
            torch.index_select(rw[:rows], 0, perm, out=wr[:rows])
        cur = dispatch(order[i + 1]) if i + 1 < len(order) else None  # overlaps chunk j's GEMMs
        if rows:
            dxr = rows_backward(ctx, buf, g, xg, gg, wr[:rows], lay.ecount, _slot_views(ctx, cache, j))
        if pend is not None:
            finish_chunk(pend)                                        # frees dxb, dwb, back, dwback
        if rows:
            lp.gather_rows(dxr, inv, 1, dxb)
            dxr = None
            torch.index_select(buf.dwr[:rows], 0, inv, out=dwb[:rows])
        ns = idx.numel()
        pend = ([tr.all_to_all_v(dxb[:rows], lay.recv_len, back[:ns], lay.send_len),
                 tr.all_to_all_v(dwb[:rows], lay.recv_len, dwback[:ns], lay.send_len)], idx)
    if pend is not None:
        finish_chunk(pend)
    ctx.stats.update(workspace_bytes_bwd=ws.nbytes)
    buf = wr = None
    sx = sg = rx = rg = dxb = back = gx = gg_ = sw = rw = dwb = dwback = cur = pend = None
    return finish(ctx, g, dx, dtw)


def lean_one_chunk(ctx: Ctx, cache: Optional[torch.Tensor]) -> bool:
    """Backward takes the P = 1 one-chunk path (one_chunk.backward_local_lean):
    one rank, one chunk, its h cached, swiglu on fused gate/up weights, no
    biases, not fp16."""
    return ctx.P == 1 and ctx.n == 1 and cache is not None and cache.shape[0] >= 1 and lean_ok(ctx)


__all__ = ["forward", "backward", "lean_one_chunk"]
