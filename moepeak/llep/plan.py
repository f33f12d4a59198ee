"""PipelinedLLEP host side: the LLEP plan, the chunk layout, and thin
wrappers over the native kernels (csrc/llep.c on CPU, cuda/llep.cu on GPU).

All integer tables live on the host as int64 CPU tensors and are identical on
every rank (they derive only from the all-gathered P x E load matrix), so the
chunk count and every collective's sizes agree everywhere.

Chunk-size formula, worked once (docs/design.md "PipelinedLLEP"):
  C = 32768 rows per destination per chunk, P = 4 ranks -> q = C // P = 8192
  rows per (src, dst) pair per chunk. If the busiest pair moves S = 100000
  rows, n = ceil(100000 / 8192) = 13 chunks on every rank; chunk j of a pair
  with S rows takes rows [floor(j*S/n), floor((j+1)*S/n)), at most
  ceil(S/n) <= q rows, so any rank receives at most P*q <= C rows per chunk,
  whatever the routing.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import List, Optional

import torch

from .. import _C
from ..core.abi import DTYPE_CODES  # the kernels' dtype codes (also part of the config fingerprint)
from ..core.ext import check_tensor, current_stream_handle, require_cuda_build


# ---------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------
@dataclass
class Plan:
    """Q [E, P]: rows of expert e run on rank d; A [E, P, P]: rows of e sent
    src -> dst; S [P, P]: rows sent src -> dst (all int64, CPU)."""
    Q: torch.Tensor
    A: torch.Tensor
    S: torch.Tensor
    spilled: bool


def llep_plan(load: torch.Tensor, alpha: float, min_tokens: int, lam: float) -> Plan:
    """The LLEP plan for load [P, E] (int64 CPU): see csrc/llep_plan.c."""
    if load.dim() != 2 or load.dtype != torch.int64 or load.device.type != "cpu":
        raise ValueError(f"moepeak: load must be a [P, E] int64 CPU tensor, got {tuple(load.shape)} {load.dtype}")
    P, E = load.shape
    if P < 1 or E < 1 or E % P != 0:
        raise ValueError(f"moepeak: num_experts ({E}) must be a positive multiple of the number of ranks ({P}); "
                         "every rank owns E / P experts")
    load = load.contiguous()
    Q = torch.empty(E, P, dtype=torch.int64)
    A = torch.empty(E, P, P, dtype=torch.int64)
    S = torch.empty(P, P, dtype=torch.int64)
    spilled = _C.llep_plan(load.data_ptr(), P, E, float(alpha), int(min_tokens), float(lam),
                           Q.data_ptr(), A.data_ptr(), S.data_ptr())
    return Plan(Q, A, S, bool(spilled))


def num_chunks(S: torch.Tensor, chunk_rows: int) -> int:
    return int(_C.llep_num_chunks(S.contiguous().data_ptr(), S.shape[0], int(chunk_rows)))


@dataclass
class ChunkLayout:
    send_start: List[int]  # [P] start of this chunk's rows for dst d in the send list
    send_len: List[int]    # [P]
    recv_len: List[int]    # [P] rows arriving from src s (receive buffer is src-major)
    perm: Optional[torch.Tensor]  # [rows] int64 CPU: grouped position -> receive row (None: not made)
    ecount: List[int]      # [E] grouped rows per expert (expert-ascending)
    rows: int


def chunk_layout(plan: Plan, rank: int, n: int, j: int, chunk_rows: int, with_perm: bool = True) -> ChunkLayout:
    """Chunk j's layout on `rank` (csrc/llep.h); with_perm=False skips the
    permutation (one rank: its receive rows are its send rows, already grouped),
    O(rows) host work and memory less."""
    E, P = plan.Q.shape
    ss = torch.empty(P, dtype=torch.int64)
    sl = torch.empty(P, dtype=torch.int64)
    rl = torch.empty(P, dtype=torch.int64)
    perm = torch.empty(chunk_rows if with_perm else 0, dtype=torch.int64)
    ec = torch.empty(E, dtype=torch.int64)
    rows = _C.llep_chunk_layout(plan.A.data_ptr(), plan.S.data_ptr(), P, E, int(rank), int(n), int(j),
                                ss.data_ptr(), sl.data_ptr(), rl.data_ptr(), perm.data_ptr() if with_perm else 0,
                                int(chunk_rows), ec.data_ptr())
    return ChunkLayout(ss.tolist(), sl.tolist(), rl.tolist(), perm[:rows] if with_perm else None, ec.tolist(),
                       int(rows))


def config_fingerprint(**fields) -> List[int]:
    """Integers that must agree on every rank; floats by their IEEE bits."""
    out = []
    for k in sorted(fields):
        v = fields[k]
        out.append(struct.unpack("<q", struct.pack("<d", v))[0] if isinstance(v, float) else int(v))
    return out


# ---------------------------------------------------------------------------
# Kernels (validated callers only: llep.py checks dtypes/devices/shapes)
# ---------------------------------------------------------------------------
def _is_cuda(t: torch.Tensor) -> bool:
    if t.device.type == "cuda":
        require_cuda_build("llep")
        return True
    return False


def count(ids_flat: torch.Tensor, E: int) -> torch.Tensor:
    """cnt [E + 1] int64 on ids' device; cnt[E] counts ids outside [0, E)."""
    cnt = torch.empty(E + 1, dtype=torch.int64, device=ids_flat.device)
    _C.llep_count(ids_flat.data_ptr(), ids_flat.numel(), E, cnt.data_ptr(), _is_cuda(ids_flat),
                  current_stream_handle(ids_flat.device))
    return cnt


