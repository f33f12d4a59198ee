"""Where each tensor class of a moepeak training step lives on a given machine: GPU, host RAM
(pinned and pageable) or local disk, decided before anything is allocated.

    placement = place(model, setup, context, gpu_bytes=..., host_bytes=..., disk_bytes=None)
    SCOConfig(spill_dir=..., **placement.sco_options())      # keep_last, arena, host budget
    StreamAdamW.backward_tail(params, placement.device_state_bytes)  # the device tail
    placement.tile_tokens                                     # None: whole blocks

place() is pure arithmetic (no torch.cuda, no I/O): the caller measures the machine and
passes the numbers, per rank (GPU) and per host (RAM, disk):
  gpu_bytes   the GPU bytes the step may use, everything resident included: in a fresh
              process torch.cuda.mem_get_info()[0]; with the model already loaded, that
              plus torch.cuda.memory_reserved()
  host_bytes  the host's RAM available: /proc/meminfo's MemAvailable
              (moepeak.core.host_memory.available_bytes(pinned=True), what SCO's arena and
              StreamAdamW check before they allocate), shared by ranks_per_host ranks
  disk_bytes  free bytes of the spill directory's filesystem (os.statvfs: f_bavail x
              f_frsize), shared by the host's ranks; None: no disk tier
Everything after is per rank.

Tensor classes and their tiers (Placement.tiers, bytes per rank)
  params_grads     GPU        parameters and gradients (+ FSDP2's gathered blocks, RoPE
                              tables): peaks()'s 'fixed'
  working_set      GPU        the step's transient peak above them: the larger of the
                              block phase and the head phase (peaks()'s total less the
                              three other classes' GPU bytes)
  boundaries       GPU        the last keep_last blocks' inputs (SCOConfig.keep_last);
                   host       the next ones back, in SCO's pinned arena (one chunk of
                              host_boundaries slots: SCOConfig(arena_bytes=...));
                   disk       the earliest ones, in SCO's spill file (SCOConfig(spill_dir,
                              host_budget_bytes)); the boundary needed first in backward
                              stays closest
  optimizer_state  GPU        StreamAdamW's device tail (device_state, fp32: 12 B per bf16
                              param element); host: the rest, at state_dtype's bytes (12 B
                              per bf16 param element with fp32 state, 8 with bf16 state).
                              (StreamAdamW has no disk tier.)
  host_staging     host       pinned staging: StreamAdamW's bucket slots, SCO's spill staging
                              slots (with a disk tier); and the host copy of the largest
                              parameter while StreamAdamW creates its fp32 master
                              (moepeak/plan/host.py states each term)

Decisions, in this order (each with its reason in Placement.reasons):
  1. tiling: whole blocks if the step fits the GPU with every boundary and all optimizer
     state off it; else sequence-tiled blocks (moepeak.tiled) with the largest tile of
     TILE_TOKENS_CHOICES that fits (Setup.tile_tokens, when given, is kept as given).
  2. keep_last: the default of the code running the layers (SCOConfig's KEEP_LAST for
     Hugging Face models, the demo's KEEP_LAST_DEMO), fewer if the GPU cannot hold them;
     more, one block at a time, while host RAM is short and the GPU has room (each block
     kept saves its host slot and a PCIe round trip). Setup.sco_keep_last, when given, is
     kept as given.
  3. device tail: while host RAM is still short, the optimizer state of the leading
     elements (StreamAdamW.backward_tail's order) moves to the GPU room left, as much as
     the host needs (at least Setup.device_state_gib). Where 2-4 in this order leave host
     RAM short, they run again with the GPU's room to the state first (keep_last at its
     default, the device tail, then keep_last grown in the room left).
  4. disk: while host RAM is still short, the earliest boundaries go to the spill file,
     as few as make host RAM fit (their staging slots counted).
  Nothing fits: PlacementError, naming the tier that is short and the bytes on both sides.

Margins (Margins; the defaults and why)
  GPU   5% of the GPU + 2 GiB. peaks() counts torch's allocated bytes; the caching
        allocator's fragmentation, cuBLAS/cuDNN workspaces and NCCL's buffers come on
        top, and the plan's totals sit within 15% of the measured peaks (benchmarks/
        RESULTS.md), the largest shortfall -6.7% (the untiled HF 2.0B model at 512k:
        plan 53.7 GiB, measured 57.6): 5% of a 139.8 GiB H200 + 2 GiB = 9.0 GiB covers
        those 3.9 GiB and the allocator's slack twice over.
  host  8 GiB + 10% of the host's RAM available, once per host. What host.py does not
        count lives here: each process's own resident memory (Python, torch, the CUDA
        runtime and its libraries, NCCL), the kernel's and the page cache's share that
        MemAvailable counts as available but a pinned allocation cannot take, and
        MemAvailable's own estimate. The OLMoE-1B-7B run of issue 40 (6.92B params, one
        H200, 125 GiB host, 512k tokens) is the yardstick: the plan said 107.5 GiB (15
        boundaries of 2 GiB + 77.3 GiB of state + 0.16 GiB of slots) and SCO's arena could
        not get its last 2 GiB. Of the ~16 GiB the run found missing, 15 GiB were the
        arena's 1 GiB chunks from the 256k step of the same process (an arena never
        shrinks, and a 1 GiB chunk cannot hold a 2 GiB boundary: host.py's last note), the
        rest the state's creation copy (0.5 GiB, now counted) and the process. With this
        margin the plan refuses 512k there (107.5 + 0.5 + 20.5 > 125 GiB) even for a fresh
        process, and the placement's sized arena (SCOConfig(arena_bytes=...), one chunk)
        leaves no partial chunks behind.
  disk  5% of the free space + 1 GiB: other writers on the filesystem (checkpoints, logs)
        and the spill file's alignment; its space is reserved with fallocate when it is
        made, so a short disk shows before the step, never in the middle of it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, Optional

from ..sco import sizes as SCO
from ..stream_adamw import sizes as SA
from .host import host_bytes
from .model import GiB, ModelShape, Setup, keep_last, largest_fitting_context, peaks
from .sequence import local_params, tokens_per_rank

# Tiles tried, largest first, when whole blocks do not fit: 8192 is the tile every tiled
# measurement in benchmarks/RESULTS.md ran (1.03x the untiled step at 512k); 4096 for a step
# that misses by little (a smaller tile shrinks only the position-wise part of the block's
# transient, and costs more tile launches; no smaller tile has been timed).
TILE_TOKENS_CHOICES = (8192, 4096)
TIERS = ("gpu", "host", "disk")
CLASSES = ("params_grads", "working_set", "boundaries", "optimizer_state", "host_staging")


@dataclass(frozen=True)
class Margins:
    """Bytes of each tier left unplanned (the module docstring says why these defaults):
    GPU gpu_fraction x gpu + gpu_bytes per GPU; host host_fraction x host + host_bytes per
    host; disk disk_fraction x free + disk_bytes per filesystem."""
    gpu_fraction: float = 0.05
    gpu_bytes: int = 2 * GiB
    host_fraction: float = 0.10
    host_bytes: int = 8 * GiB
    disk_fraction: float = 0.05
    disk_bytes: int = 1 * GiB

    def __post_init__(self):
        for name in ("gpu_fraction", "host_fraction", "disk_fraction"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"moepeak.plan: Margins.{name} must be a number in [0, 1), got {v!r}")
        for name in ("gpu_bytes", "host_bytes", "disk_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"moepeak.plan: Margins.{name} must be a number of bytes >= 0, got {v!r}")

    def gpu_room(self, gpu_bytes: float) -> float:
        return gpu_bytes - self.gpu_fraction * gpu_bytes - self.gpu_bytes

    def host_room(self, host_bytes: float) -> float:
        return host_bytes - self.host_fraction * host_bytes - self.host_bytes

    def disk_room(self, disk_bytes: float) -> float:
        return disk_bytes - self.disk_fraction * disk_bytes - self.disk_bytes


class PlacementError(ValueError):
    """Nothing fits: the message names the tier that is short and the bytes on both sides.
    tier: "gpu", "host" or "disk"; need, room: bytes per rank."""

    def __init__(self, message: str, tier: str, need: float, room: float):
        super().__init__(message)
        self.tier, self.need, self.room = tier, need, room


@dataclass(frozen=True)
class Placement:
    """One step's placement on one rank (bytes per rank). setup is the given Setup with the
    decisions filled in (tile_tokens, sco_keep_last, device_state_gib), for peaks()."""
    context: int
    tokens: int                      # T: this rank's tokens
    tile_tokens: Optional[int]
    keep_last: int
    host_boundaries: int
    disk_boundaries: int
    boundary_bytes: int              # one block input [T, H] x b
    device_state_bytes: int          # StreamAdamW's device tail budget
    tiers: Dict[str, Dict[str, float]]   # tensor class -> tier -> bytes
    used: Dict[str, float]           # tier -> bytes
    room: Dict[str, Optional[float]]  # tier -> bytes this rank may use (after the margins)
    reasons: Dict[str, str]          # "tiling", "keep_last", "optimizer_state", "disk" -> why
    setup: Setup = field(repr=False)

    def sco_options(self) -> Dict[str, int]:
        """SCOConfig's fields for this placement (add spill_dir= when disk_boundaries > 0):
        keep_last; arena_bytes, one pinned chunk of exactly the host tier's slots (no partial
        chunks); host_budget_bytes (the same bytes) when the earliest boundaries go to disk."""
        out = {"keep_last": self.keep_last, "arena_bytes": self.host_boundaries * SCO.slot_bytes(self.boundary_bytes)}
        if self.disk_boundaries:
            out["host_budget_bytes"] = out["arena_bytes"]
        return out

    def describe(self) -> str:
        """The placement as `moepeak plan --placement` prints it."""
        rows = [f"placement of one step at {self.context} tokens ({self.tokens} per GPU), GiB per GPU:",
                f"  {'':<16}" + "".join(f"{t:>10}" for t in TIERS)]
        for c in CLASSES:
            rows.append(f"  {c:<16}" + "".join(
                f"{self.tiers[c][t] / GiB:>10.2f}" if t in self.tiers[c] else f"{'-':>10}" for t in TIERS))
        rows.append(f"  {'used':<16}" + "".join(f"{self.used[t] / GiB:>10.2f}" for t in TIERS))
        rows.append(f"  {'room':<16}" + "".join(
            f"{self.room[t] / GiB:>10.2f}" if self.room[t] is not None else f"{'none':>10}" for t in TIERS))
        rows.append(f"  boundaries: {self.keep_last} on the GPU, {self.host_boundaries} in host RAM, "
                    f"{self.disk_boundaries} on disk; StreamAdamW device tail {self.device_state_bytes / GiB:.2f} GiB; "
                    + (f"tiles of {self.tile_tokens} tokens" if self.tile_tokens else "whole blocks"))
        rows += [f"  {k}: {v}" for k, v in self.reasons.items()]
        opts = ", ".join(f"{k}={v}" for k, v in self.sco_options().items())
        rows.append(f"  as options: SCOConfig({opts}{', spill_dir=...' if self.disk_boundaries else ''}), "
                    f"StreamAdamW.backward_tail(params, {self.device_state_bytes}), tile_tokens={self.tile_tokens}")
        return "\n".join(rows)


@dataclass
class _Budgets:
    gpu: float
    host: float
    disk: Optional[float]


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def _largest(lo: int, hi: int, ok) -> int:
    """The largest k in [lo, hi] with ok(k), ok true up to some k and false beyond; lo - 1 if none."""
    if not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _smallest(lo: int, hi: int, ok) -> Optional[int]:
    """The smallest k in [lo, hi] with ok(k), ok false up to some k and true beyond; None if none."""
    if lo > hi or not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


class _Step:
    """One tiling of the step on one rank: its GPU and host bytes as functions of the decisions
    (keep_last, the device tail's bytes, the boundaries on disk)."""

    def __init__(self, m: ModelShape, s: Setup, context: int, tile: Optional[int]):
        self.m, self.s, self.context, self.tile = m, s, context, tile
        self.state_all = SA.device_state_bytes_per_param(s.act_bytes) * local_params(m, s)  # all on the GPU
        # host bytes a device byte of tail saves: the state's host bytes per element over its device bytes
        self.host_per_device = SA.state_bytes_per_param(s.act_bytes, s.state_dtype_bytes) / \
            SA.device_state_bytes_per_param(s.act_bytes)
        self._gpu: Dict[int, Dict[str, float]] = {}

    def setup(self, keep: int, tail: float) -> Setup:
        return dataclasses.replace(self.s, tile_tokens=self.tile, sco_keep_last=keep, device_state_gib=tail / GiB)

    def peaks(self, keep: int) -> Dict[str, float]:
        if keep not in self._gpu:
            self._gpu[keep] = peaks(self.m, self.setup(keep, 0.0), self.context, "moepeak")
        return self._gpu[keep]

    def gpu(self, keep: int, tail: float = 0.0) -> float:
        # peaks()'s total is the device tail + max(the two phases): the tail adds as it is
        return self.peaks(keep)["total"] + min(tail, self.state_all)

    def host(self, keep: int, tail: float, disk: int = 0) -> float:
        return host_bytes(self.m, self.setup(keep, tail), self.context, disk_boundaries=disk, sized_arena=True)["total"]


def _short(what: str, need: float, room: float) -> str:
    return f"{what} needs {_gib(need)} per GPU, {_gib(room)} after its margin ({_gib(need - room)} short)"


def _keep_last(step: _Step, room: _Budgets, floor: float, reasons: Dict[str, str], grow: bool = True) -> int:
    """Decision 2: how many of the last blocks keep their input on the GPU (grow: more than the
    default while host RAM is short and the GPU has room, with a device tail of floor)."""
    s, L = step.s, step.m.layers
    if s.sco_keep_last is not None:
        keep = min(s.sco_keep_last, L)
        if step.gpu(keep, floor) > room.gpu:
            raise PlacementError("the GPU is short: with keep_last=" + f"{keep} (given) the step " +
                                 _short("", step.gpu(keep, floor), room.gpu).lstrip(), "gpu", step.gpu(keep, floor),
                                 room.gpu)
        reasons["keep_last"] = f"{keep}, as given"
        return keep
    default = min(keep_last(dataclasses.replace(s, sco_keep_last=None)), L)
    most = _largest(0, L, lambda k: step.gpu(k, floor) <= room.gpu)  # >= 0: checked by the caller
    keep = min(default, most)
    reasons["keep_last"] = (f"{keep}, the default of the code running the layers" if keep == default else
                            f"{keep}: the GPU has no room for the default {default}")
    return _grow_keep(step, room, keep, floor, reasons) if grow else keep


def _grow_keep(step: _Step, room: _Budgets, keep: int, tail: float, reasons: Dict[str, str]) -> int:
    """keep_last grown, one block at a time, while host RAM is short and the GPU (beside a
    device tail of `tail` bytes) has room; keep as it is when the setup gives keep_last."""
    L = step.m.layers
    if step.s.sco_keep_last is not None or step.host(keep, tail) <= room.host:
        return keep
    most = _largest(keep, L, lambda k: step.gpu(k, tail) <= room.gpu)
    if most <= keep:
        return keep
    more = _smallest(keep + 1, most, lambda k: step.host(k, tail) <= room.host)
    grown = most if more is None else more
    reasons["keep_last"] = (f"{grown}: host RAM is short, so {grown - keep} more of the last blocks keep their "
                            f"input on the GPU" + ("" if more is not None else ", every block" if most == L else
                                                ", all it has room for"))
    return grown


def _device_tail(step: _Step, room: _Budgets, keep: int, floor: float, reasons: Dict[str, str]) -> float:
    """Decision 3: StreamAdamW's device tail (bytes on the GPU)."""
    tail = floor
    short = step.host(keep, tail) - room.host
    if short > 0 and tail < step.state_all:
        most = min(step.state_all, room.gpu - step.gpu(keep, 0.0))
        want = min(step.state_all, tail + short / step.host_per_device)
        tail = max(tail, float(min(math.ceil(want), most)))
        reasons["optimizer_state"] = (f"{_gib(tail)} of StreamAdamW's state on the GPU (device tail): host RAM is "
                                      f"short" + ("" if tail >= step.state_all else
                                                  ", the rest in host RAM" + ("" if tail >= want else
                                                                             " (the GPU has no more room)")))
    elif tail >= step.state_all:
        reasons["optimizer_state"] = f"on the GPU, all of it ({_gib(step.state_all)}): {_given_tail(step, floor)}"
    else:
        reasons["optimizer_state"] = "in host RAM" + (f" but {_given_tail(step, floor)}" if floor else "")
    return tail


def _given_tail(step: _Step, floor: float) -> str:
    """Setup.device_state_gib in words: a device tail, or all the state (math.inf: a stock
    optimizer, whose state lives on the GPU)."""
    return "all optimizer state on the GPU, as given" if floor >= step.state_all else \
        f"the given {_gib(floor)} device tail"


def _disk(step: _Step, room: _Budgets, keep: int, tail: float, reasons: Dict[str, str]) -> int:
    """Decision 4: how many of the earliest boundaries go to the spill file."""
    offloaded = SCO.offloaded_blocks(step.m.layers, keep)
    need = step.host(keep, tail)
    if need <= room.host:
        reasons["disk"] = "none: host RAM holds every offloaded boundary"
        return 0
    boundary = SCO.boundary_bytes(tokens_per_rank(step.s, step.context), step.m.hidden, step.s.act_bytes)
    if room.disk is None:
        raise PlacementError(
            f"host RAM is short and there is no disk tier (give a spill directory): {offloaded} boundaries of "
            f"{_gib(boundary)} beside {_gib(tail)} of optimizer state on the GPU and {keep} boundaries there: "
            + _short("host RAM", need, room.host), "host", need, room.host)
    disk = _smallest(1, offloaded, lambda d: step.host(keep, tail, d) <= room.host)
    if disk is None:
        need = step.host(keep, tail, offloaded)
        raise PlacementError("host RAM is short even with every offloaded boundary on disk (optimizer state, "
                             "pinned staging): " + _short("host RAM", need, room.host), "host", need, room.host)
    spill = disk * SCO.spill_extent(boundary)
    if spill > room.disk:
        raise PlacementError(f"the disk is short: {disk} boundaries in the spill file: " +
                             _short("the disk", spill, room.disk), "disk", spill, room.disk)
    reasons["disk"] = (f"the earliest {disk} boundaries go to disk: host RAM holds {offloaded - disk} of the "
                       f"{offloaded} offloaded ones")
    return disk


def _place_tiled(m: ModelShape, s: Setup, context: int, room: _Budgets, tile: Optional[int],
                 reasons: Dict[str, str]) -> Placement:
    """Decisions 2-4 for one tiling; raises PlacementError naming the short tier."""
    step = _Step(m, s, context, tile)
    r = step.peaks(0)
    if r["fixed"] > room.gpu:
        raise PlacementError(
            f"parameters alone exceed the GPU: parameters + gradients take {_gib(r['fixed'])} per GPU over "
            f"{s.gpus} GPU(s), the GPU gives {_gib(room.gpu)} after its margin: spread the model over more GPUs",
            "gpu", r["fixed"], room.gpu)
    if r["total"] > room.gpu:
        raise PlacementError(f"the GPU is short even with every boundary and all optimizer state off it "
                             f"({r['binding']} binds): " + _short("the step", r["total"], room.gpu),
                             "gpu", r["total"], room.gpu)
    floor = min(s.device_state_gib * GiB, step.state_all)  # math.inf: all of it
    if step.gpu(0, floor) > room.gpu:
        raise PlacementError(f"the GPU is short: with {_given_tail(step, floor)} the step " +
                             _short("", step.gpu(0, floor), room.gpu).lstrip(), "gpu", step.gpu(0, floor), room.gpu)
    first = dict(reasons)
    try:  # the GPU's room to boundaries first (each kept saves a PCIe round trip), then to state
        keep = _keep_last(step, room, floor, reasons)
        tail = _device_tail(step, room, keep, floor, reasons)
        disk = _disk(step, room, keep, tail, reasons)
    except PlacementError as e:
        if e.tier != "host":
            raise
        # the state's host bytes may be what is short: the GPU's room to the state first
        reasons.clear()
        reasons.update(first)
        keep = _keep_last(step, room, floor, reasons, grow=False)
        tail = _device_tail(step, room, keep, floor, reasons)
        keep = _grow_keep(step, room, keep, tail, reasons)
        disk = _disk(step, room, keep, tail, reasons)
    return _placement(m, step.setup(keep, tail), context, disk, room, reasons)


def _placement(m: ModelShape, s: Setup, context: int, disk: int, room: _Budgets,
               reasons: Dict[str, str]) -> Placement:
    r = peaks(m, s, context, "moepeak")
    total = r["total"]
    h = host_bytes(m, s, context, disk_boundaries=disk, sized_arena=True)
    T = tokens_per_rank(s, context)
    boundary = SCO.boundary_bytes(T, m.hidden, s.act_bytes)
    keep = min(keep_last(s), m.layers)
    gpu_bounds = max(r["boundaries_block"], r["boundaries_head"])
    tiers = {"params_grads": {"gpu": r["fixed"]},
             "working_set": {"gpu": total - r["fixed"] - gpu_bounds - r["optimizer"]},
             "boundaries": {"gpu": gpu_bounds, "host": h["sco_boundaries"],
                            "disk": disk * SCO.spill_extent(boundary)},
             "optimizer_state": {"gpu": r["optimizer"], "host": h["optimizer_state"]},
             "host_staging": {"host": h["pinned_slots"] + h["sco_spill_staging"] + h["state_init"]}}
    used = {t: sum(c.get(t, 0) for c in tiers.values()) for t in TIERS}
    return Placement(context=context, tokens=T, tile_tokens=s.tile_tokens, keep_last=keep,
                     host_boundaries=SCO.offloaded_blocks(m.layers, keep) - disk, disk_boundaries=disk,
                     boundary_bytes=boundary, device_state_bytes=int(r["optimizer"]), tiers=tiers, used=used,
                     room={"gpu": room.gpu, "host": room.host, "disk": room.disk}, reasons=reasons, setup=s)


def place(m: ModelShape, s: Setup, context: int, *, gpu_bytes: float, host_bytes: float,
          disk_bytes: Optional[float] = None, ranks_per_host: int = 1, margins: Margins = Margins(),
          tiles: bool = True) -> Placement:
    """The placement of one moepeak step of `context` tokens (all ranks together, as peaks()
    takes it) on a machine: gpu_bytes per GPU, host_bytes of RAM and disk_bytes of spill
    space per host shared by ranks_per_host ranks (the module docstring says how to measure
    them). tiles=False: whole blocks only where the setup gives no tile_tokens (the ranks of
    a job whose tiles each run a collective must agree on the tiling: moepeak.plan.integration).
    Setup.device_state_gib = math.inf: all the optimizer state on the GPU (a stock optimizer).
    Raises PlacementError (naming the short tier, with the bytes) when nothing fits,
    ValueError on bad arguments."""
    for name, v in (("gpu_bytes", gpu_bytes), ("host_bytes", host_bytes)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"moepeak.plan.place: {name} must be a number of bytes > 0, got {v!r}")
    if disk_bytes is not None and (isinstance(disk_bytes, bool) or not isinstance(disk_bytes, (int, float))
                                   or disk_bytes < 0):
        raise ValueError(f"moepeak.plan.place: disk_bytes must be None or a number of bytes >= 0, got {disk_bytes!r}")
    if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int) or ranks_per_host < 1:
        raise ValueError(f"moepeak.plan.place: ranks_per_host must be an int >= 1, got {ranks_per_host!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"moepeak.plan.place: context must be an int >= 1, got {context!r}")
    if not isinstance(margins, Margins):
        raise TypeError(f"moepeak.plan.place: margins must be a moepeak.plan.Margins, got {type(margins).__name__}")
    room = _Budgets(gpu=margins.gpu_room(gpu_bytes), host=margins.host_room(host_bytes) / ranks_per_host,
                    disk=None if disk_bytes is None else max(0.0, margins.disk_room(disk_bytes)) / ranks_per_host)
    # whole blocks first; tiles free GPU memory (for the step, then for boundaries and state)
    tilings = (s.tile_tokens,) if s.tile_tokens else (None,) + (TILE_TOKENS_CHOICES if tiles else ())
    failures, last = [], None
    for tile in tilings:
        why = ("as given" if s.tile_tokens else "the untiled step fits" if tile is None else
               "; ".join(failures) + " (a tile frees GPU memory for the step, the boundaries and the state)")
        reasons = {"tiling": ("whole blocks: " if tile is None else f"tiles of {tile} tokens: ") + why}
        try:
            return _place_tiled(m, s, context, room, tile, reasons)
        except PlacementError as e:
            failures.append(f"{'whole blocks' if tile is None else f'{tile}-token tiles'} leave {e.tier} "
                            f"{_gib(e.need - e.room)} short")
            last = e
    tried = "as given" if s.tile_tokens else \
        f"whole blocks or tiles down to {tilings[-1]} tokens" if tiles else "whole blocks"
    raise PlacementError(f"moepeak.plan: nothing fits at {context} tokens ({tokens_per_rank(s, context)} per GPU, "
                         f"{tried}): {last}", last.tier, last.need, last.room)


def longest_placed_context(m: ModelShape, s: Setup, *, gpu_bytes: float, host_bytes: float,
                           disk_bytes: Optional[float] = None, ranks_per_host: int = 1,
                           margins: Margins = Margins(), limit: int = 1 << 26) -> int:
    """Largest context (multiple of 1024, <= limit) that place() places on the machine; 0 if none."""
    def fits(c: int) -> bool:
        try:
            place(m, s, c, gpu_bytes=gpu_bytes, host_bytes=host_bytes, disk_bytes=disk_bytes,
                  ranks_per_host=ranks_per_host, margins=margins)
            return True
        except PlacementError:
            return False
    return largest_fitting_context(fits, limit)
