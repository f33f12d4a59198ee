"""moepeak.sco: SCO, selective checkpoint offload: activation checkpointing whose block
inputs (the checkpoint boundaries) wait in a pinned host arena between forward and backward.

  checkpoint   SCOConfig, sco_checkpoint, apply_sco and the checkpoint mechanics
  engine       the pinned arena, the copy and load streams, the ops moepeak::sco_offload
               and moepeak::sco_reload

Public face (exported here):
  for users:         SCOConfig, sco_checkpoint, apply_sco (also moepeak.SCOConfig, ...)
  for tiled blocks:  DeferredPrefetch, which holds a reload's prefetch back until the
                     caller's backward peak has passed (moepeak.tiled uses it)
Everything else is internal to moepeak.sco.
"""
from .checkpoint import SCOConfig, apply_sco, sco_checkpoint
from .engine import DeferredPrefetch

__all__ = ["SCOConfig", "sco_checkpoint", "apply_sco", "DeferredPrefetch"]
