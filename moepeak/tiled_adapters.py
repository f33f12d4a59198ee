"""Adapters: a TiledBlockSpec built from a known block's submodules.

demo_block_spec(block, x)             moepeak's demo decoder block (attribute names of
                                      moepeak's demo model Block: attn_norm, attn.{q,k,v,o}_proj,
                                      attn.rotary, attn.cp, mlp_norm, moe)
hf_moe_layer_spec(layer, x, ...)      a Hugging Face Qwen3MoeDecoderLayer or MixtralDecoderLayer (and
                                      any layer with the same submodule names: input_layernorm,
                                      self_attn with q/k/v/o_proj and optional per-head q_norm/k_norm,
                                      post_attention_layernorm, mlp with its router at mlp.gate)
titan_block_spec(block, x, ...)       a torchtitan (0.3) decoder block with GQAttention: attention_norm,
                                      attention.{qkv_linear, q_norm, k_norm, rope, inner_attention
                                      (SDPA), wo}, ffn_norm, moe or feed_forward (tested: qwen3); or
                                      deepseek_v3's latent attention (attention.{wq or wq_a, q_norm,
                                      wq_b, wkv_a, kv_norm, wkv_b, rope, inner_attention, wo})

Each runs exactly the ops of the block's own forward, in the same order, on a tile of
rows; only the split into pre_attn / attn_core / post_attn is new.
"""
from __future__ import annotations

import torch

from .tiled import TiledBlockSpec, tiled_block


def _requires_grad_params(module: torch.nn.Module):
    return lambda: [p for p in module.parameters() if p.requires_grad]


# --------------------------------------------------------------------------- the demo block

