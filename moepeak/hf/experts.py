"""apply_moepeak's experts part: a "moepeak" implementation in transformers' experts
registry (transformers.integrations.moe.ExpertsInterface) that runs each experts module
whose layout is in SUPPORTED_LAYOUTS through moepeak.llep_moe on views of its weights
(any other keeps the model's previous implementation), and with a group, expert
parallelism over it (moepeak/hf/expert_parallel.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

from .expert_parallel import group_mean_gradient, keep_expert_slice, mark_slices_for_ddp

IMPLEMENTATION = "moepeak"  # the experts registry name apply_moepeak registers and selects


class ExpertsLayout(NamedTuple):
    """How an experts module stores its weights and gates (the flags
    transformers' @use_experts_implementation sets on the module, plus the
    gate: an activation name when the module uses transformers' default gate
    act_fn(gate) * up, else "custom <Class>._apply_gate")."""
    is_concatenated: bool  # gate_up_proj holds [gate; up] blocks (False: interleaved columns)
    is_transposed: bool    # gate_up_proj [E, H, 2I] (False: [E, 2I, H])
    has_bias: bool
    has_gate: bool         # gate_up_proj (False: up_proj only)
    gate: str


def _gated_silu_hf_layout(module, x, top_k_index, top_k_weights, group, options):
    """gate_up_proj [E_local, 2I, H] (rows [:I] gate, [I:] up), down_proj
    [E_local, H, I]: .transpose(1, 2) is exactly moepeak's w_gate_up
    [E_local, H, 2I] (columns [:I] gate) and w_down [E_local, I, H]. With a
    group, the slices' gradients are divided by its size (group_mean_gradient)."""
    from ..llep import llep_moe
    w_gate_up = group_mean_gradient(module.gate_up_proj, group).transpose(1, 2)
    w_down = group_mean_gradient(module.down_proj, group).transpose(1, 2)
    xin = x if x.dtype == w_gate_up.dtype else x.to(w_gate_up.dtype)
    y = llep_moe(xin, top_k_index, top_k_weights, w_gate_up, w_down, group=group, **options)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _gpt_oss_layout(module, x, top_k_index, top_k_weights, group, options):
    """GPT-OSS (transformers' GptOssExperts): gate_up_proj [E_local, H, 2I]
    with gate/up columns interleaved, gate_up_proj_bias [E_local, 2I],
    down_proj [E_local, I, H], down_proj_bias [E_local, H]; the clamped
    (up + 1) * gate * sigmoid(1.702 * gate) activation: llep_moe's "gpt_oss",
    on the parameters as they are (no copy); with a group, their gradients
    divided by its size (group_mean_gradient)."""
    from ..llep import GPT_OSS_ALPHA, GPT_OSS_LIMIT, llep_moe
    if (module.alpha, module.limit) != (GPT_OSS_ALPHA, GPT_OSS_LIMIT):
        raise ValueError(f"moepeak.hf: {type(module).__name__} has alpha={module.alpha}, limit={module.limit}; "
                         f"moepeak's gpt_oss activation runs alpha={GPT_OSS_ALPHA}, limit={GPT_OSS_LIMIT}")
    w, w_down, b_gate_up, b_down = (group_mean_gradient(t, group) for t in (
        module.gate_up_proj, module.down_proj, module.gate_up_proj_bias, module.down_proj_bias))
    xin = x if x.dtype == w.dtype else x.to(w.dtype)
    y = llep_moe(xin, top_k_index, top_k_weights, w, w_down, b_gate_up=b_gate_up, b_down=b_down,
                 activation="gpt_oss", group=group, **options)
    return y if y.dtype == x.dtype else y.to(x.dtype)


# The layouts moepeak's expert kernels run; anything else falls back. Adding a
# layout is one entry here and its run function.
SUPPORTED_LAYOUTS: Dict[ExpertsLayout, Callable] = {
    ExpertsLayout(True, False, False, True, "silu"): _gated_silu_hf_layout,
    ExpertsLayout(False, True, True, True, "custom GptOssExperts._apply_gate"): _gpt_oss_layout,
}


def experts_layout(module) -> ExpertsLayout:
    """The layout of a registry experts module (see ExpertsLayout)."""
    gate_fn = getattr(type(module), "_apply_gate", None)
    if gate_fn is not None and getattr(gate_fn, "__module__", "") != "transformers.integrations.moe":
        gate = f"custom {gate_fn.__qualname__}"
    else:
        gate = _activation_name(getattr(module, "act_fn", None))
    return ExpertsLayout(bool(module.is_concatenated), bool(module.is_transposed), bool(module.has_bias),
                         bool(module.has_gate), gate)


def _activation_name(act) -> str:
    if act is None:
        return "none"
    from transformers.activations import SiLUActivation
    if isinstance(act, (torch.nn.SiLU, SiLUActivation)):
        return "silu"
    return type(act).__name__


