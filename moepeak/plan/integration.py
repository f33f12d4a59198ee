"""What the integrations' automatic placement shares (moepeak.hf, moepeak.titan, the demo):
the room this rank measures, the ranks of the job and of this host, a forward call's tokens,
the context place() takes for a rank's tokens, and place() for one rank of a job with the one
rule several ranks add. The state kept between steps is StepPlacement's.

Several ranks. Each rank plans alone, from its own GPU's room and its share of this host's
RAM and disk (shared by the ranks on the host: LOCAL_WORLD_SIZE, which torchrun and
accelerate set; where it is not set, every rank of the job is assumed to be on this host,
which gives each rank too little of the host rather than too much, and the note says so).
It applies only what is its own: SCO's keep_last and arena and StreamAdamW's device tail
live in its process and no collective depends on them. No collective is added: a rank
waiting for another's plan could hang. A rank measures host RAM at its first plan; another
rank of the host that reserved its arena or state before that is counted twice (a smaller
share, never a larger one).

The tiling is not a rank's own where a collective runs per tile (the experts' all-to-all
under expert parallelism, the attention exchange of sequence parallelism, the demo's
context parallelism): the ranks' tile counts must match, so a tiling is never picked for
them (Ranks.tiles_agree). Where whole blocks do not fit and no tile_tokens was given,
place_rank raises TilesNeeded (a PlacementError) naming the option and the tile the plan
wants, before the step allocates anything: a silent fallback would run every rank into an
out-of-memory error in the middle of the step, as the one-GPU placement refuses such a step
too. The raising rank's process ends; its launcher (torchrun) ends the others, which may be
waiting in that step's first collective.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

from .model import GiB, ModelShape, Setup
from .placement import Margins, Placement, PlacementError, place
from .sequence import sequence_problems, sequence_size

LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"  # torchrun's (and accelerate's) ranks on this host


@dataclass(frozen=True)
class Ranks:
    """The ranks a step is placed among. world: the job's ranks; per_host: those sharing this
    host's RAM and disk; per_host_assumed: per_host not read but assumed (every rank on this
    host); tiles_agree: a collective runs per tile, so the ranks' tilings must match."""
    world: int = 1
    per_host: int = 1
    per_host_assumed: bool = False
    tiles_agree: bool = False

    def words(self) -> str:
        """'' for one process, else e.g. ' (rank of 8, 8 on this host: LOCAL_WORLD_SIZE)'."""
        if self.world == 1:
            return ""
        how = "assumed: LOCAL_WORLD_SIZE is not set" if self.per_host_assumed else LOCAL_WORLD_SIZE
        return f" (one rank of {self.world}, {self.per_host} on this host: {how})"


def job_ranks(tiles_agree: bool, world: Optional[int] = None) -> Ranks:
    """This process's job: `world` ranks (None: torch.distributed's world, 1 when not
    initialised) and this host's share of them (the module docstring); tiles_agree as the
    integration knows its layout."""
    if world is None:
        import torch.distributed as dist
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return Ranks()
    local = os.environ.get(LOCAL_WORLD_SIZE, "")
    if local.isdigit() and 1 <= int(local) <= world:
        return Ranks(world, int(local), False, tiles_agree)
    return Ranks(world, world, True, tiles_agree)


def forward_tokens(args, kwargs, names: Sequence[str]) -> Optional[int]:
    """T of a forward call: batch x sequence of its token tensor: the keyword names[0] (else the
    first positional argument), else the first of the other names given (inputs_embeds)."""
    import torch
    x = kwargs.get(names[0], args[0] if args else None)
    for name in names[1:]:
        if x is None:
            x = kwargs.get(name)
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return None
    return int(x.shape[0] * x.shape[1])


def activation_bytes(dtype) -> int:
    """Setup.act_bytes of a model whose parameters are `dtype`: 2 for bf16/fp16, else 4."""
    import torch
    return 2 if dtype in (torch.bfloat16, torch.float16) else 4


def rank_context(s: Setup, tokens: int) -> int:
    """The context place() takes for a rank holding `tokens` tokens (Setup.batch = 1): the
    sequence's length over its S ranks (tokens_per_rank of it is `tokens`)."""
    return tokens * sequence_size(s)


def setup_problems(m: ModelShape, s: Setup) -> List[str]:
    """What keeps the planner from this shape and layout, one sentence each; [] if nothing."""
    return m.problems() or sequence_problems(m, s)


class TilesNeeded(PlacementError):
    """Whole blocks do not fit and the ranks must agree on a tiling: tile_tokens is the tile the
    plan wants (give it on every rank)."""

    def __init__(self, message: str, tier: str, need: float, room: float, tile_tokens: int):
        super().__init__(message, tier, need, room)
        self.tile_tokens = tile_tokens


