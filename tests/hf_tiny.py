"""The tiny Hugging Face Qwen3-MoE that the sequence- and context-parallel tests of
apply_moepeak train: 2 layers, hidden 32, 4 query / 2 key-value heads of 8, 8 experts top-2
of intermediate 24, router aux loss on, fp32, in train mode."""
from __future__ import annotations

import torch


def tiny_qwen3_moe(vocab_size: int, max_positions: int, attn: str = "sdpa"):
    """The model from seed 0, its routers drawn from N(0, 1): transformers' zero router init
    would tie every route."""
    import transformers
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=max_positions, intermediate_size=48, moe_intermediate_size=24,
        num_experts=8, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01,
        attn_implementation=attn)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".gate.weight" in name:
                p.normal_(0, 1.0)
    return model.float().train()
