"""Benchmark: optimizer step with fp32 AdamW state offloaded to the CPU.

bf16 params and grads on the GPU; fp32 master/exp_avg/exp_avg_sq in host RAM.
Same process, same params, one arm at a time (host memory is freed between):
  serial_foreach  D2H all grads -> CPU AdamW(foreach) on fp32 -> H2D params
                  (what FSDP2's CPUOffloadPolicy does)
  serial_fused    the same with AdamW(fused=True)
  torchao         torchao.optim.CPUOffloadOptimizer(AdamW fused, offload_gradients=False)
                  if installed (its hooks fired at step start, see TorchaoArm)
                  (note: its CPU state has the params' dtype, bf16 here)
  stream_adamw    moepeak.StreamAdamW (bucket pipeline)
  stream_adamw_bf16state  the same with state_dtype=torch.bfloat16 (bf16 exp_avg/exp_avg_sq,
                  stochastic rounding; 8 instead of 12 B/param of host state), with
                  --state-dtype bfloat16 or both (the default float32 runs the fp32 arm only;
                  the kernel-alone row gets its bf16-state twin the same way)
plus: pinned D2H/H2D bandwidth, torch's fused CPU AdamW alone on fp32 (the
DRAM floor, 28 B/param; floor32 adds the 4 B/param of pinned DMA), moepeak's C kernel alone (same threads), and the
floor max(PCIe time, DRAM time). Layouts: "large" (tensors of 64 Mi
elements) and "experts" (2048 x 1408 expert matrices).

Columns: step_s = median wall time of step() with the GPU synchronized before;
exposed_s = median from step start (end of backward) to params ready on the
GPU (synchronize after); gpu_added = peak max_memory_allocated during the step
minus before; host_rss, pinned bytes. An OOM is recorded, not raised.

  python benchmarks/bench_optim.py --out benchmarks/results [--quick] [--state-dtype both]
"""
import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import append_results, wall_times_s  # noqa: E402
import moepeak  # noqa: E402
from moepeak.stream_adamw import StreamAdamWOptions  # noqa: E402
from moepeak.stream_adamw import sizes as stream_sizes  # noqa: E402

COLS = ["threads", "params", "layout", "arm", "step_s", "step_min_s", "step_max_s",
        "exposed_s", "vs_floor", "gpu_added", "host_rss", "pinned", "pcie_s", "dram_GBs", "d2h_GBs", "h2d_GBs", "note"]
EXPERT = (2048, 1408)
LARGE = 1 << 26


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# Host bytes per parameter each arm needs (fp32 master/grad/m/v, pinned
# staging, foreach temporaries); an arm that would not fit in 90% of
# MemAvailable is recorded as skipped instead of letting the OOM killer in.
HOST_BYTES = {"serial_foreach": 28, "serial_fused": 20, "torchao": 10, "cpu_kernels": 16,
              "stream_adamw": stream_sizes.state_bytes_per_param(torch.bfloat16),
              "stream_adamw_bf16state": stream_sizes.state_bytes_per_param(torch.bfloat16, torch.bfloat16)}


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def fits(arm, total):
    return HOST_BYTES[arm] * total <= 0.9 * mem_available()


def make_params(total, layout):
    if layout == "large":
        shapes = [(LARGE,)] * (total // LARGE)
    else:
        k = EXPERT[0] * EXPERT[1]
        shapes = [EXPERT] * (total // k)
        if total % k:
            shapes.append((total % k,))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ps = [torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16).mul_(0.02).requires_grad_(True)
          for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen, dtype=torch.bfloat16).mul_(1e-3)
    return ps


class SerialOffload:
    """D2H every grad, CPU AdamW on fp32 masters, H2D every param; serial."""

    def __init__(self, params, foreach):
        self.params = params
        self.masters = [p.detach().float().cpu() for p in params]
        for m in self.masters:
            m.grad = torch.empty_like(m)
        self.gbuf = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in params]
        self.pbuf = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in params]
        self.opt = torch.optim.AdamW(self.masters, lr=1e-4, foreach=foreach, fused=not foreach)
        self.pinned = sum(b.numel() * b.element_size() for b in self.gbuf + self.pbuf)

    def step(self):
        for b, p in zip(self.gbuf, self.params):
            b.copy_(p.grad, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        for m, b in zip(self.masters, self.gbuf):
            m.grad.copy_(b)
        self.opt.step()
        for b, m, p in zip(self.pbuf, self.masters, self.params):
            b.copy_(m)
            p.data.copy_(b, non_blocking=True)


class TorchaoArm:
    """torchao.optim.CPUOffloadOptimizer (torchao 0.17 signature). It issues
    each grad's D2H copy from a post-accumulate-grad hook during backward and
    steps only the params whose hook fired; there is no backward here (grads
    are set once), so step() fires the hooks itself, as the end of backward
    would, then steps: timed from end of backward like the other arms (in
    real training those D2H copies may overlap the backward, which this
    cannot credit)."""

    def __init__(self, params):
        from torchao.optim import CPUOffloadOptimizer
        self.params = params
        self.opt = CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True, offload_gradients=False, lr=1e-4)
        self.pinned = 2 * sum(p.numel() * p.element_size() for p in params)  # its pinned param + grad copies

    def step(self):
        for p in self.params:
            for hook in (p._post_accumulate_grad_hooks or {}).values():
                hook(p)
        self.opt.step()


