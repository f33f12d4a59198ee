"""Ring-DTP on the inputs an adversarial user gives (issue 23): second-order gradients,
non-finite logits, fp32 accuracy against fp64, out-of-range labels, empty batches,
repeated backward, degenerate strides, argument checks and autocast. Each test compares
with plain PyTorch: F.cross_entropy(F.linear(h, w, b).float(), y, ...)."""
import math
import re

import pytest
import torch
import torch.nn.functional as F

import moepeak
import moepeak.ring_dtp.blocks as B
from tests.ring_dtp_helpers import make, relerr

MODES = ("fused", "vocab_outer", "token_outer")


def _plain(h, w, y, b=None, **kw):
    return F.cross_entropy(F.linear(h, w, b).float(), y, **kw)


def _leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


# ---- 1. create_graph: second-order gradients --------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.1, "z_loss": 1e-2}, {"reduction": "sum"},
                                {"softcap": 3.0}])
def test_double_backward_matches_torch(mode, kw):
    x, w, y, b = make(12, 8, 37, torch.float64, seed=3, bias=True, ignore_frac=0.2)

    def penalty(fn, h, wt, bt):
        loss = fn(h, wt, y, bt)
        gh, gw, gb = torch.autograd.grad(loss, (h, wt, bt), create_graph=True)
        assert gh.requires_grad and gw.requires_grad
        return loss + gh.pow(2).sum() + (gw * gw).sum() + gb.pow(2).sum()

    zl, eps, cap = kw.get("z_loss", 0.0), kw.get("label_smoothing", 0.0), kw.get("softcap")
    red = kw.get("reduction", "mean")

    def ref(h, wt, y, bt):
        z = F.linear(h, wt, bt)
        if cap:
            z = cap * torch.tanh(z / cap)
        rows = F.cross_entropy(z, y, reduction="none", label_smoothing=eps)
        valid = y != -100
        rows = rows + torch.where(valid, zl * torch.logsumexp(z, -1) ** 2, torch.zeros_like(rows))
        return rows.sum() / (valid.sum() if red == "mean" else 1)

    def ours(h, wt, y, bt):
        return moepeak.linear_cross_entropy(h.float(), wt.float(), y, bias=bt.float(), mode=mode, **kw)

    hr, wr, br = _leaves(x, w, b)
    want = torch.autograd.grad(penalty(ref, hr, wr, br), (hr, wr, br))
    ho, wo, bo = _leaves(x.float(), w.float(), b.float())
    got = torch.autograd.grad(penalty(ours, ho, wo, bo), (ho, wo, bo))
    for g, r in zip(got, want):
        assert relerr(g, r) < 1e-5, relerr(g, r)


# ---- 2. -inf masks ------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_minus_inf_bias_and_weight_like_torch(mode, eps):
    x, w, y, b = make(10, 8, 23, torch.float32, seed=4, bias=True)
    b[[3, 17]] = -math.inf
    y[y == 3] = 4
    y[y == 17] = 4
    want = _plain(x, w, y, b, label_smoothing=eps)
    got = moepeak.linear_cross_entropy(x, w, y, bias=b, mode=mode, label_smoothing=eps)
    assert torch.isfinite(want).item() == (eps == 0)  # torch: finite without smoothing, inf with
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0, equal_nan=True)
    xp = x.abs() + 0.1                                      # -inf weight row: -inf logits (positive hidden)
    w2 = w.clone()
    w2[5] = -math.inf
    y2 = torch.where(y == 5, torch.full_like(y, 6), y)
    torch.testing.assert_close(moepeak.linear_cross_entropy(xp, w2, y2, mode=mode, label_smoothing=eps),
                               _plain(xp, w2, y2, label_smoothing=eps), rtol=1e-5, atol=0, equal_nan=True)


def test_minus_inf_bias_gradients_finite():
    x, w, y, b = make(10, 8, 23, torch.float32, seed=4, bias=True)
    b[[3, 17]] = -math.inf
    y[(y == 3) | (y == 17)] = 4
    got = [t.grad for t in _run_backward(lambda h, wt, bt: moepeak.linear_cross_entropy(h, wt, y, bias=bt),
                                         x, w, b)]
    want = [t.grad for t in _run_backward(lambda h, wt, bt: _plain(h, wt, y, bt), x, w, b)]
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def _run_backward(fn, *ts):
    ls = _leaves(*ts)
    fn(*ls).backward()
    return ls


# ---- 3. fp32 accuracy against fp64 -------------------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("T,H,V,scale", [(4, 64, 151936, 0.5), (3, 32, 151936, 4.0), (64, 128, 5003, 2.0),
                                         (256, 64, 32000, 1.0)])
