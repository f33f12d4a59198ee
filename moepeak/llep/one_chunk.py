"""PipelinedLLEP's one-chunk steps: when one chunk covers the whole step,
the schedule is the unchunked one, with every buffer allocated at its first
use and dropped after its last (moepeak/llep/workspace.Held accounts for
them) and nothing double-buffered or recomputed.

  P = 1 (backward_local_lean): forward cached h whole; backward writes dh
    over it (sizes.one_chunk_peak_bytes).
  P > 1 (forward_ep, backward_ep): standard expert parallelism exactly:
    forward  gather x rows -> ONE all-to-all-v -> grouped x -> h, a, o
             (one grouped GEMM each) -> ungroup -> ONE all-to-all-v back
             -> combine;
    backward gather dy rows and pick weights -> their all-to-all-vs ->
             grouped -> the four backward GEMMs -> ungroup -> the dx rows'
             and d(pick weight)s' all-to-all-vs back -> combine.
    With `keep` forward leaves h [R, 2I] and the grouped x rows [R, H] in the
    activation cache (what standard EP's autograd saves, less: no a, no
    silu(gate), no o), so backward neither recomputes h nor re-sends x;
    without it backward re-sends x and recomputes h. The lent experts'
    weights travel only when the plan spills (context.Ctx).
    Kept cache layout (flat, x dtype, viewed from cache [slots, C*2I]):
    [0, R*2I) h [R, 2I]; [R*2I, R*(2I+H)) grouped x [R, H]; the rest zero.
    R: rows this rank receives; N = T*K: rows it sends.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import gemm
from . import plan as lp
from .context import Ctx
from .experts import Bufs, Grads, experts_fwd, lean_ok, lean_rows_backward, rows_backward
from .workspace import Held


def _kept_views(cache, R: int, H: int, I: int):
    """(h [R, 2I], grouped x [R, H]) views of the kept cache (layout above)."""
    flat = cache.view(-1)
    return flat[:R * 2 * I].view(R, 2 * I), flat[R * 2 * I:R * (2 * I + H)].view(R, H)


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if t is not None else 0


class _Exchange(NamedTuple):
    """What a P > 1 one-chunk step exchanges: its chunk layout, the R rows this rank
    receives, the N = T*K rows it sends, idx (the sent rows' flat (token, k) indices,
    dst-major), and the step's Held, from base bytes (the kept cache, where the step
    holds it throughout)."""
    lay: lp.ChunkLayout
    R: int
    N: int
    idx: torch.Tensor
    base: int
    held: Held


def _exchange(ctx: Ctx, cache, cached: bool) -> _Exchange:
    lay = ctx.layout(0)
    base = _nbytes(cache) if cached else 0
    return _Exchange(lay, lay.rows, sum(lay.send_len), ctx.send_idx(lay, None), base, Held(ctx.x.device, base))


def backward_local_lean(ctx: Ctx, gy, g: Grads, hcache, dx, dtw) -> None:
    """P = 1, one chunk (rows = T*K), h cached in hcache [C, 2I] (the op's
    mutable cache): dx [T, H] fp32 and dtw [T*K] fp32 accumulate the
    result; g the weight gradients (experts.lean_rows_backward). Peak
    as sizes.one_chunk_peak_bytes counts it."""
    x, H, K = ctx.x, ctx.H, ctx.K
    lay = ctx.layout(0)
    idx = ctx.send_idx(lay, None)
    rows = idx.numel()
    held = Held(x.device)
    wg = held.new((rows,), torch.float32)
    torch.index_select(ctx.wflat, 0, idx, out=wg)
    dwr = lean_rows_backward(
        ctx, hcache[:rows], lambda wp: lp.gather_rows(gy, idx, K, held.new((rows, H), x.dtype), scale=wp), wg,
        lay.ecount, g, held, lambda dxr: lp.combine_rows(dx, dxr, idx, None, K),
        lambda: lp.gather_rows(x, idx, K, held.new((rows, H), x.dtype)))
    dtw.index_copy_(0, idx, dwr)
    ctx.stats.update(workspace_bytes_bwd=held.peak, lean_one_chunk=True)


def forward_ep(ctx: Ctx, cache, keep: bool) -> torch.Tensor:
    """P > 1, one chunk: y [T, H] (x dtype). keep: cache (the op's kept
    cache, [1, R*(2I + H)]) receives h and the grouped x rows.
    stats workspace_bytes: the most this call held above the cache."""
    x, H, I, K, tr, dt = ctx.x, ctx.H, ctx.I, ctx.K, ctx.tr, ctx.x.dtype
    lay, R, N, idx, base, held = _exchange(ctx, cache, keep)
    acc = torch.zeros(ctx.T, H, dtype=torch.float32, device=x.device)
    sx = lp.gather_rows(x, idx, K, held.new((N, H), dt))            # send rows [N, H], dst-major
    rx = held.new((R, H), dt)                                        # receive rows [R, H], src-major
    hd = tr.all_to_all_v(sx, lay.send_len, rx, lay.recv_len)
    ctx.wait_lent()
    hd.wait()
    held.drop(sx)
    sx = None
    pib = held.new((2 * R,), torch.int64)
    perm, inv = ctx.grouped_perms(lay, pib)
    hview, xview = _kept_views(cache, R, H, I) if keep else (None, None)
    xg = lp.gather_rows(rx, perm, 1, xview if keep else held.new((R, H), dt))  # grouped rows [R, H]
    held.drop(rx)
    rx = None
    mark = held.live
    grouped = gemm.grouped_ok(ctx)
    if keep and grouped:  # torch._grouped_mm's own h before its copy into the cache
        held.count(R * 2 * I * x.element_size())
    buf = Bufs(ctx, held, grouped, backward=False, rows=R, with_h=not keep)
    y = experts_fwd(ctx, xg, lay.ecount, buf, hview)                 # [R, H], grouped order
    buf = None
    held.release_to(mark)
    held.gemm(y)
    if not keep:
        held.drop(xg)
    xg = None
    yb = lp.gather_rows(y, inv, 1, held.new((R, H), dt))             # receive order
    held.drop(y, pib)
    y = perm = inv = pib = None
    back = held.new((N, H), dt)
    tr.all_to_all_v(yb, lay.recv_len, back, lay.send_len).wait()
    held.drop(yb)
    yb = None
    lp.combine_rows(acc, back, idx, ctx.wflat, K)
    back = None
    if keep:
        cache.view(-1)[R * (2 * I + H):].zero_()  # the op output is fully defined
    elif cache is not None and cache.numel():
        cache.zero_()
    ctx.stats.update(workspace_bytes=held.peak - base, cached_chunks=int(keep), cache_bytes=_nbytes(cache),
                      recv_rows=R, send_rows=N)
    return acc.to(dt)


def backward_ep(ctx: Ctx, gy, g: Grads, cache, kept: bool, overwrite: bool):
    """P > 1, one chunk: returns (dx [T, H] fp32, d(topk_weights) [T*K]
    fp32); g the weight gradients. kept: cache holds forward's h and grouped
    x (forward_ep with keep); else x travels again and h is recomputed.
    overwrite: the cache may be written (dh over h: the lean rows backward,
    where experts.lean_ok). stats workspace_bytes_bwd: the most
    this call held above the cache."""
    x, H, I, K, tr, dt = ctx.x, ctx.H, ctx.I, ctx.K, ctx.tr, ctx.x.dtype
    lay, R, N, idx, base, held = _exchange(ctx, cache, kept)
    dx = torch.zeros(ctx.T, H, dtype=torch.float32, device=x.device)
    dtw = torch.zeros(ctx.T * K, dtype=torch.float32, device=x.device)
    sg = lp.gather_rows(gy, idx, K, held.new((N, H), dt))
    sw = held.new((N,), torch.float32)
    torch.index_select(ctx.wflat, 0, idx, out=sw)
    rg, rw = held.new((R, H), dt), held.new((R,), torch.float32)
    hs = [tr.all_to_all_v(sg, lay.send_len, rg, lay.recv_len), tr.all_to_all_v(sw, lay.send_len, rw, lay.recv_len)]
    if not kept:
        sx = lp.gather_rows(x, idx, K, held.new((N, H), dt))
        rx = held.new((R, H), dt)
        hs.append(tr.all_to_all_v(sx, lay.send_len, rx, lay.recv_len))
    ctx.wait_lent()
    for hnd in hs:
        hnd.wait()
    held.drop(sg, sw)
    sg = sw = None
    if not kept:
        held.drop(sx)
        sx = None
    pib = held.new((2 * R,), torch.int64)
    perm, inv = ctx.grouped_perms(lay, pib)
    wg = held.new((R,), torch.float32)
    torch.index_select(rw, 0, perm, out=wg)
    held.drop(rw)
    rw = None
    if kept:
        hview, xg = _kept_views(cache, R, H, I)
    else:
        hview, xg = None, lp.gather_rows(rx, perm, 1, held.new((R, H), dt))
        held.drop(rx)
        rx = None
    lean = kept and overwrite and lean_ok(ctx)
    dxb = None
    if lean:
        def grouped_dy(wp):
            nonlocal rg
            out = lp.gather_rows(rg, perm, 1, held.new((R, H), dt), scale=wp)
            held.drop(rg)
            rg = None
            return out

        def ungroup_dx(dxr):
            nonlocal dxb
            dxb = lp.gather_rows(dxr, inv, 1, held.new((R, H), dt))

        dwr = lean_rows_backward(ctx, hview, grouped_dy, wg, lay.ecount, g, held, ungroup_dx, lambda: xg)
        dwb = held.new((R,), torch.float32)
        torch.index_select(dwr, 0, inv, out=dwb)
        held.drop(dwr)
        dwr = None
    else:
        gg = lp.gather_rows(rg, perm, 1, held.new((R, H), dt))
        held.drop(rg)
        rg = None
        mark = held.live
        buf = Bufs(ctx, held, gemm.grouped_ok(ctx), backward=True, rows=R, with_h=not kept)
        bufs_bytes = held.live - mark
        dxr = rows_backward(ctx, buf, g, xg, gg, wg, lay.ecount, hview)
        dxb = lp.gather_rows(dxr, inv, 1, held.new((R, H), dt))
        dwb = held.new((R,), torch.float32)
        torch.index_select(buf.dwr[:R], 0, inv, out=dwb)
        buf = dxr = None
        held.count(-bufs_bytes)
        held.drop(gg)
        gg = None
    if not kept:
        held.drop(xg)
    held.drop(wg, pib)
    xg = hview = wg = pib = perm = inv = None
    back, dwback = held.new((N, H), dt), held.new((N,), torch.float32)
    hc = [tr.all_to_all_v(dxb, lay.recv_len, back, lay.send_len),
          tr.all_to_all_v(dwb, lay.recv_len, dwback, lay.send_len)]
    for hnd in hc:
        hnd.wait()
    held.drop(dxb, dwb)
    dxb = dwb = None
    lp.combine_rows(dx, back, idx, None, K)
    dtw.index_copy_(0, idx, dwback)
    ctx.stats.update(workspace_bytes_bwd=held.peak - base, lean_one_chunk=lean,
                      recomputed_chunks=0 if kept else 1)
    return dx, dtw
