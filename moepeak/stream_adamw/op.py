"""The torch op moepeak::stream_adamw: one AdamW step on flat lists of tensors (mutates
params, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs). The optimizer around it, and the
contract users see, is moepeak.StreamAdamW (moepeak/stream_adamw/optimizer.py); the kernel's
bindings are kernel.py, the bucket plans buckets.py.

A step splits its entries in two: those updated in place on the CPU (CPU params, one
adamw_cpu call) and those streamed through a bucket plan (CUDA params; CPU params too with
host_pipeline, for tests), each a list of kernel rows built the same way.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .. import _C
from ..core.abi import ADAMW_HYPER_ROW, ADAMW_PARAM_ROW, DTYPE_CODES
from ..core.ext import require_cuda_build
from .buckets import LIVE_PLANS, plan_for
from .kernel import KernelCall, address_or_zero, run_cpu, run_plan, torch_tail_model
from .options import STATE_DTYPE_CODES, StreamAdamWOptions

_STATE_DTYPES = {code: dtype for dtype, code in STATE_DTYPE_CODES.items()}
_D = StreamAdamWOptions  # the defaults of the schedule keywords


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
    bucket_mb: float = _D.bucket_mb,
    grad_slots: int = _D.grad_slots,
    param_slots: int = _D.param_slots,
    plan_id: int = 0,
    plan_index: Optional[List[int]] = None,
    host_pipeline: bool = _D.host_pipeline,
    torch_threads: int = 0,
    torch_vlen: int = -1,
    state_dtype: int = 0,
    seeds: Optional[List[int]] = None,
) -> None:
    """One AdamW step. masters: fp32 CPU tensors; exp_avgs, exp_avg_sqs: CPU tensors of the
    state dtype (state_dtype 0: fp32, 1: bf16, stored with stochastic rounding keyed by
    seeds[i], the step and the element index); all updated in place. max_exp_avg_sqs[i]:
    amsgrad's running max (the state dtype, updated in place), or an empty tensor for no
    amsgrad. maximizes[i]: torch's maximize. params[i]: the tensor that receives the new
    value in its own dtype (a CUDA param, a bf16/fp16 CPU param), or an empty tensor when
    the master is the param itself (fp32 CPU). grads[i]: on params[i]'s device (on the CPU
    for fp32 CPU params), fp32/bf16/fp16. steps: already incremented. seeds: one int in
    [0, 2^63) per entry (None: all 0). Arguments are validated by StreamAdamW before this runs.
    plan_id/plan_index (StreamAdamW's): the bucket plan to reuse and, for
    each CUDA entry in order, its row in that plan (the plan covers every
    CUDA param of the optimizer, so params without a grad do not change it).
    host_pipeline (tests): run CPU params through the bucket pipeline with
    memcpy in place of the copy engines (params[i] then is the CPU param).
    torch_threads/torch_vlen: the scalar-tail model (kernel.torch_tail_model()) to
    emulate; 0/-1 (default): the model of this thread's torch thread count
    (StreamAdamW passes the main thread's, since it may run this on another)."""
    lists = (params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    hypers = (steps, lrs, beta1s, beta2s, epss, weight_decays, maximizes)
    seeds = _check_lists(lists, hypers, seeds)
    if state_dtype not in _STATE_DTYPES:
        raise ValueError(f"moepeak.stream_adamw: state_dtype must be 0 (fp32) or 1 (bf16), got {state_dtype!r}")
    if isa < 0:
        isa = _C.cpu_best_isa()
    tail = (torch_threads, torch_vlen) if torch_threads > 0 and torch_vlen >= 0 else torch_tail_model()
    call = KernelCall(isa, threads, tail[0], tail[1], state_dtype)
    in_place, piped = _split_entries(lists, host_pipeline, _STATE_DTYPES[state_dtype])
    if in_place:
        ptrs, hyper, row_seeds = _rows(in_place, lists, hypers, seeds, piped=False)
        run_cpu(ptrs, hyper, row_seeds, call)
    if piped:
        _run_pipeline(piped, lists, hypers, seeds, call, plan_id, plan_index,
                      (bucket_mb, grad_slots, param_slots), host_pipeline)


def _check_lists(lists, hypers, seeds) -> List[int]:
    """Every list one entry per master; returns seeds (all 0 when None)."""
    n = len(lists[2])
    if any(len(x) != n for x in lists):
        raise ValueError("moepeak.stream_adamw: params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs "
                         "differ in length")
    names = ("steps", "lrs", "beta1s", "beta2s", "epss", "weight_decays", "maximizes")
    for name, lst in zip(names, hypers):
        if len(lst) != n:
            raise ValueError(f"moepeak.stream_adamw: {name} has {len(lst)} entries, expected {n}")
    if seeds is None:
        return [0] * n
    if len(seeds) != n:
        raise ValueError(f"moepeak.stream_adamw: seeds has {len(seeds)} entries, expected {n}")
    return list(seeds)


def _split_entries(lists, host_pipeline: bool, state_dtype: torch.dtype):
    """(entries updated in place on the CPU, entries streamed through a bucket plan), after
    checking the host tensors each entry names; empty entries are in neither."""
    params, _, masters, exp_avgs, exp_avg_sqs, vmaxs = lists
    in_place, piped = [], []
    for i, mst in enumerate(masters):
        if mst.dtype != torch.float32 or mst.device.type != "cpu":
            raise TypeError(f"moepeak.stream_adamw: masters[{i}] must be fp32 on the CPU")
        if mst.numel() == 0:
            continue  # nothing to update (and no bucket segment)
        for name, t, optional in (("exp_avgs", exp_avgs[i], False), ("exp_avg_sqs", exp_avg_sqs[i], False),
                                  ("max_exp_avg_sqs", vmaxs[i], True)):
            if optional and t.numel() == 0:
                continue
            if t.numel() != mst.numel() or t.dtype != state_dtype or t.device.type != "cpu" or \
                    not t.is_contiguous():
                raise TypeError(f"moepeak.stream_adamw: {name}[{i}] must be {'empty or ' if optional else ''}a "
                                f"contiguous {state_dtype} CPU tensor of {mst.numel()} elements")
        (piped if params[i].is_cuda or host_pipeline else in_place).append(i)
    return in_place, piped


def _rows(indices, lists, hypers, seeds, piped: bool):
    """The kernel rows (ptrs, hyper, seeds) of the entries `indices`. piped: the param column
    always names the param (the pipeline copies into it); else 0 for an fp32 CPU param
    given as an empty tensor (the master is the param)."""
    params, grads, masters, exp_avgs, exp_avg_sqs, vmaxs = lists
    steps, lrs, beta1s, beta2s, epss, weight_decays, maximizes = hypers
    ptrs, hyper, row_seeds = [], [], []
    for i in indices:
        p, g = params[i], grads[i]
        lp = p.data_ptr() if piped else address_or_zero(p)
        ptrs += ADAMW_PARAM_ROW.row(master=masters[i].data_ptr(), exp_avg=exp_avgs[i].data_ptr(),
                                    exp_avg_sq=exp_avg_sqs[i].data_ptr(), grad=g.data_ptr(), param_lowp=lp,
                                    numel=masters[i].numel(), grad_dtype=DTYPE_CODES[g.dtype],
                                    param_dtype=DTYPE_CODES[p.dtype] if lp else 0,
                                    max_exp_avg_sq=address_or_zero(vmaxs[i]))
        hyper += ADAMW_HYPER_ROW.row(lr=lrs[i], beta1=beta1s[i], beta2=beta2s[i], eps=epss[i],
                                     weight_decay=weight_decays[i], step=steps[i], maximize=float(maximizes[i]))
        row_seeds.append(seeds[i])
    return ptrs, hyper, row_seeds


def _run_pipeline(indices, lists, hypers, seeds, call, plan_id, plan_index, shape, host_pipeline):
    """The piped entries through their bucket plan: the optimizer's live plan (rows placed
    at plan_index, the plan's other rows left empty: no grad, nothing moves) or one made
    for these entries. shape: (bucket_mb, grad_slots, param_slots) of a new plan."""
    params, grads = lists[0], lists[1]
    if not host_pipeline:
        require_cuda_build("moepeak.stream_adamw")
    device = params[indices[0]].device
    for i in indices:
        if params[i].device != device:
            raise ValueError(f"moepeak.stream_adamw: CUDA params must share one device; params[{i}] is on "
                             f"{params[i].device}, params[{indices[0]}] on {device}")
    ptrs, hyper, row_seeds = _rows(indices, lists, hypers, seeds, piped=True)
    if plan_index:
        plan = LIVE_PLANS.get(plan_id)
        if plan is None or len(plan_index) != len(indices):
            raise ValueError("moepeak.stream_adamw: plan_index given without its live plan")
        ptrs, hyper, row_seeds = _place_rows(plan.nparam, plan_index, ptrs, hyper, row_seeds)
    else:
        key = (tuple(params[i].numel() for i in indices), tuple(DTYPE_CODES[grads[i].dtype] for i in indices),
               tuple(DTYPE_CODES[params[i].dtype] for i in indices))
        plan = plan_for(plan_id, key, device, *shape, host_pipeline)
    if host_pipeline:
        run_plan(plan.capsule, ptrs, hyper, row_seeds, 0, call)
        return
    with torch.cuda.device(device):
        run_plan(plan.capsule, ptrs, hyper, row_seeds, torch.cuda.current_stream(device).cuda_stream, call)


def _place_rows(nparam, plan_index, ptrs, hyper, seeds):
    """Rows for every param of a plan: entry j's row at plan_index[j], the others all zero."""
    pw, hw = ADAMW_PARAM_ROW.width, ADAMW_HYPER_ROW.width
    full_p, full_h, full_s = [0] * (pw * nparam), [0.0] * (hw * nparam), [0] * nparam
    for j, row in enumerate(plan_index):
        full_p[pw * row:pw * (row + 1)] = ptrs[pw * j:pw * (j + 1)]
        full_h[hw * row:hw * (row + 1)] = hyper[hw * j:hw * (j + 1)]
        full_s[row] = seeds[j]
    return full_p, full_h, full_s


# The op. StreamAdamW.step calls stream_adamw_step directly when not under
# torch.compile (the dispatcher's per-tensor alias checks and version bumps
# of five lists cost ~10 ms per step for a few hundred params) and bumps the
# params' version counters itself; the op is what torch.compile/opcheck see.
# No register_autograd: torch refuses autograd formulas for mutating ops, and an
# optimizer step runs under torch.no_grad() anyway.
stream_adamw = torch.library.custom_op("moepeak::stream_adamw",
                                       mutates_args=("params", "masters", "exp_avgs", "exp_avg_sqs",
                                                     "max_exp_avg_sqs"))(stream_adamw_step)


@stream_adamw.register_fake
def _(params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lrs, beta1s, beta2s, epss,
      weight_decays, maximizes, isa=-1, threads=0, bucket_mb=_D.bucket_mb, grad_slots=_D.grad_slots,
      param_slots=_D.param_slots, plan_id=0, plan_index=None, host_pipeline=_D.host_pipeline, torch_threads=0,
      torch_vlen=-1, state_dtype=0, seeds=None):
    return None
