"""PipelinedLLEP's schedule options: LLEPOptions, the one home of their defaults, of the
choices each takes and of their checks.

Where the line is drawn. What llep_moe computes is fixed by its tensors and `activation`;
the options only say how: the chunk size, the LLEP plan's knobs (which rows move to which
rank), the activation-cache budget and which GEMM kernels run. Every choice gives the
same result up to GEMM summation order (the plan and the chunking only reorder rows; the
cache only saves a recompute of the same values).

llep_moe and PipelinedLLEPMoE take the options as an object (options=LLEPOptions(...)) or
as their keywords (README: chunk_rows, alpha, min_tokens_per_gemm, imbalance_threshold,
save_budget_mb; and grouped_mm); a keyword left at None takes the options' field.
moepeak.hf (apply_moepeak's expert options) and moepeak.titan (LLEPRoutedExperts.Config)
read the field names and defaults from here; the byte formulas the defaults start from
are moepeak/llep/sizes.py's.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

from ..core.options import resolve_options

# torch._grouped_mm for the expert GEMMs (moepeak/llep/gemm.py):
#   "auto"  where torch has it and the call qualifies (CUDA, compute capability >= 8.0,
#           bf16, H and I multiples of 8, weight stacks it takes as they are); should it
#           raise all the same, the rest of the call runs one GEMM per expert and the
#           logger "moepeak" warns (once per distinct error);
#   "on"    wherever the call qualifies, CPU tensors included (where torch's CPU build
#           has it); a call that does not qualify is refused, errors propagate;
#   "off"   one torch.mm per expert.
GROUPED_MM_MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class LLEPOptions:
    """How PipelinedLLEP runs one MoE layer's experts (never what it computes).

    chunk_rows           rows per destination per chunk, C (None: sizes.default_chunk_rows,
                         32768 on one rank, 16384 on several); at least the group size.
    alpha                the LLEP plan's capacity factor (>= 1): a rank takes alpha x the
                         mean load before its residuals move (csrc/llep_plan.c).
    min_tokens_per_gemm  the smallest share of an expert's rows that moves to another rank
                         (a smaller residual stays home), an int >= 0.
    imbalance_threshold  nothing moves while max/mean rank load is below it (>= 1).
    save_budget_mb       MiB for the activation cache kept from forward to backward (None:
                         sizes.default_save_budget_mb; 0: recompute every chunk).
    grouped_mm           "auto" | "on" | "off": torch._grouped_mm for the expert GEMMs
                         (GROUPED_MM_MODES says what each means).
    """
    chunk_rows: Optional[int] = None
    alpha: float = 1.0
    min_tokens_per_gemm: int = 1024
    imbalance_threshold: float = 1.3
    save_budget_mb: Optional[int] = None
    grouped_mm: str = "auto"

    def __post_init__(self):
        _optional_int("chunk_rows", self.chunk_rows, 1)
        _optional_int("save_budget_mb", self.save_budget_mb, 0)
        _optional_int("min_tokens_per_gemm", self.min_tokens_per_gemm, 0, none_ok=False)
        for name in ("alpha", "imbalance_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 1.0):
                raise ValueError(f"moepeak: {name} must be a finite number >= 1.0, got {v!r}")
        if self.grouped_mm not in GROUPED_MM_MODES:
            raise ValueError(f"moepeak: grouped_mm must be one of {GROUPED_MM_MODES}, got {self.grouped_mm!r}")

    @staticmethod
    def names() -> Tuple[str, ...]:
        """The fields, in order: the keywords llep_moe, PipelinedLLEPMoE, apply_moepeak and
        LLEPRoutedExperts.Config take for them."""
        return OPTION_NAMES

    @classmethod
    def resolve(cls, options: Optional["LLEPOptions"] = None, **keywords) -> "LLEPOptions":
        """`options` (None: the defaults) with each keyword that is not None put in its field;
        checked (a bad value raises naming the field)."""
        return resolve_options(cls, options, keywords, OPTION_NAMES, article="an")


# The fields' names, in order (a constant: torch.compile traces llep_moe's use of it).
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(LLEPOptions))


def _optional_int(name: str, v, lo: int, none_ok: bool = True) -> None:
    if v is None and none_ok:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        what = f"None or an int >= {lo}" if none_ok else f"an int >= {lo}"
        raise ValueError(f"moepeak: {name} must be {what}, got {v!r}")


__all__ = ["LLEPOptions", "GROUPED_MM_MODES"]
