"""PipelinedLLEP on one process (CPU): the C planner and chunk layout against
the plain-Python references, the kernels, the single-rank chunked layer
against the dense reference (fp64 ground truth), the working-set accounting,
bad input and opcheck. Multi-rank tests are in test_llep_dist.py."""
import random
import re

import pytest
import torch

import moepeak
from moepeak.llep import LLEPStats, llep_moe
from moepeak.llep import plan as lp
from moepeak.llep import sizes
from moepeak.llep.ops import llep_combine_, llep_dispatch
from tests import refs


# ---------------------------------------------------------------------------
# planner and layout
# ---------------------------------------------------------------------------
def _check_plan(load, alpha, m, lam):
    t = torch.tensor(load, dtype=torch.int64)
    plan = lp.llep_plan(t, alpha, m, lam)
    Q, A, S, spilled = refs.llep_plan_ref(load, alpha, m, lam)
    assert plan.Q.tolist() == Q and plan.A.tolist() == A and plan.S.tolist() == S, (load, alpha, m, lam)
    assert plan.spilled == spilled
    P, E = t.shape
    assert plan.Q.sum(1).tolist() == t.sum(0).tolist()              # every row planned once
    assert plan.A.sum(2).T.tolist() == t.tolist()                    # every src row sent once
    assert plan.A.sum(1).tolist() == plan.Q.tolist()
    return plan


def _random_loads(rng, P, E, T):
    load = []
    for _ in range(P):
        w = [rng.random() ** 4 for _ in range(E)]
        tot = sum(w)
        load.append([int(T * x / tot) for x in w])
    return load


def test_plan_random_matches_reference():
    rng = random.Random(0)
    for _ in range(300):
        P = rng.choice([1, 2, 3, 4, 8])
        E = P * rng.choice([1, 2, 3, 8])
        load = _random_loads(rng, P, E, rng.choice([0, 5, 100, 5000]))
        _check_plan(load, rng.choice([1.0, 1.1, 1.5]), rng.choice([0, 1, 16, 1024]), rng.choice([1.0, 1.3, 2.0]))


