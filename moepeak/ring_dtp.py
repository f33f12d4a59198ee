"""Ring-DTP: the vocabulary projection + cross-entropy that never holds the logits.

    loss = linear_cross_entropy(hidden, weight, labels)   # == F.cross_entropy(F.linear(h, w).float(), y)

Only a logits *block* exists at a time; forward keeps lse: [T] x fp32; the
arithmetic torch lacks (online log-sum-exp fold with target pick, padded-vocab
masking, softcap; the softmax-gradient epilogue with label smoothing, z-loss,
ignore_index, and 1 - p_y from a sum that never cancels) is C (csrc/ce.c) and CUDA C (cuda/ce.cu);
every GEMM is torch's. Schedules ("mode"):

  fused        token-outer, gradients computed in forward (3 GEMMs: Z, dX, dW).
               A chunk holds whole vocab rows Z: [ct, V] x fp32, so dZ exists
               after one pass; dX of the chunk is one exact GEMM; dW (in the
               weight's dtype) is accumulated chunk by chunk (see "Error growth"), except
               its label column (dZ[t, y_t], the largest terms), which is taken out
               of each chunk's dZ for the dW GEMM and added once at the end, summed
               in fp32 ("dW's finish", B.finish_dw); past FUSED_CENTER_CHUNKS chunks
               also centered (the dW GEMMs on X - mu, colsum(dZ) mu^T in the finish).
  vocab_outer  4 GEMMs. Forward folds lse; backward, per vocab block, recomputes
               Z, makes dZ, and sums dW_b in fp32 over token chunks (exact),
               dX += dZ W_b into an fp32 [T, H] accumulator (exact).
  token_outer  4 GEMMs. Backward per token chunk: dX of the chunk exact in fp32,
               dW accumulated in the weight's dtype, chunk by chunk.
  fused_lowp   like fused, but the GEMM writes the logits in the input dtype
               (bf16/fp16, fp32-accumulated: the rounding naive F.linear has)
               into one [ct, V] workspace, the fold reads it, and the gradient
               kernel overwrites it in place with dZ, which feeds the dX and dW
               GEMMs directly: per element 2 B written by the GEMM, 2 B read by
               the fold, 2 B read + 2 B written by the gradient (fused with fp32
               logits: 4 + 4 + 4 + 2), and more rows per chunk (2048 in a
               594 MiB block vs 576 in 512 MiB at V = 151936; see
               ring_dtp_sizes.fused_chunk_tokens for why 2048).
  vocab_outer_lowp
               vocab_outer with dX accumulated in the input dtype (bf16/fp16)
               over its vocab blocks (one rounding per block) instead of an fp32
               [T, H] accumulator, except each token's label term (p_y - 1) W[y],
               taken out of its block's dZ and added once in fp32 at the end
               ("dX's finish", B.finish_dx); dW exact per block as in vocab_outer.
               At least 8 blocks, narrower where the fp32 dW block [cv, H] would
               pass 300 MiB (ring_dtp_sizes.lowp_dx_block_cols). At T = 128k,
               H = 4096, V = 151936, bf16: 8 blocks of 19072 columns, dW block
               298 MiB, so 2.16 GiB of gradients + ~0.55 GiB, where vocab_outer
               needs a 2 GiB fp32 dX accumulator (+ its 1 GiB bf16 copy).
  auto         fp32 inputs: fused. Low precision: fused_lowp when backward is
               certain (grad enabled, reduction mean/sum) and it needs at most
               128 token chunks (T <= 262144 at V = 151936 with 2048-row
               chunks); otherwise vocab_outer (exact dW and dX, 4 GEMMs) while
               its fp32 [T, H] dX accumulator is at most the 512 MiB workspace
               (T*H <= 128M), vocab_outer_lowp beyond that.

Measured on one H200 (torch 2.11, 2026-11-30 00:16 UTC; benchmarks/bench_ring_dtp.py
--quick --interleave), T = 32k, H = 4096, V = 151936, bf16, fwd+bwd; 3-GEMM time 153.2
ms at the 799 TFLOP/s the 8192^3 probe measured in that run (761-809 in other runs);
peak above the inputs incl. dX + dW; errors vs fp64 at T = 8192 with the same chunk
count (naive bf16: dX 1.67e-3, dW 1.02e-3):
  arm                          ms     peak GiB   dX err  dW err
  naive                        234.9  55.6       1.00x   1.00x
  naive + torch.compile        191.6  10.7       1.00x   1.00x
  Liger FLCE (fp32 acc)        205.5   3.73      0.99x   1.00x
  fused_lowp, 2048 rows (16)   189.7   1.99      0.99x   1.00x   <- auto (1.24x the 3-GEMM time)
  fused_lowp, 1728 rows (19)   200.0   1.90      0.99x   1.00x
  fused (fp32 logits)          224.7   1.90      0.99x   1.00x
  vocab_outer                  310.5   2.04      0.99x   1.00x
  token_outer                  316.1   1.58      0.99x   1.04x
  CCE                          356.4   1.41      8.2x    4.1x
  Round-robin, 10 rounds: auto 189.4 ms, naive + torch.compile 191.3 ms, Liger 209.6 ms,
  the 3 GEMMs alone at their own shapes 180.4 ms (auto 1.050x of them).
  T = 128k (64 chunks, centered): auto 763.2 ms / 2.75 GiB, Liger 758.1 ms / 4.48 GiB,
  CCE 1412.5 ms / 2.16 GiB, naive OOM. T = 128k, V = 256000 (103 chunks of 1280 rows):
  auto (now fused_lowp) 1314.5 ms / 3.57 GiB where vocab_outer_lowp took 1896.8 ms /
  3.50 GiB; with the 1152-row chunks of today's sizing (114) 1326.2 ms / 3.52 GiB.
  Three later runs (01:08, 01:15 and 02:25 UTC, three machines; centering's column sums
  from the gradient kernel, the last with today's dW finish): 32k auto 188.6 / 194.0 /
  190.9 ms at probes of 755 / 769 / 788 TFLOP/s (1.16x / 1.22x / 1.23x), naive + compile
  190.8 / 199.9 / 195.1, Liger 202.6 / 212.3 / 208.6; 128k auto 757.2 / 778.3 / 772.7 ms
  at 2.75 GiB, Liger 756.2 / 780.5 / 772.0. A fourth (03:33 UTC, probe 775 TFLOP/s, the
  finish of session 11): 192.4 ms uncentered (1.22x), 194.8 centered (1.23x; the default
  since: past 8 chunks), naive + compile 196.6, Liger 210.6; round-robin 192.3 / 194.1 /
  196.7 / 213.5. A fifth (04:38 UTC, probe 779 TFLOP/s, session 12's finish): 187.8-188.9
  ms centered in three same-code arms (1.196-1.203x), naive + compile 188.3, Liger 201.6;
  round-robin 188.3 / 188.6 / 206.1; 128k 747.8 ms, Liger 747.4. The ratio follows the
  machine's probe more than the code; TunableOp found no cuBLAS/cuBLASLt algorithm faster
  than the default for these GEMMs. The largest excess over the GEMMs' probe rate is dW's
  GEMM: K = 2048 rows against a 1.24 GB output, 3.75-3.85 ms a chunk where dX's, the same
  FLOPs, takes 3.45 (H200 profile, 04:46 UTC).
  Where the 32k time goes, and the grid over T, H, V: benchmarks/RESULTS.md.
Error growth with the chunk count. fused* accumulate dW in bf16 over the token chunks,
vocab_outer_lowp dX over its vocab blocks: on CUDA torch's bf16 addmm_ gives
rn(dW + rn(dZ^T X)), the chunk's product rounded before it is added (every element, H200,
probe_gemm_paths.py rounding), and the CPU path rounds the same way. A chunk's rounding
error is relative to the running sum, so terms that add up over chunks make the error
grow with their number: above all a dW row's label terms (p - 1) x_t, which for a
frequent label (real text; a byte-level vocabulary) come in every chunk, and, for hidden
states that share a mean direction mu (the anisotropy of real final hidden states), the
non-label terms colsum(dZ) mu^T. The finish takes the label terms out of the GEMMs and
adds them once in fp32; past FUSED_CENTER_CHUNKS (8) chunks the centering does the same
for the mean direction: the dW GEMMs take X - mu (written into the chunk's own dX rows
before its dX GEMM: no buffer; ce_sub_row, 16-byte vectors) and colsum(dZ) (fp32) joins the
finish as a rank-1 term. (In the last chunk's dW GEMM instead, the term would be rounded
twice, rn(dW + rn(product)): 1.41x naive's dW error at x_mean = 3, measured.)
The gradient kernel makes colsum(dZ) as it writes dZ (B.grad_block(colsum=); its scratch
is the chunk's dX rows again): H200, one 2048-row chunk at V = 151936, 0.324 ms for the
kernel alone, 0.336 with the sums, 0.472 with a ones-row GEMM after it (the fallback
where rows are not 16-byte aligned). The same kernel takes the label column out into tc
(grad_block(take=)): at T = 32k, 16 chunks, 0.09 ms of put-back scatters are left of the
0.33 ms that the separate take and put-back cost. H200, T = 8192,
H = 4096, V = 151936, bf16, dW error / naive's, centered / finish only / neither
(benchmarks/study_dw_error.py; results/study_dw_error_center_h200.log); x_mean = the
shared direction's per-dimension std (1: cosine ~0.5 between tokens, 3: ~0.9):
  inputs                      16 chunks             64 chunks             128 chunks
  uniform labels, x_mean 0    1.01 / 1.00 / 1.16    1.01 / 1.00 / 1.18    1.01 / 1.00 / 1.18
  uniform labels, x_mean 1    1.00 / 1.16 / 6.38    1.00 / 1.56 / 12.45   1.00 / 2.46 / 15.31
  uniform labels, x_mean 3    1.00 / 2.39 / 2.47    1.00 / 4.98 / 5.21    1.00 / 10.57 / 10.79
  Zipf(1.1) labels, x_mean 0  1.00 / 1.00 / 2.65    1.00 / 1.00 / 4.29    1.00 / 1.00 / 5.49
  Zipf, x_mean 1              1.00 / 1.00 / 2.41    1.00 / 1.01 / 4.61    1.00 / 1.02 / 6.46
  Zipf, x_mean 3              1.00 / 1.24 / 2.54    1.00 / 1.94 / 4.85    1.00 / 3.72 / 7.73
At 8 chunks and fewer the centering is off: there the finish alone holds dW within 2x
naive's error even at x_mean = 3 (H200, T = 8192, uniform labels, finish only: 1.39 / 1.54 /
1.85 / 2.39 at 2 / 4 / 8 / 16 chunks, centered 1.00 at each; Zipf 1.05 / 1.08 / 1.13 / 1.24;
results/study_dw_error_chunks_s11.log), and the centering's fixed costs (above all the rank-1
pass over dW's unlabelled rows, 0.49 ms at T = 32k, V = 151936, H = 4096 in the
H200 profile of 2026-11-30 06:42 UTC) weigh most on a short T.
The 32k target shape (16 chunks) is centered: +1.0-1.2% there (H200, 2026-11-30, bench_ring_dtp
--quick: 194.8 vs 192.4 ms; round-robin 194.1 vs 192.3). Set ring_dtp.FUSED_CENTER_CHUNKS = 1
to center at any chunk count; mode="vocab_outer" is exact whatever the inputs.
vocab_outer_lowp's dX with its finish: 0.98-1.00x naive's on the H200 grid's six H x V
at 8 blocks (2.4-3.5x without it), 0.76x for x_mean = 3.
GEMMs: fp32 logits straight from cuBLAS via torch.mm(out_dtype=fp32, out=)
where torch has it (>= 2.8), else bf16 logits upcast in 256-row pieces.

Definitions: all labels ignored with reduction="mean" gives loss 0 and zero
gradients (mean over zero tokens := 0, never NaN). Labels outside [0, V) that
are not ignore_index: on CPU a ValueError before any work; on CUDA (checking
would need a host sync) those tokens' losses are NaN (so a mean loss is NaN),
their gradients 0, and a ValueError is raised at the next call or by
check_labels() (a pinned flag copied asynchronously and read once its event
has completed: no sync, no device-side assert).
z-loss adds z_loss * lse^2 per token; return_lse returns lse: [...] x fp32
(not differentiable: use z_loss to put a gradient on it).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _C
from ._ext import check_tensor, current_stream_handle, require_cuda_build
from .transport import check_transport_choice
from . import ring_dtp_blocks as B
from . import ring_dtp_sizes as S

REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
MODES = {"auto": 0, "fused": 1, "vocab_outer": 2, "token_outer": 3, "fused_lowp": 4, "vocab_outer_lowp": 5}
_FUSED = (MODES["fused"], MODES["fused_lowp"])


# ---------------------------------------------------------------------------
# Out-of-range labels on CUDA: a lazily read flag (no host sync).
# ---------------------------------------------------------------------------
def _is_compiling() -> bool:
    f = getattr(torch.compiler, "is_compiling", None)
    return bool(f()) if f is not None else False


class _LabelGuard:
    pending = []  # [(event, pinned int32 [1], V)]

    @classmethod
    def record(cls, bad: Tensor, V: int) -> None:
        flag = torch.empty(1, dtype=torch.int32, pin_memory=True)
        flag.copy_(bad.any().to(torch.int32).reshape(1), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        cls.pending.append((ev, flag, V))

    @classmethod
    def check(cls, wait: bool = False) -> None:
        # Never while tracing: reading the flag is a data-dependent branch
        # (GuardOnDataDependentSymNode under torch.compile). The op bodies run
        # eagerly (custom ops are opaque to the compiler) and call this there, so
        # an error recorded by a compiled call still surfaces at the next call.
        if _is_compiling():
            return
        keep = []
        err = None
        for ev, flag, V in cls.pending:
            if wait:
                ev.synchronize()
            if ev.query():
                if int(flag[0]) and err is None:
                    err = V
            else:
                keep.append((ev, flag, V))
        cls.pending = keep
        if err is not None:
            raise ValueError(f"moepeak: labels must be in [0, {err}) or ignore_index; an earlier "
                             "linear_cross_entropy call on CUDA got out-of-range labels (its loss was NaN)")


def check_labels() -> None:
    """Wait for pending CUDA label checks and raise if any call had out-of-range labels."""
    _LabelGuard.check(wait=True)


def _sanitize_labels(labels: Tensor, V: int, ignore_index: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(labels with bad ones replaced by ignore_index, valid mask, bad mask)."""
    ign = labels == ignore_index
    bad = ~ign & ((labels < 0) | (labels >= V))
    if labels.device.type != "cuda":
        if bool(bad.any()):
            vals = labels[bad][:5].tolist()
            raise ValueError(f"moepeak: labels must be in [0, {V}) or ignore_index={ignore_index}; got {vals}")
    else:
        _LabelGuard.record(bad, V)
    clean = torch.where(bad, torch.full_like(labels, ignore_index), labels).contiguous()
    return clean, ~ign, bad


