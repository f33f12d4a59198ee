"""`moepeak plan`'s "titan:<model>:<flavor>" presets against torchtitan's own
model registries: every field of the preset (and the attention and total
parameter counts it implies) equals what the flavor's config builds.
Skips when torchtitan (or triton, which its MoE models import) is absent."""
from __future__ import annotations

import dataclasses

import pytest

from moepeak.plan import PRESETS, ModelShape

TITAN_PRESETS = sorted(name for name in PRESETS if name.startswith("titan:"))
ATTENTION_LINEARS = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")


def titan_registry(model: str):
    pytest.importorskip("torchtitan")
    if model == "qwen3":
        from torchtitan.models.qwen3 import model_registry
    elif model == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import model_registry
    elif model == "gpt_oss":
        from torchtitan.models.gpt_oss import model_registry
    else:
        raise AssertionError(f"no torchtitan registry for {model!r}")
    return model_registry


def attention_weight_params(attn) -> int:
    """Weight-matrix parameters of one attention layer's config (biases, norms and sinks
    excluded, as ModelShape.attn_params counts)."""
    linears = [getattr(attn, name, None) for name in ATTENTION_LINEARS]
    qkv = getattr(attn, "qkv_linear", None)
    if qkv is not None:
        linears.append(qkv.wqkv)
    return sum(lin.in_features * lin.out_features for lin in linears if lin is not None)


def shape_of(model_cfg) -> tuple[ModelShape, int]:
    """(ModelShape, attention weight params per layer) read from a torchtitan model config."""
    layers = model_cfg.layers
    dense = [layer.moe is None for layer in layers]
    dense_layers = sum(dense)
    assert dense == [True] * dense_layers + [False] * (len(layers) - dense_layers), "dense layers lead"
    moe_layer = layers[-1]
    moe, attn = moe_layer.moe, moe_layer.attention
    def moe_shape(m):
        return (m.num_experts, m.router.top_k, m.routed_experts.inner_experts.hidden_dim,
                None if m.shared_experts is None else m.shared_experts.w1.out_features)
    assert all(moe_shape(layer.moe) == moe_shape(moe) for layer in layers[dense_layers:]), \
        "every MoE layer has the same shape"
    intermediate = moe.routed_experts.inner_experts.hidden_dim
    shared = 0
    if moe.shared_experts is not None:
        shared_hidden = moe.shared_experts.w1.out_features
        assert shared_hidden % intermediate == 0
        shared = shared_hidden // intermediate
    mla = getattr(attn, "kv_lora_rank", None) is not None
    attn_params = attention_weight_params(attn)
    shape = ModelShape(
        layers=len(layers), hidden=model_cfg.dim, experts=moe.num_experts, top_k=moe.router.top_k,
        intermediate=intermediate, vocab=model_cfg.vocab_size, heads=attn.n_heads,
        # MLA: every head has its own k and v; head_dim is the value head size, qk_head_dim
        # q's and k's (nope + rope)
        kv_heads=attn.n_heads if mla else attn.n_kv_heads,
        head_dim=attn.v_head_dim if mla else attn.head_dim,
        qk_head_dim=attn.qk_nope_head_dim + attn.qk_rope_head_dim if mla else None,
        attn_params_per_layer=attn_params if mla else None,
        shared_experts=shared, dense_layers=dense_layers,
        dense_intermediate=layers[0].feed_forward.w1.out_features if dense_layers else 0,
        tied_embeddings=bool(model_cfg.enable_weight_tying))
    return shape, attn_params


def test_titan_presets_cover_the_moe_flavors():
    assert TITAN_PRESETS == sorted([
        "titan:qwen3:30B-A3B", "titan:qwen3:235B-A22B",
        "titan:deepseek_v3:16B", "titan:deepseek_v3:236B", "titan:deepseek_v3:671B",
        "titan:gpt_oss:20b", "titan:gpt_oss:120b"])


@pytest.mark.parametrize("name", TITAN_PRESETS)
def test_preset_equals_torchtitan_flavor(name):
    _, model, flavor = name.split(":")
    registry = titan_registry(model)
    try:
        spec = registry(flavor)
    except ImportError as e:  # e.g. triton absent
        pytest.skip(f"torchtitan's {model} registry does not import here: {e}")
    want, attn_params = shape_of(spec.model)
    got = PRESETS[name]
    assert dataclasses.asdict(got) == dataclasses.asdict(want)
    assert got.attn_params() == attn_params  # the GQA formula counts the fused qkv + wo weights
    got.validate()


def test_titan_preset_params_match_the_built_flavor():
    """The parameter count a preset implies equals the parameters of the built
    module tree (meta device), router gates and norms included; only attention
    biases/sinks and gpt_oss's expert biases fall outside the plan's count."""
    registry = titan_registry("qwen3")
    try:
        import torch
        spec = registry("30B-A3B")
        with torch.device("meta"):
            model = spec.model.build()
    except ImportError as e:
        pytest.skip(f"torchtitan's qwen3 model does not build here: {e}")
    counted = PRESETS["titan:qwen3:30B-A3B"].params()
    # qk norms (2 x head_dim per layer) are the only parameters ModelShape does not model
    m = PRESETS["titan:qwen3:30B-A3B"]
    qk_norms = m.layers * 2 * m.d()
    assert sum(p.numel() for p in model.parameters()) == counted + qk_norms