def test_fp32_within_2x_torch_error(T, H, V, scale, device):
    """loss and lse within 2x torch's own fp32 error (+ 4 ulps for the scalar loss, which
    torch may get exact by luck; + 1 for lse); dX, dW within 2x the larger of torch's error and the error of the
    exact dZ through the same fp32 GEMMs (which order the BLAS sums K in varies by call).
    On CUDA this checks the CUDA fold (per-thread pairwise sums, a tree across threads)."""
    x, w, y, _ = make(T, H, V, torch.float32, seed=1, scale=scale)
    x, w, y = x.to(device), w.to(device), y.to(device)

    def run(fn, x, w):
        h, wt = _leaves(x, w)
        loss, lse = fn(h, wt)
        loss.backward()
        return loss.detach(), lse.detach(), h.grad, wt.grad

    def plain(h, wt):
        z = F.linear(h, wt).float()
        return F.cross_entropy(z, y), torch.logsumexp(z, -1)

    ref = run(plain, x.double(), w.double())
    ours = run(lambda h, wt: moepeak.linear_cross_entropy(h, wt, y, return_lse=True), x, w)
    torch_ = run(plain, x, w)
    for name, o, t, r in zip(("loss", "lse"), ours, torch_, ref):
        floor = 2.0 ** -21 if name == "loss" else 2.0 ** -23  # a scalar: exact by luck, or a few ulps
        assert relerr(o, r) <= 2 * relerr(t, r) + floor, (name, relerr(o, r), relerr(t, r))
    zd = x.double() @ w.double().t()
    dz = ((torch.softmax(zd, -1) - F.one_hot(y, V).double()) / T).float()
    gemm = (relerr(dz @ w, ref[2]), relerr(dz.t() @ x, ref[3]))
    for name, o, t, r, gm in zip(("dX", "dW"), ours[2:], torch_[2:], ref[2:], gemm):
        assert relerr(o, r) <= 2 * max(relerr(t, r), gm), (name, relerr(o, r), relerr(t, r), gm)


def test_fold_sums_in_double():
    """The fold's block sums: lse of long rows within an ulp of fp64's (a sequential fp32
    sum of 151936 exponentials is off by ~4e-6 relative)."""
    V = 151936
    z = torch.randn(3, V, generator=torch.Generator().manual_seed(2)) * 2
    y = torch.tensor([0, 5, 7])
    st = B.new_state(3, "cpu")
    B.fold(z, 0, V, y, -100, 0.0, *st)
    m, ls, _ = B.fin(st)
    want = torch.logsumexp(z.double(), -1)
    assert ((m + ls).double() - want).abs().max().item() <= 2.0 ** -23 * want.abs().max().item()


# ---- 4. NaN and +inf ----------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_nan_and_inf_rows_like_torch(mode):
    x, w, y, _ = make(6, 4, 40, torch.float32, seed=5)
    b = torch.zeros(40)
    x = x.clone()
    rows = []

    def with_bias(bias):
        got, lse = moepeak.linear_cross_entropy(x, w, y, bias=bias, reduction="none", mode=mode,
                                                chunk_vocab=8, chunk_tokens=2, return_lse=True)
        want = _plain(x, w, y, bias, reduction="none")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
        torch.testing.assert_close(lse, torch.logsumexp(F.linear(x, w, bias), -1), rtol=1e-5, atol=1e-6,
                                   equal_nan=True)
        rows.append(got)

    bn = b.clone()
    bn[8:16] = math.nan          # NaN fills a whole vocab block: every row NaN
    with_bias(bn)
    assert torch.isnan(rows[-1]).all()
    bi = b.clone()
    bi[7] = math.inf             # +inf logit: loss NaN (torch's), lse +inf
    with_bias(bi)
    xn = x.clone()
    xn[2] = math.nan             # one all-NaN row
    got, lse = moepeak.linear_cross_entropy(xn, w, y, reduction="none", mode=mode, return_lse=True)
    assert torch.isnan(got[2]) and torch.isnan(lse[2]) and torch.isfinite(got[[0, 1, 3, 4, 5]]).all()


def test_nan_row_gradient_nan():
    x, w, y, _ = make(6, 4, 40, torch.float32, seed=5)
    x[1, 0] = math.nan
    h = x.clone().requires_grad_()
    moepeak.linear_cross_entropy(h, w, y, reduction="sum").backward()
    assert torch.isnan(h.grad[1]).all() and torch.isfinite(h.grad[[0, 2, 3, 4, 5]]).all()


