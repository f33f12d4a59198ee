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
is the plan's tiling, gpu_budget_gib / host_budget_gib (this host's, shared by its ranks)
replace the measured bytes.
Several ranks (moepeak.plan.integration states the rule): each rank places its own share
from its own GPU and its share of the host, with no collective. The share: expert
parallelism (group=, P_ep ranks) holds 1/P_ep of the experts and the other weights whole
(DistributedDataParallel or average_gradients; FSDP2 when the parameters are DTensors),
sequence parallelism (sequence_group=, S ranks) holds T / S of each sequence (Setup's sp,
sp_size, shard, ep_size: moepeak.plan.sequence). Under either, the tiling is the ranks' to
share: where whole blocks do not fit and tile_tokens was not given, the first training
forward raises moepeak.plan.TilesNeeded naming the tile_tokens to give on every rank.
Where the model is not on a GPU it does nothing and the report says so. No disk tier
automatically: give sco_config=SCOConfig(spill_dir=..., host_budget_bytes=...).
"""
from __future__ import annotations

import logging
import math
from typing import Optional, Tuple

import torch

from ..core import host_memory
from ..plan import (GiB, ModelShape, Placement, Ranks, Setup, StepPlacement, activation_bytes, job_ranks,
                    setup_problems)
from .expert_parallel import expert_slices, group_size
from .sequence import crosses_heads

PLACEMENT_OPTIONS = ("auto_placement", "gpu_budget_gib", "host_budget_gib")
TOKEN_ARGUMENTS = ("input_ids", "inputs_embeds")  # a forward's token tensor (positional: the first)
TILE_OPTION = "apply_moepeak(..., tile_tokens=N)"
log = logging.getLogger("moepeak")
# The machine's room for this model's step: a module name, so tests can stand in for the GPU
measure = host_memory.placement_room


def model_shape(model, expert_ranks: int = 1) -> ModelShape:
    """The planner's shape of a transformers MoE model from its (text) config; params() is the
    model's own parameter count (sum of numel), whatever the family's extra tensors, with its
    expert slices counted on each of their expert_ranks ranks (expert parallelism)."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config

    def first(*names, default=None):
        for n in names:
            v = getattr(c, n, None)
            if v is not None:
                return v
        return default
    heads = first("num_attention_heads")
    sliced = sum(p.numel() for p in expert_slices(model).values()) if expert_ranks > 1 else 0
    return ModelShape(layers=first("num_hidden_layers"), hidden=first("hidden_size"),
                      experts=first("num_experts", "num_local_experts", "n_routed_experts", default=1),
                      top_k=first("num_experts_per_tok", "top_k", default=1),
                      intermediate=first("moe_intermediate_size", "intermediate_size"), vocab=first("vocab_size"),
                      heads=heads, kv_heads=first("num_key_value_heads", default=heads), head_dim=first("head_dim"),
                      tied_embeddings=bool(first("tie_word_embeddings", default=False)),
                      param_count=sum(p.numel() for p in model.parameters()) + (expert_ranks - 1) * sliced)