# ---------------------------------------------------------------------------
# Schedules (single device). x: [T, H], w: [V, H], y: [T] int64 (clean).
# ---------------------------------------------------------------------------
def _fold_all(x, w, bias, y, ignore_index, softcap, ct, cv):
    T, V = x.shape[0], w.shape[0]
    st = B.new_state(T, x.device)
    for t0 in range(0, T, ct):
        t1 = min(T, t0 + ct)
        part = tuple(a[t0:t1] for a in st)
        for v0 in range(0, V, cv):
            v1 = min(V, v0 + cv)
            z = B.logits_block(x[t0:t1], w[v0:v1], None if bias is None else bias[v0:v1])
            B.fold(z, v0, V, y[t0:t1], ignore_index, softcap, *part)
    return st


# The fused modes' dW finish (see _fused) and vocab_outer_lowp's dX finish (see
# _backward_blocked) on; False only for the A/B of tests and benchmarks/study_dw_error.py.
FUSED_DW_FINISH = True
LOWP_DX_FINISH = True
# The fused modes center X for their dW GEMMs past this many token chunks (see _fused
# and "Error growth" above): 1 centers whenever dW spans chunks; a huge number turns the
# centering off (the A/B of tests and the study). 8: see "Error growth".
FUSED_CENTER_CHUNKS = S.FUSED_CENTER_CHUNKS
# The centering's colsum(dZ) from the gradient kernel (CUDA; see _fused); False: a GEMM per
# chunk re-reads dZ (the A/B of tests and benchmarks).
FUSED_COLSUM = True


