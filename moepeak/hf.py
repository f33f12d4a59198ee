"""moepeak.hf: moepeak's schedules inside an existing Hugging Face transformers MoE model.

    from moepeak.hf import apply_moepeak
    report = apply_moepeak(model)          # model: a transformers *ForCausalLM instance
    print(report)

apply_moepeak patches one model instance in place. The module tree, the
parameters and the state_dict keys stay those of transformers (with group=None
the shapes too), so from_pretrained checkpoints load and save_pretrained writes
what transformers expects. Three parts, each can be turned off:

- experts: a "moepeak" implementation in transformers' experts registry
  (transformers.integrations.moe.ExpertsInterface), selected for this model with
  model.set_experts_implementation("moepeak"). Routing (top_k_index,
  top_k_weights) comes from the model's own router, unchanged. Each experts
  module whose layout and activation are in SUPPORTED_LAYOUTS runs through
  moepeak.llep_moe on views of its weights (gated SiLU: Qwen3-MoE, Qwen2-MoE,
  Mixtral, OLMoE, DeepSeek-V3, ...; GPT-OSS's interleaved, biased, clamped
  experts: llep_moe's "gpt_oss" activation); any other keeps the implementation
  the model had before (transformers' grouped_mm by default), and the report
  says why. With group=..., expert parallelism (moepeak.hf_expert_parallel):
  rank r keeps experts [r*E/P, (r+1)*E/P) of every supported experts module
  (the parameter is replaced by that slice: same key, shape [E/P, ...]), tokens
  stay on their rank and PipelinedLLEP moves them to the experts and back. Every
  gradient is that of the mean of the ranks' losses: the expert slices' are
  final after backward (divided by P on the way) and rank-local; the other
  parameters are replicated and their gradients are averaged over the group by
  DistributedDataParallel (apply_moepeak marks the slices for DDP to leave
  alone) or by average_gradients(model); clip with clip_grad_norm_(model, ...),
  which counts every rank's slices.
- loss: the *ForCausalLM.forward of the instance (families in LOSS_FAMILIES)
  computes moepeak.linear_cross_entropy on the last hidden state when labels
  are given in training, so the [tokens, vocab] logits never exist; logits
  come back as None. transformers' semantics are kept: labels shifted left by
  one (or shift_labels), ignore_index (-100), reduction "mean" over the
  non-ignored labels or, with num_items_in_batch (the Trainer's gradient
  accumulation), the sum divided by it; router_aux_loss_coef * aux_loss added
  when the model computes it (output_router_logits). Under autocast the
  projection runs in the autocast dtype, as lm_head would. In eval or without
  labels the model's own forward runs unchanged. With lean_norm (default) the
  final norm (the base model's .norm, a class in LEAN_NORMS) runs
  moepeak.norms.rms_norm: bitwise its forward, a backward that saves the input
  and fp32 rstd only and works in chunks of norm_chunk_tokens rows (the
  instance's forward is replaced; module tree and state_dict keys unchanged).
  With checkpoint and lean_norm, the decoder layers' RMSNorms (input,
  post-attention, per-head q/k) run it too, so a recomputed layer saves the
  norms' inputs and rstd instead of fp32 copies.
- checkpoint: SCO (moepeak.sco_checkpoint) as the model's gradient
  checkpointing function on every GradientCheckpointingLayer, enabled at once.
  The instance's _set_gradient_checkpointing is replaced, so a later
  model.gradient_checkpointing_enable(...) (also the Trainer's, with
  TrainingArguments(gradient_checkpointing=True)) installs SCO again instead of
  torch's checkpoint; its gradient_checkpointing_kwargs and offload=True are
  superseded (SCO offloads the boundaries itself); every_n_layers is honoured.
  model.gradient_checkpointing_disable() turns checkpointing off.

- tile_tokens (off unless given): every decoder layer of a family in TILED_LAYERS
  (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3; MoE and dense layers) runs
  moepeak.tiled_adapters.tiled_hf_layer_training_forward (the block's position-wise parts in
  sequence tiles of tile_tokens tokens, only attention at full length) in training with
  grad; in eval / no_grad the layer's own forward runs. The call is the stock layer's:
  under the gradient-checkpointing function when checkpointing is on (SCO: the layer's
  input is SCO's boundary), and every argument but the mask, the rotary tables and the KV
  cache reaches the attention function unchanged (position_ids and cu_seq_lens_q/k of
  packed sequences included). With checkpointing off, the empty KV cache transformers makes
  in training (config.use_cache) is left empty (stock would store every layer's k, v in
  it); a cache that holds tokens is refused. Under autocast the backward's recompute runs
  under the forward's autocast and RNG state. With output_router_logits (config or call)
  each tiled MoE layer hands transformers' output collector one router-logits tensor [B*T,
  E] for all its tokens, as the untiled router does, instead of the per-tile ones its router
  produced (a dense layer hands none, as stock): an output of the tiled block's autograd
  node, so the model's own router aux loss (load_balancing_loss_func) is that of the
  untiled model and its gradient reaches the routers and the layer inputs through the tiled
  recompute. With output_attentions and an attention function that returns weights
  (eager), each layer hands the forward's weights [B, heads, T, T], equal to stock's but
  without a gradient path (a backward through them raises). (Reads transformers' private
  output collector, transformers.utils.output_capturing._active_collector; checked at apply
  time.) The logits cost L x [T, E] in the activation dtype: 32 B/token per layer at E = 16
  in bf16, 1/128 of one [T, H] at H = 2048 (transformers' aux loss also keeps each layer's
  softmax of them). Other families' layers are left alone (the report says so).

The optimizer is not patched: moepeak.StreamAdamW(model.parameters(), lr=...)
works in a plain loop, and with the Trainer as
Trainer(..., optimizers=(moepeak.StreamAdamW(model.parameters(), lr=...), None)).

Tested with transformers 5.17 (it uses the private
PreTrainedModel._set_gradient_checkpointing); other versions are refused.
"""
from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

