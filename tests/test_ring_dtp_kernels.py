"""Ring-DTP's C/CUDA kernels one by one (moepeak.ring_dtp.blocks): scale_, the fused
modes' dW finish (take_label_column, finish_dw with its rank-1 term), sub_row, and
vocab_outer_lowp's dX finish (take_label_column_block, finish_dx).
"""
import math

import pytest
import torch

from moepeak.ring_dtp import blocks as B
from tests.refs import label_rows_dx_ref, label_rows_ref


# ---------------------------------------------------------------------------
# scale_: t *= g (fp32 multiply, one rounding), the fused modes' backward
# ---------------------------------------------------------------------------
SCALE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _scale_data(n, dtype, device, seed=0):
    """[n + 1] values: the scaled tensor is [1:] (a 1-element offset: not 16-byte aligned,
    the CUDA head/tail path) or [:n]; the other element must stay untouched."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(n + 1, generator=gen) * 300  # fp16: some products overflow to inf at g = 300
    t[::7] *= 1e-6                               # fp16 subnormal results, bf16 tiny values
    return t.to(dtype).to(device)


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def _check_scale(device):
    for dtype in SCALE_DTYPES:
        for n in (0, 1, 7, 13, 4096, 100003):  # odd n: not a multiple of the 8-element vectors
            for gv in (1.0, 0.37, 0.0, -2.5, 300.0):
                base = _scale_data(n, dtype, device, seed=n)
                t, other = (base[1:], base[:1]) if n % 2 else (base[:n], base[n:])
                before, other0 = t.clone(), other.clone()
                g = torch.tensor([gv], dtype=torch.float32, device=device)
                B.scale_(t, g)
                ref = before if gv == 1.0 else (before.float() * g).to(dtype)
                assert torch.equal(_bits(t), _bits(ref)), (dtype, n, gv)
                assert torch.equal(_bits(other), _bits(other0)), (dtype, n, gv)


def test_scale_cpu():
    _check_scale("cpu")


@pytest.mark.cuda
def test_cuda_scale():
    _check_scale("cuda")
    torch.cuda.synchronize()


def test_scale_every_bit_pattern():
    """Every bf16 / fp16 value times g: bit-equal to torch's fp32 multiply + cast (NaN: any NaN)."""
    for dtype in (torch.bfloat16, torch.float16):
        every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        for gv in (0.37, 300.0, 1e-3, -1.5, 0.0, math.inf):
            t, g = every.clone(), torch.tensor([gv])
            B.scale_(t, g)
            ref = (every.float() * g).to(dtype)
            nan = torch.isnan(ref)
            assert torch.equal(torch.isnan(t), nan), (dtype, gv)
            assert torch.equal(_bits(t)[~nan], _bits(ref)[~nan]), (dtype, gv)


def test_scale_g1_leaves_bits_untouched():
    t = torch.tensor([float("nan"), -0.0, 1e-40, 3.0], dtype=torch.float32)
    for dtype in SCALE_DTYPES:
        u = t.to(dtype)
        before = _bits(u).clone()
        B.scale_(u, torch.ones((), dtype=torch.float32))  # 0-dim g works too
        assert torch.equal(_bits(u), before), dtype


def test_scale_neighbours_untouched():
    base = torch.arange(40, dtype=torch.bfloat16)
    B.scale_(base[3:29], torch.tensor([2.0]))
    want = torch.arange(40, dtype=torch.float32)
    want[3:29] *= 2
    assert torch.equal(base, want.to(torch.bfloat16))


def test_scale_bad_input():
    t = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="g must have dtype"):
        B.scale_(t, torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="g must have exactly one element"):
        B.scale_(t, torch.ones(2))
    with pytest.raises(ValueError, match="t must be contiguous"):
        B.scale_(torch.ones(4, 4, dtype=torch.bfloat16).t(), torch.ones(1))
    with pytest.raises(TypeError, match="t must have dtype"):
        B.scale_(torch.ones(4, dtype=torch.int32), torch.ones(1))
    if torch.device("meta") is not None:
        with pytest.raises(ValueError, match="g must be on"):
            B.scale_(t, torch.ones(1, device="meta"))
    assert torch.equal(t, torch.ones(8, dtype=torch.bfloat16))  # nothing half-done


# ---------------------------------------------------------------------------
# The fused modes' dW finish (B.take_label_column, B.finish_dw)
# ---------------------------------------------------------------------------
# (T, H, V, v0, nv): H = 2100 over 9 of the CUDA kernel's 256-column bf16/fp16 slabs (17 of
# 128 in fp32), the last partial, and not a whole number of 16-byte vectors in bf16/fp16 (the
# kernel's element-wise lanes); H = 24 in vectors; a 20000-row shard, most of its rows
# unlabelled (the rank-1 pass's rows); V = 20 all in the shard, so runs of ~35 tokens cross
# the kernel's 32-position windows and the last label's run ends at the end of sy.
FINISH_SHAPES = [(300, 2100, 50, 10, 30), (3000, 24, 25000, 1000, 20000), (700, 264, 20, 0, 20)]


