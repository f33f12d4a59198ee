"""The CPU AdamW kernel with bf16 optimizer state (moepeak._C.adamw_cpu /
adamw_plan_step with state_dtype=1): exp_avg, exp_avg_sq and max_exp_avg_sq
are widened to fp32, updated exactly as torch.optim.AdamW(fused=True) updates
fp32 state, and stored back with stochastic rounding (SR) keyed by (seed, step,
element index) (csrc/adamw_kernels.h).

The bitwise references: torch's fused AdamW run on the widened state (fp32 p,
m, v, vm), then SR emulated in numpy with the header's hash (tests/refs.py, sr_expected); and the
kernel's own fp32-state path (bitwise torch's, tests/test_stream_adamw.py) for
index ranges torch cannot reach. Plus: fp64 bounds, unbiasedness (z-scores of
many draws of one value), exact values kept, signs, inf/NaN, the same bits for
every ISA, thread count and bucket split, and bad arguments."""
import array
import functools

import pytest
import torch

from moepeak import _C
from moepeak.core.abi import ADAMW_HYPER_ROW, ADAMW_PARAM_ROW, ADAMW_SEGMENT_ROW, BYTES_OF_CODE, DTYPE_CODES
from refs import adamw_fused_step_ref as torch_fused
from refs import adamw_step_ref, sr_expected
from refs import sr_mix64 as mix64

BEST = _C.cpu_best_isa()
ISAS = [
    pytest.param(code, id=name, marks=pytest.mark.skipif(code > BEST, reason=f"this CPU lacks {name}"))
    for name, code in (("scalar", 0), ("avx2", 1), ("avx512", 2))
]
F32, BF16 = DTYPE_CODES[torch.float32], DTYPE_CODES[torch.bfloat16]


def bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_bitwise(got, want, what):
    ok = torch.equal(bits(got), bits(want))
    if not ok:
        bad = (bits(got) != bits(want)).nonzero().flatten()
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} of {got.numel()} differ, first at {i}: "
                             f"{got[i].item()!r} vs {want[i].item()!r}")


# ---------------------------------------------------------------------------
# calling the kernel
# ---------------------------------------------------------------------------
def _addr(t):
    return t.data_ptr() if t is not None and t.numel() > 0 else 0


def row(p, m, v, g, vm=None, lp=None):
    """One ptrs row (moepeak.core.abi.ADAMW_PARAM_ROW)."""
    return ADAMW_PARAM_ROW.row(master=p.data_ptr(), exp_avg=m.data_ptr(), exp_avg_sq=v.data_ptr(), grad=g.data_ptr(),
                               param_lowp=_addr(lp), numel=p.numel(), grad_dtype=DTYPE_CODES[g.dtype],
                               param_dtype=DTYPE_CODES[lp.dtype] if lp is not None else 0, max_exp_avg_sq=_addr(vm))


def hyper(step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=1e-2, maximize=False):
    return ADAMW_HYPER_ROW.row(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd, step=float(step),
                               maximize=float(maximize))


def run_rows(rows, hyps, isa=0, threads=1, tail=(1, 0), **kw):
    _C.adamw_cpu(array.array("q", [x for r in rows for x in r]), array.array("d", [x for h in hyps for x in h]),
                 isa, threads, tail[0], tail[1], **kw)


@functools.lru_cache(maxsize=None)
def tail_model(threads):
    """(torch_threads, torch_vlen) under which the kernel's fp32 path is bitwise torch's fused AdamW
    with `threads` OpenMP threads (the model moepeak's optimizer probes for the same way)."""
    gen = torch.Generator().manual_seed(1234)
    n = 160 * threads + 37
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m0, v0 = torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-3
    want = torch_fused(p0, m0, v0, None, g, 3)
    for cand in [(1, 8), (1, 16), (threads, 8), (threads, 16), (1, 0)]:
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        run_rows([row(p, m, v, g)], [hyper(3)], tail=cand)
        if torch.equal(p, want[0]) and torch.equal(v, want[2]):
            return cand
    raise AssertionError("no scalar-tail model makes the fp32 kernel bitwise torch's fused AdamW")


