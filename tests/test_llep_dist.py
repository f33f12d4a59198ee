"""PipelinedLLEP over P = 2, 3, 4 gloo ranks (CPU) against the dense
single-device fp64 reference: output, dx, d(topk_weights) and every expert's
dW; balanced and 95%-to-4-experts routing; one chunk and many; T = 0 on a
rank; differing configs and bad ids reported on every rank (no hang).

Every rank builds the same global problem from one seed, takes its token
slice and its experts, and compares its share of the results."""
import pytest
import torch
import torch.distributed as dist

from moepeak.llep import LLEPStats, llep_moe
from moepeak.llep.sizes import cache_slots, capped_save_bytes, working_set_bound, workspace_bytes

try:
    from tests import refs
    from tests.dist_utils import run_ranks
except ImportError:  # rootdir not on sys.path
    import refs
    from dist_utils import run_ranks

H, I, K = 8, 12, 3
E = 8  # experts; 6 when P = 3 (set per run by _ranks_main)


def _global_problem(tokens, frac, seed):
    return refs.moe_problem(sum(tokens), E, K, H, I, frac, seed)


def _run_case(rank, P, tokens, frac, C, m, expect_spill=None, seed=0, group=None, save_budget_mb=1):
    x, ids, tw, wgu, wd, gy = _global_problem(tokens, frac, seed)
    leaves = [t.clone().requires_grad_() for t in (x, tw, wgu, wd)]
    yref = refs.moe_dense_ref(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    ref = (yref.detach(),) + torch.autograd.grad(yref, leaves, gy)
    lo, hi = sum(tokens[:rank]), sum(tokens[:rank + 1])
    El = E // P
    es = slice(rank * El, (rank + 1) * El)
    mine = [x[lo:hi].float().requires_grad_(), tw[lo:hi].float().requires_grad_(),
            wgu[es].float().requires_grad_(), wd[es].float().requires_grad_()]
    st = LLEPStats()
    y = llep_moe(mine[0], ids[lo:hi], mine[1], mine[2], mine[3], group=group, chunk_rows=C,
                 min_tokens_per_gemm=m, save_budget_mb=save_budget_mb, stats=st)
    stats = st.forward
    if stats["one_chunk_ep"]:  # one chunk covers the step: h and grouped x kept (tests/test_llep_ep_one_chunk.py)
        keep = save_budget_mb != 0
        assert stats["cached_chunks"] == int(keep)
        assert stats["cache_bytes"] == keep * 4 * stats["recv_rows"] * (2 * I + H)
    else:
        # activation cache: ceil(T*K / (C//P)) slots fit 1 MiB here (none for T = 0), capped by
        # what grouped_mm would save minus the working set
        budget = capped_save_bytes(save_budget_mb << 20, hi - lo, K, C, H, I, P, 4)
        slots = cache_slots(budget, hi - lo, K, C, I, P, 4)
        assert stats["cached_chunks"] == min(slots, stats["n_chunks"]), stats
        assert stats["cache_bytes"] == slots * 4 * C * 2 * I
    got = (y.detach(),) + torch.autograd.grad(y, mine, gy[lo:hi].float())
    want = (ref[0][lo:hi], ref[1][lo:hi], ref[2][lo:hi], ref[3][es], ref[4][es])
    for name, a, b in zip(("y", "dx", "dtopk_weights", "dw_gate_up", "dw_down"), got, want):
        err = (a.double() - b).abs()
        assert torch.allclose(a.double(), b, rtol=2e-5, atol=2e-5), \
            f"P={P} tokens={tokens} frac={frac} C={C}: {name} max diff {err.max().item():.3g} " \
            f"mean {err.mean().item():.3g}"
    assert stats["max_rows"] <= C and st.backward["max_rows"] <= C
    if stats["one_chunk_ep"]:  # within the chunked working set at the same C
        bound = working_set_bound(C, H, I, P, 4, True, save_budget_mb << 20)
        assert stats["workspace_bytes"] + stats["cache_bytes"] <= bound
        assert st.backward["workspace_bytes_bwd"] + stats["cache_bytes"] <= bound
    else:
        assert stats["workspace_bytes"] == workspace_bytes(C, H, I, P, 4, backward=False)
        assert st.backward["workspace_bytes_bwd"] == workspace_bytes(C, H, I, P, 4, backward=True)
    if expect_spill is not None:
        assert stats["spilled"] == expect_spill, stats
    return stats


def _cases(rank, P, group):
    global E, I
    E, I = (6 if P == 3 else 8), 12
    tokens = [40 + 7 * r for r in range(P)]
    kw = dict(group=group)
    _run_case(rank, P, tokens, 0.0, 1 << 16, 1024, expect_spill=False, **kw)       # balanced, one chunk
    _run_case(rank, P, tokens, 0.0, 2 * P + 1, 4, **kw)                             # balanced, many chunks
    st = _run_case(rank, P, tokens, 0.95, 4 * P, 2, expect_spill=True, **kw)      # 95:4, spills, many chunks
    assert st["n_chunks"] > 1 and st["cached_chunks"] > 0
    _run_case(rank, P, tokens, 0.95, 4 * P, 2, expect_spill=True, save_budget_mb=0, **kw)  # no cache
    _run_case(rank, P, tokens, 0.95, 1 << 16, 2, expect_spill=True, **kw)          # 95:4, one chunk
    zero = list(tokens)
    zero[P - 1] = 0
    _run_case(rank, P, zero, 0.95, 3 * P, 1, **kw)                                  # T = 0 on the last rank


def _rank_share(rank, P, seed):
    """The global problem of 50 + 3r tokens on rank r (skew 0.95, `seed`), this rank's token
    rows [lo, hi) and its experts' slice es of the E (a module global) experts."""
    tokens = [50 + 3 * r for r in range(P)]
    problem = _global_problem(tokens, 0.95, seed)
    return problem, sum(tokens[:rank]), sum(tokens[:rank + 1]), slice(rank * (E // P), (rank + 1) * (E // P))


def _grouped_vs_loop(rank, P, group):
    """bf16: the torch._grouped_mm path (local + borrowed weight stacks) gives
    the per-expert-GEMM result; run where torch has _grouped_mm on CPU."""
    global E, I
    E, I = 8, 16  # grouped_mm wants 16-byte aligned rows: bf16 dims multiple of 8
    (x, ids, tw, wgu, wd, gy), lo, hi, es = _rank_share(rank, P, 11)
    outs = []
    for grouped in (False, True):
        st = LLEPStats()
        leaves = [x[lo:hi].to(torch.bfloat16).requires_grad_(), tw[lo:hi].float().requires_grad_(),
                  wgu[es].to(torch.bfloat16).requires_grad_(), wd[es].to(torch.bfloat16).requires_grad_()]
        y = llep_moe(leaves[0], ids[lo:hi], leaves[1], leaves[2], leaves[3], group=group, chunk_rows=24,
                     min_tokens_per_gemm=2, grouped_mm="on" if grouped else "off", stats=st)
        assert st.forward["spilled"]
        outs.append((y.detach(),) + torch.autograd.grad(y, leaves, gy[lo:hi].to(torch.bfloat16)))
        for phase in (st.forward, st.backward):  # > 0: that pass's GEMMs went grouped
            assert (phase["grouped_mm"] > 0) == grouped and not phase["grouped_fallback"], phase
    for a, b in zip(*outs):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def _hf_layout(rank, P, group):
    """Weights passed as Hugging Face's transposed views ([E, 2I, H] and
    [E, H, I] storage) give bitwise the contiguous-weight result over P ranks,
    spilled experts (weights lent and gradients returned) included; the
    gradients have the views' strides."""
    global E
    E = 8
    (x, ids, tw, wgu, wd, gy), lo, hi, es = _rank_share(rank, P, 13)
    outs = []
    for hf in (False, True):
        gu, d = wgu[es].float(), wd[es].float()
        if hf:
            gu, d = gu.transpose(1, 2).contiguous().transpose(1, 2), d.transpose(1, 2).contiguous().transpose(1, 2)
        leaves = [x[lo:hi].float().requires_grad_(), tw[lo:hi].float().requires_grad_(),
                  gu.requires_grad_(), d.requires_grad_()]
        st = LLEPStats()
        y = llep_moe(leaves[0], ids[lo:hi], leaves[1], leaves[2], leaves[3], group=group, chunk_rows=24,
                     min_tokens_per_gemm=2, stats=st)
        assert st.forward["spilled"]
        grads = torch.autograd.grad(y, leaves, gy[lo:hi].float())
        assert grads[2].stride() == gu.stride() and grads[3].stride() == d.stride()
        outs.append((y.detach(),) + grads)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _evicted_group(rank, world):
    """A group registered by llep_moe is evicted once destroyed and dropped;
    its key then raises a clear error instead of reaching a dead group."""
    import gc

    from moepeak.llep.ops import llep_dispatch
    from moepeak.core.process_groups import lookup_group, register_group, registered_group_count
    g = dist.new_group(list(range(world)))
    x, ids, tw = torch.randn(5, H), torch.randint(0, 8, (5, K)), torch.rand(5, K)
    wgu, wd = torch.randn(8 // world, H, 2 * I), torch.randn(8 // world, I, H)
    assert llep_moe(x, ids, tw, wgu, wd, group=g).shape == x.shape
    key = register_group(g)
    assert lookup_group(key) is g and register_group(g) == key
    n = registered_group_count()
    dist.destroy_process_group(g)
    del g
    gc.collect()
    assert registered_group_count() == n - 1
    with pytest.raises(ValueError, match="no longer exists"):
        lookup_group(key)
    with pytest.raises(ValueError, match="no longer exists"):
        llep_dispatch(x, ids, tw, wgu, wd, key, 8, 1.0, 1024, 1.3, 0)


def _ranks_main(rank, world):
    """One spawn of 4 ranks runs P = 4 (WORLD), P = 2 and P = 3 (subgroups)."""
    g2 = dist.new_group([0, 1])
    g3 = dist.new_group([0, 1, 2])
    _cases(rank, 4, dist.group.WORLD)
    if rank < 2:
        _cases(rank, 2, g2)
        _errors(rank, g2)
        _module(rank, g2)
        _hf_layout(rank, 2, g2)
        if _cpu_grouped_mm():
            _grouped_vs_loop(rank, 2, g2)
    if rank < 3:
        _cases(rank, 3, g3)
    _evicted_group(rank, world)


def _module(rank, group):
    """PipelinedLLEPMoE over 2 ranks equals the dense block on all experts."""
    import moepeak
    torch.manual_seed(0)  # same router on every rank
    m = moepeak.PipelinedLLEPMoE(8, 16, 8, 2, group=group, chunk_rows=6, min_tokens_per_gemm=1)
    with torch.no_grad():
        m.w_gate_up.normal_(generator=torch.Generator().manual_seed(10 + rank))
        m.w_down.normal_(generator=torch.Generator().manual_seed(20 + rank)).mul_(0.25)
    wgu = [torch.empty_like(m.w_gate_up) for _ in range(2)]
    wd = [torch.empty_like(m.w_down) for _ in range(2)]
    dist.all_gather(wgu, m.w_gate_up.detach(), group=group)
    dist.all_gather(wd, m.w_down.detach(), group=group)
    xs = torch.randn(2, 3, 7, 8, generator=torch.Generator().manual_seed(5))
    y, logits = m(xs[rank])
    yr, lr = refs.moe_block_ref(xs[rank].reshape(-1, 8), m.router.weight, torch.cat(wgu), torch.cat(wd), 2)
    torch.testing.assert_close(y.reshape(-1, 8), yr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, lr)


def _cpu_grouped_mm():
    try:
        torch._grouped_mm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(1, 8, 8, dtype=torch.bfloat16),
                          offs=torch.tensor([2], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _errors(rank, group):
    global E
    E = 8
    x = torch.randn(5, H)
    ids = torch.randint(0, E, (5, K))
    tw = torch.rand(5, K)
    wgu, wd = torch.randn(E // 2, H, 2 * I), torch.randn(E // 2, I, H)
    with pytest.raises(ValueError, match="differs across ranks"):
        llep_moe(x, ids, tw, wgu, wd, group=group, chunk_rows=8 + rank)
    bad = ids.clone()
    if rank == 1:
        bad[2, 1] = E + 3
    with pytest.raises(ValueError, match=r"outside \[0, num_experts=8\) on rank\(s\) \[1\]"):
        llep_moe(x, bad, tw, wgu, wd, group=group)
    # still in step afterwards
    y = llep_moe(x, ids, tw, wgu, wd, group=group, chunk_rows=4)
    assert y.shape == x.shape


def test_llep_multirank_vs_dense():
    run_ranks(4, _ranks_main, timeout=170)
