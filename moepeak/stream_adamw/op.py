"""The torch op moepeak::stream_adamw (one AdamW step on flat lists of
tensors; mutates params, masters, exp_avgs, exp_avg_sqs) and the bucket plans
and CPU-kernel bindings it drives. The optimizer around it, and the contract
users see, is moepeak.StreamAdamW (moepeak/stream_adamw/optimizer.py).

Row layouts handed to moepeak._C (csrc/adamw.c):
  ptrs:  [n, 9] int64 (master, exp_avg, exp_avg_sq, grad, low-precision param
         or 0, numel, grad dtype code, param dtype code, max_exp_avg_sq or 0)
  hyper: [n, 7] float64 (lr, beta1, beta2, eps, weight_decay, step, maximize)
"""
from __future__ import annotations

import array
import itertools
import weakref
from typing import List, Optional

import torch

from .. import _C
from ..core.ext import require_cuda_build

ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPE_BYTES = {0: 4, 1: 2, 2: 2}
_SEG_ALIGN = 64  # bytes: each segment starts on a cache line of its slot
PTR_COLS, HYP_COLS = 9, 7  # the row widths of ptrs / hyper (module docstring)


# --------------------------------------------------------------------------
# torch's scalar-tail model (see csrc/adamw_kernels.c): found once by running
# torch's fused CPU AdamW on a probe and keeping the model that matches it.
# --------------------------------------------------------------------------
_TAIL_MODEL = {}


def _ptr_row(master, m, v, grad, lp, n, gdt, ldt, vmax=0):
    return [master, m, v, grad, lp, n, gdt, ldt, vmax]


def _vmax_ptr(t):
    """The max_exp_avg_sq column: 0 (no amsgrad) for an empty tensor."""
    return t.data_ptr() if t.numel() > 0 else 0


def torch_tail_model():
    """(torch_threads, vlen) that make our CPU kernel bitwise torch's fused
    AdamW with torch's current thread count; (1, 0) if no model matches."""
    T = torch.get_num_threads()
    if T in _TAIL_MODEL:
        return _TAIL_MODEL[T]
    gen = torch.Generator().manual_seed(1234)
    n = 160 * T + 37
    p0 = torch.randn(n, generator=gen)
    m0 = torch.randn(n, generator=gen) * 1e-2
    v0 = torch.rand(n, generator=gen) * 1e-3
    g = torch.randn(n, generator=gen)
    ref = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0, fused=True)
    opt.state[ref] = {"step": torch.tensor(2.0), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    ref.grad = g.clone()
    opt.step()
    want = opt.state[ref]["exp_avg_sq"]
    model = (1, 0)
    for cand in [(1, 8), (1, 16), (T, 8), (T, 16)]:
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        ptrs = array.array("q", _ptr_row(p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), 0, n, 0, 0))
        hyp = array.array("d", [1e-2, 0.9, 0.999, 1e-8, 0.0, 3.0, 0.0])
        _C.adamw_cpu(ptrs, hyp, 0, 1, cand[0], cand[1])
        if torch.equal(v, want) and torch.equal(p, ref.detach()):
            model = cand
            break
    _TAIL_MODEL[T] = model
    return model


# --------------------------------------------------------------------------
# bucket plans for CUDA params (pinned slot rings live in the C plan)
# --------------------------------------------------------------------------
PLANS: "weakref.WeakValueDictionary[int, BucketPlan]" = weakref.WeakValueDictionary()
PLAN_IDS = itertools.count(1)


