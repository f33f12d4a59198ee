"""A torchtitan (0.3) decoder block as a moepeak.tiled TiledBlockSpec, and the override
that runs every block of a job tiled (moepeak.titan.sco's {"tile_tokens": N}).

titan_block_spec(block, x, ...)   a block with GQAttention: attention_norm, attention.{qkv_linear,
                                  q_norm, k_norm, rope, inner_attention (SDPA), wo}, ffn_norm,
                                  moe or feed_forward (tested: qwen3); or deepseek_v3's latent
                                  attention (attention.{wq or wq_a, q_norm, wq_b, wkv_a, kv_norm,
                                  wkv_b, rope, inner_attention, wo})
tiled_titan_block_forward(...)    a drop-in for such a block's forward
tile_block(block, index, tokens)  block.forward runs tiled in training with grad
install_tile_switch(block)        the same, with the tile read at each call (None: untiled):
                                  the automatic placement sets it after SCO wrapped the block

The spec runs exactly the ops of the block's own forward, in the same order, on a tile of
rows; only the split into pre_attn / attn_core / post_attn is new.
"""
from __future__ import annotations

import torch

from ..tiled import TiledBlockSpec, requires_grad_params, tiled_block
from ..tiled.sizes import FREE


def titan_block_spec(block: torch.nn.Module, x: torch.Tensor, attention_masks=None,
                     positions=None, head_group_budget=None) -> TiledBlockSpec:
    """Spec for a torchtitan decoder block called as block(x, attention_masks, positions):
    x [B, T, D] plain (not DTensor: no tensor/sequence parallel); the attention's inner
    attention is torchtitan's ScaledDotProductAttention (causal, no masks). q/k/v: [B, T,
    heads, head_dim] as qkv_linear makes them (q heads kv-major, so head groups of GQA), or
    as deepseek_v3's Attention makes them (q, k: nope + rope head dims, v: v_head_dim);
    out: [B, T, heads, head_dim]. RoPE at a tile's positions: positions[:, start:start + t],
    or start .. start + t - 1 when the model passes none (the rows of the prefix table the
    untiled block reads). Head groups: the fewest (dividing the kv heads; MLA: the heads) whose
    full-length set fits head_group_budget (moepeak/tiled/sizes.py; FREE: a share of the GPU
    memory free at the forward, in a single process only: under torchtitan's context parallel
    the core is ring attention, whose collectives need the same calls on every rank, and free
    memory differs by rank; None, the default: one group per kv head). The SDPA backend is torchtitan's:
    ScaledDotProductAttention runs its own sdpa_kernel(cuDNN > flash > math, set_priority=True)
    inside the core, so the spec sets no order of its own (attention_backend=None)."""
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
    if head_group_budget == FREE and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        head_group_budget = None

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

    return TiledBlockSpec(pre_attn, attn_core, post_attn, requires_grad_params(block),
                          seq_dim=1, qkv_seq_dim=1, out_seq_dim=1, head_groups=attn.n_heads if mla else attn.n_kv_heads,
                          qkv_head_dim=2, out_head_dim=2, head_group_budget=head_group_budget, attention_backend=None)


def tiled_titan_block_forward(block: torch.nn.Module, x: torch.Tensor, attention_masks=None, positions=None, *,
                              tile_tokens: int) -> torch.Tensor:
    """Drop-in for a torchtitan decoder block's forward (same arguments, plus tile_tokens;
    see titan_block_spec)."""
    return tiled_block(x, titan_block_spec(block, x, attention_masks, positions), tile_tokens)


def check_tileable(block: torch.nn.Module, index: int) -> None:
    """ValueError unless layers.<index> can run tiled: GQAttention or deepseek_v3's latent
    Attention, with torchtitan's ScaledDotProductAttention."""
    from torchtitan.models.common.attention import GQAttention, ScaledDotProductAttention

    try:
        from torchtitan.models.deepseek_v3.model import Attention as LatentAttention
    except ImportError:  # a torchtitan without deepseek_v3
        LatentAttention = GQAttention
    attn = getattr(block, "attention", None)
    known = isinstance(attn, (GQAttention, LatentAttention))
    if not known or not isinstance(attn.inner_attention, ScaledDotProductAttention):
        what = type(attn).__name__ if not known else f"{type(attn).__name__} with {type(attn.inner_attention).__name__}"
        raise ValueError(f"moepeak.titan.sco: tile_tokens tiles blocks whose attention is GQAttention or deepseek_v3's "
                         f"latent Attention, with torchtitan's ScaledDotProductAttention; layers.{index} has {what}")


def install_tile_switch(block: torch.nn.Module) -> None:
    """block.forward runs tiled_titan_block_forward with block._moepeak_tile_tokens tokens per
    tile in training with grad enabled (inside FSDP2's hooks, which wrap __call__), else the
    stock forward; the tile is read at each call (None: untiled), so it can be set after SCO
    wrapped the block. Idempotent."""
    if hasattr(block, "_moepeak_tile_tokens"):
        return
    block._moepeak_tile_tokens = None
    untiled = block.forward

    def forward(x, attention_masks=None, positions=None, _block=block, _untiled=untiled):
        tile = _block._moepeak_tile_tokens
        if tile is None or not (_block.training and torch.is_grad_enabled()):
            return _untiled(x, attention_masks, positions)
        return tiled_titan_block_forward(_block, x, attention_masks, positions, tile_tokens=tile)
    block.forward = forward


def tile_block(block: torch.nn.Module, index: int, tile_tokens: int) -> None:
    """block.forward runs tiled_titan_block_forward (tile_tokens per tile) in training with
    grad enabled, else the stock forward (install_tile_switch); ValueError for a block that
    cannot be tiled (check_tileable)."""
    check_tileable(block, index)
    install_tile_switch(block)
    block._moepeak_tile_tokens = tile_tokens
