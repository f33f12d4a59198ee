"""StreamAdamW: bitwise vs torch's fused CPU AdamW, low-precision params,
state_dict interchange, training, bad input, the torch op, and (on a GPU) the
bucket pipeline's numerics, stream ordering and memory."""
import copy

import pytest
import torch

import moepeak
from moepeak import _C
from moepeak.stream_adamw.op import stream_adamw
from refs import adamw_step_ref

BEST = _C.cpu_best_isa()
ISAS = [
    pytest.param(name, marks=pytest.mark.skipif(code > BEST, reason=f"this CPU lacks {name}"))
    for name, code in (("scalar", 0), ("avx2", 1), ("avx512", 2))
]


def _pair(n, wd, isa, lr=1e-3, betas=(0.9, 0.999)):
    p0 = torch.randn(n)
    a = p0.clone().requires_grad_(True)
    b = p0.clone().requires_grad_(True)
    ref = torch.optim.AdamW([a], lr=lr, betas=betas, weight_decay=wd, fused=True)
    ours = moepeak.StreamAdamW([b], lr=lr, betas=betas, weight_decay=wd, isa=isa)
    return a, b, ref, ours


def _assert_same_state(ref, ours, a, b):
    assert torch.equal(a.detach(), b.detach()), f"param max diff {(a - b).abs().max().item()}"
    for k in ("exp_avg", "exp_avg_sq"):
        ra, rb = ref.state[a][k], ours.state[b][k]
        assert torch.equal(ra, rb), f"{k} max diff {(ra - rb).abs().max().item()}"
    assert float(ref.state[a]["step"]) == float(ours.state[b]["step"])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wd", [0.0, 1e-2])
@pytest.mark.parametrize("n", [1, 17, 2**20 + 3])
def test_bitwise_vs_torch_fused(n, wd, isa):
    torch.manual_seed(n)
    a, b, ref, ours = _pair(n, wd, isa)
    for _ in range(20):
        g = torch.randn(n)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    _assert_same_state(ref, ours, a, b)


@pytest.mark.parametrize("isa", ISAS)
def test_bitwise_small_beta1_branch(isa):
    # beta1 < 0.5 takes the other lerp branch (base = grad)
    torch.manual_seed(1)
    a, b, ref, ours = _pair(1000, 0.1, isa, lr=1e-2, betas=(0.3, 0.9))
    for _ in range(5):
        g = torch.randn(1000)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    _assert_same_state(ref, ours, a, b)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_cpu_params(dtype, isa):
    """bf16/fp16 params: the fp32 master is bitwise torch's fused AdamW run on
    fp32 params with the same (widened) grads, and the param is the master
    rounded to nearest even (exactly torch's .to(dtype)). Versus an fp64
    reference the param is within 1 ulp of its dtype (the master's own error
    is ~1e-7 relative: checked at 1e-5)."""
    torch.manual_seed(3)
    n = 4099
    p32 = torch.randn(n)
    lp = p32.to(dtype).requires_grad_(True)
    ref_p = lp.detach().float().requires_grad_(True)
    ref = torch.optim.AdamW([ref_p], lr=1e-2, weight_decay=1e-2, fused=True)
    ours = moepeak.StreamAdamW([lp], lr=1e-2, weight_decay=1e-2, isa=isa)
    p64, m64, v64 = lp.detach().double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for t in range(1, 11):
        g = torch.randn(n).to(dtype)
        lp.grad = g.clone()
        ref_p.grad = g.float()
        ref.step()
        ours.step()
        adamw_step_ref(p64, g, m64, v64, t, 1e-2, weight_decay=1e-2)
    master = ours.state[lp]["master_param"]
    assert torch.equal(master, ref_p.detach())
    assert torch.equal(lp.detach(), ref_p.detach().to(dtype))
    assert torch.allclose(master.double(), p64, rtol=1e-5, atol=1e-6), (master.double() - p64).abs().max()
    ulp = torch.finfo(dtype).eps * p64.abs().clamp_min(torch.finfo(dtype).tiny)
    err = (lp.detach().double() - p64).abs()
    assert (err <= ulp).all(), f"max err {err.max().item()}, mean {err.mean().item()}"


def _run(opt, params, grads):
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()


