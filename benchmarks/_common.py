"""Helpers shared by the benchmarks: machine description rows, CSV append,
CUDA-event timing, peak-memory measurement, OOM capture, and Ring-DTP's schedule
options changed for a block.

Peak memory convention (DESIGN.md section 4): max_memory_allocated during the
call minus memory_allocated just before it, i.e. what the call adds above its
inputs.
"""
from __future__ import annotations

import contextlib
import csv
import datetime
import os
import statistics
from typing import Callable, Dict

import torch


def machine_row() -> Dict[str, str]:
    try:
        import moepeak

        ver = moepeak.__version__
    except Exception:  # benchmark baselines must run even if moepeak is broken
        ver = "unavailable"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "torch": torch.__version__,
        "moepeak": ver,
    }


def append_rows(path: str, rows, fieldnames=None, **writer_kw) -> None:
    """Append dict rows to a CSV file, writing the header first when the file is new.
    fieldnames: the columns (default: the first row's keys); writer_kw go to csv.DictWriter."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fieldnames = list(fieldnames if fieldnames is not None else rows[0].keys())
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fieldnames, **writer_kw)
        if new:
            w.writeheader()
        w.writerows(rows)


def append_csv(path: str, row: Dict[str, object]) -> None:
    append_rows(path, [row])


def cuda_times_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 3):
    """All per-rep milliseconds of fn() (for median and spread), timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return times


def cuda_time_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 3, stat: str = "median") -> float:
    """Median (or min) milliseconds of fn() over `reps`, timed with CUDA events."""
    times = cuda_times_ms(fn, reps=reps, warmup=warmup)
    return statistics.median(times) if stat == "median" else min(times)


def peak_above(fn: Callable[[], object]):
    """(result, bytes the call added at its peak above the allocation before it).
    Raises torch.cuda.OutOfMemoryError through; callers record OOM as a result."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def relerr(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error of a against ref, in fp64 (0-norm ref: the absolute norm)."""
    a, ref = a.double(), ref.double()
    n = ref.norm()
    return ((a - ref).norm() / (n if n > 0 else 1.0)).item()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


@contextlib.contextmanager
def ring_dtp_flags(**changes):
    """Run Ring-DTP with some moepeak.ring_dtp_sched.ScheduleOptions fields changed inside the
    block (its testing hook, schedule_options): dw_finish=False (every term of the fused
    modes' dW rounded per token chunk), center_chunks (centering past that many chunks;
    1 << 30: off), fused_colsum (the column sums made by the gradient kernel),
    dx_finish=False (every term of vocab_outer_lowp's dX rounded per vocab block)."""
    from moepeak.ring_dtp_sched import schedule_options
    with schedule_options(**changes) as opts:
        yield opts
