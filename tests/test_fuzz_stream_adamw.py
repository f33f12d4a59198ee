"""Fuzz: moepeak.StreamAdamW against torch.optim.AdamW(fused=True), bitwise,
over parameter sets (sizes around the SIMD widths and buckets, several
groups), hyperparameters, steps with missing gradients, zero / huge / tiny
gradients, and state_dict round trips in the middle of training (into a new
StreamAdamW, and from torch's AdamW).

Example counts: tests/conftest.py's hypothesis profile (MOEPEAK_FUZZ_EXAMPLES).
"""
import copy

import pytest
import torch

import moepeak

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402

SIZES = [1, 2, 7, 8, 15, 16, 17, 31, 33, 64, 255, 1000, 4099]


@st.composite
def runs(draw):
    n_params = draw(st.integers(1, 4))
    return dict(
        sizes=[draw(st.sampled_from(SIZES)) for _ in range(n_params)],
        lr=draw(st.sampled_from([1e-3, 1e-2, 0.5])), b1=draw(st.sampled_from([0.0, 0.9, 0.99])),
        b2=draw(st.sampled_from([0.0, 0.5, 0.999])), eps=draw(st.sampled_from([1e-8, 1e-3])),
        wd=draw(st.sampled_from([0.0, 1e-2, 0.3])), two_groups=draw(st.booleans()),
        steps=draw(st.integers(1, 4)), reload_at=draw(st.sampled_from([None, 0, 1, 2])),
        reload_from_torch=draw(st.booleans()),
        grad_scale=draw(st.sampled_from([0.0, 1e-30, 1.0, 1e20])),
        missing=draw(st.lists(st.booleans(), min_size=16, max_size=16)), seed=draw(st.integers(0, 2**16)),
    )


def _same(a, b):
    """Bitwise equal values, NaN where the other has NaN (huge gradients overflow g*g in both)."""
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _groups(params, p):
    if p["two_groups"] and len(params) > 1:
        return [{"params": params[:1]}, {"params": params[1:], "lr": p["lr"] / 3, "weight_decay": 0.0}]
    return [{"params": params}]


@given(runs())
def test_stream_adamw_bitwise_vs_torch_fused(p):
    g = torch.Generator().manual_seed(p["seed"])
    init = [torch.randn(n, generator=g) for n in p["sizes"]]
    ta = [t.clone().requires_grad_(True) for t in init]
    ma = [t.clone().requires_grad_(True) for t in init]
    hyper = dict(lr=p["lr"], betas=(p["b1"], p["b2"]), eps=p["eps"], weight_decay=p["wd"])
    ref = torch.optim.AdamW(_groups(ta, p), fused=True, **hyper)
    ours = moepeak.StreamAdamW(_groups(ma, p), **hyper)
    k = 0
    for step in range(p["steps"]):
        if step == p["reload_at"]:
            state = copy.deepcopy((ref if p["reload_from_torch"] else ours).state_dict())
            ours = moepeak.StreamAdamW(_groups(ma, p), **hyper)
            ours.load_state_dict(state)
        for a, b in zip(ta, ma):
            skip = p["missing"][k % len(p["missing"])] and step > 0
            k += 1
            if skip:  # this parameter has no gradient this step
                a.grad = b.grad = None
                continue
            grad = torch.randn(a.shape, generator=g) * p["grad_scale"]
            a.grad, b.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
        for i, (a, b) in enumerate(zip(ta, ma)):
            assert _same(a, b), f"step {step} param {i}: max diff {(a - b).abs().max().item()}"
    for a, b in zip(ta, ma):
        if a not in ref.state:
            assert b not in ours.state or not ours.state[b]
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            assert _same(ref.state[a][key], ours.state[b][key]), key
        assert float(ref.state[a]["step"]) == float(ours.state[b]["step"])


@given(runs())
def test_stream_adamw_bf16_state_vs_fused_then_rounding(p):
    """state_dtype=torch.bfloat16: each step is torch's fused AdamW on the widened state, then
    the kernel's stochastic rounding (tests/refs.py) keyed by rounding_seed + the param's
    index and its own step; a state_dict reload mid-run (into an optimizer with another
    rounding_seed) changes no bit."""
    from refs import adamw_fused_step_ref, sr_expected

    g = torch.Generator().manual_seed(p["seed"])
    params = [torch.randn(n, generator=g).requires_grad_(True) for n in p["sizes"]]
    hyper = dict(lr=p["lr"], betas=(p["b1"], p["b2"]), eps=p["eps"], weight_decay=p["wd"])
    kw = dict(state_dtype=torch.bfloat16, **hyper)
    ours = moepeak.StreamAdamW(_groups(params, p), rounding_seed=p["seed"], **kw)
    group_of = [group for group in ours.param_groups for _ in group["params"]]
    ref = [dict(master=t.detach().clone(), m=torch.zeros(t.shape, dtype=torch.bfloat16),
                v=torch.zeros(t.shape, dtype=torch.bfloat16), step=0) for t in params]
    k = 0
    for step in range(p["steps"]):
        if step == p["reload_at"]:
            state = copy.deepcopy(ours.state_dict())
            ours = moepeak.StreamAdamW(_groups(params, p), rounding_seed=p["seed"] + 1, **kw)
            ours.load_state_dict(state)
        grads = []
        for t in params:
            skip = p["missing"][k % len(p["missing"])] and step > 0
            k += 1
            t.grad = None if skip else torch.randn(t.shape, generator=g) * p["grad_scale"]
            grads.append(t.grad)
        ours.step()
        for i, (r, grad) in enumerate(zip(ref, grads)):
            if grad is None:
                continue
            r["step"] += 1
            grp = group_of[i]
            out = adamw_fused_step_ref(r["master"], r["m"].float(), r["v"].float(), None, grad, r["step"],
                                       lr=grp["lr"], betas=grp["betas"], eps=grp["eps"], wd=grp["weight_decay"])
            r["master"] = out[0]
            r["m"], r["v"], _ = sr_expected(out[1], out[2], None, p["seed"] + i, r["step"])
            assert _same(params[i].detach(), r["master"]), f"step {step} param {i}"
    for i, (t, r) in enumerate(zip(params, ref)):
        if r["step"] == 0:
            continue
        for key, want in (("exp_avg", r["m"]), ("exp_avg_sq", r["v"])):
            assert ours.state[t][key].dtype == torch.bfloat16
            assert _same(ours.state[t][key].float(), want.float()), f"param {i} {key}"