def time_arm(step, warmup, reps):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    steps, exposed = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        steps.append(t1 - t0)
        exposed.append(t2 - t0)
    return steps, exposed, torch.cuda.max_memory_allocated() - base


def bandwidth(nbytes=1 << 30):
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    res = {}
    for name, (dst, src) in {"d2h": (h, d), "h2d": (d, h)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t = []
        for _ in range(3):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            t.append(time.perf_counter() - t0)
        res[name] = nbytes / min(t)
    del h, d
    return res


def cpu_kernels(total, threads, reps, bf16_state=False):
    """torch fused CPU AdamW alone vs moepeak's C kernel alone, fp32 params, same tensors
    (bf16_state: also the kernel with bf16 exp_avg/exp_avg_sq)."""
    # constant values: the step's cost does not depend on them, and CPU randn of
    # 2^30 elements would take longer than the measurement
    p = torch.full((total,), 0.02).requires_grad_(True)
    p.grad = torch.full((total,), 1e-3)
    out = {}
    makers = (("torch_fused_cpu_alone", lambda: torch.optim.AdamW([p], lr=1e-4, fused=True)),
              ("moepeak_kernel_alone", lambda: moepeak.StreamAdamW([p], lr=1e-4, threads=threads)))
    if bf16_state:
        makers += (("moepeak_kernel_alone_bf16state",
                    lambda: moepeak.StreamAdamW([p], lr=1e-4, threads=threads, state_dtype=torch.bfloat16)),)
    for name, make in makers:  # one optimizer (8 B/param of state) alive at a time
        opt = make()
        out[name] = statistics.median(wall_times_s(opt.step, reps, warmup=1))
        del opt
        gc.collect()
    p = None  # free now (the timing closures still name them)
    gc.collect()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--bucket-mb", type=float, default=StreamAdamWOptions.bucket_mb)
    ap.add_argument("--state-dtype", choices=("float32", "bfloat16", "both"), default="float32",
                    help="StreamAdamW's state_dtype arms (default %(default)s: the fp32 arm only)")
    args = ap.parse_args()
    state_arms = {"float32": ("stream_adamw",), "bfloat16": ("stream_adamw_bf16state",),
                  "both": ("stream_adamw", "stream_adamw_bf16state")}[args.state_dtype]
    torch.set_num_threads(args.threads)
    sizes = [1 << 30] if args.quick else [1 << 30, 1 << 32]
    warmup, reps = (1, 2) if args.quick else (2, 5)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(threads=args.threads)
    rows = []

    def record(**kw):
        row = dict(meta, **kw)
        rows.append(row)
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)

    bw = bandwidth()
    record(params=0, layout="-", arm="pinned_bw", d2h_GBs=bw["d2h"] / 1e9, h2d_GBs=bw["h2d"] / 1e9)
    for total in sizes:
        try:
            if not fits("cpu_kernels", total):
                raise MemoryError(f"needs ~{HOST_BYTES['cpu_kernels'] * total / 2**30:.0f} GiB of host RAM")
            k = cpu_kernels(total, args.threads, reps, bf16_state="stream_adamw_bf16state" in state_arms)
            for name, t in k.items():
                record(params=total, layout="fp32-cpu", arm=name, step_s=t, dram_GBs=28 * total / t / 1e9)
        except (MemoryError, RuntimeError) as e:
            record(params=total, layout="fp32-cpu", arm="cpu_kernels", note=f"failed: {type(e).__name__}: {e}"[:200])
            k = {}
        # floor28: the kernel's own traffic (28 B/param at torch fused's measured
        # DRAM rate); floor32: + 2 B/param for each pinned DMA (D2H grads, H2D
        # params), which also crosses DRAM: the floor of any offloaded step.
        pcie = max(2 * total / bw["d2h"], 2 * total / bw["h2d"])
        t_fused = k.get("torch_fused_cpu_alone", 0.0)
        floor = max(pcie, t_fused)
        floor32 = max(pcie, t_fused * 32 / 28)
        record(params=total, layout="-", arm="floor", step_s=floor, pcie_s=pcie,
               dram_GBs=28 * total / t_fused / 1e9 if t_fused else float("nan"))
        record(params=total, layout="-", arm="floor32", step_s=floor32, pcie_s=pcie)
        for layout in ("large", "experts"):
            arms = [("serial_foreach", lambda ps: SerialOffload(ps, True)),
                    ("serial_fused", lambda ps: SerialOffload(ps, False)),
                    ("torchao", TorchaoArm),
                    ("stream_adamw", lambda ps: moepeak.StreamAdamW(ps, lr=1e-4, threads=args.threads,
                                                                     bucket_mb=args.bucket_mb)),
                    ("stream_adamw_bf16state", lambda ps: moepeak.StreamAdamW(
                        ps, lr=1e-4, threads=args.threads, bucket_mb=args.bucket_mb, state_dtype=torch.bfloat16))]
            arms = [a for a in arms if not a[0].startswith("stream_adamw") or a[0] in state_arms]
            for arm, make in arms:
                params = opt = None
                if not fits(arm, total):
                    record(params=total, layout=layout, arm=arm,
                           note=f"skipped: needs ~{HOST_BYTES[arm] * total / 2**30:.0f} GiB host RAM")
                    continue
                try:
                    params = make_params(total, layout)
                    if arm == "torchao":
                        try:
                            import torchao  # noqa: F401
                        except ImportError:
                            record(params=total, layout=layout, arm=arm, note="skipped: torchao not installed")
                            continue
                    opt = make(params)
                    pinned = opt.pinned if hasattr(opt, "pinned") else None
                    steps, exposed, gpu_added = time_arm(opt.step, warmup, reps)
                    if pinned is None:
                        pinned = opt.pinned_bytes()
                    med = statistics.median(steps)
                    record(params=total, layout=layout, arm=arm, step_s=med, step_min_s=min(steps),
                           step_max_s=max(steps), exposed_s=statistics.median(exposed), gpu_added=gpu_added,
                           host_rss=rss(), pinned=pinned, vs_floor=statistics.median(exposed) / floor)
                except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError, ImportError, AttributeError) as e:
                    record(params=total, layout=layout, arm=arm, note=f"failed: {type(e).__name__}: {e}"[:200])
                finally:
                    del params, opt
                    gc.collect()
                    torch.cuda.empty_cache()
    path = append_results(args.out, "optim", [{k: v for k, v in r.items() if k in COLS} for r in rows], COLS)
    print(f"\nwrote {len(rows)} rows to {path}")
    summary(rows, args.threads)