def test_state_dict_roundtrip_both_ways():
    torch.manual_seed(4)
    shapes = [(33, 7), (129,)]
    grads = [[torch.randn(s) for s in shapes] for _ in range(10)]
    init = [torch.randn(s) for s in shapes]

    def fresh():
        return [t.clone().requires_grad_(True) for t in init]

    # torch -> ours: 5 steps in torch, load into ours, 5 more == 10 in torch
    pt, po, pr = fresh(), fresh(), fresh()
    t_opt = torch.optim.AdamW(pt, lr=1e-2, fused=True)
    _run(t_opt, pt, grads[:5])
    with torch.no_grad():
        for a, b in zip(po, pt):
            a.copy_(b)
    o_opt = moepeak.StreamAdamW(po, lr=1e-2)
    o_opt.load_state_dict(copy.deepcopy(t_opt.state_dict()))
    _run(o_opt, po, grads[5:])
    r_opt = torch.optim.AdamW(pr, lr=1e-2, fused=True)
    _run(r_opt, pr, grads)
    for a, b in zip(po, pr):
        assert torch.equal(a, b)
        _assert_same_state(r_opt, o_opt, b, a)
    sd = o_opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}

    # ours -> torch
    pt2, po2 = fresh(), fresh()
    o2 = moepeak.StreamAdamW(po2, lr=1e-2)
    _run(o2, po2, grads[:5])
    with torch.no_grad():
        for a, b in zip(pt2, po2):
            a.copy_(b)
    t2 = torch.optim.AdamW(pt2, lr=1e-2, fused=True)
    t2.load_state_dict(copy.deepcopy(o2.state_dict()))
    for a, b in zip(pt2, po2):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(t2.state[a][k], o2.state[b][k])
        assert float(t2.state[a]["step"]) == 5.0
    # the saved param_groups replace torch's (fused=True is not one of our
    # group keys), so ask for the fused kernel again to compare bitwise
    for g in t2.param_groups:
        g["fused"] = True
    _run(t2, pt2, grads[5:])
    for a, b in zip(pt2, pr):
        assert torch.equal(a, b)
    # ours -> ours
    po3 = fresh()
    o3 = moepeak.StreamAdamW(po3, lr=1e-2)
    with torch.no_grad():
        for a, b in zip(po3, po2):
            a.copy_(b)
    o3.load_state_dict(copy.deepcopy(o2.state_dict()))
    _run(o3, po3, grads[5:])
    for a, b in zip(po3, pr):
        assert torch.equal(a, b)


def test_bf16_master_survives_state_dict():
    torch.manual_seed(5)
    p = torch.randn(300).bfloat16().requires_grad_(True)
    o = moepeak.StreamAdamW([p], lr=1e-2)
    p.grad = torch.randn(300).bfloat16()
    o.step()
    sd = copy.deepcopy(o.state_dict())
    q = p.detach().clone().requires_grad_(True)
    o2 = moepeak.StreamAdamW([q], lr=1e-2)
    o2.load_state_dict(sd)
    assert o2.state[q]["master_param"].dtype == torch.float32
    assert torch.equal(o2.state[q]["master_param"], o.state[p]["master_param"])


def test_model_trains_like_torch_adamw():
    torch.manual_seed(6)
    x, y = torch.randn(256, 16), torch.randn(256, 1)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    net2 = copy.deepcopy(net)
    net3 = copy.deepcopy(net)
    ours = moepeak.StreamAdamW(net.parameters(), lr=1e-2)
    fused = torch.optim.AdamW(net2.parameters(), lr=1e-2, fused=True)
    plain = torch.optim.AdamW(net3.parameters(), lr=1e-2)
    losses = {0: [], 1: [], 2: []}
    for _ in range(40):
        for k, (m, o) in enumerate(((net, ours), (net2, fused), (net3, plain))):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            losses[k].append(loss.item())
    assert losses[0] == losses[1]  # bitwise, clipping included
    assert losses[0][-1] < 0.5 * losses[0][0]
    assert max(abs(a - b) for a, b in zip(losses[0], losses[2])) < 1e-4


