"""Ring-DTP's label handling, shared by the single-device op (ops.py) and the
ring schedules (ring.py).

Labels outside [0, V) that are not ignore_index:
  * CPU: a ValueError before any work (checking costs nothing there).
  * CUDA: checking would need a host sync, so those tokens are treated as ignored
    by the kernels (loss NaN, gradient 0; see row_losses' `bad` mask) and a pinned
    flag is copied asynchronously into PENDING (a PendingLabelChecks); it is read once
    its event has completed and raises at the next call, or check_labels() waits for
    it. No sync in the call, no device-side assert.
"""
from __future__ import annotations

import threading
from typing import List, Tuple

import torch
from torch import Tensor


class PendingLabelChecks:
    """The out-of-range-label flags of CUDA calls not read yet: [(event, pinned int32 [1], V)].

    Process-wide (one instance, PENDING) on purpose: a call's deferred error is raised by
    the next call or by check_labels(), which share nothing with that call but the process
    (the next call may be another module's; check_labels takes no argument), as CUDA's own
    errors are the process's. A lock guards the list: forward records on the caller's thread
    and a CUDA backward reads on autograd's device thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: List[tuple] = []

    def __bool__(self) -> bool:
        """Any flag not read yet (a hint read without the lock: check() decides)."""
        return bool(self._pending)

    def record(self, bad: Tensor, V: int) -> None:
        """Copy whether `bad` (a CUDA bool mask) has a set element to a pinned flag, without a
        host sync; the flag is read once the current stream has passed this point."""
        flag = torch.empty(1, dtype=torch.int32, pin_memory=True)
        flag.copy_(bad.any().to(torch.int32).reshape(1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.add(event, flag, V)

    def add(self, event, flag: Tensor, V: int) -> None:
        """Hold `flag` (int32 [1] host tensor, nonzero: the call with vocab V had a bad label)
        until `event` (with query() and synchronize(), as torch.cuda.Event) has completed."""
        with self._lock:
            self._pending.append((event, flag, V))

    def check(self, wait: bool = False) -> None:
        """Raise if a completed call had out-of-range labels (wait: for all of them); the
        flags read are dropped, the others kept. Never while tracing: reading the flag is a
        data-dependent branch (GuardOnDataDependentSymNode under torch.compile). The op bodies
        run eagerly (custom ops are opaque to the compiler) and call this there, so an error
        recorded by a compiled call still surfaces at the next call."""
        if torch.compiler.is_compiling():
            return
        with self._lock:
            taken, self._pending = self._pending, []
        keep, bad_vocab = [], None
        for event, flag, V in taken:  # outside the lock: waiting must not block record()
            if wait:
                event.synchronize()
            if event.query():
                if int(flag[0]) and bad_vocab is None:
                    bad_vocab = V
            else:
                keep.append((event, flag, V))
        if keep:
            with self._lock:
                self._pending[:0] = keep  # before the flags recorded meanwhile: call order
        if bad_vocab is not None:
            raise ValueError(f"moepeak: labels must be in [0, {bad_vocab}) or ignore_index; an earlier "
                             "linear_cross_entropy call on CUDA got out-of-range labels (its loss was NaN)")


PENDING = PendingLabelChecks()


def check_labels() -> None:
    """Wait for pending CUDA label checks and raise if any call had out-of-range labels."""
    PENDING.check(wait=True)


def sanitize_labels(labels: Tensor, V: int, ignore_index: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(labels with bad ones replaced by ignore_index, valid mask, bad mask).
    labels: [T] int64; the masks: [T] bool. Raises on CPU, records a flag on CUDA."""
    if PENDING:
        PENDING.check()
    ign = labels == ignore_index
    bad = ~ign & ((labels < 0) | (labels >= V))
    if labels.device.type != "cuda":
        if bool(bad.any()):
            vals = labels[bad][:5].tolist()
            raise ValueError(f"moepeak: labels must be in [0, {V}) or ignore_index={ignore_index}; got {vals}")
    else:
        PENDING.record(bad, V)
    clean = torch.where(bad, torch.full_like(labels, ignore_index), labels).contiguous()
    return clean, ~ign, bad
