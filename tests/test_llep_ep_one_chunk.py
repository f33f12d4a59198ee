"""PipelinedLLEP's one-chunk step at P > 1 (moepeak/llep/one_chunk.py) on
gloo ranks: standard EP's single dispatch / grouped GEMMs / combine.

Every path against the dense fp64 reference (tests/refs.py), forward and
every gradient, balanced and 95:4 routing: h and grouped x kept (the lean
backward, dh over h, fused or split gate/up weights; the generic backward
for GPT-OSS with biases), nothing kept (save_budget_mb=0: x re-sent, h
recomputed), forward only (no grad), T = 0 on some ranks, Hugging Face's
transposed weight views.
The chunk budget exactly covering the step's rows gives one chunk, one row
less the chunked schedule, both exact with the same integer plan. The
chunked schedule's default cache fits the room its single-buffered working
set leaves within the same bound. The collectives (a counting transport
through moepeak.testing.llep_transport),
host reads and host->device copies of the one-chunk step are counted, and
the bytes it holds equal llep.sizes.one_chunk_ep_bytes and stay within
the chunked working-set bound. One spawn of 3 ranks runs P = 3 and P = 2."""
import pytest
import torch
import torch.distributed as dist

from moepeak.core import Transport
from moepeak.llep import LLEPStats, llep_moe
from moepeak.llep import plan as lp
from moepeak.llep.sizes import (capped_save_bytes, cache_slots, default_chunk_rows, ep_cache_room, one_chunk_ep_bytes,
                                one_chunk_ep_rows, working_set_bound, workspace_bytes)
from moepeak.testing import llep_transport

try:
    from tests import refs
    from tests.dist_utils import run_ranks
except ImportError:  # spawned ranks import with tests/ on sys.path
    import refs
    from dist_utils import run_ranks

E, K, H, I = 6, 3, 8, 12
NAMES = ("y", "dx", "dtopk_weights", "dw_gate_up", "dw_down", "db_gate_up", "db_down")


class CountingTransport(Transport):
    """Passes every collective on to `inner`, counting them by name."""

    def __init__(self, inner, counts):
        self.inner, self.counts = inner, counts
        self.rank, self.world_size = inner.rank, inner.world_size

    def _count(self, name):
        self.counts[name] = self.counts.get(name, 0) + 1

    def send_recv(self, *args):
        self._count("send_recv")
        return self.inner.send_recv(*args)

    def all_to_all_v(self, *args):
        self._count("all_to_all_v")
        return self.inner.all_to_all_v(*args)

    def all_gather(self, *args):
        self._count("all_gather")
        return self.inner.all_gather(*args)

    def all_reduce_(self, *args, **kw):
        self._count("all_reduce_")
        return self.inner.all_reduce_(*args, **kw)


def _share(rank, P, tokens):
    lo, hi = sum(tokens[:rank]), sum(tokens[:rank + 1])
    El = E // P
    return slice(lo, hi), slice(rank * El, (rank + 1) * El)


def _swiglu_case(rank, P, group, frac, seed, *, split=False, grad=True, hf=False, tokens=None, **kw):
    """llep_moe on this rank's share (fp32) vs the dense fp64 reference;
    returns (forward stats, backward stats, this rank's results)."""
    tokens = tokens or [40 + 7 * r for r in range(P)]
    x, ids, tw, wgu, wd, gy = refs.moe_problem(sum(tokens), E, K, H, I, frac, seed)
    leaves = [t.clone().requires_grad_() for t in (x, tw, wgu, wd)]
    yref = refs.moe_dense_ref(leaves[0], ids, *leaves[1:])
    want = (yref.detach(),) + torch.autograd.grad(yref, leaves, gy)
    ts, es = _share(rank, P, tokens)
    mine = [x[ts].float(), tw[ts].float(), wgu[es].float(), wd[es].float()]
    if hf:  # Hugging Face's storage seen through transpose(1, 2)
        mine[2] = mine[2].transpose(1, 2).contiguous().transpose(1, 2)
        mine[3] = mine[3].transpose(1, 2).contiguous().transpose(1, 2)
    mine = [t.requires_grad_(grad) for t in mine]
    w_gate_up = (mine[2][..., :I], mine[2][..., I:]) if split else mine[2]
    st = LLEPStats()
    y = llep_moe(mine[0], ids[ts], mine[1], w_gate_up, mine[3], group=group, stats=st, **kw)
    fwd = dict(st.forward)
    got = (y.detach(),)
    bwd = {}
    if grad:
        got += torch.autograd.grad(y, mine, gy[ts].float())
        bwd = {**st.forward, **st.backward}
    for name, a, b in zip(NAMES, got, (want[0][ts], want[1][ts], want[2][ts], want[3][es], want[4][es])):
        assert torch.allclose(a.double(), b, rtol=2e-5, atol=2e-5), \
            f"P={P} frac={frac} {kw}: {name} max diff {(a.double() - b).abs().max().item():.3g}"
    if hf and grad:
        assert got[3].stride() == mine[2].stride() and got[4].stride() == mine[3].stride()
    return fwd, bwd, got