def route(ids_flat: torch.Tensor, E: int, plan: Plan, rank: int, local_cnt: torch.Tensor,
          to_device=None) -> torch.Tensor:
    """send_index [N] int64: rank's flat (t, k) picks in dst-major send order
    (within a dst expert-ascending, within an expert token order). to_device:
    how the host tables reach a CUDA device (default: a blocking copy)."""
    P = plan.S.shape[0]
    Ar = plan.A[:, rank, :].contiguous()                        # [E, P]
    cum = (Ar.cumsum(1) - Ar).contiguous()                      # start of dst d within expert e
    Sr = plan.S[rank]
    blk = ((Sr.cumsum(0) - Sr)[None, :] + Ar.cumsum(0) - Ar).contiguous()  # where (d, e) starts
    N = ids_flat.numel()
    out = torch.empty(N, dtype=torch.int64, device=ids_flat.device)
    if N == 0:
        return out
    if _is_cuda(ids_flat):
        estart = torch.zeros(E * P, dtype=torch.int64)
        estart[:E] = local_cnt.cumsum(0) - local_cnt
        tables = torch.stack([Ar.flatten(), cum.flatten(), blk.flatten(), estart])
        tables = to_device(tables) if to_device is not None else tables.to(ids_flat.device)
        sorted_ids, pos = torch.sort(ids_flat, stable=True)
        _C.llep_route_cuda(pos.data_ptr(), sorted_ids.data_ptr(), N, E, P, tables.data_ptr(), out.data_ptr(),
                           current_stream_handle(ids_flat.device))
    else:
        _C.llep_route_cpu(ids_flat.data_ptr(), N, E, P, Ar.data_ptr(), cum.data_ptr(), blk.data_ptr(),
                          out.data_ptr())
    return out


def gather_rows(src: torch.Tensor, idx: torch.Tensor, div: int, out: torch.Tensor, scale=None) -> torch.Tensor:
    """out[i] = src[idx[i] // div] for i < len(idx); src [R, W], out [>= len, W]
    (contiguous rows). With scale (fp32 [>= len], contiguous): out[i] =
    src[idx[i] // div] * scale[i], each element one fp32 product rounded once
    to src's dtype (the value torch's `rows * scale[:, None]` stores in the
    rows' dtype): backward's w*dy rows gathered and scaled in one pass."""
    rows = idx.numel()
    if scale is not None:
        check_tensor("src", src, dtypes=tuple(DTYPE_CODES), ndim=2, contiguous=True)
        check_tensor("out", out, dtypes=(src.dtype,), ndim=2, device=src.device, contiguous=True)
        check_tensor("scale", scale, dtypes=(torch.float32,), ndim=1, device=src.device, contiguous=True)
        if out.shape[0] < rows or out.shape[1] != src.shape[1]:
            raise ValueError(f"moepeak: out must be [>= {rows}, {src.shape[1]}], got {tuple(out.shape)}")
        if scale.numel() < rows:
            raise ValueError(f"moepeak: scale must hold a weight per gathered row (>= {rows}), got {scale.numel()}")
    if rows and scale is None:
        _C.llep_gather(src.data_ptr(), idx.data_ptr(), rows, int(div), src.shape[1] * src.element_size(),
                       out.data_ptr(), _is_cuda(src), current_stream_handle(src.device))
    elif rows:
        _C.llep_gather_scaled(src.data_ptr(), idx.data_ptr(), scale.data_ptr(), rows, int(div), src.shape[1],
                              DTYPE_CODES[src.dtype], out.data_ptr(), _is_cuda(src), current_stream_handle(src.device))
    return out[:rows]


def combine_rows(acc: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, w, div: int) -> None:
    """acc[idx[i] // div] += w[idx[i]] * y[i] in fp32 (w None: weight 1)."""
    rows = idx.numel()
    if rows:
        _C.llep_combine(acc.data_ptr(), y.data_ptr(), DTYPE_CODES[y.dtype], idx.data_ptr(),
                        0 if w is None else w.data_ptr(), rows, int(div), acc.shape[1], _is_cuda(acc),
                        current_stream_handle(acc.device))


