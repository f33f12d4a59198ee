"""SCO's sizes: the bytes its boundaries take on each tier (GPU, pinned host RAM, disk) and
the pinned staging of the disk tier. Public by design: the one statement of these
formulas, which the schedule (the arena, the placement, the spill file) and the planner
(moepeak.plan) and the demo both call. Pure arithmetic on ints, no torch.

A boundary is one block's input [B, T, H] on this rank: boundary_bytes(B*T, H, b).
Tiers, for L blocks of which the last keep_last keep their input on the GPU:
  GPU        keep_last boundaries, plus the working set of the schedule (gpu_head_bytes,
             gpu_block_bytes): flat in L.
  host RAM   the newest of the other L - keep_last boundaries, as many as fit the host
             budget, each in an arena slot of slot_bytes(boundary) (no budget: all of them).
  disk       the rest, the earliest blocks, each taking spill_extent(boundary) bytes of
             the spill file; through spill_slots pinned staging slots of the same extent.
"""
from __future__ import annotations

from typing import Dict, Optional

from .options import KEEP_LAST, KEEP_LAST_DEMO, SCOConfig

ARENA_ALIGN = 512  # bytes: every arena slot starts on this boundary (DMA-friendly)
SPILL_ALIGN = 4096  # bytes: the spill file's offsets and its staging buffers (O_DIRECT's unit)
DEFAULTS = SCOConfig  # the defaults: DEFAULTS.max_in_flight, DEFAULTS.prefetch, DEFAULTS.keep_last

__all__ = ["ARENA_ALIGN", "SPILL_ALIGN", "DEFAULTS", "KEEP_LAST", "KEEP_LAST_DEMO", "boundary_bytes",
           "slot_bytes", "spill_extent", "offloaded_blocks", "tiers", "arena_bytes", "arena_grown_bytes", "disk_bytes",
           "staging_bytes", "gpu_head_bytes", "gpu_block_bytes"]


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def boundary_bytes(tokens: int, hidden: int, element_bytes: int) -> int:
    """One block input: tokens (batch x sequence on this rank) x hidden x element bytes."""
    return tokens * hidden * element_bytes


def slot_bytes(nbytes: int) -> int:
    """The arena bytes one boundary of nbytes takes (its slot, rounded up to ARENA_ALIGN)."""
    return _round_up(nbytes, ARENA_ALIGN)


def spill_extent(nbytes: int) -> int:
    """The spill-file bytes (and staging-slot bytes) one boundary of nbytes takes."""
    return _round_up(nbytes, SPILL_ALIGN)


def offloaded_blocks(layers: int, keep_last: int) -> int:
    """How many of `layers` blocks send their input off the GPU."""
    return max(layers - keep_last, 0)


def tiers(layers: int, keep_last: int, boundary: int, host_budget: Optional[int] = None) -> Dict[str, int]:
    """How many boundaries each tier holds: {"gpu", "host", "disk"}. Without a host budget
    (no disk tier) every offloaded boundary is in host RAM; with one, the newest that fit it
    are, the earliest go to disk (the placement SCO converges to from its second step on,
    and from its first under apply_sco)."""
    off = offloaded_blocks(layers, keep_last)
    host = off if host_budget is None else min(off, host_budget // max(slot_bytes(boundary), 1))
    return {"gpu": layers - off, "host": host, "disk": off - host}


def arena_bytes(layers: int, keep_last: int, boundary: int, host_budget: Optional[int] = None) -> int:
    """Pinned host bytes the boundaries take in the arena (one slot per host-tier boundary)."""
    return tiers(layers, keep_last, boundary, host_budget)["host"] * slot_bytes(boundary)


def arena_grown_bytes(slots: int, boundary: int, grow_bytes: int = DEFAULTS.grow_bytes,
                      cap: Optional[int] = None) -> int:
    """Pinned bytes an arena that grows on demand (SCOConfig's default: arena_bytes=0,
    grow=True) holds once it took `slots` boundaries of `boundary` bytes in one step: chunks
    of max(slot, grow_bytes), each holding whole slots only (a slot never straddles two);
    under a cap (SCOConfig.arena_cap) a chunk that would pass it shrinks to one slot, and the
    slots that do not fit even so are not counted (SCO raises, or with the disk tier sends
    them to disk). arena_bytes() is the same bytes for an arena sized for the step."""
    slot = slot_bytes(boundary)
    total, room = 0, 0  # room: slots still free in the newest chunk
    for _ in range(slots):
        if room == 0:
            chunk = max(slot, grow_bytes)
            if cap is not None and total + chunk > cap:
                chunk = slot
                if total + chunk > cap:
                    break
            total, room = total + chunk, chunk // slot
        room -= 1
    return total


def disk_bytes(layers: int, keep_last: int, boundary: int, host_budget: Optional[int] = None) -> int:
    """Spill-file bytes of one step (0 without a host budget)."""
    return tiers(layers, keep_last, boundary, host_budget)["disk"] * spill_extent(boundary)


def staging_bytes(spill_slots: int, boundary: int) -> int:
    """Pinned host bytes of the disk tier's staging slots (on top of the arena): each one
    boundary's extent plus SPILL_ALIGN, the pad its 4096-aligned slice is cut from
    (moepeak.core.spill.HostBuffer)."""
    return spill_slots * (spill_extent(boundary) + SPILL_ALIGN)


def gpu_head_bytes(layers: int, keep_last: int, in_flight: int, boundary: int) -> int:
    """GPU boundary bytes while the head's backward runs: the last `in_flight` forward
    copies stay referenced until the first reload polls them, plus the kept inputs."""
    keep = min(layers, keep_last)
    return (min(layers - keep, in_flight) + keep) * boundary


def gpu_block_bytes(layers: int, keep_last: int, prefetch: int, tiled: bool, boundary: int) -> int:
    """GPU boundary bytes in a block's backward: the input being recomputed plus `prefetch`
    loaded ahead (a tiled block holds its prefetch back until its attention core's backward
    peak has passed: none), plus the kept inputs still waiting (conservatively, all but one)."""
    keep = min(layers, keep_last)
    return (min(layers, 1 + (0 if tiled else prefetch)) + max(keep - 1, 0)) * boundary
