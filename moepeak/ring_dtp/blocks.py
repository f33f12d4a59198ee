"""Ring-DTP building blocks shared by the single-device op (ops.py) and
the ring schedules (ring.py): the logits-block GEMM (torch's, gemm.py), the fold
and gradient kernels (moepeak._C), chunk sizing for torch dtypes (the arithmetic
is sizes'), and the per-row loss.

Per-token state of the online log-sum-exp, all [T] x fp32:
  m     running max of the (softcapped) logits folded so far (-inf at start)
  s     sum of exp(z - m) over them (0 at start)
  zy    the target's logit (0 until the block holding it is folded)
  zsum  sum of the logits over real vocab (label smoothing's uniform term)
  sx    like s without the target's term: 1 - p_y = sx / s, precise as p_y -> 1
lse = m + log(s).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional, Tuple

import torch

from .. import _C
from ..core.abi import DTYPE_CODES
from ..core.ext import check_tensor, current_stream_handle, require_cuda_build
from . import gemm as G
# Chunk sizes and auto's choice are torch-free integer arithmetic (shared with `moepeak plan`).
from . import sizes as S
from .sizes import BLOCKED_WORKSPACE_BYTES


def lowp_bytes(dtype: torch.dtype) -> int:
    """sizes' b (bytes of the low-precision buffers) for a torch dtype: 0 for fp32, else 2."""
    return 0 if dtype == torch.float32 else 2


