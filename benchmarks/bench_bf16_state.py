"""StreamAdamW's bf16 optimizer state against fp32 state on the demo's loss curve.

The demo (`python -m moepeak demo`, its CPU configuration unless --device cuda: a 2-layer,
8-expert fp32 MoE LM, 4 x 256 tokens a step, lr 3e-3 with warm-up and cosine decay)
trained twice from the same initial weights on the same batches, all four moepeak
schedules on, once with StreamAdamW(state_dtype=torch.float32) and once with
state_dtype=torch.bfloat16 (--state-dtype of the demo); the LR schedule spans --steps.

Written (benchmarks/results, with benchmarks/_common.py's run columns):
  optim_state_dtype.csv        one row per window of --window steps and one for all steps:
                               mean loss of each run, mean and max |loss diff|, max relative
                               diff, each run's loss at the window's last step, median step
                               seconds, and the host bytes of each run's moments + masters
                               (moepeak.stream_adamw.sizes, the demo's params in their dtype)
  optim_state_dtype_steps.csv  every step: both losses and their difference

    python benchmarks/bench_bf16_state.py --steps 1000 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from _common import append_results  # noqa: E402

from moepeak.demo import DEFAULTS, run  # noqa: E402
from moepeak.demo.config import param_count  # noqa: E402
from moepeak.stream_adamw import sizes  # noqa: E402

SUMMARY = ["device", "steps", "seed", "params", "window", "loss_fp32_mean", "loss_bf16_mean", "mean_abs_diff",
           "max_abs_diff", "max_rel_diff", "last_loss_fp32", "last_loss_bf16", "step_s_fp32", "step_s_bf16",
           "state_bytes_fp32", "state_bytes_bf16"]
STEPS = ["device", "steps", "seed", "step", "loss_fp32", "loss_bf16", "diff"]


def train(device: str, steps: int, seed: int, state_dtype: str, extra) -> dict:
    argv = ["--device", device, "--steps", str(steps), "--seed", str(seed), "--state-dtype", state_dtype,
            "--no-compare", "--no-peaks", "--log-every", str(max(1, steps // 10))] + list(extra)
    print(f"== demo, StreamAdamW state_dtype={state_dtype}: {' '.join(argv)}", flush=True)
    return run(argv)


def windows(n: int, width: int):
    """[(label, first, end)] over steps 0..n-1 in windows of `width`, then the whole run."""
    out = [(f"{a + 1}-{min(a + width, n)}", a, min(a + width, n)) for a in range(0, n, width)]
    return out + [("all", 0, n)]


def summarize(f32: dict, b16: dict, meta: dict, width: int, param_dtype: torch.dtype) -> list:
    lf, lb = f32["losses"], b16["losses"]
    n = min(len(lf), len(lb))
    params = meta["params"]
    state = {sd: params * sizes.state_bytes_per_param(param_dtype, sd, in_place=meta["device"] == "cpu")
             for sd in (torch.float32, torch.bfloat16)}
    rows = []
    for label, a, b in windows(n, width):
        diffs = [abs(x - y) for x, y in zip(lf[a:b], lb[a:b])]
        rows.append(dict(meta, window=label, loss_fp32_mean=statistics.fmean(lf[a:b]),
                         loss_bf16_mean=statistics.fmean(lb[a:b]), mean_abs_diff=statistics.fmean(diffs),
                         max_abs_diff=max(diffs), max_rel_diff=max(d / abs(x) for d, x in zip(diffs, lf[a:b])),
                         last_loss_fp32=lf[b - 1], last_loss_bf16=lb[b - 1],
                         step_s_fp32=statistics.median(f32["step_times"][a:b] or [float("nan")]),
                         step_s_bf16=statistics.median(b16["step_times"][a:b] or [float("nan")]),
                         state_bytes_fp32=state[torch.float32], state_bytes_bf16=state[torch.bfloat16]))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0, help="the demo's initialisation and data seed")
    ap.add_argument("--window", type=int, default=100, help="steps per summary row")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--demo-args", default="", help="more demo arguments, e.g. '--dtype bfloat16' (one string)")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.window < 1:
        raise SystemExit(f"bench_bf16_state: --steps and --window must be >= 1, got {a.steps} and {a.window}")
    extra = a.demo_args.split()
    f32 = train(a.device, a.steps, a.seed, "float32", extra)
    b16 = train(a.device, a.steps, a.seed, "bfloat16", extra)
    dtype_flag = extra[extra.index("--dtype") + 1] if "--dtype" in extra else DEFAULTS[a.device]["dtype"]
    meta = dict(device=a.device, steps=a.steps, seed=a.seed, params=param_count(f32["cfg"]))
    rows = summarize(f32, b16, meta, a.window, getattr(torch, dtype_flag))
    steps = [dict(device=a.device, steps=a.steps, seed=a.seed, step=f32["start"] + i + 1, loss_fp32=x, loss_bf16=y,
                  diff=y - x) for i, (x, y) in enumerate(zip(f32["losses"], b16["losses"]))]
    p1 = append_results(a.out, "optim_state_dtype", rows, SUMMARY)
    p2 = append_results(a.out, "optim_state_dtype_steps", steps, STEPS)
    print(f"\n{'window':>10} {'fp32 mean':>10} {'bf16 mean':>10} {'mean|d|':>9} {'max|d|':>9} {'max rel':>8} "
          f"{'last fp32':>10} {'last bf16':>10}")
    for r in rows:
        print(f"{r['window']:>10} {r['loss_fp32_mean']:>10.4f} {r['loss_bf16_mean']:>10.4f} "
              f"{r['mean_abs_diff']:>9.2e} {r['max_abs_diff']:>9.2e} {r['max_rel_diff']:>8.2e} "
              f"{r['last_loss_fp32']:>10.4f} {r['last_loss_bf16']:>10.4f}")
    print(f"host state (moments + masters): fp32 {rows[-1]['state_bytes_fp32']} B, bf16 "
          f"{rows[-1]['state_bytes_bf16']} B\nwrote {p1} and {p2}")
    return rows


if __name__ == "__main__":
    main()
