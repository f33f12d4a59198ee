"""moepeak.llep: PipelinedLLEP, the MoE layer whose dispatch peak grows with neither routing
imbalance nor tokens (docs/design.md section 2).

  moe         llep_moe and PipelinedLLEPMoE: the public API (validation)
  options     LLEPOptions: the schedule's options, their defaults and checks
  launch      the launch sizes (chunk rows, activation-cache slots, the one-chunk paths)
              from shapes and options alone
  stats       LLEPStats: per-call statistics, filled by the ops of the calls given one
  ops         the ops moepeak::llep_dispatch, its two backward ops, moepeak::llep_combine_
  sched       the chunked schedule, forward and backward; one_chunk: the one-chunk steps
  context     one call's shapes, plan and statistics; experts: the expert arithmetic of a
              chunk's rows; gemm: its GEMMs (grouped or per expert)
  plan        the LLEP plan (expert placement), the chunk layout, the kernels' wrappers
  sizes       the byte formulas and defaults (public: moepeak.plan reads them)
  workspace   the buffers' owners (Workspace, Held)

Public face (exported here):
  for users:         llep_moe, PipelinedLLEPMoE (also moepeak.llep_moe, ...), LLEPOptions
                     (their options), LLEPStats (their per-call statistics), ACTIVATIONS
                     (llep_moe's activation choices)
  for integrations:  LLEPOptions.names() (the option keywords), GPT_OSS_ALPHA, GPT_OSS_LIMIT,
                     the constants of the "gpt_oss" activation (moepeak.hf checks a GPT-OSS
                     model's against them)
and the module moepeak.llep.sizes, public by design. Everything else is internal to
moepeak.llep.
"""
from .context import ACTIVATIONS, GPT_OSS_ALPHA, GPT_OSS_LIMIT
from .moe import PipelinedLLEPMoE, llep_moe
from .options import LLEPOptions
from .stats import LLEPStats

__all__ = ["llep_moe", "PipelinedLLEPMoE", "LLEPOptions", "LLEPStats", "ACTIVATIONS", "GPT_OSS_ALPHA",
           "GPT_OSS_LIMIT"]