def test_lr_scheduler_grad_none_and_groups():
    torch.manual_seed(7)
    ps = [torch.randn(50, requires_grad=True) for _ in range(3)]
    qs = [p.detach().clone().requires_grad_(True) for p in ps]
    groups = lambda xs: [{"params": xs[:2]}, {"params": xs[2:], "weight_decay": 0.0, "lr": 3e-3}]  # noqa: E731
    ours = moepeak.StreamAdamW(groups(ps), lr=1e-2)
    ref = torch.optim.AdamW(groups(qs), lr=1e-2, fused=True)
    s1 = torch.optim.lr_scheduler.StepLR(ours, step_size=2, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    for t in range(6):
        for i, (p, q) in enumerate(zip(ps, qs)):
            if i == 1 and t % 2:  # grad None: skipped
                p.grad = q.grad = None
                continue
            g = torch.randn(50)
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        s1.step()
        s2.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    ours.zero_grad()
    assert all(p.grad is None for p in ps)


def test_bad_input_and_nothing_half_updated():
    good = torch.randn(10, requires_grad=True)
    bad = torch.randn(10, requires_grad=True)
    opt = moepeak.StreamAdamW([good, bad], lr=1e-2)
    good.grad = torch.randn(10)
    before = good.detach().clone()

    def expect(exc, match):
        with pytest.raises(exc, match=match):
            opt.step()
        assert torch.equal(good.detach(), before)  # nothing half-updated
        assert good not in opt.state or float(opt.state[good]["step"]) == 0.0

    bad.grad = torch.randn(10).to_sparse()
    expect(TypeError, r"params'\]\[1\].*sparse")
    bad.grad = torch.randn(20)[::2]
    expect(ValueError, r"params'\]\[1\].*contiguous")
    # a param of another dtype is refused at construction (test_stream_adamw_copy.py); one whose
    # .data changed dtype after it still is, by step()
    dbad = torch.randn(4, requires_grad=True)
    dopt = moepeak.StreamAdamW([dbad])
    dbad.data = dbad.data.double()
    dbad.grad = torch.randn(4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"params'\]\[0\].*float32, bfloat16 or float16"):
        dopt.step()
    cbad = torch.randn(4, requires_grad=True)
    copt = moepeak.StreamAdamW([cbad])
    cbad.data = torch.randn(4, dtype=torch.complex64)
    cbad.grad = torch.randn(4, dtype=torch.complex64)
    with pytest.raises(TypeError, match="complex"):
        copt.step()
    # device change between steps
    bad.grad = torch.randn(10)
    opt.step()
    before = good.detach().clone()
    step_before = float(opt.state[good]["step"])
    opt._devices[bad] = torch.device("meta")  # as if its first step ran on another device (GPU test: real move)
    with pytest.raises(ValueError, match=r"params'\]\[1\].*moved from meta to cpu"):
        opt.step()
    assert torch.equal(good.detach(), before) and float(opt.state[good]["step"]) == step_before
    # hyper-parameters
    for kw, match in [(dict(lr=-1.0), "lr"), (dict(eps=-1e-8), "eps"), (dict(betas=(1.0, 0.9)), r"betas\[0\]"),
                      (dict(betas=(0.9, -0.1)), r"betas\[1\]"), (dict(weight_decay=-0.1), "weight_decay"),
                      (dict(isa="avx1024"), "isa"), (dict(clip_grad_norm=0.0), "clip_grad_norm")]:
        with pytest.raises(ValueError, match=match):
            moepeak.StreamAdamW([torch.randn(3, requires_grad=True)], **kw)
    for kw, match in [(dict(amsgrad=1), "amsgrad"), (dict(maximize="yes"), "maximize"),
                      (dict(overlap_backward=None), "overlap_backward")]:
        with pytest.raises(TypeError, match=match):
            moepeak.StreamAdamW([torch.randn(3, requires_grad=True)], **kw)
    p = torch.randn(3, requires_grad=True)
    o = moepeak.StreamAdamW([p])
    o.param_groups[0]["lr"] = -1.0
    p.grad = torch.randn(3)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\]"):
        o.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slots", [(3, 2), (2, 1), (5, 3)])