def _why_unsupported(layout: ExpertsLayout) -> str:
    wants = next(iter(SUPPORTED_LAYOUTS))
    diffs = [f"{name}={getattr(layout, name)!r} (moepeak runs {getattr(wants, name)!r})"
             for name in layout._fields if getattr(layout, name) != getattr(wants, name)]
    return "layout not supported by moepeak's expert kernels: " + ", ".join(diffs)


def _is_registry_experts(module) -> bool:
    return all(hasattr(module, a) for a in ("is_concatenated", "is_transposed", "has_bias", "has_gate", "config")) \
        and hasattr(type(module).forward, "__wrapped__")


@dataclass
class _ExpertsPlan:
    """What one experts module runs (kept on the module as _moepeak_experts)."""
    run: Optional[Callable]   # a SUPPORTED_LAYOUTS entry, or None: fallback
    fallback: str             # the implementation the model had before
    group: object = None
    options: dict = field(default_factory=dict)


def moepeak_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "moepeak" entry of transformers' ExpertsInterface:
    hidden_states [T, H], top_k_index [T, K] (global expert ids),
    top_k_weights [T, K] -> [T, H] in hidden_states' dtype."""
    plan = getattr(self, "_moepeak_experts", None)
    if plan is None:
        raise RuntimeError(f"moepeak: {type(self).__name__} selects experts_implementation='moepeak' but was not "
                           "prepared by moepeak.hf.apply_moepeak (apply it to the model that owns this module)")
    if plan.run is None:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        fn = ALL_EXPERTS_FUNCTIONS.get_interface(plan.fallback, type(self).forward.__wrapped__)
        return fn(self, hidden_states, top_k_index, top_k_weights)
    return plan.run(self, hidden_states, top_k_index, top_k_weights, plan.group, plan.options)


def _register():
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(IMPLEMENTATION, moepeak_experts_forward)


def patch_experts(model, group, options, report):
    found = [(n, m) for n, m in model.named_modules() if _is_registry_experts(m)]
    if not found:
        report.left_alone.append("experts: no module uses transformers' experts registry "
                                 "(@use_experts_implementation)")
        return
    plans = {}
    for name, m in found:
        layout = experts_layout(m)
        run = SUPPORTED_LAYOUTS.get(layout)
        plans[name] = (m, run, None if run else _why_unsupported(layout))
    if all(run is None for _, run, _ in plans.values()):
        reasons = sorted({why for _, _, why in plans.values()})
        report.left_alone.append(f"experts: all {len(found)} experts modules stay on "
                                 f"{model.config._experts_implementation!r}: " + "; ".join(reasons))
        return
    P, rank = 1, 0
    if group is not None:
        import torch.distributed as dist
        P, rank = dist.get_world_size(group), dist.get_rank(group)
        for name, (m, run, _) in plans.items():
            if run is not None and m.num_experts % P:
                raise ValueError(f"moepeak.hf: group has {P} ranks but {name} has {m.num_experts} experts "
                                 "(expected a multiple of the group size)")
    before = model.config._experts_implementation
    if before in (None, IMPLEMENTATION):  # loaded with experts_implementation="moepeak": fall back to the default
        before = "grouped_mm"
    _register()
    model.set_experts_implementation(IMPLEMENTATION)
    on_moepeak, fallback = [], {}
    for name, (m, run, why) in plans.items():
        if m.config._experts_implementation != IMPLEMENTATION:  # a sub-model transformers would not switch
            fallback[name] = f"its config kept experts_implementation={m.config._experts_implementation!r}"
            continue
        if run is not None and P > 1:
            keep_expert_slice(m, rank, P)
        m._moepeak_experts = _ExpertsPlan(run, before, group, dict(options))
        if run is None:
            fallback[name] = f"stays on {before!r}: {why}"
        else:
            on_moepeak.append(name)
    report.experts_on_moepeak = on_moepeak
    report.experts_fallback = fallback
    ep = ""
    if P > 1:
        mark_slices_for_ddp(model)
        ep = (f", experts split over {P} ranks (rank {rank} holds [{rank}/{P}] of each; their gradients are the "
              "group's mean loss's, left alone by DDP)")
    report.patched.append(f"experts: {len(on_moepeak)} of {len(found)} experts modules run moepeak.llep_moe "
                          f"(experts_implementation={IMPLEMENTATION!r}, previously {before!r}){ep}")
    for reason in sorted(set(fallback.values())):
        names = [n for n, r in fallback.items() if r == reason]
        report.left_alone.append(f"experts: {len(names)} experts modules ({_abbrev(names)}) {reason}")


def _abbrev(names: List[str]) -> str:
    return ", ".join(names) if len(names) <= 2 else f"{names[0]} ... {names[-1]}"
