"""Shared glue between the Python schedules and moepeak._C: loading the
extension, argument checks that name the argument, and stream handles.

Every op validates its inputs here, in Python, before any pointer reaches C,
so bad input raises a clear error and nothing is half-done.

Every CUDA op takes its stream from current_stream_handle, which also checks,
once per device, that the GPU can run one of the nvcc targets moepeak._C was
built for (CUDA_TARGETS, from setup.py; check_cuda_arch): a build for other GPUs
fails there with the device's compute capability and the built list named,
instead of with a CUDA launch error inside a kernel wrapper. CUDA's rules
(target_runs_on): SASS sm_XY runs on devices of major X with minor >= Y (sm_80
on 8.6 and 8.9, never on 9.0); PTX compute_XY is JIT-compiled for any device of
compute capability >= X.Y; the arch-specific sm_XYa / compute_XYa run on X.Y
only; the family-specific sm_XYf / compute_XYf on major X with minor >= Y.
"""
from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence, Tuple

import torch

from .. import _C

HAS_CUDA_BUILD: bool = bool(_C.has_cuda)
# The nvcc targets of the CUDA objects, e.g. ("sm_80", ..., "sm_120", "compute_120"); () if unknown.
CUDA_TARGETS: Tuple[str, ...] = tuple(getattr(_C, "cuda_archs", ()))
_TARGET = re.compile(r"^(sm|compute)_([1-9][0-9]?)([0-9])([af]?)$")
CHECKED_DEVICES = set()  # CUDA device indices that passed check_cuda_arch


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


def parse_cuda_target(target: str) -> Tuple[str, int, int, str]:
    """("sm" or "compute", major, minor, suffix "" / "a" / "f") of an nvcc target such as
    "sm_86", "compute_120" or "sm_90a"."""
    m = _TARGET.match(target)
    if m is None:
        raise ValueError(f"moepeak: {target!r} is not an nvcc target like sm_90, compute_120 or sm_90a")
    kind, major, minor, suffix = m.groups()
    return kind, int(major), int(minor), suffix


def target_runs_on(target: str, capability: Tuple[int, int]) -> bool:
    """True when code built for the nvcc `target` runs on a device of compute capability
    (major, minor): SASS on the same major with an equal or higher minor, PTX (JIT) on any
    equal or higher capability; "a" targets on their exact capability only, "f" targets
    on their family (same major, equal or higher minor)."""
    kind, major, minor, suffix = parse_cuda_target(target)
    dev_major, dev_minor = capability
    if suffix == "a":
        return (dev_major, dev_minor) == (major, minor)
    if suffix == "f" or kind == "sm":
        return dev_major == major and dev_minor >= minor
    return (dev_major, dev_minor) >= (major, minor)


def cuda_arch_error(capability: Tuple[int, int], targets: Sequence[str], device_name: str = "") -> Optional[str]:
    """None when one of `targets` runs on `capability`, else the error message saying why not."""
    if any(target_runs_on(t, capability) for t in targets):
        return None
    cap = f"{capability[0]}.{capability[1]}"
    gpu = f"{device_name} (compute capability {cap})" if device_name else f"compute capability {cap}"
    built = ", ".join(targets) if targets else "no GPU"
    return (f"moepeak: this GPU, {gpu}, cannot run moepeak._C's CUDA kernels, built for {built} (SASS sm_XY "
            f"runs on compute capability X.Y to X.9, PTX compute_XY on X.Y and above). Rebuild on this "
            f"machine (the build targets the GPUs present): pip install --no-build-isolation --no-deps -e . "
            f"(or set MOEPEAK_CUDA_ARCH={capability[0]}{capability[1]} where the build cannot see the GPU)")


def check_cuda_arch(device: torch.device) -> None:
    """Raise RuntimeError unless moepeak._C's CUDA targets run on `device` (checked once per
    device; nothing to check on a CPU-only build or one that does not list its targets)."""
    if not HAS_CUDA_BUILD or not CUDA_TARGETS:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in CHECKED_DEVICES:
        return
    message = cuda_arch_error(torch.cuda.get_device_capability(index), CUDA_TARGETS,
                              torch.cuda.get_device_name(index))
    if message is not None:
        raise RuntimeError(message)
    CHECKED_DEVICES.add(index)


def current_stream_handle(device: torch.device) -> int:
    """torch's current stream on `device` as an int (cudaStream_t); 0 on CPU. On a CUDA
    device, first checks that moepeak._C was built for it (check_cuda_arch)."""
    if device.type != "cuda":
        return 0
    check_cuda_arch(device)
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
