"""moepeak.norms: an RMSNorm whose backward holds chunk-sized fp32 temporaries.

    y = rms_norm(x, weight, eps, chunk_tokens=None, multiply_in_fp32=False)

computes what transformers' RMSNorm forwards compute, op for op, so for contiguous x the
result is bitwise that of the module (strided x: torch's reduction order over strided rows
depends on how many rows one call sees, so it agrees to rounding):

    h = x.to(float32); var = h.pow(2).mean(-1, keepdim=True); h = h * rsqrt(var + eps)
    y = weight * h.to(x.dtype)              Llama order (Qwen3MoeRMSNorm, MixtralRMSNorm, ...
                                            in transformers 5.17): the default
    y = (h * weight.float()).to(x.dtype)    multiply_in_fp32=True (GptOssRMSNorm, the demo
                                            model's RMSNorm)

Eager autograd through those ops saves fp32 x [T, H] and its backward peaks at that
plus five fp32 [T, H] temporaries (24*H bytes per token). This function saves only
x [T, H] in its own dtype and rstd [T] fp32, and its forward and backward run T in
chunks of chunk_tokens rows, so the fp32 temporaries are [chunk_tokens, H]. The default
(chunk_tokens=None) is default_chunk_rows(H): DEFAULT_CHUNK_TOKENS rows at H = 2048 and the
same fp32 bytes at any other width (a per-head q/k norm, H = 128, takes 16x the rows), so
narrow norms do not pay a Python loop of tiny chunks.

Backward, per row (exact math; n = h * rstd is the fp32 normalised row, g = grad_y * weight):
    dx = rstd * (g - n * mean(g * n))          (cast to x.dtype)
    dweight = sum over rows of grad_y * n      (accumulated over chunks in fp32)
Its live bytes at the peak: the saved x and rstd, the incoming grad_y, dx [T, H] and
three fp32 [chunk_tokens, H] (h, g and one product); BACKWARD_CHUNK_FP32 names that 3.
"""
from __future__ import annotations

from typing import Optional

import torch

# 4096 rows x H = 2048: each fp32 chunk temporary is 32 MiB, three of them 96 MiB.
DEFAULT_CHUNK_TOKENS = 4096
CHUNK_ELEMENTS = DEFAULT_CHUNK_TOKENS * 2048  # the default chunk's elements, whatever H
BACKWARD_CHUNK_FP32 = 3  # fp32 [chunk_tokens, H] temporaries alive at once in the backward


def default_chunk_rows(H: int) -> int:
    """Rows per chunk when chunk_tokens is None: CHUNK_ELEMENTS // H (at least 1)."""
    return max(1, CHUNK_ELEMENTS // max(1, H))


def _check(x, weight, eps, chunk_tokens):
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"rms_norm: x must be a tensor [..., H], got {getattr(x, 'shape', type(x).__name__)}")
    if not x.is_floating_point():
        raise TypeError(f"rms_norm: x must be floating point, got {x.dtype}")
    H = x.shape[-1]
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (H,):
        raise ValueError(f"rms_norm: weight must be a tensor [H] = [{H}] (x's last dim), got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if not weight.is_floating_point():
        raise TypeError(f"rms_norm: weight must be floating point, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight is on {weight.device}, x on {x.device} (expected the same device)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"rms_norm: eps must be a float >= 0, got {eps!r}")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"rms_norm: chunk_tokens must be a positive integer or None, got {chunk_tokens!r}")


def _backward_chunk(x, rstd, grad_y, w32, dx, dw):
    """One chunk of rows: writes dx [c, H] (x.dtype; None: not wanted) and adds into dw [H]
    fp32 (None: not wanted). Its fp32 [c, H] temporaries die on return (at most three alive)."""
    r = rstd.unsqueeze(-1)                        # [c, 1] fp32
    # x * r and grad_y * w32 promote to fp32: new tensors, the saved x and grad_y stay untouched
    n = x * r                                     # [c, H] fp32: normalised rows
    if dw is not None:
        dw += (grad_y * n).sum(0)
    if dx is not None:
        g = grad_y * w32                          # [c, H] fp32: grad wrt n
        proj = (g * n).mean(-1, keepdim=True)     # [c, 1]
        g.sub_(n.mul_(proj)).mul_(r)
        dx.copy_(g)


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, eps, chunk_tokens, multiply_in_fp32):
        # x2: [T, H] x dtype (any strides); out: [T, H] x promote(weight, x) (multiply_in_fp32:
        # x dtype); rstd: [T] fp32
        T, H = x2.shape
        out_dtype = x2.dtype if multiply_in_fp32 else torch.promote_types(weight.dtype, x2.dtype)
        out = torch.empty((T, H), dtype=out_dtype, device=x2.device)
        rstd = torch.empty(T, dtype=torch.float32, device=x2.device)
        w32 = weight.to(torch.float32) if multiply_in_fp32 else None
        for lo in range(0, T, chunk_tokens):
            hi = min(lo + chunk_tokens, T)
            # transformers' op order, on rows [lo, hi)
            h = x2[lo:hi].to(torch.float32)
            variance = h.pow(2).mean(-1, keepdim=True)
            r = torch.rsqrt(variance + eps)
            h = h * r
            out[lo:hi] = (h * w32).to(x2.dtype) if multiply_in_fp32 else weight * h.to(x2.dtype)
            rstd[lo:hi] = r.squeeze(-1)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.chunk_tokens = chunk_tokens
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight, rstd = ctx.saved_tensors
        T, H = x2.shape
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = torch.empty_like(x2) if want_dx else None          # [T, H] x dtype
        dw = torch.zeros(H, dtype=torch.float32, device=x2.device) if want_dw else None  # fp32 [H] accumulator
        w32 = weight.to(torch.float32)
        for lo in range(0, T, ctx.chunk_tokens):
            hi = min(lo + ctx.chunk_tokens, T)
            _backward_chunk(x2[lo:hi], rstd[lo:hi], grad_out[lo:hi], w32,
                            dx[lo:hi] if want_dx else None, dw)
        return dx, (dw.to(weight.dtype) if want_dw else None), None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             chunk_tokens: Optional[int] = None, multiply_in_fp32: bool = False) -> torch.Tensor:
    """RMSNorm of x [..., H] with weight [H], for contiguous x bitwise equal to transformers'
    forward: weight * normalise(x.float()).to(x.dtype) (Qwen3MoeRMSNorm / MixtralRMSNorm; returns
    promote(weight.dtype, x.dtype)), or with multiply_in_fp32 (normalise(x.float()) *
    weight.float()).to(x.dtype) (GptOssRMSNorm; returns x.dtype). Saves x and fp32 rstd [T]
    only; forward and backward run chunk_tokens rows at a time (see the module docstring)."""
    _check(x, weight, eps, chunk_tokens)
    if not isinstance(multiply_in_fp32, bool):
        raise TypeError(f"rms_norm: multiply_in_fp32 must be a bool, got {multiply_in_fp32!r}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # a view where x's layout allows (then its strides are kept)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_rows(shape[-1])
    return _LeanRMSNorm.apply(x2, weight, float(eps), chunk_tokens, multiply_in_fp32).view(*shape[:-1], shape[-1])


__all__ = ["rms_norm", "default_chunk_rows", "DEFAULT_CHUNK_TOKENS", "CHUNK_ELEMENTS", "BACKWARD_CHUNK_FP32"]