def _fused(x, w, bias, y, ignore_index, softcap, eps, zloss, g, ct, lowp_logits=False):
    """Forward with gradients (3 GEMMs). g: [1] x fp32 (the per-token weight).
    lowp_logits: the GEMM writes the logits in x.dtype (bf16/fp16, fp32-accumulated, as naive
    F.linear does) and dZ is made in place in that block (CUDA); on CPU the same rounding is
    applied to an fp32 block (z <- fp32(bf16(z))), so CPU tests check these numerics."""
    T, V = x.shape[0], w.shape[0]
    st = B.new_state(T, x.device)
    dx = torch.empty_like(x)
    f32acc = x.dtype == torch.float32
    dw = torch.empty_like(w) if T else torch.zeros_like(w)  # the first chunk writes dW, the others add
    db = None if bias is None else torch.zeros(V, dtype=torch.float32, device=x.device)
    # Workspace, allocated once (no allocation inside the loop):
    #   fp32 logits:   zbuf [ct, V] x fp32 and dzbuf [ct, V] x dtype (CUDA low precision;
    #                  elsewhere dZ is made in place in zbuf and cast per chunk);
    #   lowp logits:   zbuf [ct, V] x dtype on CUDA (dZ in place: one buffer), fp32 on CPU.
    ct = min(ct, T)
    lowp = x.dtype != torch.float32
    cuda = x.device.type == "cuda"
    direct = lowp_logits and lowp and cuda
    zbuf = torch.empty((ct, V), dtype=x.dtype if direct else torch.float32, device=x.device)
    dzbuf = torch.empty((ct, V), dtype=x.dtype, device=x.device) if (cuda and lowp and not direct) else None
    # dW in bf16/fp16 over more than one chunk ("Error growth"): the label column of each
    # chunk's dZ (its largest terms; a frequent label has one in every chunk) goes to tc
    # and into dW once, summed in fp32 (B.finish_dw), instead of once per chunk.
    split = lowp and T > ct and FUSED_DW_FINISH
    tc = torch.empty(T, dtype=torch.float32, device=x.device) if split else None
    # Centering, past FUSED_CENTER_CHUNKS chunks: what the finish leaves in the GEMMs also
    # adds up over chunks along a mean direction mu the hidden states share (colsum(dZ) mu^T
    # in every chunk), so the dW GEMMs take X - mu (one rounding per element, relative to
    # |x - mu|) and colsum(dZ) (fp32, a [1, n] x [n, V] GEMM per chunk) joins the finish as
    # the rank-1 term cs mu^T: dZ^T X = dZ^T (X - mu) + colsum(dZ) mu^T exactly. No buffer for
    # X - mu: it is written into the chunk's own dX rows, before dX's GEMM (so per chunk the
    # dW GEMM comes first, with the label column taken out and then put back for dX's).
    # colsum(dZ) comes from the gradient kernel itself where it can (CUDA, 16-byte rows:
    # B.colsum_fusable), through a [<= COLSUM_GROUPS, V] x fp32 scratch that is the chunk's
    # own dX rows again (B.colsum_scratch; free until X - mu is written there); else (or for
    # a last chunk too short to hold one scratch row) a GEMM re-reads dZ.
    center = split and -(-T // ct) > FUSED_CENTER_CHUNKS
    if center:
        H = x.shape[1]
        ones = torch.ones((1, ct), dtype=x.dtype, device=x.device)
        mu32 = torch.empty(H, dtype=torch.float32, device=x.device)
        for t0 in range(0, T, ct):
            B.colsum_acc_(mu32, x[t0:t0 + ct], ones, first=t0 == 0)
        mu = mu32.div_(T).to(x.dtype)                           # [H] in x.dtype: the GEMMs' operand
        mu32.copy_(mu)                                          # and exactly it in fp32 for the finish
        cs = torch.empty(V, dtype=torch.float32, device=x.device)
        fuse_cs = FUSED_COLSUM and B.colsum_fusable(zbuf, dzbuf)
    for t0 in range(0, T, ct):
        t1 = min(T, t0 + ct)
        n = t1 - t0
        m, s, zy, zs, sx = (a[t0:t1] for a in st)
        xc = x[t0:t1]
        if direct:
            z = torch.mm(xc, w.t(), out=zbuf[:n])                # [n, V] x dtype, fp32-accumulated
            if bias is not None:
                z.add_(bias)
        else:
            z = B.mm_f32_into(xc, w.t(), zbuf[:n])           # [n, V] x fp32: the whole vocab row
            if bias is not None:
                z.add_(bias.float())
            if lowp_logits and lowp:                          # CPU: the rounding of a low-precision GEMM output
                z.copy_(z.to(x.dtype))
        B.fold(z, 0, V, y[t0:t1], ignore_index, softcap, m, s, zy, zs, sx)
        mm_, ls, q = B.fin((m, s, zy, zs, sx))
        part = B.colsum_scratch(dx[t0:t1], V) if center and fuse_cs else None
        dz = B.grad_block(z, 0, V, y[t0:t1], ignore_index, softcap, mm_, ls, q, g, eps, V, zloss, x.dtype,
                          out=None if dzbuf is None else dzbuf[:n],
                          colsum=None if part is None else (cs, part, t0 == 0),
                          take=None if part is None else tc[t0:t1])
        del z
        col = None                                            # dW's GEMM without the label column:
        if split and part is None:                            # (with the fused column sums the kernel took it)
            col = B.take_label_column(dz, y[t0:t1], tc[t0:t1])
        xg = xc
        if center:                                            # this chunk's dX rows as scratch for
            xg = B.sub_row(xc, mu, dx[t0:t1])                 # X - mu: dX's GEMM below overwrites them
            if part is None:
                B.colsum_acc_(cs, dz, ones, first=t0 == 0)
        B.mm_acc_(dw, dz.t(), xg, first=t0 == 0)              # rn(dW + rn(product)) (Error growth)
        if split:                                             # dX's GEMM with it: put it back, exactly
            B.put_label_column(dz, y[t0:t1], tc[t0:t1], col)
        if x.device.type == "cuda" or f32acc:
            torch.mm(dz, w, out=dx[t0:t1])                    # exact: one GEMM over the whole row
        else:
            dx[t0:t1] = B.mm(dz, w, False)
        if db is not None:
            db.add_(dz.float().sum(0))
        del dz  # the previous chunk's dZ must not live while the next one is made
    del zbuf, dzbuf  # the finish's scratch (the sort of the labels, flags [V]) reuses the block
    if split:
        B.finish_dw(dw, x, y, tc, cs=cs if center else None, mu=mu32 if center else None)
    return st, dx, dw, db


def _backward_blocked(x, w, bias, y, m, ls, q, g, ignore_index, softcap, eps, zloss, ct, cv, order):
    """4th and later GEMMs: recompute blocks and accumulate dX, dW (see module doc)."""
    T, H = x.shape
    V = w.shape[0]
    db = None if bias is None else torch.zeros(V, dtype=torch.float32, device=x.device)
    g1 = g.numel() == 1

    def grad(t0, t1, v0, v1):
        z = B.logits_block(x[t0:t1], w[v0:v1], None if bias is None else bias[v0:v1])
        gg = g if g1 else g[t0:t1]
        dz = B.grad_block(z, v0, V, y[t0:t1], ignore_index, softcap, m[t0:t1], ls[t0:t1], q[t0:t1], gg, eps, V,
                           zloss, x.dtype)
        if db is not None:
            db[v0:v1].add_(dz.float().sum(0))
        return dz

    if order == "vocab_outer":
        dx_acc = torch.zeros((T, H), dtype=torch.float32, device=x.device)   # [T, H] x fp32
        dw = torch.empty_like(w)
        for v0 in range(0, V, cv):
            v1 = min(V, v0 + cv)
            dw_b = None                                                      # [cv, H] x fp32
            for t0 in range(0, T, ct):
                t1 = min(T, t0 + ct)
                dz = grad(t0, t1, v0, v1)
                dx_acc[t0:t1].add_(B.mm(dz, w[v0:v1], True))
                part = B.mm(dz.t(), x[t0:t1], True)
                dw_b = part if dw_b is None else dw_b.add_(part)
            dw[v0:v1] = dw_b
        return dx_acc.to(x.dtype), dw, db
    if order == "vocab_outer_lowp":
        # dX accumulates in x.dtype inside the output: the first vocab block writes
        # it, each later one adds with one rounding (GEMM accumulate, fp32 inside);
        # dW block [cv, H] summed in fp32 over the token chunks (exact), as above.
        # dX's finish (the mirror of the fused modes' dW finish): a token's label
        # column, its largest dZ term (p_y - 1), is taken out of its vocab block's
        # dZ after the dW GEMM (which needs it) and before the dX GEMM, and
        # tc[t] * W[y_t] is added once at the end in fp32, so the roundings over the
        # vocab blocks are relative to the small sum of p_v W_v, not to W[y_t].
        if not T:
            return torch.zeros_like(x), torch.zeros_like(w), db
        dx = torch.empty_like(x)
        dw = torch.empty_like(w)
        dw_b = torch.empty((min(cv, V), H), dtype=torch.float32, device=x.device)
        split = V > cv and LOWP_DX_FINISH
        tc = torch.zeros(T, dtype=torch.float32, device=x.device) if split else None
        for v0 in range(0, V, cv):
            v1 = min(V, v0 + cv)
            blk = dw_b[:v1 - v0]
            for t0 in range(0, T, ct):
                t1 = min(T, t0 + ct)
                dz = grad(t0, t1, v0, v1)
                B.mm_f32_acc_(blk, dz.t(), x[t0:t1], first=t0 == 0)
                if split:
                    B.take_label_column_block(dz, y[t0:t1], tc[t0:t1], v0)
                B.mm_acc_(dx[t0:t1], dz, w[v0:v1], first=v0 == 0)
                del dz
            dw[v0:v1] = blk
        if split:
            B.finish_dx(dx, w, y, tc)
        return dx, dw, db
    # token_outer: dX exact per chunk, dW accumulates in the weight's dtype
    dx = torch.empty_like(x)
    dw = torch.zeros_like(w)
    for t0 in range(0, T, ct):
        t1 = min(T, t0 + ct)
        dx_c = torch.zeros((t1 - t0, H), dtype=torch.float32, device=x.device)
        for v0 in range(0, V, cv):
            v1 = min(V, v0 + cv)
            dz = grad(t0, t1, v0, v1)
            dx_c.add_(B.mm(dz, w[v0:v1], True))
            dw[v0:v1].add_(B.mm(dz.t(), x[t0:t1], True))
        dx[t0:t1] = dx_c
    return dx, dw, db


def _reduce(rows: Tensor, valid: Tensor, reduction: int) -> Tensor:
    if reduction == 0:
        return rows
    total = rows.sum()
    if reduction == 2:
        return total
    return total / valid.sum().clamp_min(1).to(torch.float32)


def _pick_mode(mode: int, grads: bool, reduction: int, T: int, H: int, V: int, dtype, chunk_tokens: int = 0) -> int:
    if mode in _FUSED and reduction == 0:
        return MODES["vocab_outer"]  # per-token upstream grads are unknown in forward
    if mode == MODES["fused_lowp"] and dtype == torch.float32:
        return MODES["fused"]  # fp32 inputs: the logits are fp32 anyway
    if mode == MODES["vocab_outer_lowp"] and dtype == torch.float32:
        return MODES["vocab_outer"]  # fp32 dX accumulation is the input dtype
    if mode != 0:
        return mode
    fusable = grads and reduction != 0  # backward certain, upstream grad one scalar
    if dtype == torch.float32:
        return MODES["fused"] if fusable else MODES["vocab_outer"]  # fp32 accumulators: exact
    return MODES[S.auto_lowp_schedule(fusable, T, H, V, B.lowp_bytes(dtype), chunk_tokens)]


def _sizes(T, H, V, dtype, mode, chunk_tokens, chunk_vocab):
    if mode in _FUSED:
        return chunk_tokens or B.fused_chunk_tokens(V, dtype, lowp_logits=mode == MODES["fused_lowp"]), V
    if mode == MODES["vocab_outer_lowp"]:
        cv = chunk_vocab or S.lowp_dx_block_cols(V, H)
        return chunk_tokens or B.lowp_dx_chunk_tokens(cv, dtype), cv
    ct, cv = B.blocked_chunks(T, H, dtype, chunk_tokens=chunk_tokens)
    return ct, (chunk_vocab or cv)


# ---------------------------------------------------------------------------
# The ops: custom_op, register_fake, register_autograd, in that order.
# ---------------------------------------------------------------------------
@torch.library.custom_op("moepeak::ring_dtp_ce", mutates_args=())
def ring_dtp_ce(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], ignore_index: int,
                reduction: int, label_smoothing: float, z_loss: float, softcap: float, mode: int,
                chunk_tokens: int, chunk_vocab: int, grads: bool
                ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """hidden [T, H], weight [V, H], labels [T] int64, bias [V] or None.
    Returns (loss: [] or [T] x fp32, m: [T] x fp32, ls = log s: [T] x fp32 (lse = m + ls),
    q = 1 - p_y: [T] x fp32, dX [T, H], dW [V, H], dbias [V] x fp32);
    dX/dW/dbias are gradients for a unit upstream grad when
    the resolved mode is 'fused', else empty."""
    T, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    if _LabelGuard.pending:  # inside the op: opaque to torch.compile, so no graph break
        _LabelGuard.check()
    y, valid, bad = _sanitize_labels(labels, V, ignore_index)
    m = _pick_mode(mode, grads, reduction, T, H, V, hidden.dtype, chunk_tokens)
    ct, cv = _sizes(T, H, V, hidden.dtype, m, chunk_tokens or None, chunk_vocab or None)
    dx, dw, db = hidden.new_empty(0), hidden.new_empty(0), torch.empty(0, dtype=torch.float32, device=dev)
    if m in _FUSED and grads:
        if reduction == 1:
            g = (1.0 / valid.sum().clamp_min(1).to(torch.float32)).reshape(1)
        else:
            g = torch.ones(1, dtype=torch.float32, device=dev)
        st, dx, dw, dbb = _fused(hidden, weight, bias, y, ignore_index, softcap, label_smoothing, z_loss, g, ct,
                                 lowp_logits=m == MODES["fused_lowp"])
        if dbb is not None:
            db = dbb
    else:
        st = _fold_all(hidden, weight, bias, y, ignore_index, softcap, ct, cv)
    m_, ls, q = B.fin(st)
    rows = B.row_losses(m_, ls, st[2], st[3], st[4], valid, bad, label_smoothing, V, z_loss)
    loss = _reduce(rows, valid, reduction)
    return loss, m_, ls, q, dx, dw, db


@ring_dtp_ce.register_fake
def _(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, mode,
      chunk_tokens, chunk_vocab, grads):
    T = hidden.shape[0]
    loss = hidden.new_empty((T,) if reduction == 0 else (), dtype=torch.float32)
    lse = hidden.new_empty((T,), dtype=torch.float32)
    q = hidden.new_empty((T,), dtype=torch.float32)
    ls = hidden.new_empty((T,), dtype=torch.float32)
    # dX/dW are either full gradients (fused) or empty: data-dependent in size only via
    # the mode choice, which depends on static arguments, so resolve it here the same way.
    m = _pick_mode(mode, grads, reduction, T, hidden.shape[1], weight.shape[0], hidden.dtype, chunk_tokens)
    if m in _FUSED and grads:
        dx, dw = torch.empty_like(hidden), torch.empty_like(weight)
        db = hidden.new_empty((weight.shape[0] if bias is not None else 0,), dtype=torch.float32)
    else:
        dx, dw = hidden.new_empty(0), hidden.new_empty(0)
        db = hidden.new_empty((0,), dtype=torch.float32)
    return loss, lse, ls, q, dx, dw, db


@torch.library.custom_op("moepeak::ring_dtp_ce_backward", mutates_args=())
def ring_dtp_ce_backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor],
                         m: Tensor, ls: Tensor, q: Tensor, ignore_index: int, reduction: int, label_smoothing: float, z_loss: float,
                         softcap: float, mode: int, chunk_tokens: int, chunk_vocab: int
                         ) -> Tuple[Tensor, Tensor, Tensor]:
    """Recompute-and-accumulate backward (modes vocab_outer / token_outer).
    grad_loss: [] or [T]. Returns dX [T, H], dW [V, H], dbias [V] x fp32 (or [0])."""
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
    resolved = _pick_mode(mode, True, reduction, T, H, V, hidden.dtype, chunk_tokens)  # as forward resolved it
    order = {MODES["token_outer"]: "token_outer",
             MODES["vocab_outer_lowp"]: "vocab_outer_lowp"}.get(resolved, "vocab_outer")
    ct, cv = _sizes(T, H, V, hidden.dtype, MODES[order], chunk_tokens or None, chunk_vocab or None)
    dx, dw, db = _backward_blocked(hidden, weight, bias, y, m.contiguous(), ls.contiguous(), q.contiguous(), g,
                                   ignore_index, softcap,
                                   label_smoothing, z_loss, ct, cv, order)
    if db is None:
        db = torch.empty(0, dtype=torch.float32, device=hidden.device)
    return dx, dw, db


