"""The model zoo: a small Mixture-of-Experts decoder LM in plain PyTorch, with a
switch per moepeak schedule.

    embed -> L x [ x + Attn(RMSNorm(x)) ; x + MoE(RMSNorm(x)) ] -> RMSNorm -> head+CE

(the RMSNorms run moepeak.norms.rms_norm, unless lean_norm=False: the final one with the Ring-DTP
head, the blocks' with SCO checkpointing)

Every switch changes only the schedule, never the parameters: the same
state_dict drives both settings, which is how the end-to-end test compares
moepeak with plain PyTorch.

    switch       moepeak                         plain PyTorch
    moe          "llep": PipelinedLLEPMoE        "dense": loop over experts
    head         "ring_dtp": RingDTPLinearCE     "plain": F.linear + F.cross_entropy
    checkpoint   "sco": sco_checkpoint           "torch": torch.utils.checkpoint, "none"
    optimizer    "stream": StreamAdamW           "torch": torch.optim.AdamW   (config.build_optimizer)

Context parallelism (MoEConfig.context_parallel, with a group of P > 1 ranks):
forward takes this rank's contiguous slice [B, T/P] of the sequences
(moepeak.demo.context_parallel.cp_slice); attention all-gathers K/V; the loss is scaled so
that its mean over the ranks is the full sequences' mean loss. Same parameters.

Parameter names and layouts (E_local = experts / expert-parallel ranks):
    embed.weight                    [V, H]
    layers.i.attn_norm.weight       [H]
    layers.i.attn.{q,k,v,o}_proj.weight  [nh*d, H], [nkv*d, H], [nkv*d, H], [H, nh*d]
    layers.i.mlp_norm.weight        [H]
    layers.i.moe.router.weight      [E, H]        (logits computed in fp32)
    layers.i.moe.w_gate_up          [E_local, H, 2I]   ([:I] gate, [I:] up)
    layers.i.moe.w_down             [E_local, I, H]
    norm.weight                     [H]
    head.weight                     [V, H]        (the vocab shard [V/P, H] under a ring group)
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_ckpt

from ..norms import rms_norm
from . import context_parallel as CP
from .config import MoEConfig, component

# scaled_dot_product_attention(..., enable_gqa=True): torch >= 2.5
SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
IGNORE_INDEX = -100  # labels that take no part in the loss (both heads' default)
# --------------------------------------------------------------------------- blocks

class RMSNorm(nn.Module):
    """(normalise(x.float()) * weight.float()).to(x.dtype). lean=True runs the same forward
    through moepeak.norms.rms_norm (bitwise; its backward saves x and an fp32 rstd only and
    works in row chunks instead of autograd's fp32 [T, H] tensors)."""

    def __init__(self, dim, eps=1e-6, device=None, dtype=None, lean=False):
        super().__init__()
        self.eps, self.lean = eps, lean
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        if self.lean:
            return rms_norm(x, self.weight, self.eps, multiply_in_fp32=True)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class Rotary:
    """cos/sin tables [T, d] (fp32), cached per (T, device); shared by all blocks
    and not a module argument, so checkpointing sees only the block input."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta = head_dim, theta
        self._cache: Dict[Tuple[int, str, int], Tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, T: int, device, offset: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Tables for positions offset .. offset+T-1 (offset: a context-parallel slice's start)."""
        key = (T, str(device), offset)
        if key not in self._cache:
            self._cache.clear()
            with torch.no_grad():
                inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=device,
                                                         dtype=torch.float32) / self.head_dim))
                pos = torch.arange(offset, offset + T, device=device, dtype=torch.float32)
                ang = torch.outer(pos, inv)
                ang = torch.cat([ang, ang], dim=-1)
                self._cache[key] = (ang.cos(), ang.sin())
        return self._cache[key]