def _rope(x, cos, sin):
    """x: [B, nh, t, d], cos/sin: [t, d] fp32; rotate_half convention, computed in fp32
    (the demo model's apply_rope arithmetic)."""
    d = x.shape[-1] // 2
    rot = torch.cat([-x[..., d:], x[..., :d]], dim=-1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


def demo_block_spec(block: torch.nn.Module, x: torch.Tensor) -> TiledBlockSpec:
    """Spec for the demo model's Block: x [B, T, H] (T: this rank's tokens under context
    parallelism). q/k/v: [B, heads, T, d]; out: [B, heads, T, d]. The core is the block's
    own attn.attend (GQA: q heads [j*r, (j+1)*r) read kv head j), split into nkv head groups."""
    attn = block.attn
    B, T = x.shape[0], x.shape[1]
    nh, nkv, d = attn.nh, attn.nkv, attn.d
    offset = 0 if attn.cp is None else attn.cp[2] * T  # global position of this rank's slice
    cos, sin = attn.rotary.tables(T, x.device, offset)  # [T, d] fp32, shared by all blocks

    def pre_attn(x_t, start):
        t = x_t.shape[1]
        n = block.attn_norm(x_t)
        q = attn.q_proj(n).view(B, t, nh, d).transpose(1, 2)
        k = attn.k_proj(n).view(B, t, nkv, d).transpose(1, 2)
        v = attn.v_proj(n).view(B, t, nkv, d).transpose(1, 2)
        c, s = cos[start:start + t], sin[start:start + t]
        return _rope(q, c, s), _rope(k, c, s), v

    def attn_core(q, k, v):
        return attn.attend(q, k, v)

    def post_attn(x_t, o_t):
        t = x_t.shape[1]
        h = x_t + attn.o_proj(o_t.transpose(1, 2).reshape(B, t, nh * d))
        y, _ = block.moe(block.mlp_norm(h))
        return h + y

    return TiledBlockSpec(pre_attn, attn_core, post_attn, _requires_grad_params(block),
                          seq_dim=1, qkv_seq_dim=2, out_seq_dim=2, head_groups=nkv, qkv_head_dim=1,
                          out_head_dim=1)


# --------------------------------------------------------------------------- Hugging Face MoE layers

# The decoder layers hf_moe_layer_spec runs (transformers 5.17), by class name: (how the
# attention makes q, k, v: "mha" = q/k/v_proj, "mla" = DeepSeek's multi-head latent attention;
# what it passes as the interface's sliding_window: "attn" (self.sliding_window), "config"
# (getattr(config, "sliding_window", None)) or None (nothing: the mask alone carries a window)).
HF_TILED_LAYERS = {
    "Qwen3MoeDecoderLayer": ("mha", "attn"),
    "Qwen2MoeDecoderLayer": ("mha", None),
    "MixtralDecoderLayer": ("mha", "config"),
    "OlmoeDecoderLayer": ("mha", "config"),
    "DeepseekV3DecoderLayer": ("mla", None),
}

def hf_moe_layer_spec(layer: torch.nn.Module, x: torch.Tensor, attention_mask=None, position_ids=None,
                      past_key_values=None, use_cache=False, position_embeddings=None, return_router_logits=False,
                      **kwargs) -> TiledBlockSpec:
    """Spec for a Hugging Face pre-norm MoE decoder layer (a class of HF_TILED_LAYERS) called as
    layer(hidden_states, ...): the same arguments. Submodules read: input_layernorm; self_attn
    with q/k/v/o_proj, head_dim, scaling and, when present, q_norm / k_norm, per head (Qwen3-MoE)
    or over the whole projection (OLMoE, which also clamps q, k, v to config.clip_qkv); for
    DeepSeek-V3 its latent-attention projections (q_a/q_b or q_proj, kv_a_proj_with_mqa, the two
    latent norms, kv_b_proj through its expand_kv) and rotary variant;
    post_attention_layernorm; mlp (returns the MoE output) with its router mlp.gate (returns
    (router_logits, weights, indices), as transformers' *TopKRouter does). RoPE, the eager
    attention fallback: the layer's own modeling module (apply_rotary_pos_emb,
    eager_attention_forward). x [B, T, H]; position_embeddings (cos, sin) [B, T, d]; q/k/v
    [B, heads, T, d]; out [B, T, heads, d] (the attention interface's layout).

    return_router_logits: post_attn also returns the tile's router logits [B, t, E] (spec.extras
    = 1): tiled_block then gives (y, logits [B, T, E]), and a loss over all tokens' logits (the
    router aux loss) backpropagates through the tiled recompute."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attn, mlp = layer.self_attn, layer.mlp
    modeling = sys.modules[type(attn).__module__]
    name = type(layer).__name__
    if past_key_values is not None or use_cache:
        raise ValueError(f"moepeak: a tiled {name} does not take a KV cache "
                         "(past_key_values / use_cache are for generation, not training)")
    if position_embeddings is None:
        raise ValueError(f"moepeak: a tiled {name} needs position_embeddings (cos, sin) [B, T, head_dim], "
                         "as the model passes them")
    dropout = attn.attention_dropout if attn.training else 0.0
    if dropout and torch.is_grad_enabled():
        raise ValueError(f"moepeak: a tiled {name} cannot use attention dropout "
                         f"({dropout}): the attention core is recomputed in backward")
    jitter = getattr(mlp, "jitter_noise", 0.0) if mlp.training else 0.0
    if jitter and torch.is_grad_enabled():
        raise ValueError(f"moepeak: a tiled {name} cannot use router jitter noise ({jitter}): the MoE part is "
                         "recomputed in backward and would draw other noise; set config.router_jitter_noise = 0")
    router = getattr(mlp, "gate", None)
    if return_router_logits and not isinstance(router, torch.nn.Module):
        raise ValueError(f"moepeak: a tiled {name} returns router logits only with a router module at mlp.gate")
    if name not in HF_TILED_LAYERS:
        raise ValueError(f"moepeak: no tiled adapter for {name} (tiled: {', '.join(HF_TILED_LAYERS)})")
    projections, window = HF_TILED_LAYERS[name]
    core_kwargs = dict(kwargs)
    if window is not None:
        core_kwargs["sliding_window"] = attn.sliding_window if window == "attn" else \
            getattr(attn.config, "sliding_window", None)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    B, hd = x.shape[0], getattr(attn, "head_dim", None)
    per_head_norm = q_norm is not None and q_norm.weight.numel() == hd
    clip = getattr(attn.config, "clip_qkv", None)
    cos, sin = position_embeddings

    def mla_pre_attn(x_t, start):
        # DeepseekV3Attention.forward's ops before the attention interface, on the tile
        t = x_t.shape[1]
        n = layer.input_layernorm(x_t)
        q = attn.q_proj(n) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(n)))
        q = q.view(B, t, -1, attn.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        kv_nope, k_rot = torch.split(attn.kv_a_proj_with_mqa(n), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        kv_nope = attn.kv_a_layernorm(kv_nope).view(B, 1, t, attn.kv_lora_rank)
        k_rot = k_rot.view(B, 1, t, attn.qk_rope_head_dim)
        rotate = modeling.apply_rotary_pos_emb_interleave if attn.config.rope_interleave else \
            modeling.apply_rotary_pos_emb
        q_rot, k_rot = rotate(q_rot, k_rot, cos[:, start:start + t], sin[:, start:start + t])
        k, v = attn.expand_kv(kv_nope, k_rot)
        return torch.cat((q_pass, q_rot), dim=-1), k, v

    def pre_attn(x_t, start):
        if projections == "mla":
            return mla_pre_attn(x_t, start)
        t = x_t.shape[1]
        n = layer.input_layernorm(x_t)
        shape = (B, t, -1, hd)
        q, k, v = attn.q_proj(n), attn.k_proj(n), attn.v_proj(n)
        if q_norm is not None and not per_head_norm:
            q, k = q_norm(q), k_norm(k)
        if clip is not None:
            q, k, v = (u.clamp(min=-clip, max=clip) for u in (q, k, v))
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        if per_head_norm:
            q, k = q_norm(q), k_norm(k)
        q, k = modeling.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2),
                                             cos[:, start:start + t], sin[:, start:start + t])
        return q, k, v.transpose(1, 2)

    def attn_core(q, k, v):
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                          modeling.eager_attention_forward)
        out, _ = interface(attn, q, k, v, attention_mask, dropout=dropout, scaling=attn.scaling, **core_kwargs)
        return out

    def moe_part(h):
        return h + mlp(layer.post_attention_layernorm(h))

    def post_attn(x_t, o_t):
        t = x_t.shape[1]
        h = x_t + attn.o_proj(o_t.reshape(B, t, -1).contiguous())
        if not return_router_logits:
            return moe_part(h)
        seen = []  # the router's outputs of this tile: exactly one call
        handle = router.register_forward_hook(lambda module, args, out: seen.append(out[0]))
        try:
            y = moe_part(h)
        finally:
            handle.remove()
        if len(seen) != 1:
            raise RuntimeError(f"moepeak: {name}.mlp called its router {len(seen)} times for one tile (expected 1)")
        return y, seen[0].view(B, t, -1)  # the router's [B*t, E] rows are batch-major

    return TiledBlockSpec(pre_attn, attn_core, post_attn, _requires_grad_params(layer),
                          seq_dim=1, qkv_seq_dim=2, out_seq_dim=1, head_groups=attn.config.num_key_value_heads,
                          qkv_head_dim=1, out_head_dim=2, extras=1 if return_router_logits else 0)


def tiled_hf_moe_layer_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, *args,
                               tile_tokens: int, **kwargs):
    """Drop-in for a Hugging Face MoE decoder layer's forward (same arguments, plus tile_tokens;
    see hf_moe_layer_spec): e.g. layer.forward = functools.partial(tiled_hf_moe_layer_forward,
    layer, tile_tokens=8192). With return_router_logits=True: (y, router logits [B*T, E]), the
    logits in the router's own row order (batch-major), with their gradient path."""
    spec = hf_moe_layer_spec(layer, hidden_states, *args, **kwargs)
    out = tiled_block(hidden_states, spec, tile_tokens)
    if not spec.extras:
        return out
    y, logits = out
    return y, logits.reshape(-1, logits.shape[-1])