def _gpt_oss_case(rank, P, group, frac):
    """GPT-OSS with biases (the generic kept backward; spilled experts' biases travel)."""
    tokens = [30 + 5 * r for r in range(P)]
    g = torch.Generator().manual_seed(21)
    T = sum(tokens)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    gu = 3.0 * torch.randn(E, H, 2 * I, generator=g, dtype=torch.float64) / H ** 0.5
    d = torch.randn(E, I, H, generator=g, dtype=torch.float64) / I ** 0.5
    bgu, bd = torch.randn(E, 2 * I, generator=g, dtype=torch.float64), torch.randn(E, H, generator=g,
                                                                                  dtype=torch.float64)
    ids = refs.skewed_topk_ids(T, E, K, frac, generator=g)
    ids = ids[torch.randperm(T, generator=g)]
    tw = torch.rand(T, K, generator=g, dtype=torch.float64)
    gy = torch.randn(T, H, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, tw, gu, d, bgu, bd)]
    yref = refs.moe_gpt_oss_ref(leaves[0], ids, *leaves[1:])
    want = (yref.detach(),) + torch.autograd.grad(yref, leaves, gy)
    ts, es = _share(rank, P, tokens)
    mine = [t.float().requires_grad_() for t in (x[ts], tw[ts], gu[es], d[es], bgu[es], bd[es])]
    st = LLEPStats()
    y = llep_moe(mine[0], ids[ts], mine[1], mine[2], mine[3], b_gate_up=mine[4], b_down=mine[5],
                 activation="gpt_oss", group=group, min_tokens_per_gemm=2, stats=st)
    fwd = dict(st.forward)
    got = (y.detach(),) + torch.autograd.grad(y, mine, gy[ts].float())
    bwd = {**st.forward, **st.backward}
    wants = (want[0][ts], want[1][ts], want[2][ts]) + tuple(w[es] for w in want[3:])
    for name, a, b in zip(NAMES, got, wants):
        assert torch.allclose(a.double(), b, rtol=2e-5, atol=2e-5), f"gpt_oss P={P} frac={frac}: {name}"
    return fwd, bwd


def _check_bytes(P, fwd, bwd, keep, lean, **options):
    """The tracked peaks are one_chunk_ep_bytes' exactly, and with the kept
    cache within the chunked bound at the default chunk budget (and its
    default cache room; save_budget_mb=0 has none)."""
    R, N = fwd["recv_rows"], fwd["send_rows"]
    cache = 4 * R * (2 * I + H) if keep else 0
    assert fwd["cache_bytes"] == cache
    assert fwd["workspace_bytes"] == one_chunk_ep_bytes(R, N, H, I, 4, False, keep=keep, **options)
    if bwd:
        assert bwd["lean_one_chunk"] == lean
        assert bwd["recomputed_chunks"] == (0 if keep else 1)
        assert bwd["workspace_bytes_bwd"] == one_chunk_ep_bytes(R, N, H, I, 4, True, keep=keep, lean=lean,
                                                                **options)
    C = default_chunk_rows(P)
    bound = working_set_bound(C, H, I, P, 4, True, ep_cache_room(C, H, 4) if keep or not bwd else 0, **options)
    assert max(fwd["workspace_bytes"], bwd.get("workspace_bytes_bwd", 0)) + cache <= bound