# ---- 5. labels: sync option, check in backward, public check_labels ----------
def test_check_labels_public_and_sync_option():
    assert moepeak.check_labels is moepeak.ring_dtp.check_labels
    moepeak.check_labels()  # nothing pending on CPU
    x, w, y, _ = make(4, 4, 10, torch.float32)
    for lc in ("deferred", "sync"):
        assert torch.isfinite(moepeak.linear_cross_entropy(x, w, y, label_check=lc))
    with pytest.raises(ValueError, match="label_check"):
        moepeak.linear_cross_entropy(x, w, y, label_check="later")


def test_backward_checks_pending_label_flags():
    """The mechanism on CPU: a pending (deferred) flag is read by backward before any
    gradient is written."""
    from moepeak.ring_dtp.labels import PENDING

    class Done:
        def synchronize(self):
            pass

        def query(self):
            return True

    x, w, y, _ = make(4, 4, 10, torch.float32)
    h = x.clone().requires_grad_()
    loss = moepeak.linear_cross_entropy(h, w, y)
    PENDING.add(Done(), torch.ones(1, dtype=torch.int32), 10)
    with pytest.raises(ValueError, match="labels must be in"):
        loss.backward()
    assert h.grad is None and not PENDING  # the flag read is dropped


@pytest.mark.cuda
def test_cuda_bad_labels_raise_in_backward_and_sync():
    x, w, y, _ = make(8, 16, 40, torch.float32)
    y[3] = 40
    h = x.cuda().requires_grad_()
    for mode in ("fused", "vocab_outer"):
        loss = moepeak.linear_cross_entropy(h, w.cuda(), y.cuda(), mode=mode)
        with pytest.raises(ValueError, match="labels must be in"):
            loss.backward()
        assert h.grad is None
    with pytest.raises(ValueError, match="labels must be in"):
        moepeak.linear_cross_entropy(h, w.cuda(), y.cuda(), label_check="sync")
    moepeak.check_labels()


# ---- 6. T = 0 -------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_batch_like_torch(mode, reduction, dtype):
    _, w, _, b = make(1, 8, 11, dtype, bias=True)
    x = torch.empty(0, 8, dtype=dtype)
    y = torch.empty(0, dtype=torch.long)
    got = _leaves(x, w, b)
    lo = moepeak.linear_cross_entropy(got[0], got[1], y, bias=got[2], reduction=reduction, mode=mode)
    ref = _leaves(x, w, b)
    lr = _plain(ref[0], ref[1], y, ref[2], reduction=reduction)
    torch.testing.assert_close(lo, lr, equal_nan=True)
    lo.sum().backward()
    lr.sum().backward()
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.grad, r.grad)


