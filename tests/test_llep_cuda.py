"""PipelinedLLEP on a GPU (skipped without one): every CUDA kernel against
its CPU/torch reference, and the P = 1 layer against the dense reference
(fp32 tight, bf16 within the tolerance rule), with and without
torch._grouped_mm."""
import pytest
import torch

from moepeak.llep import LLEPStats
from moepeak.llep import plan as lp
from moepeak.llep.ops import llep_combine_
from moepeak.llep.sizes import slot_elems

try:
    from tests import refs
    from tests.test_llep import NAMES, _dense_grads, _op_grads, _problem
except ImportError:
    import refs
    from test_llep import NAMES, _dense_grads, _op_grads, _problem

pytestmark = pytest.mark.cuda
dev = torch.device("cuda")


def test_count_cuda():
    g = torch.Generator().manual_seed(0)
    for n, E in [(0, 4), (1, 1), (100003, 128)]:
        ids = torch.randint(0, E, (n,), generator=g)
        if n > 10:
            ids[5], ids[9] = -3, E
        got = lp.count(ids.to(dev), E).cpu()
        assert torch.equal(got, lp.count(ids, E)), (n, E)


@pytest.mark.parametrize("P,rank", [(1, 0), (2, 1), (4, 2)])
def test_route_cuda_matches_cpu(P, rank):
    g = torch.Generator().manual_seed(P)
    E, T, K = 8 * P, 5001, 4
    ids = refs.skewed_topk_ids(T, E, K, 0.5, generator=g).flatten()
    cnt = lp.count(ids, E)[:E]
    load = torch.stack([cnt if s == rank else torch.randint(0, 900, (E,), generator=g) for s in range(P)])
    plan = lp.llep_plan(load, 1.0, 16, 1.0)
    want = lp.route(ids, E, plan, rank, cnt)
    got = lp.route(ids.to(dev), E, plan, rank, cnt).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype,H", [(torch.bfloat16, 8), (torch.bfloat16, 7), (torch.float32, 3), (torch.float32, 5),
                                     (torch.float16, 2880), (torch.uint8, 3)])
