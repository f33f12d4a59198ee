"""PipelinedLLEP on a GPU (skipped without one): every CUDA kernel against
its CPU/torch reference, and the P = 1 layer against the dense reference
(fp32 tight, bf16 within the tolerance rule), with and without
torch._grouped_mm."""
import pytest
import torch

from moepeak import llep_plan as lp
from moepeak import llep_sched
from moepeak.llep import llep_combine_

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
    saved = llep_sched._GROUPED_MM_OK[0]
    llep_sched._GROUPED_MM_OK[0] = grouped and hasattr(torch, "_grouped_mm")
    try:
        got = _op_grads(*prob, torch.bfloat16, chunk_rows=512)
    finally:
        llep_sched._GROUPED_MM_OK[0] = saved
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