def _paths(rank, P, group):
    for frac in (0.0, 0.95):
        kw = dict(min_tokens_per_gemm=2)
        fwd, bwd, _ = _swiglu_case(rank, P, group, frac, 3, **kw)                    # kept, lean backward
        assert fwd["one_chunk_ep"] and fwd["n_chunks"] == 1 and fwd["cached_chunks"] == 1
        assert fwd["spilled"] == (frac > 0)
        _check_bytes(P, fwd, bwd, True, True)
        fwd, bwd, _ = _swiglu_case(rank, P, group, frac, 4, save_budget_mb=0, **kw)  # nothing kept
        assert fwd["one_chunk_ep"] and fwd["cached_chunks"] == 0
        _check_bytes(P, fwd, bwd, False, False)
        fwd, bwd, _ = _swiglu_case(rank, P, group, frac, 5, split=True, **kw)        # kept, lean backward
        assert fwd["one_chunk_ep"]
        _check_bytes(P, fwd, bwd, True, True, split=True)
        fwd, _, _ = _swiglu_case(rank, P, group, frac, 6, grad=False, **kw)          # forward only
        assert fwd["one_chunk_ep"] and fwd["cached_chunks"] == 0
        _check_bytes(P, fwd, {}, False, False)
        fwd, bwd = _gpt_oss_case(rank, P, group, frac)
        assert fwd["one_chunk_ep"] and not bwd["lean_one_chunk"] and fwd["spilled"] == (frac > 0)
        _check_bytes(P, fwd, bwd, True, False, activation="gpt_oss", bias=True)
    fwd, bwd, _ = _swiglu_case(rank, P, group, 0.95, 12, tokens=[50] + [0] * (P - 1), min_tokens_per_gemm=2)
    assert fwd["one_chunk_ep"] and fwd["send_rows"] == (150 if rank == 0 else 0)  # T = 0 on all but rank 0
    outs = [_swiglu_case(rank, P, group, 0.95, 7, hf=hf, min_tokens_per_gemm=2)[2] for hf in (False, True)]
    for a, b in zip(*outs):  # transposed weight views: the contiguous weights' bits
        assert torch.equal(a, b)


def _step_rows(rank, P, group, frac, seed):
    """The most rows any rank sends or receives under the LLEP plan (what the
    one-chunk test compares), from the all-gathered loads."""
    tokens = [40 + 7 * r for r in range(P)]
    ids = refs.moe_problem(sum(tokens), E, K, H, I, frac, seed)[1][_share(rank, P, tokens)[0]]
    cnt = torch.bincount(ids.flatten(), minlength=E)
    loads = [torch.empty_like(cnt) for _ in range(P)]
    dist.all_gather(loads, cnt, group=group)
    S = lp.llep_plan(torch.stack(loads), 1.0, 2, 1.3).S
    return max(int(S.sum(0).max()), int(S.sum(1).max()))


def _boundary(rank, P, group):
    """chunk_rows = the step's rows: one chunk; one row less: chunked. Both
    exact, with the same plan."""
    for frac in (0.0, 0.95):
        rows = _step_rows(rank, P, group, frac, 8)
        fwd1, bwd1, _ = _swiglu_case(rank, P, group, frac, 8, chunk_rows=rows, min_tokens_per_gemm=2)
        fwdc, bwdc, _ = _swiglu_case(rank, P, group, frac, 8, chunk_rows=rows - 1, min_tokens_per_gemm=2)
        assert fwd1["one_chunk_ep"] and fwd1["n_chunks"] == 1 and bwd1["lean_one_chunk"]
        assert not fwdc["one_chunk_ep"] and fwdc["n_chunks"] > 1
        assert fwd1["max_rows"] == max(fwd1["recv_rows"], fwd1["send_rows"]) <= rows
        for key in ("spilled", "borrowed"):
            assert fwd1[key] == fwdc[key]
    # the default budget: one_chunk_ep_rows at the default chunk size decides
    C = default_chunk_rows(P)
    assert one_chunk_ep_rows(C, H, I, P, 4, 0, keep=True, grad=True, lean=True) >= C


def _chunked_default_cache(rank, P, group):
    """Chunked (a small explicit chunk budget), save_budget_mb=None: the
    single-buffered working set leaves ep_cache_room within the bound, which
    caches the first chunks' h; exact, and working set + cache within
    working_set_bound with that room."""
    C = 8
    T = 40 + 7 * rank
    for frac in (0.0, 0.95):
        fwd, bwd, _ = _swiglu_case(rank, P, group, frac, 10, chunk_rows=C, min_tokens_per_gemm=2)
        assert not fwd["one_chunk_ep"] and fwd["n_chunks"] > 1
        room = ep_cache_room(C, H, 4)
        slots = cache_slots(capped_save_bytes(room, T, K, C, H, I, P, 4), T, K, C, I, P, 4)
        assert slots > 0 and fwd["cached_chunks"] == min(slots, fwd["n_chunks"])
        assert fwd["cache_bytes"] == slots * 4 * C * 2 * I <= room
        assert fwd["workspace_bytes"] == workspace_bytes(C, H, I, P, 4, False)
        assert bwd["workspace_bytes_bwd"] == workspace_bytes(C, H, I, P, 4, True)
        assert bwd["recomputed_chunks"] == fwd["n_chunks"] - fwd["cached_chunks"]
        assert bwd["workspace_bytes_bwd"] + fwd["cache_bytes"] <= working_set_bound(C, H, I, P, 4, True, room)


