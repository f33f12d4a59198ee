"""llep_moe's expert variants against dense plain-PyTorch references
(tests/refs.py): the GPT-OSS activation with biases, biases on SwiGLU,
gate/up as two separate weights, non-finite pick weights, and the P = 1
plan/cache rules (forward's plan reused by backward, the cache cap)."""
import pytest
import torch

from moepeak.llep import plan as lp
from moepeak.llep import LLEPStats, llep_moe
from moepeak.llep.sizes import cache_slots, capped_save_bytes, grouped_mm_saved_bytes, workspace_bytes

try:
    from tests import refs
    from tests.dist_utils import run_ranks
except ImportError:  # spawned ranks import with tests/ on sys.path
    import refs
    from dist_utils import run_ranks

GRAD_NAMES = ("y", "dx", "dtopk_weights", "dgate_up", "ddown", "dgate_up_bias", "ddown_bias")


def gpt_oss_problem(T, H, I, E, K, seed=0, frac=0.0, scale=3.0):
    """fp64 GPT-OSS problem; `scale` makes part of h leave [-7, 7] (clamped)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    gu = scale * torch.randn(E, H, 2 * I, generator=g, dtype=torch.float64) / H ** 0.5
    d = torch.randn(E, I, H, generator=g, dtype=torch.float64) / I ** 0.5
    bgu = torch.randn(E, 2 * I, generator=g, dtype=torch.float64)
    bd = torch.randn(E, H, generator=g, dtype=torch.float64)
    ids = refs.skewed_topk_ids(T, E, K, frac, generator=g)
    tw = torch.rand(T, K, generator=g, dtype=torch.float64)
    gy = torch.randn(T, H, generator=g, dtype=torch.float64)
    return x, ids, tw, gu, d, bgu, bd, gy


def ref_grads(x, ids, tw, gu, d, bgu, bd, gy, activation="gpt_oss"):
    leaves = [t.clone().requires_grad_() for t in (x, tw, gu, d, bgu, bd)]
    if activation == "gpt_oss":
        y = refs.moe_gpt_oss_ref(leaves[0], ids, *leaves[1:])
    else:
        y = _swiglu_bias_ref(leaves[0], ids, *leaves[1:])
    return (y.detach(),) + torch.autograd.grad(y, leaves, gy)


def _swiglu_bias_ref(x, ids, tw, gu, d, bgu, bd):
    I = d.shape[1]
    y = torch.zeros_like(x)
    for e in range(gu.shape[0]):
        t, k = (ids == e).nonzero(as_tuple=True)
        h = x[t] @ gu[e] + bgu[e]
        o = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ d[e] + bd[e]
        y = y.index_add(0, t, tw[t, k].to(o.dtype).unsqueeze(1) * o)
    return y


def op_grads(x, ids, tw, gu, d, bgu, bd, gy, dtype, activation="gpt_oss", **kw):
    leaves = [x.to(dtype).requires_grad_(), tw.float().requires_grad_()] + \
        [t.to(dtype).requires_grad_() for t in (gu, d, bgu, bd)]
    y = llep_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], b_gate_up=leaves[4], b_down=leaves[5],
                 activation=activation, **kw)
    return (y.detach(),) + torch.autograd.grad(y, leaves, gy.to(dtype))


def assert_close_all(got, want, rtol, atol, names=GRAD_NAMES):
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        err = (a.double() - b.double()).abs()
        assert torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True), \
            f"{name}: max diff {err.nan_to_num().max().item():.3g}"


@pytest.mark.parametrize("C", [5, 16, 1 << 16])
@pytest.mark.parametrize("frac", [0.0, 0.95])
def test_gpt_oss_fp32_vs_dense(C, frac):
    prob = gpt_oss_problem(37, 16, 12, 6, 3, seed=C, frac=frac)
    hmax = max((prob[0] @ prob[3][e] + prob[5][e]).abs().max().item() for e in range(6))
    assert hmax > 7.0  # part of h is clamped
    assert_close_all(op_grads(*prob, torch.float32, chunk_rows=C), ref_grads(*prob), 1e-5, 1e-5)


def test_gpt_oss_cache_equals_recompute():
    prob = gpt_oss_problem(29, 8, 8, 4, 2, seed=2, frac=0.3)
    st = LLEPStats()
    cached = op_grads(*prob, torch.float32, chunk_rows=8, save_budget_mb=64, stats=st)
    assert st.forward["cached_chunks"] > 0 and st.backward["recomputed_chunks"] < st.forward["n_chunks"]
    plain = op_grads(*prob, torch.float32, chunk_rows=8, save_budget_mb=0)
    for a, b in zip(cached, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("activation", ["gpt_oss", "swiglu"])
def test_bf16_within_twice_torch_error(activation):
    prob = gpt_oss_problem(45, 32, 16, 4, 2, seed=3, frac=0.3)
    truth = ref_grads(*prob, activation=activation)
    low = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in prob]
    torch_bf16 = ref_grads(*low, activation=activation)
    got = op_grads(*prob, torch.bfloat16, activation=activation, chunk_rows=16)
    for name, a, b, t in zip(GRAD_NAMES, got, torch_bf16, truth):
        ea = (a.double() - t).norm().item()
        eb = (b.double() - t).norm().item()
        assert ea <= 2 * eb + 1e-4 * t.norm().item(), f"{name}: op err {ea:.3g} vs torch bf16 err {eb:.3g}"


def test_swiglu_bias_fp32_vs_dense():
    prob = gpt_oss_problem(33, 8, 12, 4, 2, seed=4, frac=0.5, scale=1.0)
    got = op_grads(*prob, torch.float32, activation="swiglu", chunk_rows=7)
    assert_close_all(got, ref_grads(*prob, activation="swiglu"), 1e-5, 1e-5)


def test_gpt_oss_clamp_gradient_at_and_beyond_the_limit():
    """h entries exactly at +-7 (inside the clamp range: gradient passes, as
    torch's clamp) and beyond it (zero gradient), against torch autograd in fp32."""
    H, I, E = 4, 4, 2
    x = torch.eye(H, dtype=torch.float64)                        # row t picks row t of W
    gu = torch.tensor([[7.0, 7.0, -7.0, 8.0, 8.0, -8.0, 3.0, -3.0]] * H, dtype=torch.float64)
    gu = torch.stack([gu, gu.roll(1, 1)]) * torch.tensor([1.0, 0.5, -1.0, 2.0]).view(1, H, 1).double()
    d = torch.randn(E, I, H, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    bgu, bd = torch.zeros(E, 2 * I, dtype=torch.float64), torch.zeros(E, H, dtype=torch.float64)
    ids = torch.tensor([[0, 1]] * H)
    tw = torch.full((H, 2), 0.5, dtype=torch.float64)
    gy = torch.randn(H, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    prob = (x, ids, tw, gu, d, bgu, bd, gy)
    want = ref_grads(*[t.float() if t.is_floating_point() else t for t in prob])
    got = op_grads(*prob, torch.float32, chunk_rows=3)
    assert_close_all(got, want, 1e-6, 1e-6)
    assert (want[3] == 0).any() and (want[3] != 0).any()          # some clamped, some passed


def test_split_gate_up_weights_equal_fused():
    """(w_gate, w_up) as two views of other storage (torchtitan's w1/w3 [E, I,
    H] through transpose(1, 2)) equal the fused w_gate_up, grads in their strides."""
    x, ids, tw, gu, d, _, _, gy = gpt_oss_problem(31, 8, 12, 4, 2, seed=5, frac=0.5, scale=1.0)
    I = 12
    w1 = gu[..., :I].transpose(1, 2).contiguous().float()         # [E, I, H]
    w3 = gu[..., I:].transpose(1, 2).contiguous().float()
    leaves = [x.float().requires_grad_(), tw.float().requires_grad_(), w1.requires_grad_(),
              w3.requires_grad_(), d.float().requires_grad_()]
    y = llep_moe(leaves[0], ids, leaves[1], (leaves[2].transpose(1, 2), leaves[3].transpose(1, 2)), leaves[4],
                 chunk_rows=9)
    got = (y.detach(),) + torch.autograd.grad(y, leaves, gy.float())
    ref_leaves = [t.clone().requires_grad_() for t in (x, tw, gu, d)]
    yr = refs.moe_dense_ref(ref_leaves[0], ids, ref_leaves[1], ref_leaves[2], ref_leaves[3])
    ref = (yr.detach(),) + torch.autograd.grad(yr, ref_leaves, gy)
    want = ref[:3] + (ref[3][..., :I].transpose(1, 2), ref[3][..., I:].transpose(1, 2), ref[4])
    assert_close_all(got, want, 1e-5, 1e-5, names=("y", "dx", "dtw", "dw1", "dw3", "dw_down"))
    assert got[3].stride() == w1.stride() and got[4].stride() == w3.stride()


@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_pick_weight_keeps_dweight_finite(activation, bad):
    """d(topk_weights)[t, k] = <dy[t], o_tk>, whatever topk_weights[t, k] is:
    finite in the dense reference with a NaN/inf weight, and so here."""
    prob = list(gpt_oss_problem(20, 8, 8, 4, 2, seed=6, scale=1.0))
    prob[2] = prob[2].clone()
    prob[2][3, 1] = bad
    prob[2][11, 0] = bad
    want = ref_grads(*prob, activation=activation)
    got = op_grads(*prob, torch.float32, activation=activation, chunk_rows=8)
    assert torch.isfinite(want[2]).all()
    assert torch.isfinite(got[2]).all()
    torch.testing.assert_close(got[2].double(), want[2], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0].isnan(), want[0].isnan())            # y is NaN exactly where torch's is
    clean = torch.ones(20, dtype=torch.bool)
    clean[[3, 11]] = False
    torch.testing.assert_close(got[1][clean].double(), want[1][clean], rtol=1e-5, atol=1e-5)


def test_backward_reuses_forwards_plan(monkeypatch):
    """Backward neither counts nor routes again (no host round trip)."""
    calls = {"count": 0, "route": 0}
    count, route = lp.count, lp.route

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(lp, "count", counting("count", count))
    monkeypatch.setattr(lp, "route", counting("route", route))
    prob = gpt_oss_problem(25, 8, 8, 4, 2, seed=7, scale=1.0)
    op_grads(*prob, torch.float32, chunk_rows=6)
    assert calls == {"count": 1, "route": 1}


def test_one_rank_chunk_is_at_most_the_rows():
    prob = gpt_oss_problem(10, 8, 8, 4, 2, seed=8, scale=1.0)
    stats = LLEPStats()
    op_grads(*prob, torch.float32, save_budget_mb=0, stats=stats)
    st = stats.backward
    assert st["chunk_rows"] == 20 and st["n_chunks"] == 1
    assert st["workspace_bytes_bwd"] == workspace_bytes(20, 8, 8, 1, 4, True, activation="gpt_oss", bias=True)


@pytest.mark.parametrize("T", [40, 400])
def test_cache_plus_working_set_within_grouped_mm_saved(T):
    H, I, K, C = 16, 16, 2, 128
    prob = gpt_oss_problem(T, H, I, 4, K, seed=9, scale=1.0)
    stats = LLEPStats()
    op_grads(*prob, torch.float32, chunk_rows=C, save_budget_mb=1024, stats=stats)
    st = {**stats.forward, **stats.backward}
    saved = grouped_mm_saved_bytes(T, K, H, I, 4)
    assert st["cache_bytes"] + st["workspace_bytes_bwd"] <= max(saved, st["workspace_bytes_bwd"])
    budget = capped_save_bytes(1024 << 20, T, K, C, H, I, 1, 4, activation="gpt_oss", bias=True)
    assert st["cache_bytes"] == cache_slots(budget, T, K, C, I, 1, 4) * 4 * C * 2 * I
    if T == 400:
        assert 0 < st["cached_chunks"] < st["n_chunks"]  # capped below the 1 GiB budget, not zero


def test_bad_input():
    x, ids, tw, gu, d, bgu, bd, _ = [t.float() if t.is_floating_point() else t
                                     for t in gpt_oss_problem(6, 8, 4, 4, 2)]
    with pytest.raises(ValueError, match="activation"):
        llep_moe(x, ids, tw, gu, d, activation="gelu")
    with pytest.raises(ValueError, match="both b_gate_up and b_down"):
        llep_moe(x, ids, tw, gu, d, b_gate_up=bgu)
    with pytest.raises(ValueError, match="b_down must be"):
        llep_moe(x, ids, tw, gu, d, b_gate_up=bgu, b_down=bd[:, :3])
    with pytest.raises(TypeError, match="b_gate_up"):
        llep_moe(x, ids, tw, gu, d, b_gate_up=bgu.double(), b_down=bd)
    with pytest.raises(ValueError, match="w_up must be"):
        llep_moe(x, ids, tw, (gu[..., :4], gu[..., :3]), d)
    with pytest.raises(ValueError, match="pair"):
        llep_moe(x, ids, tw, (gu, gu, gu), d)


# ---------------------------------------------------------------------------
# two gloo ranks: borrowed experts' biases travel, their gradients come home
# ---------------------------------------------------------------------------
def _two_ranks(rank, P):
    import torch.distributed as dist
    E, K, H, I = 8, 2, 8, 8
    tokens = [30, 23]
    for frac, C, m in ((0.0, 8, 1024), (0.95, 8, 2)):
        prob = gpt_oss_problem(sum(tokens), H, I, E, K, seed=11, frac=frac)
        want = ref_grads(*prob)
        x, ids, tw, gu, d, bgu, bd, gy = prob
        lo, hi = sum(tokens[:rank]), sum(tokens[:rank + 1])
        es = slice(rank * E // P, (rank + 1) * E // P)
        st = LLEPStats()
        got = op_grads(x[lo:hi], ids[lo:hi], tw[lo:hi], gu[es], d[es], bgu[es], bd[es], gy[lo:hi],
                       torch.float32, group=dist.group.WORLD, chunk_rows=C, min_tokens_per_gemm=m, stats=st)
        if frac:
            assert st.forward["spilled"] and st.backward["spilled"]
        mine = (want[0][lo:hi], want[1][lo:hi], want[2][lo:hi]) + tuple(w[es] for w in want[3:])
        assert_close_all(got, mine, 2e-5, 2e-5)


def test_gpt_oss_two_gloo_ranks_vs_dense():
    run_ranks(2, _two_ranks, timeout=170)
