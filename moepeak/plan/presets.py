"""`moepeak plan`'s presets: public MoE models' shapes (their config.json numbers) and
torchtitan 0.3's MoE flavors ("titan:<model>:<flavor>"), as ModelShape (--preset)."""
from __future__ import annotations

from typing import Dict

from .model import ModelShape


def _mla_attn_params(hidden: int, heads: int, q_lora_rank: int = 0, kv_lora_rank: int = 512, qk_nope: int = 128,
                     qk_rope: int = 64, v_head: int = 128) -> int:
    """Weights of one MLA attention layer (DeepSeek-V2/V3), norms left out: q (hidden x
    heads*(nope + rope), through a rank-q_lora_rank bottleneck when q_lora_rank > 0), kv_a
    (hidden x (kv_lora_rank + rope): the latent kv and the shared rope key), kv_b (kv_lora_rank
    x heads*(nope + v)) and o (heads*v x hidden)."""
    qk = qk_nope + qk_rope
    q = hidden * q_lora_rank + q_lora_rank * heads * qk if q_lora_rank else hidden * heads * qk
    return q + hidden * (kv_lora_rank + qk_rope) + kv_lora_rank * heads * (qk_nope + v_head) + heads * v_head * hidden


def _deepseek(*, layers: int, hidden: int, experts: int, intermediate: int, heads: int, q_lora_rank: int,
              shared_experts: int, dense_intermediate: int, top_k: int = 6, vocab: int = 102400,
              dense_layers: int = 1) -> ModelShape:
    """A DeepSeek-V2/V3 shape: MLA attention (value heads of 128, q and k heads of 128 + 64
    rope, each head its own k and v: kv_heads = heads) counted by _mla_attn_params, shared
    experts and leading dense-MLP layers."""
    return ModelShape(layers=layers, hidden=hidden, experts=experts, top_k=top_k, intermediate=intermediate,
                      vocab=vocab, heads=heads, kv_heads=heads, head_dim=128, qk_head_dim=192,
                      attn_params_per_layer=_mla_attn_params(hidden, heads, q_lora_rank),
                      shared_experts=shared_experts, dense_layers=dense_layers,
                      dense_intermediate=dense_intermediate)


# Public configs (their config.json numbers).
PRESETS: Dict[str, ModelShape] = {
    "Qwen3-30B-A3B": ModelShape(layers=48, hidden=2048, experts=128, top_k=8, intermediate=768,
                                vocab=151936, heads=32, kv_heads=4, head_dim=128),
    "Qwen3-235B-A22B": ModelShape(layers=94, hidden=4096, experts=128, top_k=8, intermediate=1536,
                                  vocab=151936, heads=64, kv_heads=4, head_dim=128),
    "DeepSeek-V3": _deepseek(layers=61, hidden=7168, experts=256, top_k=8, intermediate=2048, vocab=129280,
                             heads=128, q_lora_rank=1536, shared_experts=1, dense_layers=3,
                             dense_intermediate=18432),
    "gpt-oss-120b": ModelShape(layers=36, hidden=2880, experts=128, top_k=4, intermediate=2880,
                               vocab=201088, heads=64, kv_heads=8, head_dim=64),
    "Mixtral-8x22B": ModelShape(layers=56, hidden=6144, experts=8, top_k=2, intermediate=16384,
                                vocab=32768, heads=48, kv_heads=8, head_dim=128),
    # untied embedding and lm_head; q/k norms over the full width (OLMoE's qk_layernorm)
    "OLMoE-1B-7B": ModelShape(layers=16, hidden=2048, experts=64, top_k=8, intermediate=1024,
                              vocab=50304, heads=16, kv_heads=16, head_dim=128),
    # torchtitan 0.3.0's MoE flavors, "titan:<model>:<flavor>" (torchtitan.models.<model>'s
    # registry; tests/test_plan_presets.py checks each against the config it builds).
    # 16B's q is one hidden x (16*192) projection (no q_lora bottleneck).
    "titan:deepseek_v3:16B": _deepseek(layers=27, hidden=2048, experts=64, intermediate=1408, heads=16,
                                       q_lora_rank=0, shared_experts=2, dense_intermediate=10944),
    "titan:deepseek_v3:236B": _deepseek(layers=60, hidden=5120, experts=160, intermediate=1536, heads=128,
                                        q_lora_rank=1536, shared_experts=2, dense_intermediate=12288),
    "titan:gpt_oss:20b": ModelShape(layers=24, hidden=2880, experts=32, top_k=4, intermediate=2880,
                                    vocab=201088, heads=64, kv_heads=8, head_dim=64),
}
# torchtitan flavors with the same shapes as the public configs above.
PRESETS.update({
    "titan:qwen3:30B-A3B": PRESETS["Qwen3-30B-A3B"],
    "titan:qwen3:235B-A22B": PRESETS["Qwen3-235B-A22B"],
    "titan:deepseek_v3:671B": PRESETS["DeepSeek-V3"],
    "titan:gpt_oss:120b": PRESETS["gpt-oss-120b"],
})
