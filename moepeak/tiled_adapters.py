"""Adapters: a TiledBlockSpec built from a known block's submodules.

demo_block_spec(block, x)             moepeak's demo decoder block (attribute names of
                                      moepeak's demo model Block: attn_norm, attn.{q,k,v,o}_proj,
                                      attn.rotary, attn.cp, mlp_norm, moe)
hf_moe_layer_spec(layer, x, ...)      a Hugging Face decoder layer of HF_TILED_LAYERS (Qwen3-MoE,
                                      Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3; MoE or dense): input_layernorm,
                                      self_attn (q/k/v/o_proj and optional q_norm/k_norm, or DeepSeek's
                                      latent attention), post_attention_layernorm, mlp (router at mlp.gate)
tiled_hf_layer_training_forward(...)  such a layer's training call as transformers runs it (gradient
                                      checkpointing, KV cache arguments), with its router logits and
                                      attention weights for transformers' output collector
titan_block_spec(block, x, ...)       a torchtitan (0.3) decoder block with GQAttention: attention_norm,
                                      attention.{qkv_linear, q_norm, k_norm, rope, inner_attention
                                      (SDPA), wo}, ffn_norm, moe or feed_forward (tested: qwen3); or
                                      deepseek_v3's latent attention (attention.{wq or wq_a, q_norm,
                                      wq_b, wkv_a, kv_norm, wkv_b, rope, inner_attention, wo})

Each runs exactly the ops of the block's own forward, in the same order, on a tile of
rows; only the split into pre_attn / attn_core / post_attn is new.
"""
from __future__ import annotations

import functools
import inspect

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

# The decoder layers hf_moe_layer_spec runs (transformers 5.17 to 5.25), by class name: (how the
# attention makes q, k, v: "mha" = q/k/v_proj, "mla" = DeepSeek's multi-head latent attention;
# what it passes as the interface's sliding_window: "attn" (self.sliding_window), "config"
# (getattr(config, "sliding_window", None)) or None (nothing: the mask alone carries a window)).
# Each of these layers hands every argument of its call to self_attn, and the attention takes
# hidden_states, position_embeddings, attention_mask and the KV cache by name and passes all
# the others (position_ids, use_cache, flash attention's cu_seq_lens_q/k and max_length_q/k, ...)
# on to the attention interface unchanged.
HF_TILED_LAYERS = {
    "Qwen3MoeDecoderLayer": ("mha", "attn"),
    "Qwen2MoeDecoderLayer": ("mha", None),
    "MixtralDecoderLayer": ("mha", "config"),
    "OlmoeDecoderLayer": ("mha", "config"),
    "DeepseekV3DecoderLayer": ("mla", None),
}
# The KV cache argument's names: `cache` (transformers >= 5.2x), `past_key_values` (5.17).
HF_CACHE_ARGUMENTS = ("cache", "past_key_values")


def hf_layer_arguments(layer: torch.nn.Module, args, kwargs) -> dict:
    """The arguments of layer(hidden_states, *args, **kwargs) after hidden_states, by name:
    positional ones placed by the layer class's own forward signature, its defaults filled in
    (the layer passes them on to self_attn), its **kwargs flattened."""
    signature = inspect.signature(type(layer).forward)
    bound = signature.bind(layer, None, *args, **kwargs)
    bound.apply_defaults()
    own = list(signature.parameters)[2:]  # after self, hidden_states
    arguments = {}
    for name in own:
        value, kind = bound.arguments.get(name), signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value or {})
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(f"moepeak: {type(layer).__name__} got {len(value)} unexpected positional arguments")
        else:
            arguments[name] = value
    return arguments


