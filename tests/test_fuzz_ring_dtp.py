"""Fuzz: moepeak.linear_cross_entropy against the fp64 plain-PyTorch reference
(tests/refs.py) over shapes (T = 0, V = 1, primes), strided / expanded
inputs, every option, every CPU schedule and block size.

Example counts: tests/conftest.py's hypothesis profile (MOEPEAK_FUZZ_EXAMPLES).
The group at the end holds the edge cases issue 23 found wrong (T = 0, -inf
masks, non-finite options, second-order gradients, a second backward).
"""
import math

import pytest
import torch

import moepeak
from tests import refs

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import Phase, given, settings, strategies as st  # noqa: E402

LAYOUTS = ("contiguous", "transposed", "expanded")


def _leaf_and_view(rows, cols, layout, gen, scale=1.0):
    """A leaf tensor (what gradients land on) and the [rows, cols] view passed to the op."""
    if layout == "transposed":
        leaf = (torch.randn(cols, rows, generator=gen) * scale).requires_grad_(True)
        return leaf, leaf.t()
    if layout == "expanded":
        leaf = (torch.randn(1, cols, generator=gen) * scale).requires_grad_(True)
        return leaf, leaf.expand(rows, cols)
    leaf = (torch.randn(rows, cols, generator=gen) * scale).requires_grad_(True)
    return leaf, leaf


@st.composite
def problems(draw, t_values=(1, 2, 3, 5, 7, 13), v_values=(1, 2, 3, 7, 11, 31, 64)):
    T = draw(st.sampled_from(t_values))
    H = draw(st.sampled_from([1, 2, 3, 5, 8]))
    V = draw(st.sampled_from(v_values))
    ignore_index = draw(st.sampled_from([-100, -1, 0, V - 1, 2**40]))
    labels = draw(st.lists(st.one_of(st.integers(0, V - 1), st.just(ignore_index)), min_size=T, max_size=T))
    return dict(
        T=T, H=H, V=V, labels=labels, ignore_index=ignore_index,
        hidden_layout=draw(st.sampled_from(LAYOUTS)), weight_layout=draw(st.sampled_from(LAYOUTS[:2])),
        bias=draw(st.booleans()), reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1, 1.0])), z_loss=draw(st.sampled_from([0.0, 1e-3])),
        softcap=draw(st.sampled_from([None, 3.0, 30.0])), scale=draw(st.sampled_from([0.1, 1.0, 8.0])),
        mode=draw(st.sampled_from(["auto", "fused", "vocab_outer", "token_outer"])),
        chunk_tokens=draw(st.sampled_from([None, 1, 2, 3])), chunk_vocab=draw(st.sampled_from([None, 1, 2, 5])),
        seed=draw(st.integers(0, 2**16)),
    )


def _run(p, dtype=torch.float32, **over):
    """(loss, grads of the leaves) of moepeak (dtype=None) or the reference in `dtype`."""
    gen = torch.Generator().manual_seed(p["seed"])
    hl, h = _leaf_and_view(p["T"], p["H"], p["hidden_layout"], gen, p["scale"])
    wl, w = _leaf_and_view(p["V"], p["H"], p["weight_layout"], gen)
    bl = torch.randn(p["V"], generator=gen).requires_grad_(True) if p["bias"] else None
    y = torch.tensor(p["labels"], dtype=torch.int64).reshape(p["T"])
    kw = dict(bias=bl, ignore_index=p["ignore_index"], reduction=p["reduction"],
              label_smoothing=p["label_smoothing"], z_loss=p["z_loss"], softcap=p["softcap"])
    kw.update(over)
    if dtype is None:
        loss = moepeak.linear_cross_entropy(h, w, y, mode=p["mode"], chunk_tokens=p["chunk_tokens"],
                                            chunk_vocab=p["chunk_vocab"], **kw)
    else:
        loss = refs.ref_linear_cross_entropy(h, w, y, dtype=dtype, **kw)
    upstream = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape).to(loss.dtype)
    leaves = [t for t in (hl, wl, bl) if t is not None]
    grads = torch.autograd.grad((loss * upstream).sum(), leaves, allow_unused=True)
    grads = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]
    return loss.detach(), grads


