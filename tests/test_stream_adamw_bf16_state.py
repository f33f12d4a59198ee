"""StreamAdamW(state_dtype=torch.bfloat16): exp_avg / exp_avg_sq / max_exp_avg_sq in bf16 on
the host, fp32 masters. The reference: torch.optim.AdamW(fused=True) run one step at a time
on the widened state, then the kernel's stochastic rounding emulated (tests/refs.py,
sr_expected) with the seed rounding_seed + the param's index and the param's own step.
Also: the same bits through the bucket pipeline (split buckets, params without grads),
overlap_backward and clip_grad_norm; state_dict round trips and a bitwise resume; torch's
fp32 dicts loaded (rounded to nearest) and ours loaded by torch; device_state params kept
fp32; the host-room count; the options and sizes homes; bad input named."""
import copy
import inspect
import io
import pickle

import pytest
import torch

import moepeak
from moepeak.core import host_memory
from moepeak.stream_adamw import StreamAdamWOptions, sizes
from moepeak.stream_adamw.op import stream_adamw
from refs import adamw_fused_step_ref, sr_expected

BF16 = torch.bfloat16
SHAPES = [(37,), (5, 300), (4099,)]


def bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_bitwise(got, want, what):
    assert got.dtype == want.dtype, f"{what}: {got.dtype} vs {want.dtype}"
    diff = int((bits(got) != bits(want)).sum())
    assert diff == 0, f"{what}: {diff} of {got.numel()} elements differ"


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in SHAPES]


def _groups(ps):
    return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.0}]


def _grads(ps, step, gen):
    """Step `step`'s grads (in each param's dtype); param 1 gets none on step 2."""
    return [None if (i == 1 and step == 2) else (torch.randn(p.shape, generator=gen) * (3.0 if step % 2 else 0.1))
            .to(p.dtype) for i, p in enumerate(ps)]


