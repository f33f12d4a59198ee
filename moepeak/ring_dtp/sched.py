"""Ring-DTP's single-device schedules: the order in which logits blocks are made,
folded and turned into gradients. The op (ops.py) picks one per call
(pick_mode) and sizes its blocks (chunk_sizes); the arithmetic of a block is
blocks', the sizes' formulas sizes'.

x: [T, H], w: [V, H], y: [T] int64 (clean: out-of-range labels already replaced
by ignore_index), bias: [V] or None; the per-token state is blocks'.

  fused        token-outer, gradients computed in forward (3 GEMMs: Z, dX, dW).
               A chunk holds whole vocab rows Z: [ct, V] x fp32, so dZ exists
               after one pass; dX of the chunk is one exact GEMM; dW (in the
               weight's dtype) is accumulated chunk by chunk (see "Error growth"),
               except its label column (dZ[t, y_t], the largest terms), which is
               taken out of each chunk's dZ for the dW GEMM and added once at the
               end, summed in fp32 ("dW's finish", B.finish_dw); past
               RingDTPOptions.center_chunks chunks also centered (the dW GEMMs on
               X - mu, colsum(dZ) mu^T in the finish).
  vocab_outer  4 GEMMs. Forward folds lse; backward, per vocab block, recomputes
               Z, makes dZ, and sums dW_b in fp32 over token chunks (exact),
               dX += dZ W_b into an fp32 [T, H] accumulator (exact).
  token_outer  4 GEMMs. Backward per token chunk: dX of the chunk exact in fp32,
               dW accumulated in the weight's dtype, chunk by chunk.
  fused_lowp   like fused, but the GEMM writes the logits in the input dtype
               (bf16/fp16, fp32-accumulated: the rounding naive F.linear has) into
               one [ct, V] workspace, the fold reads it, and the gradient kernel
               overwrites it in place with dZ, which feeds the dX and dW GEMMs
               directly: per element 2 B written by the GEMM, 2 B read by the fold,
               2 B read + 2 B written by the gradient (fused with fp32 logits:
               4 + 4 + 4 + 2), and more rows per chunk (2048 in a 594 MiB block vs
               576 in 512 MiB at V = 151936; sizes.fused_chunk_tokens).
  vocab_outer_lowp
               vocab_outer with dX accumulated in the input dtype (bf16/fp16) over
               its vocab blocks (one rounding per block) instead of an fp32 [T, H]
               accumulator, except each token's label term (p_y - 1) W[y], taken
               out of its block's dZ and added once in fp32 at the end ("dX's
               finish", B.finish_dx); dW exact per block as in vocab_outer. At
               least 8 blocks, narrower where the fp32 dW block [cv, H] would pass
               300 MiB (sizes.lowp_dx_block_cols). Worked once: T = 128k,
               H = 4096, V = 151936, bf16: 8 blocks of 19072 columns, dW block
               298 MiB, so 2.16 GiB of gradients + ~0.55 GiB, where vocab_outer
               needs a 2 GiB fp32 dX accumulator (+ its 1 GiB bf16 copy).
  auto         fp32 inputs: fused. Low precision: fused_lowp when backward is
               certain (grad enabled, reduction mean/sum) and it needs at most 128
               token chunks (T <= 262144 at V = 151936 with 2048-row chunks);
               otherwise vocab_outer (exact dW and dX, 4 GEMMs) while its fp32
               [T, H] dX accumulator is at most the 512 MiB workspace
               (T*H <= 128M), vocab_outer_lowp beyond that.

Error growth with the chunk count. fused* accumulate dW in bf16 over the token
chunks, vocab_outer_lowp dX over its vocab blocks: torch's bf16 addmm_ gives
rn(dW + rn(dZ^T X)), the chunk's product rounded before it is added (CUDA and
CPU alike; benchmarks/probe_gemm_paths.py checks the CUDA path). A chunk's
rounding error is relative to the running sum, so terms that add up over chunks
make the error grow with their number: above all a dW row's label terms
(p - 1) x_t, which for a frequent label come in every chunk, and, for hidden
states that share a mean direction mu (real final hidden states are
anisotropic), the non-label terms colsum(dZ) mu^T. The finish takes the label
terms out of the GEMMs and adds them once in fp32; past center_chunks (default
8) chunks the centering does the same for the mean direction: the dW GEMMs take
X - mu (written into the chunk's own dX rows before its dX GEMM: no buffer) and
colsum(dZ) (fp32, made by the gradient kernel where rows are 16-byte aligned,
else by a ones-row GEMM) joins the finish as a rank-1 term. Adding that term in
the last chunk's dW GEMM instead would round it twice.
Bounds (benchmarks/study_dw_error.py on an H200, T = 8192, H = 4096, V = 151936,
bf16; dW error / naive bf16's, centered / finish only / neither; x_mean is the
shared direction's per-dimension std, 1: cosine ~0.5 between tokens, 3: ~0.9):
  inputs                      16 chunks             64 chunks             128 chunks
  uniform labels, x_mean 0    1.01 / 1.00 / 1.16    1.01 / 1.00 / 1.18    1.01 / 1.00 / 1.18
  uniform labels, x_mean 1    1.00 / 1.16 / 6.38    1.00 / 1.56 / 12.45   1.00 / 2.46 / 15.31
  uniform labels, x_mean 3    1.00 / 2.39 / 2.47    1.00 / 4.98 / 5.21    1.00 / 10.57 / 10.79
  Zipf(1.1) labels, x_mean 0  1.00 / 1.00 / 2.65    1.00 / 1.00 / 4.29    1.00 / 1.00 / 5.49
  Zipf, x_mean 1              1.00 / 1.00 / 2.41    1.00 / 1.01 / 4.61    1.00 / 1.02 / 6.46
  Zipf, x_mean 3              1.00 / 1.24 / 2.54    1.00 / 1.94 / 4.85    1.00 / 3.72 / 7.73
At 8 chunks and fewer the finish alone holds dW within 2x naive's error even at
x_mean = 3 (uniform labels, finish only: 1.39 / 1.54 / 1.85 / 2.39 at 2 / 4 / 8 /
16 chunks, centered 1.00 at each), so the centering, whose fixed costs weigh most
on a short T, starts past 8. mode="vocab_outer" is exact whatever the inputs.
vocab_outer_lowp's dX with its finish: 0.98-1.00x naive's at 8 blocks on the
benchmark grid's six H x V (2.4-3.5x without it), 0.76x for x_mean = 3.
The tests hold these bounds on CPU at smaller shapes (tests/test_ring_dtp_errors.py).

The switches of the finishes and the centering are RingDTPOptions fields (options.py:
dw_finish, dx_finish, center_chunks, fused_colsum), passed to each call as arguments; their
defaults are what the op runs, and the tests and benchmarks/studies turn each off to measure
what it buys.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import blocks as B
from . import gemm as G
from . import sizes as S
from .options import MODES

REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
FUSED_MODES = (MODES["fused"], MODES["fused_lowp"])


def fold_all(x, w, bias, y, ignore_index, softcap, ct, cv):
    """Forward only: fold every [ct, cv] logits block into the state (B.new_state's five rows)."""
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


def fused(x, w, bias, y, ignore_index, softcap, eps, zloss, g, ct, *, lowp_logits: bool, dw_finish: bool,
          center_chunks: int, fused_colsum: bool):
    """Forward with gradients (3 GEMMs). g: [1] x fp32 (the per-token weight).
    lowp_logits: the GEMM writes the logits in x.dtype (bf16/fp16, fp32-accumulated, as naive
    F.linear does) and dZ is made in place in that block (CUDA); on CPU the same rounding is
    applied to an fp32 block (z <- fp32(bf16(z))), so CPU tests check these numerics.
    dw_finish, center_chunks, fused_colsum: RingDTPOptions' fields of those names."""
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
    split = lowp and T > ct and dw_finish
    tc = torch.empty(T, dtype=torch.float32, device=x.device) if split else None
    # Centering, past center_chunks chunks: what the finish leaves in the GEMMs also
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
    center = split and -(-T // ct) > center_chunks
    if center:
        mu, mu32, ones = _token_mean(x, ct)
        cs = torch.empty(V, dtype=torch.float32, device=x.device)
        fuse_cs = fused_colsum and B.colsum_fusable(zbuf, dzbuf)
    for t0 in range(0, T, ct):
        t1 = min(T, t0 + ct)
        n = t1 - t0
        m, s, zy, zs, sx = (a[t0:t1] for a in st)
        xc = x[t0:t1]
        z = _chunk_logits(xc, w, bias, zbuf[:n], direct, lowp_logits and lowp)
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
        G.mm_acc_(dw, dz.t(), xg, first=t0 == 0)              # rn(dW + rn(product)) (Error growth)
        if split:                                             # dX's GEMM with it: put it back, exactly
            B.put_label_column(dz, y[t0:t1], tc[t0:t1], col)
        if x.device.type == "cuda" or f32acc:
            torch.mm(dz, w, out=dx[t0:t1])                    # exact: one GEMM over the whole row
        else:
            dx[t0:t1] = G.mm(dz, w, False)
        if db is not None:
            db.add_(dz.float().sum(0))
        del dz  # the previous chunk's dZ must not live while the next one is made
    del zbuf, dzbuf  # the finish's scratch (the sort of the labels, flags [V]) reuses the block
    if split:
        B.finish_dw(dw, x, y, tc, cs=cs if center else None, mu=mu32 if center else None)
    return st, dx, dw, db


def _token_mean(x, ct):
    """The centering's mean row of x [T, H]: (mu [H] in x.dtype, the GEMMs' operand; the same
    values in fp32, for the finish; ones [1, ct] in x.dtype, the column sums' GEMM operand),
    summed in fp32 chunk by chunk."""
    T, H = x.shape
    ones = torch.ones((1, ct), dtype=x.dtype, device=x.device)
    mu32 = torch.empty(H, dtype=torch.float32, device=x.device)
    for t0 in range(0, T, ct):
        B.colsum_acc_(mu32, x[t0:t0 + ct], ones, first=t0 == 0)
    mu = mu32.div_(T).to(x.dtype)
    mu32.copy_(mu)
    return mu, mu32, ones


def _chunk_logits(xc, w, bias, zbuf, direct: bool, round_to_input: bool):
    """The chunk's logits xc @ w.T (+ bias) written into zbuf [n, V], the whole vocab row:
    direct (CUDA), in x.dtype from an fp32-accumulating GEMM; else fp32, rounded to x.dtype
    and back where round_to_input (CPU: the rounding a low-precision GEMM output has)."""
    if direct:
        z = torch.mm(xc, w.t(), out=zbuf)
        if bias is not None:
            z.add_(bias)
        return z
    z = G.mm_f32_into(xc, w.t(), zbuf)
    if bias is not None:
        z.add_(bias.float())
    if round_to_input:
        z.copy_(z.to(xc.dtype))
    return z


def backward_blocked(x, w, bias, y, m, ls, q, g, ignore_index, softcap, eps, zloss, ct, cv, order, *,
                     dx_finish: bool):
    """4th and later GEMMs: recompute blocks and accumulate dX, dW (see module doc) in `order`
    ("vocab_outer", "vocab_outer_lowp" or "token_outer"). dx_finish: RingDTPOptions' field of
    that name. Returns (dX, dW, dbias in fp32 or None)."""
    T, V = x.shape[0], w.shape[0]
    db = None if bias is None else torch.zeros(V, dtype=torch.float32, device=x.device)
    if T == 0:  # no token: zero gradients (the orders below assume at least one chunk)
        return torch.zeros_like(x), torch.zeros_like(w), db
    grad = _block_gradient(x, w, bias, y, m, ls, q, g, ignore_index, softcap, eps, zloss, db)
    if order == "vocab_outer":
        dx, dw = _vocab_outer(grad, x, w, ct, cv)
    elif order == "vocab_outer_lowp":
        dx, dw = _vocab_outer_lowp(grad, x, w, y, ct, cv, dx_finish)
    else:
        dx, dw = _token_outer(grad, x, w, ct, cv)
    return dx, dw, db


def _block_gradient(x, w, bias, y, m, ls, q, g, ignore_index, softcap, eps, zloss, db):
    """grad(t0, t1, v0, v1): the recomputed block's dZ [t1 - t0, v1 - v0] in x.dtype (its column
    sums added to db, the fp32 dbias, where there is a bias)."""
    V = w.shape[0]
    per_row = g.numel() != 1

    def grad(t0, t1, v0, v1):
        z = B.logits_block(x[t0:t1], w[v0:v1], None if bias is None else bias[v0:v1])
        dz = B.grad_block(z, v0, V, y[t0:t1], ignore_index, softcap, m[t0:t1], ls[t0:t1], q[t0:t1],
                          g[t0:t1] if per_row else g, eps, V, zloss, x.dtype)
        if db is not None:
            db[v0:v1].add_(dz.float().sum(0))
        return dz
    return grad


def _vocab_outer(grad, x, w, ct, cv):
    """dX in an fp32 [T, H] accumulator, each dW block [cv, H] summed in fp32 over the token
    chunks: both exact, one rounding each at the end."""
    (T, H), V = x.shape, w.shape[0]
    dx_acc = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    dw = torch.empty_like(w)
    for v0 in range(0, V, cv):
        v1 = min(V, v0 + cv)
        dw_b = None                                                      # [cv, H] x fp32
        for t0 in range(0, T, ct):
            t1 = min(T, t0 + ct)
            dz = grad(t0, t1, v0, v1)
            dx_acc[t0:t1].add_(G.mm(dz, w[v0:v1], True))
            part = G.mm(dz.t(), x[t0:t1], True)
            dw_b = part if dw_b is None else dw_b.add_(part)
        dw[v0:v1] = dw_b
    return dx_acc.to(x.dtype), dw


def _vocab_outer_lowp(grad, x, w, y, ct, cv, dx_finish: bool):
    """dX accumulated in x.dtype inside the output: the first vocab block writes it, each later
    one adds with one rounding (GEMM accumulate, fp32 inside); each dW block [cv, H] summed in
    fp32 over the token chunks (exact), as in _vocab_outer.
    dX's finish (the mirror of the fused modes' dW finish): a token's label column, its largest
    dZ term (p_y - 1), is taken out of its vocab block's dZ after the dW GEMM (which needs it)
    and before the dX GEMM, and tc[t] * W[y_t] is added once at the end in fp32, so the
    roundings over the vocab blocks are relative to the small sum of p_v W_v, not to W[y_t]."""
    (T, H), V = x.shape, w.shape[0]
    dx = torch.empty_like(x)
    dw = torch.empty_like(w)
    dw_b = torch.empty((min(cv, V), H), dtype=torch.float32, device=x.device)
    split = V > cv and dx_finish
    tc = torch.zeros(T, dtype=torch.float32, device=x.device) if split else None
    for v0 in range(0, V, cv):
        v1 = min(V, v0 + cv)
        blk = dw_b[:v1 - v0]
        for t0 in range(0, T, ct):
            t1 = min(T, t0 + ct)
            dz = grad(t0, t1, v0, v1)
            G.mm_f32_acc_(blk, dz.t(), x[t0:t1], first=t0 == 0)
            if split:
                B.take_label_column_block(dz, y[t0:t1], tc[t0:t1], v0)
            G.mm_acc_(dx[t0:t1], dz, w[v0:v1], first=v0 == 0)
            del dz
        dw[v0:v1] = blk
    if split:
        B.finish_dx(dx, w, y, tc)
    return dx, dw


def _token_outer(grad, x, w, ct, cv):
    """dX exact per token chunk (an fp32 [ct, H] accumulator), dW accumulated in the weight's
    dtype, chunk by chunk."""
    (T, H), V = x.shape, w.shape[0]
    dx = torch.empty_like(x)
    dw = torch.zeros_like(w)
    for t0 in range(0, T, ct):
        t1 = min(T, t0 + ct)
        dx_c = torch.zeros((t1 - t0, H), dtype=torch.float32, device=x.device)
        for v0 in range(0, V, cv):
            v1 = min(V, v0 + cv)
            dz = grad(t0, t1, v0, v1)
            dx_c.add_(G.mm(dz, w[v0:v1], True))
            dw[v0:v1].add_(G.mm(dz.t(), x[t0:t1], True))
        dx[t0:t1] = dx_c
    return dx, dw


def reduce_rows(rows: Tensor, valid: Tensor, reduction: int) -> Tensor:
    """The loss from per-token rows: none / mean over valid tokens / sum. The mean over no
    valid token is 0 / 0 = NaN, as torch's F.cross_entropy gives (no host sync to test it)."""
    if reduction == 0:
        return rows
    # summed as torch's nll_loss sums them: in double on CPU (its accumulation type), fp32 on CUDA
    total = rows.sum(dtype=torch.float64).float() if rows.device.type == "cpu" else rows.sum()
    if reduction == 2:
        return total
    return total / valid.sum().to(torch.float32)


def pick_mode(mode: int, grads: bool, reduction: int, T: int, H: int, V: int, dtype, chunk_tokens: int = 0) -> int:
    """The schedule (a MODES value) a call runs: `mode` as asked, made concrete where it
    cannot apply, or auto's choice (module docstring; sizes.auto_lowp_schedule)."""
    if mode in FUSED_MODES and reduction == 0:
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


def chunk_sizes(T, H, V, dtype, mode, chunk_tokens, chunk_vocab):
    """(ct, cv): token rows and vocab columns of a block for the resolved `mode`
    (sizes works each formula once with numbers); None: the budget's choice."""
    if mode in FUSED_MODES:
        return chunk_tokens or B.fused_chunk_tokens(V, dtype, lowp_logits=mode == MODES["fused_lowp"]), V
    if mode == MODES["vocab_outer_lowp"]:
        cv = chunk_vocab or S.lowp_dx_block_cols(V, H)
        return chunk_tokens or B.lowp_dx_chunk_tokens(cv, dtype), cv
    ct, cv = B.blocked_chunks(T, H, dtype, chunk_tokens=chunk_tokens)
    return ct, (chunk_vocab or cv)

