"""PipelinedLLEP with Hugging Face's expert weight layout: gate_up_proj
[E, 2I, H] (gate rows first) and down_proj [E, H, I] passed as
transpose(1, 2) views. Forward and every gradient equal the contiguous-weight
result bitwise on CPU (fp32, bf16); gradients come back in the weights'
strides; no weight-sized copy is made anywhere in the op. The P > 1 case is in
test_llep_dist.py (_hf_layout)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moepeak.llep import LLEPOptions, LLEPStats, llep_moe
from moepeak.llep import sched as llep_sched
from moepeak.llep.context import Ctx

try:
    from tests.test_llep import NAMES, _cpu_grouped_mm, _problem
except ImportError:  # rootdir not on sys.path
    from test_llep import NAMES, _cpu_grouped_mm, _problem


def _hf_storage(wgu, wd, dtype):
    """HF's parameters [E, 2I, H] and [E, H, I] holding the same numbers."""
    return (wgu.transpose(1, 2).to(dtype).contiguous().requires_grad_(),
            wd.transpose(1, 2).to(dtype).contiguous().requires_grad_())


def _grads(x, ids, tw, wgu, wd, gy, dtype, hf, **kw):
    """(y, dx, d topk_weights, dW_gate_up, dW_down) with the weights passed
    contiguous (hf False) or as HF's transposed views (hf True; the dW are then
    the gradients of the views, checked to have the views' strides)."""
    xl, twl = x.to(dtype).requires_grad_(), tw.float().requires_grad_()
    if hf:
        gu_p, d_p = _hf_storage(wgu, wd, dtype)
        gu, d = gu_p.transpose(1, 2), d_p.transpose(1, 2)
        assert not gu.is_contiguous() and not d.is_contiguous()
    else:
        gu, d = wgu.to(dtype).requires_grad_(), wd.to(dtype).requires_grad_()
    y = llep_moe(xl, ids, twl, gu, d, **kw)
    grads = torch.autograd.grad(y, [xl, twl, gu, d], gy.to(dtype))
    for g, w in zip(grads[2:], (gu, d)):
        assert g.shape == w.shape and g.stride() == w.stride(), (g.stride(), w.stride())
    return (y.detach(),) + grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frac,C,budget", [(0.0, 16, 0), (0.95, 16, 1), (0.95, 7, 0), (0.5, 4096, None)])
def test_hf_layout_bitwise_equals_contiguous(dtype, frac, C, budget):
    prob = _problem(53, 16, 24, 8, 3, torch.float64, seed=31, frac=frac)
    kw = dict(chunk_rows=C, save_budget_mb=budget)
    ref = _grads(*prob, dtype, False, **kw)
    got = _grads(*prob, dtype, True, **kw)
    for name, a, b in zip(NAMES, got, ref):
        assert torch.equal(a, b), f"{name}: max diff {(a.double() - b.double()).abs().max().item():.3g}"


@pytest.mark.skipif(not _cpu_grouped_mm(), reason="torch has no CPU _grouped_mm here")
@pytest.mark.parametrize("C", [24, 4096])
def test_hf_layout_grouped_cpu(C):
    """The torch._grouped_mm path takes the column-major weight stacks as they
    are and computes the weight gradients in their orientation: bitwise the
    contiguous-weight grouped result."""
    prob = _problem(70, 16, 8, 16, 3, torch.float64, seed=11, frac=0.5)
    st = LLEPStats()
    ref = _grads(*prob, torch.bfloat16, False, chunk_rows=C, grouped_mm="on")
    got = _grads(*prob, torch.bfloat16, True, chunk_rows=C, grouped_mm="on", stats=st)
    assert st.forward["grouped_mm"] > 0 and st.backward["grouped_dw"] > 0, st
    for name, a, b in zip(NAMES, got, ref):
        assert torch.equal(a, b), f"{name}: max diff {(a.double() - b.double()).abs().max().item():.3g}"


