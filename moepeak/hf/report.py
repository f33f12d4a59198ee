"""MoepeakReport: what apply_moepeak changed in a model and what it left alone, and why."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List


@dataclass
class MoepeakReport:
    """What apply_moepeak changed (patched) and what it left alone, and why."""
    model: str
    patched: List[str] = field(default_factory=list)
    left_alone: List[str] = field(default_factory=list)
    experts_on_moepeak: List[str] = field(default_factory=list)  # module names
    experts_fallback: Dict[str, str] = field(default_factory=dict)  # module name -> reason
    sco_config: object = None  # the moepeak.SCOConfig of the checkpoints
    sco: object = None  # the moepeak.SCOOffloader running them: its stats() and free()
    sequence: object = None  # the SequenceOptions under sequence parallelism (apply_moepeak(sequence_group=...))
    placement: object = None  # the automatic placement (moepeak/hf/autoplace.py): where each step's tensors go

    def __str__(self):
        lines = [f"moepeak.hf.apply_moepeak({self.model}):"]
        lines += [f"  patched     {p}" for p in self.patched] or ["  patched     nothing"]
        lines += [f"  left alone  {p}" for p in self.left_alone]
        if self.placement is not None:
            lines += ["  " + line for line in self.placement.describe().splitlines()]
        return "\n".join(lines)
