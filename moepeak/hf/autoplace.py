"""apply_moepeak's automatic placement: each training step's tensors placed on this GPU, this
host's RAM (moepeak.plan.place), from the model's shape, the step's tokens T and the machine's
measured free bytes, before the step allocates anything.

When: at the first training forward and again whenever T grows past the last planned T (a
forward pre-hook on the model), or earlier by place_model(model, tokens) (call it before
creating the optimizer: its device_state_bytes is StreamAdamW's device tail,
StreamAdamW(params, device_state=backward_tail(params, placement.device_state_bytes))).
Host RAM is measured once, at the first plan (before StreamAdamW's state and SCO's arena
take theirs); the GPU's free + reserved bytes at each. What it applies: SCO's keep_last and
a pinned arena sized for the step's host boundaries
(SCOOffloader.reconfigure: the arena of a shorter step is freed, not kept beside the new
one), and sequence tiles (tile_tokens) when whole blocks do not fit. Explicit settings win:
a given sco_config keeps SCO as configured (its keep_last is the plan's), a given tile_tokens
is the plan's tiling, gpu_budget_gib / host_budget_gib replace the measured bytes.
Where: one GPU per process, without expert or sequence parallelism (group=None,
sequence_group=None); elsewhere, and where the model is not on a GPU, it does nothing and
the report says so. No disk tier automatically: give sco_config=SCOConfig(spill_dir=...,
host_budget_bytes=...).
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch

from ..core import host_memory
from ..plan import GiB, ModelShape, Placement, Setup, place

PLACEMENT_OPTIONS = ("auto_placement", "gpu_budget_gib", "host_budget_gib")
log = logging.getLogger("moepeak")


def model_shape(model) -> ModelShape:
    """The planner's shape of a transformers MoE model from its (text) config; params() is the
    model's own parameter count (sum of numel), whatever the family's extra tensors."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config

    def first(*names, default=None):
        for n in names:
            v = getattr(c, n, None)
            if v is not None:
                return v
        return default
    heads = first("num_attention_heads")
    return ModelShape(layers=first("num_hidden_layers"), hidden=first("hidden_size"),
                      experts=first("num_experts", "num_local_experts", "n_routed_experts", default=1),
                      top_k=first("num_experts_per_tok", "top_k", default=1),
                      intermediate=first("moe_intermediate_size", "intermediate_size"), vocab=first("vocab_size"),
                      heads=heads, kv_heads=first("num_key_value_heads", default=heads), head_dim=first("head_dim"),
                      tied_embeddings=bool(first("tie_word_embeddings", default=False)),
                      param_count=sum(p.numel() for p in model.parameters()))


def measure(model) -> Optional[Tuple[float, float]]:
    """The machine's room for this model's step (core.host_memory.placement_room); a module
    function so tests can stand in for the GPU."""
    return host_memory.placement_room(model)


def batch_tokens(args, kwargs) -> Optional[int]:
    """T of a forward call: input_ids' or inputs_embeds' batch x sequence."""
    x = kwargs.get("input_ids", args[0] if args else None)
    if x is None:
        x = kwargs.get("inputs_embeds")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return None
    return int(x.shape[0] * x.shape[1])