def _check_finish_dw(device, dtype, rank1=False, shape=FINISH_SHAPES[0]):
    """dw[r] += [cs[r] mu +] sum_{t: y_t = v0 + r} tc[t] x[t]: within half an ulp of the dtype
    (plus the fp32 sum's rounding) of the fp64 result; deterministic (bitwise equal on a
    second call); on CUDA bitwise equal to the CPU kernel (the same order and arithmetic);
    without the rank-1 term, rows of labels outside [v0, v0 + nv) and rows no token is
    labelled with unchanged bitwise."""
    g = torch.Generator().manual_seed(3)
    T, H, V, v0, nv = shape
    x = torch.randn(T, H, generator=g).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    y[::7] = -100                                              # ignore_index: never a row
    # Runs against the CUDA kernel's walk (windows of 32 positions, groups of 8 tokens):
    y[:40] = v0 + 2                                            # a window and one group
    y[50:61] = v0 + 3                                          # a group and 3 tokens
    y[61:93] = v0 + 4                                          # exactly one window
    y[100:116] = v0 + 5                                        # exactly two groups
    y[120:191] = v0 + 6                                        # two windows and 7 tokens
    y[40:45] = v0                                              # the shard's first and last rows
    y[45:47] = v0 + nv - 1
    tc = torch.randn(T, generator=g)
    dw0 = torch.randn(nv, H, generator=g).to(dtype)
    cs = torch.randn(nv, generator=g) * 3 if rank1 else None
    mu = torch.randn(H, generator=g).to(dtype).float() if rank1 else None
    extra = dict(cs=cs, mu=mu) if rank1 else {}
    on_cpu = dw0.clone()
    B.finish_dw(on_cpu, x, y, tc, v0=v0, **extra)
    x, y, tc, dw = (t.to(device) for t in (x, y, tc, dw0.clone()))
    extra = {k: v.to(device) for k, v in extra.items()}
    B.finish_dw(dw, x, y, tc, v0=v0, **extra)
    again = dw0.clone().to(device)
    B.finish_dw(again, x, y, tc, v0=v0, **extra)
    assert torch.equal(dw, again)
    assert torch.equal(dw.cpu(), on_cpu)
    truth, mag = label_rows_ref(dw0, x, y, tc, v0, cs=cs, mu=mu)
    got = dw.cpu().double()
    ulp_half = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    assert ((got - truth).abs() <= ulp_half * truth.abs() + 1e-6 * mag + 1e-30).all()
    if rank1:
        return
    yc = y.cpu()
    labelled = yc[(yc >= v0) & (yc < v0 + nv)] - v0
    untouched = torch.ones(nv, dtype=torch.bool)
    untouched[labelled.unique()] = False
    assert untouched.any() == (nv > 20)                        # every row labelled in the V = 20 shape
    assert torch.equal(dw.cpu()[untouched], dw0[untouched])


