"""PipelinedLLEP's fused elementwise kernels (csrc/llep.c, csrc/llep_swiglu.c; CUDA twins
in cuda/llep.cu) against the torch ops they replace:

  gather_rows(..., scale=w)  = src[idx // div] * w[:, None] stored in src's dtype (torch's
                               mixed bf16/fp16 x fp32 multiply): bitwise
  swiglu_fwd                 = silu(gate) then * up, each rounded once: within the exp's
                               last fp32 bit (libm here, Sleef in torch's CPU kernels)
  swiglu_bwd                 = d up = da * s, d gate = silu_backward(da * up, gate)

and the layer that uses them against the unfused arithmetic (tests/test_llep.py's
references still hold; here: the lean and chunked paths agree bitwise, as before)."""
import pytest
import torch

from moepeak.llep import plan as lp

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
dev = "cuda" if torch.cuda.is_available() else "cpu"


def _ulp(dtype):
    return {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]


def _exp_tol(dtype):
    """What a last-bit difference of fp32 exp can leave after the kernel's few fp32 operations:
    a few fp32 ulps in fp32; one rounding flip (one ulp) in bf16 / fp16."""
    return dict(rtol=4 * _ulp(dtype) if dtype == torch.float32 else _ulp(dtype), atol=1e-30)


def _weights(n, g):
    w = torch.rand(n, generator=g) * 2 - 0.5
    w[::7] = 1.0
    w[1::11] = 3e-8      # tiny: left as is (the caller replaces them by 1 before scaling)
    w[2::13] = -0.7
    return w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("div", [1, 3])