from .hf_expert_parallel import (average_gradients, clip_grad_norm_, expert_slices, group_mean_gradient,
                                 keep_expert_slice, mark_slices_for_ddp)
from .hf_norms import LEAN_NORMS, patch_final_norm, patch_layer_norms
from .tiled_adapters import HF_TILED_LAYERS

IMPLEMENTATION = "moepeak"
TESTED_TRANSFORMERS = ((5, 17), (6, 0))  # [lowest, first untested major)

# Options apply_moepeak accepts (**options) and where each goes.
EXPERTS_OPTIONS = ("chunk_rows", "alpha", "min_tokens_per_gemm", "imbalance_threshold", "save_budget_mb")
LOSS_OPTIONS = {"ce_mode": "mode", "ce_chunk_tokens": "chunk_tokens", "ce_chunk_vocab": "chunk_vocab"}
NORM_OPTIONS = ("norm_chunk_tokens",)
CHECKPOINT_OPTIONS = ("sco_config",)
# Decoder layers the tiled block adapter runs (moepeak.tiled_adapters.hf_moe_layer_spec), by class
# name, each read for transformers 5.17: pre-norm attention + MoE with the adapter's submodule names.
TILED_LAYERS = tuple(HF_TILED_LAYERS)


# ---------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------
def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("moepeak.hf needs transformers: pip install 'moepeak[hf]'") from e
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    lo, hi = TESTED_TRANSFORMERS
    if not lo <= version < hi:
        raise ImportError(f"moepeak.hf supports transformers >= {lo[0]}.{lo[1]}, < {hi[0]} "
                          f"(found {transformers.__version__})")
    return transformers


# ---------------------------------------------------------------------------
# Experts: layouts moepeak runs, and the registry function
# ---------------------------------------------------------------------------
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
    from . import llep_moe
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
    from . import llep_moe
    from .llep import GPT_OSS_ALPHA, GPT_OSS_LIMIT
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


def _patch_experts(model, group, options, report):
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


# ---------------------------------------------------------------------------
# Loss without logits
# ---------------------------------------------------------------------------
# *ForCausalLM classes whose forward was read for transformers 5.17: lm_head
# on the last hidden state, self.loss_function (ForCausalLMLoss), no logit
# scaling or softcap, and loss += router_aux_loss_coef * aux_loss when it
# computes aux_loss. A family is added by one entry after reading its forward.
LOSS_FAMILIES = {
    "Qwen3MoeForCausalLM": "router aux loss",
    "Qwen2MoeForCausalLM": "router aux loss",
    "Qwen3NextForCausalLM": "router aux loss",
    "MixtralForCausalLM": "router aux loss",
    "OlmoeForCausalLM": "router aux loss",
    "GptOssForCausalLM": "router aux loss",
    "DeepseekV3ForCausalLM": "no aux loss",
}