# --------------------------------------------------------------------------- torchtitan blocks

def titan_block_spec(block: torch.nn.Module, x: torch.Tensor, attention_masks=None,
                     positions=None) -> TiledBlockSpec:
    """Spec for a torchtitan decoder block called as block(x, attention_masks, positions):
    x [B, T, D] plain (not DTensor: no tensor/sequence parallel); the attention's inner
    attention is torchtitan's ScaledDotProductAttention (causal, no masks). q/k/v: [B, T,
    heads, head_dim] as qkv_linear makes them (q heads kv-major, so head groups of GQA), or
    as deepseek_v3's Attention makes them (q, k: nope + rope head dims, v: v_head_dim);
    out: [B, T, heads, head_dim]. RoPE at a tile's positions: positions[:, start:start + t],
    or start .. start + t - 1 when the model passes none (the rows of the prefix table the
    untiled block reads)."""
    attn = block.attention
    name = type(block).__name__
    mla = hasattr(attn, "wkv_a")  # deepseek_v3's multi-head latent attention
    if attention_masks is not None:
        raise ValueError(f"moepeak: a tiled {name} runs causal SDPA attention without masks; "
                         f"got attention_masks ({type(attention_masks).__name__})")
    if type(x).__name__ == "DTensor":
        raise NotImplementedError(f"moepeak: a tiled {name} takes a plain block input (FSDP2 only), got a DTensor "
                                  "(tensor or sequence parallel)")
    B = x.shape[0]

    def tile_positions(start, t, device):
        return positions[:, start:start + t] if positions is not None else \
            torch.arange(start, start + t, device=device).unsqueeze(0)

    def mla_pre_attn(x_t, start):
        # deepseek_v3 Attention.forward's ops before its inner attention, on the tile
        t = x_t.shape[1]
        n = block.attention_norm(x_t)
        q = attn.wq(n) if attn.q_lora_rank == 0 else attn.wq_b(attn.q_norm(attn.wq_a(n)))
        q_nope, q_pe = torch.split(q.view(B, t, -1, attn.qk_head_dim), [attn.qk_nope_head_dim, attn.qk_rope_head_dim],
                                   dim=-1)
        kv, k_pe = torch.split(attn.wkv_a(n), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = attn.rope(q_pe, k_pe.unsqueeze(2), tile_positions(start, t, x_t.device))
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = attn.wkv_b(attn.kv_norm(kv)).view(B, t, -1, attn.qk_nope_head_dim + attn.v_head_dim)
        k_nope, v = torch.split(kv, [attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
        return q, torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.size(2), -1)], dim=-1), v

    def pre_attn(x_t, start):
        if mla:
            return mla_pre_attn(x_t, start)
        t = x_t.shape[1]
        q, k, v = attn.qkv_linear(block.attention_norm(x_t))
        if attn.q_norm is not None or attn.k_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = attn.rope(q, k, tile_positions(start, t, x_t.device))
        return q, k, v

    def attn_core(q, k, v):
        if mla:
            return attn.inner_attention(q, k, v, attention_masks=None, scale=attn.softmax_scale).contiguous()
        return attn.inner_attention(q, k, v, attention_masks=None, scale=attn.scaling, enable_gqa=attn.enable_gqa)

    def post_attn(x_t, o_t):
        t = x_t.shape[1]
        h = x_t + attn.wo(o_t.reshape(B, t, -1))
        ffn = block.moe if getattr(block, "moe_enabled", False) else block.feed_forward
        return h + ffn(block.ffn_norm(h))

    return TiledBlockSpec(pre_attn, attn_core, post_attn, _requires_grad_params(block),
                          seq_dim=1, qkv_seq_dim=1, out_seq_dim=1, head_groups=attn.n_heads if mla else attn.n_kv_heads,
                          qkv_head_dim=2, out_head_dim=2)


def tiled_titan_block_forward(block: torch.nn.Module, x: torch.Tensor, attention_masks=None, positions=None, *,
                              tile_tokens: int) -> torch.Tensor:
    """Drop-in for a torchtitan decoder block's forward (same arguments, plus tile_tokens;
    see titan_block_spec)."""
    return tiled_block(x, titan_block_spec(block, x, attention_masks, positions), tile_tokens)
