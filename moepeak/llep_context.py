"""PipelinedLLEP's per-call state (`Ctx`): what one forward or backward call
derives from its inputs before the chunk loop, with identical control flow on
every rank.

  1. count picks per expert (kernel), all-gather a config fingerprint, then the
     P x E load matrix (one small all-gather each; bad ids and differing
     configs are reported on every rank, so no rank is left hanging);
  2. plan (C, identical everywhere), n chunks, this rank's send list (route);
  3. lend spilled experts' weights to their helpers (one all-to-all-v):
     borrowed weights live in bflat [n_borrowed, H*2I + I*H] (param dtype),
     row i = slot i's w_gate_up [H, 2I] then w_down [I, H], row-major.

Weights may have any strides (e.g. Hugging Face's [E, 2I, H] storage seen
through transpose(1, 2)): they are only sliced per expert, never copied
whole; weight gradients are allocated like the weights (same strides).
"""
from __future__ import annotations

from typing import Dict

import torch

from . import llep_plan as lp

# Statistics of the last call (tests and benchmarks read them).
LAST_STATS: Dict[str, object] = {}


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
                                   lam=float(lam), dtype=lp.DTYPE_CODE[x.dtype], cuda=int(x.is_cuda))
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
        self._staging = [None, None]  # see staging()
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

    def staging(self, which: int) -> torch.Tensor:
        """A row-major [H, 2I] (which 0) or [I, H] (1) matrix in the weights'
        dtype, made on first use and reused for the rest of the call: where an
        expert's weights (or weight gradient) are not row-major, the
        per-expert GEMMs go through it (moepeak/llep_gemm.py)."""
        buf = self._staging[which]
        if buf is None:
            W = self.wgu if which == 0 else self.wd
            buf = self._staging[which] = W.new_empty(W.shape[1:])
        return buf

    def new_dw(self, which: int) -> torch.Tensor:
        """An unwritten weight gradient like w_gate_up (which 0) or w_down (1):
        same shape, and the same strides for a dense weight (a transposed view
        included), so autograd gets the gradient in the weight's layout."""
        return torch.empty_like(self.wgu if which == 0 else self.wd)
