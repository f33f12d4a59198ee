"""Sequence-tiled Hugging Face decoder layers (apply_moepeak(..., tile_tokens=N)): a layer as
a moepeak.tiled TiledBlockSpec, its training call as transformers runs it, and the patch
that makes every supported layer of a model run tiled.

hf_moe_layer_spec(layer, x, ...)      a decoder layer of HF_TILED_LAYERS (Qwen3-MoE, Qwen2-MoE,
                                      Mixtral, OLMoE, DeepSeek-V3; MoE or dense): input_layernorm,
                                      self_attn (q/k/v/o_proj and optional q_norm/k_norm, or
                                      DeepSeek's latent attention), post_attention_layernorm, mlp
                                      (router at mlp.gate)
tiled_hf_layer_training_forward(...)  such a layer's training call as transformers runs it
                                      (gradient checkpointing, KV cache arguments), with its router
                                      logits and attention weights for transformers' output collector
patch_tiled_layers(model, ...)        every such layer of the model runs tiled in training with grad

The spec runs exactly the ops of the layer's own forward, in the same order, on a tile of
rows; only the split into pre_attn / attn_core / post_attn is new.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch

from ..tiled import (DEFAULT_ATTENTION_BACKEND, TiledBlockSpec, attention_backend_context, requires_grad_params,
                     tiled_block)
from ..tiled.sizes import FREE, FREE_MEMORY_SHARE
from .sequence import crosses_heads


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
TILED_LAYERS = tuple(HF_TILED_LAYERS)  # the class names apply_moepeak(tile_tokens=...) tiles
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


def _attention_pre_hooks(attn: torch.nn.Module, arguments: dict, name: str) -> dict:
    """The keyword arguments the layer passes self_attn (all but hidden_states, which the tiled
    layer makes tile by tile), after self_attn's keyword forward pre-hooks (those registered
    with with_kwargs=True: how an engine rewrites the attention's arguments, e.g. accelerate's
    context-parallel hook, which drops the mask and sets is_causal=True). The layer calls
    self_attn with keywords only, so the hooks get no positional arguments and must return none."""
    hooks = [(hook_id, hook) for hook_id, hook in attn._forward_pre_hooks.items()
             if hook_id in attn._forward_pre_hooks_with_kwargs]
    for _, hook in hooks:
        result = hook(attn, (), arguments)
        if result is None:
            continue
        args, arguments = result
        if args:
            raise ValueError(f"moepeak: a forward pre-hook of {name}.self_attn returned {len(args)} positional "
                             "arguments; the tiled layer passes the attention's arguments by keyword only")
    return arguments


def attention_head_groups(attn: torch.nn.Module, interface, forced: Optional[int], name: str, budget=None):
    """(head_groups, head_group_budget) of the tiled layer's spec: forced, or 1 when the function
    crosses ranks by heads (DeepSpeed Ulysses checks it receives every head), with no budget; else
    num_key_value_heads groups (each group's backward frees its tensors before the next runs) and
    `budget`, with which the tiled block runs fewer, larger groups where their full-length set
    fits (moepeak/tiled/sizes.py; FREE: a share of the GPU memory free at the forward)."""
    if crosses_heads(interface):
        if forced not in (None, 1):
            raise ValueError(f"moepeak: attention_head_groups={forced}, but the attention function of {name} "
                             f"({attn.config._attn_implementation!r}, from {interface.__module__}) exchanges heads "
                             "across ranks and needs every head in one call; pass attention_head_groups=1 or None")
        return 1, None
    if forced is not None:
        return forced, None
    return attn.config.num_key_value_heads, budget


def hf_moe_layer_spec(layer: torch.nn.Module, x: torch.Tensor, *args, return_router_logits=False,
                      attention_weights=None, head_groups: Optional[int] = None, head_group_budget=None,
                      attention_backend: Optional[str] = DEFAULT_ATTENTION_BACKEND, **kwargs) -> TiledBlockSpec:
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
    None from sdpa or flash attention.
    head_groups: the attention's head groups (attention_head_groups: None picks 1 for an
    attention function that crosses ranks by heads, else num_key_value_heads or, with
    head_group_budget (bytes, FREE or None), the fewest groups whose full-length set fits it).
    attention_backend: the SDPA backends the attention function's calls run on
    (moepeak.tiled.ATTENTION_BACKENDS; None: torch's own choice; "auto" with attention_mask:
    torch's own), entered by the core itself (the spec's own attention_backend is None).
    self_attn's keyword forward pre-hooks run on the attention's keyword arguments first
    (_attention_pre_hooks), as they would when the layer calls self_attn."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = type(layer).__name__
    if name not in HF_TILED_LAYERS:
        raise ValueError(f"moepeak: no tiled adapter for {name} (tiled: {', '.join(HF_TILED_LAYERS)})")
    attn, mlp = layer.self_attn, layer.mlp
    modeling = sys.modules[type(attn).__module__]
    core_kwargs = _attention_pre_hooks(attn, hf_layer_arguments(layer, args, kwargs), name)
    attention_mask = core_kwargs.pop("attention_mask", None)
    position_embeddings = core_kwargs.pop("position_embeddings", None)
    _leave_cache_alone(core_kwargs, attn, name)
    if position_embeddings is None:
        raise ValueError(f"moepeak: a tiled {name} needs position_embeddings (cos, sin) [B, T, head_dim], "
                         "as the model passes them")
    dropout = _refuse_random_draws(attn, mlp, name)
    router = getattr(mlp, "gate", None)
    if return_router_logits and not isinstance(router, torch.nn.Module):
        raise ValueError(f"moepeak: a tiled {name} returns router logits only with a router module at mlp.gate")
    projections, window = HF_TILED_LAYERS[name]
    if window is not None:
        core_kwargs["sliding_window"] = attn.sliding_window if window == "attn" else \
            getattr(attn.config, "sliding_window", None)
    B = x.shape[0]
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                      modeling.eager_attention_forward)
    head_groups, head_group_budget = attention_head_groups(attn, interface, head_groups, name, head_group_budget)
    make_pre_attn = _mla_pre_attn if projections == "mla" else _mha_pre_attn
    pre_attn = make_pre_attn(layer, modeling, B, position_embeddings)

    def attn_core(q, k, v):
        # the backend order here, not through the spec: "auto" reads whether the call passes a mask
        with attention_backend_context(attention_backend, q.device, q.dtype, masked=attention_mask is not None):
            out, weights = interface(attn, q, k, v, attention_mask, dropout=dropout, scaling=attn.scaling,
                                     **core_kwargs)
        if attention_weights is not None and len(attention_weights) < head_groups:
            attention_weights.append(weights)  # the forward's calls, one per head group, come first
        return out

    post_attn = _post_attn(layer, router, B, name, return_router_logits)

    return TiledBlockSpec(pre_attn, attn_core, post_attn, requires_grad_params(layer),
                          seq_dim=1, qkv_seq_dim=2, out_seq_dim=1, head_groups=head_groups,
                          qkv_head_dim=1, out_head_dim=2, extras=1 if return_router_logits else 0,
                          head_group_budget=head_group_budget, attention_backend=None)


def _refuse_random_draws(attn: torch.nn.Module, mlp: torch.nn.Module, name: str) -> float:
    """The attention's dropout probability (0.0 out of training). Attention dropout and router
    jitter noise are refused with grad: the tiles would draw them per head group and tile by
    tile, so their masks and noise would not be the untiled layer's."""
    dropout = attn.attention_dropout if attn.training else 0.0
    if dropout and torch.is_grad_enabled():
        raise ValueError(f"moepeak: a tiled {name} cannot use attention dropout ({dropout}): its core runs per "
                         "head group, so its masks would not be the untiled layer's; set config.attention_dropout = 0")
    jitter = getattr(mlp, "jitter_noise", 0.0) if mlp.training else 0.0
    if jitter and torch.is_grad_enabled():
        raise ValueError(f"moepeak: a tiled {name} cannot use router jitter noise ({jitter}): the tiles draw it "
                         "tile by tile, not as the untiled layer does; set config.router_jitter_noise = 0")
    return dropout


def _mha_pre_attn(layer: torch.nn.Module, modeling, B: int, position_embeddings):
    """pre_attn(x_t, start) of a q/k/v_proj attention: the layer's ops before the attention
    interface on the tile of rows start .. start+t-1, giving q, k, v [B, heads, t, head_dim].
    q_norm / k_norm over the whole projection (OLMoE) act before clip_qkv and the head split;
    per head (Qwen3-MoE, weight of head_dim elements) after the split, before RoPE."""
    attn = layer.self_attn
    cos, sin = position_embeddings
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    hd = getattr(attn, "head_dim", None)
    per_head_norm = q_norm is not None and q_norm.weight.numel() == hd
    clip = getattr(attn.config, "clip_qkv", None)

    def pre_attn(x_t, start):
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

    return pre_attn


def _mla_pre_attn(layer: torch.nn.Module, modeling, B: int, position_embeddings):
    """pre_attn(x_t, start) of DeepSeek-V3's latent attention: DeepseekV3Attention.forward's ops
    before the attention interface on the tile of rows start .. start+t-1 (q through q_proj or
    the q_a/q_b low-rank pair; one latent k/v row per token, expanded by attn.expand_kv)."""
    attn = layer.self_attn
    cos, sin = position_embeddings

    def pre_attn(x_t, start):
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

    return pre_attn


def _post_attn(layer: torch.nn.Module, router, B: int, name: str, return_router_logits: bool):
    """post_attn(x_t, o_t) on a tile: o_proj, the residual, post_attention_layernorm, mlp and its
    residual; with return_router_logits also the tile's router logits [B, t, E], caught by a
    forward hook on the router (mlp.gate) that must see exactly one call per tile."""
    attn, mlp = layer.self_attn, layer.mlp

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

    return post_attn


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
                                    router_logits: bool = False, attention_weights: bool = False,
                                    head_groups: Optional[int] = None, head_group_budget=None,
                                    attention_backend: Optional[str] = DEFAULT_ATTENTION_BACKEND, **kwargs):
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
                            return_router_logits=with_logits, attention_weights=weights, head_groups=head_groups,
                            head_group_budget=head_group_budget, attention_backend=attention_backend)
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


