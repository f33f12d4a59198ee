"""Expert parallelism in moepeak.hf: apply_moepeak(model, group=ep_group).

Rank r of the P ranks of the group keeps experts [r*E/P, (r+1)*E/P) of every experts
module moepeak runs: the parameter (same name) becomes that slice [E/P, ...]. Each rank
runs its own batch; PipelinedLLEP takes its tokens to their experts and back.

Gradients follow data parallelism's convention: every parameter's gradient is that of
the mean of the ranks' losses (with as many target tokens on every rank, one process's
gradient on the ranks' batches put together), so the optimizer step, gradient clipping
included, is that of one process.
- An expert slice is rank-local. PipelinedLLEP brings every rank's tokens' contribution
  home to it, which is the gradient of the *sum* of the ranks' losses; the experts path
  divides it by P on its way (group_mean_gradient), so the slice's gradient is final
  when backward returns and is never averaged again. (Megatron-Core scales its expert
  gradients by 1 / data-parallel size in its DDP for the same reason; torchtitan divides
  the loss by the global token count and sums every gradient instead.)
- Every other parameter is replicated and its gradient must be averaged over the group:
  by torch's DistributedDataParallel, which leaves the expert slices alone because
  apply_moepeak lists them in model._ddp_params_and_buffers_to_ignore (DDP's own mark,
  read when it wraps the model), or, without DDP, by average_gradients(model).
- Gradient-norm clipping must count every rank's slices: clip_grad_norm_(model, max_norm).
  torch.nn.utils.clip_grad_norm_ on one rank's parameters sees only its own slices, so the
  ranks would clip by different factors and their replicated parameters drift apart.
"""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from ..core.autograd import scale_grad

# The experts module's parameters a rank keeps a slice of (those its layout has).
EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def group_size(group) -> int:
    """Ranks in `group` (1 for None: no expert parallelism)."""
    return 1 if group is None else torch.distributed.get_world_size(group)


def group_mean_gradient(t, group):
    """An expert slice (or its bias) as the experts path reads it: the tensor itself, whose
    gradient is divided by the group's size P (the sum over the ranks' losses that
    PipelinedLLEP brings home becomes the gradient of their mean). None stays None."""
    P = group_size(group)
    return t if t is None or P == 1 else scale_grad(t, div=P)


def keep_expert_slice(module, rank: int, P: int) -> None:
    """Replace each expert parameter [E, ...] of `module` by rank's slice [E/P, ...] (same name)."""
    El = module.num_experts // P
    for pname in EXPERT_PARAMS:
        full = getattr(module, pname, None)
        if full is None:
            continue
        local = full.detach()[rank * El:(rank + 1) * El].clone()
        setattr(module, pname, torch.nn.Parameter(local, requires_grad=full.requires_grad))


def _split_plans(model):
    """(module name, module, plan) of each experts module whose experts are split over a group."""
    for name, m in model.named_modules():
        plan = getattr(m, "_moepeak_experts", None)
        if plan is not None and plan.run is not None and group_size(plan.group) > 1:
            yield name, m, plan


def expert_slices(model) -> Dict[str, torch.nn.Parameter]:
    """{parameter name: parameter} of this rank's expert slices after
    apply_moepeak(model, group=...): rank-local, their gradients final after backward.
    Empty without expert parallelism. For FSDP2, fully_shard(..., ignored_params=set(
    expert_slices(model).values())) keeps them out of its reduction likewise."""
    out = {}
    for name, m, _ in _split_plans(model):
        for pname in EXPERT_PARAMS:
            p = m._parameters.get(pname)
            if p is not None:
                out[f"{name}.{pname}" if name else pname] = p
    return out


def mark_slices_for_ddp(model) -> List[str]:
    """Add the expert slices' names to model._ddp_params_and_buffers_to_ignore (through
    DistributedDataParallel's own setter), so DDP averages every other gradient only."""
    names = list(expert_slices(model))
    if names:
        from torch.nn.parallel import DistributedDataParallel
        known = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, known + [n for n in names if n not in known])
    return names


