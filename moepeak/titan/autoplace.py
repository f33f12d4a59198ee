"""moepeak.titan.sco's automatic placement: each training step's tensors placed on this GPU
and this host's RAM (moepeak.plan.place), from the model's shape, the step's tokens T and the
machine's measured free bytes, before the step allocates anything.

When: a forward pre-hook on the model runs it at the first training forward and again
whenever T (the tokens tensor's batch x sequence) grows past the last planned T. Host RAM is
measured once, at the first plan (before StreamAdamW's state and SCO's arena take theirs);
the GPU's free + reserved bytes at each plan. What it applies, through
SCOOffloader.reconfigure: SCO's keep_last and a pinned arena sized for the step's host
boundaries; and sequence tiles (tile_tokens) when whole blocks do not fit. Explicit Config
fields win: a given keep_last is the plan's, a given arena_bytes (or a disk tier: spill_dir,
host_budget_bytes) keeps SCO's arena as given, a given tile_tokens is the plan's tiling;
auto_placement=False turns it off. The decision is logged once per plan on the 'moepeak'
logger, with the planner's reasons.

Where: one process on one GPU, the optimizer moepeak.titan.stream_adamw (place() counts
StreamAdamW's state in host RAM; its device_state_mb is the plan's device tail). Elsewhere
(CPU, several ranks, a stock optimizer) it does nothing and the log says why, once.
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch

from ..core import host_memory
from ..plan import GiB, ModelShape, Placement, Setup, place

log = logging.getLogger("moepeak")
STREAM_ADAMW_MARK = "_moepeak_device_state_bytes"  # set on each model part by StreamAdamWOptimizers


def _blocks(model):
    layers = model.get_submodule("layers")
    return list(layers.values()) if hasattr(layers, "values") else list(layers)


def model_shape(model) -> ModelShape:
    """The planner's shape of a torchtitan decoder (tok_embeddings, layers with attention and
    moe or feed_forward, lm_head); param_count: the model's own count (sum of numel)."""
    blocks = _blocks(model)
    emb = model.tok_embeddings
    moe_blocks = [b for b in blocks if getattr(b, "moe_enabled", False)]
    moe = moe_blocks[0].moe if moe_blocks else None
    experts = [m for m in (moe.modules() if moe is not None else ()) if hasattr(m, "w1_EFD")]
    attn = blocks[0].attention
    mla = hasattr(attn, "wkv_a")
    heads = int(attn.n_heads)
    dense = [b for b in blocks if b not in moe_blocks]
    dense_ff = getattr(dense[0], "feed_forward", None) if dense else None
    head = getattr(model, "lm_head", None)
    return ModelShape(
        layers=len(blocks), hidden=int(emb.embedding_dim), vocab=int(emb.num_embeddings),
        experts=int(moe.router.num_experts) if moe is not None else 1,
        top_k=int(moe.router.top_k) if moe is not None else 1,
        intermediate=int(experts[0].w1_EFD.shape[1]) if experts else 1,
        heads=heads, kv_heads=heads if mla else int(attn.n_kv_heads),
        head_dim=int(attn.v_head_dim if mla else attn.head_dim),
        qk_head_dim=int(attn.qk_head_dim) if mla else None,
        dense_layers=len(dense),
        dense_intermediate=int(dense_ff.w1.out_features) if dense_ff is not None and hasattr(dense_ff, "w1") else 0,
        tied_embeddings=head is not None and head.weight is emb.weight,
        param_count=sum(p.numel() for p in model.parameters()))


def measure(model) -> Optional[Tuple[float, float]]:
    """The machine's room for this model's step (core.host_memory.placement_room); a module
    function so tests can stand in for the GPU."""
    return host_memory.placement_room(model)


def step_tokens(args, kwargs) -> Optional[int]:
    """T of a Decoder forward call: the tokens tensor's batch x sequence."""
    x = kwargs.get("tokens", args[0] if args else None)
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return None
    return int(x.shape[0] * x.shape[1])


