"""The demo model's decoder block (moepeak/demo/models.py's Block: attn_norm,
attn.{q,k,v,o}_proj, attn.rotary, attn.cp, mlp_norm, moe) as a moepeak.tiled
TiledBlockSpec: demo_block_spec(block, x). It runs exactly the ops of the block's own
forward, in the same order, on a tile of rows; only the split into pre_attn / attn_core /
post_attn is new.
"""
from __future__ import annotations

import torch

from ..tiled import TiledBlockSpec, requires_grad_params


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

    return TiledBlockSpec(pre_attn, attn_core, post_attn, requires_grad_params(block),
                          seq_dim=1, qkv_seq_dim=2, out_seq_dim=2, head_groups=nkv, qkv_head_dim=1,
                          out_head_dim=1)