@ring_dtp_ce_backward.register_fake
def _(grad_loss, hidden, weight, labels, bias, m, ls, q, ignore_index, reduction, label_smoothing, z_loss, softcap,
      mode, chunk_tokens, chunk_vocab):
    db = hidden.new_empty((weight.shape[0] if bias is not None else 0,), dtype=torch.float32)
    return torch.empty_like(hidden), torch.empty_like(weight), db


def _setup_context(ctx, inputs, output):
    (hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, mode,
     chunk_tokens, chunk_vocab, grads) = inputs
    loss, m, ls, q, dx, dw, db = output
    ctx.fused = dw.numel() > 0
    # Only `loss` is differentiable. Without these two lines autograd would hand
    # backward zero-filled gradients for every other output (materialize_grads):
    # a [T, H] and a [V, H] buffer, dX + dW a second time (the 2.88 GiB H200 peak
    # at T = 32k, H = 4096, V = 151936, instead of ~1.9).
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(m, ls, q, dx, dw, db)
    ctx.args = (ignore_index, reduction, label_smoothing, z_loss, softcap, mode, chunk_tokens, chunk_vocab)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    if ctx.fused:
        ctx.save_for_backward(dx, dw, db)
    else:
        ctx.save_for_backward(hidden, weight, labels, bias, m, ls, q)