def _run(opt, ps, steps, seed=5, first=1):
    gen = torch.Generator().manual_seed(seed)
    for t in range(first, first + steps):
        for p, g in zip(ps, _grads(ps, t, gen)):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_reference_fused_then_stochastic_rounding(dtype, amsgrad, maximize):
    ps = _params(dtype)
    opt = moepeak.StreamAdamW(_groups(ps), lr=1e-2, weight_decay=1e-2, amsgrad=amsgrad, maximize=maximize,
                              state_dtype=BF16, rounding_seed=12345)
    hyper = [(1e-2, 1e-2), (1e-2, 1e-2), (3e-3, 0.0)]
    ref = [dict(master=p.detach().float().clone(), m=torch.zeros(p.shape, dtype=BF16),
                v=torch.zeros(p.shape, dtype=BF16), vm=torch.zeros(p.shape, dtype=BF16) if amsgrad else None,
                step=0) for p in ps]
    gen = torch.Generator().manual_seed(5)
    for t in range(1, 5):
        grads = _grads(ps, t, gen)
        for p, g in zip(ps, grads):
            p.grad = g
        opt.step()
        for i, (r, g) in enumerate(zip(ref, grads)):
            if g is None:
                continue
            r["step"] += 1
            lr, wd = hyper[i]
            out = adamw_fused_step_ref(r["master"], r["m"].float(), r["v"].float(),
                                       None if r["vm"] is None else r["vm"].float(), g.float(), r["step"],
                                       lr=lr, wd=wd, maximize=maximize)
            r["master"] = out[0]
            r["m"], r["v"], r["vm"] = sr_expected(out[1], out[2], out[3], 12345 + i, r["step"])
    for i, (p, r) in enumerate(zip(ps, ref)):
        st = opt.state[p]
        assert st["rounding_seed"] == 12345 + i and float(st["step"]) == r["step"]
        assert_bitwise(p.detach(), r["master"].to(dtype), f"param {i}")
        if dtype != torch.float32:
            assert_bitwise(st["master_param"], r["master"], f"master {i}")
        for k, key in (("m", "exp_avg"), ("v", "exp_avg_sq"), ("vm", "max_exp_avg_sq")):
            if r[k] is not None:
                assert st[key].shape == p.shape
                assert_bitwise(st[key], r[k], f"{key} {i}")
        assert amsgrad or "max_exp_avg_sq" not in st


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucket_pipeline_and_overlap_give_the_same_bits(dtype):
    """The host bucket pipeline (params split over buckets, the element index carried across
    the split, a param without a grad keeping its plan row) and overlap_backward (updates in
    backward, several jobs) store the bits of the in-place CPU path."""
    runs = {}
    for name, kw in (("in_place", {}), ("pipeline", dict(_host_pipeline=True, bucket_mb=2e-3)),
                     ("pipeline_threads", dict(_host_pipeline=True, bucket_mb=1e-2, threads=2, isa="scalar"))):
        ps = _params(dtype)
        opt = moepeak.StreamAdamW(_groups(ps), lr=1e-2, amsgrad=True, state_dtype=BF16, rounding_seed=7, **kw)
        _run(opt, ps, 4)
        runs[name] = (ps, opt)
    for name in ("pipeline", "pipeline_threads"):
        for i, (a, b) in enumerate(zip(runs["in_place"][0], runs[name][0])):
            assert_bitwise(b.detach(), a.detach(), f"{name} param {i}")
            for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                assert_bitwise(runs[name][1].state[b][k], runs["in_place"][1].state[a][k], f"{name} {k} {i}")


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def _mlp_steps(model, opt, steps, seed=3):
    """Fit y = tanh(x W) for a fixed random W, fresh batches each step; the losses."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 4, generator=gen)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ w))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("clip", [None, 0.5])
def test_overlap_backward_and_clip_bitwise_the_plain_step(clip):
    out = []
    for kw in ({}, dict(overlap_backward=True, bucket_mb=4e-3)):
        model = _mlp()
        opt = moepeak.StreamAdamW(model.parameters(), lr=1e-2, state_dtype=BF16, clip_grad_norm=clip, **kw)
        out.append((model, opt, _mlp_steps(model, opt, 3)))
    (m0, o0, l0), (m1, o1, l1) = out
    assert l0 == l1
    if clip is None:
        assert o1.overlap_stats()["params_in_backward"] > 0
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert_bitwise(b.detach(), a.detach(), "param")
        assert_bitwise(o1.state[b]["exp_avg_sq"], o0.state[a]["exp_avg_sq"], "exp_avg_sq")


def _through_torch_save(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("how", ["state_dict", "deepcopy", "pickle"])
def test_resume_is_bitwise(how):
    """3 steps, then a resumed optimizer (its state_dict through torch.save into a new
    optimizer built with another rounding_seed: the saved seeds win; or a deepcopy/pickle
    of the whole) and the original take 3 more steps on the same grads: the same bits."""
    ps = _params(BF16)
    opt = moepeak.StreamAdamW(_groups(ps), lr=1e-2, amsgrad=True, state_dtype=BF16, rounding_seed=11)
    _run(opt, ps, 3)
    if how == "state_dict":
        sd = _through_torch_save(opt.state_dict())
        assert {sd["state"][i]["exp_avg"].dtype for i in sd["state"]} == {BF16}
        assert [sd["state"][i]["rounding_seed"] for i in range(3)] == [11, 12, 13]
        assert sd["state"][0]["master_param"].dtype == torch.float32
        ps2 = [p.detach().clone().requires_grad_(True) for p in ps]
        opt2 = moepeak.StreamAdamW(_groups(ps2), lr=1e-2, amsgrad=True, state_dtype=BF16, rounding_seed=999)
        opt2.load_state_dict(sd)
    else:
        ps2, opt2 = copy.deepcopy((ps, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((ps, opt)))
    assert opt2.options.state_dtype == BF16
    _run(opt, ps, 3, seed=8, first=4)
    _run(opt2, ps2, 3, seed=8, first=4)
    for i, (a, b) in enumerate(zip(ps, ps2)):
        assert_bitwise(b.detach(), a.detach(), f"param {i}")
        for k in ("master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert_bitwise(opt2.state[b][k], opt.state[a][k], f"{k} {i}")


def test_torch_fp32_dict_loads_rounded_to_nearest_and_ours_loads_into_torch():
    ps = _params(torch.float32)
    ref = torch.optim.AdamW(_groups([p for p in ps]), lr=1e-2, fused=True)
    _run(ref, ps, 2)
    ours_ps = [p.detach().clone().requires_grad_(True) for p in ps]
    ours = moepeak.StreamAdamW(_groups(ours_ps), lr=1e-2, state_dtype=BF16, rounding_seed=40)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    for a, b in zip(ps, ours_ps):
        for k in ("exp_avg", "exp_avg_sq"):
            assert_bitwise(ours.state[b][k], ref.state[a][k].to(BF16), f"{k} rounded to nearest even")
        assert "rounding_seed" not in ours.state[b]
    m0, v0 = ours.state[ours_ps[0]]["exp_avg"].clone(), ours.state[ours_ps[0]]["exp_avg_sq"].clone()
    p0 = ours_ps[0].detach().clone()
    g = torch.randn(ours_ps[0].shape)
    ours_ps[0].grad = g
    ours.step()  # the first step after the load: seed 40 + index 0, step 3
    want = adamw_fused_step_ref(p0, m0.float(), v0.float(), None, g, 3)
    want_m, want_v, _ = sr_expected(want[1], want[2], None, 40, 3)
    assert ours.state[ours_ps[0]]["rounding_seed"] == 40
    assert_bitwise(ours_ps[0].detach(), want[0], "param")
    assert_bitwise(ours.state[ours_ps[0]]["exp_avg"], want_m, "exp_avg")
    assert_bitwise(ours.state[ours_ps[0]]["exp_avg_sq"], want_v, "exp_avg_sq")
    # ours into torch's AdamW: torch casts the moments to the params' dtype (exact widening)
    back_ps = [p.detach().clone().requires_grad_(True) for p in ours_ps]
    back = torch.optim.AdamW(_groups(back_ps), lr=1e-2)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert_bitwise(back.state[back_ps[0]]["exp_avg"], ours.state[ours_ps[0]]["exp_avg"].float(), "widened")
    _run(back, back_ps, 1)
    # and a bf16 dict into an fp32 StreamAdamW: widened exactly
    f32 = moepeak.StreamAdamW(_groups([p.detach().clone().requires_grad_(True) for p in ps]), lr=1e-2)
    f32.load_state_dict(copy.deepcopy(ours.state_dict()))
    p = f32.param_groups[0]["params"][0]
    assert_bitwise(f32.state[p]["exp_avg_sq"], ours.state[ours_ps[0]]["exp_avg_sq"].float(), "widened")


def test_device_state_params_keep_fp32_state():
    """device_state params (here on the CPU, their own device) keep fp32 state, updated by
    torch's fused kernel (bitwise torch.optim.AdamW); the others bf16."""
    ps = _params(torch.float32)
    ref_ps = [p.detach().clone().requires_grad_(True) for p in ps]
    opt = moepeak.StreamAdamW(_groups(ps), lr=1e-2, state_dtype=BF16, device_state=[ps[2]])
    ref = torch.optim.AdamW(_groups(ref_ps), lr=1e-2, fused=True)
    _run(opt, ps, 3)
    _run(ref, ref_ps, 3)
    st = opt.state[ps[2]]
    assert st["exp_avg"].dtype == torch.float32 and "rounding_seed" not in st
    assert_bitwise(ps[2].detach(), ref_ps[2].detach(), "device_state param")
    assert_bitwise(st["exp_avg_sq"], ref.state[ref_ps[2]]["exp_avg_sq"], "device_state exp_avg_sq")
    assert opt.state[ps[0]]["exp_avg"].dtype == BF16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_room_and_sizes_count_the_bf16_state(monkeypatch, dtype):
    p = torch.nn.Parameter(torch.randn(1000, 100).to(dtype))
    opt = moepeak.StreamAdamW([p], lr=1e-2, state_dtype=BF16)
    p.grad = torch.randn_like(p)
    need = 1000 * 100 * (4 if dtype == torch.float32 else 8)  # m, v bf16 (+ the fp32 master)
    assert need == p.numel() * sizes.state_bytes_per_param(dtype, BF16, in_place=True)
    monkeypatch.setattr(host_memory, "available_bytes", lambda pinned: need - 1)
    with pytest.raises(MemoryError, match=rf"needs {need / 2**30:.2f} GiB of host memory"):
        opt.step()
    assert not opt.state[p]
    monkeypatch.setattr(host_memory, "available_bytes", lambda pinned: need)
    opt.step()
    held = sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k not in ("step", "rounding_seed"))
    assert held == need


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_sizes_match_the_state_created(dtype, state_dtype, amsgrad):
    """sizes.state_bytes_per_param is what the optimizer allocates (CPU params in place, and
    through the host pipeline, where an fp32 param gets its master copy as a CUDA one does);
    sizes.device_state_bytes_per_param what a device_state param holds."""
    for pipeline in (False, True):
        p = torch.nn.Parameter(torch.randn(333).to(dtype))
        opt = moepeak.StreamAdamW([p], amsgrad=amsgrad, state_dtype=state_dtype, _host_pipeline=pipeline)
        p.grad = torch.randn_like(p)
        opt.step()
        held = sum(t.nbytes for t in opt.state[p].values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        held += sum(t.nbytes for t in opt._gpu_master.values())
        assert held == 333 * sizes.state_bytes_per_param(dtype, state_dtype, amsgrad=amsgrad, in_place=not pipeline)
    p = torch.nn.Parameter(torch.randn(333).to(dtype))
    opt = moepeak.StreamAdamW([p], amsgrad=amsgrad, state_dtype=state_dtype, device_state=[p])
    p.grad = torch.randn_like(p)
    opt.step()
    held = sum(t.nbytes for t in opt.state[p].values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    assert held == 333 * sizes.device_state_bytes_per_param(dtype, amsgrad=amsgrad)


def test_sizes_formulas_and_their_errors():
    assert sizes.state_bytes_per_param(torch.bfloat16) == sizes.state_bytes_per_param(2) == 12
    assert sizes.state_bytes_per_param(torch.bfloat16, BF16) == 8
    assert sizes.state_bytes_per_param(torch.float32, BF16, in_place=True) == 4
    assert sizes.state_bytes_per_param(torch.float32, BF16, amsgrad=True) == 10
    assert sizes.device_state_bytes_per_param(torch.bfloat16) == 12
    assert sizes.device_state_bytes_per_param(torch.float32, amsgrad=True) == 12
    assert sizes.pinned_staging_bytes() == 160 * 2 ** 20  # 3 + 2 slots of 16 Mi bf16 elements
    assert sizes.pinned_staging_bytes(1, grad_dtype=torch.float32, param_dtype=4) == 5 * 2 ** 20
    assert sizes.bucket_elements() == 16 * 2 ** 20 and sizes.bucket_elements(1e-9) == 16
    for bad in (torch.float64, torch.int16, 3, True, "bf16"):
        with pytest.raises(ValueError, match="state_dtype must be torch.float32, torch.bfloat16"):
            sizes.state_bytes_per_param(2, bad)


def test_options_are_the_one_home_of_the_defaults():
    """Every schedule keyword of the constructor defaults to StreamAdamWOptions' field, and
    lands in opt.options."""
    sig = inspect.signature(moepeak.StreamAdamW.__init__).parameters
    fields = {f: getattr(StreamAdamWOptions, f) for f in StreamAdamWOptions.__dataclass_fields__}
    for f, default in fields.items():
        key = "_host_pipeline" if f == "host_pipeline" else f
        assert sig[key].default == default, f
    p = torch.nn.Parameter(torch.randn(3))
    opt = moepeak.StreamAdamW([p], bucket_mb=2, threads=1, isa="scalar", grad_slots=4, param_slots=3,
                              clip_grad_norm=1.0, device_state=p, state_dtype=BF16, rounding_seed=5)
    assert opt.options == StreamAdamWOptions(bucket_mb=2, threads=1, isa="scalar", grad_slots=4, param_slots=3,
                                             clip_grad_norm=1.0, device_state=(p,), state_dtype=BF16,
                                             rounding_seed=5)
    assert opt.options.device_state == (p,)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(state_dtype=torch.float16), ValueError, r"state_dtype must be torch.float32 or torch.bfloat16, got "
                                                  r"torch.float16"),
    (dict(state_dtype="bfloat16"), ValueError, r"state_dtype must be torch.float32 or torch.bfloat16"),
    (dict(state_dtype=torch.float64), ValueError, r"state_dtype must be"),
    (dict(rounding_seed=-1), ValueError, r"rounding_seed must be an int in \[0, 2\^63\), got -1"),
    (dict(rounding_seed=1 << 63), ValueError, r"rounding_seed must be an int"),
    (dict(rounding_seed=1.5), ValueError, r"rounding_seed must be an int"),
    (dict(grad_slots=1), ValueError, r"grad_slots must be an int >= 2, got 1"),
    (dict(param_slots=0), ValueError, r"param_slots must be an int >= 1, got 0"),
    (dict(bucket_mb=0), ValueError, r"bucket_mb must be a number > 0"),
    (dict(threads=0), ValueError, r"threads must be None or an int in \[1, 256\]"),
    (dict(device_state=3), TypeError, r"device_state must be None, a param or an iterable of params, got int"),
])
def test_bad_options_named_before_anything_exists(kw, exc, match):
    with pytest.raises(exc, match=match):
        moepeak.StreamAdamW([torch.nn.Parameter(torch.randn(3))], **kw)


