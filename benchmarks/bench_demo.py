"""The composed demo model on one GPU at increasing context, moepeak's four
schedules on vs off (plain PyTorch: dense MoE, F.cross_entropy on full logits,
torch.utils.checkpoint, torch.optim.AdamW), in one process.

For each (context, mode): a fresh model, 1 warm-up step + `--steps` timed
steps through moepeak.demo.run (the same code path as `moepeak demo`).
Recorded: peak GPU memory of the whole step (max_memory_allocated, weights
included, from an empty allocator), median tokens/s of the timed steps, OOM as
a result, and `moepeak plan`'s predicted total for the same model next to the
measured peak (with the ratio: the plan's 15% target).

    python benchmarks/bench_demo.py --out benchmarks/results            # 32k..512k
    python benchmarks/bench_demo.py --quick --out benchmarks/results    # 32k, 128k (< 3 min)
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from _common import append_results, is_oom  # noqa: E402

from moepeak import plan as P  # noqa: E402
from moepeak.demo import DEFAULTS, run  # noqa: E402
from moepeak.demo.config import available  # noqa: E402

GiB = 2 ** 30


def model_args(d):
    return ["--layers", str(d["layers"]), "--hidden", str(d["hidden"]), "--heads", str(d["heads"]),
            "--kv-heads", str(d["kv_heads"]), "--experts", str(d["experts"]), "--top-k", str(d["top_k"]),
            "--intermediate", str(d["intermediate"]), "--vocab", str(d["vocab"]), "--dtype", d["dtype"]]


def predicted(d, context, mode):
    m = P.ModelShape(layers=d["layers"], hidden=d["hidden"], experts=d["experts"], top_k=d["top_k"],
                     intermediate=d["intermediate"], vocab=d["vocab"], heads=d["heads"],
                     kv_heads=d["kv_heads"])
    # one GPU, bf16 params; plain = torch AdamW on bf16 params (m, v: 4 B/param),
    # bf16 params + grads (4 B/param); dense MoE routing on one rank (rho = 1)
    s = P.Setup(gpus=1, act_bytes=2, imbalance=1.0, plain_opt_bytes=4.0, plain_fixed_bytes=4.0)
    return P.peaks(m, s, context, mode)


def one(d, context, mode, steps):
    argv = ["--device", "cuda", "--seq-len", str(context), "--batch", "1", "--steps", str(steps + 1),
            "--no-peaks", "--no-compare", "--quiet", "--data-mb", "8"] + model_args(d)
    if mode == "plain":
        argv.append("--plain")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    try:
        r = run(argv)
    except Exception as e:  # noqa: BLE001 - an OOM is a result
        if not is_oom(e):
            raise
        gc.collect()
        torch.cuda.empty_cache()
        return {"status": "OOM", "peak": None, "tok_s": None, "wall": time.perf_counter() - t0}
    peak = torch.cuda.max_memory_allocated() - base
    times = r["step_times"][1:] or r["step_times"]
    med = statistics.median(times)
    spread = (max(times) - min(times)) / med if len(times) > 1 else 0.0
    return {"status": "ok", "peak": peak, "tok_s": context / med, "spread": spread,
            "wall": time.perf_counter() - t0, "loss": r["losses"][-1],
            "settings": f"{r['cfg'].moe}/{r['cfg'].head}/{r['cfg'].checkpoint}/{r['optimizer']}"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="32k and 128k only, 2 timed steps")
    ap.add_argument("--contexts", default=None, help="comma-separated, e.g. 32768,131072")
    ap.add_argument("--steps", type=int, default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_demo: needs a CUDA GPU")
        return 1
    d = dict(DEFAULTS["cuda"])
    ctxs = [1 << 15, 1 << 17] if a.quick else [1 << 15, 1 << 16, 1 << 17, 1 << 18, 1 << 19]
    if a.contexts:
        ctxs = [int(c) for c in a.contexts.split(",")]
    steps = a.steps or (2 if a.quick else 3)
    missing = [s for s in ("moe", "head", "checkpoint", "optimizer") if not available(s)]
    if missing:
        print(f"bench_demo: NOTE moepeak components missing in this build (plain used instead): {missing}")
    print(f"{'context':>8} {'mode':>8} {'status':>6} {'peak GiB':>9} {'plan GiB':>9} {'plan/meas':>9} "
          f"{'tok/s':>10} {'binding(plan)':>14}  settings")
    for ctx in ctxs:
        for mode in ("moepeak", "plain"):
            r = one(d, ctx, mode, steps)
            pr = predicted(d, ctx, mode)
            ratio = pr["total"] / r["peak"] if r["peak"] else None
            tok = f"{r['tok_s']:.0f}" if r["tok_s"] else "-"
            print(f"{ctx:>8} {mode:>8} {r['status']:>6} "
                  f"{(r['peak'] or 0) / GiB:>9.2f} {pr['total'] / GiB:>9.2f} "
                  f"{(f'{ratio:.2f}' if ratio else '-'):>9} "
                  f"{tok:>10} {pr['binding']:>14}  "
                  f"{r.get('settings', '')}", flush=True)
            append_results(a.out, "demo", [dict(
                context=ctx, mode=mode, status=r["status"],
                peak_gib=f"{r['peak'] / GiB:.3f}" if r["peak"] else "",
                plan_total_gib=f"{pr['total'] / GiB:.3f}",
                plan_over_measured=f"{ratio:.3f}" if ratio else "",
                tokens_per_s=f"{r['tok_s']:.1f}" if r["tok_s"] else "",
                spread=f"{r.get('spread', 0):.3f}", binding_plan=pr["binding"],
                settings=r.get("settings", ""), steps=steps,
                model=f"L{d['layers']}-H{d['hidden']}-E{d['experts']}-K{d['top_k']}-I{d['intermediate']}"
                      f"-V{d['vocab']}-{d['dtype']}")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