def apply_rope(x, cos, sin):
    """x: [B, nh, T, d]; rotate_half convention."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    rot = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig, rotary: Rotary, device=None, dtype=None):
        super().__init__()
        H, d = cfg.hidden, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.heads, cfg.kv_heads, d
        kw = dict(bias=False, device=device, dtype=dtype)
        self.q_proj = nn.Linear(H, self.nh * d, **kw)
        self.k_proj = nn.Linear(H, self.nkv * d, **kw)
        self.v_proj = nn.Linear(H, self.nkv * d, **kw)
        self.o_proj = nn.Linear(self.nh * d, H, **kw)
        self.rotary = rotary
        self.cp = None  # (group, world, rank) under context parallelism (set by MoELM)

    def forward(self, x):
        B, T, _ = x.shape  # T: this rank's slice under context parallelism
        q = self.q_proj(x).view(B, T, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        offset = 0 if self.cp is None else self.cp[2] * T  # global position of the slice start
        cos, sin = self.rotary.tables(T, x.device, offset)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.attend(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.d))

    def attend(self, q, k, v):
        """The attention core: q [B, hq, T, d], k/v [B, hkv, T, d] (RoPE applied; hkv divides
        hq) -> [B, hq, T, d]. Heads are independent: q head i reads kv head i // (hq/hkv),
        so any split into head groups of whole kv heads gives the same rows."""
        if self.cp is not None:  # keys/values of ranks 0..r: [B, hkv, (r+1)*T, d]
            k, v = CP.gather_kv(k, v, *self.cp)
        r = q.shape[1] // k.shape[1]
        if r > 1 and SDPA_GQA and q.shape[2] == k.shape[2]:  # kv heads read in place (flash)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if r > 1:  # GQA by repetition (torch < 2.5, or the context-parallel lower-right mask)
            k = k.repeat_interleave(r, dim=1)
            v = v.repeat_interleave(r, dim=1)
        return CP.causal_attention(q, k, v)  # flash on GPU: O(T) memory


class DenseMoE(nn.Module):
    """Plain PyTorch MoE: same parameters and routing as PipelinedLLEPMoE, one
    gather + two GEMMs per expert, every intermediate materialised."""

    def __init__(self, hidden_size, intermediate_size, num_experts, top_k, *,
                 norm_topk_prob=True, device=None, dtype=None):
        super().__init__()
        H, I, E = hidden_size, intermediate_size, num_experts
        self.H, self.I, self.E, self.K, self.norm_topk_prob = H, I, E, top_k, norm_topk_prob
        self.router = nn.Linear(H, E, bias=False, device=device, dtype=dtype)
        self.w_gate_up = nn.Parameter(torch.empty(E, H, 2 * I, device=device, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(E, I, H, device=device, dtype=dtype))

    def route(self, x2):
        acc = torch.promote_types(x2.dtype, torch.float32)
        with torch.autocast(x2.device.type, enabled=False):                # fp32 even under autocast
            logits = F.linear(x2.to(acc), self.router.weight.to(acc))      # [N, E] fp32 (fp64 in)
        probs = logits.softmax(-1)
        w, ids = probs.topk(self.K, dim=-1)                                 # [N, K]
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return logits, w, ids

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, self.H)
        logits, w, ids = self.route(x2)
        acc = logits.dtype
        y = torch.zeros(x2.shape, device=x.device, dtype=acc)               # [N, H] accumulator
        for e in range(self.E):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            h = x2[tok] @ self.w_gate_up[e]                                  # [n, 2I]
            a = F.silu(h[:, :self.I]) * h[:, self.I:]
            out = (a @ self.w_down[e]).to(acc) * w[tok, slot, None]
            y = y.index_add(0, tok, out)
        return y.to(x.dtype).view(shape), logits


class PlainLMHead(nn.Module):
    """lm_head + cross-entropy on the full [N, V] fp32 logits."""

    def __init__(self, hidden_size, vocab_size, *, ignore_index=-100, reduction="mean", device=None,
                 dtype=None):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, device=device, dtype=dtype))

    def forward(self, hidden, labels):
        logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), self.weight).float()
        return F.cross_entropy(logits, labels.reshape(-1), ignore_index=self.ignore_index,
                               reduction=self.reduction)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, rotary: Rotary, group=None, device=None, dtype=None):
        super().__init__()
        lean = cfg.lean_norm and cfg.checkpoint == "sco"  # what the recompute saves: x and rstd only
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, device, dtype, lean=lean)
        self.attn = Attention(cfg, rotary, device, dtype)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, device, dtype, lean=lean)
        if cfg.moe == "llep":
            kw = {} if cfg.chunk_rows is None else {"chunk_rows": cfg.chunk_rows}
            self.moe = component("moe")(cfg.hidden, cfg.intermediate, cfg.experts, cfg.top_k,
                                        group=group, norm_topk_prob=cfg.norm_topk_prob,
                                        device=device, dtype=dtype, **kw)
        else:
            self.moe = DenseMoE(cfg.hidden, cfg.intermediate, cfg.experts, cfg.top_k,
                                norm_topk_prob=cfg.norm_topk_prob, device=device, dtype=dtype)
        self.tile_tokens = cfg.tile_tokens

    def forward(self, x):
        # Tiled inside forward (not around the call), so that module hooks such as
        # FSDP2's unshard/reshard run around the tiled block as around the plain one.
        if self.tile_tokens is not None:
            from ..tiled import tiled_block
            from .tiled import demo_block_spec
            return tiled_block(x, demo_block_spec(self, x), self.tile_tokens)
        x = x + self.attn(self.attn_norm(x))
        y, _ = self.moe(self.mlp_norm(x))
        return x + y


class MoELM(nn.Module):
    """forward(input_ids [B, T] int64, labels [B, T] int64, -100 = ignore) -> mean loss."""

    def __init__(self, cfg: MoEConfig, *, group=None, world_size: int = 1, device=None,
                 dtype=torch.float32, seed: int = 0):
        super().__init__()
        cfg.validate(world_size=world_size)
        self.cfg, self.group = cfg, group
        self.rank, self.world = 0, 1
        if group is not None and torch.distributed.is_initialized():
            self.rank = torch.distributed.get_rank(group)
            self.world = torch.distributed.get_world_size(group)
        # context parallel: inputs are this rank's slice (cp_slice); the head returns the
        # slice's loss sum, which forward() scales to the full sequence's mean
        self.cp = cfg.context_parallel and self.world > 1
        red = "sum" if self.cp else "mean"
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden, device=device, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, self.rotary, group, device, dtype)
                                    for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, device, dtype,
                            lean=cfg.lean_norm and cfg.head == "ring_dtp")
        if cfg.head == "ring_dtp":
            kw = {k: getattr(cfg, k) for k in ("chunk_tokens", "chunk_vocab") if getattr(cfg, k)}
            self.head = component("head")(cfg.hidden, cfg.vocab_size, group=group, reduction=red,
                                          device=device, dtype=dtype, **kw)
        else:
            self.head = PlainLMHead(cfg.hidden, cfg.vocab_size, reduction=red, device=device, dtype=dtype)
        if self.cp:
            for blk in self.layers:
                blk.attn.cp = (group, self.world, self.rank)
        self._ckpt, self.sco_config, self.sco = None, None, None
        if cfg.checkpoint == "sco":
            self.use_sco()
        self.reset_parameters(seed)

    def use_sco(self):
        """Make SCO this model's checkpoint schedule, with its own SCO config (self.sco_config)
        and runtime (self.sco: its stats(); its pinned arena is freed by close()). Idempotent."""
        if self._ckpt is None:
            self._ckpt = component("checkpoint")
            from ..sco import SCOConfig, SCOOffloader
            self.sco_config = SCOConfig(keep_last=self.cfg.sco_keep_last)
            self.sco = SCOOffloader(self.sco_config)
            self.sco.num_blocks = len(self.layers)  # self.sco.reconfigure(keep_last=...) moves the kept ones
            self._sco_from_end = {id(b): len(self.layers) - 1 - i for i, b in enumerate(self.layers)}

    def close(self):
        """Free the pinned SCO arena now (it would otherwise live until exit)."""
        if self.sco is not None:
            self.sco.free()

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0):
        """Deterministic init from `seed`, independent of the schedules chosen:
        every parameter is drawn by name on the CPU, then copied in."""
        std = 0.02
        for name, p in self.named_parameters():
            g = torch.Generator().manual_seed(seed * 1000003 + _stable_hash(name))
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            shape = list(p.shape)
            full0 = self._full_dim0(name, shape[0])
            full = torch.empty([full0] + shape[1:], dtype=torch.float32)
            full.normal_(0.0, std, generator=g)
            if name.endswith("o_proj.weight") or name.endswith("w_down"):
                full.mul_(1.0 / math.sqrt(2 * self.cfg.layers))
            if full0 != shape[0]:  # this rank's dim-0 shard (local experts / vocab shard)
                r = self.rank
                full = full[r * shape[0]:(r + 1) * shape[0]]
            p.copy_(full.to(p.dtype))

    def _full_dim0(self, name: str, local: int) -> int:
        if name.endswith("w_gate_up") or name.endswith("w_down"):
            return self.cfg.experts
        if name == "head.weight":
            return self.cfg.vocab_size
        return local

    def run_block(self, blk, x):
        """One block under cfg.checkpoint ("sco", "torch" or "none"; no checkpointing
        when grad is off), sequence-tiled when cfg.tile_tokens is set: the tiled block keeps
        only its input x for backward, so it is its own checkpoint ("torch" and "none" run
        it as is) and SCO wraps it to keep x in host memory. hidden_states() calls it for
        every block."""
        if not torch.is_grad_enabled() or self.cfg.checkpoint == "none":
            return blk(x)
        if self.cfg.checkpoint == "sco":
            return self._ckpt(blk, x, sco_offloader=self.sco, sco_block_from_end=self._sco_from_end[id(blk)])
        if self.cfg.tile_tokens is not None:
            return blk(x)
        return torch_ckpt.checkpoint(blk, x, use_reentrant=False)

    def hidden_states(self, input_ids):
        x = self.embed(input_ids)
        for blk in self.layers:
            x = self.run_block(blk, x)
        return self.norm(x)

    def forward(self, input_ids, labels):
        """input_ids, labels: [B, T] (under context parallelism this rank's slice
        [B, T/P] of the sequences, see context_parallel.cp_slice) -> loss."""
        if not self.cp:
            return self.head(self.hidden_states(input_ids), labels)
        # P * (this slice's loss sum) / (valid labels in the whole sequence): the mean over
        # the ranks of this value is the full sequence's mean loss (FSDP2 averages gradients)
        n = (labels != IGNORE_INDEX).sum().to(torch.float32)
        torch.distributed.all_reduce(n, group=self.group)
        scale = self.world / n.clamp_min(1.0)
        return self.head(self.hidden_states(input_ids), labels) * scale


def _stable_hash(s: str) -> int:
    h = 2166136261
    for c in s.encode():
        h = ((h ^ c) * 16777619) & 0xFFFFFFFF
    return h
