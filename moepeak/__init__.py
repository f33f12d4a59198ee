"""moepeak: bounded-memory schedules for long-context Mixture-of-Experts training.

Four schedules, each changing only the order and granularity of work (never
the arithmetic), each with a GPU working set fixed at launch:

  PipelinedLLEP       moepeak.PipelinedLLEPMoE, moepeak.llep_moe       (expert dispatch)
  Ring-DTP            moepeak.linear_cross_entropy,
                      moepeak.RingDTPLinearCrossEntropy                 (lm_head + cross-entropy)
  SCO                 moepeak.sco_checkpoint, moepeak.apply_sco         (checkpoint boundaries)
  StreamAdamW         moepeak.StreamAdamW                               (optimizer state)

Public face (for users): the names above, get_transport (moepeak.core) and rms_norm
(moepeak.norms), and __version__. They are resolved lazily, so `import moepeak` stays cheap
and a component's import cost is paid only when it is used; each lives in the subpackage of
its concern (docs/design.md section 7: the package layout), which moepeak's own modules
import instead of this facade.
"""
from __future__ import annotations

from .version import __version__

__all__ = sorted(["StreamAdamW", "linear_cross_entropy", "RingDTPLinearCrossEntropy", "check_labels",
                  "sco_checkpoint", "apply_sco", "SCOConfig", "SCOOffloader", "PipelinedLLEPMoE", "llep_moe",
                  "get_transport", "rms_norm"]) + ["__version__"]


def __getattr__(name):
    """Import the subpackage that exports `name` on first use."""
    if name in ("PipelinedLLEPMoE", "llep_moe"):
        from . import llep as home
    elif name in ("linear_cross_entropy", "RingDTPLinearCrossEntropy", "check_labels"):
        from . import ring_dtp as home
    elif name in ("sco_checkpoint", "apply_sco", "SCOConfig", "SCOOffloader"):
        from . import sco as home
    elif name == "StreamAdamW":
        from . import stream_adamw as home
    elif name == "get_transport":
        from . import core as home
    elif name == "rms_norm":
        from . import norms as home
    else:
        raise AttributeError(f"module 'moepeak' has no attribute {name!r}")
    value = getattr(home, name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