def test_gather_cuda(dtype, H):
    g = torch.Generator().manual_seed(1)
    src = (torch.randn(300, H, generator=g) * 50).to(dtype)
    idx = torch.randint(0, 300 * 4, (517,), generator=g)
    out = torch.empty(600, H, dtype=dtype, device=dev)
    got = lp.gather_rows(src.to(dev), idx.to(dev), 4, out)
    assert torch.equal(got.cpu(), src[idx // 4])
    # unaligned views (offset by one element)
    s2 = src.to(dev).flatten()[1:1 + 299 * H].view(299, H)
    o2 = torch.empty(601 * H, dtype=dtype, device=dev)[1:1 + 517 * H].view(517, H)
    idx2 = torch.randint(0, 299, (517,), generator=g)
    lp.gather_rows(s2, idx2.to(dev), 1, o2)
    assert torch.equal(o2.cpu(), s2.cpu()[idx2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weighted", [True, False])
def test_combine_cuda(dtype, weighted):
    g = torch.Generator().manual_seed(2)
    T, K, H = 1000, 4, 96
    idx = torch.randperm(T * K, generator=g)[:3001]
    y = torch.randn(3001, H, generator=g).to(dtype)
    w = torch.rand(T * K, generator=g) if weighted else None
    acc = torch.randn(T, H, generator=g)
    want = acc.double().index_add(0, idx // K, y.double() * (w[idx, None].double() if weighted else 1.0))
    acc_d = acc.to(dev)
    llep_combine_(acc_d, y.to(dev), idx.to(dev), None if w is None else w.to(dev), K)
    torch.testing.assert_close(acc_d.cpu().double(), want, rtol=1e-5, atol=1e-5)


def test_gather_combine_cuda_many_rows():
    """Row-per-block kernels: more rows than the 65535-block grid (grid-stride
    over rows) and a row longer than the block (threads stride over h)."""
    g = torch.Generator().manual_seed(3)
    T, K, H, R = 40000, 2, 300, 70001
    src = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, T * K, (R,), generator=g)
    out = torch.empty(R, H, dtype=torch.bfloat16, device=dev)
    got = lp.gather_rows(src.to(dev), idx.to(dev), K, out)
    assert torch.equal(got.cpu(), src[idx // K])
    w = torch.rand(T * K, generator=g)
    acc = torch.zeros(T, H, device=dev)
    llep_combine_(acc, got, idx.to(dev), w.to(dev), K)
    want = torch.zeros(T, H, dtype=torch.float64).index_add(0, idx // K, src[idx // K].double() * w[idx, None].double())
    torch.testing.assert_close(acc.cpu().double(), want, rtol=1e-5, atol=1e-5)


def _to(prob, device):
    return tuple(t.to(device) for t in prob)


@pytest.mark.parametrize("frac", [0.0, 0.95])
@pytest.mark.parametrize("C", [64, 1 << 16])
def test_layer_p1_fp32_cuda(frac, C):
    prob = _to(_problem(333, 64, 96, 16, 4, torch.float32, seed=7, frac=frac), dev)
    ref = _dense_grads(*prob)
    torch.backends.cuda.matmul.allow_tf32 = False
    got = _op_grads(*prob, torch.float32, chunk_rows=C)
    for name, a, b in zip(NAMES, got, ref):
        err = (a.double() - b).abs()
        assert torch.allclose(a.double(), b, rtol=1e-4, atol=1e-4), f"{name}: max {err.max():.3g} mean {err.mean():.3g}"


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("frac", [0.0, 0.95])
def test_layer_p1_bf16_cuda(grouped, frac):
    prob = _to(_problem(1000, 128, 64, 16, 4, torch.float32, seed=9, frac=frac), dev)
    truth = _dense_grads(*prob)
    bf = _dense_grads(*[t.to(torch.bfloat16) if t.is_floating_point() else t for t in prob])
    stats = LLEPStats()
    got = _op_grads(*prob, torch.bfloat16, chunk_rows=512, grouped_mm="auto" if grouped else "off", stats=stats)
    st = stats.backward
    # grouped: forward/dX GEMMs and the 2D x 2D weight gradients went grouped
    assert (st["grouped_mm"] > 0 and st["grouped_dw"] > 0) == grouped, st
    assert (stats.forward["grouped_mm"] > 0) == grouped and not st["grouped_fallback"], stats
    for name, a, b, t in zip(NAMES, got, bf, truth):
        ea = (a.double() - t).abs().max().item()
        eb = (b.double() - t).abs().max().item()
        assert ea <= 2 * eb + 1e-4 * t.abs().max().item(), f"{name}: op err {ea:.3g} vs torch bf16 err {eb:.3g}"


def test_working_set_cuda_peak():
    """Peak of forward+backward above inputs at two routings differs by at most
    what the fp32 [T, H] accumulators and outputs explain: the working set is
    fixed from C."""
    T, H, I, E, K, C = 4096, 256, 256, 16, 4, 2048
    peaks = []
    for frac in (0.0, 0.95):
        prob = _to(_problem(T, H, I, E, K, torch.float32, seed=3, frac=frac), dev)
        ids = prob[1]
        x = prob[0].to(torch.bfloat16).requires_grad_()
        wgu, wd = prob[3].to(torch.bfloat16).requires_grad_(), prob[4].to(torch.bfloat16).requires_grad_()
        tw = prob[2].float().requires_grad_()
        gy = prob[5].to(torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        from moepeak.llep import llep_moe
        y = llep_moe(x, ids, tw, wgu, wd, chunk_rows=C)
        y.backward(gy)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del y
        x.grad = wgu.grad = wd.grad = tw.grad = None
    assert abs(peaks[0] - peaks[1]) <= 0.05 * max(peaks), peaks


def test_grouped_peak_not_above_per_expert_cuda():
    """The grouped path (GEMM outputs used in place, dW results of at most
    C // H experts) peaks no higher than the per-expert path with its
    workspace buffers, and gives the same result."""
    T, H, I, E, K, C = 4096, 256, 256, 16, 4, 2048
    prob = _to(_problem(T, H, I, E, K, torch.float32, seed=4, frac=0.5), dev)
    peaks, outs = [], []
    for grouped in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        outs.append(_op_grads(*prob, torch.bfloat16, chunk_rows=C, grouped_mm="auto" if grouped else "off"))
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    if hasattr(torch, "_grouped_mm"):
        assert peaks[1] <= peaks[0], peaks
    for name, a, b in zip(NAMES, outs[1], outs[0]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)


@pytest.mark.parametrize("grouped", [True, False])
def test_cache_cuda_equals_recompute(grouped):
    """bf16 on the GPU: chunks served from the activation cache (0, 3 of 8,
    all 8 slots) give bitwise the same d(topk_weights) and dW as recomputing
    (GEMMs are deterministic); y and dx go through the fp32 atomicAdd
    combine, whose summation order may differ run to run: equal within one
    bf16 rounding. The peak grows by at most the cache itself."""
    try:
        from tests.test_llep import _slot_grads
    except ImportError:
        from test_llep import _slot_grads
    T, H, I, E, K, C = 4096, 256, 256, 16, 4, 2048
    prob = _to(_problem(T, H, I, E, K, torch.float32, seed=6, frac=0.95), dev)
    outs, peaks = [], []
    for slots in (0, 3, 8):
        stats = LLEPStats()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        outs.append(_slot_grads(*prob, torch.bfloat16, C, slots, stats, "auto" if grouped else "off"))
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        assert stats.forward["cached_chunks"] == slots and stats.backward["recomputed_chunks"] == 8 - slots, stats
        assert (stats.backward["grouped_mm"] > 0) == (grouped and hasattr(torch, "_grouped_mm")), stats
    slot_bytes = 2 * slot_elems(C, I)
    for got, slots, peak in zip(outs[1:], (3, 8), peaks[1:]):
        for name, a, b in zip(NAMES, got, outs[0]):
            if name in ("y", "dx"):
                torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2, msg=name)
            else:
                assert torch.equal(a, b), f"{name} differs with {slots} cache slots"
        assert peak <= peaks[0] + slots * slot_bytes + (1 << 20), (peaks, slots, slot_bytes)


@pytest.mark.parametrize("grouped", [True, False])
def test_hf_layout_cuda(grouped):
    """Hugging Face's weights ([E, 2I, H] / [E, H, I] seen through
    transpose(1, 2)) on the GPU in bf16: torch._grouped_mm takes the
    column-major stacks as they are (no staging), the gradients come back in
    the views' strides, and the result equals contiguous weights up to GEMM
    summation order."""
    try:
        from tests.test_llep_hf_layout import _grads
    except ImportError:
        from test_llep_hf_layout import _grads
    prob = _to(_problem(1000, 128, 64, 16, 4, torch.float32, seed=9, frac=0.5), dev)
    mode, stats = "auto" if grouped else "off", LLEPStats()
    ref = _grads(*prob, torch.bfloat16, False, chunk_rows=512, grouped_mm=mode)
    got = _grads(*prob, torch.bfloat16, True, chunk_rows=512, grouped_mm=mode, stats=stats)  # asserts the strides
    st = stats.backward
    assert (st["grouped_mm"] > 0 and st["grouped_dw"] > 0) == (grouped and hasattr(torch, "_grouped_mm")), st
    for name, a, b in zip(NAMES, got, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("activation", ["gpt_oss", "swiglu"])
def test_biased_experts_cuda_bf16_tolerance_rule(activation, grouped):
    """GPT-OSS / biased SwiGLU experts on the GPU (H, I multiples of 8 so the
    grouped path runs), bf16 within twice torch's own bf16 error vs fp64."""
    try:
        from tests import test_llep_act as act
    except ImportError:
        import test_llep_act as act
    prob = act.gpt_oss_problem(300, 64, 32, 8, 2, seed=5, frac=0.5)
    truth = act.ref_grads(*prob, activation=activation)
    low = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in prob]
    torch_bf16 = act.ref_grads(*low, activation=activation)
    on_dev = [t.to(dev) for t in prob]
    got = act.op_grads(*on_dev, torch.bfloat16, activation=activation, chunk_rows=128,
                       grouped_mm="auto" if grouped else "off")
    for name, a, b, t in zip(act.GRAD_NAMES, got, torch_bf16, truth):
        ea = (a.cpu().double() - t).norm().item()
        eb = (b.double() - t).norm().item()
        assert ea <= 2 * eb + 1e-4 * t.norm().item(), f"{name}: op err {ea:.3g} vs torch bf16 err {eb:.3g}"


def test_split_gate_up_cuda_grouped():
    x, ids, tw, wgu, wd, gy = _problem(300, 64, 32, 8, 2, torch.bfloat16, seed=6, frac=0.5)
    I = 32
    fused = _op_grads(x.to(dev), ids.to(dev), tw.to(dev), wgu.to(dev), wd.to(dev), gy.to(dev), torch.bfloat16,
                      chunk_rows=128)
    from moepeak.llep import llep_moe
    w1 = wgu[..., :I].transpose(1, 2).contiguous().to(dev, torch.bfloat16).requires_grad_()
    w3 = wgu[..., I:].transpose(1, 2).contiguous().to(dev, torch.bfloat16).requires_grad_()
    xs = x.to(dev, torch.bfloat16).requires_grad_()
    y = llep_moe(xs, ids.to(dev), tw.to(dev).float(), (w1.transpose(1, 2), w3.transpose(1, 2)),
                 wd.to(dev, torch.bfloat16), chunk_rows=128, grouped_mm="on")
    y.backward(gy.to(dev, torch.bfloat16))
    torch.testing.assert_close(y.float(), fused[0].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(xs.grad.float(), fused[1].float(), rtol=3e-2, atol=3e-2)
    dwgu = torch.cat([w1.grad.transpose(1, 2), w3.grad.transpose(1, 2)], 2)
    torch.testing.assert_close(dwgu.float(), fused[3].float(), rtol=3e-2, atol=3e-2)