def test_bad_state_named_and_nothing_changed():
    ps = _params(torch.float32)
    opt = moepeak.StreamAdamW(_groups(ps), lr=1e-2, state_dtype=BF16)
    _run(opt, ps, 1)
    before = [p.detach().clone() for p in ps]
    opt.state[ps[1]]["exp_avg"] = opt.state[ps[1]]["exp_avg"].float()  # an fp32 moment in bf16 state
    with pytest.raises(TypeError, match=r"params'\]\[1\].*state 'exp_avg' must be a contiguous bfloat16 CPU tensor"):
        _run(opt, ps, 1)
    opt.state[ps[1]]["exp_avg"] = opt.state[ps[1]]["exp_avg"].to(BF16)
    opt.state[ps[0]]["rounding_seed"] = -3
    with pytest.raises(TypeError, match=r"params'\]\[0\].*'rounding_seed' must be an int in \[0, 2\^63\)"):
        _run(opt, ps, 1)
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
    assert {float(opt.state[p]["step"]) for p in ps} == {1.0}
    opt.state[ps[0]]["rounding_seed"] = 0
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2]["rounding_seed"] = "x"
    fresh = moepeak.StreamAdamW(_groups([p.detach().clone().requires_grad_(True) for p in ps]), state_dtype=BF16)
    with pytest.raises(TypeError, match=r"load_state_dict: state 2 'rounding_seed' must be an int"):
        fresh.load_state_dict(sd)
    assert not fresh.state


