"""moepeak.tiled: the sequence-tiled decoder block, in which only the attention core holds
full-length tensors (docs/design.md section 6, "the fifth peak").

  block   TiledBlockSpec (a block as pre_attn / attn_core / post_attn), tiled_block, the
          module TiledBlock, and the autograd node that runs them tile by tile

Public face (exported here), for users and for the adapters that describe known blocks
(moepeak/demo/tiled.py, moepeak/hf/tiled.py, moepeak/titan/tiled.py): TiledBlockSpec,
tiled_block, TiledBlock, tile_ranges, requires_grad_params. Everything else is internal to
moepeak.tiled.
"""
from .block import TiledBlock, TiledBlockSpec, requires_grad_params, tile_ranges, tiled_block

__all__ = ["TiledBlockSpec", "tiled_block", "TiledBlock", "tile_ranges", "requires_grad_params"]
