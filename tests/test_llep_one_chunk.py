"""P = 1, one chunk: the lean backward (h cached, dh written over it, buffers
held only while used) against the recompute path, bitwise; and its peak
formula against permute + grouped_mm's at issue 26's 16k shape (no allocation)."""
import pytest
import torch

from moepeak.llep import LLEPOptions, LLEPStats, llep_moe
from moepeak.llep.launch import Shapes, size_launch
from moepeak.llep.sizes import (capped_save_bytes, grouped_mm_peak_bytes, one_chunk_fits, one_chunk_peak_bytes,
                                slot_elems, working_set_bound, workspace_bytes)

GIB = 2 ** 30


def _grads(T, K, E, H, I, dtype, split=False, **kw):
    g = torch.Generator().manual_seed(T * 7 + K)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    ids = torch.rand(T, E, generator=g).topk(K, 1).indices
    tw = torch.rand(T, K, generator=g)
    tw = (tw / tw.sum(1, keepdim=True)).requires_grad_()
    wgu = (torch.randn(E, H, 2 * I, generator=g) * H ** -0.5).to(dtype).requires_grad_()
    wd = (torch.randn(E, I, H, generator=g) * I ** -0.5).to(dtype).requires_grad_()
    gy = torch.randn(T, H, generator=g).to(dtype)
    stats = LLEPStats()
    gate_up = (wgu[..., :I], wgu[..., I:]) if split else wgu  # split: torchtitan's w1/w3 form (views)
    y = llep_moe(x, ids, tw, gate_up, wd, stats=stats, **kw)
    y.backward(gy)
    st = {**stats.forward, **stats.backward}
    return [y.detach()] + [t.grad for t in (x, tw, wgu, wd)], st


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K,E", [(37, 4, 64), (64, 4, 32), (5, 6, 24)])
def test_one_chunk_cached_equals_recompute_bitwise(T, K, E, dtype, split):
    """The lean path (fused or split gate/up weights) against the recompute path."""
    H, I = 16, 16  # E large against T*K: the weight gradients dominate both peaks, as at 16k
    b = torch.empty((), dtype=dtype).element_size()
    assert one_chunk_fits(T, K, E, H, I, T * K, b, 1 << 20, split=split)
    lean, st = _grads(T, K, E, H, I, dtype, split, chunk_rows=T * K, save_budget_mb=1)
    assert st["n_chunks"] == 1 and st["cached_chunks"] == 1
    assert st["recomputed_chunks"] == 0 and st["lean_one_chunk"]
    ref, st0 = _grads(T, K, E, H, I, dtype, split, chunk_rows=T * K, save_budget_mb=0)
    assert st0["recomputed_chunks"] == 1 and not st0["lean_one_chunk"]
    for a, b in zip(lean, ref):
        assert torch.equal(a, b)


def test_lean_cache_serves_one_backward():
    T, K, E, H, I = 20, 2, 64, 8, 8
    x = torch.randn(T, H, requires_grad=True)
    ids = torch.rand(T, E).topk(K, 1).indices
    tw = torch.full((T, K), 0.5)
    wgu, wd = torch.randn(E, H, 2 * I), torch.randn(E, I, H)
    y = llep_moe(x, ids, tw, wgu, wd, chunk_rows=T * K, save_budget_mb=1)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_issue26_16k_shape_one_chunk_within_grouped_mm_peak():
    T, K, E, H, I, b, C, budget = 16384, 4, 128, 2880, 2880, 2, 32768, 1536 << 20
    gmm = grouped_mm_peak_bytes(T, K, E, H, I, b)
    assert gmm == b * E * 3 * H * I + b * T * K * (2 * H + 2 * I)
    assert abs(gmm / GIB - 7.339) < 1e-3
    # the chunked schedule at C = 32768 cannot cache at 16k: its working set alone
    # exceeds what grouped_mm holds above the weight gradients
    assert capped_save_bytes(budget, T, K, C, H, I, 1, b) == 0
    assert workspace_bytes(C, H, I, 1, b, True) + 4 * T * H > gmm - b * E * 3 * H * I
    # one chunk with the whole h cached: <= grouped_mm's peak and within the chunked bound
    peak = one_chunk_peak_bytes(T, K, E, H, I, b)
    assert peak <= gmm and abs(peak / GIB - 7.164) < 1e-3
    held = b * T * K * 2 * I + b * T * K * (H + 3 * I) + 12 * T * K
    assert held <= working_set_bound(C, H, I, 1, b, True, budget)
    assert one_chunk_fits(T, K, E, H, I, C, b, budget)
    # longer inputs keep the chunked schedule (64k: 8 chunks, the cache capped at the budget)
    assert not one_chunk_fits(4 * T, K, E, H, I, C, b, budget)
    assert capped_save_bytes(budget, 4 * T, K, C, H, I, 1, b) == budget
    # no cache budget, no one chunk
    assert not one_chunk_fits(T, K, E, H, I, C, b, 0)


