"""Issue 38: where llep_moe's time goes at P = 1 against the fair grouped_mm layer, kernel by
kernel (docs/notes/llep-p1-gap.md lists the hypotheses this profile tests).

One forward + backward of each arm at T tokens (default 64k; E = 128, K = 4, H = I = 2880,
bf16; arms from benchmarks/bench_llep.py, same weights, routing, x and dy):

  pipelined          llep_moe as users call it (default chunk budget and activation cache)
  grouped_mm_hf      transformers' Qwen3MoeExperts, experts_implementation="grouped_mm",
                     routing weights in bf16 (the fair baseline)
  pipelined_nocache  llep_moe with save_budget_mb=0: every chunk's h recomputed in backward
  moepeak_1chunk     llep_moe with chunk_rows = T*K: one chunk (no cache at 64k: recomputed)
(pipelined - pipelined_nocache: what the cache saves; pipelined_nocache - moepeak_1chunk:
what chunking itself costs; moepeak_1chunk - grouped_mm_hf: the rest.)

Per arm: wall time of fwd+bwd (CUDA events, median of --reps after one warm-up), then one
fwd+bwd under torch.profiler. Printed and written to --out (profile_llep_T<T>_<routing>.txt,
and the kernel rows as .csv):
  * the kernel table side by side: each CUDA kernel's count and total ms per arm, sorted
    by the largest total, with the first arm minus the second;
  * the same summed per kernel class (GEMM, moepeak's kernels, sort/index, elementwise,
    reduction, copy/memset, other);
  * the GEMM ops (torch._grouped_mm, mm, addmm) by input shapes: which GEMM (gate/up or
    down, forward, recompute, dX or dW) takes the time (kernel names: demangled where
    c++filt is installed);
  * per arm: wall ms, kernel ms (busy = kernel / wall; below ~0.97 the GPU waits on the
    host), the largest idle gaps, GEMM ms and the TFLOP/s of 18*T*K*H*I (the layer's
    GEMM FLOP) over it, and llep's statistics of forward and backward (bench_llep.LLEP_STATS:
    chunks, cached and recomputed chunks, grouped GEMM calls, host syncs, host->device
    copies).

  python benchmarks/studies/profile_llep_vs_grouped.py --out $OUT          # ~30-60 s on an H200
  python benchmarks/studies/profile_llep_vs_grouped.py --routing 95:4 --arms pipelined,grouped_mm_titan
  python benchmarks/studies/profile_llep_vs_grouped.py --smoke --out /tmp/p  # CPU, tiny: CPU ops instead
"""
from __future__ import annotations

import argparse
import csv
import gc
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: bench_llep's arms
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
import bench_llep  # noqa: E402
from _common import cuda_event_ms  # noqa: E402