def _patch_loss(model, options, report):
    cls = type(model)
    if cls.__name__ not in LOSS_FAMILIES:
        report.left_alone.append(f"loss: {cls.__name__}.forward is not in moepeak.hf.LOSS_FAMILIES (its loss "
                                 "may scale or cap the logits); the model computes its own logits and loss")
        return
    base = getattr(model, model.base_model_prefix, None)
    head = model.get_output_embeddings()
    if not isinstance(base, torch.nn.Module) or not isinstance(head, torch.nn.Linear):
        report.left_alone.append(f"loss: {cls.__name__} has no base model {model.base_model_prefix!r} or no "
                                 "nn.Linear output embedding")
        return
    original = cls.forward
    signature = inspect.signature(original)
    ce_options = {LOSS_OPTIONS[k]: v for k, v in options.items()}

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        extra = dict(bound.arguments.pop("kwargs", {}))
        arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
        labels = arguments.get("labels")
        if labels is None or not self.training:
            return original(self, *args, **kwargs)
        return_dict = extra.pop("return_dict", getattr(self.config, "return_dict", True))
        arguments["labels"] = None
        # lm_head runs on no position: its input slice is empty.
        arguments["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=labels.device)
        captured = []
        hook = getattr(self, self.base_model_prefix).register_forward_hook(
            lambda mod, inp, out: captured.append(out[0]))
        try:
            out = original(self, **arguments, **extra, return_dict=True)
        finally:
            hook.remove()
        loss = causal_lm_loss(captured[-1], self.get_output_embeddings(), labels,
                              num_items_in_batch=extra.get("num_items_in_batch"),
                              ignore_index=extra.get("ignore_index", -100),
                              shift_labels=extra.get("shift_labels"), **ce_options)
        aux = getattr(out, "aux_loss", None)
        if aux is not None:
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        fields = dict(out.items())
        fields.update(loss=loss, logits=None)
        out = type(out)(**fields)
        return out if return_dict else out.to_tuple()

    model.forward = types.MethodType(forward, model)
    report.patched.append(f"loss: {cls.__name__}.forward computes moepeak.linear_cross_entropy on the last "
                          f"hidden state in training with labels (no logits; {LOSS_FAMILIES[cls.__name__]})")


def causal_lm_loss(hidden, lm_head: torch.nn.Linear, labels, *, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None, **ce_options):
    """transformers' ForCausalLMLoss(lm_head(hidden), labels, ...) without the logits.

    hidden [B, T, H]; labels [B, T] int (position t's label is predicted at
    t - 1: labels shift left by one and the last position gets ignore_index),
    or shift_labels [B, T] already shifted. Reduction: mean over non-ignored
    labels, or the sum / num_items_in_batch when that is given. fp32 result.
    No label left (T = 1, every label ignored): NaN (0 / 0; num_items_in_batch = 0:
    the sum / 0) and zero gradients, as transformers' loss."""
    from . import linear_cross_entropy
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    weight, bias = lm_head.weight, lm_head.bias
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):  # lm_head would run in the autocast dtype
        dt = torch.get_autocast_dtype(dev)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    shift_labels = shift_labels.to(hidden.device)
    if num_items_in_batch is None:
        return linear_cross_entropy(hidden, weight, shift_labels, bias=bias, ignore_index=ignore_index,
                                    reduction="mean", **ce_options)
    total = linear_cross_entropy(hidden, weight, shift_labels, bias=bias, ignore_index=ignore_index,
                                 reduction="sum", **ce_options)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


