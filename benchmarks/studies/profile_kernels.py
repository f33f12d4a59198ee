"""Where the time goes: a kernel-level profile of the Ring-DTP and PipelinedLLEP
hot paths on one GPU, next to the baselines they are measured against.

For each case: wall time of one fwd+bwd (CUDA events, median of 5), the sum of
GPU kernel time inside it (torch.profiler), their ratio ("busy": below ~0.97 the
GPU waits on the host), and the top kernels by total time. Also the three Ring-DTP
GEMMs alone at several chunk sizes (TFLOP/s each), which says how far the chunked
GEMMs sit from the large-GEMM rate.

  python benchmarks/profile_kernels.py --out DIR [--what ring,llep,gemms]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import moepeak  # noqa: E402
from _common import cuda_time_ms, ring_dtp_options  # noqa: E402


def _time(fn, iters=5, warmup=2):
    return cuda_time_ms(fn, reps=iters, warmup=warmup)


def profile(name, fn, log, top=14, cpu_table=False):
    ms = _time(fn)
    from torch.profiler import ProfilerActivity, profile as tprof, record_function
    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("mp_step"):
            fn()
        torch.cuda.synchronize()
    kern = {}
    for ev in prof.events():
        if getattr(ev, "device_type", None) is not None and str(ev.device_type).endswith("CUDA"):
            t = getattr(ev, "device_time", None)
            if t is None:
                t = getattr(ev, "cuda_time", 0.0)
            k = ev.name[:90]
            c, s = kern.get(k, (0, 0.0))
            kern[k] = (c + 1, s + t / 1000.0)
    busy = sum(s for _, s in kern.values())
    log(f"\n== {name}: wall {ms:.2f} ms, kernels {busy:.2f} ms, busy {busy / ms:.3f}")
    for k, (c, s) in sorted(kern.items(), key=lambda kv: -kv[1][1])[:top]:
        log(f"  {s:9.2f} ms {c:6d}x  {k}")
    _gaps(prof, log)
    if cpu_table:
        log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    return ms, busy


def _gaps(prof, log, top=4):
    """Where the GPU sat idle inside the profiled call: the largest gaps between
    consecutive kernels (one stream), with the kernels on either side."""
    ks = []
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA") and getattr(ev, "time_range", None) is not None:
            ks.append((ev.time_range.start, ev.time_range.end, ev.name[:50]))
    ks.sort()
    if len(ks) < 2:
        return
    step = [ev for ev in prof.events() if ev.name == "mp_step"]
    if step:
        c0, c1 = step[0].time_range.start, step[0].time_range.end
        log(f"  host: the call took {(c1 - c0) / 1000.0:.2f} ms of CPU; first kernel began "
            f"{(ks[0][0] - c0) / 1000.0:.2f} ms after the call, last kernel ended "
            f"{(max(b for _, b, _ in ks) - c1) / 1000.0:.2f} ms after it returned")
    gaps = []
    end, prev = ks[0][1], ks[0][2]
    for a, b, n in ks[1:]:
        if a > end:
            gaps.append((a - end, prev, n))
        if b > end:
            end, prev = b, n
    total = sum(g for g, _, _ in gaps) / 1000.0
    span = (end - ks[0][0]) / 1000.0
    log(f"  idle between the first and last kernel: {total:.2f} ms of {span:.2f} ms, {len(gaps)} gaps; largest:")
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        log(f"    {g / 1000.0:7.3f} ms  after {a}  before {b}")


def ring_cases(log):
    T, H, V = 32768, 4096, 151936
    torch.manual_seed(0)
    x = (torch.randn(T, H, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda") * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, V, (T,), device="cuda")

    def step(loss_fn):
        def f():
            x.grad = w.grad = None
            loss_fn().backward()
        return f
    comp = torch.compile(lambda a, b, c: F.cross_entropy(F.linear(a, b).float(), c))
    profile("ring: naive + torch.compile", step(lambda: comp(x, w, y)), log)
    profile("ring: moepeak default (fused_lowp, centered at this shape's 16 chunks)",
            step(lambda: moepeak.linear_cross_entropy(x, w, y)), log, cpu_table=True)
    uncentered = ring_dtp_options(center_chunks=1 << 30)  # what the centering adds: the same op without it
    profile("ring: moepeak default, uncentered",
            step(lambda: moepeak.linear_cross_entropy(x, w, y, options=uncentered)), log)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        lg = LigerFusedLinearCrossEntropyLoss(accum_dtype=torch.float32)
        profile("ring: liger flce fp32acc", step(lambda: lg(w, x, y)), log)
    except Exception as e:  # optional baseline
        log(f"liger unavailable: {e}")


def gemm_cases(log):
    H, V = 4096, 151936
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16)
    dw = torch.zeros(V, H, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _time(lambda: a @ a, iters=10)
    log(f"\n== GEMMs: square 8192 bf16 {2 * 8192 ** 3 / ms / 1e9:.0f} TFLOP/s")
    for ct in (864, 1728, 1792, 2048, 2304, 3456, 4096):
        x = torch.randn(ct, H, device="cuda", dtype=torch.bfloat16)
        z = torch.empty(ct, V, device="cuda", dtype=torch.bfloat16)
        dx = torch.empty(ct, H, device="cuda", dtype=torch.bfloat16)
        fl = 2 * ct * V * H / 1e9
        t1 = _time(lambda: torch.mm(x, w.t(), out=z), iters=10)
        t2 = _time(lambda: torch.mm(z, w, out=dx), iters=10)
        t3 = _time(lambda: dw.addmm_(z.t(), x), iters=10)
        log(f"  ct={ct:5d}: Z {t1:6.3f} ms {fl / t1:5.0f} | dX {t2:6.3f} ms {fl / t2:5.0f} | "
            f"dW+= {t3:6.3f} ms {fl / t3:5.0f} TFLOP/s | per token {(t1 + t2 + t3) / ct * 1e3:.2f} us")


def llep_cases(log):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_llep import grouped_mm_layer, make_routing
    from moepeak.llep import llep_moe
    E, K, H, I = 128, 4, 2880, 2880
    torch.manual_seed(0)
    wgu = (torch.randn(E, H, 2 * I, device="cuda") * 0.02).bfloat16().requires_grad_()
    wd = (torch.randn(E, I, H, device="cuda") * 0.02).bfloat16().requires_grad_()
    for T in (16384, 262144):
        x = torch.randn(T, H, device="cuda").bfloat16().requires_grad_()
        gy = torch.randn(T, H, device="cuda").bfloat16()
        for frac in (0.0, 0.95):
            ids, tw = make_routing(T, E, K, frac, "cuda", 0)
            tw.requires_grad_()

            def step(layer):
                def f():
                    x.grad = tw.grad = wgu.grad = wd.grad = None
                    layer(x, ids, tw, wgu, wd).backward(gy)
                return f
            profile(f"llep: grouped_mm T={T} imb={frac}", step(grouped_mm_layer), log, top=8)
            profile(f"llep: moepeak T={T} imb={frac}", step(llep_moe), log)
        x = gy = None  # free now (the timing closures still name them)
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--what", default="gemms,ring,llep")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    f = open(os.path.join(a.out, "profile_kernels.txt"), "a")

    def log(s):
        print(s, flush=True)
        f.write(s + "\n")
        f.flush()
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    for w in a.what.split(","):
        {"gemms": gemm_cases, "ring": ring_cases, "llep": llep_cases}[w](log)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