DEFAULT_ARMS = "pipelined,grouped_mm_hf,pipelined_nocache,moepeak_1chunk"
# Kernel classes, first match wins (lower-case substrings of the kernel name).
# (On CPU, --smoke, the aten op names stand in for kernels.)
CLASSES = (
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "sm100_", "grouped_mm", "aten::mm", "addmm")),
    ("moepeak", ("gather_kernel", "combine_kernel", "count_kernel", "route_kernel", "down_bwd_kernel")),
    ("sort/index", ("sort", "radix", "index", "scatter", "gather", "histc", "histogram", "cumsum", "scan")),
    ("reduction", ("reduce", "sum_", "norm")),
    ("copy/memset", ("memcpy", "memset", "copy", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "silu", "mul", "cast")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


GEMM_OPS = ("aten::_grouped_mm", "aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")


def demangle(names):
    """{name: readable name}: C++ symbols (the cutlass GEMM kernels are reported mangled)
    through c++filt where it is installed, else as they are."""
    out = {n: n for n in names}
    tool = shutil.which("c++filt")
    mangled = [n for n in names if n.startswith("_Z")]
    if tool and mangled:
        try:
            res = subprocess.run([tool], input="\n".join(mangled), capture_output=True, text=True, timeout=30)
            lines = res.stdout.splitlines()
            if res.returncode == 0 and len(lines) == len(mangled):
                out.update(zip(mangled, lines))
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def short_name(name: str, width: int = 96) -> str:
    """A kernel name that fits a table column: 'void ' dropped; when cut, a hash of the full
    name is appended so that two kernels sharing a prefix stay apart."""
    n = name[5:] if name.startswith("void ") else name
    if len(n) <= width:
        return n
    return n[:width - 7] + "~" + hashlib.sha1(name.encode()).hexdigest()[:6]


def fwd_bwd(fn, leaves, gy, stats=None):
    for t in leaves:
        t.grad = None
    bench_llep.LLEP_STATS.forward, bench_llep.LLEP_STATS.backward = {}, {}
    y = fn()
    y.backward(gy)
    if stats is not None:
        stats["fwd"] = dict(bench_llep.LLEP_STATS.forward)
        stats["bwd"] = dict(bench_llep.LLEP_STATS.backward)
    del y
    for t in leaves:
        t.grad = None


def wall_ms(fn, leaves, gy, reps):
    """Median CUDA-event ms of fwd+bwd after one warm-up (on CPU: host wall ms)."""
    fwd_bwd(fn, leaves, gy)
    times = []
    for _ in range(reps):
        if gy.is_cuda:
            torch.cuda.synchronize()
            times.append(cuda_event_ms(lambda: fwd_bwd(fn, leaves, gy)))
        else:
            t0 = time.perf_counter()
            fwd_bwd(fn, leaves, gy)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _shapes(ev) -> str:
    shapes = [sh for sh in (getattr(ev, "input_shapes", None) or []) if sh]
    return "x".join("[" + ",".join(str(d) for d in sh) + "]" for sh in shapes[:3])


def profile_one(fn, leaves, gy):
    """({kernel name: [count, total ms]}, kernel spans [(start us, end us)], stats, {GEMM op
    and input shapes: [count, ms]}): one fwd+bwd under torch.profiler; on CPU the CPU ops'
    self time stands in for kernels and their CPU time for the GEMM ops'."""
    from torch.profiler import ProfilerActivity, profile
    cuda = gy.is_cuda
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    stats = {}
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts, record_shapes=True) as prof:
        fwd_bwd(fn, leaves, gy, stats)
        if cuda:
            torch.cuda.synchronize()
    gemms = {}
    for ev in prof.events():
        if ev.name in GEMM_OPS and not str(getattr(ev, "device_type", "")).endswith("CUDA"):
            us = getattr(ev, "device_time_total", None) if cuda else ev.cpu_time_total
            if us is None:
                us = getattr(ev, "cuda_time_total", 0.0)
            c = gemms.setdefault(f"{ev.name[6:]} {_shapes(ev)}", [0, 0.0])
            c[0] += 1
            c[1] += us / 1000.0
    kern, spans = {}, []
    if cuda:
        for ev in prof.events():
            if not str(getattr(ev, "device_type", "")).endswith("CUDA"):
                continue
            t = getattr(ev, "device_time", None)
            if t is None:
                t = getattr(ev, "cuda_time", 0.0)
            c = kern.setdefault(ev.name, [0, 0.0])
            c[0] += 1
            c[1] += t / 1000.0
            spans.append((ev.time_range.start, ev.time_range.end))
    else:
        for ev in prof.key_averages():
            if ev.self_cpu_time_total > 0:
                kern[ev.key] = [ev.count, ev.self_cpu_time_total / 1000.0]
    return kern, sorted(spans), stats, gemms


def idle_gaps(spans, top=3):
    """(total idle ms between the first kernel's start and the last one's end, [largest gaps ms])."""
    if len(spans) < 2:
        return 0.0, []
    gaps, end = [], spans[0][1]
    for a, b in spans[1:]:
        if a > end:
            gaps.append((a - end) / 1000.0)
        end = max(end, b)
    return sum(gaps), sorted(gaps, reverse=True)[:top]


def side_by_side(results, arms, top):
    """The kernel table: rows (short name, class, [(count, ms) per arm]), largest first."""
    names = sorted({k for a in arms for k in results[a]["kern"]},
                   key=lambda k: -max(results[a]["kern"].get(k, [0, 0.0])[1] for a in arms))
    readable = demangle(names)
    rows = [(short_name(readable[k]), kernel_class(readable[k]), [tuple(results[a]["kern"].get(k, [0, 0.0]))
                                                                 for a in arms], readable[k]) for k in names]
    return rows[:top] if top else rows


