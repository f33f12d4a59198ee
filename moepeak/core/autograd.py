"""Small autograd pieces the schedules share."""
from __future__ import annotations

import torch


class _GradScale(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `mul` and then divides it by `div`
    (each skipped when 1, so a division stays a division: bitwise what `grad / div` gives)."""

    @staticmethod
    def forward(ctx, t, mul, div):
        ctx.mul, ctx.div = mul, div
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        if ctx.mul != 1:
            grad = grad * ctx.mul
        if ctx.div != 1:
            grad = grad / ctx.div
        return grad, None, None


def scale_grad(t: torch.Tensor, mul: float = 1.0, div: float = 1.0) -> torch.Tensor:
    """`t` unchanged in forward; its gradient times `mul`, divided by `div`, in backward."""
    return _GradScale.apply(t, mul, div)
