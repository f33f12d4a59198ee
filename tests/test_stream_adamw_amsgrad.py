"""StreamAdamW amsgrad / maximize: bitwise vs torch.optim.AdamW(fused=True)
on every ISA (scalar, AVX2, AVX-512), through the CPU kernel and the bucket
pipeline, and state dicts (max_exp_avg_sq) interchangeable with torch's."""
import pytest
import torch

import moepeak
from moepeak import _C

BEST = _C.cpu_best_isa()
ISAS = [
    pytest.param(name, marks=pytest.mark.skipif(code > BEST, reason=f"this CPU lacks {name}"))
    for name, code in (("scalar", 0), ("avx2", 1), ("avx512", 2))
]
OPTIONS = [(True, False), (False, True), (True, True)]


def _grads(n, steps, seed):
    g = torch.Generator().manual_seed(seed)
    # alternate large and small grads so amsgrad's max keeps an older v
    return [torch.randn(n, generator=g) * (3.0 if i % 2 == 0 else 0.1) for i in range(steps)]


@pytest.mark.parametrize("host_pipeline", [False, True])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("amsgrad,maximize", OPTIONS)
@pytest.mark.parametrize("n", [17, 2**16 + 3])
def test_bitwise_vs_torch_fused(n, amsgrad, maximize, isa, host_pipeline):
    torch.manual_seed(n)
    p0 = torch.randn(n)
    a, b = p0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
    kw = dict(lr=1e-2, weight_decay=1e-2, amsgrad=amsgrad, maximize=maximize)
    ref = torch.optim.AdamW([a], fused=True, **kw)
    ours = moepeak.StreamAdamW([b], isa=isa, bucket_mb=0.05, _host_pipeline=host_pipeline, **kw)
    for g in _grads(n, 8, seed=n):
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    assert torch.equal(a.detach(), b.detach())
    for k in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
        assert torch.equal(ref.state[a][k], ours.state[b][k]), k
    assert ("max_exp_avg_sq" in ours.state[b]) == amsgrad


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_params_master_bitwise(isa):
    """bf16 params: the fp32 master is torch's fused AdamW on fp32 params."""
    torch.manual_seed(2)
    n = 4099
    lp = torch.randn(n).bfloat16().requires_grad_(True)
    ref_p = lp.detach().float().requires_grad_(True)
    kw = dict(lr=1e-2, amsgrad=True, maximize=True)
    ref = torch.optim.AdamW([ref_p], fused=True, **kw)
    ours = moepeak.StreamAdamW([lp], isa=isa, **kw)
    for g in _grads(n, 5, seed=3):
        lp.grad, ref_p.grad = g.bfloat16(), g.bfloat16().float()
        ref.step()
        ours.step()
    assert torch.equal(ours.state[lp]["master_param"], ref_p.detach())
    assert torch.equal(ours.state[lp]["max_exp_avg_sq"], ref.state[ref_p]["max_exp_avg_sq"])
    assert torch.equal(lp.detach(), ref_p.detach().bfloat16())


def test_state_dict_interchange_with_torch():
    torch.manual_seed(4)
    n = 300
    kw = dict(lr=1e-2, amsgrad=True, maximize=True)
    a, b = (torch.randn(n).requires_grad_(True) for _ in range(2))
    b.data.copy_(a.data)
    ref = torch.optim.AdamW([a], fused=True, **kw)
    ours = moepeak.StreamAdamW([b], **kw)
    gs = _grads(n, 6, seed=5)
    for g in gs[:3]:
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    sd = ours.state_dict()
    assert sd["param_groups"][0]["amsgrad"] is True and sd["param_groups"][0]["maximize"] is True
    assert torch.equal(sd["state"][0]["max_exp_avg_sq"], ref.state[a]["max_exp_avg_sq"])
    ref2 = torch.optim.AdamW([a], fused=True, **kw)
    ref2.load_state_dict(sd)
    ours2 = moepeak.StreamAdamW([b], **kw)
    ours2.load_state_dict(ref.state_dict())
    for g in gs[3:]:
        a.grad, b.grad = g.clone(), g.clone()
        ref2.step()
        ours2.step()
    assert torch.equal(a.detach(), b.detach())
    assert torch.equal(ref2.state[a]["max_exp_avg_sq"], ours2.state[b]["max_exp_avg_sq"])


def test_wrong_size_max_exp_avg_sq_raises():
    p = torch.randn(8, requires_grad=True)
    opt = moepeak.StreamAdamW([p], amsgrad=True)
    p.grad = torch.randn(8)
    opt.step()
    opt.state[p]["max_exp_avg_sq"] = torch.zeros(4)
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match="max_exp_avg_sq"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("amsgrad,maximize", OPTIONS + [(False, False)])
@pytest.mark.parametrize("n", [100, 2**12 + 5])
def test_nan_and_inf_grads_same_bits(n, amsgrad, maximize, isa):
    """±NaN / ±inf grads: the same bits as torch, NaN signs included (torch's
    vector body and scalar tail differ there; both are emulated)."""
    torch.manual_seed(7)
    p0 = torch.randn(n)
    a, b = p0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
    kw = dict(lr=1e-2, amsgrad=amsgrad, maximize=maximize)
    ref = torch.optim.AdamW([a], fused=True, **kw)
    ours = moepeak.StreamAdamW([b], isa=isa, **kw)
    bits = lambda t: t.detach().view(torch.int32)  # noqa: E731
    for step, g in enumerate(_grads(n, 4, seed=8)):
        for j, val in enumerate((float("nan"), -float("nan"), float("inf"), -float("inf"))):
            g[(7 * step + 13 * j) % n] = val
            g[n - 1 - j] = val  # the last elements: torch's scalar tail where it has one
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    assert torch.equal(bits(a), bits(b))
    for k in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
        assert torch.equal(bits(ref.state[a][k]), bits(ours.state[b][k])), k
