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

The optimizer: moepeak.titan.stream_adamw keeps its state in host RAM but for its device tail
(device_state_mb, marked on the model: the plan's device tail); any other optimizer (a stock
torch AdamW, torchtitan's default) is planned with all its state on the GPU (Setup's
device_state_gib = ALL_STATE_ON_GPU: fp32 master + moments, 12 B per bf16 parameter beside
the parameter and its gradient; 8 per fp32 one), as AdamW keeps it.
Several ranks (torch.distributed's world; moepeak.plan.integration states the rule): each
rank places its own share from its own GPU and its share of the host, with no collective:
the model's parameters over the world (FSDP2), the tokens its forward sees (T per rank). Its
tiles may each run the experts' all-to-all, so the tiling is the ranks' to share: where whole
blocks do not fit and tile_tokens was not given, the first training forward raises
moepeak.plan.TilesNeeded naming the Config's tile_tokens to give. Tensor parallelism's shards
are not modelled (the plan counts each rank's blocks whole: more than they hold). On CPU it
does nothing and the log says why, once.
"""
from __future__ import annotations

import logging
from typing import Optional

from ..core import host_memory
from ..plan import (ALL_STATE_ON_GPU, GiB, ModelShape, Placement, Setup, StepPlacement, activation_bytes,
                    job_ranks, setup_problems)

log = logging.getLogger("moepeak")
STREAM_ADAMW_MARK = "_moepeak_device_state_bytes"  # set on each model part by StreamAdamWOptimizers
TOKEN_ARGUMENTS = ("tokens",)  # a Decoder forward's token tensor (positional: the first)
TILE_OPTION = "tile_tokens=N in moepeak.titan.sco's Config (the job config's activation_checkpoint.tile_tokens)"
# The machine's room for this model's step: a module name, so tests can stand in for the GPU
measure = host_memory.placement_room


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


class TitanAutoPlacement(StepPlacement):
    """The placement state of one job's SCO component: what the Config gave, the last plan.
    SCOActivationCheckpointing makes it and hooks it on the model's forward."""

    def __init__(self, component, model, *, keep_given: Optional[int], arena_given: bool,
                 tile_given: Optional[int]):
        super().__init__(tile_given)
        self.component, self.model = component, model
        self.keep_given, self.arena_given = keep_given, arena_given
        self.note = "not run yet (at the first training forward)"
        self._said_off = False

    def __call__(self, module, args, kwargs):
        T = self.due(module, args, kwargs, TOKEN_ARGUMENTS)
        if T is not None:
            self.plan(T)

    def _off(self, why: str) -> None:
        self.note = "off: " + why
        if not self._said_off:
            log.info("moepeak.titan.sco: automatic placement %s", self.note)
            self._said_off = True

    def plan(self, tokens: int) -> Optional[Placement]:
        """Place a step of `tokens` tokens (this rank's) and apply it; None where it does not run
        (self.note says why). PlacementError (the short tier, the bytes) when nothing fits;
        TilesNeeded under several ranks when only tiles fit and none were given."""
        measured = measure(self.model)
        if measured is None:
            self._off("the model is not on a GPU (no-op)")
            return None
        gpu, host = measured
        host = self.first_host(host)
        if not host > 0:
            self._off("this host's available RAM could not be read (/proc/meminfo)")
            return None
        ranks = job_ranks(tiles_agree=True)
        device_state = getattr(self.model, STREAM_ADAMW_MARK, None)
        setup = Setup(gpus=ranks.world, impl="hf", act_bytes=activation_bytes(next(self.model.parameters()).dtype),
                      tile_tokens=self.tile_tokens, sco_keep_last=self.keep_given,
                      device_state_gib=ALL_STATE_ON_GPU if device_state is None else device_state / GiB)
        shape = model_shape(self.model)
        bad = setup_problems(shape, setup)
        if bad:
            self._off("the model does not give the planner's shape (" + "; ".join(bad) + ")")
            return None
        p = self.place(shape, setup, tokens, gpu_bytes=gpu, host_bytes=host, ranks=ranks, tile_option=TILE_OPTION)
        self._apply(p)
        self.planned(tokens, p)
        self.note = self.summary(p, f"{tokens} tokens", gpu, host, "measured", ranks) + (
            "; the optimizer is not moepeak.titan.stream_adamw: its state is counted on the GPU"
            if device_state is None else "")
        log.info("moepeak.titan.sco: automatic placement: %s\n%s", self.note,
                 "\n".join(f"  {k}: {v}" for k, v in p.reasons.items()))
        if device_state is not None and p.device_state_bytes > device_state:
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


__all__ = ["TitanAutoPlacement", "model_shape", "measure", "STREAM_ADAMW_MARK", "TOKEN_ARGUMENTS", "TILE_OPTION"]
