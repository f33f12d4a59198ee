"""OffloadStreamAdamW: AdamW with fp32 master weights, exp_avg and exp_avg_sq in
host RAM, streamed through the GPU copy engines bucket by bucket.

API
---
``moepeak.StreamAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
weight_decay=1e-2, *, bucket_mb=64, threads=None, isa=None, grad_slots=3,
param_slots=2)`` is a ``torch.optim.Optimizer`` with the update of
``torch.optim.AdamW`` (decoupled weight decay, bias correction, no amsgrad,
no maximize).

- Parameters may be CUDA tensors (fp32, bf16 or fp16) or CPU tensors. On
  CUDA, params and grads stay on the GPU; the optimizer's fp32 state lives on
  the CPU. One ``step()`` is a pipeline over buckets of ``bucket_mb`` MiB of
  fp32 master weights (large tensors are split, small ones packed):
  D2H grads of bucket i+1 || CPU AdamW of bucket i || H2D params of bucket i-1,
  through ``grad_slots`` + ``param_slots`` pinned slots allocated once. It adds
  no GPU memory (copies go straight between the grads/params and the pinned
  slots). ``step()`` may be called right after ``backward()`` without a
  synchronize: it orders its copy streams after torch's current stream, and
  makes the current stream wait for the last H2D copy, so the next forward sees
  the new parameters. When ``step()`` returns every grad has been read, so
  ``zero_grad()`` may free them at once.
- CPU parameters are updated in place with no copies (the same C kernel).
- The CPU kernel is C (AVX-512 / AVX2 / scalar, chosen at run time or forced
  with ``isa='avx512'|'avx2'|'scalar'``), runs on moepeak's pthread pool with
  ``threads`` threads (None: all CPUs of the process), GIL released.
- Exactness: the fp32 update is bitwise the one of
  ``torch.optim.AdamW(fused=True)`` on CPU (same scalar casts, same fused
  multiply-adds, and torch's scalar-tail rounding emulated; see
  csrc/adamw_kernels.c). For CUDA params the master/state follow the same
  arithmetic; the bf16/fp16 param is the master rounded to nearest even.
- State (``state_dict()``) per parameter: ``step`` (0-d float32 CPU tensor),
  ``exp_avg``, ``exp_avg_sq`` (fp32 CPU tensors shaped like the local
  param), the same keys as ``torch.optim.AdamW``; plus, for bf16/fp16 params
  only, ``master_param`` (the fp32 master). Loading a ``torch.optim.AdamW``
  state dict works (the master is then initialised from the param); loading
  ours into ``torch.optim.AdamW`` works too (torch keeps ``master_param`` as
  an unused extra entry, cast to the param's dtype; drop it from the dict
  first to avoid that memory). For fp32 CUDA params the CPU master is always
  equal to the param and is rebuilt from it after a load.
- LR schedulers (lr is read from ``param_groups`` every step), grad clipping
  before ``step()``, ``zero_grad()``, params with ``grad is None`` (skipped)
  and FSDP2 DTensor params (updated through their local shards) work.
- Errors name the parameter (``param_groups[g]['params'][i]``): sparse or
  complex grads/params, unsupported dtypes, non-contiguous tensors, a param
  whose device changed between steps, bad lr/eps/betas/weight_decay,
  amsgrad/maximize. Every check runs before any parameter is touched.

The torch op ``moepeak::stream_adamw`` (mutating: params, masters, exp_avgs,
exp_avg_sqs) does one step on flat lists; the optimizer calls it.
"""
from __future__ import annotations

import array
import itertools
import weakref
from typing import List, Optional

import torch

from . import _C
from ._ext import require_cuda_build

_ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DT_SIZE = {0: 4, 1: 2, 2: 2}
_SEG_ALIGN = 64  # bytes: each segment starts on a cache line of its slot


# --------------------------------------------------------------------------
# torch's scalar-tail model (see csrc/adamw_kernels.c): found once by running
# torch's fused CPU AdamW on a probe and keeping the model that matches it.
# --------------------------------------------------------------------------
_TAIL_MODEL = {}


def _ptr_row(master, m, v, grad, lp, n, gdt, ldt):
    return [master, m, v, grad, lp, n, gdt, ldt]


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
        hyp = array.array("d", [1e-2, 0.9, 0.999, 1e-8, 0.0, 3.0])
        _C.adamw_cpu(ptrs, hyp, 0, 1, cand[0], cand[1])
        if torch.equal(v, want) and torch.equal(p, ref.detach()):
            model = cand
            break
    _TAIL_MODEL[T] = model
    return model


# --------------------------------------------------------------------------
# bucket plans for CUDA params (pinned slot rings live in the C plan)
# --------------------------------------------------------------------------
_PLANS: "weakref.WeakValueDictionary[int, _Plan]" = weakref.WeakValueDictionary()
_plan_ids = itertools.count(1)


