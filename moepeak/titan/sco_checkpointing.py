"""moepeak.titan.sco's component: full activation checkpointing of every transformer block
with each block's input in a pinned host arena between forward and backward (SCO), and
with tile_tokens each block sequence-tiled (the contract: moepeak.titan's docstring)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

from ..sco import SCOConfig, SCOOffloader, apply_sco
from .tiled import tile_block


class SCOActivationCheckpointing(ActivationCheckpointing):
    """Full activation checkpointing of every transformer block, each block's
    input kept in a pinned host arena between forward and backward; with
    tile_tokens, each block also runs sequence-tiled (moepeak.tiled): only its
    attention core holds full-length tensors, in forward and in the recompute."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        max_in_flight: int = SCOConfig.max_in_flight
        prefetch: int = SCOConfig.prefetch
        keep_last: int = SCOConfig.keep_last
        """How many of the last blocks keep their input on the GPU (SCOConfig.keep_last)."""
        arena_bytes: int = SCOConfig.arena_bytes
        max_arena_bytes: Optional[int] = SCOConfig.max_arena_bytes
        spill_dir: Optional[str] = SCOConfig.spill_dir
        """The disk tier (SCOConfig.spill_dir): with host_budget_bytes, the earliest boundaries
        beyond that many pinned host bytes go to an anonymous spill file in this directory."""
        host_budget_bytes: Optional[int] = SCOConfig.host_budget_bytes
        tile_tokens: Optional[int] = None
        """Tokens per sequence tile of the position-wise parts (None: untiled).
        Blocks with GQAttention or deepseek_v3's latent Attention, and torchtitan's
        ScaledDotProductAttention, only."""

    def __init__(self, config: Config, dump_folder: str = ""):
        super().__init__(config, dump_folder)
        if not config.preserve_rng_state:
            raise ValueError("moepeak.titan.sco always preserves the RNG state (preserve_rng_state=False "
                             "is not supported)")
        tile = config.tile_tokens
        if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
            raise ValueError(f"moepeak.titan.sco: tile_tokens must be a positive integer or None, got {tile!r}")
        self.tile_tokens = tile
        self.sco_config = SCOConfig(max_in_flight=config.max_in_flight, prefetch=config.prefetch,
                                    keep_last=config.keep_last, arena_bytes=config.arena_bytes,
                                    max_arena_bytes=config.max_arena_bytes, spill_dir=config.spill_dir,
                                    host_budget_bytes=config.host_budget_bytes)
        self.sco = SCOOffloader(self.sco_config)  # the runtime: arena, streams, stats

    def apply(self, model: torch.nn.Module) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
        blocks = list(model.get_submodule("layers").children())
        if self.tile_tokens is not None:
            for i, block in enumerate(blocks):
                tile_block(block, i, self.tile_tokens)
        apply_sco(model, blocks, offloader=self.sco)
        for block in blocks:
            # torchtitan's MoE load-balancing hook halves the token counts of
            # blocks marked as non-reentrant checkpointed (the recompute counts
            # them twice); SCO recomputes the same way.
            block.checkpoint_impl = CheckpointImpl.NO_REENTRANT