# ---------------------------------------------------------------------------
# Checkpointing: SCO as the gradient-checkpointing function
# ---------------------------------------------------------------------------
def _patch_checkpoint(model, options, report):
    from transformers.modeling_layers import GradientCheckpointingLayer
    from . import SCOConfig, sco_checkpoint

    if not getattr(model, "supports_gradient_checkpointing", False) or not any(
            isinstance(m, GradientCheckpointingLayer) for m in model.modules()):
        report.left_alone.append(f"checkpoint: {type(model).__name__} has no GradientCheckpointingLayer")
        return
    cfg = options.get("sco_config") or SCOConfig()
    if not isinstance(cfg, SCOConfig):
        raise TypeError(f"moepeak.hf: sco_config must be a moepeak.SCOConfig, got {type(cfg).__name__}")
    class_set = type(model)._set_gradient_checkpointing

    def _set_gradient_checkpointing(self, enable=True, gradient_checkpointing_func=None, every_n_layers=1):
        if not enable:
            return class_set(self, enable=False)
        class_set(self, enable=True, gradient_checkpointing_func=functools.partial(sco_checkpoint, sco_config=cfg),
                  every_n_layers=every_n_layers)
        layers = [m for m in self.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
        for layer in cfg.kept_blocks(layers):
            # the blocks whose backward runs first keep their input on the device
            layer._gradient_checkpointing_func = functools.partial(sco_checkpoint, sco_config=cfg,
                                                                   sco_keep_on_gpu=True)

    model._set_gradient_checkpointing = types.MethodType(_set_gradient_checkpointing, model)
    model.gradient_checkpointing_enable()
    report.sco_config = cfg
    report.patched.append("checkpoint: SCO (moepeak.sco_checkpoint) is the gradient-checkpointing function of "
                          "every GradientCheckpointingLayer, enabled; gradient_checkpointing_enable() reinstalls it")


# ---------------------------------------------------------------------------
# Sequence-tiled decoder layers
# ---------------------------------------------------------------------------
def _patch_tiled_layers(model, tile_tokens, report):
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"moepeak.hf: tile_tokens must be a positive integer or None, got {tile_tokens!r}")
    from .tiled_adapters import tiled_hf_layer_training_forward
    layers = [m for m in model.modules() if type(m).__name__ in TILED_LAYERS]
    if not layers:
        kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("DecoderLayer")})
        report.left_alone.append(f"tile_tokens: no decoder layer the tiled adapter runs ({', '.join(TILED_LAYERS)}); "
                                 f"{', '.join(kinds) or 'no decoder layers'} stay untiled")
        return
    _output_collector()  # the hand-off below needs it: refuse now, not mid-training
    for layer in layers:
        untiled = layer.forward

        def forward(hidden_states, *args, _layer=layer, _untiled=untiled, **kwargs):
            if not (_layer.training and torch.is_grad_enabled()):
                return _untiled(hidden_states, *args, **kwargs)
            collected = _output_collector().get() or {}
            logits_out, maps_out = collected.get("router_logits"), collected.get("attentions")
            first = None if logits_out is None else len(logits_out)
            y, logits, maps = tiled_hf_layer_training_forward(
                _layer, hidden_states, *args, tile_tokens=tile_tokens, router_logits=logits_out is not None,
                attention_weights=maps_out is not None, **kwargs)
            if logits_out is not None:
                # transformers' hook on the router recorded one graph-less entry per tile (none in
                # a dense layer); the layer's one entry is the full-length logits with their graph
                recorded = len(logits_out) - first
                del logits_out[first:]
                if recorded and logits is None:
                    raise RuntimeError(f"moepeak.hf: {type(_layer).__name__}'s router logits were recorded but "
                                       "its mlp has no router at mlp.gate")
                if recorded:
                    logits_out.append(logits)
            if maps is not None:
                maps_out.append(maps)
            return y
        layer.forward = forward
    report.patched.append(f"tile_tokens: {len(layers)} decoder layers run moepeak.tiled_hf_layer_training_forward "
                          f"in training (tiles of {tile_tokens} tokens)")


def _output_collector():
    """transformers' context variable holding the outputs being collected in this forward
    ({"router_logits": [...], "attentions": [...], ...} or None): where an untiled router's
    logits and attention's weights go."""
    try:
        from transformers.utils import output_capturing
        return output_capturing._active_collector
    except (ImportError, AttributeError) as e:
        raise RuntimeError("moepeak.hf: tile_tokens needs transformers' output collector "
                           "(transformers.utils.output_capturing._active_collector, transformers 5.17) to hand the "
                           "router logits to the aux loss; this transformers has none") from e