def test_opcheck_bf16_state():
    n = 37
    masters = [torch.randn(n), torch.randn(n)]
    lp = masters[1].to(BF16)
    args = ([torch.empty(0), lp], [torch.randn(n), torch.randn(n).to(BF16)], masters,
            [torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)],
            [torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)], [torch.empty(0), torch.zeros(n, dtype=BF16)],
            [1.0, 1.0], [1e-3, 1e-3], [0.9, 0.9], [0.999, 0.999], [1e-8, 1e-8], [0.01, 0.0], [False, True])
    torch.library.opcheck(stream_adamw, args, kwargs=dict(state_dtype=1, seeds=[3, (1 << 63) - 1]))
    with pytest.raises(TypeError, match=r"exp_avgs\[0\] must be a contiguous torch.float32 CPU tensor"):
        stream_adamw(*args)  # bf16 state named as fp32


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_pipeline_bitwise_the_cpu_kernel(dtype):
    """CUDA params through the pinned pipeline (buckets split) store the bits of the same
    params on the CPU: one kernel, one rounding per (seed, step, element index)."""
    cpu = _params(dtype)
    gpu = [p.detach().cuda().requires_grad_(True) for p in cpu]
    o_cpu = moepeak.StreamAdamW(_groups(cpu), lr=1e-2, amsgrad=True, state_dtype=BF16, rounding_seed=3)
    o_gpu = moepeak.StreamAdamW(_groups(gpu), lr=1e-2, amsgrad=True, state_dtype=BF16, rounding_seed=3,
                                bucket_mb=2e-3)
    gen = torch.Generator().manual_seed(5)
    for t in range(1, 5):
        for a, b, g in zip(cpu, gpu, _grads(cpu, t, gen)):
            a.grad, b.grad = g, None if g is None else g.cuda()
        o_cpu.step()
        o_gpu.step()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        assert_bitwise(b.detach().cpu(), a.detach(), f"param {i}")
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert_bitwise(o_gpu.state[b][k], o_cpu.state[a][k], f"{k} {i}")
    assert o_gpu.pinned_bytes() <= sizes.pinned_staging_bytes(2e-3, grad_dtype=dtype, param_dtype=dtype) \
        + 3 * 5 * sizes.SEGMENT_ALIGN


