"""Helpers shared by the benchmarks: the results CSVs' one schema (append_results),
CUDA-event timing, peak-memory measurement, OOM capture, and Ring-DTP's schedule
options changed for a block.

Peak memory convention (docs/design.md section 4): max_memory_allocated during the
call minus memory_allocated just before it, i.e. what the call adds above its
inputs.
"""
from __future__ import annotations

import csv
import datetime
import os
import statistics
import subprocess
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch


# The run columns that lead every row of benchmarks/results/<component>.csv, in this order;
# the component's own figures follow them.
RESULT_COLUMNS = ("timestamp", "gpu", "torch", "moepeak", "commit")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(repo_root: str = REPO_ROOT) -> str:
    """The commit the measured code is at: $MOEPEAK_COMMIT if set (for copies of the tree
    without .git, e.g. a GPU machine), else `git rev-parse --short HEAD` in repo_root (this
    repository), else "unknown"."""
    env = os.environ.get("MOEPEAK_COMMIT", "").strip()
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo_root, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def run_columns(gpu: Optional[str] = None) -> Dict[str, str]:
    """The RESULT_COLUMNS of a row written now: timestamp (UTC, ISO-8601 to the second, e.g.
    2026-11-30T06:51:47+00:00), gpu (the given name, else CUDA device 0's, else "cpu"), the
    torch and moepeak versions, and git_commit()."""
    try:
        import moepeak

        version = moepeak.__version__
    except Exception:  # benchmark baselines must run even if moepeak is broken
        version = "unavailable"
    if gpu is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "torch": torch.__version__,
        "moepeak": version,
        "commit": git_commit(),
    }


def append_results(out_dir: str, component: str, rows: Sequence[Dict[str, object]],
                   fields: Optional[Sequence[str]] = None, gpu: Optional[str] = None) -> str:
    """Append rows to OUT_DIR/COMPONENT.csv, each led by run_columns(gpu); returns the path.

    rows: dicts of the component's figures only (a key of RESULT_COLUMNS is an error); a key
    a row lacks is written empty. fields: the figure columns in order (default: the file's
    existing header, else the rows' keys in order of first appearance). The file is
    append-only: its header is written when the file is new and must equal RESULT_COLUMNS +
    fields when it is not, so every row of a file has the same columns."""
    if not component or os.sep in component or "/" in component or component.endswith(".csv"):
        raise ValueError(f"append_results: component must be a bare name like 'ring_dtp', got {component!r}")
    path = os.path.join(out_dir, component + ".csv")
    rows = list(rows)
    if not rows:
        return path
    for row in rows:
        clash = [k for k in row if k in RESULT_COLUMNS]
        if clash:
            raise ValueError(f"append_results: rows carry the component's figures only; {clash} are filled in "
                             f"by run_columns() (pass gpu= to name the GPU)")
    existing = None
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, newline="") as f:
            existing = next(csv.reader(f), None)
    if fields is None:
        if existing is not None:
            fields = existing[len(RESULT_COLUMNS):]
        else:
            fields = list(dict.fromkeys(k for row in rows for k in row))
    header = list(RESULT_COLUMNS) + list(fields)
    if existing is not None and existing != header:
        raise ValueError(f"append_results: {path} has the columns {existing}, these rows {header}; "
                         f"results files are append-only with one header (convert the file or use a new component)")
    unknown = sorted({k for row in rows for k in row} - set(fields))
    if unknown:
        raise ValueError(f"append_results: columns {unknown} are not among fields {list(fields)}")
    os.makedirs(out_dir or ".", exist_ok=True)
    run = run_columns(gpu)
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if existing is None:
            writer.writerow(header)
        for row in rows:
            writer.writerow([run[k] for k in RESULT_COLUMNS] + [row.get(k, "") for k in fields])
    return path


def cuda_event_ms(fn: Callable[[], object]) -> float:
    """Milliseconds of fn() between two CUDA events on the current stream (waits for the second)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def cuda_times_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 3):
    """All per-rep milliseconds of fn() (for median and spread), timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return [cuda_event_ms(fn) for _ in range(reps)]


def wall_times_s(fn: Callable[[], object], reps: int = 3, warmup: int = 1):
    """All per-rep wall-clock seconds of fn() after `warmup` untimed calls (host work:
    CPU kernels, or GPU work that fn itself synchronizes)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
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


def doubling(lo: int, hi: int, multiple_of: int = 1) -> List[int]:
    """lo, 2 lo, 4 lo, ... up to hi, keeping those that multiple_of divides (the lengths a
    doubling benchmark runs)."""
    lengths = []
    while lo <= hi:
        if lo % multiple_of == 0:
            lengths.append(lo)
        lo *= 2
    return lengths


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def ring_dtp_options(**changes):
    """Ring-DTP's options (moepeak.ring_dtp.RingDTPOptions, for linear_cross_entropy's
    options=) with some error-control fields changed: dw_finish=False (every term of the
    fused modes' dW rounded per token chunk), center_chunks (centering past that many chunks;
    1 << 30: off), fused_colsum (the column sums made by the gradient kernel),
    dx_finish=False (every term of vocab_outer_lowp's dX rounded per vocab block)."""
    from moepeak.ring_dtp import RingDTPOptions
    return RingDTPOptions(**changes)


class TimeBudget:
    """A run's wall-clock budget (--max-seconds): what is left, and whether a step of an
    estimated length still fits (None: unlimited)."""

    def __init__(self, max_seconds: Optional[float]):
        self.max_seconds = max_seconds
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return float("inf") if self.max_seconds is None else self.max_seconds - self.elapsed()

    def fits(self, estimate_s: float) -> bool:
        return estimate_s <= self.left()


def cuda_times_and_peak(fn: Callable[[], object], reps: int, warmup: int = 1, cuda: Optional[bool] = None):
    """(per-rep CUDA-event milliseconds, the largest peak of a timed rep in bytes above the
    allocation just before it) of fn() after `warmup` untimed calls. cuda=False (default:
    whether CUDA is available): host wall milliseconds and peak 0, for CPU smoke runs.
    OOM propagates (callers record it)."""
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return [t * 1e3 for t in wall_times_s(fn, reps=reps, warmup=warmup)], 0
    for _ in range(warmup):
        fn()
    times, peak = [], 0
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        times.append(cuda_event_ms(fn))
        peak = max(peak, torch.cuda.max_memory_allocated() - before)
    return times, peak
