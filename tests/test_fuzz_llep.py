"""Fuzz: PipelinedLLEP on one process (CPU).

- the planner, chunk count and chunk layout (moepeak.llep.plan) equal the
  plain-Python references in tests/refs.py exactly, over random and skewed
  loads, prime rank / expert counts, every alpha / min_tokens / lam;
- moepeak.llep_moe equals the dense fp64 reference (refs.moe_dense_ref) in
  its output and every gradient, over prime T / E / K / H / I, uniform and
  skewed routing, chunk sizes from 1 row up.

Example counts: tests/conftest.py's hypothesis profile (MOEPEAK_FUZZ_EXAMPLES).
"""
import pytest
import torch

import moepeak
from moepeak.llep import plan as lp
from tests import refs

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402


@st.composite
def loads(draw):
    P = draw(st.sampled_from([1, 2, 3, 4, 5, 7]))
    E = P * draw(st.sampled_from([1, 2, 3, 5]))
    big = draw(st.sampled_from([0, 1, 10, 1000, 2**40]))
    skew = draw(st.booleans())
    load = []
    for _ in range(P):
        row = draw(st.lists(st.integers(0, big), min_size=E, max_size=E))
        if skew:  # one hot expert per rank gets most rows
            row[draw(st.integers(0, E - 1))] += big * E
        load.append(row)
    return load


# alpha = inf (no capacity bound) is valid for the op, but refs.llep_plan_ref's exact
# integer ceil cannot take it; the C clamps the capacity at 9e18 rows.
@given(loads(), st.sampled_from([1.0, 1.1, 1.5, 2.0, 1e6]), st.sampled_from([0, 1, 7, 1024]),
       st.sampled_from([1.0, 1.3, 2.0, float("inf")]))
def test_plan_matches_reference_exactly(load, alpha, m, lam):
    plan = lp.llep_plan(torch.tensor(load, dtype=torch.int64), alpha, m, lam)
    Q, A, S, spilled = refs.llep_plan_ref(load, alpha, m, lam)
    assert plan.Q.tolist() == Q and plan.A.tolist() == A and plan.S.tolist() == S
    assert plan.spilled == spilled
    t = torch.tensor(load, dtype=torch.int64)
    assert plan.A.sum(2).T.tolist() == t.tolist()  # every source row sent exactly once


@given(loads(), st.integers(0, 2**20), st.data())
def test_chunk_layout_matches_reference_exactly(load, extra_rows, data):
    load = [[v % 5000 for v in row] for row in load]  # the layout materialises perm [chunk_rows]
    plan = lp.llep_plan(torch.tensor(load, dtype=torch.int64), 1.0, 4, 1.3)
    P = len(load)
    C = P + extra_rows % 4096
    n = lp.num_chunks(plan.S, C)
    assert n == refs.llep_num_chunks_ref(plan.S.tolist(), C)
    if n == 0:
        return
    r = data.draw(st.integers(0, P - 1))
    j = data.draw(st.integers(0, n - 1))
    lay = lp.chunk_layout(plan, r, n, j, C)
    ss, sl, rl, perm, ec = refs.llep_chunk_layout_ref(plan.A.tolist(), plan.S.tolist(), r, n, j)
    assert (lay.send_start, lay.send_len, lay.recv_len, lay.perm.tolist(), lay.ecount) == (ss, sl, rl, perm, ec)
    assert lay.rows <= C


@st.composite
def moe_problems(draw):
    T = draw(st.sampled_from([1, 2, 3, 5, 7, 13, 31]))
    E = draw(st.sampled_from([1, 2, 3, 5, 7]))
    K = draw(st.integers(1, E))
    return dict(T=T, E=E, K=K, H=draw(st.sampled_from([1, 2, 3, 5, 8])), I=draw(st.sampled_from([1, 2, 3, 7])),
                frac=draw(st.sampled_from([0.0, 0.5, 1.0])), chunk_rows=draw(st.sampled_from([None, 1, 2, 3, 17])),
                min_tokens=draw(st.sampled_from([0, 1, 1024])), seed=draw(st.integers(0, 2**16)))


def _moe(p, ours):
    g = torch.Generator().manual_seed(p["seed"])
    T, E, K, H, I = p["T"], p["E"], p["K"], p["H"], p["I"]
    x = torch.randn(T, H, generator=g)
    wgu = torch.randn(E, H, 2 * I, generator=g) / H ** 0.5
    wd = torch.randn(E, I, H, generator=g) / I ** 0.5
    ids = refs.skewed_topk_ids(T, E, K, p["frac"], generator=g, hot=min(4, E))
    tw = torch.rand(T, K, generator=g)
    gy = torch.randn(T, H, generator=g)
    dt = torch.float32 if ours else torch.float64
    leaves = [t.to(dt).requires_grad_(True) for t in (x, tw, wgu, wd)]
    if ours:
        y = moepeak.llep_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], chunk_rows=p["chunk_rows"],
                             min_tokens_per_gemm=p["min_tokens"])
    else:
        y = refs.moe_dense_ref(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    grads = torch.autograd.grad((y * gy.to(dt)).sum(), leaves)
    return [y.detach()] + list(grads)


@given(moe_problems())
def test_llep_moe_matches_dense_fp64_reference(p):
    got, want = _moe(p, True), _moe(p, False)
    for name, a, b in zip(("y", "dx", "d_topk_weights", "dw_gate_up", "dw_down"), got, want):
        assert a.shape == b.shape, name
        diff = (a.double() - b).abs()
        tol = 1e-5 + 1e-4 * b.abs()
        assert bool((diff <= tol).all()), f"{name}: max diff {diff.max().item():.3g}, mean {diff.mean().item():.3g}"


# ---------------------------------------------------------------------------
# Issue 23's LLEP item: one NaN routing weight leaves the other gradients as the dense
# reference has them.
# ---------------------------------------------------------------------------
def test_nan_routing_weight_keeps_other_gradients_finite():
    g = torch.Generator().manual_seed(0)
    T, E, K, H, I = 5, 3, 2, 4, 3
    x, gy = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    wgu, wd = torch.randn(E, H, 2 * I, generator=g), torch.randn(E, I, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    tw = torch.rand(T, K, generator=g)
    tw[2, 1] = float("nan")
    grads = []
    for fn, dt in ((moepeak.llep_moe, torch.float32), (refs.moe_dense_ref, torch.float64)):
        w = tw.to(dt).requires_grad_(True)
        y = fn(x.to(dt), ids, w, wgu.to(dt), wd.to(dt))
        (dw,) = torch.autograd.grad((y * gy.to(dt)).sum(), w)  # d(tw)[t, k] = <gy[t], o_k(x_t)>: finite
        grads.append(dw)
    got, want = grads
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
    assert torch.allclose(got.double().nan_to_num(0.0), want.nan_to_num(0.0), rtol=1e-4, atol=1e-5)
