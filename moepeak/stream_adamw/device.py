"""StreamAdamW's device_state: params whose optimizer state stays on their own device.

For a large param whose gradient is final last in backward (the input embedding), the
host update that overlap_backward runs cannot be hidden behind backward. Its fp32
master (bf16/fp16 params), exp_avg, exp_avg_sq and step then live on the param's device
(12 bytes per element; 8 for fp32 params) and torch's fused AdamW kernel updates them
there, on the current stream: from the param's own hook with overlap_backward, else in
step(). Their state is fp32 whatever StreamAdamWOptions.state_dtype says (torch's kernel
updates it; bf16 state with stochastic rounding is the host kernel's). The optimizer
(moepeak/stream_adamw/optimizer.py) owns the order and the state (state.py); this module
holds the choice of params and the update.
"""
from __future__ import annotations

import torch

from .sizes import bucket_elements, device_state_bytes_per_param


def device_state_set(param_groups, device_state) -> set:
    """The params (by identity) named in device_state; each must be one of param_groups'."""
    if device_state is None:
        return set()
    if isinstance(device_state, torch.Tensor):
        device_state = [device_state]
    mine = {id(p) for g in param_groups for p in g["params"]}
    chosen = set()
    for i, p in enumerate(device_state):
        if not isinstance(p, torch.Tensor) or id(p) not in mine:
            what = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"moepeak.StreamAdamW: device_state[{i}] must be one of the optimizer's params, "
                             f"got {what} that is not among them")
        chosen.add(p)
    return chosen


def device_state_bytes(p: torch.Tensor) -> int:
    """Device memory a param's device_state takes on this rank (sizes.device_state_bytes_per_param,
    without amsgrad), over the local shard of a DTensor param (FSDP2)."""
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * device_state_bytes_per_param(p.dtype)


def backward_tail(params, max_bytes: int) -> list:
    """The leading params of `params` (given in forward order, as a module's parameters()
    are) whose device_state fits max_bytes together: their gradients are final last in
    backward, so their host updates are the ones overlap_backward cannot hide. Stops at
    the first param that does not fit (the tail of backward is contiguous)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"moepeak.StreamAdamW.backward_tail: max_bytes must be an int >= 0, got {max_bytes!r}")
    chosen, used = [], 0
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"moepeak.StreamAdamW.backward_tail: params[{i}] must be a tensor, got {type(p).__name__}")
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"moepeak.StreamAdamW.backward_tail: params[{i}] must be float32, bfloat16 or "
                            f"float16 (the dtypes StreamAdamW updates), got {p.dtype}")
        need = device_state_bytes(p)
        if used + need > max_bytes:
            break
        used += need
        chosen.append(p)
    return chosen


def fused_update(entries, state, bucket_mb: float) -> None:
    """One AdamW step of entries [(group, param, local param, local grad, name)] whose state
    (already initialised and checked) is on the param's device: step += 1, then torch's fused
    kernel on the fp32 master (the param itself when fp32), and the param = the master
    rounded to nearest even. CUDA: in slices of bucket_mb MiB, so a low-precision grad is
    cast to fp32 one slice at a time (the kernel is elementwise: slicing changes no bit).
    CPU: one call per param, as torch's CPU kernel rounds a tensor's scalar tail apart from
    its vector body (the host update's C kernel reproduces exactly that)."""
    steps = [state[p]["step"] for _, p, _, _, _ in entries]
    if steps:
        torch._foreach_add_(steps, 1.0)
    for group, p, lp, lg, _ in entries:
        slice_n = bucket_elements(bucket_mb) if lp.is_cuda else max(1, lp.numel())
        st = state[p]
        master = lp if lp.dtype == torch.float32 else st["master_param"]
        flat = [t.view(-1) for t in (master, lg, st["exp_avg"], st["exp_avg_sq"])]
        vmax = st["max_exp_avg_sq"].view(-1) if group["amsgrad"] else None
        beta1, beta2 = group["betas"]
        for a in range(0, lp.numel(), slice_n):
            b = min(lp.numel(), a + slice_n)
            w, g, m, v = (t[a:b] for t in flat)
            torch._fused_adamw_([w], [g.float() if g.dtype != torch.float32 else g], [m], [v],
                                [vmax[a:b]] if vmax is not None else [], [st["step"]],
                                amsgrad=bool(group["amsgrad"]), lr=float(group["lr"]), beta1=float(beta1),
                                beta2=float(beta2), weight_decay=float(group["weight_decay"]),
                                eps=float(group["eps"]), maximize=bool(group["maximize"]),
                                grad_scale=None, found_inf=None)
            if lp.dtype != torch.float32:
                lp.view(-1)[a:b].copy_(w)
