"""moepeak: bounded-memory schedules for long-context Mixture-of-Experts training.

Four schedules, each changing only the order and granularity of work (never
the arithmetic), each with a GPU working set fixed at launch:

  PipelinedLLEP       moepeak.PipelinedLLEPMoE, moepeak.llep_moe       (expert dispatch)
  Ring-DTP            moepeak.linear_cross_entropy,
                      moepeak.RingDTPLinearCrossEntropy                 (lm_head + cross-entropy)
  SCO                 moepeak.sco_checkpoint, moepeak.apply_sco         (checkpoint boundaries)
  StreamAdamW         moepeak.StreamAdamW                               (optimizer state)

Public names are resolved lazily, so `import moepeak` stays cheap and a
component's import cost is paid only when it is used.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "StreamAdamW": "stream_adamw",
    "linear_cross_entropy": "ring_dtp",
    "RingDTPLinearCrossEntropy": "ring_dtp",
    "check_labels": "ring_dtp",
    "sco_checkpoint": "sco",
    "apply_sco": "sco",
    "SCOConfig": "sco",
    "PipelinedLLEPMoE": "llep",
    "llep_moe": "llep",
    "get_transport": "transport",
    "rms_norm": "norms",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'moepeak' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
