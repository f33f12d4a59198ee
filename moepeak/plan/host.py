"""moepeak's host RAM per rank (per GPU), term by term, and the longest context a host's RAM
holds. Every term is an allocation moepeak's code makes in host memory during a training
step, read off that code and computed with its schedule's own byte formulas
(moepeak.sco.sizes, moepeak.stream_adamw.sizes):

  sco_boundaries   SCO's pinned arena: the L - keep_last - disk boundaries [T, H] x b that
                   wait in host RAM. With SCOConfig's defaults the arena grows in chunks of
                   max(slot, grow_bytes) (moepeak/sco/arena.py), each holding whole slots
                   only: boundaries of 580 MiB in 1 GiB chunks take 1 GiB each
                   (arena_grown_bytes). An arena sized for the step (SCOConfig(arena_bytes=
                   n x slot), what moepeak.plan.placement recommends) takes n x slot.
  sco_spill_staging  the disk tier's pinned staging slots (spill_slots x the boundary's
                   4096-aligned extent), only when boundaries go to disk.
  optimizer_state  StreamAdamW's host state: state_bytes_per_param(b, state dtype) x N / P
                   (--sp with --shard ddp: x the rank's parameters, (N - N_e) + N_e / P_ep,
                   the non-expert weights' state replicated on every rank; model.local_params)
                   (fp32 master + exp_avg + exp_avg_sq: 12 B per bf16 param with fp32 state,
                   8 with bf16 state), less the elements whose state a device tail keeps on
                   the GPU (at device_state_bytes_per_param each, 12 B for bf16 params).
  pinned_slots     StreamAdamW's pinned bucket slots (grad_slots + param_slots buckets).
  state_init       StreamAdamW creates each bf16 param's fp32 master with
                   param.to("cpu", float32): torch copies the CUDA bf16 tensor into a host
                   bf16 temporary and converts it there, so while the state is created the
                   largest local parameter also has a host copy (b x its elements; the
                   largest of the embedding [V, H], one layer's fused expert weights
                   [E, H, 2I] and a dense MLP's [H, 2 I_dense], over P ranks).

Not counted here, and so inside the host margin (moepeak.plan.placement.Margins): the
process itself (Python, torch, the CUDA runtime and its libraries, NCCL's buffers), the
kernel and the page cache the run reads through. Not counted anywhere: an arena that grew
for a shorter sequence earlier in the same process keeps its chunks (SCO's arena never
shrinks; a chunk too small for the new boundaries stays allocated beside the new ones).
"""
from __future__ import annotations

from typing import Dict, Optional

from ..sco import sizes as SCO
from ..stream_adamw import sizes as SA
from .model import GiB, ModelShape, Setup, keep_last, largest_fitting_context
from .sequence import expert_ranks, local_params, shard_of, tokens_per_rank

HOST_TERMS = ("sco_boundaries", "sco_spill_staging", "optimizer_state", "pinned_slots", "state_init")


def arena_grown_bytes(slots: int, boundary: int, grow_bytes: int = SCO.DEFAULTS.grow_bytes) -> int:
    """Pinned bytes SCO's arena allocates for `slots` boundaries of `boundary` bytes when it
    grows on demand (SCOConfig's default): chunks of max(slot, grow_bytes), each holding
    chunk // slot whole slots (moepeak/sco/arena.py's placement)."""
    if slots <= 0:
        return 0
    slot = SCO.slot_bytes(boundary)
    chunk = max(slot, grow_bytes)
    per_chunk = chunk // slot
    return -(-slots // per_chunk) * chunk


def largest_param_elems(m: ModelShape, ranks: int, expert_ranks: Optional[int] = None) -> int:
    """Elements of the largest parameter tensor on one rank: the embedding or lm_head [V, H],
    one layer's fused expert weights [E, H, 2I] (the demo's, llep's and transformers' layout),
    a dense MLP's [H, 2 I_dense]; sharded over the ranks (FSDP2's dim 0, the experts).
    expert_ranks given (ddp: the non-expert weights replicated): only the experts are split,
    over expert_ranks."""
    H = m.hidden
    experts = m.experts * H * 2 * m.intermediate
    if expert_ranks is not None:
        return max(m.vocab * H, -(-experts // expert_ranks), 2 * H * m.dense_intermediate)
    return -(-max(m.vocab * H, experts, 2 * H * m.dense_intermediate) // ranks)


def device_tail_bytes(m: ModelShape, s: Setup) -> float:
    """GPU bytes per rank of StreamAdamW's device tail (Setup.device_state_gib): the budget, at
    most all the state at device_state_bytes_per_param (fp32 moments + fp32 master)."""
    return min(s.device_state_gib * GiB, SA.device_state_bytes_per_param(s.act_bytes) * local_params(m, s))


def host_bytes(m: ModelShape, s: Setup, context: int, *, disk_boundaries: int = 0,
               sized_arena: bool = False) -> Dict[str, float]:
    """moepeak's host RAM per rank, by term (HOST_TERMS, the module docstring) and its total.

    disk_boundaries: how many of the offloaded boundaries (the earliest) go to the disk tier
    instead; sized_arena: the arena is one chunk sized for the step (SCOConfig(arena_bytes=))
    rather than grown in SCOConfig.grow_bytes chunks."""
    T = tokens_per_rank(s, context)
    boundary = SCO.boundary_bytes(T, m.hidden, s.act_bytes)
    offloaded = SCO.offloaded_blocks(m.layers, keep_last(s))
    if not 0 <= disk_boundaries <= offloaded:
        raise ValueError(f"moepeak.plan: disk_boundaries must be in [0, {offloaded}] (the offloaded blocks), "
                         f"got {disk_boundaries}")
    in_host = offloaded - disk_boundaries
    arena = in_host * SCO.slot_bytes(boundary) if sized_arena else arena_grown_bytes(in_host, boundary)
    per_param = SA.state_bytes_per_param(s.act_bytes, s.state_dtype_bytes)
    # the tail's elements leave the host: tail bytes / device bytes per element of them
    on_device = device_tail_bytes(m, s) * per_param / SA.device_state_bytes_per_param(s.act_bytes)
    out = {"sco_boundaries": arena,
           "sco_spill_staging": SCO.staging_bytes(SCO.DEFAULTS.spill_slots, boundary) if disk_boundaries else 0,
           "optimizer_state": per_param * local_params(m, s) - on_device,
           "pinned_slots": SA.pinned_staging_bytes(s.bucket_mb, grad_dtype=s.act_bytes, param_dtype=s.act_bytes),
           "state_init": s.act_bytes * largest_param_elems(
               m, s.gpus, expert_ranks(s) if shard_of(s) == "ddp" else None)}
    out["total"] = sum(out[k] for k in HOST_TERMS)
    return out


def longest_host_context(m: ModelShape, s: Setup, host_gib: float, per_node: int) -> int:
    """Largest context (multiple of 1024) whose host RAM, per_node ranks to a host, fits
    host_gib GiB (what the ranks may take: a host's RAM less its margin)."""
    return largest_fitting_context(lambda c: per_node * host_bytes(m, s, c)["total"] <= host_gib * GiB)