def _backward(ctx, grad_loss, gm, gls, gq, gdx, gdw, gdb):
    if grad_loss is None:  # nothing flowed into loss (grads are not materialized)
        return (None,) * 13
    if ctx.fused:
        dx, dw, db = ctx.saved_tensors
        g = grad_loss.to(torch.float32)
        if torch.compiler.is_compiling() or type(dx) is not torch.Tensor:  # traced (functional/fake tensors)
            dx, dw = (dx.float() * g).to(dx.dtype), (dw.float() * g).to(dw.dtype)
            db = db * g
        else:
            # In place: the saved gradients are used once (a second backward through
            # this graph trips autograd's version check instead of scaling twice).
            for t in (dx, dw):
                _scale_(t, g)
            db = db * g
    else:
        hidden, weight, labels, bias, m, ls, q = ctx.saved_tensors
        dx, dw, db = ring_dtp_ce_backward(grad_loss, hidden, weight, labels, bias, m, ls, q, *ctx.args)
    dbias = db.to(ctx.bias_dtype) if ctx.has_bias else None
    return dx, dw, None, dbias, None, None, None, None, None, None, None, None, None


def _scale_(t: Tensor, g: Tensor) -> None:
    """t *= g in place, in fp32 with one rounding to t's dtype (== (t.float() * g).to(t.dtype)),
    for t: contiguous fp32/bf16/fp16 and g: one fp32 element on t's device. g is read by the
    kernel (on CUDA: no host sync) and g == 1 (loss.backward()) does nothing; no temporary.
    Bumps t's autograd version like any in-place op."""
    check_tensor("t", t, dtypes=tuple(B._ZCODE), contiguous=True)
    check_tensor("g", g, dtypes=(torch.float32,), device=t.device)
    if g.numel() != 1:
        raise ValueError(f"moepeak: g must have exactly one element, got shape {tuple(g.shape)}")
    cuda = t.device.type == "cuda"
    if cuda:
        require_cuda_build("_scale_")
    elif t.device.type != "cpu":
        raise ValueError(f"moepeak: _scale_ supports cpu and cuda tensors, got {t.device}")
    if t.numel():
        _C.ce_scale(t.data_ptr(), B._ZCODE[t.dtype], t.numel(), g.data_ptr(), cuda, current_stream_handle(t.device))
    torch.autograd.graph.increment_version(t)