def bf16_state(n, gen, amsgrad):
    m = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    v = (torch.rand(n, generator=gen) * 1e-3).bfloat16()
    vm = (v.float() * (1 + torch.rand(n, generator=gen))).bfloat16() if amsgrad else None
    return m, v, vm


# ---------------------------------------------------------------------------
# bitwise against torch's fused AdamW + SR emulation
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("n", [17, 4099, 70001])
def test_bitwise_vs_torch_fused_then_stochastic_rounding(n, amsgrad, maximize, isa):
    """Five steps in lockstep: the kernel's p is torch's fused p bitwise, and its bf16 m, v, vm are
    the SR (this file's emulation) of torch's fp32 m, v, vm; each within the stated bound
    |SR(x) - x| < ulp_bf16(x)."""
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    m, v, vm = bf16_state(n, gen, amsgrad)
    ref_p, ref_m, ref_v, ref_vm = p.clone(), m.clone(), v.clone(), None if vm is None else vm.clone()
    tail = tail_model(torch.get_num_threads())
    seed = 0xDEADBEEF12345678
    for step in range(1, 6):
        g = torch.randn(n, generator=gen) * (3.0 if step % 2 else 0.1)
        run_rows([row(p, m, v, g, vm)], [hyper(step, maximize=maximize)], isa=isa, threads=2, tail=tail,
                 state_dtype=BF16, seed=seed)
        out = torch_fused(ref_p, ref_m.float(), ref_v.float(), None if ref_vm is None else ref_vm.float(), g, step,
                          maximize=maximize)
        ref_p = out[0]
        ref_m, ref_v, ref_vm = sr_expected(out[1], out[2], out[3], seed, step)
        assert_bitwise(p, ref_p, f"step {step} p")
        assert_bitwise(m, ref_m, f"step {step} exp_avg")
        assert_bitwise(v, ref_v, f"step {step} exp_avg_sq")
        if amsgrad:
            assert_bitwise(vm, ref_vm, f"step {step} max_exp_avg_sq")
            assert (vm.float() >= v.float()).all()  # one draw for both: the max stays >= v after rounding
        for got, x in ((m, out[1]), (v, out[2])):
            ulp = (2.0 ** (torch.floor(torch.log2(x.double().abs())) - 7)).clamp_min(2.0 ** -133)
            err = (got.double() - x.double()).abs()
            assert (err[x != 0] < ulp[x != 0]).all() and (err[x == 0] == 0).all()


@pytest.mark.parametrize("isa", ISAS)
def test_low_precision_grads_and_param_copy(isa):
    """bf16 grads and a bf16 param copy with bf16 state: torch's fused AdamW on the widened grads."""
    n = 4099
    gen = torch.Generator().manual_seed(7)
    p = torch.randn(n, generator=gen)
    m, v, _ = bf16_state(n, gen, False)
    g = torch.randn(n, generator=gen).bfloat16()
    lp = torch.empty(n, dtype=torch.bfloat16)
    want = torch_fused(p, m.float(), v.float(), None, g.float(), 4)
    want_m, want_v, _ = sr_expected(want[1], want[2], None, 99, 4)
    run_rows([row(p, m, v, g, lp=lp)], [hyper(4)], isa=isa, tail=tail_model(torch.get_num_threads()),
             state_dtype=BF16, seed=99)
    assert_bitwise(p, want[0], "p")
    assert_bitwise(lp, want[0].bfloat16(), "bf16 param copy (round to nearest even)")
    assert_bitwise(m, want_m, "exp_avg")
    assert_bitwise(v, want_v, "exp_avg_sq")


