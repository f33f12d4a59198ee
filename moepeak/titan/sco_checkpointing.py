"""moepeak.titan.sco's component: full activation checkpointing of every transformer block
with each block's input in a pinned host arena between forward and backward (SCO), and
with tile_tokens each block sequence-tiled (the contract: moepeak.titan's docstring)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

from ..sco import SCOConfig, SCOOffloader, apply_sco
from .autoplace import TitanAutoPlacement
from .tiled import check_tileable, install_tile_switch, tile_block


class SCOActivationCheckpointing(ActivationCheckpointing):
    """Full activation checkpointing of every transformer block, each block's
    input kept in a pinned host arena between forward and backward; with
    tile_tokens, each block also runs sequence-tiled (moepeak.tiled): only its
    attention core holds full-length tensors, in forward and in the recompute."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        max_in_flight: int = SCOConfig.max_in_flight
        prefetch: int = SCOConfig.prefetch
        keep_last: Optional[int] = None
        """How many of the last blocks keep their input on the GPU (SCOConfig.keep_last; None:
        the automatic placement's, else SCOConfig's default)."""
        arena_bytes: Optional[int] = None
        """SCOConfig.arena_bytes (None: sized by the automatic placement, else SCOConfig's 0)."""
        max_arena_bytes: Optional[int] = SCOConfig.max_arena_bytes
        spill_dir: Optional[str] = SCOConfig.spill_dir
        """The disk tier (SCOConfig.spill_dir): with host_budget_bytes, the earliest boundaries
        beyond that many pinned host bytes go to an anonymous spill file in this directory."""
        host_budget_bytes: Optional[int] = SCOConfig.host_budget_bytes
        tile_tokens: Optional[int] = None
        """Tokens per sequence tile of the position-wise parts (None: untiled).
        Blocks with GQAttention or deepseek_v3's latent Attention, and torchtitan's
        ScaledDotProductAttention, only. None: whole blocks unless the automatic placement
        finds they do not fit."""
        auto_placement: bool = True
        """Place keep_last, arena_bytes and tile_tokens where they are None from the model, the
        step's tokens and this machine (moepeak/titan/autoplace.py); False: SCOConfig's defaults."""

    def __init__(self, config: Config, dump_folder: str = ""):
        super().__init__(config, dump_folder)
        if not config.preserve_rng_state:
            raise ValueError("moepeak.titan.sco always preserves the RNG state (preserve_rng_state=False "
                             "is not supported)")
        tile = config.tile_tokens
        if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
            raise ValueError(f"moepeak.titan.sco: tile_tokens must be a positive integer or None, got {tile!r}")
        if not isinstance(config.auto_placement, bool):
            raise ValueError(f"moepeak.titan.sco: auto_placement must be a bool, got {config.auto_placement!r}")
        self.tile_tokens = tile
        self.config_given = config
        self.placement: Optional[TitanAutoPlacement] = None  # made by apply() when auto_placement
        defaults = SCOConfig()
        self.sco_config = SCOConfig(max_in_flight=config.max_in_flight, prefetch=config.prefetch,
                                    keep_last=defaults.keep_last if config.keep_last is None else config.keep_last,
                                    arena_bytes=defaults.arena_bytes if config.arena_bytes is None
                                    else config.arena_bytes,
                                    max_arena_bytes=config.max_arena_bytes, spill_dir=config.spill_dir,
                                    host_budget_bytes=config.host_budget_bytes)
        self.sco = SCOOffloader(self.sco_config)  # the runtime: arena, streams, stats

    def apply(self, model: torch.nn.Module) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
        blocks = list(model.get_submodule("layers").children())
        c = self.config_given
        auto = c.auto_placement and (c.keep_last is None or c.arena_bytes is None or c.tile_tokens is None)
        for i, block in enumerate(blocks):
            if self.tile_tokens is not None:
                tile_block(block, i, self.tile_tokens)
            elif auto:
                install_tile_switch(block)  # untiled until the placement sets a tile
        apply_sco(model, blocks, offloader=self.sco)
        if auto:
            self.placement = TitanAutoPlacement(
                self, model, keep_given=c.keep_last, tile_given=c.tile_tokens,
                arena_given=c.arena_bytes is not None or c.spill_dir is not None or c.host_budget_bytes is not None)
            model.register_forward_pre_hook(self.placement, with_kwargs=True)
        for block in blocks:
            # torchtitan's MoE load-balancing hook halves the token counts of
            # blocks marked as non-reentrant checkpointed (the recompute counts
            # them twice); SCO recomputes the same way.
            block.checkpoint_impl = CheckpointImpl.NO_REENTRANT

    def set_tiles(self, model: torch.nn.Module, tile_tokens: int) -> None:
        """Run every block with tiles of tile_tokens from the next forward on (the automatic
        placement's tiling); ValueError naming the first block that cannot be tiled, before
        any block changes."""
        blocks = list(model.get_submodule("layers").children())
        for i, block in enumerate(blocks):
            check_tileable(block, i)
        for block in blocks:
            block._moepeak_tile_tokens = tile_tokens
        self.tile_tokens = tile_tokens