@pytest.mark.parametrize("shape", FINISH_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finish_dw_rank1_cpu(dtype, shape):
    _check_finish_dw("cpu", dtype, rank1=True, shape=shape)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", FINISH_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_finish_dw_rank1(dtype, shape):
    _check_finish_dw("cuda", dtype, rank1=True, shape=shape)
    torch.cuda.synchronize()


@pytest.mark.parametrize("shape", FINISH_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finish_dw_cpu(dtype, shape):
    _check_finish_dw("cpu", dtype, shape=shape)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", FINISH_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_finish_dw(dtype, shape):
    _check_finish_dw("cuda", dtype, shape=shape)
    torch.cuda.synchronize()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sub_row_is_torch_sub(dtype, device):
    """B.sub_row (the centering's X - mu) == torch.sub bitwise: rows of a wider buffer, H a
    multiple of the CUDA vector; H = 2100 + 3 and an odd row offset (torch.sub's path on CUDA);
    values whose difference rounds (large and small magnitudes mixed)."""
    g = torch.Generator().manual_seed(11)
    for H, off in ((2048, 0), (2103, 1)):
        base = (torch.randn(70, H + 16, generator=g) * torch.logspace(-3, 3, H + 16)).to(dtype).to(device)
        x = base[3:67, off:off + H]
        mu = (torch.randn(H, generator=g) * 3).to(dtype).to(device)
        out_buf = torch.full((64, H + 8), float("nan"), dtype=dtype, device=device)
        out = out_buf[:, :H]
        assert B.sub_row(x, mu, out) is out
        assert torch.equal(out, torch.sub(x, mu)), (H, off)
        assert out_buf[:, H:].isnan().all()                     # nothing past the rows' H columns


def test_sub_row_bad_input():
    from moepeak import _C
    x, mu, out = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), torch.zeros(4, 8,
                                                                                                          dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="mu must have dtype"):
        B.sub_row(x, mu.float(), out)
    with pytest.raises(ValueError, match="sub_row needs x, out \\[n, H\\]"):
        B.sub_row(x, torch.ones(7, dtype=torch.bfloat16), out)
    with pytest.raises(ValueError, match="sub_row needs"):
        B.sub_row(x, mu, torch.zeros(8, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="ldo >= h"):
        _C.ce_sub_row(0, 4, 0, 8, 0, 2, 8, 1, False, 0)
    assert torch.equal(out, torch.zeros(4, 8, dtype=torch.bfloat16))  # nothing written


def test_take_label_column():
    dz = torch.randn(5, 9).to(torch.bfloat16)
    dz[2] = 0                                                   # an ignored row is all zero
    y = torch.tensor([3, 0, -100, 8, 3])
    tc = torch.full((5,), 7.0)
    want, dz0 = dz.clone(), dz.clone()
    col = B.take_label_column(dz, y, tc)
    assert torch.equal(tc, torch.tensor([want[0, 3], want[1, 0], 0.0, want[3, 8], want[4, 3]]).float())
    want[[0, 1, 3, 4], [3, 0, 8, 3]] = 0
    assert torch.equal(dz, want)
    taken = dz.clone()
    B.put_label_column(dz, y, tc)                               # and back, bitwise
    assert torch.equal(dz, dz0)
    B.put_label_column(taken, y, tc, col)                       # the same with the column handed over
    assert torch.equal(taken, dz0)


def test_take_label_column_block():
    """A block of columns v0 .. v0 + nv - 1 (vocab_outer_lowp): only rows labelled inside it
    give up their element; the others keep tc and dZ, whatever their label."""
    dz = torch.randn(6, 4).to(torch.bfloat16)
    y = torch.tensor([10, 13, 9, 14, -100, 11])                 # block: vocab 10 .. 13
    tc = torch.full((6,), 7.0)
    want = dz.clone()
    B.take_label_column_block(dz, y, tc, 10)
    assert torch.equal(tc, torch.tensor([want[0, 0], want[1, 3], 7.0, 7.0, 7.0, want[5, 1]]).float())
    want[[0, 1, 5], [0, 3, 1]] = 0
    assert torch.equal(dz, want)


def test_finish_dw_bad_input():
    from moepeak import _C
    with pytest.raises(ValueError, match="ldw >= h"):
        _C.ce_dw_finish(0, 1, 4, 0, 3, 0, 8, 8, 0, 0, 0, 5, 0, 0, 0, False, 0)
    with pytest.raises(ValueError, match="dtype 0..2"):
        _C.ce_dw_finish(0, 5, 8, 0, 3, 0, 8, 8, 0, 0, 0, 5, 0, 0, 0, False, 0)
    with pytest.raises(ValueError, match="t, nv, h >= 0"):
        _C.ce_dw_finish(0, 1, 8, 0, -1, 0, 8, 8, 0, 0, 0, 5, 0, 0, 0, False, 0)
    with pytest.raises(ValueError, match="cs and mu both set or both 0"):
        _C.ce_dw_finish(0, 1, 8, 0, 3, 0, 8, 8, 0, 0, 0, 5, 64, 0, 0, False, 0)
    with pytest.raises(ValueError, match="flags .* must be set on CUDA"):
        _C.ce_dw_finish(0, 1, 8, 0, 3, 0, 8, 8, 0, 0, 0, 5, 64, 64, 0, True, 0)
    dw, x = torch.zeros(3, 4, dtype=torch.bfloat16), torch.ones(2, 4, dtype=torch.bfloat16)
    y, tc = torch.zeros(2, dtype=torch.int64), torch.ones(2)
    with pytest.raises(TypeError, match="x must have dtype in \\(bfloat16\\)"):
        B.finish_dw(dw, x.float(), y, tc)
    with pytest.raises(TypeError, match="labels must have dtype"):
        B.finish_dw(dw, x, y.int(), tc)
    with pytest.raises(TypeError, match="tc must have dtype"):
        B.finish_dw(dw, x, y, tc.double())
    with pytest.raises(ValueError, match="dw must be contiguous"):
        B.finish_dw(torch.zeros(4, 3, dtype=torch.bfloat16).t(), x, y, tc)
    with pytest.raises(ValueError, match="finish_dw needs dw"):
        B.finish_dw(dw, torch.ones(2, 3, dtype=torch.bfloat16), y, tc)
    with pytest.raises(ValueError, match="finish_dw needs dw"):
        B.finish_dw(dw, x, y[:1], tc)
    with pytest.raises(ValueError, match="cs and mu both or neither"):
        B.finish_dw(dw, x, y, tc, cs=torch.zeros(3))
    with pytest.raises(ValueError, match="needs cs \\[nv\\], mu \\[H\\]"):
        B.finish_dw(dw, x, y, tc, cs=torch.zeros(4), mu=torch.zeros(4))
    with pytest.raises(TypeError, match="mu must have dtype"):
        B.finish_dw(dw, x, y, tc, cs=torch.zeros(3), mu=torch.zeros(4, dtype=torch.bfloat16))
    assert torch.equal(dw, torch.zeros(3, 4, dtype=torch.bfloat16))  # nothing half-done


# ---------------------------------------------------------------------------
# vocab_outer_lowp's dX finish (B.take_label_column_block, B.finish_dx)
# ---------------------------------------------------------------------------
def _check_finish_dx(device, dtype):
    """dx[t] += tc[t] w[y_t - v0]: one fmaf and one rounding per element, so within half an
    ulp of the dtype (+ fp32's) of the fp64 result; rows labelled outside [v0, v0 + nv)
    (ignore_index, other shards) unchanged bitwise."""
    g = torch.Generator().manual_seed(4)
    T, H, V, v0, nv = 200, 300, 60, 20, 25
    w = torch.randn(nv, H, generator=g).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    y[::9] = -100
    tc = torch.randn(T, generator=g)
    dx0 = torch.randn(T, H, generator=g).to(dtype)
    w, y, tc, dx = (t.to(device) for t in (w, y, tc, dx0.clone()))
    B.finish_dx(dx, w, y, tc, v0=v0)
    truth = label_rows_dx_ref(dx0, w, y, tc, v0)
    got = dx.cpu().double()
    ulp_half = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    assert ((got - truth).abs() <= (ulp_half * (1 + 1e-6) + 2.0 ** -24) * truth.abs() + 1e-30).all()
    yc = y.cpu()
    outside = (yc < v0) | (yc >= v0 + nv)
    assert outside.any() and (~outside).any()
    assert torch.equal(dx.cpu()[outside], dx0[outside])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finish_dx_cpu(dtype):
    _check_finish_dx("cpu", dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_finish_dx(dtype):
    _check_finish_dx("cuda", dtype)
    torch.cuda.synchronize()


def test_finish_dx_bad_input():
    from moepeak import _C
    with pytest.raises(ValueError, match="ldx >= h"):
        _C.ce_dx_finish(0, 1, 4, 0, 8, 0, 3, 8, 0, 0, 5, False, 0)
    with pytest.raises(ValueError, match="dtype 0..2"):
        _C.ce_dx_finish(0, 7, 8, 0, 8, 0, 3, 8, 0, 0, 5, False, 0)
    with pytest.raises(ValueError, match="t, nv, h >= 0"):
        _C.ce_dx_finish(0, 1, 8, 0, 8, 0, -3, 8, 0, 0, 5, False, 0)
    dx, w = torch.zeros(2, 4, dtype=torch.bfloat16), torch.ones(3, 4, dtype=torch.bfloat16)
    y, tc = torch.zeros(2, dtype=torch.int64), torch.ones(2)
    with pytest.raises(TypeError, match="w must have dtype in \\(bfloat16\\)"):
        B.finish_dx(dx, w.half(), y, tc)
    with pytest.raises(TypeError, match="labels must have dtype"):
        B.finish_dx(dx, w, y.int(), tc)
    with pytest.raises(TypeError, match="tc must have dtype"):
        B.finish_dx(dx, w, y, tc.double())
    with pytest.raises(ValueError, match="dx must be contiguous"):
        B.finish_dx(torch.zeros(4, 2, dtype=torch.bfloat16).t(), w, y, tc)
    with pytest.raises(ValueError, match="finish_dx needs dx"):
        B.finish_dx(dx, torch.ones(3, 5, dtype=torch.bfloat16), y, tc)
    with pytest.raises(ValueError, match="finish_dx needs dx"):
        B.finish_dx(dx, torch.ones(4, 3, dtype=torch.bfloat16).t(), y, tc)   # columns strided
    with pytest.raises(ValueError, match="finish_dx needs dx"):
        B.finish_dx(dx, w, y, tc[:1])
    assert torch.equal(dx, torch.zeros(2, 4, dtype=torch.bfloat16))  # nothing half-done