def _leave_cache_alone(arguments: dict, attn: torch.nn.Module, name: str) -> None:
    """Pops the KV cache argument. With grad (training) an empty cache, which transformers makes
    itself when config.use_cache is True and checkpointing is off, is not written: the loss and
    gradients are those of the stock layer, which would also store this layer's full-length k, v
    in it until the step ends (memory the tiles exist to save; a training step never reads them
    back). A cache holding tokens of this layer, or any cache under no_grad (generation), is
    refused: the tiled layer neither reads nor fills it."""
    for key in HF_CACHE_ARGUMENTS:
        cache = arguments.pop(key, None)
        if cache is None:
            continue
        if not torch.is_grad_enabled():
            raise ValueError(f"moepeak: a tiled {name} does not fill a KV cache ({key}={type(cache).__name__} "
                             "under no_grad); generation runs the layer's own forward (apply_moepeak does so in "
                             "eval and under torch.no_grad())")
        held = getattr(cache, "get_seq_length", None)
        held = held(attn.layer_idx) if callable(held) else None
        if held != 0:
            what = f"{held} cached tokens" if held is not None else f"a {type(cache).__name__}"
            raise ValueError(f"moepeak: a tiled {name} in training cannot attend to {what} of layer "
                             f"{attn.layer_idx} ({key}): it takes no keys/values of earlier tokens; pass {key}=None "
                             "to train, or generate under torch.no_grad() or model.eval() (the layer's own forward)")


