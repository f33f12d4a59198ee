"""moepeak's four schedules as torchtitan overrides (optional extra: moepeak[titan]).

A stock torchtitan job turns them on from its command line, without a fork:

    --override.imports moepeak.titan.experts,moepeak.titan.loss,moepeak.titan.sco,\
        moepeak.titan.stream_adamw,moepeak.titan.rope

Each name is an ``@override`` factory (torchtitan.config.override) that swaps
one component's Config in the trainer's config tree before anything is built:

  experts       RoutedExperts.Config -> LLEPRoutedExperts.Config: the routed
                experts run as PipelinedLLEP (moepeak.llep_moe), expert parallel
                over torchtitan's "ep" mesh dimension when it has more than one
                rank. The stock GroupedExperts stays the child module, so its
                parameters and state_dict keys (w1_EFD, w2_EDF, w3_EFD) are
                unchanged. The router, shared experts and load balancing stay
                stock.
  loss          the trainer's loss -> RingDTPLoss.Config: a ChunkedLossWrapper
                subclass, so the trainer skips the lm_head (its _skip_lm_head
                path) and hands the loss the final hidden states; the loss is
                moepeak.linear_cross_entropy, which never forms the logits. An
                FSDP2-sharded lm_head (DTensor, Shard(0) on a 1-D mesh) runs the
                vocab-sharded ring over that mesh's group on its local shard.
  sco           ActivationCheckpointing.Config (full or selective) ->
                SCOActivationCheckpointing.Config: full AC whose block inputs live
                in a pinned host arena between forward and backward
                (moepeak.apply_sco); module tree and state_dict keys unchanged.
                {"tile_tokens": N} also runs each block sequence-tiled
                (moepeak.tiled: the fifth peak), GQAttention or deepseek_v3's
                latent attention, with SDPA. {"keep_last": n}: the last n blocks'
                inputs stay on the GPU. On a GPU, keep_last, arena_bytes (and,
                on one rank, tile_tokens) left unset are placed at the first
                step (and when the step's tokens grow) from the model, the step's
                tokens and the machine's free bytes (moepeak.plan.place, logged on
                the 'moepeak' logger; moepeak/titan/autoplace.py); on CPU, or
                with {"auto_placement": false}, SCOConfig's defaults (keep_last 1).
  stream_adamw  OptimizersContainer.Config -> StreamAdamWOptimizers.Config: each
                "AdamW" param group runs moepeak.StreamAdamW (fp32 state in host
                RAM); its state dict has torch AdamW's keys, so DCP checkpoints
                interchange with the stock optimizer's. {"device_state_mb": N}
                keeps the state of the parameters final last in backward on the
                GPU (StreamAdamW.backward_tail), so their update is not exposed.
  rope          CosSinRoPE / ComplexRoPE.Config -> SharedCosSinRoPE /
                SharedComplexRoPE.Config: one rotary table for every block
                instead of one each ([max_seq_len, 2 * head_dim] fp32 per block:
                1 GiB each at 1M positions with head_dim 128); same numbers, no
                state_dict entry (the table is a non-persistent buffer).

Options travel as JSON kwargs on the CLI, e.g.
    --override.imports 'moepeak.titan.experts={"save_budget_mb": 0}'

Expert weight layout: GroupedExperts stores w1 (gate) and w3 (up) as
[E, F, D] and w2 as [E, D, F]; llep_moe takes the gate/up pair
(w1^T, w3^T), each [E_local, D, F], and w_down = w2^T [E_local, F, D], all
three transpose(1, 2) views of the parameters (no per-step copy; the
gradients come back in the parameters' strides). Only where the compute
dtype differs from the parameters' does .to(dtype) make a cast copy.

Modules: one per override's component (routed_experts, ring_dtp_loss, sco_checkpointing,
shared_rope, optimizers), autoplace (sco's automatic placement), tiled (torchtitan's
blocks as moepeak.tiled specs), compat (the torch names torchtitan 0.3 needs), configs
(a cut-down stock job for tests and benchmarks). No submodule is named after an override:
each of experts, loss, sco, stream_adamw and rope is the factory function defined here,
which torchtitan registers under its import path (moepeak.titan.<name>).

Public face (exported here, for torchtitan jobs): the five override factories, their
components (LLEPRoutedExperts, RingDTPLoss, SCOActivationCheckpointing,
StreamAdamWOptimizers, SharedCosSinRoPE, SharedComplexRoPE) and qwen3_moe_config.
"""
from __future__ import annotations

