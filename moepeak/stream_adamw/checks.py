"""StreamAdamW's argument checks (moepeak/stream_adamw/optimizer.py calls them): the
hyper-parameters of its groups, every param with a grad, and the state tensors the kernel
will read and write (its schedule options are checked by StreamAdamWOptions). Every check
runs before any parameter of the update (the step, or one overlap bucket) is touched, and
each error names the parameter (param_groups[g]['params'][i])."""
from __future__ import annotations

import torch

from ..core.abi import DTYPE_CODES
from ..core.ext import HAS_CUDA_BUILD


def local_shard(t):
    """The local shard of a DTensor (FSDP2), else t itself."""
    if t is not None and hasattr(t, "_local_tensor") and type(t).__name__ == "DTensor":
        return t._local_tensor
    return t


def collect(param_groups, devices, only=None, skip=()):
    """Validate every param of param_groups with a grad (nothing is touched on failure);
    return [(group, param, local param, local grad, name)]. devices: param -> the device
    it had at its first step; only: a set of params to restrict to; skip: params to
    leave out."""
    out = []
    for gi, group in enumerate(param_groups):
        check_hyper(f"param_groups[{gi}]['lr']", group["lr"], group["betas"], group["eps"],
                     group["weight_decay"], group.get("amsgrad", False), group.get("maximize", False))
        for pi, p in enumerate(group["params"]):
            if p.grad is None or (only is not None and p not in only) or p in skip:
                continue
            name = f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}, dtype {p.dtype})"
            lp, lg = local_shard(p), local_shard(p.grad)
            if p.grad.is_sparse or lg.layout != torch.strided:
                raise TypeError(f"moepeak.StreamAdamW: {name} has a sparse grad; StreamAdamW needs dense grads")
            if lp.is_complex() or lg.is_complex():
                raise TypeError(f"moepeak.StreamAdamW: {name}: complex params/grads are not supported")
            if lp.dtype not in DTYPE_CODES or lg.dtype not in DTYPE_CODES:
                raise TypeError(f"moepeak.StreamAdamW: {name}: param and grad must be float32, bfloat16 or "
                                f"float16, got {lp.dtype} and {lg.dtype}")
            if lg.shape != lp.shape:
                raise ValueError(f"moepeak.StreamAdamW: {name}: grad shape {tuple(lg.shape)} != param shape")
            if not lp.is_contiguous() or not lg.is_contiguous():
                raise ValueError(f"moepeak.StreamAdamW: {name}: param and grad must be contiguous")
            if lg.device != lp.device:
                raise ValueError(f"moepeak.StreamAdamW: {name}: grad on {lg.device} but param on {lp.device}")
            if lp.device.type not in ("cpu", "cuda"):
                raise ValueError(f"moepeak.StreamAdamW: {name}: params must be on cpu or cuda, got {lp.device}")
            if lp.is_cuda and not HAS_CUDA_BUILD:
                raise RuntimeError(f"moepeak.StreamAdamW: {name} is on CUDA but moepeak._C was built without "
                                   "CUDA; rebuild with nvcc on PATH")
            seen = devices.get(p)
            if seen is not None and seen != lp.device:
                raise ValueError(f"moepeak.StreamAdamW: {name} moved from {seen} to {lp.device} between steps; "
                                 "create the optimizer after moving the model")
            out.append((group, p, lp, lg, name))
    cuda_devs = {lp.device for _, _, lp, _, _ in out if lp.is_cuda}
    if len(cuda_devs) > 1:
        raise ValueError(f"moepeak.StreamAdamW: CUDA params must all be on one device, got "
                         f"{sorted(map(str, cuda_devs))}")
    return out


def check_state_tensors(held, lp, name: str, dev: torch.device, on_device: bool) -> None:
    """Each (key, tensor, dtype) of `held`, the state the kernel reads and writes for the
    local param lp, must be a contiguous tensor of that dtype and lp's numel on `dev`
    ('step': an fp32 scalar there); on_device: the param is a device_state one (the state
    on its device)."""
    for key, t, dtype in held:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"moepeak.StreamAdamW: {name}: state '{key}' must be a tensor, got {type(t).__name__}")
        if key == "step":
            if t.numel() != 1 or t.dtype != torch.float32 or t.device != dev:
                raise TypeError(f"moepeak.StreamAdamW: {name}: state 'step' must be a float32 scalar on {dev} "
                                f"(device_state), got {t.dtype} of {t.numel()} elements on {t.device}")
            continue
        if t.numel() != lp.numel():
            raise RuntimeError(
                f"moepeak.StreamAdamW: {name}: size mismatch: state '{key}' has {t.numel()} elements "
                f"(shape {tuple(t.shape)}) but the param has {lp.numel()} (shape {tuple(lp.shape)}); "
                "was the param's .data replaced or a state_dict of another model loaded?")
        if t.dtype != dtype or t.device != dev or not t.is_contiguous():
            where = "CPU" if not on_device else f"{dev} (device_state)"
            kind = str(dtype).replace("torch.", "")
            raise TypeError(f"moepeak.StreamAdamW: {name}: state '{key}' must be a contiguous {kind} {where} "
                            f"tensor, got {t.dtype} on {t.device} (contiguous={t.is_contiguous()})")


def check_hyper(lr_name, lr, betas, eps, weight_decay, amsgrad, maximize):
    """StreamAdamW's hyper-parameters (a group's, or the defaults): a clear error naming the bad one."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"moepeak.StreamAdamW: {lr_name} tensor must have one element")
        lr = float(lr)
    if not isinstance(lr, (int, float)) or not lr >= 0.0:
        raise ValueError(f"moepeak.StreamAdamW: {lr_name} must be a float >= 0, got {lr!r}")
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"moepeak.StreamAdamW: eps must be >= 0, got {eps!r}")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"moepeak.StreamAdamW: betas must be a pair of floats, got {betas!r}") from None
    for i, b in enumerate((b1, b2)):
        if not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"moepeak.StreamAdamW: betas[{i}] must be in [0, 1), got {b!r}")
    if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
        raise ValueError(f"moepeak.StreamAdamW: weight_decay must be >= 0, got {weight_decay!r}")
    for name, flag in (("amsgrad", amsgrad), ("maximize", maximize)):
        if not isinstance(flag, bool):
            raise TypeError(f"moepeak.StreamAdamW: {name} must be a bool, got {flag!r}")
