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
