"""Shared glue between the Python schedules and moepeak._C: loading the
extension, argument checks that name the argument, and stream handles.

Every op validates its inputs here, in Python, before any pointer reaches C,
so bad input raises a clear error and nothing is half-done.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from . import _C

HAS_CUDA_BUILD: bool = bool(_C.has_cuda)


def cuda_ready(device: Optional[torch.device] = None) -> bool:
    """True when CUDA tensors can use moepeak's CUDA kernels."""
    return HAS_CUDA_BUILD and torch.cuda.is_available()


def require_cuda_build(what: str) -> None:
    if not HAS_CUDA_BUILD:
        raise RuntimeError(
            f"moepeak: {what} got CUDA tensors, but moepeak._C was built without CUDA "
            "(no nvcc at build time, or MOEPEAK_CUDA=0). Rebuild with nvcc on PATH: "
            "pip install --no-build-isolation --no-deps ."
        )


def current_stream_handle(device: torch.device) -> int:
    """torch's current stream on `device` as an int (cudaStream_t); 0 on CPU."""
    if device.type != "cuda":
        return 0
    return torch.cuda.current_stream(device).cuda_stream


def check_tensor(
    name: str,
    t,
    *,
    dtypes: Optional[Iterable[torch.dtype]] = None,
    ndim: Optional[int] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = False,
    floating: bool = False,
) -> torch.Tensor:
    """Raise TypeError/ValueError naming `name` unless `t` is the tensor expected."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"moepeak: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"moepeak: {name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.is_complex():
        raise TypeError(f"moepeak: {name} must be real, got complex dtype {t.dtype}")
    if floating and not t.is_floating_point():
        raise TypeError(f"moepeak: {name} must be a floating-point tensor, got {t.dtype}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"moepeak: {name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"moepeak: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"moepeak: {name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"moepeak: {name} must be contiguous (call .contiguous()), got strides {t.stride()}")
    return t
