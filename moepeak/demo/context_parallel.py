"""Context parallelism for the demo model: one sequence sharded over the ranks
of a group, exact attention by all-gathering K and V.

Layout (P ranks, one sequence of T tokens, S = T / P):
    rank r holds tokens [r*S, (r+1)*S) of every sequence in the batch:
        input_ids, labels, hidden states   [B, S(, H)]   (cp_slice)
    RoPE positions are global: r*S .. (r+1)*S - 1 (Rotary.tables(offset=r*S)).
    Attention on rank r: queries [B, nh, S, d] attend to the keys of ranks 0..r,
        K, V [B, nkv, (r+1)*S, d], with the causal mask aligned to the lower right
        (local query i sees keys 0 .. r*S + i): exactly the rows r*S..(r+1)*S-1 of
        the full sequence's causal attention. Keys of ranks > r are in the future
        and are dropped right after the gather.
    Everything else (MoE, the vocabulary head, checkpointing) works on the local
    S tokens unchanged.

Communication per attention layer: one all-gather of K and V packed together,
    kv: [S, 2, B, nkv, d] -> [P*S, 2, B, nkv, d]   (seq-major, so the gather is along dim 0)
and in backward its adjoint, one reduce-scatter (sum) of d(kv) back to [S, ...]
(the gradient every rank's queries sent to this rank's keys). With GQA the
packet is small: T=1M, nkv=2, d=128, bf16 -> 2*2*128*2 B = 1 KiB per token,
1 GiB for the whole gathered K and V of one layer.

Load balance: the contiguous split gives rank r a share (2r+1)/P^2 of the causal
attention work (P=2: 1/4 vs 3/4 of the pairs); the last rank sets the pace of
attention-bound steps. A zig-zag split would balance it; not done here.

The loss: each rank computes the sum of its slice's token losses; MoELM scales
it by P / (valid tokens of the whole sequence), so that the mean over ranks
(what FSDP2's gradient average and the demo's loss average compute) is the
full sequence's mean loss, also when ignored labels are spread unevenly.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F


def cp_slice(t: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of `t` along `dim` (the sequence dim; it
    must be divisible by `world`)."""
    T = t.shape[dim]
    if T % world:
        raise ValueError(f"moepeak: context parallelism needs the sequence length ({T}) divisible by "
                         f"the number of ranks ({world})")
    S = T // world
    return t.narrow(dim, rank * S, S).contiguous()


# Newer torch renames the two dim-0 collectives (same arguments); older has only the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather0(x: torch.Tensor, group, world: int) -> torch.Tensor:
    out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
    _ALL_GATHER(out, x, group=group)
    return out


def _reduce_scatter0(g: torch.Tensor, group, world: int, rank: int) -> torch.Tensor:
    S = g.shape[0] // world
    out = g.new_empty((S,) + tuple(g.shape[1:]))
    try:
        _REDUCE_SCATTER(out, g, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError:  # a backend without reduce-scatter (older gloo): all-reduce, keep ours
        g = g.clone()
        dist.all_reduce(g, group=group)
        out.copy_(g[rank * S:(rank + 1) * S])
    return out


class _GatherSeq(torch.autograd.Function):
    """[S, ...] on each rank -> [P*S, ...] (rank order) on every rank.
    Backward: reduce-scatter (sum) of the [P*S, ...] gradient."""

    @staticmethod
    def forward(ctx, x, group, world, rank):
        ctx.group, ctx.world, ctx.rank = group, world, rank
        return _all_gather0(x.contiguous(), group, world)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter0(g.contiguous(), ctx.group, ctx.world, ctx.rank), None, None, None


def gather_seq(x: torch.Tensor, group, world: int, rank: int) -> torch.Tensor:
    return _GatherSeq.apply(x, group, world, rank)


def gather_kv(k: torch.Tensor, v: torch.Tensor, group, world: int, rank: int
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """k, v: [B, nkv, S, d] (RoPE applied at global positions) -> the keys and values
    of ranks 0..rank, each [B, nkv, (rank+1)*S, d], in one all-gather."""
    S = k.shape[2]
    kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4)            # [S, 2, B, nkv, d]
    kv = gather_seq(kv, group, world, rank)[:(rank + 1) * S]    # [(rank+1)*S, 2, B, nkv, d]
    kv = kv.permute(1, 2, 3, 0, 4)                              # [2, B, nkv, (rank+1)*S, d]
    return kv[0], kv[1]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, nh, Tq, d], k/v [B, nh, Tk, d] with Tk >= Tq: the last Tq rows of causal
    attention over Tk keys (mask aligned to the lower right). Tq == Tk is plain
    causal attention. On CUDA torch's CausalBias dispatches the lower-right case to
    the flash or memory-efficient kernel (O(T) memory); elsewhere it materialises the
    [Tq, Tk] mask (CPU tests)."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    if Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if Tk < Tq:
        raise ValueError(f"moepeak: causal_attention needs at least as many keys as queries, got "
                         f"{Tk} keys for {Tq} queries")
    from torch.nn.attention.bias import causal_lower_right
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Tq, Tk))