def _counts(rank, P, group):
    """The one-chunk step's collectives, host reads and host->device copies:
    forward one all-gather (loads and config), one all-to-all-v out and one
    back (+ one lending weights when the plan spills), one host read;
    backward no all-gather and no host read, dy rows and pick weights out,
    dx rows and d(pick weight)s back (+ weights lent again and their
    gradients returned when it spills). On CPU: host->device copies of the
    fingerprint and of the permutations (one per pass)."""
    for frac, spill in ((0.0, 0), (0.95, 1)):
        fwd_counts, bwd_counts = {}, {}
        tokens = [40 + 7 * r for r in range(P)]
        x, ids, tw, wgu, wd, gy = refs.moe_problem(sum(tokens), E, K, H, I, frac, 9)
        ts, es = _share(rank, P, tokens)
        leaves = [t.float().requires_grad_() for t in (x[ts], tw[ts], wgu[es], wd[es])]
        st = LLEPStats()
        with llep_transport(lambda tr: CountingTransport(tr, fwd_counts)):
            y = llep_moe(leaves[0], ids[ts], leaves[1], leaves[2], leaves[3], group=group, min_tokens_per_gemm=2,
                         stats=st)
        with llep_transport(lambda tr: CountingTransport(tr, bwd_counts)):
            torch.autograd.grad(y, leaves, gy[ts].float())
        fwd, bwd = st.forward, st.backward
        assert fwd["one_chunk_ep"] and fwd["spilled"] == bool(spill) and bwd["lean_one_chunk"]
        assert fwd_counts == {"all_gather": 1, "all_to_all_v": 2 + spill}, fwd_counts
        assert bwd_counts == {"all_to_all_v": 4 + 2 * spill}, bwd_counts
        assert (fwd["host_syncs"], fwd["h2d_copies"]) == (1, 2)
        assert (bwd["host_syncs"], bwd["h2d_copies"]) == (0, 1)


def _bad_kept_cache(rank, P, group):
    """A kept cache of the wrong size is reported (on every rank, before any
    collective) instead of being read out of bounds."""
    from moepeak.llep.ops import llep_dispatch, llep_dispatch_backward
    from moepeak.core.process_groups import register_group
    tokens = [40 + 7 * r for r in range(P)]
    x, ids, tw, wgu, wd, gy = (t.float() if t.is_floating_point() else t
                               for t in refs.moe_problem(sum(tokens), E, K, H, I, 0.0, 11))
    ts, es = _share(rank, P, tokens)
    args = (x[ts], ids[ts], tw[ts], wgu[es], wd[es], register_group(group), 64, 1.0, 2, 1.3)
    st = LLEPStats()
    _, cache, load, send_index = llep_dispatch(*args, 0, None, None, None, "swiglu", 1 << 20, True, stats=st.key)
    R = st.forward["recv_rows"]
    assert st.forward["one_chunk_ep"] and cache.shape == (1, R * (2 * I + H))
    with pytest.raises(ValueError, match="kept one-chunk cache"):
        llep_dispatch_backward(gy[ts], *args, cache[:, 1:], None, None, None, "swiglu", load, send_index, 1 << 20,
                               True)


def _ranks_main(rank, world):
    g2 = dist.new_group([0, 1])
    _paths(rank, 3, dist.group.WORLD)
    _boundary(rank, 3, dist.group.WORLD)
    if rank < 2:
        _paths(rank, 2, g2)
        _boundary(rank, 2, g2)
        _chunked_default_cache(rank, 2, g2)
        _counts(rank, 2, g2)
        _bad_kept_cache(rank, 2, g2)


def test_one_chunk_ep_on_gloo_ranks():
    run_ranks(3, _ranks_main, timeout=170)