def test_within_bf16_rounding_of_fp64_reference():
    """One step at a time from the kernel's own bf16 state: p within fp32 rounding of an fp64 AdamW step
    (refs.adamw_step_ref), m and v within one bf16 ulp (SR) plus fp32 rounding."""
    n = 20001
    gen = torch.Generator().manual_seed(11)
    p = torch.randn(n, generator=gen)
    m, v, _ = bf16_state(n, gen, False)
    for step in range(1, 8):
        g = torch.randn(n, generator=gen)
        p64, m64, v64 = p.double(), m.double(), v.double()
        # the fp32 update's own rounding, absolute: a few fp32 ulps of its largest terms
        fp32_err = {"m": 2.0 ** -21 * (m64.abs() + 0.1 * g.double().abs()),
                    "v": 2.0 ** -21 * (v64.abs() + 1e-3 * g.double() ** 2)}
        adamw_step_ref(p64, g, m64, v64, step, 1e-2, weight_decay=1e-2)
        run_rows([row(p, m, v, g)], [hyper(step)], isa=BEST, threads=2, state_dtype=BF16, seed=step)
        assert torch.allclose(p.double(), p64, rtol=1e-6, atol=1e-7), (p.double() - p64).abs().max()
        for got, x, name in ((m, m64, "m"), (v, v64, "v")):
            err = (got.double() - x).abs()
            bound = 2.0 ** -7 * (x.abs() + fp32_err[name]) + fp32_err[name] + 2.0 ** -133
            assert (err <= bound).all(), f"{name}: max err/bound {(err / bound).max().item()}"


# ---------------------------------------------------------------------------
# properties of the rounding
# ---------------------------------------------------------------------------
def _moments_equal_grad(x, n, seeds=None, step=1):
    """Run the kernel so that the fp32 m is exactly the grad x and the fp32 v exactly fl(x*x)
    (beta1 = beta2 = 0: m = fma(0, g - m, g), v = fma(g, g, v * 0)); n elements, or one element
    per seed (rows sharing index 0). Returns the stored bf16 (m, v)."""
    betas = (0.0, 0.0)
    if seeds is None:
        p, g = torch.zeros(n), torch.full((n,), x, dtype=torch.float32)
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        run_rows([row(p, m, v, g)], [hyper(step, betas=betas)], isa=BEST, threads=2, state_dtype=BF16, seed=5)
        return m, v
    k = len(seeds)
    p, g = torch.zeros(k), torch.full((k,), x, dtype=torch.float32)
    m, v = torch.zeros(k, dtype=torch.bfloat16), torch.zeros(k, dtype=torch.bfloat16)
    rows = [row(p[i:i + 1], m[i:i + 1], v[i:i + 1], g[i:i + 1]) for i in range(k)]
    run_rows(rows, [hyper(step, betas=betas)] * k, isa=BEST, state_dtype=BF16,
             seed=array.array("q", [s - (1 << 64) if s >= 1 << 63 else s for s in seeds]))
    return m, v


def _z_score(stored, x):
    """(count of draws rounded away from zero - expectation) / its standard deviation, for bf16 draws
    `stored` of the fp32 value x; also checks every draw is one of x's two bf16 neighbours."""
    x32 = torch.tensor(x, dtype=torch.float32)
    down = x32.view(torch.int32) & ~0xFFFF
    lo = down.view(torch.float32).item()
    hi = (down + 0x10000).view(torch.float32).item()
    vals = stored.float()
    assert ((vals == lo) | (vals == hi)).all(), "a draw is not a bf16 neighbour of x"
    frac = (int(x32.view(torch.int32)) & 0xFFFF) / 65536.0  # x = lo + frac * (hi - lo)
    n = stored.numel()
    ups = int((vals == hi).sum())  # the sample mean is lo + (hi - lo) * ups / n
    return (ups - n * frac) / max((n * frac * (1 - frac)) ** 0.5, 1e-12)


@pytest.mark.parametrize("x", [1.0 + 2.0 ** -9, 1.0 / 3.0, -2.7182817, 1.0e30, 3.0e-39, -1.2e-5])
def test_rounding_is_unbiased(x):
    """E[SR(x)] = x: 2^16 draws over element indices (one seed), and 4096 draws over seeds (one
    index): the count rounded up is within 5 standard deviations of n * frac (frac = the dropped
    16 bits / 2^16), for m (the hash's high half) and v (its low half)."""
    x32 = float(torch.tensor(x, dtype=torch.float32))
    xx = float(torch.tensor(x32, dtype=torch.float32) * torch.tensor(x32, dtype=torch.float32))
    m, v = _moments_equal_grad(x32, 1 << 16)
    assert abs(_z_score(m, x32)) < 5
    if xx != 0 and abs(xx) < 3e38:
        assert abs(_z_score(v, xx)) < 5
    m, v = _moments_equal_grad(x32, None, seeds=[mix64(s) for s in range(4096)])
    assert abs(_z_score(m, x32)) < 5
    if xx != 0 and abs(xx) < 3e38:
        assert abs(_z_score(v, xx)) < 5