def down_bwd(D: torch.Tensor, a: torch.Tensor, w: torch.Tensor, wp: torch.Tensor, dwr: torch.Tensor) -> None:
    """The down projection's backward epilogue over rows r (csrc/llep.h):
    dwr[r] = <D[r], a[r]> / wp[r]; D[r], a[r] *= w[r] / wp[r] in place.
    D, a [rows, I] (same float dtype, contiguous); w, wp, dwr [>= rows] fp32."""
    check_tensor("D", D, dtypes=tuple(DTYPE_CODES), ndim=2, contiguous=True)
    check_tensor("a", a, dtypes=(D.dtype,), ndim=2, device=D.device, contiguous=True)
    if a.shape != D.shape:
        raise ValueError(f"moepeak: a must have D's shape {tuple(D.shape)}, got {tuple(a.shape)}")
    rows = D.shape[0]
    for name, t in (("w", w), ("wp", wp), ("dwr", dwr)):
        check_tensor(name, t, dtypes=(torch.float32,), ndim=1, device=D.device, contiguous=True)
        if t.numel() < rows:
            raise ValueError(f"moepeak: {name} must hold at least rows={rows} elements, got {t.numel()}")
    if rows:
        _C.llep_down_bwd(D.data_ptr(), a.data_ptr(), DTYPE_CODES[D.dtype], w.data_ptr(), wp.data_ptr(),
                         dwr.data_ptr(), rows, D.shape[1], _is_cuda(D), current_stream_handle(D.device))


def _check_swiglu_rows(h: torch.Tensor, rows: int, I: int, names) -> None:
    """h [rows, 2I] with unit column stride; the named [rows, I] tensors contiguous, of h's
    dtype and device."""
    check_tensor("h", h, dtypes=tuple(DTYPE_CODES), ndim=2)
    if tuple(h.shape) != (rows, 2 * I) or (rows > 1 and h.stride(0) < 2 * I) or (I and h.stride(1) != 1):
        raise ValueError(f"moepeak: h must be [rows={rows}, 2I={2 * I}] with unit column stride, got "
                         f"{tuple(h.shape)} strides {h.stride()}")
    for name, t in names:
        check_tensor(name, t, dtypes=(h.dtype,), ndim=2, device=h.device, contiguous=True)
        if tuple(t.shape) != (rows, I):
            raise ValueError(f"moepeak: {name} must be [rows={rows}, I={I}], got {tuple(t.shape)}")


def swiglu_fwd(h: torch.Tensor, a: torch.Tensor, s=None) -> torch.Tensor:
    """SwiGLU on h = [gate | up] rows (csrc/llep.h): a [rows, I] = rnd(s * up) with
    s = rnd(silu(gate)) (also stored in s [rows, I] when given); the values of
    torch.ops.aten.silu then mul, one kernel. h [rows, 2I] (unit column stride,
    any row stride); a, s contiguous, h's dtype. Returns a."""
    rows, I = a.shape
    _check_swiglu_rows(h, rows, I, [("a", a)] + ([("s", s)] if s is not None else []))
    if rows and I:
        _C.llep_swiglu_fwd(h.data_ptr(), h.stride(0) if rows > 1 else 2 * I, a.data_ptr(),
                           0 if s is None else s.data_ptr(), rows, I, DTYPE_CODES[a.dtype], _is_cuda(a),
                           current_stream_handle(a.device))
    return a


def swiglu_bwd(h: torch.Tensor, da: torch.Tensor, s: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """dh [rows, 2I] (h's layout; may be h itself) from da [rows, I], h and
    s = rnd(silu(gate)) [rows, I]: d up = rnd(da * s), d gate = aten
    silu_backward(rnd(da * up), gate), one kernel. Returns dh."""
    rows, I = da.shape
    _check_swiglu_rows(h, rows, I, [("da", da), ("s", s)])
    _check_swiglu_rows(dh, rows, I, [])
    if dh.dtype != h.dtype or dh.device != h.device:
        raise TypeError(f"moepeak: dh must match h's dtype and device, got {dh.dtype} on {dh.device}")
    if rows and I:
        _C.llep_swiglu_bwd(h.data_ptr(), h.stride(0) if rows > 1 else 2 * I, da.data_ptr(), s.data_ptr(),
                           dh.data_ptr(), dh.stride(0) if rows > 1 else 2 * I, rows, I, DTYPE_CODES[h.dtype],
                           _is_cuda(h), current_stream_handle(h.device))
    return dh


__all__ = ["Plan", "llep_plan", "num_chunks", "ChunkLayout", "chunk_layout", "config_fingerprint",
           "count", "route", "gather_rows", "combine_rows", "down_bwd", "swiglu_fwd", "swiglu_bwd"]
