"""PipelinedLLEP schedules: forward and backward, readable top to bottom.

Per call (forward, and again in backward: nothing routing-sized is saved):
  1. count picks per expert (kernel), all-gather a config fingerprint, then the
     P x E load matrix (one small all-gather each; bad ids and differing
     configs are reported on every rank, so no rank is left hanging);
  2. plan (C, identical everywhere), n chunks, this rank's send list (route);
  3. lend spilled experts' weights to their helpers (one all-to-all-v);
  4. chunk loop. Forward: dispatch(j+1) is issued before GEMM(j), combine(j)
     is issued after GEMM(j) and finished after GEMM(j+1). Backward: the same
     with chunks in reverse order and x, dy and the pick weights travelling;
     dx rows and d(topk_weights) come back; borrowed experts' weight gradients
     return to their owner at the end and are summed there.

Buffers (the working set, allocated once per call from C, never from the
routing; names as in the code; b = bytes per element of x):
  forward, P = 1:  xr [C, H], h [C, 2I], a [C, I], o [C, H]          (b each)
  forward, P > 1:  sx, rx, yb, back: 2 x [C, H] each (double-buffered send,
                   receive, combine-send, combine-receive); gx [C, H] grouped
                   rows; h [C, 2I]; a [C, I]; o [C, H]
  backward, P = 1: xr, gr, o, do [C, H]; h, dh [C, 2I]; s, a, da [C, I];
                   wr, wp, dwr [C] fp32
  backward, P > 1: sx, sg, rx, rg, dxb, back: 2 x [C, H]; gx, gg, o, do
                   [C, H]; h, dh [C, 2I]; s, a, da [C, I]; sw, rw, dwb, dwback
                   2 x [C] fp32; wr, wp, dwr [C] fp32
  plus int64 index rings (3 x [C] send indices, [C] perm and inverse perm).
  With torch._grouped_mm (CUDA bf16) the GEMM outputs h, o, da are not
  allocated in the workspace (counted all the same): each GEMM's own output,
  at most [C, N], is used in place, no copy; the grouped weight gradient's
  result [G, H, 2I] (or [G, I, H]) has G = C // H (C // I) experts at most,
  no larger than the [C, 2I] ([C, H]) buffer it replaces. Worked once: C =
  32768, H = I = 2880, bf16: G = 11, [11, 2880, 5760] x 2 B = 348 MiB, vs
  [32768, 5760] x 2 B = 360 MiB. Per chunk the host does no device read:
  offsets come from the chunk layout (host) in one copy per GEMM grouping.
  Activation cache (fixed at launch by save_budget_mb, kept from forward to
  backward): cache [slots, C*2I] (b each), slot j = chunk j's h [C, 2I];
  slots = min(budget // (b*C*2I), ceil(T*K / (C//P))), so its bytes are <=
  the budget whatever the routing; backward recomputes h only for chunks
  j >= slots. Backward never recomputes o = a W_down: d(pick weight) =
  <dy, o> = <dy W_down^T, a>, and dy W_down^T is the GEMM backward makes
  anyway (see compute() in backward). Bound of one call: working_set_bound().
  Outside the working set: fp32 accumulators [T, H] (forward y, backward dx),
  the send list [T*K] int64, and borrowed experts' weights (and their grads).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from . import llep_plan as lp

# Statistics of the last call (tests and benchmarks read them).
LAST_STATS: Dict[str, object] = {}

_GROUPED_MM_OK = [hasattr(torch, "_grouped_mm")]
# Tests only: exercise the grouped path on CPU where torch supports it.
GROUPED_ON_CPU = [False]
# Backward divides d(weight) sums by the pick weight w; below this |w| (and at
# w = 0) dy is left unscaled instead and the row scaled by w afterwards. With
# |w| >= 2^-24, w * dy stays a normal bf16/fp32 number for any |dy| > 2^-102.
_TINY_W = 2.0 ** -24


class Workspace:
    """Every working-set buffer of one call; frozen before the chunk loop so
    that nothing routing-dependent can be allocated inside it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.nbytes = 0
        self.frozen = False

    def alloc(self, shape, dtype) -> torch.Tensor:
        if self.frozen:
            raise RuntimeError("moepeak: internal error: workspace allocation inside the chunk loop")
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self.nbytes += t.numel() * t.element_size()
        return t

    def gemm_out(self, shape, dtype, grouped: bool) -> Optional[torch.Tensor]:
        """A GEMM output buffer. With torch._grouped_mm the GEMM allocates its
        own [rows <= C, N] output (no copy into the workspace), so the buffer is
        only counted (the bound is the same), not allocated: None."""
        if not grouped:
            return self.alloc(shape, dtype)
        self.nbytes += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return None

    def ring(self, k: int, shape, dtype) -> List[torch.Tensor]:
        return [self.alloc(shape, dtype) for _ in range(k)]


