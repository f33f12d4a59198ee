"""A stock torchtitan job config cut down for tests and benchmarks (no moepeak override in it)."""
from __future__ import annotations

from typing import Optional


def qwen3_moe_config(n_layers: int, num_experts: int, top_k: int, hidden_dim: int, *,
                     flavor: Optional[str] = None, max_seq_len: Optional[int] = None):
    """A stock torchtitan Qwen3-MoE Trainer.Config cut down for tests and benchmarks.

    qwen3_moe_debug()'s job (with the model of qwen3 `flavor`, e.g. "30B-A3B", if given)
    keeping its first n_layers blocks, each with num_experts routed experts of hidden_dim,
    top_k routing, SDPA attention, and full activation checkpointing. max_seq_len, if given,
    sets the rotary tables' length (the stock tables end at the flavor's training length).
    No moepeak override is applied: apply_overrides(...) on the result does that."""
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    cfg = qwen3_moe_debug()
    if flavor is not None:
        cfg.model_spec = model_registry(flavor)
    model = cfg.model_spec.model
    model.layers = model.layers[:n_layers]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        moe = layer.moe
        moe.num_experts = num_experts
        inner = moe.routed_experts.inner_experts
        inner.num_experts, inner.hidden_dim = num_experts, hidden_dim
        dispatcher = moe.routed_experts.token_dispatcher
        dispatcher.num_experts, dispatcher.top_k = num_experts, top_k
        moe.router.num_experts, moe.router.top_k, moe.router.gate.out_features = num_experts, top_k, num_experts
        if max_seq_len is not None and hasattr(rope := layer.attention.rope, "max_seq_len"):
            rope.max_seq_len = max_seq_len
    cfg.activation_checkpoint = FullAC.Config()
    return cfg