def test_one_chunk_ep_rows_at_the_issue_shapes():
    """At E128 K4 H = I = 2880 bf16 on 2 ranks (default chunk budget 16384,
    default cache room) the kept lean one-chunk step covers 8k tokens per
    rank (32768 rows each way) with room for the routing's spread below the
    imbalance threshold (1.3 x): 49145 rows; at 32k tokens (131072 rows) the
    schedule stays chunked. Per row: forward's and backward's peak above
    the cache and the cache itself, within the chunked bound."""
    C, H_, I_, b = 16384, 2880, 2880, 2
    room = ep_cache_room(C, H_, b)
    assert room == 540 << 20
    rows = one_chunk_ep_rows(C, H_, I_, 2, b, room, keep=True, grad=True, lean=True, grouped=True)
    assert rows == 49145
    assert 1.3 * 32768 <= rows < 131072
    bound = working_set_bound(C, H_, I_, 2, b, True, room)
    for bwd in (False, True):
        peak = one_chunk_ep_bytes(rows, rows, H_, I_, b, bwd, keep=True, lean=True, grouped=True)
        assert peak + b * rows * (2 * I_ + H_) + b * C * 2 * I_ <= bound
    # nothing kept and no gradient: the forward alone bounds the rows
    assert one_chunk_ep_rows(C, H_, I_, 2, b, room, keep=False, grad=False, lean=False, grouped=True) > rows


# ---------------------------------------------------------------------------
# Two GPUs, NCCL (skipped below 2 GPUs): the one-chunk step through
# torch._grouped_mm (bf16) and fp32 GEMMs, pinned host->device copies
# ---------------------------------------------------------------------------
def _two_gpus(rank, P):
    import os
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", rank)
    group = dist.group.WORLD
    E2, K2, H2, I2, tokens = 8, 4, 64, 96, (300, 237)
    ts, es = slice(sum(tokens[:rank]), sum(tokens[:rank + 1])), slice(rank * E2 // P, (rank + 1) * E2 // P)
    for frac in (0.0, 0.95):
        x, ids, tw, wgu, wd, gy = (t.to(dev) for t in refs.moe_problem(sum(tokens), E2, K2, H2, I2, frac, 17))

        def dense(dtype):
            leaves = [t.to(dtype).requires_grad_() for t in (x, tw, wgu, wd)]
            y = refs.moe_dense_ref(leaves[0], ids, *leaves[1:])
            out = (y.detach(),) + torch.autograd.grad(y, leaves, gy.to(dtype))
            return [out[0][ts], out[1][ts], out[2][ts], out[3][es], out[4][es]]

        truth, bf = dense(torch.float64), dense(torch.bfloat16)
        for dtype in (torch.float32, torch.bfloat16):
            counts = {}
            leaves = [x[ts].to(dtype).requires_grad_(), tw[ts].float().requires_grad_(),
                      wgu[es].to(dtype).requires_grad_(), wd[es].to(dtype).requires_grad_()]
            st = LLEPStats()
            with llep_transport(lambda tr: CountingTransport(tr, counts)):
                y = llep_moe(leaves[0], ids[ts], leaves[1], leaves[2], leaves[3], group=group,
                             min_tokens_per_gemm=2, stats=st)
                got = (y.detach(),) + torch.autograd.grad(y, leaves, gy[ts].to(dtype))
            fwd, bwd = st.forward, st.backward
            case = f"rank {rank} frac={frac} {dtype}"
            assert fwd["one_chunk_ep"] and bwd["lean_one_chunk"] and fwd["host_syncs"] == 1, (case, fwd)
            assert bwd["host_syncs"] == 0 and fwd["spilled"] == (frac > 0), (case, bwd)
            spill = int(frac > 0)
            assert counts == {"all_gather": 1, "all_to_all_v": 6 + 3 * spill}, (case, counts)
            if dtype == torch.bfloat16:
                assert fwd["grouped_mm"] > 0, (case, fwd)
            for name, a, t, b in zip(NAMES, got, truth, bf):
                err = (a.double() - t).abs().max().item()
                if dtype == torch.float32:
                    assert torch.allclose(a.double(), t, rtol=1e-4, atol=1e-4), f"{case}: {name} {err:.3g}"
                else:  # at most 2x torch's bf16 dense layer's error
                    eb = (b.double() - t).abs().max().item()
                    assert err <= 2 * eb + 1e-4 * t.abs().max().item(), f"{case}: {name} {err:.3g} vs {eb:.3g}"


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs 2 CUDA GPUs (this machine has {torch.cuda.device_count()})")
def test_one_chunk_ep_two_gpus_nccl():
    run_ranks(2, _two_gpus, timeout=240, backend="nccl")