def test_bucket_pipeline_schedule_on_host(dtype, slots):
    """The bucket pipeline's schedule (split/packed buckets, slot rings, grads
    that are None on some steps, empty params) run on CPU tensors with memcpy
    for the copies: bitwise torch's fused AdamW on fp32 masters; the params
    are the masters rounded to their dtype."""
    torch.manual_seed(13)
    sizes = [(3000, 101), (17,), (1,), (513, 257), (0,), (70000,)]
    init = [torch.randn(s) for s in sizes]
    ours_p = [t.to(dtype).requires_grad_(True) for t in init]
    ref_p = [t.to(dtype).float().requires_grad_(True) for t in init]
    # bucket_mb = 0.25: 65536 fp32 elements per bucket -> the 303000-element
    # param spans 5 buckets, small ones are packed with pieces of big ones
    ours = moepeak.StreamAdamW(ours_p, lr=1e-2, bucket_mb=0.25, grad_slots=slots[0], param_slots=slots[1],
                               _host_pipeline=True)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, fused=True)
    for t in range(8):
        for i, (a, b) in enumerate(zip(ours_p, ref_p)):
            if i == 1 and t % 3 == 1:
                a.grad = b.grad = None
                continue
            g = torch.randn(a.shape).to(dtype)
            a.grad, b.grad = g, g.float()
        ours.step()
        ref.step()
    assert ours._plan.nbuckets == 8
    for a, b in zip(ours_p, ref_p):
        assert torch.equal(a.detach(), b.detach().to(dtype))
        if a.numel():
            assert torch.equal(ours.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"])


def _dtensor_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(12)
    full = [torch.randn(17, 5), torch.randn(33)]
    grads = [[torch.randn(t.shape) for t in full] for _ in range(4)]
    dps = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
    locs = [d.to_local().detach().clone().requires_grad_(True) for d in dps]
    ours = moepeak.StreamAdamW(dps, lr=1e-2)
    ref = torch.optim.AdamW(locs, lr=1e-2, fused=True)
    for gs in grads:
        for d, loc, g in zip(dps, locs, gs):
            d.grad = distribute_tensor(g, mesh, [Shard(0)])
            loc.grad = d.grad.to_local().clone()
        ours.step()
        ref.step()
    for d, loc in zip(dps, locs):
        assert torch.equal(d.to_local(), loc.detach()), f"rank {rank}: shard differs"
        assert torch.equal(ours.state[d]["exp_avg_sq"], ref.state[loc]["exp_avg_sq"])

    # state_dict(): a DTensor param's state is a DTensor (its mesh, placements, global shape),
    # so torch.distributed.checkpoint keeps every rank's shard; self.state stays plain.
    from torch.distributed.tensor import DTensor
    sd = ours.state_dict()
    for i, d in enumerate(dps):
        for k in ("exp_avg", "exp_avg_sq"):
            v = sd["state"][i][k]
            assert isinstance(v, DTensor) and v.shape == d.shape and v.placements == d.placements
            assert torch.equal(v.to_local(), ours.state[d][k])
            assert type(ours.state[d][k]) is torch.Tensor
        assert sd["state"][i]["step"].dim() == 0
    # load_state_dict accepts it, and the same state as plain local-shard tensors
    plain_sd = {"param_groups": sd["param_groups"],
                "state": {i: {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in st.items()}
                          for i, st in sd["state"].items()}}
    for src in (sd, plain_sd):
        other = [torch.nn.Parameter(d.detach().clone()) for d in dps]
        o = moepeak.StreamAdamW(other, lr=1e-2)
        o.load_state_dict(src)
        for d, e in zip(dps, other):
            for k in ("exp_avg", "exp_avg_sq"):
                assert type(o.state[e][k]) is torch.Tensor and torch.equal(o.state[e][k], ours.state[d][k])
        for d, e in zip(dps, other):  # one more step: the same update
            e.grad = d.grad = distribute_tensor(torch.ones(d.shape), mesh, [Shard(0)])
        o.step()
    ours.step()
    for d, e in zip(dps, other):
        assert torch.equal(d.to_local(), e.to_local()), (rank, (d.to_local() - e.to_local()).abs().max(),
                                                          ours.state[d]["step"], o.state[e]["step"])


def test_dtensor_params_update_local_shards():
    from dist_utils import run_ranks

    run_ranks(2, _dtensor_rank)


def test_opcheck_cpu():
    torch.manual_seed(8)
    n = 37
    masters = [torch.randn(n), torch.randn(n)]
    lp = masters[1].to(torch.bfloat16)
    args = ([torch.empty(0), lp], [torch.randn(n), torch.randn(n).bfloat16()], masters,
            [torch.zeros(n), torch.zeros(n)], [torch.zeros(n), torch.zeros(n)], [torch.empty(0), torch.zeros(n)],
            [1.0, 1.0], [1e-3, 1e-3], [0.9, 0.9], [0.999, 0.999], [1e-8, 1e-8], [0.01, 0.0], [False, True])
    torch.library.opcheck(stream_adamw, args)


# ---------------------------------------------------------------------------
# GPU: the bucket pipeline
# ---------------------------------------------------------------------------
def _cuda_vs_cpu_fused(dtype, bucket_mb, sizes, steps=10):
    """Our CUDA pipeline's fp32 master must be bitwise torch's fused AdamW on
    CPU fp32 with the same (widened) grads: the same C kernel runs."""
    torch.manual_seed(9)
    init = [torch.randn(s) for s in sizes]
    gpu = [t.to("cuda", dtype).requires_grad_(True) for t in init]
    cpu = [t.to(dtype).float().requires_grad_(True) for t in init]
    ours = moepeak.StreamAdamW(gpu, lr=1e-2, bucket_mb=bucket_mb)
    ref = torch.optim.AdamW(cpu, lr=1e-2, fused=True)
    for t in range(steps):
        for i, (a, b) in enumerate(zip(gpu, cpu)):
            if i == 1 and t % 3 == 1:  # grad None: skipped by both
                a.grad = b.grad = None
                continue
            g = torch.randn(a.shape, device="cuda").to(dtype)
            a.grad = g
            b.grad = g.float().cpu()
        ours.step()
        ref.step()
    torch.cuda.synchronize()
    return gpu, cpu, ours, ref


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_pipeline_matches_cpu_fused(dtype):
    # sizes chosen so tensors are split across buckets and packed together
    sizes = [(3000, 1001), (17,), (1,), (513, 257)]
    gpu, cpu, ours, _ = _cuda_vs_cpu_fused(dtype, bucket_mb=1, sizes=sizes)
    for a, b in zip(gpu, cpu):
        assert torch.equal(a.cpu(), b.detach().to(dtype))


def _vs_torch_cuda_fused(dtype, sizes, bucket_mb, steps=10):
    torch.manual_seed(10)
    init = [torch.randn(s) for s in sizes]
    ours_p = [t.to("cuda", dtype).requires_grad_(True) for t in init]
    ref_p = [t.to(dtype).to("cuda", torch.float32).requires_grad_(True) for t in init]
    ours = moepeak.StreamAdamW(ours_p, lr=1e-3, bucket_mb=bucket_mb)
    ref = torch.optim.AdamW(ref_p, lr=1e-3, fused=True)
    for _ in range(steps):
        for a, b in zip(ours_p, ref_p):
            g = torch.randn(a.shape, device="cuda").to(dtype)
            a.grad, b.grad = g, g.float()
        ours.step()
        ref.step()
    torch.cuda.synchronize()
    return ours_p, ref_p, ours


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_vs_torch_cuda_fused(dtype):
    """Versus torch's CUDA fused AdamW on fp32 params (it rounds differently
    from the CPU kernel: ~1e-7 absolute after 10 steps, so rtol 1e-5 / atol
    1e-6 on fp32). bf16: the master obeys the fp32 bound, the param is exactly
    the master rounded, and so |param - ref| <= 1 bf16 ulp of |ref| + 1e-6.
    (A bound of 1 ulp alone fails where the update cancels the param to ~1e-6:
    there 1e-7 of fp32 noise is many ulps; seen on the H200 and reproduced on
    the CPU with the host pipeline, whose master is bitwise torch's CPU fused.)"""
    ours_p, ref_p, ours = _vs_torch_cuda_fused(dtype, [(1 << 20,), (4097,)], bucket_mb=2)
    for a, b in zip(ours_p, ref_p):
        b = b.detach()
        if dtype == torch.float32:
            torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)
            continue
        mst = ours.state[a]["master_param"]
        torch.testing.assert_close(mst.cuda(), b, rtol=1e-5, atol=1e-6)
        assert torch.equal(a.detach(), mst.cuda().to(dtype))
        bound = torch.finfo(dtype).eps * b.abs() + 1e-6
        err = (a.detach().float() - b).abs()
        assert (err <= bound).all(), f"max {err.max().item()} mean {err.mean().item()}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_master_vs_torch_cuda_fp32(dtype):
    """The fp32 master of low-precision CUDA params, through split and packed
    buckets (bucket_mb=0.5: 128 Ki elements), versus torch's CUDA fused AdamW
    run on fp32 params with the same widened grads: fp32 noise only (a race
    or a wrong offset would give errors of order lr or of the values)."""
    sizes = [(1000, 1001), (17,), (1,), (513, 257), (300000,)]
    ours_p, ref_p, ours = _vs_torch_cuda_fused(dtype, sizes, bucket_mb=0.5, steps=12)
    assert ours._plan.nbuckets > 8
    for a, b in zip(ours_p, ref_p):
        mst = ours.state[a]["master_param"]
        torch.testing.assert_close(mst.cuda(), b.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(a.detach(), mst.cuda().to(dtype))


@pytest.mark.cuda
def test_cuda_device_change_is_an_error():
    p = torch.randn(8, device="cuda", requires_grad=True)
    o = moepeak.StreamAdamW([p])
    p.grad = torch.randn(8, device="cuda")
    o.step()
    p.data = p.data.cpu()
    p.grad = torch.randn(8)
    with pytest.raises(ValueError, match=r"params'\]\[0\].*moved from cuda:0 to cpu"):
        o.step()


@pytest.mark.cuda
def test_cuda_opcheck():
    n = 1000
    args = ([torch.randn(n, device="cuda").bfloat16()], [torch.randn(n, device="cuda").bfloat16()],
            [torch.randn(n)], [torch.zeros(n)], [torch.zeros(n)], [torch.zeros(n)], [1.0], [1e-3], [0.9], [0.999],
            [1e-8], [0.01], [True])
    torch.library.opcheck(stream_adamw, args)


@pytest.mark.cuda
def test_cuda_stream_ordering_and_memory():
    """Step right after a slow 'backward' with no synchronize: the D2H must
    wait for it (else it reads the stale grads), and a read right after step
    on the current stream must see the new params (else it reads the old)."""
    torch.manual_seed(11)
    n = 1 << 26  # 64 Mi bf16 elements: each H2D takes ~ms
    p = torch.randn(n, device="cuda").bfloat16().requires_grad_(True)
    ref_p = p.detach().float().cpu().requires_grad_(True)
    ours = moepeak.StreamAdamW([p], lr=1e-2, bucket_mb=16)
    ref = torch.optim.AdamW([ref_p], lr=1e-2, fused=True)
    p.grad = torch.zeros_like(p)
    for _ in range(2):
        g = torch.randn(n, device="cuda").bfloat16()
        ref_p.grad = g.float().cpu()
        ref.step()
        torch.cuda.synchronize()
        p.grad.fill_(0)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream
        p.grad.copy_(g)  # the grads become final only after the sleep
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ours.step()
        peak = torch.cuda.max_memory_allocated() - before
        seen = p.detach().float()  # current stream, no sync
        torch.cuda.synchronize()
        assert peak <= 16 << 20  # <= one bucket (the pipeline allocates no GPU memory at all)
        assert torch.equal(seen.cpu(), ref_p.detach().bfloat16().float())
    # pinned slots: 3 grad + 2 param slots of one bucket (4 Mi bf16 elements)
    assert 0 < ours.pinned_bytes() <= 5 * (4 << 20) * 2


@pytest.mark.cuda
def test_cuda_state_dict_with_torch_cuda_fused():
    """torch CUDA fused AdamW -> StreamAdamW -> torch CUDA fused: the state moves
    both ways (fp32 CPU in ours, param device/dtype in torch) and training
    continues; CUDA and CPU arithmetic differ by roundings: rtol 1e-5."""
    torch.manual_seed(14)
    init = [torch.randn(1000, 3), torch.randn(77)]
    grads = [[torch.randn(t.shape, device="cuda") for t in init] for _ in range(9)]
    a = [t.cuda().requires_grad_(True) for t in init]
    ref = [t.cuda().requires_grad_(True) for t in init]
    ta = torch.optim.AdamW(a, lr=1e-2, fused=True)
    tr = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    _run(ta, a, grads[:3])
    ours = moepeak.StreamAdamW(a, lr=1e-2)
    ours.load_state_dict(copy.deepcopy(ta.state_dict()))
    assert ours.state[a[0]]["exp_avg"].device.type == "cpu"
    _run(ours, a, grads[3:6])
    tb = torch.optim.AdamW(a, lr=1e-2, fused=True)
    tb.load_state_dict(copy.deepcopy(ours.state_dict()))
    for g in tb.param_groups:
        g["fused"] = True
    assert tb.state[a[0]]["exp_avg"].device.type == "cuda"
    _run(tb, a, grads[6:])
    _run(tr, ref, grads)
    for x, y in zip(a, ref):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-5, atol=1e-6)