@pytest.mark.parametrize("T,split", [(16384, False), (65536, False), (262144, False), (16384, True),
                                     (65536, True), (262144, True)])
def test_default_launch_at_issue38_points_peaks_within_grouped_mm(T, split):
    """save_budget_mb=None on one rank: the cache takes what keeps the layer's peak at or
    under permute + grouped_mm's (sizes.default_save_budget_mb). At E = 128, K = 4,
    H = I = 2880, bf16: 16k and 64k run one chunk with h cached whole (no recompute),
    256k caches all 32 chunks; each launch's peak, from llep.sizes, is at most
    grouped_mm_peak_bytes (the lower of the fair grouped arms' peaks)."""
    K, E, H, I, b = 4, 128, 2880, 2880, 2
    launch = size_launch(LLEPOptions(), Shapes(P=1, T=T, K=K, E_local=E, H=H, I=I, dtype=torch.bfloat16, grad=True,
                                               split=split))
    C, slots = launch.options.chunk_rows, launch.save_slots
    gmm = grouped_mm_peak_bytes(T, K, E, H, I, b)
    if C == T * K:  # the lean one-chunk path
        assert T <= 65536 and slots == 1
        assert one_chunk_peak_bytes(T, K, E, H, I, b, split=split) <= gmm
    else:
        n = -(-T * K // C)
        assert T == 262144 and C == 32768 and slots == n == 32  # every chunk's h cached: no recompute
        cache = slots * b * slot_elems(C, I)
        bwd = workspace_bytes(C, H, I, 1, b, True, split=split)
        assert b * E * 3 * H * I + cache + bwd + 4 * T * H <= gmm  # dW + cache + working set + fp32 dx


def test_default_chunking_picks_one_chunk_when_it_fits():
    # E large against T*K: the weight gradients dominate both peaks, as at 16k
    T, K, E, H, I = 48, 2, 64, 8, 8
    assert one_chunk_fits(T, K, E, H, I, 32, 4, 1 << 20)
    lean, st = _grads(T, K, E, H, I, torch.float32, save_budget_mb=1)
    assert st["n_chunks"] == 1 and st["recomputed_chunks"] == 0 and st["lean_one_chunk"]
    ref, _ = _grads(T, K, E, H, I, torch.float32, chunk_rows=T * K, save_budget_mb=0)
    for a, b in zip(lean, ref):
        assert torch.equal(a, b)


def test_opcheck_lean_backward_op():
    from moepeak.llep.ops import llep_dispatch, llep_dispatch_backward_lean_
    T, K, E, H, I = 12, 4, 32, 8, 8
    x, gy = torch.randn(T, H), torch.randn(T, H)
    ids = torch.rand(T, E).topk(K, 1).indices
    tw = torch.rand(T, K)
    wgu, wd = torch.randn(E, H, 2 * I), torch.randn(E, I, H)
    args = (x, ids, tw, wgu, wd, "", T * K, 1.0, 1024, 1.3)
    _, cache, load, send_index = llep_dispatch(*args, 1)
    torch.library.opcheck(llep_dispatch_backward_lean_, (gy,) + args + (cache, None, None, None, "swiglu", load,
                                                                         send_index))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_lean_matches_fused_lean(dtype):
    """Split gate/up weights on the lean path give the fused path's values: the same
    GEMM columns, rows and roundings (bitwise in fp32 here; bf16 within one rounding
    of the per-expert GEMMs' summation order)."""
    T, K, E, H, I = 37, 4, 64, 16, 16
    b = torch.empty((), dtype=dtype).element_size()
    assert all(one_chunk_fits(T, K, E, H, I, T * K, b, 1 << 20, split=sp) for sp in (False, True))
    fused, st = _grads(T, K, E, H, I, dtype, False, save_budget_mb=1)
    split, st2 = _grads(T, K, E, H, I, dtype, True, save_budget_mb=1)
    assert st["lean_one_chunk"] and st2["lean_one_chunk"]
    for a, b in zip(split, fused):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
