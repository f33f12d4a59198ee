"""PipelinedLLEP's expert GEMMs: one chunk's rows times each expert's weights,
through torch._grouped_mm where it works (CUDA bf16, H and I multiples of 8)
and one torch.mm per expert otherwise.

Rows arrive grouped expert-ascending (ecount[e] rows of expert e, e in
[0, E)). Weights may have any strides, e.g. row-major per expert (moepeak's
own [E, H, 2I]) or column-major (Hugging Face's [E, 2I, H] seen through
transpose(1, 2)); the stack is never copied whole.
  * grouped path: torch._grouped_mm takes row- and column-major stacks as
    they are; a grouped weight gradient is computed in the weights'
    orientation (dW^T = right^T left for column-major weights), so it can be
    the gradient tensor itself, strides and all, without a copy.
  * per-expert path: a BLAS sums in an order that depends on the operands'
    layout (MKL's fp32 sgemm does), so each expert's matrix is presented
    row-major: an expert that is not is staged, one at a time, in
    ctx.staging(which) [H, 2I] or [I, H] (param dtype; one expert's weights,
    allocated once per call), and its weight gradient is formed there and
    copied out. Results are then bitwise those of contiguous weights.

Whether torch._grouped_mm is used is the call's option grouped_mm
(moepeak/llep/options.py): "off" never; "on" wherever the call qualifies
(grouped_capability), else refused up front; "auto" where it qualifies on a
CUDA device of compute capability >= 8.0. Under "auto" a raise from
torch._grouped_mm all the same sends the rest of the call to the per-expert
GEMMs (results are the same up to summation order) and the logger "moepeak"
warns once per distinct error; nothing is switched off beyond the call.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from .context import Ctx

_GROUPED_ERRORS = (RuntimeError, TypeError, NotImplementedError)
_LOG = logging.getLogger("moepeak")
_warned_fallbacks = set()  # (error type, message) already logged: each distinct failure warns once


def column_major(W: torch.Tensor) -> bool:
    """Each expert's matrix W[e] is stored column-major (stride(-2) == 1)."""
    return W.stride(-2) == 1 and W.stride(-1) != 1 and W.shape[-1] > 1


def _grouped_operand_ok(W: torch.Tensor) -> bool:
    """torch._grouped_mm takes a weight stack whose matrices are row- or
    column-major with the other stride and the start 16-byte aligned."""
    b = W.element_size()
    if W.stride(-1) == 1:
        lead = W.stride(-2)
    elif W.stride(-2) == 1:
        lead = W.stride(-1)
    else:
        return False
    return (lead * b) % 16 == 0 and (W.stride(0) * b) % 16 == 0 and W.data_ptr() % 16 == 0


