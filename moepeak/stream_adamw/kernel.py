"""The CPU AdamW kernel's bindings (moepeak._C.adamw_cpu / adamw_plan_step, csrc/adamw.c):
the per-call settings, the rows handed to the kernel, and the model of torch's scalar-tail
rounding that makes its fp32 path bitwise torch.optim.AdamW(fused=True).

Buffers handed to moepeak._C (layouts and dtype codes: moepeak.core.abi, csrc/mp_abi.h):
  ptrs:  [n, 9] int64, abi.ADAMW_PARAM_ROW (addresses; grad 0: no grad this step)
  hyper: [n, 7] float64, abi.ADAMW_HYPER_ROW
  seeds: [n] int64, the stochastic-rounding seed of each row's bf16 state
"""
from __future__ import annotations

import array
import functools
import logging
from typing import List, NamedTuple

import torch

from .. import _C
from ..core.abi import ADAMW_HYPER_ROW, ADAMW_PARAM_ROW, DTYPE_CODES

LOG = logging.getLogger("moepeak")


class KernelCall(NamedTuple):
    """The settings of one kernel call, the same for every row of it."""
    isa: int  # 0 scalar, 1 avx2, 2 avx512
    threads: int  # 0: the pool's default
    torch_threads: int  # the scalar-tail model (torch_tail_model)
    torch_vlen: int
    state_dtype: int  # abi.DTYPE_CODES of exp_avg/exp_avg_sq/max_exp_avg_sq: fp32, or bf16 (stochastic rounding)

    def keywords(self, seeds: List[int]) -> dict:
        """The state keywords of adamw_cpu / adamw_plan_step (none for fp32 state: its old call)."""
        if self.state_dtype == DTYPE_CODES[torch.float32]:
            return {}
        return dict(state_dtype=self.state_dtype, seed=array.array("q", seeds))


def address_or_zero(t: torch.Tensor) -> int:
    """A column that may be absent (no amsgrad, an fp32 param updated in place): 0 for an
    empty tensor."""
    return t.data_ptr() if t.numel() > 0 else 0


def run_cpu(ptrs: list, hyper: list, seeds: List[int], call: KernelCall) -> None:
    """adamw_cpu on rows of CPU tensors, in place."""
    _C.adamw_cpu(array.array("q", ptrs), array.array("d", hyper), call.isa, call.threads, call.torch_threads,
                 call.torch_vlen, **call.keywords(seeds))


def run_plan(capsule, ptrs: list, hyper: list, seeds: List[int], stream: int, call: KernelCall) -> None:
    """adamw_plan_step: one pass of a bucket plan's pipeline (stream 0: a host plan)."""
    _C.adamw_plan_step(capsule, array.array("q", ptrs), array.array("d", hyper), stream, call.isa, call.threads,
                       call.torch_threads, call.torch_vlen, **call.keywords(seeds))


# --------------------------------------------------------------------------
# torch's scalar-tail model (see csrc/adamw_kernels.c): found once per torch thread count by
# running torch's fused CPU AdamW on a probe and keeping the model that matches it (memoized:
# a fact about this torch, the same for every optimizer; no match is logged once).
# --------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _tail_model_for(threads: int):
    gen = torch.Generator().manual_seed(1234)
    n = 160 * threads + 37
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
    for cand in [(1, 8), (1, 16), (threads, 8), (threads, 16)]:
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        row = ADAMW_PARAM_ROW.row(master=p.data_ptr(), exp_avg=m.data_ptr(), exp_avg_sq=v.data_ptr(),
                                  grad=g.data_ptr(), numel=n, grad_dtype=DTYPE_CODES[g.dtype])
        hyper = ADAMW_HYPER_ROW.row(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=3.0,
                                    maximize=0.0)
        run_cpu(row, hyper, [0], KernelCall(0, 1, cand[0], cand[1], DTYPE_CODES[torch.float32]))
        if torch.equal(v, want) and torch.equal(p, ref.detach()):
            return cand
    LOG.warning("moepeak.StreamAdamW: no model of torch's scalar-tail rounding matches its fused CPU AdamW "
                "with %d threads; the fp32 update is AdamW's arithmetic but may differ from torch's in the last "
                "bit of a tensor's tail elements", threads)
    return (1, 0)


def torch_tail_model():
    """(torch_threads, vlen) that make our CPU kernel bitwise torch's fused
    AdamW with torch's current thread count; (1, 0) if no model matches."""
    return _tail_model_for(torch.get_num_threads())