def test_plan_adversarial():
    # all tokens of every rank to one expert
    for P in (2, 3, 4):
        E = 4 * P
        load = [[0] * E for _ in range(P)]
        for s in range(P):
            load[s][1] = 1000
        plan = _check_plan(load, 1.0, 16, 1.3)
        assert plan.spilled
        assert max(plan.Q.sum(0).tolist()) <= -(-P * 1000 // P)     # capacity respected here
    # empty experts, T = 0 on some ranks, everything zero
    _check_plan([[0, 0, 50, 0], [0, 0, 0, 0]], 1.0, 4, 1.3)
    _check_plan([[0] * 6 for _ in range(3)], 1.0, 4, 1.3)
    # the C file's worked example: small experts stay home, one expert moves
    plan = _check_plan([[900, 50, 30, 20], [0, 0, 0, 0]], 1.0, 100, 1.3)
    assert plan.Q.tolist() == [[450, 450], [50, 0], [0, 30], [0, 20]]
    # a residual below m never leaves its owner (worth neither a GEMM nor a weight transfer)
    plan = _check_plan([[10, 0, 0, 0], [0, 0, 0, 0]], 1.0, 1024, 1.3)
    assert plan.Q.tolist() == [[10, 0], [0, 0], [0, 0], [0, 0]] and not plan.spilled
    # residuals >= m go to the least-assigned helper; one below m stays with its owner
    plan = _check_plan([[0, 0, 0, 0, 0, 0], [300, 0, 0, 0, 0, 0], [0, 0, 0, 0, 290, 0]], 1.0, 100, 1.3)
    assert plan.Q.tolist()[0] == [197, 103, 0]


def test_plan_moves_only_hot_experts():
    """95:4-style routing on 2 ranks, 64 experts each, every cold expert above
    m: only hot experts move (their weights travel), never the cold ones."""
    P, E = 2, 128
    for hot_share, cold in ((0.95, 30), (0.5, 1500), (0.8, 2000)):
        load = [[0] * E for _ in range(P)]
        for s in range(P):
            for e in range(E):
                load[s][e] = cold
            for e in range(4):
                load[s][e] = int(hot_share * cold * E / (1 - hot_share) / 4)
        plan = _check_plan(load, 1.0, 1024, 1.3)
        assert plan.spilled
        moved = [e for e in range(E) if int(plan.Q[e].sum()) != int(plan.Q[e, e // (E // P)])]
        assert 1 <= len(moved) <= 4 and all(e < 4 for e in moved), (hot_share, moved)
        assert max(plan.Q.sum(0).tolist()) - min(plan.Q.sum(0).tolist()) <= 1024 + 2 * cold
    # below the imbalance threshold nothing moves
    plan = _check_plan([[100, 100], [100, 120]], 1.0, 1, 1.3)
    assert not plan.spilled


def test_plan_refuses_indivisible_experts():
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        lp.llep_plan(torch.zeros(3, 8, dtype=torch.int64), 1.0, 1, 1.3)


def test_chunk_layout_matches_reference():
    rng = random.Random(1)
    for _ in range(60):
        P = rng.choice([1, 2, 3, 4])
        E = P * rng.choice([1, 2, 4])
        load = _random_loads(rng, P, E, rng.choice([0, 7, 300]))
        plan = lp.llep_plan(torch.tensor(load, dtype=torch.int64), 1.0, rng.choice([1, 8]), 1.3)
        C = rng.choice([P, P + 1, 16, 1000])
        n = lp.num_chunks(plan.S, C)
        assert n == refs.llep_num_chunks_ref(plan.S.tolist(), C)
        for r in range(P):
            total_recv = 0
            for j in range(n):
                lay = lp.chunk_layout(plan, r, n, j, C)
                ss, sl, rl, perm, ec = refs.llep_chunk_layout_ref(plan.A.tolist(), plan.S.tolist(), r, n, j)
                assert (lay.send_start, lay.send_len, lay.recv_len, lay.perm.tolist(), lay.ecount) == \
                    (ss, sl, rl, perm, ec)
                assert lay.rows <= C and sum(lay.send_len) <= C
                bare = lp.chunk_layout(plan, r, n, j, C, with_perm=False)  # everything but the permutation
                assert bare.perm is None
                assert (bare.send_start, bare.send_len, bare.recv_len, bare.ecount, bare.rows) == \
                    (ss, sl, rl, ec, lay.rows)
                if P == 1:  # one rank: the grouped order is the receive order, no permutation needed
                    assert perm == list(range(lay.rows))
                total_recv += lay.rows
            assert total_recv == int(plan.S[:, r].sum())


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------
def test_count_route_gather_combine_cpu():
    g = torch.Generator().manual_seed(2)
    T, K, E, H = 29, 3, 6, 5
    ids = torch.randint(0, E, (T, K), generator=g)
    cnt = lp.count(ids.flatten(), E)
    assert cnt[:E].tolist() == torch.bincount(ids.flatten(), minlength=E).tolist() and cnt[E] == 0
    bad = ids.clone().flatten()
    bad[3], bad[7] = -1, E
    assert int(lp.count(bad, E)[E]) == 2
    # route on a 2-rank plan, rank 0's view
    load = torch.stack([cnt[:E], torch.randint(0, 40, (E,), generator=g)])
    plan = lp.llep_plan(load, 1.0, 1, 1.0)
    out = lp.route(ids.flatten(), E, plan, 0, cnt[:E])
    expect = []
    for d in range(2):
        for e in range(E):
            rows = (ids.flatten() == e).nonzero().flatten().tolist()
            lo = int(plan.A[e, 0, :d].sum())
            expect += rows[lo:lo + int(plan.A[e, 0, d])]
    assert out.tolist() == expect
    x = torch.randn(T, H, generator=g)
    buf = torch.empty(T * K, H)
    assert torch.equal(lp.gather_rows(x, out, K, buf), x[out // K])
    w = torch.rand(T * K, generator=g)
    y = torch.randn(T * K, H, generator=g)
    acc = torch.zeros(T, H)
    llep_combine_(acc, y, out, w, K)
    ref = torch.zeros(T, H, dtype=torch.float64).index_add(0, out // K, (w[out, None] * y).double())
    torch.testing.assert_close(acc.double(), ref, rtol=1e-6, atol=1e-6)
    for dt in (torch.bfloat16, torch.float16):
        acc = torch.zeros(T, H)
        llep_combine_(acc, y.to(dt), out, None, K)
        ref = torch.zeros(T, H).index_add(0, out // K, y.to(dt).float())
        torch.testing.assert_close(acc, ref, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# single-rank layer vs dense
# ---------------------------------------------------------------------------
def _problem(T, H, I, E, K, dtype, seed=0, frac=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    wgu = torch.randn(E, H, 2 * I, generator=g, dtype=torch.float64) / H ** 0.5
    wd = torch.randn(E, I, H, generator=g, dtype=torch.float64) / I ** 0.5
    ids = refs.skewed_topk_ids(T, E, K, frac, generator=g)
    tw = torch.rand(T, K, generator=g, dtype=torch.float64)
    gy = torch.randn(T, H, generator=g, dtype=torch.float64)
    return x, ids, tw, wgu, wd, gy


def _dense_grads(x, ids, tw, wgu, wd, gy):
    leaves = [t.clone().requires_grad_() for t in (x, tw, wgu, wd)]
    y = refs.moe_dense_ref(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    return (y.detach(),) + torch.autograd.grad(y, leaves, gy)


def _op_grads(x, ids, tw, wgu, wd, gy, dtype, **kw):
    leaves = [x.to(dtype).requires_grad_(), tw.float().requires_grad_(), wgu.to(dtype).requires_grad_(),
              wd.to(dtype).requires_grad_()]
    y = llep_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], **kw)
    return (y.detach(),) + torch.autograd.grad(y, leaves, gy.to(dtype))


NAMES = ("y", "dx", "dtopk_weights", "dw_gate_up", "dw_down")


def _assert_close_all(got, ref, rtol, atol):
    for name, a, b in zip(NAMES, got, ref):
        err = (a.double() - b.double()).abs()
        assert torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol), \
            f"{name}: max diff {err.max().item():.3g}, mean {err.mean().item():.3g}"


@pytest.mark.parametrize("T,C", [(1, 4), (37, 5), (64, 64), (50, 10000)])
@pytest.mark.parametrize("frac", [0.0, 0.95])
def test_single_rank_fp32_vs_dense(T, C, frac):
    prob = _problem(T, 16, 24, 8, 3, torch.float32, seed=T, frac=frac)
    ref = _dense_grads(*prob)
    st = LLEPStats()
    got = _op_grads(*prob, torch.float32, chunk_rows=C, stats=st)
    _assert_close_all(got, ref, 1e-5, 1e-5)
    assert st.forward["max_rows"] <= C and st.backward["max_rows"] <= C


def test_one_chunk_equals_many_chunks():
    prob = _problem(61, 8, 12, 4, 2, torch.float32, seed=5, frac=0.5)
    st = LLEPStats()
    one = _op_grads(*prob, torch.float32, chunk_rows=1 << 20, stats=st)
    assert st.forward["n_chunks"] == st.backward["n_chunks"] == 1
    many = _op_grads(*prob, torch.float32, chunk_rows=3, stats=st)
    assert st.forward["n_chunks"] == st.backward["n_chunks"] == 41
    _assert_close_all(many, one, 1e-6, 1e-6)


@pytest.mark.parametrize("frac", [0.0, 0.3, 0.95])
def test_single_rank_bf16_tolerance_rule(frac):
    """bf16 error vs fp64 at most 2x PyTorch's own bf16 dense error (+ a tiny
    slack for an all-zero reference error); many chunks, so dW is rounded
    into its bf16 accumulator several times."""
    prob = _problem(45, 32, 32, 4, 2, torch.bfloat16, seed=3, frac=frac)
    truth = _dense_grads(*prob)
    torch_bf16 = _dense_grads(*[t.to(torch.bfloat16) if t.is_floating_point() else t for t in prob])
    got = _op_grads(*prob, torch.bfloat16, chunk_rows=16)
    for name, a, b, t in zip(NAMES, got, torch_bf16, truth):
        ea = (a.double() - t).abs().max().item()
        eb = (b.double() - t).abs().max().item()
        assert ea <= 2 * eb + 1e-4 * t.abs().max().item(), f"{name}: op err {ea:.3g} vs torch bf16 err {eb:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_tiny_and_negative_pick_weights(dtype):
    """Backward gets d(pick weight) = <dy W_down^T, a> from the GEMM that makes
    da (dividing by w): rows whose weight is 0, tiny (< 2^-24) or negative
    must still get <dy, o> exactly, and their da / dW_down contributions w-scaled."""
    prob = list(_problem(40, 16, 24, 4, 3, dtype, seed=21, frac=0.3))
    tw = prob[2].clone()
    tw[::7, 0] = 0.0
    tw[1::7, 1] = 1e-30
    tw[2::7, 2] = -0.7
    tw[3::7, 0] = 3e-8
    prob[2] = tw
    truth = _dense_grads(*prob)
    if dtype == torch.float32:
        _assert_close_all(_op_grads(*prob, dtype, chunk_rows=16), truth, 1e-5, 1e-5)
        return
    ref = _dense_grads(*[t.to(dtype) if t.is_floating_point() else t for t in prob])
    got = _op_grads(*prob, dtype, chunk_rows=16)
    for name, a, b, t in zip(NAMES, got, ref, truth):
        # norm-wise: the weights' wide range makes single-element maxima noisy
        # (the max-abs ratio reaches 2.2x here with the o-recompute backward too)
        ea = (a.double() - t).norm().item()
        eb = (b.double() - t).norm().item()
        assert ea <= 2 * eb + 1e-4 * t.norm().item(), f"{name}: op err {ea:.3g} vs torch err {eb:.3g}"
    # rows with a zero weight: d(weight) is <dy, o>, not 0
    dtw = got[2]
    assert dtw[::7, 0].abs().min() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_down_bwd_kernel_cpu(dtype):
    g = torch.Generator().manual_seed(4)
    rows, I = 37, 29
    D = torch.randn(rows, I, generator=g).to(dtype)
    a = torch.randn(rows, I, generator=g).to(dtype)
    w = torch.rand(rows, generator=g)
    w[3], w[5] = 0.0, 1e-30
    wp = w.clone().masked_fill_(w.abs() < 2.0 ** -24, 1.0)
    dwr = torch.full((rows + 3,), 7.0)
    D2, a2 = D.clone(), a.clone()
    lp.down_bwd(D2, a2, w, wp, dwr)
    ref = (D.double() * a.double()).sum(1) / wp.double()
    torch.testing.assert_close(dwr[:rows].double(), ref, rtol=1e-5, atol=1e-5)
    assert (dwr[rows:] == 7.0).all()                                   # nothing past rows written
    sc = (w / wp)[:, None]
    assert torch.equal(D2, (sc * D.float()).to(dtype)) and torch.equal(a2, (sc * a.float()).to(dtype))
    keep = (w == wp)
    assert torch.equal(D2[keep], D[keep]) and torch.equal(a2[keep], a[keep])  # factor-1 rows untouched


def test_down_bwd_bad_input():
    """Checked before any pointer reaches C; nothing is written on refusal."""
    D, a = torch.randn(5, 3), torch.randn(5, 3)
    w, dwr = torch.rand(5), torch.full((5,), 7.0)
    D0, a0 = D.clone(), a.clone()
    cases = [
        ((D.double(), a, w, w, dwr), TypeError, "D must have dtype"),
        ((D, a.bfloat16(), w, w, dwr), TypeError, "a must have dtype"),
        ((D, a[:4], w, w, dwr), ValueError, "a must have D's shape"),
        ((D.t(), a.t(), w, w, dwr), ValueError, "D must be contiguous"),
        ((D, a, w[:4], w, dwr), ValueError, "w must hold at least rows=5"),
        ((D, a, w, w.double(), dwr), TypeError, "wp must have dtype"),
        ((D, a, w, w, dwr[:3]), ValueError, "dwr must hold at least rows=5"),
        ((D, a, w, w, dwr.view(5, 1)), ValueError, "dwr must be 1-D"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            lp.down_bwd(*args)
    assert torch.equal(D, D0) and torch.equal(a, a0) and (dwr == 7.0).all()


def _cpu_grouped_mm() -> bool:
    try:
        a = torch.ones(16, 8, dtype=torch.bfloat16)
        torch._grouped_mm(a, torch.ones(2, 8, 8, dtype=torch.bfloat16), offs=torch.tensor([8, 16], dtype=torch.int32))
        torch._grouped_mm(a.t(), a, offs=torch.tensor([8, 16], dtype=torch.int32))
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _cpu_grouped_mm(), reason="torch has no CPU _grouped_mm here")
@pytest.mark.parametrize("C,frac", [(24, 0.0), (24, 0.95), (7, 0.5), (4096, 0.3)])
def test_grouped_path_vs_per_expert_cpu(C, frac):
    """The torch._grouped_mm path (forward, dX and the 2D x 2D weight
    gradients, with experts split across chunks going to addmm_) equals the
    per-expert-GEMM path and keeps the bf16 tolerance rule vs fp64; E = 16 and
    a small C so the grouped dW runs are capped at G = C // H experts."""
    prob = _problem(70, 16, 8, 16, 3, torch.bfloat16, seed=11, frac=frac)
    truth = _dense_grads(*prob)
    torch_bf16 = _dense_grads(*[t.to(torch.bfloat16) if t.is_floating_point() else t for t in prob])
    outs = []
    for grouped in (False, True):
        st = LLEPStats()
        outs.append(_op_grads(*prob, torch.bfloat16, chunk_rows=C, grouped_mm="on" if grouped else "auto", stats=st))
        for phase in (st.forward, st.backward):
            assert not phase["grouped_fallback"], phase  # no grouped GEMM raised and fell back
            assert (phase["grouped_mm"] > 0) == grouped, phase
        assert (st.backward["grouped_dw"] > 0) == grouped, st
    for name, a, b, ref, t in zip(NAMES, outs[1], outs[0], torch_bf16, truth):
        # the same roundings on both paths: equal up to GEMM summation order
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)
        ea = (a.double() - t).abs().max().item()
        eb = (ref.double() - t).abs().max().item()
        assert ea <= 2 * eb + 1e-4 * t.abs().max().item(), f"{name}: op err {ea:.3g} vs torch bf16 err {eb:.3g}"


def test_zero_tokens():
    prob = _problem(0, 8, 8, 4, 2, torch.float32)
    got = _op_grads(*prob, torch.float32, chunk_rows=8)
    assert got[0].shape == (0, 8) and got[3].abs().sum() == 0


def test_module_matches_reference_block():
    torch.manual_seed(0)
    m = moepeak.PipelinedLLEPMoE(16, 8, 8, 2, chunk_rows=7)
    x = torch.randn(2, 5, 16)
    y, logits = m(x)
    yr, lr = refs.moe_block_ref(x.reshape(-1, 16), m.router.weight, m.w_gate_up, m.w_down, 2)
    torch.testing.assert_close(y.reshape(-1, 16), yr, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, lr)
    y.square().sum().backward()
    assert m.router.weight.grad is not None and m.w_gate_up.grad is not None


# ---------------------------------------------------------------------------
# working set
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("frac", [0.0, 0.95])
def test_working_set_fixed_by_chunk_rows(frac):
    T, H, I, E, K, C = 90, 8, 12, 8, 4, 32
    prob = _problem(T, H, I, E, K, torch.float32, frac=frac)
    stats = LLEPStats()
    _op_grads(*prob, torch.float32, chunk_rows=C, stats=stats)
    st = {**stats.forward, **stats.backward}
    assert st["workspace_bytes"] == sizes.workspace_bytes(C, H, I, 1, 4, backward=False) == 4 * C * (2 * H + 3 * I)
    assert st["workspace_bytes_bwd"] == sizes.workspace_bytes(C, H, I, 1, 4, backward=True)
    assert st["max_rows"] <= C and st["n_chunks"] == -(-T * K // C)
    # with the activation cache (default budget: every chunk fits here)
    assert st["cache_bytes"] == 4 * C * 2 * I * st["n_chunks"] and st["recomputed_chunks"] == 0
    for bwd, key in ((False, "workspace_bytes"), (True, "workspace_bytes_bwd")):
        assert st[key] + st["cache_bytes"] <= sizes.working_set_bound(C, H, I, 1, 4, bwd, 1536 << 20)
    _op_grads(*prob, torch.float32, chunk_rows=C, save_budget_mb=1, stats=stats)
    st = {**stats.forward, **stats.backward}
    assert 0 < st["cache_bytes"] <= 1 << 20
    assert st["workspace_bytes_bwd"] + st["cache_bytes"] <= sizes.working_set_bound(C, H, I, 1, 4, True, 1 << 20)


# ---------------------------------------------------------------------------
# activation cache (forward keeps h, o of the first chunks; backward reuses)
# ---------------------------------------------------------------------------
def _slot_grads(x, ids, tw, wgu, wd, gy, dtype, C, slots, stats=None, grouped_mm="auto"):
    """Gradients through the op with an explicit cache slot count."""
    leaves = [x.to(dtype).requires_grad_(), tw.float().requires_grad_(), wgu.to(dtype).requires_grad_(),
              wd.to(dtype).requires_grad_()]
    y, cache = llep_dispatch(leaves[0], ids, leaves[1], leaves[2], leaves[3], "", C, 1.0, 1024, 1.3, slots,
                             grouped_mm=grouped_mm, stats=stats.key if stats is not None else "")[:2]
    assert tuple(cache.shape) == (slots, sizes.slot_elems(C, wd.shape[1]))
    assert not cache.requires_grad
    return (y.detach(),) + torch.autograd.grad(y, leaves, gy.to(dtype))


def test_backward_allocates_no_cache_sized_gradient():
    """Autograd must not materialize a zero gradient for the non-differentiable
    cache output (that would cost the cache's budget a second time): backward
    allocates nothing of the cache's size (it only reads it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numels = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.numels.append((str(func), t.numel()))
            return out

    x, ids, tw, wgu, wd, gy = _problem(64, 16, 8, 4, 2, torch.float64, seed=3)
    leaves = [x.float().requires_grad_(), tw.float().requires_grad_(), wgu.float().requires_grad_(),
              wd.float().requires_grad_()]
    y, cache = llep_dispatch(leaves[0], ids, leaves[1], leaves[2], leaves[3], "", 32, 1.0, 1024, 1.3, 4)[:2]
    assert cache.numel() > 0
    with _Sizes() as mode:
        torch.autograd.grad(y, leaves, gy.float())
    big = [(f, n) for f, n in mode.numels if n >= cache.numel()]
    assert not big, f"backward allocated cache-sized tensors: {big}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frac", [0.0, 0.95])
def test_cache_bitwise_equals_recompute(dtype, frac):
    """Cached chunks (none, some, all, more slots than chunks) give bitwise
    the same y, dx, d(topk_weights) and dW as recomputing every chunk."""
    T, C = 53, 16
    prob = _problem(T, 16, 24, 8, 3, torch.float64, seed=21, frac=frac)
    n = -(-T * 3 // C)
    st = LLEPStats()
    ref = _slot_grads(*prob, dtype, C, 0, st)
    assert st.forward["cached_chunks"] == 0 and st.backward["recomputed_chunks"] == n
    for slots in (1, n // 2, n, n + 3):
        got = _slot_grads(*prob, dtype, C, slots, st)
        assert st.forward["cached_chunks"] == min(slots, n), st
        assert st.backward["recomputed_chunks"] == n - min(slots, n), st
        for name, a, b in zip(NAMES, got, ref):
            assert torch.equal(a, b), f"{name} differs with {slots} cache slots"
    if dtype == torch.float32:
        _assert_close_all(got, _dense_grads(*prob), 1e-5, 1e-5)


@pytest.mark.skipif(not _cpu_grouped_mm(), reason="torch has no CPU _grouped_mm here")
def test_cache_bitwise_grouped_cpu():
    """The grouped path copies torch._grouped_mm's own outputs into the cache:
    still bitwise the recompute."""
    prob = _problem(70, 16, 8, 16, 3, torch.float64, seed=12, frac=0.5)
    st = LLEPStats()
    ref = _slot_grads(*prob, torch.bfloat16, 24, 0, grouped_mm="on")
    got = _slot_grads(*prob, torch.bfloat16, 24, 4, st, grouped_mm="on")
    assert st.forward["grouped_mm"] > 0 and st.backward["grouped_mm"] > 0
    for name, a, b in zip(NAMES, got, ref):
        assert torch.equal(a, b), name


def test_cache_slots_from_budget_not_routing():
    C, H, I, b = 32768, 2880, 2880, 2
    slot = b * C * 2 * I
    assert slot == 377487360  # 360 MiB
    assert sizes.cache_slots(1536 << 20, 16384, 4, C, I, 1, b) == 2  # its 2 chunks
    assert sizes.cache_slots(1536 << 20, 262144, 4, C, I, 1, b) == 4
    assert sizes.cache_slots(1536 << 20, 1000, 4, C, I, 1, b) == 1  # one chunk only
    assert sizes.cache_slots(1536 << 20, 262144, 4, C, I, 2, b) == 4
    assert sizes.cache_slots(0, 262144, 4, C, I, 1, b) == 0
    assert sizes.cache_slots(slot - 1, 262144, 4, C, I, 1, b) == 0
    # the cache a call allocates: the same under balanced and skewed routing,
    # and none without gradients
    T, H, I, E, K, C = 90, 8, 12, 8, 4, 32
    cache_bytes, st = [], LLEPStats()
    for frac in (0.0, 0.95):
        prob = _problem(T, H, I, E, K, torch.float32, frac=frac)
        _op_grads(*prob, torch.float32, chunk_rows=C, save_budget_mb=1, stats=st)
        cache_bytes.append(st.forward["cache_bytes"])
    assert cache_bytes[0] == cache_bytes[1] == 4 * C * 2 * I * sizes.cache_slots(1 << 20, T, K, C, I, 1, 4)
    assert cache_bytes[0] == 4 * C * 2 * I * 12  # ceil(360 / 32) chunks, all fit in 1 MiB
    with torch.no_grad():
        llep_moe(*[t.float() if t.is_floating_point() else t for t in prob[:5]], chunk_rows=C, stats=st)
    assert st.forward["cache_bytes"] == 0
    prob = _problem(T, H, I, E, K, torch.float32, frac=0.3)
    _op_grads(*prob, torch.float32, chunk_rows=C, save_budget_mb=0, stats=st)
    assert st.forward["cache_bytes"] == 0 and st.backward["recomputed_chunks"] == 12


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------
def test_bad_input():
    x, ids, tw, wgu, wd, _ = [t.float() if t.is_floating_point() else t for t in _problem(6, 8, 4, 4, 2, torch.float32)]
    with pytest.raises(ValueError, match="top_k"):
        llep_moe(x, torch.zeros(6, 5, dtype=torch.int64), torch.ones(6, 5), wgu, wd)
    with pytest.raises(ValueError, match="outside"):
        llep_moe(x, ids.masked_fill(ids == ids[0, 0], 4), tw, wgu, wd)
    with pytest.raises(ValueError, match="outside"):
        llep_moe(x, ids.masked_fill(ids == ids[0, 0], -1), tw, wgu, wd)
    with pytest.raises(ValueError, match="w_down"):
        llep_moe(x, ids, tw, wgu, wd[:, :3])
    with pytest.raises(ValueError, match="w_gate_up"):
        llep_moe(x, ids, tw, wgu[:, :7], wd)
    with pytest.raises(TypeError, match="w_gate_up"):
        llep_moe(x, ids, tw, wgu.double(), wd)
    with pytest.raises(ValueError, match="topk_ids"):
        llep_moe(x, ids[:5], tw[:5], wgu, wd)
    with pytest.raises(ValueError, match="chunk_rows"):
        llep_moe(x, ids, tw, wgu, wd, chunk_rows=0)
    with pytest.raises(ValueError, match="alpha"):
        llep_moe(x, ids, tw, wgu, wd, alpha=0.5)
    with pytest.raises(ValueError, match="save_budget_mb"):
        llep_moe(x, ids, tw, wgu, wd, save_budget_mb=-1)
    with pytest.raises(ValueError, match="save_slots"):
        llep_dispatch(x, ids, tw, wgu, wd, "", 6, 1.0, 1024, 1.3, -1)
    with pytest.raises(ValueError, match="one_chunk_rows"):
        llep_dispatch(x, ids, tw, wgu, wd, "", 6, 1.0, 1024, 1.3, 0, None, None, None, "swiglu", -1)
    with pytest.raises(ValueError, match="multiple"):
        lp.llep_plan(torch.zeros(4, 6, dtype=torch.int64), 1.0, 1, 1.3)
    with pytest.raises(ValueError, match="top_k"):
        moepeak.PipelinedLLEPMoE(8, 4, 4, 5)


def test_hidden_size_mismatch_names_x_and_both_shapes():
    """x's last dim against the experts' H: the module and llep_moe refuse a mismatch (a
    reshape to [-1, H] would mix tokens' features whenever the sizes divide)."""
    moe = moepeak.PipelinedLLEPMoE(32, 64, 8, 2)
    with pytest.raises(ValueError, match=re.escape("hidden_size=32) takes x [..., 32], got (2, 16, 48)")):
        moe(torch.randn(2, 16, 48))
    with pytest.raises(ValueError, match=re.escape("takes x [..., 32], got ()")):
        moe(torch.randn(()))
    x, ids, tw, wgu, wd, _ = [t.float() if t.is_floating_point() else t for t in _problem(6, 8, 4, 4, 2, torch.float32)]
    wide = torch.randn(3, 16)  # 48 elements: [6, 8] after a reshape
    with pytest.raises(ValueError, match=re.escape("x must be [..., H] with H = 8 (w_down [E_local, I, H] is "
                                                   "(4, 4, 8)), got (3, 16)")):
        llep_moe(wide, ids, tw, wgu, wd)
    with pytest.raises(ValueError, match=re.escape("x must be [..., H] with H = 8")):
        llep_moe(torch.randn(()), ids, tw, wgu, wd)
    with pytest.raises(ValueError, match=re.escape("topk_ids and topk_weights must both be [T=6, K], got (6, 2) "
                                                   "and (6, 1)")):
        llep_moe(x, ids, tw[:, :1], wgu, wd)


# ---------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------
def test_opcheck():
    problem = _problem(11, 8, 4, 4, 2, torch.float32)
    x, ids, tw, wgu, wd, _ = [t.float() if t.is_floating_point() else t for t in problem]
    args = (x.requires_grad_(), ids, tw.requires_grad_(), wgu.requires_grad_(), wd.requires_grad_(), "", 6, 1.0,
            1024, 1.3)
    torch.library.opcheck(llep_dispatch, args)
    torch.library.opcheck(llep_dispatch, args + (3,))  # with an activation cache (4 chunks, 3 slots)
    # keep_one_chunk: the fake's cache has data-dependent sizes (the kept one-chunk step's, at P > 1)
    torch.library.opcheck(llep_dispatch, args + (2, None, None, None, "swiglu", 0, True))
    acc = torch.zeros(11, 8)
    idx = torch.randperm(22)[:15]
    torch.library.opcheck(llep_combine_, (acc, torch.randn(15, 8), idx, torch.rand(22), 2))