def grouped_capability(x: torch.Tensor, weights, H: int, I: int, auto: bool) -> Optional[str]:
    """Why torch._grouped_mm cannot run this call's GEMMs (None: it can). weights: the
    local stacks present. auto: also require what "auto" requires (a CUDA device of
    compute capability >= 8.0)."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    if x.dtype != torch.bfloat16:
        return f"it takes bf16 tensors, got {x.dtype}"
    if H % 8 or I % 8:
        return f"it needs H and I multiples of 8, got H={H}, I={I}"
    if not all(_grouped_operand_ok(W) for W in weights):
        return "a weight stack is neither row- nor column-major with 16-byte aligned strides and start"
    if auto:
        if not x.is_cuda:
            return "grouped_mm='auto' uses it on CUDA devices only"
        if torch.cuda.get_device_capability(x.device) < (8, 0):
            return "it needs compute capability >= 8.0"
    return None


def check_grouped_request(x: torch.Tensor, weights, H: int, I: int, mode: str) -> None:
    """grouped_mm="on" on a call torch._grouped_mm cannot run is refused by name."""
    if mode == "on":
        why = grouped_capability(x, [W for W in weights if W is not None], H, I, auto=False)
        if why is not None:
            raise ValueError(f"moepeak: grouped_mm='on' but torch._grouped_mm cannot run this call: {why}")


def grouped_ok(ctx: Ctx) -> bool:
    """This call's GEMMs go through torch._grouped_mm (options.grouped_mm; under "auto",
    not after it raised in this call)."""
    mode = ctx.options.grouped_mm
    if mode == "off" or ctx.grouped_failed:
        return False
    return grouped_capability(ctx.x, [ctx.W[w] for w in ctx.kinds], ctx.H, ctx.I, auto=mode == "auto") is None


def _fall_back(ctx: Ctx, grp: "Groups", err: Exception) -> None:
    """torch._grouped_mm raised: under "on" the error propagates; under "auto" the rest of
    this call runs per-expert GEMMs, and the logger "moepeak" warns (once per process for
    each distinct error)."""
    if ctx.options.grouped_mm == "on":
        raise err
    ctx.grouped_failed = True
    ctx.stats["grouped_fallback"] = 1
    grp.grouped = False
    seen = (type(err).__name__, str(err))
    if seen not in _warned_fallbacks:
        _warned_fallbacks.add(seen)
        _LOG.warning("moepeak: torch._grouped_mm raised (%s: %s); the llep call runs one GEMM per expert "
                     "from there (grouped_mm='off' chooses that up front; this error is reported once)", *seen)


def _stack(ctx: Ctx, experts, kind, which: int):
    """[G, in, N] weight stack (weight kind `which`, see context.Ctx) of
    a run of experts that are consecutive in their storage (local block or
    slots): a view."""
    if kind == "l":
        e0 = experts[0] - ctx.r * ctx.El
        return ctx.W[which][e0:e0 + len(experts)]
    return ctx.borrowed_stack(which, ctx.slot[experts[0]], len(experts))


def mm(ctx: Ctx, inp, grp: "Groups", which: int, transpose: bool, out):
    """Rows of e times W_e (or W_e^T) for each expert e, rows grouped
    expert-ascending; which: the weight kind (context.Ctx). Returns the [rows, N]
    result: torch._grouped_mm's own output where it works (out may then be
    None: no copy into the workspace), else `out` filled by one torch.mm per
    expert."""
    rows = inp.shape[0]
    N = ctx.dims(which)[0 if transpose else 1]
    if rows == 0:
        return inp.new_empty(0, N) if out is None else out[:0]
    if grp.grouped:
        try:
            res = None
            for a, b, experts, kind, offs in grp.segments:
                W = _stack(ctx, experts, kind, which)
                r = torch._grouped_mm(inp[a:b], W.transpose(1, 2) if transpose else W, offs=offs)
                if a == 0 and b == rows:
                    res = r  # one segment (always at P = 1): no copy
                else:
                    if res is None:
                        res = inp.new_empty(rows, N) if out is None else out[:rows]
                    res[a:b].copy_(r)
            ctx.stats["grouped_mm"] += 1
            return res
        except _GROUPED_ERRORS as err:
            _fall_back(ctx, grp, err)
    if out is None:  # only after a grouped failure: this call's buffer
        out = inp.new_empty(rows, N)
    off = 0
    for e, c in enumerate(grp.ecount):
        if c:
            W = _row_major(ctx, ctx.weights(e)[which], which)
            torch.mm(inp[off:off + c], W.t() if transpose else W, out=out[off:off + c])
            off += c
    return out[:rows]


def _row_major(ctx: Ctx, W, which: int):
    """Expert matrix W itself when row-major, else a copy in ctx.staging(which)."""
    return W if W.is_contiguous() else ctx.staging(which).copy_(W)


def _grouped_dw(left, right, offs, col_major: bool):
    """[G, ., .] = left[rows of g]^T @ right[rows of g] per group g; with
    col_major the result is computed transposed, so each matrix is
    column-major (the layout of column-major weights)."""
    if col_major:
        return torch._grouped_mm(right.t(), left, offs=offs).transpose(1, 2)
    return torch._grouped_mm(left.t(), right, offs=offs)


def dw_accumulate(ctx: Ctx, left, right, grp: "Groups", which: int, dW_local, dW_borrowed):
    """dW_e += left[rows of e]^T @ right[rows of e] (param dtype).
    dW_local[which] is None until the first call: on the grouped path the
    first chunk's grouped GEMM over all local experts (2D x 2D, offsets
    along the rows; experts without rows there get an unused slice, written
    or zeroed later) *is* the weight gradient [E_local, ., .], no copy, when
    its strides are the weights' (row- or column-major weights of a dense
    stack); otherwise dW is allocated like the weights (ctx.new_dw).
    After that, experts whose gradient is still untouched (unwritten) get
    it from one torch._grouped_mm per run of at most G experts and a copy
    into dW; G is chosen so that the [G, ., .] result is no larger than one
    [C, 2I] (or [C, H]) buffer. Experts already touched by an earlier chunk
    use addmm_ (one rounding into the running sum: the same rounding as
    the per-expert path)."""
    touched = ctx.touched[which]
    done = set()  # experts of this call already written by a grouped run
    W = ctx.W[which]
    col = column_major(W)
    if grp.grouped:
        try:
            if dW_local[which] is None:
                for a0, b0, experts, kind, offs in grp.segments:
                    if kind == "l":
                        r = _grouped_dw(left[a0:b0], right[a0:b0], offs, col)
                        if r.stride() == W.stride():
                            dW_local[which] = r
                            ex = [e for e in experts if grp.ecount[e]]
                            touched.update(ex)
                            done.update(ex)
                        r = None
                if dW_local[which] is None:
                    dW_local[which] = ctx.new_dw(which)
            for a0, experts, kind, offs in grp.dw_runs(which, touched):
                b0 = a0 + int(sum(grp.ecount[e] for e in experts))
                if kind == "l":
                    r = _grouped_dw(left[a0:b0], right[a0:b0], offs, col)
                    e0 = experts[0] - ctx.r * ctx.El
                    dW_local[which][e0:e0 + len(experts)].copy_(r)
                else:
                    r = torch._grouped_mm(left[a0:b0].t(), right[a0:b0], offs=offs)
                    for i, e in enumerate(experts):
                        dW_borrowed[which][ctx.slot[e]].copy_(r[i])
                r = None  # freed before the next run's result exists: one [G, ., .] at a time
                touched.update(experts)
                done.update(experts)
            ctx.stats["grouped_dw"] += 1
        except _GROUPED_ERRORS as err:
            _fall_back(ctx, grp, err)
    if dW_local[which] is None:
        dW_local[which] = ctx.new_dw(which)
    off = 0
    for e, c in enumerate(grp.ecount):
        if c and e not in done:
            if e // ctx.El == ctx.r:
                g = dW_local[which][e - ctx.r * ctx.El]
            else:
                g = dW_borrowed[which][ctx.slot[e]]
            dst = g if g.is_contiguous() else ctx.staging(which)
            if e in touched:
                if dst is not g:
                    dst.copy_(g)
                dst.addmm_(left[off:off + c].t(), right[off:off + c])
            else:  # first rows of e: dW starts uninitialised (see sched.backward)
                torch.mm(left[off:off + c].t(), right[off:off + c], out=dst)
            if dst is not g:
                g.copy_(dst)
            touched.add(e)
        off += c


class Groups:
    """One chunk's expert grouping, computed on the host from ecount (no device
    read): segments of grouped rows whose experts form one weight stack, with
    their grouped_mm offsets (int32, cumulative rows within the segment) moved
    to the device in ONE host-to-device copy per chunk (Ctx.host_to_device:
    pinned, asynchronous), shared by every GEMM of the chunk."""

    def __init__(self, ctx: Ctx, ecount):
        self.ctx, self.ecount = ctx, ecount
        self.grouped = grouped_ok(ctx)
        self._rows_index = None
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
        self.dev = ctx.host_to_device(torch.tensor(host, dtype=torch.int32)) if host else None
        self.segments = [(a, b, ex, kind, self.dev[c0:c1]) for a, b, ex, kind, c0, c1 in spans]

    def row_table_index(self) -> torch.Tensor:
        """[rows] int64 on the device: each grouped row's row in ctx.bias_table
        (its expert's), built on the host from ecount (one copy per chunk)."""
        if self._rows_index is None:
            ctx = self.ctx
            ex = [e for e, c in enumerate(self.ecount) if c]
            rows_of = torch.tensor([ctx.table_row(e) for e in ex], dtype=torch.int64)
            counts = torch.tensor([self.ecount[e] for e in ex], dtype=torch.int64)
            self._rows_index = ctx.host_to_device(torch.repeat_interleave(rows_of, counts))
        return self._rows_index

    def dw_runs(self, which: int, touched):
        """Runs for the grouped weight gradient: consecutive experts of one
        segment with rows in this chunk and an untouched gradient, at most G
        per run. Returns [(first row, experts, kind, offs on the device)]. The
        few experts left out (touched ones) go to addmm_."""
        ctx = self.ctx
        G = max(1, ctx.C // ctx.dims(which)[0])
        runs, host = [], []
        for a, _, experts, _, _ in self.segments:
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
        dev = ctx.host_to_device(torch.tensor(host, dtype=torch.int32))
        return [(s, ex, kind, dev[c0:c1]) for s, ex, kind, c0, c1 in out]