class AutoPlacement:
    """The placement state of one model (model._moepeak_placement): the explicit settings, the
    last plan and what it applied. apply_moepeak makes it; place_model and the hook run it."""

    def __init__(self, model, report, *, keep_given: Optional[int], sco_given: bool, tile_tokens: Optional[int],
                 gpu_budget_gib: Optional[float], host_budget_gib: Optional[float], enabled: bool, why_off: str = ""):
        for name, v in (("gpu_budget_gib", gpu_budget_gib), ("host_budget_gib", host_budget_gib)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"moepeak.hf: {name} must be a number of GiB > 0 or None, got {v!r}")
        self.model, self.report = model, report
        self.keep_given, self.sco_given, self.tile_tokens = keep_given, sco_given, tile_tokens
        self.gpu_budget_gib, self.host_budget_gib = gpu_budget_gib, host_budget_gib
        self.enabled, self.why_off = enabled, why_off
        self.tokens = 0                   # T of the last plan
        self.host_measured = 0.0          # the host's available RAM at the first plan
        self.device_state_bytes = None    # StreamAdamW's device tail once the optimizer took it
        self.placement: Optional[Placement] = None
        self.note = why_off or "not run yet (at the first training forward, or place_model(model, tokens))"

    def __call__(self, module, args, kwargs):
        if not (self.enabled and module.training and torch.is_grad_enabled()):
            return
        T = batch_tokens(args, kwargs)
        if T is not None and T > self.tokens:
            self.plan(T)

    def plan(self, tokens: int) -> Optional[Placement]:
        """Place a step of `tokens` tokens and apply it; None where placement is off or there is no
        GPU (self.note says why). PlacementError (the short tier, the bytes) when nothing fits."""
        if not self.enabled:
            return None
        measured = measure(self.model)
        if measured is None and (self.gpu_budget_gib is None or self.host_budget_gib is None):
            self.note = "off: the model is not on a GPU (no-op)"
            return None
        gpu, host = measured or (0.0, 0.0)
        # host RAM as first measured, before StreamAdamW's state and SCO's arena existed: a later
        # measure would see them taken and count them twice (the arena is freed on re-plan)
        if measured is not None:
            self.host_measured = host = self.host_measured or host
        gpu = self.gpu_budget_gib * GiB if self.gpu_budget_gib is not None else gpu
        host = self.host_budget_gib * GiB if self.host_budget_gib is not None else host
        if not host > 0:
            self.note = "off: this host's available RAM could not be read (give host_budget_gib)"
            return None
        shape = model_shape(self.model)
        bad = shape.problems()
        if bad:
            self.note = "off: the model's config does not give the planner's shape (" + "; ".join(bad) + ")"
            return None
        dtype = next(self.model.parameters()).dtype
        setup = Setup(gpus=1, impl="hf", act_bytes=2 if dtype in (torch.bfloat16, torch.float16) else 4,
                      tile_tokens=self.tile_tokens, sco_keep_last=self.keep_given,
                      device_state_gib=(self.device_state_bytes or 0) / GiB)
        p = place(shape, setup, tokens, gpu_bytes=gpu, host_bytes=host)
        self._apply(p)
        self.tokens, self.placement = tokens, p
        src = "given" if measured is None else "measured"
        self.note = (f"{tokens} tokens on {gpu / GiB:.1f} GiB of GPU and {host / GiB:.1f} GiB of host RAM "
                     f"({src}): {p.keep_last} boundaries on the GPU, {p.host_boundaries} in host RAM; "
                     f"StreamAdamW device tail {p.device_state_bytes / GiB:.2f} GiB; "
                     + (f"tiles of {p.tile_tokens} tokens" if p.tile_tokens else "whole blocks"))
        if self.device_state_bytes is not None and p.device_state_bytes > self.device_state_bytes:
            log.warning("moepeak.hf: the step of %d tokens wants %.2f GiB of StreamAdamW's state on the GPU, the "
                        "optimizer has %.2f GiB: host RAM may be short; make the optimizer with "
                        "place_model(model, %d).device_state_bytes", tokens, p.device_state_bytes / GiB,
                        self.device_state_bytes / GiB, tokens)
        return p

    def _apply(self, p: Placement) -> None:
        sco = self.report.sco
        if sco is not None and not self.sco_given:
            sco.reconfigure(**p.sco_options())
        if p.tile_tokens and self.tile_tokens is None:
            from .tiled import patch_tiled_layers
            patch_tiled_layers(self.model, p.tile_tokens, self.report)
            self.tile_tokens = p.tile_tokens  # installed: later plans keep it

    def describe(self) -> str:
        lines = [f"placement: {self.note}"]
        if self.placement is not None:
            lines += [f"  {k}: {v}" for k, v in self.placement.reasons.items()]
        return "\n".join(lines)


def install(model, report, *, options, sco_config, tile_tokens, group, sequence_group, checkpoint) -> AutoPlacement:
    """The automatic placement of apply_moepeak (see the module docstring): made, hooked on the
    model's forward, kept as model._moepeak_placement and report.placement."""
    enabled = options.get("auto_placement", True)
    if not isinstance(enabled, bool):
        raise ValueError(f"moepeak.hf: auto_placement must be a bool, got {enabled!r}")
    why = ("off: auto_placement=False" if not enabled else
           "off: expert or sequence parallelism (group/sequence_group): give sco_config and tile_tokens"
           if group is not None or sequence_group is not None else
           "off: checkpoint=False (nothing of SCO's to place)" if not checkpoint else "")
    auto = AutoPlacement(model, report, keep_given=sco_config.keep_last if sco_config is not None else None,
                         sco_given=sco_config is not None, tile_tokens=tile_tokens,
                         gpu_budget_gib=options.get("gpu_budget_gib"), host_budget_gib=options.get("host_budget_gib"),
                         enabled=not why, why_off=why)
    if auto.enabled:
        model.register_forward_pre_hook(auto, with_kwargs=True)
    model._moepeak_placement = report.placement = auto
    return auto


def place_model(model, tokens: int) -> Optional[Placement]:
    """Place a training step of `tokens` tokens (batch x sequence) on this machine now and apply
    it (apply_moepeak's automatic placement); returns the Placement (its device_state_bytes:
    StreamAdamW's device tail budget, recorded as the optimizer's), or None where placement is
    off (placement_report says why)."""
    auto = getattr(model, "_moepeak_placement", None)
    if auto is None:
        raise ValueError("moepeak.hf.place_model: apply_moepeak(model) first")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"moepeak.hf.place_model: tokens must be an int >= 1, got {tokens!r}")
    p = auto.plan(tokens)
    if p is not None and auto.device_state_bytes is None:
        auto.device_state_bytes = p.device_state_bytes
    return p


def placement_report(model) -> str:
    """Where the last placement put each tensor class and why (or why there is none)."""
    auto = getattr(model, "_moepeak_placement", None)
    if auto is None:
        raise ValueError("moepeak.hf.placement_report: apply_moepeak(model) first")
    return auto.describe() + ("\n" + auto.placement.describe() if auto.placement is not None else "")


__all__ = ["PLACEMENT_OPTIONS", "AutoPlacement", "model_shape", "measure", "place_model", "placement_report",
           "install"]
