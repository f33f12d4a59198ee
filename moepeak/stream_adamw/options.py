"""StreamAdamW's schedule options: the one home of their defaults and their validation.

``StreamAdamW(params, ..., bucket_mb=..., threads=..., ...)`` takes these fields as
keywords (README) and keeps them as ``optimizer.options``, a frozen StreamAdamWOptions;
the planner (moepeak.plan), the integrations (moepeak.hf, moepeak.titan) and the demo read
the defaults from here (``StreamAdamWOptions.bucket_mb``) and the byte formulas from
moepeak.stream_adamw.sizes. Every error names the field and what was expected, and is
raised when the options are built, before the optimizer exists.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

import torch

from .. import _C
from ..core.abi import DTYPE_CODES

ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2}
# The optimizer-state dtypes the CPU kernel keeps exp_avg / exp_avg_sq / max_exp_avg_sq in,
# by the kernel's state_dtype code (moepeak.core.abi); the master is fp32 either way.
STATE_DTYPE_CODES = {dtype: DTYPE_CODES[dtype] for dtype in (torch.float32, torch.bfloat16)}
# Per-parameter rounding seeds are rounding_seed + the param's index, kept below 2^63 (they
# travel as int64 through the op moepeak::stream_adamw).
SEED_LIMIT = 1 << 63


def _name(isa_code: int) -> str:
    return next(k for k, v in ISA_CODES.items() if v == isa_code)


@dataclass(frozen=True)
class StreamAdamWOptions:
    """How StreamAdamW runs its step (the AdamW hyper-parameters are torch's param-group keys).

    bucket_mb         MiB of fp32 master weights per bucket of the pipeline (and per overlap job)
    threads           CPU threads of the kernel (None: every CPU of the process)
    isa               'avx512' | 'avx2' | 'scalar' (or its code 2 | 1 | 0), None: the best this
                      CPU runs; every ISA gives the same bits
    grad_slots        pinned D2H slots of the pipeline (>= 2)
    param_slots       pinned H2D slots of the pipeline (>= 1)
    overlap_backward  update each bucket of params as its grads become final in backward
    clip_grad_norm    None, or the max total grad norm: step() clips first (torch's clip_grad_norm_)
    device_state      params whose state stays on their own device, fp32 (None: none); kept as a
                      tuple, left out of == (tensors have no truth value)
    state_dtype       torch.float32 (default: bitwise torch.optim.AdamW(fused=True)) or
                      torch.bfloat16: exp_avg, exp_avg_sq (and max_exp_avg_sq) in bf16 on the
                      host, stored with stochastic rounding; the master stays fp32
    rounding_seed     the base of the per-parameter seeds of that rounding (param i: base + i,
                      kept in its state), an int in [0, 2^63)
    host_pipeline     tests: CPU params run through the bucket pipeline, memcpy for the copies
    """

    bucket_mb: float = 64.0
    threads: Optional[int] = None
    isa: Union[None, str, int] = None
    grad_slots: int = 3
    param_slots: int = 2
    overlap_backward: bool = False
    clip_grad_norm: Optional[float] = None
    device_state: Optional[Tuple[torch.Tensor, ...]] = field(default=None, compare=False)  # tensors: no ==
    state_dtype: torch.dtype = torch.float32
    rounding_seed: int = 0
    host_pipeline: bool = False

    def __post_init__(self):
        if self.device_state is not None:  # one tensor or an iterable of them, kept as a tuple
            ds = self.device_state
            if not isinstance(ds, torch.Tensor):
                try:
                    ds = tuple(ds)
                except TypeError:
                    raise TypeError(f"moepeak.StreamAdamW: device_state must be None, a param or an iterable of "
                                    f"params, got {type(ds).__name__}") from None
            object.__setattr__(self, "device_state", (ds,) if isinstance(ds, torch.Tensor) else ds)
        self._check_pipeline()
        self._check_step_modes()
        self._check_state_dtype()
        self.isa_code()  # the ISA must run on this CPU

    def _check_pipeline(self):
        if isinstance(self.bucket_mb, bool) or not (isinstance(self.bucket_mb, (int, float)) and self.bucket_mb > 0):
            raise ValueError(f"moepeak.StreamAdamW: bucket_mb must be a number > 0, got {self.bucket_mb!r}")
        for name, low in (("grad_slots", 2), ("param_slots", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"moepeak.StreamAdamW: {name} must be an int >= {low}, got {v!r}")
        t = self.threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= 256):
            raise ValueError(f"moepeak.StreamAdamW: threads must be None or an int in [1, 256], got {t!r}")
        if not isinstance(self.host_pipeline, bool):
            raise TypeError(f"moepeak.StreamAdamW: host_pipeline must be a bool, got {self.host_pipeline!r}")

    def _check_step_modes(self):
        if not isinstance(self.overlap_backward, bool):
            raise TypeError(f"moepeak.StreamAdamW: overlap_backward must be a bool, got {self.overlap_backward!r}")
        c = self.clip_grad_norm
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
            raise ValueError(f"moepeak.StreamAdamW: clip_grad_norm must be None or a number > 0, got {c!r}")

    def _check_state_dtype(self):
        if self.state_dtype not in STATE_DTYPE_CODES:
            raise ValueError(f"moepeak.StreamAdamW: state_dtype must be torch.float32 or torch.bfloat16, "
                             f"got {self.state_dtype!r}")
        s = self.rounding_seed
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < SEED_LIMIT:
            raise ValueError(f"moepeak.StreamAdamW: rounding_seed must be an int in [0, 2^63), got {s!r}")

    def isa_code(self) -> int:
        """The kernel's ISA code: isa's, or the best this CPU runs when isa is None."""
        best = _C.cpu_best_isa()
        if self.isa is None:
            return best
        code = ISA_CODES.get(self.isa, self.isa) if isinstance(self.isa, (str, int)) else None
        if isinstance(code, bool) or code not in (0, 1, 2):
            raise ValueError(f"moepeak.StreamAdamW: isa must be one of {sorted(ISA_CODES)}, 0, 1, 2 or None, "
                             f"got {self.isa!r}")
        if code > best:
            raise ValueError(f"moepeak.StreamAdamW: isa={self.isa!r} is not supported by this CPU (best: "
                             f"{_name(best)!r})")
        return code

    @property
    def state_code(self) -> int:
        """state_dtype's code for the kernel (0 fp32, 1 bf16)."""
        return STATE_DTYPE_CODES[self.state_dtype]