def test_draws_depend_on_seed_step_and_index():
    """The same value rounds differently at other seeds, steps and indices (the key is live), and
    identically when all three repeat."""
    x = 1.0 / 3.0
    a, _ = _moments_equal_grad(x, 4096, step=1)
    b, _ = _moments_equal_grad(x, 4096, step=1)
    c, _ = _moments_equal_grad(x, 4096, step=2)
    assert torch.equal(bits(a), bits(b))
    assert not torch.equal(bits(a), bits(c))
    assert 0 < int((a.float() != a.float()[0]).sum()) < 4096  # both neighbours occur along the index
    s1, _ = _moments_equal_grad(x, None, seeds=list(range(256)))
    assert 0 < int((s1.float() != s1.float()[0]).sum()) < 256  # both neighbours occur along the seed


def test_representable_values_kept_and_signs():
    """beta1 = 0, beta2 = 1 make the fp32 results exactly bf16 values (m = g, v = v, vm = max(vm, v)):
    stored bit for bit, +-0 and subnormals included. Random data: v and vm never get the sign bit."""
    n = 4096
    gen = torch.Generator().manual_seed(3)
    special = torch.tensor([0.0, -0.0, 9.2e-41, -9.2e-41, 3.3895314e38, -3.3895314e38, 1.0, -1.0])
    g = torch.cat([special, torch.randn(n - special.numel(), generator=gen) * 1e3]).bfloat16().float()
    p = torch.randn(n, generator=gen)
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.cat([torch.tensor([0.0, 9.2e-41, 1e-38]), torch.rand(n - 3, generator=gen)]).bfloat16()
    vm = (torch.rand(n, generator=gen) * 2).bfloat16()
    v0, vm0 = v.clone(), vm.clone()
    run_rows([row(p, m, v, g, vm)], [hyper(1, betas=(0.0, 1.0))], isa=BEST, state_dtype=BF16, seed=1)
    assert_bitwise(m, g.bfloat16(), "exp_avg = g")
    assert_bitwise(v, v0, "exp_avg_sq unchanged")
    assert_bitwise(vm, torch.maximum(vm0, v0), "max_exp_avg_sq = max")

    p = torch.randn(n, generator=gen)
    m, v, vm = bf16_state(n, gen, True)
    v[:64] = torch.tensor(9.2e-41).bfloat16()  # subnormals that may round to 0 but never below
    for step in range(1, 4):
        g = torch.randn(n, generator=gen) * 1e-20
        run_rows([row(p, m, v, g, vm)], [hyper(step)], isa=BEST, state_dtype=BF16, seed=2)
        assert not bool((bits(v) < 0).any()) and not bool((bits(vm) < 0).any())


@pytest.mark.parametrize("isa", ISAS)
def test_inf_nan_propagate_as_torch(isa):
    """Non-finite grads and state: the same NaN/inf positions as torch's fused AdamW on fp32
    state; NaN stored as 0x7FC0 (torch's bf16 NaN), +-inf kept; all bitwise the emulation."""
    n = 64
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen)
    m, v, vm = bf16_state(n, gen, True)
    g = torch.randn(n, generator=gen)
    g[[1, 20, 33]] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    m[[5, 40]] = torch.tensor([float("inf"), float("nan")]).bfloat16()
    v[[7, 41]] = torch.tensor([float("inf"), float("nan")]).bfloat16()
    vm[50] = float("inf")
    tail = tail_model(torch.get_num_threads())
    want = torch_fused(p, m.float(), v.float(), vm.float(), g, 2)
    want_m, want_v, want_vm = sr_expected(want[1], want[2], want[3], 8, 2)
    run_rows([row(p, m, v, g, vm)], [hyper(2)], isa=isa, tail=tail, state_dtype=BF16, seed=8)
    for got, ref32, ref16, name in ((m, want[1], want_m, "exp_avg"), (v, want[2], want_v, "exp_avg_sq"),
                                    (vm, want[3], want_vm, "max_exp_avg_sq")):
        assert torch.equal(got.float().isnan(), ref32.isnan()), name
        inf = ref32.isinf()
        assert inf.any() and torch.equal(got.float()[inf], ref32[inf]), name
        assert (bits(got)[ref32.isnan()] == 0x7FC0).all(), name
        assert_bitwise(got, ref16, name)
    assert torch.equal(p.isnan(), want[0].isnan())
    assert_bitwise(p, want[0], "p")