def test_step_bumps_param_versions():
    """step() calls the op's body directly (no dispatcher) outside
    torch.compile; autograd's in-place check must still see the update."""
    p = torch.randn(10, requires_grad=True)
    q = torch.randn(10).bfloat16().requires_grad_(True)
    o = moepeak.StreamAdamW([p, q])
    p.grad, q.grad = torch.randn(10), torch.randn(10).bfloat16()
    y = (p * p).sum()  # saves p for backward
    v0, w0 = p._version, q._version
    o.step()
    assert p._version > v0 and q._version > w0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_pipeline_streaming_stores_per_isa(dtype, isa):
    """The pipeline writes the new params into its slots with streaming
    stores where aligned (per ISA; odd sizes give unaligned starts): same
    bits as torch's fused AdamW rounded to the param dtype."""
    torch.manual_seed(15)
    sizes = [(40001,), (3,), (77777,), (16,)]
    init = [torch.randn(s) for s in sizes]
    ours_p = [t.to(dtype).requires_grad_(True) for t in init]
    ref_p = [t.to(dtype).float().requires_grad_(True) for t in init]
    ours = moepeak.StreamAdamW(ours_p, lr=1e-2, bucket_mb=0.1, isa=isa, threads=2, _host_pipeline=True)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, fused=True)
    for _ in range(3):
        for a, b in zip(ours_p, ref_p):
            g = torch.randn(a.shape).to(dtype)
            a.grad, b.grad = g, g.float()
        ours.step()
        ref.step()
    for a, b in zip(ours_p, ref_p):
        assert torch.equal(a.detach(), b.detach().to(dtype))


