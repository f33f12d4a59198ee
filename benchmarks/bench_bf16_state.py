"""StreamAdamW's bf16 optimizer state against fp32 state on the demo's loss curve.

The demo (`python -m moepeak demo`, its CPU configuration unless --device cuda: a 2-layer,
8-expert fp32 MoE LM, 4 x 256 tokens a step, lr 3e-3 with warm-up and cosine decay over
--steps) trained from the same initial weights on the same batches, all four moepeak
schedules on, once per arm:
  fp32      StreamAdamW(state_dtype=torch.float32) (the default: bitwise torch's fused AdamW)
  bf16      state_dtype=torch.bfloat16 (the demo's --state-dtype), rounding_seed 0
  bf16_s1   the same with rounding_seed 1: another draw of the stochastic rounding, so that
            bf16 vs bf16_s1 shows how far two runs apart by rounding noise alone drift
            (the demo has no flag for the seed: the run builds moepeak.stream_adamw's
            StreamAdamW, which the arm swaps for a subclass with that seed; a control that
            came out identical to bf16 is refused)

Written (benchmarks/results, with benchmarks/_common.py's run columns):
  optim_state_dtype.csv        per pair (bf16 vs fp32, bf16_s1 vs fp32, bf16_s1 vs bf16) and
                               window of --window steps (and "all"): each run's mean loss,
                               the signed mean, mean |.| and max |.| of the per-step loss
                               difference, the max relative difference, each run's loss at
                               the window's last step, median step seconds, and the host bytes
                               of each run's moments + masters (moepeak.stream_adamw.sizes)
  optim_state_dtype_steps.csv  every step of every arm: its loss

    python benchmarks/bench_bf16_state.py --steps 1000 --out benchmarks/results
(On a CPU shared with other jobs, OMP_NUM_THREADS=1 avoids thread-pool stalls; both runs of a
pair always share the thread count, recorded as `threads`.)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from _common import append_results  # noqa: E402

import moepeak.stream_adamw as stream_adamw_home  # noqa: E402
from moepeak.demo import DEFAULTS, run  # noqa: E402
from moepeak.demo.config import param_count  # noqa: E402
from moepeak.stream_adamw import sizes  # noqa: E402

ARMS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "bf16_s1": ("bfloat16", 1)}
PAIRS = (("bf16", "fp32"), ("bf16_s1", "fp32"), ("bf16_s1", "bf16"))
SUMMARY = ["device", "threads", "steps", "seed", "params", "arm", "reference", "window", "loss_mean",
           "ref_loss_mean", "mean_diff", "mean_abs_diff", "max_abs_diff", "max_rel_diff", "last_loss",
           "ref_last_loss", "step_s", "ref_step_s", "state_bytes", "ref_state_bytes"]
STEPS = ["device", "threads", "steps", "seed", "arm", "step", "loss"]


@contextlib.contextmanager
def rounding_seed(seed):
    """Inside the block, StreamAdamW as the demo builds it (moepeak.stream_adamw.StreamAdamW,
    looked up when the optimizer is made) takes rounding_seed=seed."""
    if seed is None:
        yield
        return
    base = stream_adamw_home.StreamAdamW

    class Seeded(base):
        def __init__(self, *args, **kw):
            super().__init__(*args, rounding_seed=seed, **kw)

    stream_adamw_home.StreamAdamW = Seeded
    try:
        yield
    finally:
        stream_adamw_home.StreamAdamW = base


def train(arm: str, device: str, steps: int, seed: int, extra) -> dict:
    state_dtype, rseed = ARMS[arm]
    argv = ["--device", device, "--steps", str(steps), "--seed", str(seed), "--state-dtype", state_dtype,
            "--no-compare", "--no-peaks", "--log-every", str(max(1, steps // 10))] + list(extra)
    print(f"== {arm}: demo {' '.join(argv)}" + (f", rounding_seed {rseed}" if rseed is not None else ""), flush=True)
    with rounding_seed(rseed):
        return run(argv)


def windows(n: int, width: int):
    """[(label, first, end)] over steps 0..n-1 in windows of `width`, then the whole run."""
    out = [(f"{a + 1}-{min(a + width, n)}", a, min(a + width, n)) for a in range(0, n, width)]
    return out + [("all", 0, n)]


def compare(run_a: dict, run_b: dict, width: int) -> list:
    """Per window: run_a's figures against run_b's (the reference)."""
    la, lb = run_a["losses"], run_b["losses"]
    n = min(len(la), len(lb))
    rows = []
    for label, a, b in windows(n, width):
        diffs = [x - y for x, y in zip(la[a:b], lb[a:b])]
        rows.append(dict(window=label, loss_mean=statistics.fmean(la[a:b]), ref_loss_mean=statistics.fmean(lb[a:b]),
                         mean_diff=statistics.fmean(diffs), mean_abs_diff=statistics.fmean(abs(d) for d in diffs),
                         max_abs_diff=max(abs(d) for d in diffs),
                         max_rel_diff=max(abs(d) / abs(y) for d, y in zip(diffs, lb[a:b])),
                         last_loss=la[b - 1], ref_last_loss=lb[b - 1],
                         step_s=statistics.median(run_a["step_times"][a:b] or [float("nan")]),
                         ref_step_s=statistics.median(run_b["step_times"][a:b] or [float("nan")])))
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
    runs = {arm: train(arm, a.device, a.steps, a.seed, extra) for arm in ARMS}
    if runs["bf16_s1"]["losses"] == runs["bf16"]["losses"]:
        raise RuntimeError("bench_bf16_state: the rounding_seed=1 control trained exactly like rounding_seed 0: "
                           "the demo no longer builds moepeak.stream_adamw.StreamAdamW where this arm swaps it")
    dtype_name = extra[extra.index("--dtype") + 1] if "--dtype" in extra else DEFAULTS[a.device]["dtype"]
    params = param_count(runs["fp32"]["cfg"])
    state = {arm: params * sizes.state_bytes_per_param(getattr(torch, dtype_name), getattr(torch, sd),
                                                        in_place=a.device == "cpu") for arm, (sd, _) in ARMS.items()}
    meta = dict(device=a.device, threads=torch.get_num_threads(), steps=a.steps, seed=a.seed)
    rows = [dict(meta, params=params, arm=x, reference=ref, state_bytes=state[x], ref_state_bytes=state[ref], **r)
            for x, ref in PAIRS for r in compare(runs[x], runs[ref], a.window)]
    steps = [dict(meta, arm=arm, step=r["start"] + i + 1, loss=loss) for arm, r in runs.items()
             for i, loss in enumerate(r["losses"])]
    p1 = append_results(a.out, "optim_state_dtype", rows, SUMMARY)
    p2 = append_results(a.out, "optim_state_dtype_steps", steps, STEPS)
    print(f"\n{'pair':>16} {'window':>9} {'mean':>8} {'ref mean':>8} {'mean d':>9} {'mean|d|':>8} {'max|d|':>8} "
          f"{'max rel':>8} {'last':>7} {'ref last':>8}")
    for r in rows:
        print(f"{r['arm'] + ' vs ' + r['reference']:>16} {r['window']:>9} {r['loss_mean']:>8.4f} "
              f"{r['ref_loss_mean']:>8.4f} {r['mean_diff']:>+9.2e} {r['mean_abs_diff']:>8.2e} "
              f"{r['max_abs_diff']:>8.2e} {r['max_rel_diff']:>8.2e} {r['last_loss']:>7.4f} {r['ref_last_loss']:>8.4f}")
    print("host state (moments + masters): " + ", ".join(f"{arm} {b} B" for arm, b in state.items()))
    print(f"wrote {p1} and {p2}")
    return rows


if __name__ == "__main__":
    main()