class BucketPlan:
    """Bucket layout of a fixed list of CUDA params and its C pipeline.

    segs: [nseg, 5] int64 (param index, first element, n, gslot byte offset,
    pslot byte offset); bucket_seg: [nb + 1]. Worked example, bucket_mb = 64
    (16 Mi fp32 elements per bucket), bf16 params of 40 Mi + 3 x 2 Mi
    elements: buckets = [16Mi of p0], [16Mi of p0], [8Mi of p0 + 3 x 2Mi],
    so nb = 3; gslot_bytes = pslot_bytes = 32 MiB; pinned = 3 x 32 + 2 x 32
    = 160 MiB whatever the model size.
    """

    def __init__(self, key, device, bucket_mb, grad_slots, param_slots, host=False):
        numels, gdts, ldts = key
        bucket_elems = max(16, int(bucket_mb * (1 << 20)) // 4)
        segs, bucket_seg = [], [0]
        cur = goff = poff = 0
        gmax = pmax = 0
        for i, n in enumerate(numels):
            off = 0
            while off < n:
                take = min(n - off, bucket_elems - cur)
                segs += [i, off, take, goff, poff]
                goff += -(-take * DTYPE_BYTES[gdts[i]] // _SEG_ALIGN) * _SEG_ALIGN
                poff += -(-take * DTYPE_BYTES[ldts[i]] // _SEG_ALIGN) * _SEG_ALIGN
                gmax, pmax = max(gmax, goff), max(pmax, poff)
                cur += take
                off += take
                if cur == bucket_elems:
                    bucket_seg.append(len(segs) // 5)
                    cur = goff = poff = 0
        if cur > 0:
            bucket_seg.append(len(segs) // 5)
        self.key = key
        self.nparam = len(numels)
        self.nbuckets = len(bucket_seg) - 1
        self.pinned_bytes = 0 if host else grad_slots * gmax + param_slots * pmax
        args = (array.array("q", segs), array.array("q", bucket_seg), len(numels), gmax, pmax, grad_slots,
                param_slots, host)
        if host:  # the same schedule on CPU tensors, memcpy for the copies (tests)
            self.capsule = _C.adamw_plan_create(*args)
        else:
            with torch.cuda.device(device):
                self.capsule = _C.adamw_plan_create(*args)


def _get_plan(plan_id, key, device, bucket_mb, grad_slots, param_slots, host):
    plan = PLANS.get(plan_id) if plan_id > 0 else None
    if plan is not None and plan.key == key:
        return plan
    return BucketPlan(key, device, bucket_mb, grad_slots, param_slots, host)


# --------------------------------------------------------------------------
# the torch op
# --------------------------------------------------------------------------
def stream_adamw_step(
    params: List[torch.Tensor],
    grads: List[torch.Tensor],
    masters: List[torch.Tensor],
    exp_avgs: List[torch.Tensor],
    exp_avg_sqs: List[torch.Tensor],
    max_exp_avg_sqs: List[torch.Tensor],
    steps: List[float],
    lrs: List[float],
    beta1s: List[float],
    beta2s: List[float],
    epss: List[float],
    weight_decays: List[float],
    maximizes: List[bool],
    isa: int = -1,
    threads: int = 0,
    bucket_mb: float = 64.0,
    grad_slots: int = 3,
    param_slots: int = 2,
    plan_id: int = 0,
    plan_index: Optional[List[int]] = None,
    host_pipeline: bool = False,
    torch_threads: int = 0,
    torch_vlen: int = -1,
) -> None:
    """One AdamW step. masters/exp_avgs/exp_avg_sqs: fp32 CPU tensors, updated
    in place. max_exp_avg_sqs[i]: amsgrad's running max (fp32 CPU, updated in
    place), or an empty tensor for no amsgrad. maximizes[i]: torch's maximize. params[i]: the tensor that receives the new value in its own
    dtype (a CUDA param, a bf16/fp16 CPU param), or an empty tensor when the
    master is the param itself (fp32 CPU). grads[i]: on params[i]'s device
    (on the CPU for fp32 CPU params), fp32/bf16/fp16. steps: already
    incremented. Arguments are validated by StreamAdamW before this runs.
    plan_id/plan_index (StreamAdamW's): the bucket plan to reuse and, for
    each CUDA entry in order, its row in that plan (the plan covers every
    CUDA param of the optimizer, so params without a grad do not change it).
    host_pipeline (tests): run CPU params through the bucket pipeline with
    memcpy in place of the copy engines (params[i] then is the CPU param).
    torch_threads/torch_vlen: the scalar-tail model (torch_tail_model()) to
    emulate; 0/-1 (default): the model of this thread's torch thread count
    (StreamAdamW passes the main thread's, since it may run this on another)."""
    n = len(masters)
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(max_exp_avg_sqs) == n):
        raise ValueError("moepeak.stream_adamw: params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs "
                         "differ in length")
    for name, lst in (("steps", steps), ("lrs", lrs), ("beta1s", beta1s), ("beta2s", beta2s), ("epss", epss),
                      ("weight_decays", weight_decays), ("maximizes", maximizes)):
        if len(lst) != n:
            raise ValueError(f"moepeak.stream_adamw: {name} has {len(lst)} entries, expected {n}")
    if isa < 0:
        isa = _C.cpu_best_isa()
    tthreads, tvlen = (torch_threads, torch_vlen) if torch_threads > 0 and torch_vlen >= 0 else torch_tail_model()
    cpu_rows, cpu_hyp, cuda_idx = [], [], []
    for i in range(n):
        mst, p, g = masters[i], params[i], grads[i]
        if mst.dtype != torch.float32 or mst.device.type != "cpu":
            raise TypeError(f"moepeak.stream_adamw: masters[{i}] must be fp32 on the CPU")
        if mst.numel() == 0:
            continue  # nothing to update (and no bucket segment)
        vmax = max_exp_avg_sqs[i]
        if vmax.numel() > 0 and (vmax.numel() != mst.numel() or vmax.dtype != torch.float32
                                 or vmax.device.type != "cpu" or not vmax.is_contiguous()):
            raise TypeError(f"moepeak.stream_adamw: max_exp_avg_sqs[{i}] must be empty or a contiguous fp32 CPU "
                            f"tensor of {mst.numel()} elements")
        if p.is_cuda or host_pipeline:
            cuda_idx.append(i)
            continue
        lp = 0 if p.numel() == 0 else p.data_ptr()
        cpu_rows += _ptr_row(mst.data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(), g.data_ptr(), lp,
                             mst.numel(), DTYPE_CODES[g.dtype], DTYPE_CODES[p.dtype] if lp else 0, _vmax_ptr(vmax))
        cpu_hyp += [lrs[i], beta1s[i], beta2s[i], epss[i], weight_decays[i], steps[i], float(maximizes[i])]
    if cpu_rows:
        _C.adamw_cpu(array.array("q", cpu_rows), array.array("d", cpu_hyp), isa, threads, tthreads, tvlen)
    if cuda_idx:
        if not host_pipeline:
            require_cuda_build("moepeak.stream_adamw")
        device = params[cuda_idx[0]].device
        rows, hyp, numels, gdts, ldts = [], [], [], [], []
        for i in cuda_idx:
            p, g = params[i], grads[i]
            if p.device != device:
                raise ValueError(f"moepeak.stream_adamw: CUDA params must share one device; params[{i}] is on "
                                 f"{p.device}, params[{cuda_idx[0]}] on {device}")
            numels.append(p.numel())
            gdts.append(DTYPE_CODES[g.dtype])
            ldts.append(DTYPE_CODES[p.dtype])
            rows += _ptr_row(masters[i].data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(), g.data_ptr(),
                             p.data_ptr(), p.numel(), gdts[-1], ldts[-1], _vmax_ptr(max_exp_avg_sqs[i]))
            hyp += [lrs[i], beta1s[i], beta2s[i], epss[i], weight_decays[i], steps[i], float(maximizes[i])]
        if plan_index:
            plan = PLANS.get(plan_id)
            if plan is None or len(plan_index) != len(cuda_idx):
                raise ValueError("moepeak.stream_adamw: plan_index given without its live plan")
            full = [0] * (PTR_COLS * plan.nparam)
            full_h = [0.0] * (HYP_COLS * plan.nparam)
            for j, slot in enumerate(plan_index):
                full[PTR_COLS * slot:PTR_COLS * (slot + 1)] = rows[PTR_COLS * j:PTR_COLS * (j + 1)]
                full_h[HYP_COLS * slot:HYP_COLS * (slot + 1)] = hyp[HYP_COLS * j:HYP_COLS * (j + 1)]
            rows, hyp = full, full_h
        else:
            plan = _get_plan(plan_id, (tuple(numels), tuple(gdts), tuple(ldts)), device, bucket_mb, grad_slots,
                             param_slots, host_pipeline)
        step_args = (array.array("q", rows), array.array("d", hyp))
        if host_pipeline:
            _C.adamw_plan_step(plan.capsule, *step_args, 0, isa, threads, tthreads, tvlen)
        else:
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream(device).cuda_stream
                _C.adamw_plan_step(plan.capsule, *step_args, stream, isa, threads, tthreads, tvlen)



# The op. StreamAdamW.step calls stream_adamw_step directly when not under
# torch.compile (the dispatcher's per-tensor alias checks and version bumps
# of five lists cost ~10 ms per step for a few hundred params) and bumps the
# params' version counters itself; the op is what torch.compile/opcheck see.
stream_adamw = torch.library.custom_op("moepeak::stream_adamw",
                                       mutates_args=("params", "masters", "exp_avgs", "exp_avg_sqs",
                                                     "max_exp_avg_sqs"))(
    stream_adamw_step)

@stream_adamw.register_fake
def _(params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lrs, beta1s, beta2s, epss,
      weight_decays, maximizes, isa=-1, threads=0, bucket_mb=64.0, grad_slots=3, param_slots=2, plan_id=0,
      plan_index=None, host_pipeline=False, torch_threads=0, torch_vlen=-1):
    return None


# No register_autograd: torch refuses autograd formulas for mutating
# (non-functional) ops ("Cannot register autograd formula for non-functional
# operator"), and an optimizer step runs under torch.no_grad() anyway.


def check_hyper(lr_name, lr, betas, eps, weight_decay, amsgrad, maximize):
    """StreamAdamW's hyper-parameters (a group's, or the defaults): a clear error naming the bad one."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"moepeak.StreamAdamW: {lr_name} tensor must have one element")
        lr = float(lr)
    if not isinstance(lr, (int, float)) or not lr >= 0.0:
        raise ValueError(f"moepeak.StreamAdamW: {lr_name} must be a float >= 0, got {lr!r}")
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"moepeak.StreamAdamW: eps must be >= 0, got {eps!r}")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"moepeak.StreamAdamW: betas must be a pair of floats, got {betas!r}") from None
    for i, b in enumerate((b1, b2)):
        if not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"moepeak.StreamAdamW: betas[{i}] must be in [0, 1), got {b!r}")
    if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
        raise ValueError(f"moepeak.StreamAdamW: weight_decay must be >= 0, got {weight_decay!r}")
    for name, flag in (("amsgrad", amsgrad), ("maximize", maximize)):
        if not isinstance(flag, bool):
            raise TypeError(f"moepeak.StreamAdamW: {name} must be a bool, got {flag!r}")