# ---------------------------------------------------------------------------
# the same bits for every ISA, thread count and bucket split
# ---------------------------------------------------------------------------
def _host_plan_step(p, m, v, vm, g, lp, pieces, first_base, numel, hyp, state_dtype, seed):
    """One adamw_plan_step through a host plan (memcpy for the copies) of one parameter of `numel`
    elements whose elements first_base.. are the tensors given (addresses shifted back so the plan
    may name indices up to 2^32 and beyond): `pieces` (first, n) segments, the first alone in
    bucket 0, the rest packed in bucket 1."""
    es = BYTES_OF_CODE[state_dtype]
    shift = lambda t, size: t.data_ptr() - first_base * size  # noqa: E731
    ptrs = ADAMW_PARAM_ROW.row(master=shift(p, 4), exp_avg=shift(m, es), exp_avg_sq=shift(v, es), grad=shift(g, 4),
                               param_lowp=shift(lp, 4), numel=numel, grad_dtype=F32, param_dtype=F32,
                               max_exp_avg_sq=shift(vm, es) if vm is not None else 0)
    segs, off = [], 0
    for k, (first, cnt) in enumerate(pieces):
        if k == 1:
            off = 0
        segs += ADAMW_SEGMENT_ROW.row(param=0, first=first, numel=cnt, grad_slot_offset=off, param_slot_offset=off)
        off += -(-cnt * 4 // 64) * 64
    slot = max(-(-cnt * 4 // 64) * 64 for _, cnt in pieces) * len(pieces)
    plan = _C.adamw_plan_create(array.array("q", segs), array.array("q", [0, 1, len(pieces)]), 1, slot, slot, 2, 1,
                                True)
    _C.adamw_plan_step(plan, array.array("q", ptrs), array.array("d", hyp), 0, BEST, 2, 1, 0,
                       state_dtype=state_dtype, seed=seed)


def test_same_bits_every_isa_thread_count_and_bucket_split():
    """bf16 state with amsgrad over 3 pool tasks' worth of elements: every available ISA with 1, 2
    and 3 threads, and the host bucket pipeline (the parameter split into three segments over two
    buckets), store the same bits as the scalar path on one thread."""
    n = 3 * 16384 + 101
    gen = torch.Generator().manual_seed(9)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m0, v0, vm0 = bf16_state(n, gen, True)
    results = {}
    for isa in range(BEST + 1):
        for threads in (1, 2, 3):
            p, m, v, vm = p0.clone(), m0.clone(), v0.clone(), vm0.clone()
            run_rows([row(p, m, v, g, vm)], [hyper(3)], isa=isa, threads=threads, state_dtype=BF16, seed=77)
            results[isa, threads] = (p, m, v, vm)
    p, m, v, vm, lp = p0.clone(), m0.clone(), v0.clone(), vm0.clone(), torch.empty(n)
    _host_plan_step(p, m, v, vm, g, lp, [(0, 20000), (20000, 17), (20017, n - 20017)], 0, n, hyper(3), BF16, 77)
    results["pipeline"] = (p, m, v, vm)
    base = results[0, 1]
    for key, got in results.items():
        for a, b, name in zip(got, base, ("p", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")):
            assert_bitwise(a, b, f"{key} {name}")
    assert torch.equal(lp, results["pipeline"][0])


def test_indices_across_2_pow_32():
    """A segment of a 2^32 + 64-element parameter covering indices 2^32 - 37 .. 2^32 + 26: the key
    changes with the index's high word exactly as the header says (the kernel splits ranges there),
    against SR of the kernel's own fp32-state results at the same indices."""
    n, first = 64, (1 << 32) - 37
    gen = torch.Generator().manual_seed(12)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m0, v0, vm0 = bf16_state(n, gen, True)
    hyp = hyper(6)
    p32, m32, v32, vm32 = p0.clone(), m0.float(), v0.float(), vm0.float()
    _host_plan_step(p32, m32, v32, vm32, g, torch.empty(n), [(first, n)], first, first + n + 27, hyp, F32, 0)
    p, m, v, vm = p0.clone(), m0.clone(), v0.clone(), vm0.clone()
    _host_plan_step(p, m, v, vm, g, torch.empty(n), [(first, 30), (first + 30, n - 30)], first, first + n + 27,
                    hyp, BF16, 31337)
    want_m, want_v, want_vm = sr_expected(m32, v32, vm32, 31337, 6, first=first)
    assert_bitwise(p, p32, "p")
    assert_bitwise(m, want_m, "exp_avg")
    assert_bitwise(v, want_v, "exp_avg_sq")
    assert_bitwise(vm, want_vm, "max_exp_avg_sq")
    wrong = sr_expected(m32, v32, vm32, 31337, 6, first=first - (1 << 32))[0]  # keys without the high word
    assert not torch.equal(bits(wrong[37:]), bits(m[37:]))


# ---------------------------------------------------------------------------
# the fp32 path and the arguments
# ---------------------------------------------------------------------------
def test_fp32_state_path_unchanged_by_new_arguments():
    """state_dtype=0 (explicit, with any seed) is bit for bit the call without the new arguments,
    which is torch's fused AdamW."""
    n = 4099
    gen = torch.Generator().manual_seed(4)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m0, v0 = torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-3
    tail = tail_model(torch.get_num_threads())
    outs = []
    for kw in ({}, {"state_dtype": 0}, {"state_dtype": 0, "seed": 12345}):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        run_rows([row(p, m, v, g)], [hyper(3)], isa=BEST, tail=tail, **kw)
        outs.append((p, m, v))
    want = torch_fused(p0, m0, v0, None, g, 3)
    for got in outs:
        for a, b in zip(got, want):
            assert_bitwise(a, b, "fp32 path")


def test_bad_arguments_named_and_nothing_changed():
    n = 33
    p, g = torch.randn(n), torch.randn(n)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    raw = torch.zeros(2 * n + 2, dtype=torch.uint8)
    snapshot = [t.clone() for t in (p, m, v)]
    r, h = [row(p, m, v, g)], [hyper(1)]
    with pytest.raises(ValueError, match=r"adamw_cpu: state_dtype must be 0 \(fp32\) or 1 \(bf16\), got 2"):
        run_rows(r, h, state_dtype=2)
    with pytest.raises(ValueError, match=r"adamw_cpu: seed must be an int in \[0, 2\^64\)"):
        run_rows(r, h, state_dtype=BF16, seed=-1)
    with pytest.raises(ValueError, match=r"adamw_cpu: seed must be an int in \[0, 2\^64\)"):
        run_rows(r, h, state_dtype=BF16, seed=1 << 64)
    with pytest.raises(TypeError, match=r"adamw_cpu: seed must be an int or a buffer of 1 int64.*float"):
        run_rows(r, h, state_dtype=BF16, seed=1.5)
    with pytest.raises(ValueError, match=r"seed buffer must hold 1 int64 \(one per row\), got 16 bytes"):
        run_rows(r, h, state_dtype=BF16, seed=array.array("q", [1, 2]))
    odd = [p.data_ptr(), raw.data_ptr() + 1, v.data_ptr(), g.data_ptr(), 0, n, 0, 0, 0]
    with pytest.raises(ValueError, match=r"ptrs row 0: exp_avg, exp_avg_sq and max_exp_avg_sq must be aligned "
                                         r"to their dtype's 2 bytes"):
        run_rows([odd], h, state_dtype=BF16)
    with pytest.raises(TypeError):
        run_rows(r, h, state_dtype="bf16")
    for a, b in zip((p, m, v), snapshot):
        assert torch.equal(bits(a), bits(b))