# ---------------------------------------------------------------------------
# state sizes, torch interchange (fused key)
# ---------------------------------------------------------------------------
def _stepped(dtype=torch.float32, n=64, host_pipeline=False):
    p = torch.randn(n, dtype=dtype, requires_grad=True)
    opt = moepeak.StreamAdamW([p], lr=1e-2, _host_pipeline=host_pipeline)
    p.grad = torch.randn_like(p)
    opt.step()
    return p, opt


@pytest.mark.parametrize("host_pipeline", [False, True])
@pytest.mark.parametrize("dtype,new_n", [(torch.float32, 4096), (torch.float32, 16), (torch.bfloat16, 65536),
                                         (torch.bfloat16, 16)])
def test_replaced_param_data_of_another_size_raises(dtype, new_n, host_pipeline):
    p, opt = _stepped(dtype, n=64, host_pipeline=host_pipeline)
    p.data = torch.randn(new_n, dtype=dtype)
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\].*size mismatch.*64 elements.*"
                                           rf"has {new_n}"):
        opt.step()
    assert torch.equal(p.detach(), before)  # nothing touched


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_replaced_state_tensor_of_another_size_raises(key):
    p, opt = _stepped()
    opt.state[p][key] = torch.zeros(1 << 16)
    p.grad = torch.randn_like(p)
    with pytest.raises(RuntimeError, match=rf"size mismatch: state '{key}' has 65536 elements"):
        opt.step()
    opt.state[p][key] = torch.zeros(64, dtype=torch.float64)
    with pytest.raises(TypeError, match=rf"state '{key}' must be a contiguous float32 CPU tensor"):
        opt.step()