def test_loss_curve_stays_near_fp32_state():
    """60 steps of a tiny MLP (lr 1e-2) from the same weights on the same batches: the loss
    falls more than 10x with either state dtype, and bf16 state's loss stays within 1%
    (relative) of fp32 state's at every step (measured: 0.08%; the demo's 1000-step curves:
    benchmarks/bench_bf16_state.py)."""
    curves = {}
    for sd in (torch.float32, BF16):
        model = _mlp(seed=1)
        opt = moepeak.StreamAdamW(model.parameters(), lr=1e-2, weight_decay=0.0, state_dtype=sd)
        curves[sd] = _mlp_steps(model, opt, 60, seed=4)
    f32, b16 = curves[torch.float32], curves[BF16]
    assert f32[-1] < f32[0] / 10 and b16[-1] < b16[0] / 10
    rel = max(abs(a - b) / a for a, b in zip(f32, b16))
    assert rel < 0.01, rel
    assert f32 != b16  # the state dtype is live


def test_demo_selects_bf16_state():
    """`moepeak demo --state-dtype bfloat16` reaches StreamAdamW (the run itself:
    benchmarks/bench_bf16_state.py)."""
    from moepeak.demo import build_parser
    from moepeak.demo.config import build_optimizer
    assert build_parser().parse_args(["--state-dtype", "bfloat16"]).state_dtype == "bfloat16"
    assert build_parser().parse_args([]).state_dtype is None
    p = torch.nn.Parameter(torch.randn(4))
    assert build_optimizer([p], "stream", state_dtype=BF16).options.state_dtype == BF16
    assert build_optimizer([p], "stream").options == StreamAdamWOptions()
