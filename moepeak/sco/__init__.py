"""moepeak.sco: SCO, selective checkpoint offload: activation checkpointing whose block
inputs (the checkpoint boundaries) wait in a pinned host arena between forward and
backward, and, with the opt-in disk tier, the earliest of them in a spill file.

  options     SCOConfig (pure config: the one home of SCO's defaults and validation),
              KEEP_LAST, KEEP_LAST_DEMO
  sizes       the byte formulas: boundary, arena, disk and staging bytes, the GPU terms
              (public: moepeak.plan and the demo read them)
  offloader   SCOOffloader, the runtime (engines per device, stats, free)
  checkpoint  sco_checkpoint and the checkpoint mechanics
  apply       apply_sco, offloader_of
  engine      where each boundary waits (its tier), the streams and events; arena: the
              pinned arena; disk: the disk tier; ops: moepeak::sco_offload, sco_reload
  deferral    DeferredPrefetch

Public face (exported here):
  for users:         SCOConfig, SCOOffloader, sco_checkpoint, apply_sco, offloader_of,
                     default_offloader (also moepeak.SCOConfig, moepeak.SCOOffloader, ...)
  for the planner, the integrations and the demo: KEEP_LAST, KEEP_LAST_DEMO, and the
                     module moepeak.sco.sizes
  for tiled blocks:  DeferredPrefetch, which holds a reload's prefetch back until the
                     caller's backward peak has passed (moepeak.tiled uses it)
Everything else is internal to moepeak.sco.
"""
from .apply import apply_sco, offloader_of
from .checkpoint import sco_checkpoint
from .deferral import DeferredPrefetch
from .offloader import SCOOffloader, default_offloader
from .options import KEEP_LAST, KEEP_LAST_DEMO, SCOConfig

__all__ = ["SCOConfig", "SCOOffloader", "sco_checkpoint", "apply_sco", "offloader_of", "default_offloader",
           "DeferredPrefetch", "KEEP_LAST", "KEEP_LAST_DEMO"]