def test_loaded_state_dict_of_another_size_raises():
    _, big = _stepped(n=4096)
    p, opt = _stepped(n=64)
    before = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(RuntimeError, match=r"load_state_dict: size mismatch.*4096 elements.*has 64"):
        opt.load_state_dict(big.state_dict())
    assert all(torch.equal(before[k], v) for k, v in opt.state[p].items())


def test_state_dict_carries_fused_so_torch_runs_the_same_kernel():
    torch.manual_seed(0)
    p = torch.randn(1000, requires_grad=True)
    q = p.detach().clone().requires_grad_(True)
    ours = moepeak.StreamAdamW([p], lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        ours.step()
    sd = ours.state_dict()
    assert sd["param_groups"][0]["fused"] is True
    with torch.no_grad():
        q.copy_(p)
    ref = torch.optim.AdamW([q], lr=1e-2)  # constructed non-fused: the loaded group decides
    ref.load_state_dict(copy.deepcopy(sd))  # a copy: torch would share our step tensors
    assert ref.param_groups[0]["fused"] is True
    for _ in range(3):
        g = torch.randn_like(p)
        p.grad, q.grad = g, g.clone()
        ours.step()
        ref.step()
    assert torch.equal(p, q)
    assert torch.equal(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
    back = moepeak.StreamAdamW([p], lr=1e-2)  # and a torch AdamW's dict loads back into ours
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert back.param_groups[0]["fused"] is True


def _threads_of_process():
    import os
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs /proc")
def test_oversized_thread_pool_released_when_optimizer_dies():
    import gc
    want = _C.get_num_threads() + 6
    p = torch.randn(16384 * want, requires_grad=True)  # one pool grain per requested thread
    p.grad = torch.randn_like(p)
    moepeak.StreamAdamW([p], lr=1e-3).step()  # warm-up: torch's and the default pool's threads exist
    base_workers, base_threads = _C.pool_workers(), _threads_of_process()
    for i in range(200):
        opt = moepeak.StreamAdamW([p], lr=1e-3, threads=want)
        if i % 10 == 0:  # every tenth steps (the pool grows to the request); all 200 are dropped
            opt.step()
            assert _C.pool_workers() >= want - 1  # the request was served
        del opt
        gc.collect()
        assert _C.pool_workers() <= max(base_workers, _C.get_num_threads() - 1)
    assert _threads_of_process() <= base_threads


def test_adamw_plan_step_rejects_overflowing_arguments():
    # A malformed call must raise, never reach memory: run it in a child so a
    # crash (the unchecked overflow) fails this test instead of killing pytest.
    import subprocess
    import sys
    code = r'''
import array, torch
from moepeak import _C
segs = array.array("q", [0, 0, 4, 0, 0])
plan = _C.adamw_plan_create(segs, array.array("q", [0, 1]), 1, 64, 64, 3, 2, True)
p, m, v, g = (torch.zeros(4) for _ in range(4))
hyp = array.array("d", [1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 0.0])
bad = [
    [p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), p.data_ptr(), (1 << 63) - 1, 0, 0, 0],  # huge numel
    [p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), p.data_ptr(), 2, 0, 0, 0],  # segment beyond the param
    [p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), 0, 4, 0, 0, 0],  # null param
    [0, m.data_ptr(), v.data_ptr(), g.data_ptr(), p.data_ptr(), 4, 0, 0, 0],  # null master
]
for row in bad:
    try:
        _C.adamw_plan_step(plan, array.array("q", row), hyp, 0, 0, 1, 1 << 30, 16)
    except ValueError:
        pass
    else:
        raise SystemExit(f"accepted {row}")
for tt, tv in ((0, 16), (1 << 30, 16), (1, -1), (1, 1 << 20)):
    try:
        _C.adamw_plan_step(plan, array.array("q", [p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(),
                                                   p.data_ptr(), 4, 0, 0, 0]), hyp, 0, 0, 1, tt, tv)
    except ValueError:
        pass
    else:
        raise SystemExit(f"accepted torch_threads={tt} torch_vlen={tv}")
for seg in ([0, (1 << 63) - 8, 16, 0, 0], [0, 0, 4, 1 << 62, 0], [0, 0, -1, 0, 0]):
    try:
        _C.adamw_plan_create(array.array("q", seg), array.array("q", [0, 1]), 1, 64, 64, 3, 2, True)
    except ValueError:
        pass
    else:
        raise SystemExit(f"plan accepted {seg}")
print("ok")
'''
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-2000:])


def test_pool_trim_bad_input():
    """The pool bindings name the argument and refuse what is out of range, touching nothing."""
    before = _C.pool_workers()
    for bad in (-1, 257):
        with pytest.raises(ValueError, match="keep"):
            _C.pool_trim(bad)
    with pytest.raises(TypeError):
        _C.pool_trim("2")
    assert _C.pool_workers() == before
