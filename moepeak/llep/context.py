"""PipelinedLLEP's per-call state (`Ctx`): what one forward or backward call
derives from its inputs before the chunk loop, with identical control flow on
every rank.

  1. count picks per expert (kernel), then ONE all-gather of [counts | bad-id
     count | config fingerprint] per rank and ONE host read of it (the call's
     only device->host sync): bad ids and differing configs are reported on
     every rank, so no rank is left hanging;
  2. plan (C, identical everywhere), n chunks (or the one-chunk step, see
     `one_chunk_rows`), this rank's send list (route);
  3. lend spilled experts' weights (and biases) to their helpers (one
     all-to-all-v, only when the plan spills; waited for at first use):
     borrowed ones live in bflat [n_borrowed, per] (param dtype), row i =
     slot i's weight kinds row-major ([H, 2I] or [H, I] gate, [I, H] down,
     [H, I] up when split), then b_gate_up [2I] and b_down [H].
Backward passes forward's load matrix and send list (plan_state), so steps 1
and the route are not repeated: the plan itself is host-only and cheap.

Host->device copies of per-chunk tables (grouping offsets, permutations) go
through `host_to_device`: staged in pinned memory on CUDA, so the copy is
truly asynchronous (a copy from pageable memory may wait for the stream).
ctx.stats (the call's record, moepeak/llep/stats.py) counts host reads
(`host_syncs`) and these copies (`h2d_copies`), so tests can pin them down.

Weights may have any strides (e.g. Hugging Face's [E, 2I, H] storage seen
through transpose(1, 2)): they are only sliced per expert, never copied
whole; weight gradients are allocated like the weights (same strides).
"""
from __future__ import annotations

from typing import Dict

import torch

from ..core.abi import DTYPE_CODES
from . import plan as lp
from .options import LLEPOptions

# Expert activations: "swiglu" silu(gate) * up, gate = h[:, :I], up = h[:, I:];
# "gpt_oss" (Hugging Face GPT-OSS): gate = h[:, 0::2], up = h[:, 1::2],
# g = min(gate, 7), u = clamp(up, -7, 7), a = (u + 1) * g * sigmoid(1.702 g).
ACTIVATIONS = ("swiglu", "gpt_oss")
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0