def test_gather_scaled_bitwise_torch_multiply(dtype, div):
    g = torch.Generator().manual_seed(2)
    R, N, rows = 29, 37, 50
    src = (torch.randn(R, N, generator=g) * 4).to(dtype)
    idx = torch.randint(0, R * div, (rows,), generator=g)
    w = _weights(rows, g)
    out = torch.full((rows + 2, N), 7.0).to(dtype)
    got = lp.gather_rows(src, idx, div, out, scale=w)
    want = torch.mul(src[idx // div], w.unsqueeze(1), out=torch.empty(rows, N, dtype=dtype))
    assert got.data_ptr() == out.data_ptr() and got.shape == (rows, N)
    assert torch.equal(got, want)
    assert (out[rows:] == 7.0).all()  # nothing past rows written


def test_gather_scaled_bad_input_refused():
    src, out, w, idx = torch.randn(4, 8), torch.empty(3, 8), torch.ones(3), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="idx"):
        lp.gather_rows(src, torch.tensor([0, -1, 2]), 1, out, scale=w)
    with pytest.raises(TypeError, match="scale must have dtype"):
        lp.gather_rows(src, idx, 1, out, scale=w.double())
    with pytest.raises(ValueError, match="scale must hold"):
        lp.gather_rows(src, idx, 1, out, scale=w[:2])
    with pytest.raises(TypeError, match="out must have dtype"):
        lp.gather_rows(src, idx, 1, out.bfloat16(), scale=w)
    with pytest.raises(ValueError, match="out must be"):
        lp.gather_rows(src, idx, 1, out[:2], scale=w)
    with pytest.raises(TypeError, match="src must have dtype"):
        lp.gather_rows(src.double(), idx, 1, out.double(), scale=w)


def _swiglu_ref(h, I):
    gate, up = h[:, :I], h[:, I:]
    s = torch.ops.aten.silu(gate)
    return torch.mul(s, up), s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,I,pad", [(1, 5, 0), (33, 24, 0), (17, 13, 6)])
def test_swiglu_fwd_matches_silu_mul(dtype, rows, I, pad):
    g = torch.Generator().manual_seed(rows + I)
    store = (torch.randn(rows, 2 * I + pad, generator=g) * 3).to(dtype)
    h = store[:, :2 * I]  # a row stride past 2I (a slot of a wider buffer) is fine
    a, s = torch.empty(rows, I, dtype=dtype), torch.empty(rows, I, dtype=dtype)
    lp.swiglu_fwd(h, a, s)
    a_ref, s_ref = _swiglu_ref(h, I)
    torch.testing.assert_close(s, s_ref, **_exp_tol(dtype))
    torch.testing.assert_close(a, a_ref, **_exp_tol(dtype))
    a2 = torch.empty_like(a)
    lp.swiglu_fwd(h, a2)  # without s: the same a
    assert torch.equal(a2, a)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_swiglu_bwd_matches_torch_ops(dtype, in_place):
    g = torch.Generator().manual_seed(5)
    rows, I = 31, 20
    h = (torch.randn(rows, 2 * I, generator=g) * 3).to(dtype)
    da = torch.randn(rows, I, generator=g).to(dtype)
    s = torch.ops.aten.silu(h[:, :I]).contiguous()
    gate, up = h[:, :I], h[:, I:]
    want_up = torch.mul(da, s)
    t = torch.mul(da, up)
    want_gate = torch.ops.aten.silu_backward(t, gate)
    h0 = h.clone()
    dh = h if in_place else torch.full_like(h, 9.0)
    got = lp.swiglu_bwd(h, da, s, dh)
    assert got.data_ptr() == dh.data_ptr()
    torch.testing.assert_close(got[:, I:], want_up, rtol=0, atol=0)  # one product, one rounding: exact
    # silu' = sg * (1 + g (1 - sg)) cancels near g = -1.28: there a last-bit exp difference is
    # large relative to the (tiny) value, not to the scale of the values around it
    scale = dict(rtol=_exp_tol(dtype)["rtol"], atol=8 * _ulp(dtype) * t.float().abs().max().item())
    torch.testing.assert_close(got[:, :I], want_gate, **scale)
    if not in_place:
        assert torch.equal(h, h0)


def test_swiglu_bad_input():
    h, a = torch.randn(4, 10), torch.empty(4, 5)
    with pytest.raises(ValueError, match="h must be"):
        lp.swiglu_fwd(h[:, :8], a)
    with pytest.raises(ValueError, match="h must be"):
        lp.swiglu_fwd(h.t().contiguous().t(), a)   # column stride not 1
    with pytest.raises(TypeError, match="a must have dtype"):
        lp.swiglu_fwd(h, a.double())
    with pytest.raises(ValueError, match="a must be contiguous"):
        lp.swiglu_fwd(h, torch.empty(5, 4).t())
    with pytest.raises(ValueError, match="s must be"):
        lp.swiglu_bwd(h, a, torch.empty(4, 4), h)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_kernels_cuda_bitwise_torch(dtype):
    """On the GPU the kernels compute torch's expressions with the same fp32 operations
    and libdevice exp: the scaled gather is bitwise torch's multiply; SwiGLU forward and
    backward are bitwise torch's silu/mul/silu_backward but for FMA contractions the two
    compilers may place differently (then one ulp, on few elements). Both the 16-byte
    packed and the scalar paths (an odd I) run."""
    g = torch.Generator().manual_seed(8)
    for rows, I in ((257, 2880), (33, 13)):
        src = (torch.randn(rows, I, generator=g) * 4).to(dev, dtype)
        idx = torch.randint(0, rows * 4, (3 * rows,), generator=g).to(dev)
        w = _weights(3 * rows, g).to(dev)
        out = torch.empty(3 * rows, I, device=dev, dtype=dtype)
        want = torch.mul(src[idx // 4], w.unsqueeze(1), out=torch.empty_like(out))
        assert torch.equal(lp.gather_rows(src, idx, 4, out, scale=w), want)
        h = (torch.randn(rows, 2 * I, generator=g) * 3).to(dev, dtype)
        a, s = torch.empty(rows, I, device=dev, dtype=dtype), torch.empty(rows, I, device=dev, dtype=dtype)
        lp.swiglu_fwd(h, a, s)
        a_ref, s_ref = _swiglu_ref(h, I)
        da = torch.randn(rows, I, generator=g).to(dev, dtype)
        dh = lp.swiglu_bwd(h, da, s_ref.contiguous(), torch.empty_like(h))
        assert torch.equal(dh[:, I:], torch.mul(da, s_ref))
        dg_ref = torch.ops.aten.silu_backward(torch.mul(da, h[:, I:]), h[:, :I])
        for got, ref in ((s, s_ref), (a, a_ref), (dh[:, :I], dg_ref)):
            tol = dict(rtol=_exp_tol(dtype)["rtol"], atol=8 * _ulp(dtype) * ref.float().abs().max().item())
            torch.testing.assert_close(got, ref, **tol)
            if dtype != torch.float32:  # a last-bit fp32 difference rarely flips a bf16/fp16 rounding
                assert (got != ref).float().mean().item() <= 1e-3, (dtype, rows, I)
        torch.cuda.synchronize()


def _layer_grads(prob, dtype, split, **kw):
    """llep_moe's y and gradients (x, topk_weights, w_gate_up, w_down) on prob's device;
    split: w_gate_up passed as its (gate, up) column views, as moepeak.titan passes w1/w3."""
    from moepeak.llep import LLEPStats, llep_moe
    x, ids, tw, wgu, wd, gy = prob
    I = wd.shape[1]
    leaves = [x.to(dtype).requires_grad_(), tw.float().requires_grad_(), wgu.to(dtype).requires_grad_(),
              wd.to(dtype).requires_grad_()]
    gate_up = (leaves[2][..., :I], leaves[2][..., I:]) if split else leaves[2]
    stats = LLEPStats()
    y = llep_moe(leaves[0], ids, leaves[1], gate_up, leaves[3], stats=stats, **kw)
    return (y.detach(),) + torch.autograd.grad(y, leaves, gy.to(dtype)), stats


@pytest.mark.parametrize("split", [False, True])
def test_default_budget_caches_every_chunk_equal_to_recompute(split):
    """save_budget_mb=None on one rank: with many chunks the cache below permute +
    grouped_mm's peak holds every chunk's h (forward writes h straight into its slot,
    no working h buffer); the result is bitwise the recompute path's (save_budget_mb=0),
    and that path matches the dense fp64 reference (fp32)."""
    try:
        from tests.test_llep import _dense_grads, _problem
    except ImportError:
        from test_llep import _dense_grads, _problem
    prob = _problem(512, 32, 32, 8, 4, torch.float32, seed=11, frac=0.5)
    got, st = _layer_grads(prob, torch.float32, split, chunk_rows=128)
    assert st.forward["n_chunks"] == st.forward["cached_chunks"] == 16 and st.backward["recomputed_chunks"] == 0
    ref, st0 = _layer_grads(prob, torch.float32, split, chunk_rows=128, save_budget_mb=0)
    assert st0.backward["recomputed_chunks"] == 16
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    for a, b in zip(got, _dense_grads(*prob)):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("path", ["lean", "chunked"])
def test_default_p1_paths_cuda_bf16_tolerance_rule(path, split):
    """The default launch's two P = 1 paths on the GPU in bf16 with the fused kernels
    (16-byte packs: H, I multiples of 8): the lean one-chunk step and the chunked one
    with every chunk cached; each gradient within twice torch's own bf16 error against
    fp64 (the tolerance rule)."""
    try:
        from tests.test_llep import _dense_grads, _problem
    except ImportError:
        from test_llep import _dense_grads, _problem
    shape, kw = (((100, 32, 16, 64, 4), {}) if path == "lean" else ((4096, 256, 256, 16, 4), {"chunk_rows": 512}))
    prob = tuple(t.to(dev) for t in _problem(*shape, torch.float32, seed=13, frac=0.95))
    truth = _dense_grads(*prob)
    torch_bf16 = _dense_grads(*[t.to(torch.bfloat16) if t.is_floating_point() else t for t in prob])
    got, st = _layer_grads(prob, torch.bfloat16, split, **kw)
    if path == "lean":
        assert st.backward["lean_one_chunk"] and st.backward["recomputed_chunks"] == 0, st
    else:
        assert st.forward["n_chunks"] == st.forward["cached_chunks"] == 32, st
        assert st.backward["recomputed_chunks"] == 0, st
    for name, a, b, t in zip(("y", "dx", "dtopk_weights", "dw_gate_up", "dw_down"), got, torch_bf16, truth):
        ea = (a.double() - t).abs().max().item()
        eb = (b.double() - t).abs().max().item()
        assert ea <= 2 * eb + 1e-4 * t.abs().max().item(), f"{name}: op err {ea:.3g} vs torch bf16 err {eb:.3g}"