def place_rank(m: ModelShape, s: Setup, context: int, *, gpu_bytes: float, host_bytes: float, ranks: Ranks,
               tile_option: str, margins: Margins = Margins()) -> Placement:
    """place() for this rank: host_bytes shared by ranks.per_host; where ranks.tiles_agree and
    the setup gives no tile_tokens, whole blocks only, TilesNeeded (naming tile_option, e.g.
    "apply_moepeak(..., tile_tokens=N)", with N the plan's tile) when they do not fit."""
    kw = dict(gpu_bytes=gpu_bytes, host_bytes=host_bytes, ranks_per_host=ranks.per_host, margins=margins)
    if not ranks.tiles_agree or s.tile_tokens:
        return place(m, s, context, **kw)
    try:
        return place(m, s, context, tiles=False, **kw)
    except PlacementError as whole:
        tiled = place(m, s, context, **kw)  # nothing fits even tiled: its PlacementError says so
        option = tile_option.replace("N", str(tiled.tile_tokens))
        raise TilesNeeded(
            f"moepeak: whole blocks do not fit on this rank ({whole}); the plan wants tiles of {tiled.tile_tokens} "
            f"tokens, a choice the {ranks.world} ranks must share (each tile runs a collective): give {option} on "
            "every rank (or turn the automatic placement off to run whole blocks unplaced)", whole.tier, whole.need,
            whole.room, tiled.tile_tokens) from whole


class StepPlacement:
    """What an integration's automatic placement keeps for one model between steps (moepeak.hf's
    AutoPlacement and moepeak.titan's TitanAutoPlacement are this): the T of the last plan (a
    longer step plans again), host RAM as first measured (before StreamAdamW's state and SCO's
    arena took theirs: a later measure would count them twice; the arena is freed on re-plan),
    the last Placement, and the tiling given or installed (later plans keep it)."""

    def __init__(self, tile_tokens: Optional[int]):
        self.tile_tokens = tile_tokens
        self.tokens = 0
        self.host_measured = 0.0
        self.placement: Optional[Placement] = None

    def due(self, module, args, kwargs, names: Sequence[str]) -> Optional[int]:
        """The tokens of a training forward longer than the last plan's (the forward pre-hook's
        test), else None."""
        import torch
        if not (module.training and torch.is_grad_enabled()):
            return None
        T = forward_tokens(args, kwargs, names)
        return T if T is not None and T > self.tokens else None

    def first_host(self, host: float) -> float:
        """Host RAM as measured at the first plan (`host`, the measure of this one, if none yet)."""
        self.host_measured = self.host_measured or host
        return self.host_measured

    def place(self, m: ModelShape, s: Setup, tokens: int, *, gpu_bytes: float, host_bytes: float, ranks: Ranks,
              tile_option: str) -> Placement:
        """place_rank for a step of this rank's `tokens`; kept as the last plan once applied
        (planned())."""
        return place_rank(m, s, rank_context(s, tokens), gpu_bytes=gpu_bytes, host_bytes=host_bytes, ranks=ranks,
                          tile_option=tile_option)

    def planned(self, tokens: int, p: Placement) -> None:
        """p was applied for a step of `tokens` tokens: the installed tiling stays for later plans."""
        self.tokens, self.placement = tokens, p
        if p.tile_tokens and self.tile_tokens is None:
            self.tile_tokens = p.tile_tokens

    @staticmethod
    def summary(p: Placement, step: str, gpu: float, host: float, source: str, ranks: Ranks) -> str:
        """The one-line decision: where the step ("4096 tokens") went and on what room."""
        arena = p.sco_options()["arena_bytes"]
        return (f"{step} on {gpu / GiB:.1f} GiB of GPU and {host / GiB:.1f} GiB of host RAM ({source})"
                f"{ranks.words()}: {p.keep_last} boundaries on the GPU, {p.host_boundaries} in host RAM (arena "
                f"{arena / GiB:.2f} GiB); optimizer state on the GPU {p.device_state_bytes / GiB:.2f} GiB; "
                + (f"tiles of {p.tile_tokens} tokens" if p.tile_tokens else "whole blocks"))


ALL_STATE_ON_GPU = math.inf  # Setup.device_state_gib of a stock optimizer: its state lives on the GPU

__all__ = ["Ranks", "job_ranks", "forward_tokens", "activation_bytes", "rank_context", "setup_problems",
           "TilesNeeded", "place_rank", "StepPlacement", "ALL_STATE_ON_GPU", "LOCAL_WORLD_SIZE"]