def report(results, arms, args, flop, log):
    log(f"\nT = {args.T}, routing {args.routing}, E = {args.E}, K = {args.K}, H = {args.H}, I = {args.I}, bf16; "
        f"GEMM FLOP of the layer (18*T*K*H*I) {flop / 1e12:.2f} TFLOP")
    for a in arms:
        r = results[a]
        if "error" in r:
            log(f"\n== {a}: {r['error']}")
            continue
        busy = sum(ms for _, ms in r["kern"].values())
        gemm = sum(ms for k, (_, ms) in r["kern"].items() if kernel_class(k) == "gemm")
        idle, big = idle_gaps(r["spans"])
        log(f"\n== {a}: wall {r['wall']:.2f} ms, kernels {busy:.2f} ms (busy {busy / max(r['wall'], 1e-9):.3f}), "
            f"idle between kernels {idle:.2f} ms (largest {', '.join(f'{g:.2f}' for g in big) or '-'} ms); "
            f"GEMM {gemm:.2f} ms = {flop / 1e9 / max(gemm, 1e-9):.0f} TFLOP/s of the layer's GEMM FLOP")
        for phase in ("fwd", "bwd"):
            st = {k: v for k, v in r["stats"].get(phase, {}).items() if k != "borrowed"}
            if st:
                log(f"   llep {phase}: " + ", ".join(f"{k}={v}" for k, v in sorted(st.items())))
    ok = [a for a in arms if "error" not in results[a]]
    if not ok:
        return []
    log("\nper kernel class, ms (count):")
    head = "  " + f"{'class':14s}" + "".join(f"{a:>26s}" for a in ok)
    log(head)
    for cls in [c for c, _ in CLASSES] + ["other"]:
        cells = []
        for a in ok:
            ks = [(n, ms) for k, (n, ms) in results[a]["kern"].items() if kernel_class(k) == cls]
            cells.append(f"{sum(ms for _, ms in ks):14.2f} ({sum(n for n, _ in ks):6d})    ")
        log("  " + f"{cls:14s}" + "".join(f"{c:>26s}" for c in cells))
    log("\nGEMM ops by input shapes (the op's kernels), ms (count):")
    keys = sorted({k for a in ok for k in results[a]["gemms"]},
                  key=lambda k: -max(results[a]["gemms"].get(k, [0, 0.0])[1] for a in ok))
    log("  " + "".join(f"{a[:22]:>24s}" for a in ok) + "  op and shapes")
    for k in keys[:args.top]:
        cells = [results[a]["gemms"].get(k, [0, 0.0]) for a in ok]
        log("  " + "".join(f"{ms:14.3f} ({n:6d})  " for n, ms in cells) + f"  {k}")
    rows = side_by_side(results, ok, 0)
    diff = len(ok) > 1
    log("\nkernels, total ms (count), largest first" + (f"; diff = {ok[0]} - {ok[1]}" if diff else "") + ":")
    log("  " + "".join(f"{a[:22]:>24s}" for a in ok) + ("     diff" if diff else "") + "  class        kernel")
    for name, cls, cells, _ in rows[:args.top]:
        line = "".join(f"{ms:14.3f} ({n:6d})  " for n, ms in cells)
        if diff:
            line += f"{cells[0][1] - cells[1][1]:+9.3f}"
        log(f"  {line}  {cls:12s} {name}")
    if len(rows) > args.top:
        log(f"  ... {len(rows) - args.top} more kernels in the .csv")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results", "profiles"),
                    help="directory for the table (.txt) and the kernel rows (.csv)")
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--routing", default="balanced", choices=list(bench_llep.IMBALANCE))
    ap.add_argument("--arms", default=DEFAULT_ARMS, help="comma-separated bench_llep P = 1 arms; the first "
                                                         "two are diffed")
    ap.add_argument("--reps", type=int, default=3, help="timed fwd+bwd per arm for the wall time")
    ap.add_argument("--top", type=int, default=45, help="kernel rows printed (all go to the .csv)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (E=8, K=4, H=I=16, T=64): code paths")
    args = ap.parse_args()
    arms = bench_llep.select_arms(args.arms, 1, False)
    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        args.E, args.K, args.H, args.I = 8, 4, 16, 16
        args.T = min(args.T, 64)
    else:
        args.E, args.K, args.H, args.I = bench_llep.CONFIGS["E128_K4_H2880_I2880"]
    E, K, H, I, T, dt = args.E, args.K, args.H, args.I, args.T, torch.bfloat16
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"profile_llep_T{T}_{args.routing.replace(':', 'to')}")
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    t0 = time.monotonic()
    g = torch.Generator(device=dev).manual_seed(1234)
    wgu = (torch.randn(E, H, 2 * I, device=dev, dtype=dt, generator=g) * H ** -0.5).requires_grad_()
    wd = (torch.randn(E, I, H, device=dev, dtype=dt, generator=g) * I ** -0.5).requires_grad_()
    ids, tw0 = bench_llep.make_routing(T, E, K, bench_llep.IMBALANCE[args.routing], dev, seed=T)
    x = torch.randn(T, H, device=dev, dtype=dt, generator=g).requires_grad_()
    tw = tw0.clone().requires_grad_()
    tw_act = tw0.to(dt).requires_grad_()
    gy = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    mods = bench_llep.p1_modules(arms, E, K, H, I, wgu, wd)
    fns = bench_llep.p1_arm_fns(mods, x, ids, tw, tw_act, wgu, wd, T, K)
    results = {}
    for a in arms:
        if isinstance(fns[a], str):
            results[a] = {"error": fns[a]}
            continue
        fn, leaves = fns[a]
        try:
            wall = wall_ms(fn, leaves, gy, args.reps)
            kern, spans, stats, gemms = profile_one(fn, leaves, gy)
            results[a] = dict(wall=wall, kern=kern, spans=spans, stats=stats, gemms=gemms)
        except RuntimeError as err:  # an OOM or a library error is a result
            results[a] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"}
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"  {a}: done ({time.monotonic() - t0:.1f} s)", flush=True)
    flop = 18.0 * T * K * H * I
    rows = report(results, arms, args, flop, log)
    ok = [a for a in arms if "error" not in results[a]]
    with open(stem + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kernel", "class"] + [f"{a}_{c}" for a in ok for c in ("count", "ms")])
        for _, cls, cells, full in rows:
            w.writerow([full, cls] + [v for n, ms in cells for v in (n, round(ms, 4))])
    print(f"\nwrote {stem}.txt and .csv ({time.monotonic() - t0:.1f} s)")


if __name__ == "__main__":
    main()