# ---- 7. retain_graph: the second backward accumulates ---------------------------
@pytest.mark.parametrize("mode", ["fused", "fused_lowp", "vocab_outer"])
def test_second_backward_accumulates(mode):
    x, w, y, _ = make(12, 8, 50, torch.float32, seed=23)
    h, wt = _leaves(x, w)
    loss = moepeak.linear_cross_entropy(h, wt, y, mode=mode)
    loss.backward(retain_graph=True)
    (loss * 3).backward()
    hr, wr = _leaves(x, w)
    lr = _plain(hr, wr, y)
    lr.backward(retain_graph=True)
    (lr * 3).backward()
    torch.testing.assert_close(h.grad, hr.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(wt.grad, wr.grad, rtol=1e-5, atol=1e-7)


# ---- 8. degenerate strides --------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_degenerate_strides(mode, dtype):
    torch.manual_seed(0)
    cases = []
    w1 = torch.randn(1, 8).to(dtype).as_strided((1, 8), (3, 1))          # V = 1, odd row stride
    cases.append((torch.randn(5, 8).to(dtype), w1, torch.zeros(5, dtype=torch.long)))
    x1 = torch.randn(40).to(dtype).as_strided((40, 1), (1, 5))           # H = 1, odd column stride
    w2 = torch.randn(40).to(dtype).as_strided((7, 1), (1, 9))
    cases.append((x1, w2, torch.randint(0, 7, (40,))))
    x3 = torch.randn(8).to(dtype).as_strided((1, 8), (2, 1))             # T = 1
    cases.append((x3, torch.randn(6, 8).to(dtype), torch.tensor([2])))
    if dtype == torch.bfloat16 and mode == "fused":     # V = 1 through dW's finish (fused_lowp, 2 chunks)
        mode = "fused_lowp"
    for x, w, y in cases:
        assert x.is_contiguous() and w.is_contiguous()
        got = _leaves(x, w)
        lo = moepeak.linear_cross_entropy(got[0], got[1], y, mode=mode, chunk_tokens=2)
        ref = _leaves(x.double(), w.double())
        lr = _plain(ref[0], ref[1], y)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(lo, lr.float(), rtol=tol, atol=tol)
        lo.backward()
        lr.backward()
        torch.testing.assert_close(got[1].grad.double(), ref[1].grad, rtol=tol, atol=tol)


# ---- 9. arguments -------------------------------------------------------------------
def test_softcap_inf_is_no_cap():
    x, w, y, _ = make(6, 8, 30, torch.float32)
    torch.testing.assert_close(moepeak.linear_cross_entropy(x, w, y, softcap=math.inf),
                               moepeak.linear_cross_entropy(x, w, y), rtol=0, atol=0)


@pytest.mark.parametrize("name,value", [("z_loss", math.nan), ("z_loss", math.inf), ("label_smoothing", math.nan),
                                        ("softcap", math.nan)])
def test_non_finite_options_refused(name, value):
    x, w, y, _ = make(4, 4, 10, torch.float32)
    with pytest.raises(ValueError, match=name):
        moepeak.linear_cross_entropy(x, w, y, **{name: value})


def test_shapes_refused_naming_the_argument_and_both_shapes():
    """hidden [..., H] against weight [V, H], labels against hidden's leading dims, bias [V]:
    the function and the module name the argument, what was expected and what came."""
    x, w, y, _ = make(4, 32, 11, torch.float32)
    head = moepeak.RingDTPLinearCrossEntropy(32, 11)
    for loss in (lambda h, t: moepeak.linear_cross_entropy(h, w, t), head):
        with pytest.raises(ValueError, match=re.escape("hidden must be [..., H] with H = weight.shape[1] = 32, "
                                                       "got (2, 2, 48)")):
            loss(torch.randn(2, 2, 48), y.reshape(2, 2))
        with pytest.raises(ValueError, match=re.escape("labels must have shape hidden.shape[:-1] = (2, 2), "
                                                       "got (4,)")):
            loss(x.reshape(2, 2, 32), y)
    with pytest.raises(ValueError, match=re.escape("bias must be [V] = [11], got (12,)")):
        moepeak.linear_cross_entropy(x, w, y, bias=torch.zeros(12))


def test_ignore_index_range():
    x, w, y, _ = make(6, 4, 10, torch.float32)
    for ii in (2 ** 40, 2 ** 63 - 1, -(2 ** 63)):
        torch.testing.assert_close(moepeak.linear_cross_entropy(x, w, y, ignore_index=ii),
                                   _plain(x, w, y, ignore_index=ii))
    y2 = y.clone()
    y2[0] = 2 ** 40
    torch.testing.assert_close(moepeak.linear_cross_entropy(x, w, y2, ignore_index=2 ** 40),
                               _plain(x, w, y2, ignore_index=2 ** 40))
    with pytest.raises(ValueError, match="ignore_index"):
        moepeak.linear_cross_entropy(x, w, y, ignore_index=2 ** 70)
    with pytest.raises(TypeError, match="ignore_index"):
        moepeak.linear_cross_entropy(x, w, y, ignore_index=1.5)


def test_label_dtypes_as_torch():
    x, w, y, _ = make(6, 4, 10, torch.float32)
    with pytest.raises(RuntimeError):
        _plain(x, w, y.int())                       # torch refuses int32 targets
    with pytest.raises(TypeError, match="labels"):
        moepeak.linear_cross_entropy(x, w, y.int())
    torch.testing.assert_close(moepeak.linear_cross_entropy(x, w, y.to(torch.uint8)),
                               _plain(x, w, y.to(torch.uint8)))   # uint8: torch takes it too


def test_autocast_casts_like_linear():
    x, w, y, b = make(16, 8, 40, torch.float32, bias=True)
    xb = x.to(torch.bfloat16)
    got = _leaves(xb, w, b)
    ref = _leaves(xb, w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lo = moepeak.linear_cross_entropy(got[0], got[1], y, bias=got[2])
        lr = _plain(ref[0], ref[1], y, ref[2])
    torch.testing.assert_close(lo, lr, rtol=2e-2, atol=2e-2)
    lo.backward()
    lr.backward()
    for g, r in zip(got, ref):
        assert g.grad.dtype == r.grad.dtype
        torch.testing.assert_close(g.grad, r.grad, rtol=5e-2, atol=5e-3)
    with pytest.raises(TypeError, match="weight dtype"):  # outside autocast: the clear mismatch error
        moepeak.linear_cross_entropy(xb, w, y)
