"""moepeak.norms.rms_norm against transformers' Llama-style RMSNorm modules (forward bitwise)
and an fp64 reference (gradients, docs/design.md's rule: at most 2x the eager module's own error at the
same dtype), and the live bytes of its backward (the plan's lean final_norm term)."""
import pytest
import torch

from moepeak import plan as P
from moepeak.norms import BACKWARD_CHUNK_FP32, DEFAULT_CHUNK_TOKENS, default_chunk_rows, rms_norm
from refs import rms_norm_ref
from tiled_blocks import LiveBytes

transformers = pytest.importorskip("transformers")

from moepeak.hf import LEAN_NORMS  # noqa: E402

MODULES = {"Qwen3MoeRMSNorm": "qwen3_moe", "Qwen2MoeRMSNorm": "qwen2_moe", "MixtralRMSNorm": "mixtral",
           "OlmoeRMSNorm": "olmoe", "DeepseekV3RMSNorm": "deepseek_v3", "GptOssRMSNorm": "gpt_oss"}


def _module(name, H, dtype, eps=1e-6, seed=0):
    import importlib
    modeling = importlib.import_module(f"transformers.models.{MODULES[name]}.modeling_{MODULES[name]}")
    norm = getattr(modeling, name)(H, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(H, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


def test_lean_norms_list_is_what_is_tested():
    assert set(LEAN_NORMS) == set(MODULES)
    assert [k for k, fp32 in LEAN_NORMS.items() if fp32] == ["GptOssRMSNorm"]


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,chunk", [(37, 5), (40, 8), (40, 40), (1, 4), (7, DEFAULT_CHUNK_TOKENS)])
def test_forward_bitwise_and_grads_within_rule(name, dtype, T, chunk):
    H = 48
    norm = _module(name, H, dtype, eps=1e-5)
    g = torch.Generator().manual_seed(T)
    x0 = (3 * torch.randn(2, T, H, generator=g)).to(dtype)
    gy = torch.randn(2, T, H, generator=g).to(dtype)

    def run(fn, x):
        x = x.detach().requires_grad_(True)
        norm.weight.grad = None
        y = fn(x)
        y.backward(gy.to(y.dtype))
        return y.detach(), x.grad, norm.weight.grad.clone()

    y, dx, dw = run(lambda x: rms_norm(x, norm.weight, norm.variance_epsilon, chunk_tokens=chunk,
                                       multiply_in_fp32=LEAN_NORMS[name]), x0)
    y_hf, dx_hf, dw_hf = run(norm, x0)
    assert y.dtype == y_hf.dtype and torch.equal(y, y_hf), "forward differs from the module's"
    xd = x0.double().requires_grad_(True)
    wd = norm.weight.detach().double().requires_grad_(True)
    rms_norm_ref(xd, wd, norm.variance_epsilon).backward(gy.double())
    assert dx.dtype == dtype and dw.dtype == norm.weight.dtype
    for what, ours, eager, truth in (("dx", dx, dx_hf, xd.grad), ("dweight", dw, dw_hf, wd.grad)):
        e_ours = (ours.double() - truth).abs()
        e_eager = (eager.double() - truth).abs()
        if dtype == torch.float32:  # the eager module's error at fp32 (it may be exact on a few rows)
            tol = 2 * e_eager.max().item() + 1e-5 * truth.abs().max().item()
        else:
            tol = 2 * e_eager.max().item()
        assert e_ours.max().item() <= tol, \
            f"{what}: max diff {e_ours.max().item():.3g} mean {e_ours.mean().item():.3g}, eager max " \
            f"{e_eager.max().item():.3g} mean {e_eager.mean().item():.3g}"
        assert e_ours.mean().item() <= 2 * e_eager.mean().item() + 1e-7 * truth.abs().max().item(), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_demo_models_norm(dtype):
    """moepeak.demo.models.RMSNorm multiplies in fp32 (GPT-OSS's order): bitwise forward with
    multiply_in_fp32=True, and its lean mode (the final norm's) is exactly that function."""
    from moepeak.demo.models import RMSNorm
    H = 40
    eager = RMSNorm(H, 1e-5, dtype=dtype)
    lean = RMSNorm(H, 1e-5, dtype=dtype, lean=True)
    with torch.no_grad():
        eager.weight.copy_(1 + 0.5 * torch.randn(H, generator=torch.Generator().manual_seed(1)))
        lean.weight.copy_(eager.weight)
    x = (3 * torch.randn(3, 11, H, generator=torch.Generator().manual_seed(2))).to(dtype).requires_grad_(True)
    y4 = rms_norm(x, eager.weight, 1e-5, chunk_tokens=4, multiply_in_fp32=True)
    assert y4.dtype == dtype and torch.equal(y4, eager(x)) and torch.equal(lean(x), eager(x))
    y = rms_norm(x, eager.weight, 1e-5, multiply_in_fp32=True)  # the module's chunking: same dweight sums
    g = torch.randn(3, 11, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    dx_lean, dw_lean = torch.autograd.grad(lean(x), [x, lean.weight], g)
    dx, dw = torch.autograd.grad(y, [x, eager.weight], g)
    assert torch.equal(dx_lean, dx) and torch.equal(dw_lean, dw)


def test_empty_non_contiguous_and_no_grad_paths():
    H = 16
    norm = _module("Qwen3MoeRMSNorm", H, torch.float32)
    x = torch.randn(0, H, requires_grad=True)
    y = rms_norm(x, norm.weight, 1e-6, chunk_tokens=4)
    assert y.shape == (0, H)
    y.sum().backward()
    assert x.grad.shape == (0, H) and torch.equal(norm.weight.grad, torch.zeros(H))
    base = torch.randn(H, 9, requires_grad=True)  # x = base.t(): [9, H], not contiguous
    norm.weight.grad = None
    y = rms_norm(base.t(), norm.weight, 1e-6, chunk_tokens=4)
    # strided rows: torch's own reduction order over them depends on how many rows one call
    # sees, so only contiguous input is bitwise the module's; here they agree to fp32 rounding
    torch.testing.assert_close(y, norm(base.t()), rtol=1e-6, atol=1e-6)
    y.backward(torch.ones_like(y))
    dx_lean, dw_lean = base.grad.clone(), norm.weight.grad.clone()
    base.grad, norm.weight.grad = None, None
    norm(base.t()).backward(torch.ones_like(y))
    torch.testing.assert_close(dx_lean, base.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw_lean, norm.weight.grad, rtol=1e-5, atol=1e-6)
    w = norm.weight.detach()  # only x needs grad
    xs = torch.randn(5, H, requires_grad=True)
    rms_norm(xs, w, 1e-6, chunk_tokens=2).sum().backward()
    assert xs.grad is not None
    with torch.no_grad():
        assert torch.equal(rms_norm(xs, w, 1e-6), norm(xs))


def test_default_chunk_is_a_fixed_number_of_elements():
    """chunk_tokens=None: DEFAULT_CHUNK_TOKENS rows at H = 2048, the same fp32 bytes at other
    widths (a per-head norm, H = 128, takes 16x the rows), bitwise the explicit chunking."""
    assert default_chunk_rows(2048) == DEFAULT_CHUNK_TOKENS
    assert default_chunk_rows(128) == 16 * DEFAULT_CHUNK_TOKENS and default_chunk_rows(1 << 30) == 1
    H = 4096 * 2048 // 48 + 1  # wide rows: a default chunk of 48 rows, so T = 100 runs three chunks
    assert default_chunk_rows(H) == 47
    w = 1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(0))
    x = torch.randn(100, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(100, H, generator=torch.Generator().manual_seed(2))
    y = rms_norm(x, w, 1e-6)
    (dx,) = torch.autograd.grad(y, x, g)
    y2 = rms_norm(x, w, 1e-6, chunk_tokens=47)
    (dx2,) = torch.autograd.grad(y2, x, g)
    assert torch.equal(y, y2) and torch.equal(dx, dx2)


def test_bad_arguments():
    w = torch.ones(8)
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight must be a tensor \\[H\\] = \\[8\\]"):
        rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive integer"):
        rms_norm(x, w, 1e-6, chunk_tokens=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        rms_norm(x, w, 1e-6, chunk_tokens=2.0)
    with pytest.raises(ValueError, match="eps must be a float >= 0"):
        rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, None)
    with pytest.raises(TypeError, match="x must be floating point"):
        rms_norm(torch.ones(3, 8, dtype=torch.long), w, 1e-6)
    with pytest.raises(ValueError, match="x must be a tensor"):
        rms_norm(torch.tensor(1.0), torch.ones(1), 1e-6)
    with pytest.raises(TypeError, match="weight must be floating point"):
        rms_norm(x, torch.ones(8, dtype=torch.long), 1e-6)
    with pytest.raises(TypeError, match="multiply_in_fp32 must be a bool"):
        rms_norm(x, w, 1e-6, multiply_in_fp32=1)


@pytest.mark.parametrize("T,H,chunk", [(512, 64, 64), (300, 128, 128), (256, 64, 4096)])
def test_backward_live_bytes_are_the_plans_lean_final_norm(T, H, chunk):
    """bf16 lean norm: live bytes through forward and backward peak at the saved x, rstd, the
    incoming grad, dx and three fp32 [c, H] chunk temporaries (the plan's final_norm with
    lean_norm); not counted: the weight's [H] gradient and scalars (< 1% here)."""
    norm = _module("Qwen3MoeRMSNorm", H, torch.bfloat16)
    x = torch.randn(1, T, H, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, T, H, dtype=torch.bfloat16)
    with LiveBytes() as live:
        # LiveBytes counts x's storage too (the norm saves a view of it): as in the model,
        # where the norm's saved input is the last block's output
        (rms_norm(x, norm.weight, norm.variance_epsilon, chunk_tokens=chunk) * g).sum().backward()
    shape = P.ModelShape(layers=2, hidden=H, experts=4, top_k=2, intermediate=32, vocab=256, heads=4,
                         kv_heads=2, head_dim=16)
    pred = P.peaks(shape, P.Setup(gpus=1, impl="hf", norm_chunk_tokens=chunk), T, "moepeak")["final_norm"]
    assert pred == T * (3 * 2 * H + 4) + BACKWARD_CHUNK_FP32 * 4 * min(chunk, T) * H
    assert 0 <= live.peak - pred <= 1e-2 * pred, (live.peak, pred)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["Qwen3MoeRMSNorm", "GptOssRMSNorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_forward_bitwise_and_grads_within_rule(dtype, name):
    """On the GPU: chunked forward bitwise the module's at the bench's H (2048), T not a multiple
    of the chunk; gradients within docs/design.md's rule of the fp64 reference."""
    T, H, chunk = 10000, 2048, DEFAULT_CHUNK_TOKENS
    norm = _module(name, H, dtype).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(1, T, H, device="cuda", generator=g).to(dtype)
    gy = torch.randn(1, T, H, device="cuda", generator=g).to(dtype)
    grads = []
    for fn in (lambda x: rms_norm(x, norm.weight, norm.variance_epsilon, chunk_tokens=chunk,
                                  multiply_in_fp32=LEAN_NORMS[name]), norm):
        x = x0.detach().requires_grad_(True)
        norm.weight.grad = None
        y = fn(x)
        y.backward(gy)
        grads.append((y.detach(), x.grad, norm.weight.grad.clone()))
    (y, dx, dw), (y_hf, dx_hf, dw_hf) = grads
    assert torch.equal(y, y_hf)
    xd = x0.double().requires_grad_(True)
    wd = norm.weight.detach().double().requires_grad_(True)
    rms_norm_ref(xd, wd, norm.variance_epsilon).backward(gy.double())
    for what, ours, eager, truth in (("dx", dx, dx_hf, xd.grad), ("dweight", dw, dw_hf, wd.grad)):
        e_ours, e_eager = (ours.double() - truth).abs(), (eager.double() - truth).abs()
        slack = 1e-5 * truth.abs().max().item() if dtype == torch.float32 else 0.0
        assert e_ours.max().item() <= 2 * e_eager.max().item() + slack, \
            f"{what}: max {e_ours.max().item():.3g} mean {e_ours.mean().item():.3g}, eager {e_eager.max().item():.3g}"