ring_dtp_ce.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------
def _check(hidden, weight, labels, bias, reduction, mode, label_smoothing, z_loss, softcap, chunk_tokens,
           chunk_vocab, sharded=False):
    check_tensor("hidden", hidden, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    check_tensor("weight", weight, dtypes=(hidden.dtype,), ndim=2, device=hidden.device)
    check_tensor("labels", labels, dtypes=(torch.int64, torch.int32), device=hidden.device)
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"moepeak: hidden must be [..., H] with H = weight.shape[1] = {weight.shape[1]}, "
                         f"got {tuple(hidden.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"moepeak: labels must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(labels.shape)}")
    if weight.shape[0] < 1 and not sharded:  # (a shard may be empty: FSDP2 cuts V = 5 for 4 ranks 2, 2, 1, 0;
        raise ValueError("moepeak: weight must have at least one vocab row")  # all-empty raises on every rank)
    if bias is not None:
        check_tensor("bias", bias, dtypes=(hidden.dtype,), ndim=1, device=hidden.device)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"moepeak: bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"moepeak: reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")
    if mode not in MODES:
        raise ValueError(f"moepeak: mode must be one of {sorted(MODES)}, got {mode!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"moepeak: label_smoothing must be in [0, 1], got {label_smoothing}")
    if z_loss < 0:
        raise ValueError(f"moepeak: z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"moepeak: softcap must be None or > 0, got {softcap}")
    for n, v in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"moepeak: {n} must be None or a positive int, got {v!r}")
    if hidden.device.type == "cuda":
        require_cuda_build("linear_cross_entropy")
    elif hidden.device.type != "cpu":
        raise ValueError(f"moepeak: linear_cross_entropy supports cpu and cuda tensors, got {hidden.device}")


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Optional[Tensor] = None,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: Optional[float] = None, return_lse: bool = False,
                         group=None, ring: str = "auto", chunk_tokens: Optional[int] = None,
                         chunk_vocab: Optional[int] = None, mode: str = "auto", transport="auto"):
    """F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ...) without the logits.

    hidden [..., H], weight [V, H] (with `group`: this rank's dim-0 vocab shard),
    labels [...] int64. Returns loss ([] or labels.shape for reduction="none", fp32),
    and lse (labels.shape, fp32) when return_lse.
    mode: "auto" or a schedule of the module docstring ("fused", "fused_lowp",
    "vocab_outer", "vocab_outer_lowp", "token_outer"); all give the same loss and
    gradients up to rounding, and differ in speed, workspace and where they round
    (vocab_outer is the exact choice). chunk_tokens / chunk_vocab override the
    block sizes the workspace budget picks.
    group: `weight` is this rank's dim-0 vocab shard, the loss is that of this rank's tokens
    against the whole vocabulary, and the shard's gradient is that of the sum of the
    group's losses. ring: "weights" / "activations" circulate shards or tokens around the
    group (exact 4-GEMM order, `mode` not used; "auto" picks the one moving fewer bytes) and
    hold only a 1/P shard of what grows with the vocabulary; "gather" all-gathers the whole
    weight, runs the single-device op (`mode` applies) and sums each shard's gradient back
    at its owner: 2 V H more elements, faster where they fit (two H200s, P = 2, 32k tokens
    per rank, H = 4096, V = 151936: 201 ms / 3.24 GiB against the activations ring's
    307 ms / 3.49 GiB).
    transport (with `group`): "auto" / "torch" (torch.distributed on the group), "nccl"
    (moepeak's NCCL-from-C transport, CUDA tensors; one communicator per group and
    device, created collectively on the first call and kept), or a moepeak Transport.
    On two H200s the two measure the same inside the ring (benchmarks/RESULTS.md).
    """
    _check(hidden, weight, labels, bias, reduction, mode, label_smoothing, z_loss, softcap, chunk_tokens,
           chunk_vocab, sharded=group is not None)
    check_transport_choice(transport)
    lead = tuple(labels.shape)
    x = hidden.reshape(-1, hidden.shape[-1])
    x = x if x.is_contiguous() else x.contiguous()
    y = labels.reshape(-1).to(torch.int64).contiguous()
    if group is not None and ring == "gather":  # the whole weight here, then the single-device op
        from .ring_dtp_ring import gather_vocab_shards
        weight, group = gather_vocab_shards(weight, group, transport, bias, y, ignore_index), None
    if group is not None:
        from .ring_dtp_ring import ring_linear_cross_entropy
        loss, lse = ring_linear_cross_entropy(x, weight, y, bias, group, ring, ignore_index, reduction,
                                              label_smoothing, z_loss, softcap or 0.0, chunk_tokens, chunk_vocab,
                                              transport)
    else:
        w = weight if weight.is_contiguous() else weight.contiguous()
        grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad))
        out = torch.ops.moepeak.ring_dtp_ce(x, w, y, bias, ignore_index, REDUCTIONS[reduction],
                                            float(label_smoothing), float(z_loss), float(softcap or 0.0),
                                            MODES[mode], chunk_tokens or 0, chunk_vocab or 0, grads)
        loss, lse = out[0], out[1] + out[2]
    if reduction == "none":
        loss = loss.reshape(lead)
    if return_lse:
        return loss, lse.detach().reshape(lead)
    return loss


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times `scale` (averaging the ring's summed dW)."""

    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class RingDTPLinearCrossEntropy(torch.nn.Module):
    """lm_head + cross-entropy in one module: holds `.weight` [V, H] (the name an
    lm_head uses, so checkpoints load) and `.bias` when bias=True.
    forward(hidden, labels) -> loss (and lse with return_lse=True).

    Sharded weight (FSDP2 layout): `shard_(mesh)` makes `.weight` a Shard(0)
    DTensor; forward then uses weight.to_local() as this rank's ring shard and
    the mesh's group (no all-gather of the full weight happens, unless ring="gather"). Under
    `fully_shard(model, mesh=mesh, ignored_params={head.weight})` FSDP2 leaves
    that weight to the ring (without ignored_params FSDP2 would all-gather it
    before forward; the result is still right, through the single-device op).
    With grad_average=True (default) the shard's gradient is the mean over the
    group's ranks, as FSDP2/DDP reduce gradients; False gives the sum.
    Tied embeddings: assign `module.weight = emb.weight` (unsharded).
    transport: the ring's transport, as linear_cross_entropy's."""

    def __init__(self, hidden_size: int, vocab_size: int, *, bias: bool = False, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: Optional[float] = None, group=None, ring: str = "auto",
                 chunk_tokens: Optional[int] = None, chunk_vocab: Optional[int] = None, mode: str = "auto",
                 grad_average: bool = True, transport="auto", device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.weight = torch.nn.Parameter(torch.empty(vocab_size, hidden_size, **fk))
        self.bias = torch.nn.Parameter(torch.empty(vocab_size, **fk)) if bias else None
        self.opts = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                         z_loss=z_loss, softcap=softcap, ring=ring, chunk_tokens=chunk_tokens,
                         chunk_vocab=chunk_vocab, mode=mode, transport=transport)
        check_transport_choice(transport)
        self.group = group
        self.grad_average = grad_average
        self.reset_parameters()

    def shard_(self, mesh) -> "RingDTPLinearCrossEntropy":
        """Make .weight a dim-0 sharded DTensor on the 1-D `mesh` (FSDP2's layout)."""
        from torch.distributed.tensor import Shard, distribute_tensor  # noqa: WPS433
        if self.bias is not None:
            raise ValueError("moepeak: shard_() supports bias=False only (the ring has no bias)")
        self.weight = torch.nn.Parameter(distribute_tensor(self.weight.detach(), mesh, [Shard(0)]))
        return self

    def reset_parameters(self) -> None:
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's init
        if self.bias is not None:
            bound = 1 / math.sqrt(self.hidden_size)
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, hidden: Tensor, labels: Tensor, return_lse: bool = False):
        w, b = self.weight, self.bias
        group = self.group
        if hasattr(w, "to_local"):  # FSDP2 / DTensor: this rank's dim-0 shard is the ring shard
            w, group = self._local_shard(w, group)
            b = b.to_local() if b is not None and hasattr(b, "to_local") else b
        if group is not None and self.grad_average:
            w = _ScaleGrad.apply(w, 1.0 / torch.distributed.get_world_size(group))
        opts = dict(self.opts)
        mode = opts.pop("mode")
        return linear_cross_entropy(hidden, w, labels, bias=b, group=group, return_lse=return_lse,
                                    mode=mode, **opts)

    @staticmethod
    def _local_shard(w, group):
        """(local dim-0 shard, its group) of a DTensor weight; no all-gather. The gradient
        flows back through to_local() into the DTensor's own Shard(0) gradient."""
        from torch.distributed.tensor import Shard  # noqa: WPS433 (torch >= 2.4)
        pl = tuple(w.placements)
        if w.device_mesh.ndim != 1 or len(pl) != 1 or not (isinstance(pl[0], Shard) and pl[0].dim == 0):
            raise ValueError(f"moepeak: a DTensor weight must be Shard(0) on a 1-D mesh (FSDP2's layout), "
                             f"got placements {pl} on a {w.device_mesh.ndim}-D mesh")
        return w.to_local(), (group if group is not None else w.device_mesh.get_group())

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, bias={self.bias is not None}"