# ---------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------
@dataclass
class MoepeakReport:
    """What apply_moepeak changed (patched) and what it left alone, and why."""
    model: str
    patched: List[str] = field(default_factory=list)
    left_alone: List[str] = field(default_factory=list)
    experts_on_moepeak: List[str] = field(default_factory=list)  # module names
    experts_fallback: Dict[str, str] = field(default_factory=dict)  # module name -> reason
    sco_config: object = None

    def __str__(self):
        lines = [f"moepeak.hf.apply_moepeak({self.model}):"]
        lines += [f"  patched     {p}" for p in self.patched] or ["  patched     nothing"]
        lines += [f"  left alone  {p}" for p in self.left_alone]
        return "\n".join(lines)


def apply_moepeak(model, *, experts: bool = True, loss: bool = True, checkpoint: bool = True, group=None,
                  tile_tokens: Optional[int] = None, lean_norm: bool = True, **options) -> MoepeakReport:
    """Put moepeak's schedules into a transformers model instance (in place);
    returns a MoepeakReport. See the module docstring for what each part does.

    group: a torch.distributed process group for expert parallelism (every
    rank calls apply_moepeak and every forward/backward together). Each rank
    runs its own batch; the gradients are those of the mean of the ranks'
    losses once the replicated parameters' are averaged: wrap the model in
    DistributedDataParallel(model, process_group=group) (it leaves the expert
    slices alone), or call average_gradients(model) after backward; clip with
    clip_grad_norm_(model, max_norm) (moepeak.hf_expert_parallel).
    options: for the experts, llep_moe's chunk_rows, alpha,
    min_tokens_per_gemm, imbalance_threshold, save_budget_mb; for the loss,
    ce_mode, ce_chunk_tokens, ce_chunk_vocab (linear_cross_entropy's mode,
    chunk_tokens, chunk_vocab); for the lean final norm, norm_chunk_tokens
    (moepeak.norms.rms_norm's chunk_tokens); for checkpointing, sco_config (a
    moepeak.SCOConfig).
    lean_norm: with loss, the final norm runs moepeak.norms.rms_norm; with checkpoint, the decoder
    layers' norms too (see the module docstring).
    tile_tokens: sequence-tiled decoder layers (see the module docstring; None: off)."""
    transformers = _transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"moepeak.hf: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if getattr(model, "_moepeak_hf", None) is not None:
        raise RuntimeError(f"moepeak.hf: apply_moepeak was already applied to this {type(model).__name__} "
                           "instance; apply it once, to a fresh model")
    known = EXPERTS_OPTIONS + tuple(LOSS_OPTIONS) + NORM_OPTIONS + CHECKPOINT_OPTIONS
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"moepeak.hf: unknown option(s) {unknown}; expected some of {list(known)}")
    report = MoepeakReport(type(model).__name__)
    if tile_tokens is not None:  # checked first: it may refuse the model's config
        _patch_tiled_layers(model, tile_tokens, report)
    if experts:
        _patch_experts(model, group, {k: v for k, v in options.items() if k in EXPERTS_OPTIONS}, report)
    else:
        report.left_alone.append("experts: turned off (experts=False)")
        if group is not None:
            raise ValueError("moepeak.hf: group (expert parallelism) needs experts=True")
    if loss:
        _patch_loss(model, {k: v for k, v in options.items() if k in LOSS_OPTIONS}, report)
        if lean_norm:
            patch_final_norm(model, options, report)
        else:
            report.left_alone.append("final norm: turned off (lean_norm=False)")
    else:
        report.left_alone.append("loss: turned off (loss=False)")
    if checkpoint:
        _patch_checkpoint(model, options, report)
        if lean_norm:
            patch_layer_norms(model, options, report)
    else:
        report.left_alone.append("checkpoint: turned off (checkpoint=False)")
    model._moepeak_hf = report
    return report


__all__ = ["apply_moepeak", "MoepeakReport", "ExpertsLayout", "SUPPORTED_LAYOUTS", "LOSS_FAMILIES", "LEAN_NORMS",
           "experts_layout", "causal_lm_loss", "moepeak_experts_forward", "IMPLEMENTATION", "expert_slices",
           "average_gradients", "clip_grad_norm_"]
