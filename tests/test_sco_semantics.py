"""SCO against torch.utils.checkpoint(use_reentrant=False) on what backward sees
and on torch.compile: saved-tensor object identity, the recompute-mismatch
message, a compiled model with SCO blocks (gradients bitwise those of the
eager run), and apply_sco refusing blocks that are not the model's."""
import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import moepeak
from moepeak.sco import SCOConfig, SCOOffloader, offloader_of
from tests.refs import SCOBlock

H, B, T = 16, 2, 8


class _SaveSecond(torch.autograd.Function):
    """Returns x, saves y; backward reports the object ctx.saved_tensors gave it."""

    seen = None

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(y)
        return x * 1

    @staticmethod
    def backward(ctx, g):
        (_SaveSecond.seen,) = ctx.saved_tensors
        return g, None


def _torch_ck(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def _sco_ck(fn, *args):
    return moepeak.sco_checkpoint(fn, *args, sco_offloader=SCOOffloader())


@pytest.mark.parametrize("ck", [_torch_ck, _sco_ck], ids=["torch", "sco"])
def test_saved_tensor_without_grad_is_the_same_object(ck):
    # torch's own test_checkpointing_without_reentrant_saved_object_identity: a saved
    # argument that needs no grad reaches backward as the caller's very object
    a = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(1.0)
    _SaveSecond.seen = None
    ck(_SaveSecond.apply, a, b).backward()
    assert _SaveSecond.seen is b


@pytest.mark.parametrize("keep", [False, True])
def test_boundary_without_grad_is_the_same_object_on_cpu(keep):
    # The boundary (first tensor argument) needs no grad here and never leaves its
    # place on CPU: the replay hands backward that object, as torch's checkpoint does.
    b = torch.tensor(2.0)
    c = torch.tensor(3.0, requires_grad=True)
    for ck in (_torch_ck, lambda f, *a: moepeak.sco_checkpoint(f, *a, sco_offloader=SCOOffloader(),
                                                               sco_keep_on_gpu=keep)):
        _SaveSecond.seen = None
        ck(lambda y, x: _SaveSecond.apply(x, y), b, c).backward()
        assert _SaveSecond.seen is b


def test_saved_tensor_with_grad_comes_back_detached_like_torch():
    seen = {}

    class SaveBoth(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            seen["x"], seen["w"] = x, w
            return g * w, g * x

    for name, ck in (("torch", _torch_ck), ("sco", _sco_ck)):
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        ck(SaveBoth.apply, x, w).sum().backward()
        assert seen["x"] is not x and seen["w"] is not w, name
        assert torch.equal(seen["x"], x) and torch.equal(seen["w"], w), name


def _changing_fn(second_call):
    """fn whose second call (the recompute) runs second_call instead of its first ops."""
    calls = []

    def fn(x):
        calls.append(1)
        return (second_call(x) if len(calls) > 1 else x.sin().cos()).sum()
    return fn


@pytest.mark.parametrize("second_call, message", [
    (lambda x: x[:2].sin().cos(), r"saved tensor 0 of 2 was shape \(4,\) dtype torch.float32 in the forward but "
                                  r"shape \(2,\) dtype torch.float32 in the recompute"),
    (lambda x: x.sin().double().cos(), r"saved tensor 1 of 2 was shape \(4,\) dtype torch.float32 in the forward "
                                       r"but shape \(4,\) dtype torch.float64 in the recompute"),
    (lambda x: x.sin(), r"the recompute saved 1 tensors but the forward saved 2"),
], ids=["shape", "dtype", "count"])
def test_recompute_mismatch_says_what_differs(second_call, message):
    x = torch.randn(4, requires_grad=True)
    y = moepeak.sco_checkpoint(_changing_fn(second_call), x, sco_offloader=SCOOffloader())
    with pytest.raises(RuntimeError, match=message):
        y.backward()


class _Model(torch.nn.Module):
    def __init__(self, n=2, dropout=0.1):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([SCOBlock(H, dropout=dropout) for _ in range(n)])
        self.head = torch.nn.Linear(H, 5)

    def forward(self, x):
        for blk in self.layers:
            x = blk(x)
        return self.head(x)


def _torch_checkpointed(model):
    for blk in model.layers:
        blk.forward = lambda x, _f=blk.forward: checkpoint(_f, x, use_reentrant=False)
    return model


def _grads(model, x, steps=2):
    """Per step: the input's and every parameter's gradient (dropout seeded per step)."""
    out = []
    for step in range(steps):
        model.zero_grad()
        xi = x.clone().requires_grad_()
        torch.manual_seed(100 + step)
        model(xi).square().sum().backward()
        out.append([xi.grad] + [p.grad.clone() for p in model.parameters()])
    return out


def _assert_bitwise(a, b):
    for step, (ga, gb) in enumerate(zip(a, b)):
        for i, (u, v) in enumerate(zip(ga, gb)):
            assert torch.equal(u, v), f"step {step} grad {i}: max diff {(u - v).abs().max().item()}"


def test_torch_compile_of_apply_sco_model_matches_eager_bitwise():
    torch._dynamo.reset()
    x = torch.randn(B, T, H)
    ref = _grads(_torch_checkpointed(_Model()), x)
    eager = moepeak.apply_sco(_Model(), blocks=SCOBlock, config=SCOConfig())
    model = moepeak.apply_sco(_Model(), blocks=SCOBlock, config=SCOConfig())
    compiled = torch.compile(model, backend="aot_eager")
    _assert_bitwise(_grads(eager, x), ref)
    _assert_bitwise(_grads(compiled, x), ref)
    st = offloader_of(model).stats("cpu")  # the blocks really ran under SCO
    assert st["offloads"] == 2 and st["kept"] == 2 and st["live"] == 0


@pytest.mark.slow
def test_torch_compile_inductor_of_apply_sco_model_runs():
    # The default backend: the blocks run eagerly (graph break), the head compiled by
    # inductor, whose kernels may round differently from eager ones: close, not bitwise.
    torch._dynamo.reset()
    x = torch.randn(B, T, H)
    ref = _grads(_torch_checkpointed(_Model()), x, steps=1)
    compiled = torch.compile(moepeak.apply_sco(_Model(), blocks=SCOBlock, config=SCOConfig()))
    for u, v in zip(_grads(compiled, x, steps=1)[0], ref[0]):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def test_apply_sco_refuses_blocks_of_another_model():
    model, other = _Model(), _Model()
    before = [blk.forward for blk in model.layers]
    with pytest.raises(ValueError, match=r"blocks\[0\] \(SCOBlock\) is not a submodule of model \(_Model\)"):
        moepeak.apply_sco(model, blocks=other.layers)
    with pytest.raises(ValueError, match=r"blocks\[1\] \(SCOBlock\) is not a submodule"):
        moepeak.apply_sco(model, blocks=[model.layers[0], copy.deepcopy(model.layers[1])])
    with pytest.raises(ValueError, match=r"apply_sco blocks \(SCOBlock\) is not a submodule"):
        moepeak.apply_sco(model, blocks=other.layers[1])
    with pytest.raises(ValueError, match=r"apply_sco blocks\[0\] \(SCOBlock\) is not a submodule"):
        moepeak.apply_sco(model, blocks=torch.nn.ModuleList([other.layers[1]]))
    # nothing was wrapped: the first block of the mixed list is untouched
    assert [blk.forward for blk in model.layers] == before
    assert all(getattr(blk, "_moepeak_sco", None) is None for blk in list(model.layers) + list(other.layers))


@pytest.mark.cuda
def test_cuda_saved_tensor_identity_kept_and_offloaded_boundary():
    # on the GPU too: a non-boundary argument without grad comes back as itself; the
    # boundary without grad as itself when kept on the GPU, as a fresh equal tensor
    # once it went through the pinned arena
    b = torch.randn(3, device="cuda")
    c = torch.randn(3, device="cuda", requires_grad=True)
    for keep in (False, True):
        _SaveSecond.seen = None
        moepeak.sco_checkpoint(_SaveSecond.apply, c, b, sco_offloader=SCOOffloader(),
                               sco_keep_on_gpu=keep).sum().backward()
        assert _SaveSecond.seen is b
        _SaveSecond.seen = None
        moepeak.sco_checkpoint(lambda y, x: _SaveSecond.apply(x, y), b, c, sco_offloader=SCOOffloader(),
                               sco_keep_on_gpu=keep).sum().backward()
        assert (_SaveSecond.seen is b) == keep and torch.equal(_SaveSecond.seen, b)