def hf_moe_layer_spec(layer: torch.nn.Module, x: torch.Tensor, *args, return_router_logits=False,
                      attention_weights=None, **kwargs) -> TiledBlockSpec:
    """Spec for a Hugging Face pre-norm MoE decoder layer (a class of HF_TILED_LAYERS) called as
    layer(x, *args, **kwargs): the same arguments, placed by the layer's own signature. Every
    argument but attention_mask, position_embeddings and the KV cache reaches the attention
    interface unchanged, as in the layer's own forward (position_ids and cu_seq_lens_q/k of packed
    sequences: flash attention's document boundaries); the KV cache: see _leave_cache_alone.
    Submodules read: input_layernorm; self_attn
    with q/k/v/o_proj, head_dim, scaling and, when present, q_norm / k_norm, per head (Qwen3-MoE)
    or over the whole projection (OLMoE, which also clamps q, k, v to config.clip_qkv); for
    DeepSeek-V3 its latent-attention projections (q_a/q_b or q_proj, kv_a_proj_with_mqa, the two
    latent norms, kv_b_proj through its expand_kv) and rotary variant;
    post_attention_layernorm; mlp (the MoE block or, in a dense layer, the MLP) with, in an MoE
    layer, its router mlp.gate (returns (router_logits, weights, indices), as transformers'
    *TopKRouter does). RoPE, the eager
    attention fallback: the layer's own modeling module (apply_rotary_pos_emb,
    eager_attention_forward). x [B, T, H]; position_embeddings (cos, sin) [B, T, d]; q/k/v
    [B, heads, T, d]; out [B, T, heads, d] (the attention interface's layout).

    return_router_logits: post_attn also returns the tile's router logits [B, t, E] (spec.extras
    = 1): tiled_block then gives (y, logits [B, T, E]), and a loss over all tokens' logits (the
    router aux loss) backpropagates through the tiled recompute.
    attention_weights: a list, or None; a list receives the attention weights the interface
    returns for each head group in the forward (the first head-group calls of the core; the
    backward's recompute adds nothing): [B, heads of the group, T, T] from the eager interface,
    None from sdpa or flash attention."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = type(layer).__name__
    if name not in HF_TILED_LAYERS:
        raise ValueError(f"moepeak: no tiled adapter for {name} (tiled: {', '.join(HF_TILED_LAYERS)})")
    attn, mlp = layer.self_attn, layer.mlp
    modeling = sys.modules[type(attn).__module__]
    core_kwargs = hf_layer_arguments(layer, args, kwargs)
    attention_mask = core_kwargs.pop("attention_mask", None)
    position_embeddings = core_kwargs.pop("position_embeddings", None)
    _leave_cache_alone(core_kwargs, attn, name)
    if position_embeddings is None:
        raise ValueError(f"moepeak: a tiled {name} needs position_embeddings (cos, sin) [B, T, head_dim], "
                         "as the model passes them")
    dropout = attn.attention_dropout if attn.training else 0.0
    if dropout and torch.is_grad_enabled():
        raise ValueError(f"moepeak: a tiled {name} cannot use attention dropout ({dropout}): its core runs per "
                         "head group, so its masks would not be the untiled layer's; set config.attention_dropout = 0")
    jitter = getattr(mlp, "jitter_noise", 0.0) if mlp.training else 0.0
    if jitter and torch.is_grad_enabled():
        raise ValueError(f"moepeak: a tiled {name} cannot use router jitter noise ({jitter}): the tiles draw it "
                         "tile by tile, not as the untiled layer does; set config.router_jitter_noise = 0")
    router = getattr(mlp, "gate", None)
    if return_router_logits and not isinstance(router, torch.nn.Module):
        raise ValueError(f"moepeak: a tiled {name} returns router logits only with a router module at mlp.gate")
    projections, window = HF_TILED_LAYERS[name]
    if window is not None:
        core_kwargs["sliding_window"] = attn.sliding_window if window == "attn" else \
            getattr(attn.config, "sliding_window", None)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    B, hd = x.shape[0], getattr(attn, "head_dim", None)
    per_head_norm = q_norm is not None and q_norm.weight.numel() == hd
    clip = getattr(attn.config, "clip_qkv", None)
    head_groups = attn.config.num_key_value_heads
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
        out, weights = interface(attn, q, k, v, attention_mask, dropout=dropout, scaling=attn.scaling, **core_kwargs)
        if attention_weights is not None and len(attention_weights) < head_groups:
            attention_weights.append(weights)  # the forward's calls, one per head group, come first
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
                          seq_dim=1, qkv_seq_dim=2, out_seq_dim=1, head_groups=head_groups,
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


def tiled_hf_layer_training_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, *args, tile_tokens: int,
                                    router_logits: bool = False, attention_weights: bool = False, **kwargs):
    """layer(hidden_states, *args, **kwargs) in training, sequence-tiled, run the way transformers'
    GradientCheckpointingLayer runs the layer's own forward: with layer.gradient_checkpointing on,
    under layer._gradient_checkpointing_func (SCO under apply_moepeak; the tiled block is then
    replayed only up to its boundary), use_cache=False and the cache dropped as transformers sets
    them. transformers 5.17 checkpoints in GradientCheckpointingLayer.__call__, which then wraps
    this call already; later versions checkpoint in the class's forward, which a layer patched
    with this call no longer runs, so it is done here.

    Returns (y, router logits, attention weights). router_logits: the full-length logits [B*T, E]
    with their gradient path, None in a dense layer (no router at mlp.gate) or when not asked.
    attention_weights: [B, heads, T, T] from the eager interface (None from sdpa or flash, as the
    untiled layer gives), values of the forward without a gradient path: a backward that reaches
    them raises."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    with_logits = router_logits and isinstance(getattr(layer.mlp, "gate", None), torch.nn.Module)
    weights = [] if attention_weights else None
    run = functools.partial(tiled_hf_moe_layer_forward, layer, tile_tokens=tile_tokens,
                            return_router_logits=with_logits, attention_weights=weights)
    if getattr(layer, "gradient_checkpointing", False) and "__call__" not in vars(GradientCheckpointingLayer):
        kwargs = dict(kwargs)
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not getattr(layer, "_can_checkpoint_with_cache", False):
            for key in HF_CACHE_ARGUMENTS + ("layer_past",):
                if kwargs.get(key) is not None:
                    kwargs[key] = None
        out = layer._gradient_checkpointing_func(functools.partial(run, **kwargs), hidden_states, *args)
    else:
        out = run(hidden_states, *args, **kwargs)
    y, logits = out if with_logits else (out, None)
    maps = None
    if weights and all(w is not None for w in weights):
        maps = _WithoutGradient.apply(torch.cat(weights, dim=1), y)
    return y, logits, maps


class _WithoutGradient(torch.autograd.Function):
    """maps, in the graph of y only so that a backward reaching them raises instead of giving
    gradients without their share (the tiled forward keeps no graph of the attention weights)."""

    @staticmethod
    def forward(ctx, maps, y):
        return maps.detach()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("moepeak: the attention weights of a tiled decoder layer (output_attentions=True) have "
                           "no gradient path; a loss on them needs the untiled layer (tile_tokens=None)")


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