def summary(rows, threads):
    """One table of every timed row, then the issue's targets, pass/fail."""
    print(f"\nthreads={threads}\n{'params':>12} {'layout':>8} {'arm':>22} {'step_s':>8} {'exposed_s':>9} "
          f"{'vs_floor':>8} {'gpu_added':>10} {'pinned':>12} {'rss':>14}  note")
    for r in rows:
        if "step_s" in r or "note" in r:
            print(f"{r['params']:>12} {r['layout']:>8} {r['arm']:>22} {r.get('step_s', float('nan')):>8.3f} "
                  f"{r.get('exposed_s', float('nan')):>9.3f} {r.get('vs_floor', float('nan')):>8.3f} "
                  f"{r.get('gpu_added', ''):>10} {r.get('pinned', ''):>12} {r.get('host_rss', ''):>14}  "
                  f"{r.get('note', '')}")
    t = {(r["params"], r["layout"], r["arm"]): r for r in rows}

    def val(p, lay, arm, col="exposed_s"):
        r = t.get((p, lay, arm))
        return r.get(col) if r else None

    print("\ntargets (issue 2, at 2^30 params):")
    for p in sorted({r["params"] for r in rows if r["params"]}):
        checks = []
        kern, tf = val(p, "fp32-cpu", "moepeak_kernel_alone", "step_s"), val(p, "fp32-cpu", "torch_fused_cpu_alone",
                                                                               "step_s")
        checks.append(("C kernel alone <= torch fused CPU alone", kern, tf, kern is not None and tf is not None
                       and kern <= tf))
        f28, f32 = val(p, "-", "floor", "step_s"), val(p, "-", "floor32", "step_s")
        for lay in ("large", "experts"):
            s, b = val(p, lay, "stream_adamw"), val(p, lay, "stream_adamw_bf16state")
            if b is not None:
                checks.append((f"{lay}: stream_adamw_bf16state exposed_s, info", b, None, None))
                if s is not None:
                    checks.append((f"{lay}: stream_adamw_bf16state / stream_adamw, info", b / s, None, None))
            if s is None:
                if b is None:
                    checks.append((f"{lay}: stream_adamw ran", None, None, False))
                continue
            if p == 1 << 30:
                checks.append((f"{lay}: stream_adamw <= 0.31 s", s, 0.31, s <= 0.31))
            if f28:
                checks.append((f"{lay}: stream_adamw <= 1.15 x floor28 ({f28:.3f} s)", s / f28, 1.15,
                               s <= 1.15 * f28))
            if f32:
                checks.append((f"{lay}: stream_adamw / floor32 ({f32:.3f} s), info", s / f32, None, None))
            for arm, want in (("serial_fused", 1.65), ("serial_foreach", 5.0), ("torchao", None)):
                o = val(p, lay, arm)
                if o is not None:
                    checks.append((f"{lay}: speedup vs {arm}" + (f" >= {want}" if want else ", info"), o / s, want,
                                   None if want is None else o / s >= want))
        print(f"  params={p}")
        for name, got, want, ok in checks:
            verdict = "info" if ok is None else ("PASS" if ok else "FAIL")
            g = "n/a" if got is None else f"{got:.3f}"
            w = "" if want is None else f" (target {want:.3f})" if isinstance(want, float) else ""
            print(f"    {verdict:4}  {name}: {g}{w}")

if __name__ == "__main__":
    main()
