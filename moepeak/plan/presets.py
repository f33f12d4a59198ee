"""`moepeak plan`'s presets: public MoE models' shapes (their config.json numbers) and
torchtitan 0.3's MoE flavors ("titan:<model>:<flavor>"), as ModelShape (--preset)."""
from __future__ import annotations

from typing import Dict

from .model import ModelShape

# Public configs (their config.json numbers).
PRESETS: Dict[str, ModelShape] = {
    "Qwen3-30B-A3B": ModelShape(layers=48, hidden=2048, experts=128, top_k=8, intermediate=768,
                                vocab=151936, heads=32, kv_heads=4, head_dim=128),
    "Qwen3-235B-A22B": ModelShape(layers=94, hidden=4096, experts=128, top_k=8, intermediate=1536,
                                  vocab=151936, heads=64, kv_heads=4, head_dim=128),
    # MLA attention: q_a 7168x1536, q_b 1536x(128*192), kv_a 7168x576, kv_b 512x(128*256), o (128*128)x7168
    "DeepSeek-V3": ModelShape(layers=61, hidden=7168, experts=256, top_k=8, intermediate=2048,
                              vocab=129280, heads=128, kv_heads=128, head_dim=128, qk_head_dim=192,
                              attn_params_per_layer=7168 * 1536 + 1536 * 128 * 192 + 7168 * 576
                              + 512 * 128 * 256 + 128 * 128 * 7168,
                              shared_experts=1, dense_layers=3, dense_intermediate=18432),
    "gpt-oss-120b": ModelShape(layers=36, hidden=2880, experts=128, top_k=4, intermediate=2880,
                               vocab=201088, heads=64, kv_heads=8, head_dim=64),
    "Mixtral-8x22B": ModelShape(layers=56, hidden=6144, experts=8, top_k=2, intermediate=16384,
                                vocab=32768, heads=48, kv_heads=8, head_dim=128),
    # untied embedding and lm_head; q/k norms over the full width (OLMoE's qk_layernorm)
    "OLMoE-1B-7B": ModelShape(layers=16, hidden=2048, experts=64, top_k=8, intermediate=1024,
                              vocab=50304, heads=16, kv_heads=16, head_dim=128),
    # torchtitan 0.3.0's MoE flavors, "titan:<model>:<flavor>" (torchtitan.models.<model>'s
    # registry; tests/test_plan_presets.py checks each against the config it builds).
    # MLA (deepseek_v3) counts its attention weights in attn_params_per_layer; head_dim is
    # the value head size, qk_head_dim q's and k's; kv_heads = heads (each head has its own k, v).
    # wq 2048x(16*192), kv_a 2048x576, kv_b 512x(16*256), o (16*128)x2048
    "titan:deepseek_v3:16B": ModelShape(layers=27, hidden=2048, experts=64, top_k=6, intermediate=1408,
                                        vocab=102400, heads=16, kv_heads=16, head_dim=128, qk_head_dim=192,
                                        attn_params_per_layer=2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256
                                        + 16 * 128 * 2048,
                                        shared_experts=2, dense_layers=1, dense_intermediate=10944),
    # q_a 5120x1536, q_b 1536x(128*192), kv_a 5120x576, kv_b 512x(128*256), o (128*128)x5120
    "titan:deepseek_v3:236B": ModelShape(layers=60, hidden=5120, experts=160, top_k=6, intermediate=1536,
                                         vocab=102400, heads=128, kv_heads=128, head_dim=128,
                                         qk_head_dim=192,
                                         attn_params_per_layer=5120 * 1536 + 1536 * 128 * 192 + 5120 * 576
                                         + 512 * 128 * 256 + 128 * 128 * 5120,
                                         shared_experts=2, dense_layers=1, dense_intermediate=12288),
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
