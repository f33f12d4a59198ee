"""Two GPUs, real NCCL: Ring-DTP and PipelinedLLEP against single-device
references, with both transports (skipped below 2 GPUs).

Ranks: tests/dist_utils.run_ranks spawns 2 processes on a gloo WORLD; each
binds GPU `rank` and creates
  * an nccl process group over both ranks (torch.distributed's NCCL): the
    schedules reach it through get_transport(group) -> TorchDistTransport;
  * moepeak's own NcclTransport (NCCL called from C, communicator from a
    unique id broadcast over WORLD).
The schedules pick their transport with get_transport(group) (backend "auto",
which is torch.distributed until NCCL is measured faster), so there is no
argument to ask for the C transport: `_use_transport` swaps the module's
get_transport for one that returns the given transport and records the type
of every transport handed out, and each case asserts that the intended one
(and only it) moved the data.

Ring-DTP (V prime: FSDP2's ceil split gives shards of 516 and 515 rows, padded
in the ring; T differs per rank and is not a multiple of chunk_tokens; every
9th label is ignore_index): per rank, loss and dX equal the single-GPU op on
(X_r, W_full), and the dW shard equals those rows of sum_j dW_j (the ring's
contract). fp32: within 2e-5 (norm-wise relative) of the single-GPU op and of
an fp64 reference; bf16: docs/design.md section 4's rule (error vs fp64 at most 2x
naive bf16's + 1e-3), also against the single-GPU op. Both ring variants, both
transports; the two transports give bitwise equal results (the same kernels
and GEMMs on the same bytes; no atomics in the Ring-DTP kernels).

PipelinedLLEP (E = 8 experts, 4 per rank, K = 4; balanced and 95:4 routing,
where 95% of tokens send all 4 picks to experts 0..3, all owned by rank 0):
output, dX, d(topk_weights), dW_gate_up and dW_down of the rank's own experts
(a borrowed expert's gradient must come home to its owner) against the dense
fp64 reference; C = 64 rows (32 per source) gives ~20-40 chunks, so the
double-buffered pipeline runs; with and without the activation cache. fp32:
rtol = atol = 1e-4 (TF32 off); bf16: max error at most 2x torch's bf16 dense
layer + 1e-4 * max|truth| (test_llep_cuda's rule). NCCL C vs torch transport:
equal up to the combine kernel's atomicAdd order (fp32 rounding; one bf16 ulp
after the final rounding), weight gradients bitwise.

Run (2 GPUs):  NCCL_NVLS_ENABLE=0 python -m pytest -q tests/test_multigpu.py
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

try:
    from tests import refs
    from tests.dist_utils import run_ranks
except ImportError:  # rootdir not on sys.path
    import refs
    from dist_utils import run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs 2 CUDA GPUs (this machine has {torch.cuda.device_count()})"),
]


def relerr(a, b) -> float:
    """Norm-wise relative error of a against b (docs/design.md section 4's metric)."""
    a, b = a.double(), b.double()
    n = b.norm()
    return ((a - b).norm() / (n if n > 0 else 1.0)).item()


# ---------------------------------------------------------------------------
# Rank setup and transport selection
# ---------------------------------------------------------------------------
def _setup(rank: int, device: str):
    """(device, group, {transport name: transport or None}). None means
    'whatever get_transport(group) gives' (TorchDistTransport on `group`).
    device "cpu" is a dry run of the same code on the gloo WORLD (no NCCL)."""
    if device == "cpu":
        return torch.device("cpu"), dist.group.WORLD, {"torch": None}
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # read by NCCL at communicator creation
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from moepeak.core import get_transport
    group = dist.new_group(backend="nccl")  # collective over WORLD
    assert dist.get_backend(group) == "nccl"
    ours = get_transport(dist.group.WORLD, device=dev, backend="nccl")
    return dev, group, {"torch": None, "nccl": ours}


_EXPECTED = {"torch": "TorchDistTransport", "nccl": "NcclTransport"}


@contextlib.contextmanager
def _use_transport(module, override):
    """Within the block, `module`'s get_transport returns `override` (when not
    None); yields the list of transport type names handed out."""
    orig = module.get_transport
    used = []

    def pick(group, *args, **kw):
        t = override if (override is not None and group is not None) else orig(group, *args, **kw)
        used.append(type(t).__name__)
        return t

    module.get_transport = pick
    try:
        yield used
    finally:
        module.get_transport = orig


def _close(tps):
    for t in tps.values():
        if t is not None:
            t.close()


# ---------------------------------------------------------------------------
# Ring-DTP
# ---------------------------------------------------------------------------
V, H = 1031, 96           # prime V: shards of 516 and 515 rows
CT, CV = 64, 200          # several token chunks and vocab blocks per shard
FLOOR_BF16 = 1e-3         # tests/ring_dtp_helpers.py's FLOOR for bf16
ALL_OPTS = dict(label_smoothing=0.1, z_loss=1e-3, softcap=20.0)


def _ring_data(P, dtype, dev):
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(V, H, generator=g) * (2.0 / H ** 0.5)   # logits of std ~2
    xs, ys = [], []
    for r in range(P):
        T = 157 + 64 * r
        xs.append(torch.randn(T, H, generator=g).to(dtype).to(dev))
        y = torch.randint(0, V, (T,), generator=g)
        y[::9] = -100
        ys.append(y.to(dev))
    return w.to(dtype).to(dev), xs, ys


def _shard(P, rank):
    per = -(-V // P)
    return min(V, rank * per), min(V, (rank + 1) * per)


def _loss_grads(fn, x, w, y, **kw):
    """(loss, dX, dW) of fn(x, w, y) for fresh leaves."""
    xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(xl, wl, y, **kw)
    loss.backward()
    return loss.detach(), xl.grad, wl.grad


def _ring_expectations(rank, P, w, xs, ys, opts):
    """Per rank: single-GPU op, fp64 reference, naive (same dtype), as
    (loss_r, dX_r, dW_shard) where dW_shard = rows of sum_j dW_j."""
    import moepeak

    a, b = _shard(P, rank)
    out = {}
    fns = {"single": lambda x, w, y: moepeak.linear_cross_entropy(x, w, y, **opts),
           "fp64": lambda x, w, y: refs.ref_linear_cross_entropy(x.double(), w.double(), y, **opts),
           "naive": lambda x, w, y: refs.naive_linear_cross_entropy(x, w, y, **opts)}
    for name, fn in fns.items():
        dw = torch.zeros(V, H, dtype=torch.float64, device=w.device)
        mine = None
        for j in range(P):
            loss, dx, dwj = _loss_grads(fn, xs[j], w, ys[j])
            dw += dwj.double()
            if j == rank:
                mine = (loss, dx)
        out[name] = (mine[0], mine[1], dw[a:b])
    return out


def _ring_rank(rank, P, device="cuda"):
    import moepeak
    from moepeak.ring_dtp import group as ring_dtp_group

    dev, group, tps = _setup(rank, device)
    a, b = _shard(P, rank)
    names = ("loss", "dX", "dW shard")
    configs = [(torch.float32, {}), (torch.float32, ALL_OPTS), (torch.bfloat16, {})]
    for dtype, opts in configs:
        w, xs, ys = _ring_data(P, dtype, dev)
        exp = _ring_expectations(rank, P, w, xs, ys, opts)
        for variant in ("weights", "activations", "gather"):
            got_by_tp = {}
            for tname, override in tps.items():
                with _use_transport(ring_dtp_group, override) as used:  # where the ring picks its transport
                    got = _loss_grads(lambda x, ws, y: moepeak.linear_cross_entropy(
                        x, ws, y, group=group, ring=variant, chunk_tokens=CT, chunk_vocab=CV, **opts),
                        xs[rank], w[a:b], ys[rank])
                assert used and set(used) == {_EXPECTED[tname]}, (tname, used)
                got_by_tp[tname] = got
                case = f"rank {rank} {dtype} opts={sorted(opts)} ring={variant} transport={tname}"
                for i, name in enumerate(names):
                    o, s, r = got[i], exp["single"][i], exp["fp64"][i]
                    assert o.shape == r.shape and o.dtype == (torch.float32 if i == 0 else dtype), \
                        (case, name, o.shape, o.dtype)
                    assert torch.isfinite(o).all(), f"{case}: {name} not finite"
                    es, eo = relerr(o, s), relerr(o, r)
                    if dtype == torch.float32:
                        assert es <= 2e-5 and eo <= 2e-5, \
                            f"{case}: {name} vs single-GPU {es:.3e}, vs fp64 {eo:.3e}"
                    else:
                        en = relerr(exp["naive"][i], r)
                        assert eo <= 2 * en + FLOOR_BF16 and es <= 2 * en + FLOOR_BF16, \
                            f"{case}: {name} vs fp64 {eo:.3e}, vs single-GPU {es:.3e}, naive bf16 {en:.3e}"
            if "nccl" in got_by_tp:
                for i, name in enumerate(names):
                    assert torch.equal(got_by_tp["torch"][i], got_by_tp["nccl"][i]), \
                        f"rank {rank} {dtype} ring={variant}: {name} differs between the NCCL C transport " \
                        f"and torch.distributed (max diff " \
                        f"{(got_by_tp['torch'][i].double() - got_by_tp['nccl'][i].double()).abs().max():.3e})"
        if dtype == torch.float32 and not opts and "nccl" in got_by_tp:
            # the public switch (no monkeypatch): transport="nccl" makes its own shared communicator
            # and must give the NCCL results above bitwise (got_by_tp holds the last variant's)
            got = _loss_grads(lambda x, ws, y: moepeak.linear_cross_entropy(
                x, ws, y, group=group, ring=variant, chunk_tokens=CT, chunk_vocab=CV, transport="nccl"),
                xs[rank], w[a:b], ys[rank])
            for i, name in enumerate(names):
                assert torch.equal(got[i], got_by_tp["nccl"][i]), f"rank {rank}: transport='nccl' {name} differs"
    _close(tps)


def test_ring_dtp_two_gpus_equals_single_gpu():
    run_ranks(2, _ring_rank, timeout=240)


# ---------------------------------------------------------------------------
# PipelinedLLEP
# ---------------------------------------------------------------------------
E, HL, IL, K = 8, 64, 96, 4
TOKENS = (300, 237)
C_ROWS, MIN_GEMM = 64, 2   # 32 rows per source per chunk; spill shares >= 2 tokens


def _llep_problem(frac, dev):
    prob = refs.moe_problem(sum(TOKENS), E, K, HL, IL, frac, 7 + int(frac * 100))
    return tuple(t.to(dev) for t in prob)


def _dense(x, ids, tw, wgu, wd, gy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, tw, wgu, wd)]
    y = refs.moe_dense_ref(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    return (y.detach(),) + torch.autograd.grad(y, leaves, gy)


LLEP_NAMES = ("y", "dx", "dtopk_weights", "dw_gate_up", "dw_down")


def _llep_rank(rank, P, device="cuda"):
    from moepeak import llep
    from moepeak.llep import ops as llep_ops

    dev, group, tps = _setup(rank, device)
    lo, hi = sum(TOKENS[:rank]), sum(TOKENS[:rank + 1])
    El = E // P
    es = slice(rank * El, (rank + 1) * El)
    cases = [(0.0, torch.float32, None), (0.95, torch.float32, None), (0.0, torch.bfloat16, None),
             (0.95, torch.bfloat16, None), (0.95, torch.bfloat16, 0)]
    for frac, dtype, budget in cases:
        x, ids, tw, wgu, wd, gy = _llep_problem(frac, dev)
        truth = _dense(x, ids, tw, wgu, wd, gy)
        truth = (truth[0][lo:hi], truth[1][lo:hi], truth[2][lo:hi], truth[3][es], truth[4][es])
        if dtype == torch.bfloat16:
            bf = _dense(*[t.to(dtype) if t.is_floating_point() else t for t in (x, ids, tw, wgu, wd, gy)])
            bf = (bf[0][lo:hi], bf[1][lo:hi], bf[2][lo:hi], bf[3][es], bf[4][es])
        kw = dict(group=group, chunk_rows=C_ROWS, min_tokens_per_gemm=MIN_GEMM)
        if budget is not None:
            kw["save_budget_mb"] = budget
        got_by_tp = {}
        for tname, override in tps.items():
            leaves = [x[lo:hi].to(dtype).requires_grad_(), tw[lo:hi].float().requires_grad_(),
                      wgu[es].to(dtype).requires_grad_(), wd[es].to(dtype).requires_grad_()]
            stats = llep.LLEPStats()
            with _use_transport(llep_ops, override) as used:  # the module whose ops pick the transport
                y = llep.llep_moe(leaves[0], ids[lo:hi], leaves[1], leaves[2], leaves[3], stats=stats, **kw)
                fwd = stats.forward
                got = (y.detach(),) + torch.autograd.grad(y, leaves, gy[lo:hi].to(dtype))
            assert used and set(used) == {_EXPECTED[tname]}, (tname, used)
            got_by_tp[tname] = got
            case = f"rank {rank} frac={frac} {dtype} budget={budget} transport={tname}"
            # the schedule really pipelined, and spilled exactly under imbalance
            assert fwd["n_chunks"] > 1 and fwd["max_rows"] <= C_ROWS, (case, fwd)
            assert fwd["spilled"] == (frac > 0), (case, fwd)
            assert bool(fwd["borrowed"]) == (frac > 0 and rank == 1), (case, fwd)
            if budget == 0:
                assert fwd["cached_chunks"] == 0, (case, fwd)
            for name, a, t, i in zip(LLEP_NAMES, got, truth, range(5)):
                assert a.shape == t.shape and torch.isfinite(a).all(), (case, name, a.shape, t.shape)
                err = (a.double() - t).abs()
                if dtype == torch.float32:
                    assert torch.allclose(a.double(), t, rtol=1e-4, atol=1e-4), \
                        f"{case}: {name} max diff {err.max().item():.3g} mean {err.mean().item():.3g}"
                else:
                    eb = (bf[i].double() - t).abs().max().item()
                    assert err.max().item() <= 2 * eb + 1e-4 * t.abs().max().item(), \
                        f"{case}: {name} max err {err.max().item():.3g} vs torch bf16 {eb:.3g}"
        if "nccl" in got_by_tp:
            for name, a, b in zip(LLEP_NAMES, got_by_tp["nccl"], got_by_tp["torch"]):
                msg = f"rank {rank} frac={frac} {dtype}: {name} NCCL C vs torch transport"
                if name.startswith("dw") or name == "dtopk_weights":
                    assert torch.equal(a, b), msg  # no atomics on these paths
                elif dtype == torch.float32:
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=msg)
                else:  # the fp32 combine's atomicAdd order, then one bf16 rounding
                    d = (a.double() - b.double()).abs()
                    ulp = b.double().abs().clamp_min(1e-3) * 2.0 ** -7
                    assert (d <= ulp).all() and d.mean() <= 1e-3 * b.double().abs().mean(), \
                        f"{msg}: max diff {d.max().item():.3g}"
    _close(tps)


def test_llep_two_gpus_vs_dense():
    run_ranks(2, _llep_rank, timeout=240)