class TitanAutoPlacement:
    """The placement state of one job's SCO component: what the Config gave, the last plan.
    SCOActivationCheckpointing makes it and hooks it on the model's forward."""

    def __init__(self, component, model, *, keep_given: Optional[int], arena_given: bool,
                 tile_given: Optional[int]):
        self.component, self.model = component, model
        self.keep_given, self.arena_given, self.tile_tokens = keep_given, arena_given, tile_given
        self.tokens = 0                   # T of the last plan
        self.host_measured = 0.0          # the host's available RAM at the first plan
        self.placement: Optional[Placement] = None
        self.note = "not run yet (at the first training forward)"
        self._said_off = False

    def __call__(self, module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return
        T = step_tokens(args, kwargs)
        if T is not None and T > self.tokens:
            self.plan(T)

    def _off(self, why: str) -> None:
        self.note = "off: " + why
        if not self._said_off:
            log.info("moepeak.titan.sco: automatic placement %s", self.note)
            self._said_off = True

    def plan(self, tokens: int) -> Optional[Placement]:
        """Place a step of `tokens` tokens and apply it; None where it does not run (self.note
        says why). PlacementError (the short tier, the bytes) when nothing fits."""
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            self._off(f"{torch.distributed.get_world_size()} ranks (one GPU per job only): "
                      "give keep_last, arena_bytes and tile_tokens")
            return None
        measured = measure(self.model)
        if measured is None:
            self._off("the model is not on a GPU (no-op)")
            return None
        device_state = getattr(self.model, STREAM_ADAMW_MARK, None)
        if device_state is None:
            self._off("the optimizer is not moepeak.titan.stream_adamw (the plan counts StreamAdamW's "
                      "state in host RAM)")
            return None
        gpu, host = measured
        # host RAM as first measured, before StreamAdamW's state and SCO's arena existed: a later
        # measure would see them taken and count them twice (the arena is freed on re-plan)
        self.host_measured = host = self.host_measured or host
        if not host > 0:
            self._off("this host's available RAM could not be read (/proc/meminfo)")
            return None
        shape = model_shape(self.model)
        bad = shape.problems()
        if bad:
            self._off("the model does not give the planner's shape (" + "; ".join(bad) + ")")
            return None
        dtype = next(self.model.parameters()).dtype
        setup = Setup(gpus=1, impl="hf", act_bytes=2 if dtype in (torch.bfloat16, torch.float16) else 4,
                      tile_tokens=self.tile_tokens, sco_keep_last=self.keep_given,
                      device_state_gib=device_state / GiB)
        p = place(shape, setup, tokens, gpu_bytes=gpu, host_bytes=host)
        self._apply(p)
        self.tokens, self.placement = tokens, p
        self.note = (f"{tokens} tokens on {gpu / GiB:.1f} GiB of GPU and {host / GiB:.1f} GiB of host RAM: "
                     f"{p.keep_last} boundaries on the GPU, {p.host_boundaries} in host RAM"
                     + ("" if self.arena_given else f" (arena {p.sco_options()['arena_bytes'] / GiB:.2f} GiB)")
                     + "; " + (f"tiles of {p.tile_tokens} tokens" if p.tile_tokens else "whole blocks"))
        log.info("moepeak.titan.sco: automatic placement: %s\n%s", self.note,
                 "\n".join(f"  {k}: {v}" for k, v in p.reasons.items()))
        if p.device_state_bytes > device_state:
            log.warning("moepeak.titan.sco: the step of %d tokens wants %.2f GiB of StreamAdamW's state on the "
                        "GPU, the optimizer has %.2f GiB (stream_adamw's device_state_mb): host RAM may be short; "
                        "give device_state_mb=%d", tokens, p.device_state_bytes / GiB, device_state / GiB,
                        -(-p.device_state_bytes // (1 << 20)))
        return p

    def _apply(self, p: Placement) -> None:
        opts = p.sco_options()
        fields = {"keep_last": opts["keep_last"]} if self.keep_given is None else {}
        if not self.arena_given:
            fields["arena_bytes"] = opts["arena_bytes"]
        if fields:
            self.component.sco.reconfigure(**fields)
        if p.tile_tokens and self.tile_tokens is None:
            self.component.set_tiles(self.model, p.tile_tokens)
            self.tile_tokens = p.tile_tokens  # installed: later plans keep it


__all__ = ["TitanAutoPlacement", "model_shape", "measure", "step_tokens", "STREAM_ADAMW_MARK"]