def test_hf_layout_param_grads_land_in_hf_storage():
    """Through the views, the HF parameters' .grad are [E, 2I, H] / [E, H, I],
    contiguous, and the transposes of the contiguous-weight gradients."""
    x, ids, tw, wgu, wd, gy = _problem(40, 16, 24, 8, 3, torch.float64, seed=5, frac=0.5)
    ref = _grads(x, ids, tw, wgu, wd, gy, torch.float32, False, chunk_rows=16)
    gu_p, d_p = _hf_storage(wgu, wd, torch.float32)
    llep_moe(x.float(), ids, tw.float(), gu_p.transpose(1, 2), d_p.transpose(1, 2), chunk_rows=16).backward(
        gy.float())
    assert gu_p.grad.is_contiguous() and d_p.grad.is_contiguous()
    assert torch.equal(gu_p.grad, ref[3].transpose(1, 2)) and torch.equal(d_p.grad, ref[4].transpose(1, 2))


class _NewAllocations(TorchDispatchMode):
    """Records (op, shape, strides) of every op output of at least `numel`
    elements that is new memory (shares no storage with the op's inputs): a
    copy of a weight (clone, contiguous, _to_copy, a GEMM into a fresh buffer)
    shows up here, a view or an in-place write does not."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.big = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel and \
                    t.untyped_storage().data_ptr() not in ins:
                self.big.append((str(func), tuple(t.shape), t.stride()))
        return out


@pytest.mark.parametrize("grouped", [False, True])
def test_hf_layout_makes_no_weight_copy(grouped):
    """With HF's views, nothing weight-sized is allocated in forward, and in
    backward only the two weight gradients, in the weights' strides: both at
    the op boundary (llep_moe and autograd, so a .contiguous() there is
    caught) and inside the op's schedule (llep_sched.forward/backward). T and
    C are small, so every other tensor is smaller than one weight."""
    if grouped and not _cpu_grouped_mm():
        pytest.skip("torch has no CPU _grouped_mm here")
    dt = torch.bfloat16
    x, ids, tw, wgu, wd, gy = _problem(24, 16, 24, 8, 3, torch.float64, seed=7, frac=0.5)
    x, tw, gy = x.to(dt), tw.float(), gy.to(dt)
    gu_p, d_p = _hf_storage(wgu, wd, dt)
    gu, d = gu_p.transpose(1, 2), d_p.transpose(1, 2)
    small = min(gu.numel(), d.numel())
    assert max(x.numel(), 16 * 2 * 24) < small                     # [T, H] and [C, 2I] are smaller
    mode = "on" if grouped else "off"
    with _NewAllocations(small) as fwd:
        y = llep_moe(x, ids, tw, gu, d, chunk_rows=16, save_budget_mb=0, grouped_mm=mode)
    with _NewAllocations(small) as bwd:
        y.backward(gy)
    assert not fwd.big, f"forward allocated weight-sized tensors: {fwd.big}"
    assert len(bwd.big) == 2 and all("llep_dispatch_backward" in f for f, _, _ in bwd.big), bwd.big
    assert sorted(s for _, _, s in bwd.big) == sorted([gu.stride(), d.stride()]), bwd.big

    # inside the op: the schedule's own ops
    ctx_args = (x, ids, tw, (gu.detach(), d.detach(), None), (None, None), "swiglu", None,
                LLEPOptions(chunk_rows=16, grouped_mm=mode))
    with _NewAllocations(small) as inner_fwd:
        llep_sched.forward(Ctx(*ctx_args))
    with _NewAllocations(small) as inner_bwd:
        _, _, (dgu, dd, _), _, _ = llep_sched.backward(Ctx(*ctx_args), gy)
    assert not inner_fwd.big, f"the forward schedule allocated weight-sized tensors: {inner_fwd.big}"
    assert len(inner_bwd.big) == 2, f"the backward schedule allocated more than the two dW: {inner_bwd.big}"
    assert dgu.stride() == gu.stride() and dd.stride() == d.stride()
