"""Hugging Face sequence parallelism in `moepeak plan` (Setup.sp, --sp: moepeak.hf's
sequence_group; README "Across GPUs with sequence parallelism"): the layout's sizes (S, P_ep,
tokens per rank, the parameters a rank holds), the attention exchange's bytes per token and
the checks of Setup's sequence fields. moepeak/plan/model.py's docstring states where each
term enters the peaks; host.py and placement.py read the rank's parameters from here.
"""
from __future__ import annotations

from typing import List

# m: a moepeak.plan.ModelShape, s: a moepeak.plan.Setup throughout (not imported: model.py
# imports this module)

# Hugging Face sequence parallelism (Setup.sp, --sp): DeepSpeed Ulysses (heads exchanged by
# all-to-all) or torch context_parallel (ring attention: accelerate's cp_size); how the
# non-expert weights are held beside it (Setup.shard, --shard). DeepSpeed's ZeRO-3 is not modelled.
SP_ENGINES = ("ulysses", "ring")
SHARDS = ("ddp", "fsdp2")


def sequence_attention_bytes(m, s, b: int, tiled: bool) -> float:
    """Bytes per local token the sequence-parallel engine's attention adds to the block being
    recomputed (Setup.sp; 0 without it).
      ulysses  the all-to-all's full-sequence q, k, v of the rank's heads and the core's output
               before the all-to-all back, all kept by the core's graph: b*(Qq + Qo + r*(Kk + Kv)),
               r = max(1, S / nkv) (S > nkv: each rank gets one kv head, repeated S / nkv times).
               The tiled layer calls it with one head group (tiled_full_len_bytes(groups=1)).
      ring     torch context_parallel (accelerate's cp_size) per head-group call: the kv shard in
               flight beside the one in use (send + receive buffers of k and v, 2*b*(Kk + Kv))
               and the fp32 merge state (output 4*Qo, lse 4*nh), over the call's head groups
               (the tiled layer's nkv; the untiled model's one call: 1).
    With one rank per sequence (S = 1: expert parallelism alone) nothing is exchanged."""
    if s.sp is None or sequence_size(s) == 1:
        return 0.0
    nh, nkv = m.heads, m.kv_heads
    Qq, Qo, Kk, Kv = nh * m.dqk(), nh * m.d(), nkv * m.dqk(), nkv * m.d()
    if s.sp == "ulysses":
        r = max(1, sequence_size(s) // nkv)
        return b * (Qq + Qo + r * (Kk + Kv))
    G = nkv if tiled else 1
    return (2 * b * (Kk + Kv) + 4 * Qo + 4 * nh) / G


def sequence_size(s) -> int:
    """S: the ranks one sequence is split over (every GPU without Setup.sp)."""
    return (s.sp_size or s.gpus) if s.sp else s.gpus


def shard_of(s) -> str:
    """How the non-expert weights are held: "ddp" (replicated, DistributedDataParallel) or "fsdp2"."""
    if not s.sp:
        return "fsdp2"
    return s.shard or ("ddp" if s.sp == "ulysses" else "fsdp2")


def expert_ranks(s) -> int:
    """P_ep: the ranks the routed experts are split over (PipelinedLLEP's group)."""
    return (s.ep_size or sequence_size(s)) if s.sp else s.gpus


def tokens_per_rank(s, context: int) -> int:
    """T: the batch's tokens on one rank (the sequence split over its S ranks)."""
    return s.batch * -(-context // sequence_size(s))


def expert_params(m) -> int:
    """N_e: the routed experts' weights (gate, up, down of every MoE layer)."""
    return (m.layers - m.dense_layers) * m.experts * 3 * m.hidden * m.intermediate


def local_params(m, s) -> float:
    """Parameters one rank holds (and keeps gradients and optimizer state of): ddp the
    non-expert ones whole and 1/P_ep of the experts, (N - N_e) + N_e / P_ep; fsdp2 N / P."""
    N = m.params()
    if shard_of(s) == "ddp":
        Ne = expert_params(m)
        return (N - Ne) + Ne / expert_ranks(s)
    return N / s.gpus


def sequence_problems(m, s, flags: bool = False) -> List[str]:
    """What is wrong with Setup's sequence-parallel fields, one sentence per bad field
    (flags=True: named as `moepeak plan`'s flags); [] if nothing."""
    def name(f: str) -> str:
        return "--" + f.replace("_", "-") if flags else f
    if s.sp is None:
        given = [f for f in ("sp_size", "shard", "ep_size") if getattr(s, f) is not None]
        return [f"{name(f)} needs {name('sp')}" for f in given]
    bad = []
    if s.sp not in SP_ENGINES:
        return [f"{name('sp')} must be one of {SP_ENGINES}, got {s.sp!r}"]
    if s.impl != "hf":
        bad.append(f"{name('sp')} models Hugging Face sequence parallelism: it needs {name('impl')} hf")
    if s.shard is not None and s.shard not in SHARDS:
        bad.append(f"{name('shard')} must be one of {SHARDS}, got {s.shard!r}")
    for f in ("sp_size", "ep_size"):
        v = getattr(s, f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1 or s.gpus % v):
            bad.append(f"{name(f)} must be a positive integer dividing {name('gpus')} ({s.gpus}), got {v!r}")
    if bad:
        return bad
    S, Pep = sequence_size(s), expert_ranks(s)
    if m.heads % S:
        bad.append(f"{name('sp_size')} ({S}) must divide the attention heads ({m.heads})")
    if s.sp == "ulysses" and m.kv_heads % S and S % m.kv_heads:
        bad.append(f"{name('sp_size')} ({S}) must divide the kv heads ({m.kv_heads}) or be a multiple of them "
                   "(Ulysses splits or repeats them over the ranks)")
    if m.experts % Pep:
        bad.append(f"{name('ep_size')} ({Pep}) must divide the experts ({m.experts})")
    return bad