def patch_tiled_layers(model, tile_tokens, report, head_groups: Optional[int] = None, head_group_budget=None,
                       attention_backend: Optional[str] = DEFAULT_ATTENTION_BACKEND):
    """Every layer of TILED_LAYERS runs tiled_hf_layer_training_forward in training with grad
    (head_groups, head_group_budget, attention_backend: hf_moe_layer_spec's)."""
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"moepeak.hf: tile_tokens must be a positive integer or None, got {tile_tokens!r}")
    layers = [m for m in model.modules() if type(m).__name__ in TILED_LAYERS]
    if not layers:
        kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("DecoderLayer")})
        report.left_alone.append(f"tile_tokens: no decoder layer the tiled adapter runs ({', '.join(TILED_LAYERS)}); "
                                 f"{', '.join(kinds) or 'no decoder layers'} stay untiled")
        return
    output_collector()  # the hand-off below needs it: refuse now, not mid-training
    for layer in layers:
        untiled = layer.forward

        def forward(hidden_states, *args, _layer=layer, _untiled=untiled, **kwargs):
            if not (_layer.training and torch.is_grad_enabled()):
                return _untiled(hidden_states, *args, **kwargs)
            collected = output_collector().get() or {}
            logits_out, maps_out = collected.get("router_logits"), collected.get("attentions")
            first = None if logits_out is None else len(logits_out)
            y, logits, maps = tiled_hf_layer_training_forward(
                _layer, hidden_states, *args, tile_tokens=tile_tokens, router_logits=logits_out is not None,
                attention_weights=maps_out is not None, head_groups=head_groups, head_group_budget=head_group_budget,
                attention_backend=attention_backend, **kwargs)
            if logits_out is not None:
                # transformers' hook on the router recorded one graph-less entry per tile (none in
                # a dense layer); the layer's one entry is the full-length logits with their graph
                recorded = len(logits_out) - first
                del logits_out[first:]
                if recorded and logits is None:
                    raise RuntimeError(f"moepeak.hf: {type(_layer).__name__}'s router logits were recorded but "
                                       "its mlp has no router at mlp.gate")
                if recorded:
                    logits_out.append(logits)
            if maps is not None:
                maps_out.append(maps)
            return y
        layer.forward = forward
    groups = f"attention_head_groups={head_groups}" if head_groups is not None else \
        f"the fewest head groups whose full-length set fits {FREE_MEMORY_SHARE:.0%} of the free GPU memory" \
        if head_group_budget == FREE else f"the fewest head groups that fit {head_group_budget} bytes" \
        if head_group_budget is not None else "num_key_value_heads head groups"
    report.patched.append(f"tile_tokens: {len(layers)} decoder layers run "
                          "moepeak.hf.tiled.tiled_hf_layer_training_forward "
                          f"in training (tiles of {tile_tokens} tokens; attention in {groups}, one head group "
                          "under an attention function that exchanges heads across ranks)")


def output_collector():
    """transformers' context variable holding the outputs being collected in this forward
    ({"router_logits": [...], "attentions": [...], ...} or None): where an untiled router's
    logits and attention's weights go."""
    try:
        from transformers.utils import output_capturing
        return output_capturing._active_collector
    except (ImportError, AttributeError) as e:
        raise RuntimeError("moepeak.hf: tile_tokens needs transformers' output collector "
                           "(transformers.utils.output_capturing._active_collector, transformers 5.17) to hand the "
                           "router logits to the aux loss; this transformers has none") from e