def _sharded(model) -> bool:
    """The model's parameters are DTensors (FSDP2): the non-expert weights are sharded."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _attention_crosses_heads(model) -> bool:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return crosses_heads(ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, None))


class AutoPlacement(StepPlacement):
    """The placement state of one model (model._moepeak_placement): the explicit settings, the
    ranks' layout, the last plan and what it applied. apply_moepeak makes it; place_model and
    the hook run it."""

    def __init__(self, model, report, *, keep_given: Optional[int], sco_given: bool, tile_tokens: Optional[int],
                 gpu_budget_gib: Optional[float], host_budget_gib: Optional[float], enabled: bool, why_off: str = "",
                 group=None, sequence=None):
        for name, v in (("gpu_budget_gib", gpu_budget_gib), ("host_budget_gib", host_budget_gib)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"moepeak.hf: {name} must be a number of GiB > 0 or None, got {v!r}")
        super().__init__(tile_tokens)
        self.model, self.report = model, report
        self.keep_given, self.sco_given = keep_given, sco_given
        self.gpu_budget_gib, self.host_budget_gib = gpu_budget_gib, host_budget_gib
        self.group, self.sequence = group, sequence  # expert group, SequenceOptions (None: none)
        self.enabled, self.why_off = enabled, why_off
        self.device_state_bytes = None    # StreamAdamW's device tail once the optimizer took it
        self.note = why_off or "not run yet (at the first training forward, or place_model(model, tokens))"

    def __call__(self, module, args, kwargs):
        T = self.due(module, args, kwargs, TOKEN_ARGUMENTS) if self.enabled else None
        if T is not None:
            self.plan(T)

    def layout(self) -> Tuple[ModelShape, Setup, Ranks]:
        """The planner's shape and Setup of this rank's share (the module docstring), and the ranks."""
        experts = group_size(self.group)
        seq = self.sequence.resolve_group() if self.sequence is not None else None
        S = torch.distributed.get_world_size(seq) if seq is not None else 1
        ranks = job_ranks(tiles_agree=experts > 1 or S > 1)
        common = dict(impl="hf", act_bytes=activation_bytes(next(self.model.parameters()).dtype),
                      tile_tokens=self.tile_tokens, sco_keep_last=self.keep_given,
                      device_state_gib=(self.device_state_bytes or 0) / GiB)
        shape = model_shape(self.model, experts)
        if experts == 1 and S == 1:  # one process, or replicas of the whole model (DDP, FSDP2 of it)
            return shape, Setup(gpus=1, **common), ranks
        world = ranks.world
        gpus = world if world % S == 0 and world % experts == 0 else math.lcm(S, experts)
        # S = 1 (expert parallelism alone): nothing is exchanged by the sequence; "ring" only names
        # the tiled layers' head groups (num_key_value_heads, as moepeak.hf.tiled picks them)
        engine = "ulysses" if S > 1 and _attention_crosses_heads(self.model) else "ring"
        return shape, Setup(gpus=gpus, sp=engine, sp_size=S, shard="fsdp2" if _sharded(self.model) else "ddp",
                            ep_size=experts, **common), ranks

    def plan(self, tokens: int) -> Optional[Placement]:
        """Place a step of `tokens` tokens (this rank's) and apply it; None where placement is off
        or there is no GPU (self.note says why). PlacementError (the short tier, the bytes) when
        nothing fits; TilesNeeded under several ranks when only tiles fit and none were given."""
        if not self.enabled:
            return None
        measured = measure(self.model)
        if measured is None and (self.gpu_budget_gib is None or self.host_budget_gib is None):
            self.note = "off: the model is not on a GPU (no-op)"
            return None
        gpu, host = measured or (0.0, 0.0)
        if measured is not None:
            host = self.first_host(host)
        gpu = self.gpu_budget_gib * GiB if self.gpu_budget_gib is not None else gpu
        host = self.host_budget_gib * GiB if self.host_budget_gib is not None else host
        if not host > 0:
            self.note = "off: this host's available RAM could not be read (give host_budget_gib)"
            return None
        shape, setup, ranks = self.layout()
        bad = setup_problems(shape, setup)
        if bad:
            self.note = "off: the model's config does not give the planner's shape (" + "; ".join(bad) + ")"
            return None
        p = self.place(shape, setup, tokens, gpu_bytes=gpu, host_bytes=host, ranks=ranks, tile_option=TILE_OPTION)
        self._apply(p)
        self.planned(tokens, p)
        self.note = self.summary(p, f"{tokens} tokens", gpu, host, "given" if measured is None else "measured", ranks)
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

    def describe(self) -> str:
        lines = [f"placement: {self.note}"]
        if self.placement is not None:
            lines += [f"  {k}: {v}" for k, v in self.placement.reasons.items()]
        return "\n".join(lines)


def install(model, report, *, options, sco_config, tile_tokens, group, sequence, checkpoint) -> AutoPlacement:
    """The automatic placement of apply_moepeak (see the module docstring): made, hooked on the
    model's forward, kept as model._moepeak_placement and report.placement. sequence: the
    SequenceOptions of sequence_group (None: none)."""
    enabled = options.get("auto_placement", True)
    if not isinstance(enabled, bool):
        raise ValueError(f"moepeak.hf: auto_placement must be a bool, got {enabled!r}")
    why = ("off: auto_placement=False" if not enabled else
           "off: checkpoint=False (nothing of SCO's to place)" if not checkpoint else "")
    auto = AutoPlacement(model, report, keep_given=sco_config.keep_last if sco_config is not None else None,
                         sco_given=sco_config is not None, tile_tokens=tile_tokens,
                         gpu_budget_gib=options.get("gpu_budget_gib"), host_budget_gib=options.get("host_budget_gib"),
                         enabled=not why, why_off=why, group=group, sequence=sequence)
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
           "install", "TOKEN_ARGUMENTS", "TILE_OPTION"]