class _Plan:
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
                goff += -(-take * _DT_SIZE[gdts[i]] // _SEG_ALIGN) * _SEG_ALIGN
                poff += -(-take * _DT_SIZE[ldts[i]] // _SEG_ALIGN) * _SEG_ALIGN
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
    plan = _PLANS.get(plan_id) if plan_id > 0 else None
    if plan is not None and plan.key == key:
        return plan
    return _Plan(key, device, bucket_mb, grad_slots, param_slots, host)


# --------------------------------------------------------------------------
# the torch op
# --------------------------------------------------------------------------
def _stream_adamw_impl(
    params: List[torch.Tensor],
    grads: List[torch.Tensor],
    masters: List[torch.Tensor],
    exp_avgs: List[torch.Tensor],
    exp_avg_sqs: List[torch.Tensor],
    steps: List[float],
    lrs: List[float],
    beta1s: List[float],
    beta2s: List[float],
    epss: List[float],
    weight_decays: List[float],
    isa: int = -1,
    threads: int = 0,
    bucket_mb: float = 64.0,
    grad_slots: int = 3,
    param_slots: int = 2,
    plan_id: int = 0,
    plan_index: Optional[List[int]] = None,
    host_pipeline: bool = False,
) -> None:
    """One AdamW step. masters/exp_avgs/exp_avg_sqs: fp32 CPU tensors, updated
    in place. params[i]: the tensor that receives the new value in its own
    dtype (a CUDA param, a bf16/fp16 CPU param), or an empty tensor when the
    master is the param itself (fp32 CPU). grads[i]: on params[i]'s device
    (on the CPU for fp32 CPU params), fp32/bf16/fp16. steps: already
    incremented. Arguments are validated by StreamAdamW before this runs.
    plan_id/plan_index (StreamAdamW's): the bucket plan to reuse and, for
    each CUDA entry in order, its row in that plan (the plan covers every
    CUDA param of the optimizer, so params without a grad do not change it).
    host_pipeline (tests): run CPU params through the bucket pipeline with
    memcpy in place of the copy engines (params[i] then is the CPU param)."""
    n = len(masters)
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError("moepeak.stream_adamw: params, grads, masters, exp_avgs, exp_avg_sqs differ in length")
    for name, lst in (("steps", steps), ("lrs", lrs), ("beta1s", beta1s), ("beta2s", beta2s), ("epss", epss),
                      ("weight_decays", weight_decays)):
        if len(lst) != n:
            raise ValueError(f"moepeak.stream_adamw: {name} has {len(lst)} entries, expected {n}")
    if isa < 0:
        isa = _C.cpu_best_isa()
    tthreads, tvlen = torch_tail_model()
    cpu_rows, cpu_hyp, cuda_idx = [], [], []
    for i in range(n):
        mst, p, g = masters[i], params[i], grads[i]
        if mst.dtype != torch.float32 or mst.device.type != "cpu":
            raise TypeError(f"moepeak.stream_adamw: masters[{i}] must be fp32 on the CPU")
        if mst.numel() == 0:
            continue  # nothing to update (and no bucket segment)
        if p.is_cuda or host_pipeline:
            cuda_idx.append(i)
            continue
        lp = 0 if p.numel() == 0 else p.data_ptr()
        cpu_rows += _ptr_row(mst.data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(), g.data_ptr(), lp,
                             mst.numel(), _DT[g.dtype], _DT[p.dtype] if lp else 0)
        cpu_hyp += [lrs[i], beta1s[i], beta2s[i], epss[i], weight_decays[i], steps[i]]
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
            gdts.append(_DT[g.dtype])
            ldts.append(_DT[p.dtype])
            rows += _ptr_row(masters[i].data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(), g.data_ptr(),
                             p.data_ptr(), p.numel(), gdts[-1], ldts[-1])
            hyp += [lrs[i], beta1s[i], beta2s[i], epss[i], weight_decays[i], steps[i]]
        if plan_index:
            plan = _PLANS.get(plan_id)
            if plan is None or len(plan_index) != len(cuda_idx):
                raise ValueError("moepeak.stream_adamw: plan_index given without its live plan")
            full = [0] * (8 * plan.nparam)
            full_h = [0.0] * (6 * plan.nparam)
            for j, slot in enumerate(plan_index):
                full[8 * slot:8 * slot + 8] = rows[8 * j:8 * j + 8]
                full_h[6 * slot:6 * slot + 6] = hyp[6 * j:6 * j + 6]
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



# The op. StreamAdamW.step calls _stream_adamw_impl directly when not under
# torch.compile (the dispatcher's per-tensor alias checks and version bumps
# of five lists cost ~10 ms per step for a few hundred params) and bumps the
# params' version counters itself; the op is what torch.compile/opcheck see.
stream_adamw = torch.library.custom_op("moepeak::stream_adamw",
                                       mutates_args=("params", "masters", "exp_avgs", "exp_avg_sqs"))(
    _stream_adamw_impl)

@stream_adamw.register_fake
def _(params, grads, masters, exp_avgs, exp_avg_sqs, steps, lrs, beta1s, beta2s, epss, weight_decays, isa=-1,
      threads=0, bucket_mb=64.0, grad_slots=3, param_slots=2, plan_id=0, plan_index=None, host_pipeline=False):
    return None


# No register_autograd: torch refuses autograd formulas for mutating
# (non-functional) ops ("Cannot register autograd formula for non-functional
# operator"), and an optimizer step runs under torch.no_grad() anyway.

from ._stream_adamw_optim import StreamAdamW  # noqa: E402,F401  (the public class)