def _expert_group(model):
    groups = {id(plan.group): plan.group for _, _, plan in _split_plans(model)}
    if not groups:
        raise ValueError("moepeak.hf: the model has no expert slices (expected a model after "
                         "apply_moepeak(model, group=...) with a group of 2 ranks or more)")
    if len(groups) > 1:
        raise ValueError(f"moepeak.hf: the model's experts are split over {len(groups)} different groups; "
                         "expected one")
    return next(iter(groups.values()))


def _is_sharded(p) -> bool:
    """A DTensor parameter (FSDP2's shards, a vocab-sharded head): its gradient is its shard's,
    reduced by whoever sharded it."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(p, DTensor)


def _average_over(params, group) -> None:
    """Each parameter's gradient averaged over the group (None on every rank stays None; None on
    some ranks counts as zeros there)."""
    import torch.distributed as dist
    if not params or group_size(group) == 1:
        return
    P = dist.get_world_size(group)
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(present, group=group)
    for p, anywhere in zip(params, present.tolist()):
        if not anywhere:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)  # sum (gloo has no average), then / P
        p.grad.div_(P)


def average_gradients(model, expert_replica_group=None) -> None:
    """Average over the expert-parallel group the gradient of every trainable parameter that
    is not an expert slice (DDP's reduction, without DDP): call it on every rank after
    backward, before clipping and the optimizer step. A parameter without a gradient on
    every rank keeps none; one with a gradient on some ranks only gets the average with
    zeros for the others (as DDP with find_unused_parameters). One all_reduce per gradient
    plus one for the presence flags (one host read): DDP buckets and overlaps them.

    expert_replica_group: when the expert-parallel group is narrower than the data-parallel
    world (e.g. experts split over the P ranks of a sequence group, D such groups training D
    sequences), the ranks holding the same expert slices (the same position in each expert
    group: D ranks). Every gradient, the slices' included, is then also averaged over it, so
    each is that of the mean of all W = P * D ranks' losses. Gradients DDP already averaged
    over the world are averaged again unchanged (identical on the ranks). DTensor parameters
    (FSDP2, a vocab-sharded head) are left to whoever sharded them."""
    group = _expert_group(model)
    local = {id(p) for p in expert_slices(model).values()}
    replicated = [p for p in model.parameters() if p.requires_grad and id(p) not in local and not _is_sharded(p)]
    _average_over(replicated, group)
    if expert_replica_group is not None:
        slices = [p for p in expert_slices(model).values() if p.requires_grad]
        _average_over(replicated + slices, expert_replica_group)


def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole expert-parallel model: the norm of every
    replicated gradient (already averaged: identical on the ranks) and of every rank's
    expert slices, the same on every rank; every gradient is scaled by
    min(1, max_norm / (norm + 1e-6)). Returns the total norm (fp32). Call it on every rank."""
    import torch.distributed as dist
    group = _expert_group(model)
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"moepeak.hf: norm_type must be > 0 or inf, got {norm_type}")
    slices = list(expert_slices(model).values())
    local = {id(p) for p in slices}
    replicated = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in local]
    mine = [p.grad for p in slices if p.grad is not None]
    device = next(iter(replicated + mine + [p for p in model.parameters()])).device

    def norm_of(grads):  # [] fp32: the p-norm of the gradients' p-norms
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads])
        return torch.linalg.vector_norm(norms, norm_type)

    sliced = norm_of(mine)
    if norm_type == math.inf:
        dist.all_reduce(sliced, op=dist.ReduceOp.MAX, group=group)
    else:
        sliced = sliced ** norm_type
        dist.all_reduce(sliced, group=group)
        sliced = sliced ** (1.0 / norm_type)
    total = torch.linalg.vector_norm(torch.stack([norm_of(replicated), sliced]), norm_type)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in replicated + mine:
        g.mul_(scale)
    return total


__all__ = ["expert_slices", "average_gradients", "clip_grad_norm_", "group_mean_gradient", "keep_expert_slice",
           "mark_slices_for_ddp", "EXPERT_PARAMS"]