def logits_block(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Z = x @ w.T (+ bias): [t, v] x fp32, contiguous (x: [t, H], w: [v, H], bias: [v])."""
    z = G.mm(x, w.t(), True)
    if bias is not None:
        z.add_(bias.float())
    return z.contiguous()


def new_state(t: int, device) -> Tuple[torch.Tensor, ...]:
    m = torch.full((t,), -math.inf, dtype=torch.float32, device=device)
    z = torch.zeros((4, t), dtype=torch.float32, device=device)
    return m, z[0], z[1], z[2], z[3]  # m, s, zy, zsum, sx


def fold(z: torch.Tensor, v0: int, v_valid: int, labels: torch.Tensor, ignore_index: int, softcap: float,
         m, s, zy, zsum, sx) -> None:
    """Fold the logits block z: [t, v] (global columns [v0, v0+v)) into the state rows."""
    t, v = z.shape
    cuda = z.device.type == "cuda"
    _C.ce_fold(z.data_ptr(), DTYPE_CODES[z.dtype], z.stride(0), t, v, v0, v_valid, labels.data_ptr(), ignore_index,
               softcap, m.data_ptr(), s.data_ptr(), zy.data_ptr(), zsum.data_ptr(), sx.data_ptr(), cuda,
               current_stream_handle(z.device))


# Rows of the scratch that the fused column sums go through (cuda/ce_grad.cu ce_grad_colsum_kernel
# uses at most this many row groups; 8 x V x fp32: 4.6 MiB at V = 151936).
COLSUM_GROUPS = S.COLSUM_GROUPS


def colsum_scratch(rows: torch.Tensor, V: int) -> Optional[torch.Tensor]:
    """The column sums' scratch as a [G, V] x fp32 view of the memory of `rows` (a
    contiguous tensor that holds nothing needed until the sums are done: the fused modes
    pass the chunk's own dX rows), G = min(COLSUM_GROUPS, bytes // (4 V)); None when that
    memory holds less than one row of V fp32 (then the caller sums with a GEMM)."""
    nbytes = rows.numel() * rows.element_size()
    groups = min(COLSUM_GROUPS, nbytes // (4 * V)) if V > 0 else 0
    if groups < 1 or not rows.is_contiguous() or rows.data_ptr() % 4:
        return None
    return rows.view(-1).view(torch.uint8)[:groups * V * 4].view(torch.float32).view(groups, V)


def colsum_fusable(z: torch.Tensor, out: Optional[torch.Tensor] = None) -> bool:
    """Can grad_block sum dZ's columns in its gradient kernel (colsum=)? CUDA, and the rows of
    the logits block (and of out) start on 16-byte boundaries (e.g. V % 8 == 0 for bf16)."""
    if z.device.type != "cuda" or z.stride(1) != 1:
        return False
    for t in (z,) if out is None else (z, out):
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
    return True


def grad_block(z: torch.Tensor, v0: int, v_valid: int, labels: torch.Tensor, ignore_index: int, softcap: float,
               m: torch.Tensor, ls: torch.Tensor, q: torch.Tensor, g: torch.Tensor, eps: float, n_classes: int,
               zloss: float,
               dtype: torch.dtype, out: Optional[torch.Tensor] = None,
               colsum: Optional[Tuple[torch.Tensor, torch.Tensor, bool]] = None,
               take: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Turn the logits block z: [t, v] x fp32 into dZ, returned in `dtype` (the GEMM
    operand dtype). m, ls = log(s), q = 1 - p_y: [t] x fp32 (lse = m + ls); g: [t] (per row) or [1] (broadcast) x fp32.
    out: optional preallocated [t, v] x dtype workspace (CUDA, dtype bf16/fp16) for dZ.
    colsum = (cs, part, first) (CUDA, colsum_fusable): the same kernel also makes the column
    sums of dZ as returned, each row's target element excluded (= colsum after
    take_label_column), in fp32: cs ([v] x fp32) = them if first, else cs += them; part:
    [G, >= v] x fp32 scratch (the kernel sums over at most G row groups; colsum_scratch).
    Deterministic (no atomics) for a given G and device.
    take = tc ([t] x fp32; with colsum only): the kernel also does take_label_column's work on
    the dZ it writes (tc[i] = dZ[i, labels[i] - v0] as stored, that element 0; tc[i] = 0 for a
    row without a target in the block), bitwise what take_label_column after it gives, without
    its passes; put_label_column(dz, labels, tc) restores the column."""
    t, v = z.shape
    cuda = z.device.type == "cuda"
    extra = _colsum_args(colsum, take, z)
    if z.dtype != torch.float32:          # low-precision logits (CUDA): dZ in place, in z's dtype
        dz = z
    elif cuda and dtype != torch.float32:  # fp32 logits on CUDA: dZ written in `dtype`
        dz = out if out is not None else torch.empty((t, v), dtype=dtype, device=z.device)
    else:                                  # fp32 dZ in place (cast to `dtype` after it)
        dz = z
    _C.ce_grad(z.data_ptr(), DTYPE_CODES[z.dtype], z.stride(0), t, v, v0, v_valid, labels.data_ptr(), ignore_index,
               softcap, m.data_ptr(), ls.data_ptr(), q.data_ptr(), g.data_ptr(), 0 if g.numel() == 1 else 1, eps,
               n_classes, zloss, dz.data_ptr(), dz.stride(0), DTYPE_CODES[dz.dtype], cuda,
               current_stream_handle(z.device), *extra)
    return dz if z.dtype != torch.float32 or dz.dtype == dtype else dz.to(dtype)


def _colsum_args(colsum, take, z: torch.Tensor) -> tuple:
    """grad_block's colsum= and take= as the kernel's trailing arguments (checked; () without)."""
    t, v = z.shape
    if colsum is None:
        if take is not None:
            raise ValueError("moepeak: grad_block(take=...) needs colsum=... (the column sums' kernel takes the "
                             "column)")
        return ()
    cs, part, first = colsum
    if z.device.type != "cuda":
        raise ValueError("moepeak: grad_block(colsum=...) is CUDA only; on CPU use colsum_acc_ after it")
    check_tensor("cs", cs, dtypes=(torch.float32,), ndim=1, device=z.device, contiguous=True)
    check_tensor("part", part, dtypes=(torch.float32,), ndim=2, device=z.device, contiguous=True)
    if cs.shape[0] != v or part.shape[1] < v:
        raise ValueError(f"moepeak: grad_block(colsum=) needs cs [{v}] and part [G, >= {v}]; got cs "
                         f"{tuple(cs.shape)}, part {tuple(part.shape)}")
    extra = (part.data_ptr(), part.stride(0), part.shape[0], cs.data_ptr(), bool(first))
    if take is None:
        return extra
    check_tensor("take", take, dtypes=(torch.float32,), ndim=1, device=z.device, contiguous=True)
    if take.shape[0] != t:
        raise ValueError(f"moepeak: grad_block(take=) needs tc [{t}] (one per row), got {tuple(take.shape)}")
    return extra + (take.data_ptr(),)


def take_label_column(dz: torch.Tensor, labels: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
    """tc <- dZ's label column (dz[t, labels[t]] as fp32), then that column <- 0, in place,
    for a block of whole vocab rows (the fused modes). An ignored row's dZ is all zero, so
    clamping its label into [0, V) reads and writes a zero. No host sync. Returns the
    column index [t, 1] (the clamped labels) for put_label_column."""
    col = labels.clamp(0, dz.shape[1] - 1).unsqueeze(1)
    tc.copy_(dz.gather(1, col).squeeze(1))
    dz.scatter_(1, col, 0)
    return col


def put_label_column(dz: torch.Tensor, labels: torch.Tensor, tc: torch.Tensor,
                     col: Optional[torch.Tensor] = None) -> None:
    """Undo take_label_column: dz[t, labels[t]] <- tc[t] in dz's dtype, bitwise the element
    taken (tc holds it widened to fp32); an ignored row gets back its zero. col: what
    take_label_column returned (else the labels are clamped again). No host sync."""
    if col is None:
        col = labels.clamp(0, dz.shape[1] - 1).unsqueeze(1)
    dz.scatter_(1, col, tc.to(dz.dtype).unsqueeze(1))


def take_label_column_block(dz: torch.Tensor, labels: torch.Tensor, tc: torch.Tensor, v0: int) -> None:
    """take_label_column for a block of vocab columns v0 .. v0 + nv - 1 (vocab_outer_lowp):
    only the rows labelled inside the block give their element to tc and have it zeroed; the
    others (labels of other blocks, ignore_index) keep their tc and dZ. No host sync."""
    nv = dz.shape[1]
    col = (labels - v0).clamp(0, nv - 1).unsqueeze(1)
    val = dz.gather(1, col).squeeze(1)
    inside = (labels >= v0) & (labels < v0 + nv)
    tc.copy_(torch.where(inside, val.float(), tc))
    dz.scatter_(1, col, torch.where(inside, torch.zeros_like(val), val).unsqueeze(1))


def finish_dw(dw: torch.Tensor, x: torch.Tensor, labels: torch.Tensor, tc: torch.Tensor, v0: int = 0,
              cs: Optional[torch.Tensor] = None, mu: Optional[torch.Tensor] = None) -> None:
    """dw[r] += [cs[r] * mu +] sum over the tokens t with labels[t] == v0 + r of tc[t] * x[t]:
    summed in fp32 (the optional rank-1 term first, then the label terms in token order: a
    stable sort of the labels, so deterministic), one rounding per element (csrc/ce.c,
    cuda/ce_finish.cu ce_dw_finish). dw: [nv, H] rows for labels v0 .. v0 + nv - 1 (other labels,
    ignore_index included, are no row; without cs, rows no token is labelled with are
    untouched), x: [t, H], same dtype, rows contiguous; tc: [t] x fp32; cs: [nv] and mu: [H]
    x fp32, both or neither."""
    check_tensor("dw", dw, dtypes=tuple(DTYPE_CODES), ndim=2, contiguous=True)
    check_tensor("x", x, dtypes=(dw.dtype,), ndim=2, device=dw.device, contiguous=True)
    check_tensor("labels", labels, dtypes=(torch.int64,), ndim=1, device=dw.device)
    check_tensor("tc", tc, dtypes=(torch.float32,), ndim=1, device=dw.device)
    if x.shape[1] != dw.shape[1] or labels.shape[0] != x.shape[0] or tc.shape[0] != x.shape[0]:
        raise ValueError(f"moepeak: finish_dw needs dw [nv, H], x [t, H], labels [t], tc [t]; got dw "
                         f"{tuple(dw.shape)}, x {tuple(x.shape)}, labels {tuple(labels.shape)}, tc {tuple(tc.shape)}")
    if (cs is None) != (mu is None):
        raise ValueError("moepeak: finish_dw needs cs and mu both or neither")
    if cs is not None:
        check_tensor("cs", cs, dtypes=(torch.float32,), ndim=1, device=dw.device, contiguous=True)
        check_tensor("mu", mu, dtypes=(torch.float32,), ndim=1, device=dw.device, contiguous=True)
        if cs.shape[0] != dw.shape[0] or mu.shape[0] != dw.shape[1]:
            raise ValueError(f"moepeak: finish_dw needs cs [nv], mu [H] for dw {tuple(dw.shape)}; got cs "
                             f"{tuple(cs.shape)}, mu {tuple(mu.shape)}")
    sy, perm = torch.sort(labels, stable=True)
    tcs = tc[perm]  # the label terms in sy's order (the kernels' operand: loaded beside sy and perm)
    cuda = dw.device.type == "cuda"
    # CUDA with the rank-1 term: which rows the label runs wrote (the others get cs[r] mu alone)
    flags = torch.zeros(dw.shape[0], dtype=torch.uint8, device=dw.device) if cuda and cs is not None else None
    _C.ce_dw_finish(dw.data_ptr(), DTYPE_CODES[dw.dtype], dw.stride(0), v0, dw.shape[0], x.data_ptr(), x.stride(0),
                    x.shape[1], sy.data_ptr(), perm.data_ptr(), tcs.data_ptr(), x.shape[0],
                    0 if cs is None else cs.data_ptr(), 0 if mu is None else mu.data_ptr(),
                    0 if flags is None else flags.data_ptr(), cuda, current_stream_handle(dw.device))


def sub_row(x: torch.Tensor, mu: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x - mu, mu [H] broadcast over the rows of x [n, H]: the centering's X - mu
    (sched.fused). One dtype for all three; the subtraction in fp32 with one rounding per
    element, the arithmetic of torch.sub (csrc/ce.c, cuda/ce_finish.cu ce_sub_row). On CUDA the
    kernel moves 16-byte vectors, where torch's broadcast of mu does not (H200, T = 32k,
    H = 4096: torch.sub 0.43 ms over the 16 chunks); rows it cannot vectorise go to
    torch.sub. Returns out."""
    check_tensor("x", x, dtypes=tuple(DTYPE_CODES), ndim=2)
    check_tensor("mu", mu, dtypes=(x.dtype,), ndim=1, device=x.device, contiguous=True)
    check_tensor("out", out, dtypes=(x.dtype,), ndim=2, device=x.device)
    if out.shape != x.shape or mu.shape[0] != x.shape[1] or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"moepeak: sub_row needs x, out [n, H] (rows contiguous) and mu [H]; got x "
                         f"{tuple(x.shape)} stride {tuple(x.stride())}, out {tuple(out.shape)} stride "
                         f"{tuple(out.stride())}, mu {tuple(mu.shape)}")
    cuda = x.device.type == "cuda"
    vec = 16 // x.element_size()
    if cuda and (x.shape[1] % vec or x.stride(0) % vec or out.stride(0) % vec
                 or (x.data_ptr() | out.data_ptr() | mu.data_ptr()) % 16):
        return torch.sub(x, mu, out=out)
    _C.ce_sub_row(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), mu.data_ptr(), x.shape[0], x.shape[1],
                  DTYPE_CODES[x.dtype], cuda, current_stream_handle(x.device))
    return out


def colsum_acc_(cs: torch.Tensor, dz: torch.Tensor, ones: torch.Tensor, first: bool) -> None:
    """cs (fp32 [V]) = (first) or += the column sums of dz [n, V], accumulated in fp32: a
    [1, n] x [n, V] GEMM against ones ([1, >= n], dz's dtype), fp32 out. No [n, V] temporary."""
    G.mm_f32_acc_(cs.view(1, -1), ones[:, :dz.shape[0]], dz, first)


def finish_dx(dx: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, tc: torch.Tensor, v0: int = 0) -> None:
    """dx[t] += tc[t] * w[labels[t] - v0] for the tokens whose label is one of w's rows
    (v0 .. v0 + nv - 1), in fp32 (fmaf) with one rounding per element; other rows untouched
    (csrc/ce.c, cuda/ce_finish.cu ce_dx_finish). dx: [t, H], w: [nv, H], same dtype, rows
    contiguous; labels: [t] int64; tc: [t] x fp32."""
    check_tensor("dx", dx, dtypes=tuple(DTYPE_CODES), ndim=2, contiguous=True)
    check_tensor("w", w, dtypes=(dx.dtype,), ndim=2, device=dx.device)
    check_tensor("labels", labels, dtypes=(torch.int64,), ndim=1, device=dx.device, contiguous=True)
    check_tensor("tc", tc, dtypes=(torch.float32,), ndim=1, device=dx.device, contiguous=True)
    if w.shape[1] != dx.shape[1] or w.stride(1) != 1 or labels.shape[0] != dx.shape[0] or tc.shape[0] != dx.shape[0]:
        raise ValueError(f"moepeak: finish_dx needs dx [t, H], w [nv, H] (rows contiguous), labels [t], tc [t]; "
                         f"got dx {tuple(dx.shape)}, w {tuple(w.shape)} stride {tuple(w.stride())}, labels "
                         f"{tuple(labels.shape)}, tc {tuple(tc.shape)}")
    _C.ce_dx_finish(dx.data_ptr(), DTYPE_CODES[dx.dtype], dx.stride(0), w.data_ptr(), w.stride(0), v0, w.shape[0],
                    dx.shape[1], labels.data_ptr(), tc.data_ptr(), dx.shape[0], dx.device.type == "cuda",
                    current_stream_handle(dx.device))


def fin(st):
    """(m, ls = log s, q = 1 - p_y) of a complete state: what backward needs.
    Non-finite logits, as torch has them: a NaN anywhere in a row makes zsum NaN (a sum
    keeps every NaN, where the CUDA fold's max skips it), and m is made NaN there; a +inf
    logit leaves m = +inf and s NaN (exp(inf - inf)). Either way ls is NaN, so the row's
    loss and gradient are NaN (F.cross_entropy's); lse_report gives the lse."""
    m = torch.where(torch.isnan(st[3]), torch.full_like(st[0], math.nan), st[0])
    return m, torch.log(st[1]), st[4] / st[1]


def lse_report(m: torch.Tensor, ls: torch.Tensor) -> torch.Tensor:
    """lse = m + ls as torch.logsumexp gives it: +inf for a row with a +inf logit (its s is
    NaN, see fin), NaN for a row with a NaN logit."""
    return torch.where(m == math.inf, m, m + ls)


def row_losses(m, ls, zy, zsum, sx, valid, bad, eps: float, n_classes: int, zloss: float) -> torch.Tensor:
    """Per-token loss [T] x fp32: (1-eps)(lse - z_y) + eps(lse - mean_j z_j) + zl*lse^2,
    0 for ignored tokens, NaN for tokens whose label was out of range. Formed as
    (m - zy) + log s: lse - zy would lose ulp(lse) under a large common offset."""
    # lse - zy = log1p(sum_{j != y} exp(z_j - zy)) = log1p(sx * exp(m - zy)): exact as p_y -> 1,
    # where log(s) ~ log(1 + tiny) would cancel; (m - zy) + log s when the target is far below m.
    d = m - zy
    near = d < 20.0
    ce = torch.where(near, torch.log1p(sx * torch.exp(torch.where(near, d, torch.zeros_like(d)))), d + ls)
    if eps:  # (without smoothing no 0 * inf = NaN from a -inf logit's zsum = -inf)
        loss = ((1.0 - eps) * ce + eps * (m - zsum / n_classes)) + eps * ls
    else:
        loss = ce
    lse = m + ls
    if zloss:
        loss = loss + zloss * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return torch.where(bad, torch.full_like(loss, math.nan), loss)


def plain_rows(z: torch.Tensor, labels: torch.Tensor, ignore_index: int, eps: float, zloss: float,
               softcap: float) -> torch.Tensor:
    """Per-token loss [T] x fp32 of the whole logits z: [T, V] x fp32 through torch ops alone,
    so differentiable to any order (the backward under create_graph=True differentiates it):
    softcap, cross-entropy with label smoothing, z-loss; 0 for ignored tokens and for labels
    outside [0, V). Holds [T, V] tensors: the memory of the plain-PyTorch loss."""
    V = z.shape[1]
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    valid = (labels != ignore_index) & (labels >= 0) & (labels < V)
    lse = torch.logsumexp(z, dim=1)
    zy = z.gather(1, torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(1)).squeeze(1)
    rows = lse - zy
    if eps:
        rows = (1.0 - eps) * rows + eps * (lse - z.mean(dim=1))
    if zloss:
        rows = rows + zloss * lse * lse
    return torch.where(valid, rows, torch.zeros_like(rows))


def autocast_off(device: torch.device):
    """A context without torch.autocast on `device`: the schedules run their own dtypes
    (linear_cross_entropy has cast the inputs as autocast would)."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def lowp_dx_chunk_tokens(cv: int, dtype: torch.dtype, budget: int = BLOCKED_WORKSPACE_BYTES) -> int:
    """sizes.lowp_dx_chunk_tokens for a torch dtype."""
    return S.lowp_dx_chunk_tokens(cv, lowp_bytes(dtype), budget)


def fused_chunk_tokens(V: int, dtype: torch.dtype, budget: Optional[int] = None,
                       lowp_logits: bool = False) -> int:
    """sizes.fused_chunk_tokens for a torch dtype (the sizes, worked once, are there)."""
    return S.fused_chunk_tokens(V, lowp_bytes(dtype), budget, lowp_logits)


def blocked_chunks(T: int, H: int, dtype: torch.dtype, budget: int = BLOCKED_WORKSPACE_BYTES,
                   chunk_tokens: Optional[int] = None) -> Tuple[int, int]:
    """sizes.blocked_chunks for a torch dtype: (ct, cv) of the 4-GEMM orders."""
    return S.blocked_chunks(T, H, lowp_bytes(dtype), budget, chunk_tokens)


def scale_(t: torch.Tensor, g: torch.Tensor) -> None:
    """t *= g in place (the fused modes' backward: the saved unit-upstream gradients times
    the upstream gradient), in fp32 with one rounding to t's dtype (== (t.float() * g).to(t.dtype)),
    for t: contiguous fp32/bf16/fp16 and g: one fp32 element on t's device. g is read by the
    kernel (on CUDA: no host sync) and g == 1 (loss.backward()) does nothing; no temporary.
    Bumps t's autograd version like any in-place op."""
    check_tensor("t", t, dtypes=tuple(DTYPE_CODES), contiguous=True)
    check_tensor("g", g, dtypes=(torch.float32,), device=t.device)
    if g.numel() != 1:
        raise ValueError(f"moepeak: g must have exactly one element, got shape {tuple(g.shape)}")
    cuda = t.device.type == "cuda"
    if cuda:
        require_cuda_build("scale_")
    elif t.device.type != "cpu":
        raise ValueError(f"moepeak: scale_ supports cpu and cuda tensors, got {t.device}")
    if t.numel():
        _C.ce_scale(t.data_ptr(), DTYPE_CODES[t.dtype], t.numel(), g.data_ptr(), cuda, current_stream_handle(t.device))
    torch.autograd.graph.increment_version(t)