class Ctx:
    """Everything one call derives from its inputs; identical control flow on
    every rank.

    Weight kinds (`which`): 0 = w_gate_up [E_local, H, 2I] (fused) or w_gate
    [E_local, H, I] (split), 1 = w_down [E_local, I, H], 2 = w_up [E_local,
    H, I] (split only). ctx.W[which] is the local stack (None if absent).
    Biases (optional, both or neither): b_gate_up [E_local, 2I] (a bias per
    column of h = [gate | up], or interleaved for "gpt_oss"), b_down
    [E_local, H]. `plan_state` (load [P, E] int64 CPU, send_index [T*K]
    int64 on x's device), when given, is forward's: the call skips the
    count, the all-gather and the route (no host round trip).
    `one_chunk_rows` (P > 1): when no rank sends or receives more rows than
    this, the step runs as one chunk (n = 1, `one_chunk`: standard EP's
    single dispatch, grouped GEMM and combine; moepeak/llep/one_chunk.py);
    0: never. Decided from the all-gathered loads: the same on every rank.
    `options`: the call's LLEPOptions, chunk_rows the launch's C (an int).
    `stats`: the call's record (moepeak/llep/stats.py keys), filled as it runs."""

    def __init__(self, x, topk_ids, topk_weights, weights, biases, activation, tr, options: LLEPOptions,
                 plan_state=None, one_chunk_rows: int = 0, keep_one_chunk: bool = False):
        w0, w_down, w_up = weights
        self.x, self.tr, self.activation, self.options = x, tr, activation, options
        self.C = int(options.chunk_rows)
        self.W = [w0, w_down, w_up]
        self.wgu, self.wu = w0, w_up
        self.split = w_up is not None
        self.kinds = (0, 1, 2) if self.split else (0, 1)
        self.bgu_local, self.bd_local = biases
        self.has_bias = self.bgu_local is not None
        self.T, self.H = x.shape
        self.K = topk_ids.shape[1]
        self.El = w0.shape[0]
        self.I = w_down.shape[1]
        self.P = tr.world_size if tr is not None else 1
        self.r = tr.rank if tr is not None else 0
        self.E = self.El * self.P
        self.pinned = x.is_cuda  # host->device copies staged in pinned memory
        self.stats: Dict[str, object] = dict(host_syncs=0, h2d_copies=0, grouped_mm=0, grouped_dw=0,
                                             grouped_fallback=0)
        self.grouped_failed = False  # torch._grouped_mm raised under "auto": per-expert GEMMs from then on
        self.ids = topk_ids.reshape(-1).to(torch.int64).contiguous()
        self.wflat = topk_weights.reshape(-1).to(torch.float32).contiguous()
        self.one_chunk_rows, self.keep_one_chunk = int(one_chunk_rows), bool(keep_one_chunk)
        if plan_state is None:
            self.load = self._gather_loads()
        else:
            self.load = plan_state[0]
        self.plan = lp.llep_plan(self.load, options.alpha, options.min_tokens_per_gemm, options.imbalance_threshold)
        S = self.plan.S
        # rows this rank receives; the most any rank sends or receives (the one-chunk test)
        self.recv_rows = int(S[:, self.r].sum())
        step_rows = max(int(S.sum(0).max()), int(S.sum(1).max()))
        self.one_chunk = self.P > 1 and 0 < step_rows <= one_chunk_rows
        self.n = 1 if self.one_chunk else lp.num_chunks(S, self.C)
        if plan_state is None:
            self.send_index = lp.route(self.ids, self.E, self.plan, self.r, self.load[self.r], self.host_to_device)
        else:
            self.send_index = plan_state[1]
        # Borrowed experts (run here, owned elsewhere) and lent ones (ours, run
        # on d). Both ascending by expert id, so grouped by owner.
        Q = self.plan.Q
        own = range(self.r * self.El, (self.r + 1) * self.El)
        self.borrowed = [e for e in range(self.E) if e // self.El != self.r and int(Q[e, self.r]) > 0]
        self.lend = [[e for e in own if d != self.r and int(Q[e, d]) > 0] for d in range(self.P)]
        self.slot = {e: i for i, e in enumerate(self.borrowed)}
        # One expert's parameters, flattened (lending): each weight kind row-major
        # [in, N], then b_gate_up [2I] and b_down [H].
        self.flat_off, off = {}, 0
        for which in self.kinds:
            self.flat_off[which] = off
            off += self.dims(which)[0] * self.dims(which)[1]
        self.bias_off = off
        self.per = off + (2 * self.I + self.H if self.has_bias else 0)
        self.bW = {}  # which -> per borrowed slot, the [in, N] matrix
        self.bias_table = None
        self._lent = None  # the lending all-to-all-v's handle until waited for
        if self.plan.spilled:
            self._lend_weights()
        if self.has_bias:
            self._make_bias_tables()
        self.layouts: Dict[int, lp.ChunkLayout] = {}
        # experts whose weight gradient (per kind) holds a partial sum
        self.touched = (set(), set(), set())
        self._staging = [None, None, None]  # see staging()
        self.stats.update(n_chunks=self.n, chunk_rows=self.C, spilled=self.plan.spilled,
                          borrowed=list(self.borrowed), max_rows=0, one_chunk_ep=self.one_chunk)

    def _gather_loads(self):
        """Count picks per expert and all-gather [counts (E) | ids outside
        [0, E) (1) | config fingerprint (F)] per rank in ONE collective and
        ONE host read; bad ids and differing configs are reported on every
        rank. Returns load [P, E] int64 CPU."""
        tr, dev, x, o = self.tr, self.x.device, self.x, self.options
        cnt = lp.count(self.ids, self.E)
        fp = lp.config_fingerprint(E=self.E, K=self.K, H=self.H, I=self.I, C=self.C, m=o.min_tokens_per_gemm,
                                   alpha=float(o.alpha), lam=float(o.imbalance_threshold),
                                   dtype=DTYPE_CODES[x.dtype], cuda=int(x.is_cuda), split=int(self.split),
                                   bias=int(self.has_bias), act=ACTIVATIONS.index(self.activation),
                                   one=self.one_chunk_rows, keep=int(self.keep_one_chunk))
        if tr is not None:
            mine = torch.cat([cnt, self.host_to_device(torch.tensor(fp, dtype=torch.int64))])
            rows = torch.empty(self.P, mine.numel(), dtype=torch.int64, device=dev)
            tr.all_gather(rows, mine)
            rows = self.to_host(rows)
            fps = rows[:, self.E + 1:]
            bad = [s for s in range(self.P) if not torch.equal(fps[s], fps[0])]
            if bad:
                raise ValueError(f"moepeak: llep_moe configuration differs across ranks {bad} vs rank 0 "
                                 "(num_experts, top_k, hidden/intermediate size, chunk_rows, alpha, "
                                 "min_tokens_per_gemm, imbalance_threshold, dtype, device type, activation, "
                                 "biases, weight split, one_chunk_rows and keep_one_chunk must agree)")
        else:
            rows = self.to_host(cnt)[None]
        badr = [s for s in range(self.P) if int(rows[s, self.E]) != 0]
        if badr:
            raise ValueError(f"moepeak: topk_ids has {int(rows[badr[0], self.E])} id(s) outside "
                             f"[0, num_experts={self.E}) on rank(s) {badr}")
        return rows[:, :self.E].contiguous()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """t on the host: the call's device->host syncs all go through here
        (stats["host_syncs"] counts them)."""
        self.stats["host_syncs"] += 1
        return t.cpu()

    def host_to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host table t on x's device, copied asynchronously: staged in
        pinned memory on CUDA (the caching host allocator keeps the staging
        block until the copy has run). stats["h2d_copies"] counts them."""
        self.stats["h2d_copies"] += 1
        if self.pinned:
            t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
        return t.to(self.x.device, non_blocking=True)

    def grouped_perms(self, lay: lp.ChunkLayout, out: torch.Tensor):
        """(perm, inv) [rows] int64 on x's device, in out [>= 2*rows] (int64):
        perm maps a grouped position to its receive row, inv a receive row
        to its grouped position; one host->device copy."""
        rows = lay.rows
        host = torch.empty(2 * rows, dtype=torch.int64, pin_memory=self.pinned)
        host[:rows] = lay.perm
        host[rows:].index_copy_(0, lay.perm, torch.arange(rows, dtype=torch.int64))
        self.stats["h2d_copies"] += 1
        dev = out[:2 * rows]
        dev.copy_(host, non_blocking=True)
        return dev[:rows], dev[rows:]

    def dims(self, which: int):
        """(in, N) of weight kind `which`: the forward GEMM is [rows, in] x [in, N]."""
        if which == 1:
            return self.I, self.H
        return self.H, (self.I if self.split else 2 * self.I)

    # ---- weights ---------------------------------------------------------
    def _lend_weights(self):
        def flat(le):
            parts = [self.W[w][le].reshape(-1) for w in self.kinds]
            if self.has_bias:
                parts += [self.bgu_local[le].reshape(-1), self.bd_local[le].reshape(-1)]
            return torch.cat(parts)
        parts = [flat(e - self.r * self.El) for d in range(self.P) for e in self.lend[d]]
        send = torch.cat(parts) if parts else self.wgu.new_empty(0)
        recv_counts = [sum(1 for e in self.borrowed if e // self.El == o) * self.per for o in range(self.P)]
        recv = self.wgu.new_empty(len(self.borrowed) * self.per)
        self._lent = self.tr.all_to_all_v(send, [len(l) * self.per for l in self.lend], recv, recv_counts)
        self.bflat = recv.view(len(self.borrowed), self.per)
        for which in self.kinds:
            self.bW[which] = [self._slot_stack(which, i, 1)[0] for i in range(len(self.borrowed))]

    def wait_lent(self):
        """The lent weights have arrived (waited for once, at first use, so the
        lending overlaps the first dispatch)."""
        if self._lent is not None:
            self._lent.wait()
            self._lent = None

    def borrowed_stack(self, which: int, i0: int, n: int):
        """[n, in, N] view of borrowed slots i0..i0+n-1's weight kind `which`."""
        self.wait_lent()
        return self._slot_stack(which, i0, n)

    def _slot_stack(self, which: int, i0: int, n: int):
        a, N = self.dims(which)
        o = self.flat_off[which]
        return self.bflat[i0:i0 + n, o:o + a * N].unflatten(1, (a, N))

    def _make_bias_tables(self):
        """bias_table = (gate_up [El + nb, 2I], down [El + nb, H]): table row
        of local expert le is le, of borrowed slot i is El + i. Without
        borrowed experts the tables are the biases themselves (no copy)."""
        if not self.borrowed:
            self.bias_table = (self.bgu_local, self.bd_local)
            return
        self.wait_lent()
        o = self.bias_off
        bgu = self.bflat[:, o:o + 2 * self.I]
        bd = self.bflat[:, o + 2 * self.I:o + 2 * self.I + self.H]
        self.bias_table = (torch.cat([self.bgu_local, bgu]), torch.cat([self.bd_local, bd]))

    def table_row(self, e: int) -> int:
        return e - self.r * self.El if e // self.El == self.r else self.El + self.slot[e]

    def weights(self, e: int):
        """Expert e's [in, N] matrices, indexed by weight kind (None where absent)."""
        if e // self.El == self.r:
            le = e - self.r * self.El
            return tuple(W[le] if W is not None else None for W in self.W)
        self.wait_lent()
        i = self.slot[e]
        return tuple(self.bW[w][i] if w in self.bW else None for w in range(3))

    def layout(self, j: int) -> lp.ChunkLayout:
        lay = self.layouts.get(j)
        if lay is None:
            cap = self.recv_rows if self.one_chunk else self.C
            lay = lp.chunk_layout(self.plan, self.r, self.n, j, cap, with_perm=self.P > 1)  # P = 1: grouped already
            self.stats["max_rows"] = max(int(self.stats["max_rows"]), lay.rows, sum(lay.send_len))
            self.layouts = {j: lay}  # keep one: layouts are cheap to recompute
        return lay

    def send_idx(self, lay: lp.ChunkLayout, buf: torch.Tensor) -> torch.Tensor:
        """Chunk's send indices (dst-major) as one contiguous int64 tensor."""
        if self.P == 1 or self.one_chunk:  # one chunk: the whole send list (dst-major)
            a = lay.send_start[0]
            return self.send_index[a:a + sum(lay.send_len)]
        pos = 0
        for d in range(self.P):
            a, k = lay.send_start[d], lay.send_len[d]
            if k:
                buf[pos:pos + k].copy_(self.send_index[a:a + k])
            pos += k
        return buf[:pos]

    def staging(self, which: int) -> torch.Tensor:
        """A row-major [in, N] matrix of weight kind `which` in the weights'
        dtype, made on first use and reused for the rest of the call: where an
        expert's weights (or weight gradient) are not row-major, the
        per-expert GEMMs go through it (moepeak/llep/gemm.py)."""
        buf = self._staging[which]
        if buf is None:
            buf = self._staging[which] = self.W[which].new_empty(self.W[which].shape[1:])
        return buf

    def new_dw(self, which: int) -> torch.Tensor:
        """An unwritten weight gradient like weight kind `which`: same shape,
        and the same strides for a dense weight (a transposed view included),
        so autograd gets the gradient in the weight's layout."""
        return torch.empty_like(self.W[which])