from typing import Any

import torch

from . import compat

compat.provide_missing_torch_names()  # torchtitan 0.3 on torch 2.11 / 2.13 (see moepeak/titan/compat.py)
try:
    from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config import derive, override
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.rope import RoPE
except ImportError as e:  # pragma: no cover - exercised only without torchtitan
    raise ImportError("moepeak.titan needs torchtitan 0.3 (pip install -e '.[titan]' from a moepeak checkout); "
                      f"here torch {torch.__version__}: {e}") from e

from .configs import qwen3_moe_config
from .optimizers import StreamAdamWOptimizers
from .ring_dtp_loss import RingDTPLoss
from .routed_experts import LLEPRoutedExperts
from .sco_checkpointing import SCOActivationCheckpointing
from . import shared_rope
from .shared_rope import SharedComplexRoPE, SharedCosSinRoPE

__all__ = ["LLEPRoutedExperts", "RingDTPLoss", "SCOActivationCheckpointing", "StreamAdamWOptimizers",
           "SharedCosSinRoPE", "SharedComplexRoPE", "experts", "loss", "sco", "stream_adamw", "rope",
           "qwen3_moe_config"]


@override(target=RoutedExperts.Config, description="moepeak PipelinedLLEP routed experts")
def experts(cfg: RoutedExperts.Config, **options: Any) -> LLEPRoutedExperts.Config:
    if type(cfg.inner_experts) is not GroupedExperts.Config:
        raise ValueError(f"moepeak.titan.experts: PipelinedLLEP computes SwiGLU experts "
                         f"(silu(x w1) * (x w3)) w2; {type(cfg.inner_experts).__qualname__} "
                         f"(e.g. gpt_oss's clamped activation with biases) is not supported")
    return derive(cfg, LLEPRoutedExperts.Config, **options)


@override(target=BaseLoss.Config, fqns=["loss"], description="moepeak Ring-DTP linear cross-entropy")
def loss(cfg: BaseLoss.Config, **options: Any) -> RingDTPLoss.Config:
    if type(cfg) is CrossEntropyLoss.Config:
        return RingDTPLoss.Config(loss_fn=cfg, **options)
    if type(cfg) is ChunkedLossWrapper.Config:
        return derive(cfg, RingDTPLoss.Config, **options)
    raise ValueError(f"moepeak.titan.loss replaces cross-entropy (CrossEntropyLoss or ChunkedLossWrapper); "
                     f"the job's loss is {type(cfg).__qualname__}")


@override(target=ActivationCheckpointing.Config, fqns=["activation_checkpoint"],
          description="moepeak SCO: full AC with block inputs in pinned host memory")
def sco(cfg: ActivationCheckpointing.Config, **options: Any) -> SCOActivationCheckpointing.Config:
    return SCOActivationCheckpointing.Config(preserve_rng_state=cfg.preserve_rng_state,
                                             determinism_check=cfg.determinism_check, debug=cfg.debug, **options)


@override(target=RoPE.Config, description="moepeak: one rotary table for all blocks")
def rope(cfg: RoPE.Config) -> RoPE.Config:
    if type(cfg) in shared_rope.SHARED_ROPE.values():
        return cfg
    shared = shared_rope.SHARED_ROPE.get(type(cfg))
    if shared is None:
        raise ValueError(f"moepeak.titan.rope shares CosSinRoPE and ComplexRoPE tables; "
                         f"{type(cfg).__qualname__} is not supported")
    return derive(cfg, shared)


@override(target=OptimizersContainer.Config, fqns=["optimizer"], description="moepeak StreamAdamW")
def stream_adamw(cfg: OptimizersContainer.Config, **options: Any) -> StreamAdamWOptimizers.Config:
    return derive(cfg, StreamAdamWOptimizers.Config, **options)
