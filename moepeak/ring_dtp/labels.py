"""Ring-DTP's label handling, shared by the single-device op (ops.py) and the
ring schedules (ring.py).

Labels outside [0, V) that are not ignore_index:
  * CPU: a ValueError before any work (checking costs nothing there).
  * CUDA: checking would need a host sync, so those tokens are treated as ignored
    by the kernels (loss NaN, gradient 0; see row_losses' `bad` mask) and a pinned
    flag is copied asynchronously; LabelGuard.check() reads it once its event has
    completed and raises at the next call, or check_labels() waits for it. No sync
    in the call, no device-side assert.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor


class LabelGuard:
    """Pending out-of-range-label flags of CUDA calls: [(event, pinned int32 [1], V)]."""

    pending: List[tuple] = []

    @classmethod
    def record(cls, bad: Tensor, V: int) -> None:
        flag = torch.empty(1, dtype=torch.int32, pin_memory=True)
        flag.copy_(bad.any().to(torch.int32).reshape(1), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        cls.pending.append((ev, flag, V))

    @classmethod
    def check(cls, wait: bool = False) -> None:
        """Raise if a completed call had out-of-range labels (wait: for all of them).
        Never while tracing: reading the flag is a data-dependent branch
        (GuardOnDataDependentSymNode under torch.compile). The op bodies run eagerly
        (custom ops are opaque to the compiler) and call this there, so an error
        recorded by a compiled call still surfaces at the next call."""
        if torch.compiler.is_compiling():
            return
        keep = []
        err = None
        for ev, flag, V in cls.pending:
            if wait:
                ev.synchronize()
            if ev.query():
                if int(flag[0]) and err is None:
                    err = V
            else:
                keep.append((ev, flag, V))
        cls.pending = keep
        if err is not None:
            raise ValueError(f"moepeak: labels must be in [0, {err}) or ignore_index; an earlier "
                             "linear_cross_entropy call on CUDA got out-of-range labels (its loss was NaN)")


def check_labels() -> None:
    """Wait for pending CUDA label checks and raise if any call had out-of-range labels."""
    LabelGuard.check(wait=True)


def sanitize_labels(labels: Tensor, V: int, ignore_index: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(labels with bad ones replaced by ignore_index, valid mask, bad mask).
    labels: [T] int64; the masks: [T] bool. Raises on CPU, records a flag on CUDA."""
    if LabelGuard.pending:
        LabelGuard.check()
    ign = labels == ignore_index
    bad = ~ign & ((labels < 0) | (labels >= V))
    if labels.device.type != "cuda":
        if bool(bad.any()):
            vals = labels[bad][:5].tolist()
            raise ValueError(f"moepeak: labels must be in [0, {V}) or ignore_index={ignore_index}; got {vals}")
    else:
        LabelGuard.record(bad, V)
    clean = torch.where(bad, torch.full_like(labels, ignore_index), labels).contiguous()
    return clean, ~ign, bad