def slot_elems(C: int, I: int) -> int:
    """Elements of one activation-cache slot: h [C, 2I] (o is never cached:
    backward does not need it)."""
    return C * 2 * I


def cache_slots(budget_bytes: int, T: int, K: int, C: int, I: int, P: int, b: int) -> int:
    """Chunks whose forward intermediates fit the launch-time byte budget.
    From shapes and the budget only (never the routing): at most
    budget // (b * C * 2I) slots, and no more than ceil(T*K / (C//P)),
    the chunks this rank's own T*K picks can need (exactly the chunk count at
    P = 1; at P > 1 the global count may differ either way, which only
    changes how many chunks are recomputed, never a result). Worked once: budget 1536 MiB, C = 32768,
    I = 2880, bf16: one slot is 32768 x 5760 x 2 B = 360 MiB, so 4 slots
    (1440 MiB): T = 16k, K = 4 (2 chunks) recomputes nothing; T = 256k (32
    chunks) recomputes 28."""
    per = b * slot_elems(C, I)
    if budget_bytes <= 0 or per <= 0:
        return 0
    return int(min(budget_bytes // per, -(-T * K // (C // P))))


def workspace_bytes(C: int, H: int, I: int, P: int, b: int, backward: bool) -> int:
    """The working set in bytes, from C alone (see the module docstring)."""
    idx = 8 * C * (3 + 2) if P > 1 else 0
    if not backward:
        if P == 1:
            return b * C * (2 * H + 3 * I)
        return b * C * (10 * H + 3 * I) + idx
    if P == 1:
        return b * C * (4 * H + 7 * I) + 12 * C
    return b * C * (16 * H + 7 * I) + 4 * C * 11 + idx


def working_set_bound(C: int, H: int, I: int, P: int, b: int, backward: bool, save_budget_bytes: int) -> int:
    """Bytes above the [T, H]-sized tensors and weight gradients: the working
    set plus the activation cache (alive in both passes), from C and the
    launch-time budget alone."""
    return workspace_bytes(C, H, I, P, b, backward) + max(0, save_budget_bytes)


class Ctx:
    """Everything one call derives from its inputs; identical control flow on
    every rank."""

    def __init__(self, x, topk_ids, topk_weights, w_gate_up, w_down, tr, C, alpha, m, lam):
        self.x, self.wgu, self.wd, self.tr, self.C = x, w_gate_up, w_down, tr, C
        self.T, self.H = x.shape
        self.K = topk_ids.shape[1]
        self.El, _, twoI = w_gate_up.shape
        self.I = twoI // 2
        self.P = tr.world_size if tr is not None else 1
        self.r = tr.rank if tr is not None else 0
        self.E = self.El * self.P
        dev = x.device
        self.ids = topk_ids.reshape(-1).to(torch.int64).contiguous()
        self.wflat = topk_weights.reshape(-1).to(torch.float32).contiguous()
        cnt = lp.count(self.ids, self.E)
        fp = lp.config_fingerprint(E=self.E, K=self.K, H=self.H, I=self.I, C=C, m=m, alpha=float(alpha),
                                   lam=float(lam), dtype=lp._DTYPE_CODE[x.dtype], cuda=int(x.is_cuda))
        fpt = torch.tensor(fp, dtype=torch.int64)
        if tr is not None:
            fps = torch.empty(self.P, len(fp), dtype=torch.int64, device=dev)
            tr.all_gather(fps, fpt.to(dev))
            fps = fps.cpu()
            bad = [s for s in range(self.P) if not torch.equal(fps[s], fps[0])]
            if bad:
                raise ValueError(f"moepeak: llep_moe configuration differs across ranks {bad} vs rank 0 "
                                 "(num_experts, top_k, hidden/intermediate size, chunk_rows, alpha, "
                                 "min_tokens_per_gemm, imbalance_threshold, dtype and device type must agree)")
            loads = torch.empty(self.P, self.E + 1, dtype=torch.int64, device=dev)
            tr.all_gather(loads, cnt)
            loads = loads.cpu()
        else:
            loads = cnt.cpu()[None]
        badr = [s for s in range(self.P) if int(loads[s, self.E]) != 0]
        if badr:
            raise ValueError(f"moepeak: topk_ids has {int(loads[badr[0], self.E])} id(s) outside "
                             f"[0, num_experts={self.E}) on rank(s) {badr}")
        self.load = loads[:, :self.E].contiguous()
        self.plan = lp.llep_plan(self.load, alpha, m, lam)
        self.n = lp.num_chunks(self.plan.S, C)
        self.send_index = lp.route(self.ids, self.E, self.plan, self.r, self.load[self.r])
        # Borrowed experts (run here, owned elsewhere) and lent ones (ours, run
        # on d). Both ascending by expert id, so grouped by owner.
        Q = self.plan.Q
        own = range(self.r * self.El, (self.r + 1) * self.El)
        self.borrowed = [e for e in range(self.E) if e // self.El != self.r and int(Q[e, self.r]) > 0]
        self.lend = [[e for e in own if d != self.r and int(Q[e, d]) > 0] for d in range(self.P)]
        self.slot = {e: i for i, e in enumerate(self.borrowed)}
        self.per = self.H * 2 * self.I + self.I * self.H  # elements of one expert's weights
        self.bgu = self.bd = None
        if self.plan.spilled:
            self._lend_weights()
        self.layouts: Dict[int, lp.ChunkLayout] = {}
        # experts whose weight gradient (0: gate_up, 1: down) holds a partial sum
        self.touched = (set(), set())
        LAST_STATS.update(n_chunks=self.n, chunk_rows=C, spilled=self.plan.spilled, borrowed=list(self.borrowed),
                          max_rows=0, grouped_mm=0, grouped_dw=0)

    # ---- weights ---------------------------------------------------------
    def _lend_weights(self):
        parts = [torch.cat([self.wgu[e - self.r * self.El].reshape(-1), self.wd[e - self.r * self.El].reshape(-1)])
                 for d in range(self.P) for e in self.lend[d]]
        send = torch.cat(parts) if parts else self.wgu.new_empty(0)
        recv_counts = [sum(1 for e in self.borrowed if e // self.El == o) * self.per for o in range(self.P)]
        recv = self.wgu.new_empty(len(self.borrowed) * self.per)
        self.tr.all_to_all_v(send, [len(l) * self.per for l in self.lend], recv, recv_counts).wait()
        self.bflat = recv.view(len(self.borrowed), self.per)
        n1 = self.H * 2 * self.I
        self.bgu = [self.bflat[i, :n1].view(self.H, 2 * self.I) for i in range(len(self.borrowed))]
        self.bd = [self.bflat[i, n1:].view(self.I, self.H) for i in range(len(self.borrowed))]

    def weights(self, e: int):
        if e // self.El == self.r:
            return self.wgu[e - self.r * self.El], self.wd[e - self.r * self.El]
        i = self.slot[e]
        return self.bgu[i], self.bd[i]

    def layout(self, j: int) -> lp.ChunkLayout:
        lay = self.layouts.get(j)
        if lay is None:
            lay = lp.chunk_layout(self.plan, self.r, self.n, j, self.C)
            LAST_STATS["max_rows"] = max(int(LAST_STATS["max_rows"]), lay.rows, sum(lay.send_len))
            self.layouts = {j: lay}  # keep one: layouts are cheap to recompute
        return lay

    def send_idx(self, lay: lp.ChunkLayout, buf: torch.Tensor) -> torch.Tensor:
        """Chunk's send indices (dst-major) as one contiguous int64 tensor."""
        if self.P == 1:
            a = lay.send_start[0]
            return self.send_index[a:a + lay.send_len[0]]
        pos = 0
        for d in range(self.P):
            a, k = lay.send_start[d], lay.send_len[d]
            if k:
                buf[pos:pos + k].copy_(self.send_index[a:a + k])
            pos += k
        return buf[:pos]

    # ---- expert GEMMs (torch) ---------------------------------------------
    def _grouped_ok(self) -> bool:
        return (_GROUPED_MM_OK[0] and (self.x.is_cuda or GROUPED_ON_CPU[0]) and self.x.dtype == torch.bfloat16
                and self.H % 8 == 0 and self.I % 8 == 0)

    def _stack(self, experts, kind, which: int):
        """[G, ., .] weight stack (which 0: w_gate_up, 1: w_down) of a run of
        experts that are consecutive in their storage (local block or slots)."""
        if kind == "l":
            e0 = experts[0] - self.r * self.El
            W = self.wgu if which == 0 else self.wd
            return W[e0:e0 + len(experts)]
        n1 = self.H * 2 * self.I
        i0 = self.slot[experts[0]]
        blk = self.bflat[i0:i0 + len(experts)]
        return blk[:, :n1].unflatten(1, (self.H, 2 * self.I)) if which == 0 else blk[:, n1:].unflatten(1, (self.I, self.H))

    def groups(self, ecount) -> "Groups":
        return Groups(self, ecount)

    def mm(self, inp, grp: "Groups", which: int, transpose: bool, out):
        """Rows of e times W_e (or W_e^T) for each expert e, rows grouped
        expert-ascending; which 0: w_gate_up, 1: w_down. Returns the [rows, N]
        result: torch._grouped_mm's own output where it works (CUDA bf16; out
        may then be None: no copy into the workspace), else `out` filled by one
        torch.mm per expert."""
        rows = inp.shape[0]
        N = (self.H if transpose else 2 * self.I) if which == 0 else (self.I if transpose else self.H)
        if rows == 0:
            return inp.new_empty(0, N) if out is None else out[:0]
        if grp.grouped:
            try:
                res = None
                for a, b, experts, kind, offs in grp.segments:
                    W = self._stack(experts, kind, which)
                    r = torch._grouped_mm(inp[a:b], W.transpose(1, 2) if transpose else W, offs=offs)
                    if a == 0 and b == rows:
                        res = r  # one segment (always at P = 1): no copy
                    else:
                        if res is None:
                            res = inp.new_empty(rows, N) if out is None else out[:rows]
                        res[a:b].copy_(r)
                LAST_STATS["grouped_mm"] = int(LAST_STATS.get("grouped_mm", 0)) + 1
                return res
            except (RuntimeError, TypeError, NotImplementedError):
                _GROUPED_MM_OK[0] = False  # unsupported here: per-expert GEMMs from now on
                grp.grouped = False
        if out is None:  # only after a grouped failure: this call's buffer
            out = inp.new_empty(rows, N)
        off = 0
        for e, c in enumerate(grp.ecount):
            if c:
                W = self.weights(e)[which]
                torch.mm(inp[off:off + c], W.t() if transpose else W, out=out[off:off + c])
                off += c
        return out[:rows]

    def new_dw(self, which: int) -> torch.Tensor:
        """An unwritten weight gradient like w_gate_up (which 0) or w_down (1)."""
        return torch.empty_like(self.wgu if which == 0 else self.wd)

    def dw_accumulate(self, left, right, grp: "Groups", which: int, dW_local, dW_borrowed):
        """dW_e += left[rows of e]^T @ right[rows of e] (param dtype).
        dW_local[which] is None until the first call: on the grouped path the
        first chunk's grouped GEMM over all local experts (2D x 2D, offsets
        along the rows; experts without rows there get an unused slice, written
        or zeroed later) *is* the weight gradient [E_local, ., .], no copy.
        After that, experts whose gradient is still untouched (unwritten) get
        it from one torch._grouped_mm per run of at most G experts and a copy
        into dW; G is chosen so that the [G, ., .] result is no larger than one
        [C, 2I] (or [C, H]) buffer. Experts already touched by an earlier chunk
        use addmm_ (one rounding into the running sum: the same rounding as
        the per-expert path)."""
        touched = self.touched[which]
        done = set()  # experts of this call already written by a grouped run
        if grp.grouped:
            try:
                if dW_local[which] is None:
                    for a0, b0, experts, kind, offs in grp.segments:
                        if kind == "l":
                            dW_local[which] = torch._grouped_mm(left[a0:b0].t(), right[a0:b0], offs=offs)
                            ex = [e for e in experts if grp.ecount[e]]
                            touched.update(ex)
                            done.update(ex)
                for a0, experts, kind, offs in grp.dw_runs(which, touched):
                    b0 = a0 + int(sum(grp.ecount[e] for e in experts))
                    r = torch._grouped_mm(left[a0:b0].t(), right[a0:b0], offs=offs)
                    if kind == "l":
                        e0 = experts[0] - self.r * self.El
                        dW_local[which][e0:e0 + len(experts)].copy_(r)
                    else:
                        for i, e in enumerate(experts):
                            dW_borrowed[which][self.slot[e]].copy_(r[i])
                    r = None  # freed before the next run's result exists: one [G, ., .] at a time
                    touched.update(experts)
                    done.update(experts)
                LAST_STATS["grouped_dw"] = int(LAST_STATS.get("grouped_dw", 0)) + 1
            except (RuntimeError, TypeError, NotImplementedError):
                _GROUPED_MM_OK[0] = False
                grp.grouped = False
        if dW_local[which] is None:
            dW_local[which] = self.new_dw(which)
        off = 0
        for e, c in enumerate(grp.ecount):
            if c and e not in done:
                if e // self.El == self.r:
                    g = dW_local[which][e - self.r * self.El]
                else:
                    g = dW_borrowed[which][self.slot[e]]
                if e in touched:
                    g.addmm_(left[off:off + c].t(), right[off:off + c])
                else:  # first rows of e: dW starts uninitialised (see backward)
                    torch.mm(left[off:off + c].t(), right[off:off + c], out=g)
                touched.add(e)
            off += c


class Groups:
    """One chunk's expert grouping, computed on the host from ecount (no device
    read): segments of grouped rows whose experts form one weight stack, with
    their grouped_mm offsets (int32, cumulative rows within the segment) moved
    to the device in ONE host-to-device copy per chunk, shared by every GEMM
    of the chunk."""

    def __init__(self, ctx: Ctx, ecount):
        self.ctx, self.ecount = ctx, ecount
        self.grouped = ctx._grouped_ok()
        self.segments = []
        if not self.grouped:
            return
        lo, hi = ctx.r * ctx.El, (ctx.r + 1) * ctx.El
        below = [e for e in ctx.borrowed if e < lo]
        above = [e for e in ctx.borrowed if e >= hi]
        host, spans, row = [], [], 0
        for experts, kind in ((below, "b"), (list(range(lo, hi)), "l"), (above, "b")):
            counts = [ecount[e] for e in experts]
            nrows = sum(counts)
            if nrows:
                c, acc = len(host), 0
                for k in counts:
                    acc += k
                    host.append(acc)
                spans.append((row, row + nrows, experts, kind, c, len(host)))
            row += nrows
        self.host = host
        self.dev = torch.tensor(host, dtype=torch.int32).to(ctx.x.device, non_blocking=True) if host else None
        self.segments = [(a, b, ex, kind, self.dev[c0:c1]) for a, b, ex, kind, c0, c1 in spans]

    def dw_runs(self, which: int, touched):
        """Runs for the grouped weight gradient: consecutive experts of one
        segment with rows in this chunk and an untouched gradient, at most G
        per run. Returns [(first row, experts, kind, offs on the device)]. The
        few experts left out (touched ones) go to addmm_."""
        ctx = self.ctx
        G = max(1, ctx.C // (ctx.H if which == 0 else ctx.I))
        runs, host = [], []
        for a, b, experts, kind, _ in self.segments:
            row, cur, start = a, [], a
            for e in experts:
                c = self.ecount[e]
                if c == 0:
                    continue
                if e in touched or len(cur) == G or (cur and cur[-1] + 1 != e):
                    if cur:
                        runs.append((start, cur))
                    cur = []
                if e not in touched:
                    if not cur:
                        start = row
                    cur.append(e)
                row += c
            if cur:
                runs.append((start, cur))
        out = []
        for start, ex in runs:
            acc, c0 = 0, len(host)
            for e in ex:
                acc += self.ecount[e]
                host.append(acc)
            out.append((start, ex, "l" if ex[0] // ctx.El == ctx.r else "b", c0, len(host)))
        if not host:
            return []
        dev = torch.tensor(host, dtype=torch.int32).to(ctx.x.device, non_blocking=True)
        return [(s, ex, kind, dev[c0:c1]) for s, ex, kind, c0, c1 in out]


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
    gmm = ctx._grouped_ok()
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
    grp = ctx.groups(ecount)
    hh = ctx.mm(xg, grp, 0, False, h if slot is None else slot)
    if slot is not None:
        hh = _keep(hh, slot[:rows])
    torch.ops.aten.silu.out(hh[:, :I], out=a[:rows])
    a[:rows].mul_(hh[:, I:])                                         # a = silu(gate) * up
    hh = None
    return ctx.mm(a[:rows], grp, 1, False, o)


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
    gmm = ctx._grouped_ok()
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
        grp = ctx.groups(ecount)
        if slot is None:
            hh = ctx.mm(xg, grp, 0, False, h)                        # [rows, 2I]
        else:
            hh = slot[:rows]                                         # (the cache is only read)
        _act(hh, I, s, a, rows)
        if dt == torch.float16:
            oo = ctx.mm(a[:rows], grp, 1, False, o)                  # [rows, H]
            torch.mul(oo, gg, out=do[:rows])                         # dy . expert output, per row
            torch.sum(do[:rows], 1, dtype=torch.float32, out=dwr[:rows])
            oo = None
            torch.mul(gg, wg.unsqueeze(1), out=do[:rows])            # d(expert output) = w * dy
            dda = ctx.mm(do[:rows], grp, 1, True, da)                # [rows, I]
        else:
            w1 = wp[:rows]
            w1.copy_(wg).masked_fill_(wg.abs() < _TINY_W, 1.0)       # wp: w, or 1 for tiny |w|
            torch.mul(gg, w1.unsqueeze(1), out=do[:rows])            # d(expert output) = wp * dy
            dda = ctx.mm(do[:rows], grp, 1, True, da)                # [rows, I]: (wp dy) W_down^T
            lp.down_bwd(dda, a[:rows], wg, w1, dwr)                  # d(weight); tiny-w rows rescaled
        if need_dw:
            ctx.dw_accumulate(a[:rows], do[:rows], grp, 1, dW, dWb)  # a rows already carry w / wp
        torch.mul(dda, s[:rows], out=dh[:rows, I:])                  # d up = da * silu(gate)
        torch.mul(dda, hh[:, I:], out=s[:rows])                      # d silu(gate) = da * up
        dda = None
        torch.ops.aten.silu_backward.grad_input(s[:rows], hh[:, :I], grad_input=dh[:rows, :I])
        hh = None
        if need_dw:
            ctx.dw_accumulate(xg, dh[:rows], grp, 0, dW, dWb)
        return ctx.mm(dh[:rows], grp, 0, True, o)                    # dx rows [rows, H]

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