def _assert_close(name, got, want, rtol=2e-5, atol=2e-5, torch_fp32=None):
    """|got - want| <= atol + rtol |want| (+ twice plain PyTorch's own fp32 error when given:
    docs/design.md's yardstick, which matters where large logits cancel); NaN only where want is NaN."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.numel() == 0:
        return
    both_nan = torch.isnan(got) & torch.isnan(want)
    diff = torch.where(both_nan, torch.zeros_like(got), (got - want).abs())
    tol = atol + rtol * want.abs().nan_to_num(0.0, 0.0, 0.0)
    if torch_fp32 is not None:
        tol = tol + 2 * (torch_fp32.double() - want).abs().nan_to_num(0.0, 0.0, 0.0)
    bad = ~(diff <= tol)
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {got.numel()} off, max diff "
                           f"{diff.nan_to_num(math.inf).max().item():.3g}, mean diff {diff.nanmean().item():.3g}")


def _compare(p, **over):
    """moepeak (fp32) against the fp64 reference, within twice plain PyTorch's fp32 error."""
    loss, grads = _run(p, None, **over)
    rloss, rgrads = _run(p, torch.float64, **over)
    tloss, tgrads = _run(p, torch.float32, **over)
    assert loss.dtype == torch.float32
    _assert_close("loss", loss, rloss, torch_fp32=tloss)
    for name, g, r, t in zip(("d_hidden", "d_weight", "d_bias"), grads, rgrads, tgrads):
        _assert_close(name, g, r, torch_fp32=t)


@given(problems())
def test_linear_cross_entropy_matches_fp64_reference(p):
    _compare(p)


@given(problems(), st.sampled_from([-1e4, -30.0, 30.0]))
def test_linear_cross_entropy_large_masking_bias(p, big):
    """Finite but large bias entries (a soft vocabulary mask) stay exact."""
    gen = torch.Generator().manual_seed(p["seed"] + 1)
    mask = torch.rand(p["V"], generator=gen) < 0.3
    p = dict(p, bias=False)
    bias = torch.where(mask, torch.tensor(big), torch.zeros(()))
    _compare(p, bias=bias.requires_grad_(True))


# ---------------------------------------------------------------------------
# Issue 23's Ring-DTP items: the correct behaviour (torch's result, or a clear
# ValueError naming the argument), fixed by the Ring-DTP pass.
# ---------------------------------------------------------------------------

# Few examples: each case is one edge, its shapes drawn small.
edge_settings = settings(max_examples=10, phases=[Phase.explicit, Phase.generate])


@edge_settings
@given(problems(t_values=(0,)))
def test_empty_batch(p):
    _compare(p)


@edge_settings
@given(problems(v_values=(2, 3, 7, 11)))
def test_minus_inf_bias_mask(p):
    p = dict(p, label_smoothing=0.0, softcap=None)  # a masked slot makes torch's smoothing term -inf too
    gen = torch.Generator().manual_seed(p["seed"] + 2)
    bias = torch.zeros(p["V"])
    bias[torch.randperm(p["V"], generator=gen)[: p["V"] // 2]] = -math.inf
    # labels only on unmasked slots, so the reference loss is finite
    keep = (bias == 0).nonzero().flatten().tolist()
    p["labels"] = [keep[i % len(keep)] if y != p["ignore_index"] else y for i, y in enumerate(p["labels"])]
    _compare(p, bias=bias.requires_grad_(True))


def _small_problem():
    return dict(T=3, H=2, V=5, labels=[0, 4, 2], ignore_index=-100, hidden_layout="contiguous",
                weight_layout="contiguous", bias=False, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                softcap=None, scale=1.0, mode="auto", chunk_tokens=None, chunk_vocab=None, seed=0)


def test_softcap_inf_is_no_cap_or_a_clear_error():
    """softcap=inf: torch's c * tanh(z / c) is NaN there; the op gives the uncapped loss or names softcap."""
    p = _small_problem()
    try:
        loss, _ = _run(p, None, softcap=math.inf)
    except ValueError as e:
        assert "softcap" in str(e)
        return
    want, _ = _run(p, torch.float64)
    _assert_close("loss", loss, want)


def test_z_loss_nan_is_rejected():
    h, w, y = torch.randn(3, 2), torch.randn(5, 2), torch.tensor([0, 4, 2])
    with pytest.raises(ValueError, match="z_loss"):
        moepeak.linear_cross_entropy(h, w, y, z_loss=math.nan)


def test_second_order_gradient():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(4, 3, generator=gen, dtype=torch.float32).requires_grad_(True)
    w = torch.randn(6, 3, generator=gen, dtype=torch.float32).requires_grad_(True)
    y = torch.tensor([0, 5, 2, 3])
    (g,) = torch.autograd.grad(moepeak.linear_cross_entropy(h, w, y), h, create_graph=True)
    (gg,) = torch.autograd.grad(g.pow(2).sum(), w)
    h64, w64 = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    (r,) = torch.autograd.grad(refs.ref_linear_cross_entropy(h64, w64, y), h64, create_graph=True)
    (rr,) = torch.autograd.grad(r.pow(2).sum(), w64)
    _assert_close("d(|dh|^2)/dw", gg, rr)


def test_retain_graph_double_backward_fused():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(4, 3, generator=gen).requires_grad_(True)
    w = torch.randn(6, 3, generator=gen).requires_grad_(True)
    y = torch.tensor([0, 5, 2, 3])
    loss = moepeak.linear_cross_entropy(h, w, y, mode="fused")
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    loss.backward()
    _assert_close("accumulated d_hidden", h.grad, 2 * first, rtol=1e-6, atol=1e-7)
