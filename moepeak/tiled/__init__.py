"""moepeak.tiled: the sequence-tiled decoder block, in which only the attention core holds
full-length tensors (docs/design.md section 6, "the fifth peak").

  block      TiledBlockSpec (a block as pre_attn / attn_core / post_attn), tiled_block, the
             module TiledBlock, and the autograd node that runs them tile by tile
  attention  the SDPA backend option of the attention core (attention_backend: "auto" runs
             cuDNN first on Hopper), its check and the context a core call runs inside
  sizes      the block's full-length bytes per token and the head-group choice they drive
             (public by design: the planner reads it)

Public face (exported here), for users and for the adapters that describe known blocks
(moepeak/demo/tiled.py, moepeak/hf/tiled.py, moepeak/titan/tiled.py): TiledBlockSpec,
tiled_block, TiledBlock, tile_ranges, requires_grad_params; ATTENTION_BACKENDS,
DEFAULT_ATTENTION_BACKEND, check_attention_backend, attention_backend_context, attention_dtype,
describe_attention_backend; and the module sizes. Everything else is internal to moepeak.tiled.
"""
from .attention import (ATTENTION_BACKENDS, DEFAULT_ATTENTION_BACKEND, attention_backend_context, attention_dtype,
                        check_attention_backend, describe_attention_backend)
from .block import TiledBlock, TiledBlockSpec, requires_grad_params, tile_ranges, tiled_block

__all__ = ["TiledBlockSpec", "tiled_block", "TiledBlock", "tile_ranges", "requires_grad_params",
           "ATTENTION_BACKENDS", "DEFAULT_ATTENTION_BACKEND", "check_attention_backend", "attention_backend_context",
           "attention_dtype", "describe_attention_backend"]
