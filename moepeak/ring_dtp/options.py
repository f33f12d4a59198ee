"""Ring-DTP's schedule options: RingDTPOptions, the one home of the schedule's defaults, of
the choices each option takes and of their checks.

Where the line is drawn. The loss *definition* is what linear_cross_entropy computes:
ignore_index, reduction, label_smoothing, z_loss and softcap (and the module's grad_average)
are its keywords, and two calls that differ in one of them compute different numbers. The
*schedule* is how that loss is computed: the order of the GEMMs and where they round (mode,
and the error-control steps dw_finish, dx_finish, center_chunks, fused_colsum), the block
sizes (chunk_tokens, chunk_vocab), how the ranks of a group move bytes (ring, transport) and
when an out-of-range label is reported (label_check). Every schedule gives the loss of the
definition up to rounding (sched's "Error growth" bounds it), so a schedule option never
changes what a correct input means.

linear_cross_entropy and RingDTPLinearCrossEntropy take the options as an object
(options=RingDTPOptions(...)) or as their keywords mode=, chunk_tokens=, chunk_vocab=, ring=,
transport=, label_check= (a keyword left at None takes the options' field); the error-control
steps are fields only (their defaults are what the op runs; the tests and
benchmarks/studies switch them off to measure what each buys). moepeak.hf (apply_moepeak's
ce_* options) and moepeak.titan (RingDTPLoss.Config) read the field names and defaults from
here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

from ..core.options import resolve_options
from ..core.transport import Transport, check_transport_choice
from . import sizes as S

# Each schedule's code in the ops' schemas (moepeak::ring_dtp_ce's `mode` argument).
MODES = {"auto": 0, "fused": 1, "vocab_outer": 2, "token_outer": 3, "fused_lowp": 4, "vocab_outer_lowp": 5}
# Multi-rank schedules (with `group`; moepeak/ring_dtp/ring.py).
RINGS = ("auto", "weights", "activations", "gather")
# When a CUDA call reports out-of-range labels (moepeak/ring_dtp/labels.py).
LABEL_CHECKS = ("deferred", "sync")

# The keywords of linear_cross_entropy that set a field (the others are fields only).
KEYWORD_FIELDS = ("mode", "chunk_tokens", "chunk_vocab", "ring", "transport", "label_check")


@dataclasses.dataclass(frozen=True)
class RingDTPOptions:
    """How Ring-DTP computes the loss (never what it computes: module docstring).

    mode           single-device schedule, one of MODES (sched's docstring): "auto" picks by
                   dtype, token count and whether backward is certain; with `group` only
                   ring="gather" runs it (the rings have their own exact order).
    chunk_tokens   token rows of a logits block; None: the workspace budget's choice (sizes).
    chunk_vocab    vocab columns of a block (4-GEMM orders and rings); None: the budget's.
    ring           with `group`, one of RINGS: "weights" / "activations" circulate shards or
                   tokens, "auto" the one moving fewer bytes, "gather" all-gathers the weight.
    transport      with `group`: "auto", "torch", "nccl" or a moepeak Transport instance.
    label_check    CUDA labels, one of LABEL_CHECKS: "deferred" (no host sync; the error
                   comes at the latest from this call's backward) or "sync" (before any work).
    dw_finish      fused*: dW's label column summed in fp32 and added once (False: every term
                   rounded per token chunk).
    dx_finish      vocab_outer_lowp: dX's label term added once in fp32 (False: every term
                   rounded per vocab block).
    center_chunks  fused*: the dW GEMMs on X - mean past this many token chunks (0: whenever
                   dW spans chunks; a huge number: never).
    fused_colsum   the centering's colsum(dZ) made by the gradient kernel where it can (CUDA);
                   False: a ones-row GEMM re-reads dZ.
    """
    mode: str = "auto"
    chunk_tokens: Optional[int] = None
    chunk_vocab: Optional[int] = None
    ring: str = "auto"
    transport: Union[str, Transport] = "auto"
    label_check: str = "deferred"
    dw_finish: bool = True
    dx_finish: bool = True
    center_chunks: int = S.FUSED_CENTER_CHUNKS
    fused_colsum: bool = True

    def __post_init__(self):
        self._check_choices()
        self._check_sizes()
        self._check_switches()

    def _check_choices(self) -> None:
        _one_of("mode", self.mode, tuple(MODES))
        _one_of("ring", self.ring, RINGS)
        _one_of("label_check", self.label_check, LABEL_CHECKS)
        check_transport_choice(self.transport)

    def _check_sizes(self) -> None:
        for name in ("chunk_tokens", "chunk_vocab"):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 1):
                raise ValueError(f"moepeak: {name} must be None or a positive int, got {v!r}")
        if type(self.center_chunks) is not int or self.center_chunks < 0:
            raise ValueError(f"moepeak: center_chunks must be an int >= 0, got {self.center_chunks!r}")

    def _check_switches(self) -> None:
        for name in ("dw_finish", "dx_finish", "fused_colsum"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"moepeak: {name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def resolve(cls, options: Optional["RingDTPOptions"] = None, **keywords) -> "RingDTPOptions":
        """`options` (None: the defaults) with each keyword of KEYWORD_FIELDS that is not None
        put in its field; checked (a bad value raises naming the field)."""
        return resolve_options(cls, options, keywords, KEYWORD_FIELDS)

    def op_args(self) -> Tuple[int, int, int, bool, bool, int, bool]:
        """The schedule arguments of the ops moepeak::ring_dtp_ce and ring_dtp_ce_backward, in
        their order: (mode code, chunk_tokens, chunk_vocab (0: the budget's), dw_finish,
        dx_finish, center_chunks, fused_colsum)."""
        return (MODES[self.mode], self.chunk_tokens or 0, self.chunk_vocab or 0, self.dw_finish, self.dx_finish,
                self.center_chunks, self.fused_colsum)


def _one_of(name: str, value, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"moepeak: {name} must be one of {choices}, got {value!r}")
