"""Plots (PNG) of benchmarks/results/<component>.csv: one figure per component, each
arm's latest row per setting (the newest timestamp wins), so a re-run replaces the bars
it re-measured.

    pip install -e ".[plot]"      # matplotlib
    python benchmarks/plot_results.py [--results benchmarks/results] [--out DIR] [COMPONENT ...]

Writes DIR/<component>.png (DIR defaults to the results folder, where PNGs are
git-ignored). A component whose CSV is missing or has no ok rows is reported and skipped.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
Row = Dict[str, str]


def read_rows(path: str) -> List[Row]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def number(text: str) -> float:
    """The cell as a float; nan for an empty or non-numeric cell (an OOM row's time)."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def latest(rows: Sequence[Row], key: Callable[[Row], Tuple]) -> Dict[Tuple, Row]:
    """key -> the row with the newest timestamp among rows with that key (ISO-8601 strings
    order as times; a date alone sorts before every time of that day)."""
    out: Dict[Tuple, Row] = {}
    for r in rows:
        k = key(r)
        if k not in out or r["timestamp"] >= out[k]["timestamp"]:
            out[k] = r
    return out


def natural_key(text: str) -> List:
    """Orders "T=8192" before "T=32768": digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


# Ring-DTP's CSV also holds design experiments' arms (chunk sizes, error studies, round-robin
# rows); the plot shows the op's default against the baselines.
RING_DTP_ARMS = ("naive", "naive_compile", "chunked_torch", "liger_flce_fp32acc", "cce", "moepeak_auto")

# component -> (which rows, setting shown on the x axis, bar series, [(column, y label, log axis)], title)
Spec = Tuple[Callable[[Row], bool], Callable[[Row], str], Callable[[Row], str], List[Tuple[str, str, bool]], str]
SPECS: Dict[str, Spec] = {
    "ring_dtp": (lambda r: r["status"] == "ok" and r["arm"] in RING_DTP_ARMS and r["H"] == "4096"
                 and r["V"] == "151936",
                 lambda r: f"T={r['T']}", lambda r: r["arm"],
                 [("median_ms", "fwd+bwd ms", False), ("peak_gib", "peak above inputs, GiB", True)],
                 "Ring-DTP, one GPU, H=4096, V=151936"),
    "ring_dtp_dist": (lambda r: r["status"] == "ok" and r["peak_gib"] != "",
                      lambda r: f"P={r['P']} T/rank={r['T_per_rank']}", lambda r: f"{r['arm']} ({r['transport']})",
                      [("ms", "fwd+bwd ms", False), ("peak_gib", "peak per rank, GiB", True)],
                      "Ring-DTP, vocabulary sharded over P GPUs"),
    "llep": (lambda r: r["status"] == "ok",
             lambda r: f"P={r['P']} {r['config']}\nT={r['T']} {r['imbalance']}", lambda r: r["arm"],
             [("ms_fwd_bwd", "fwd+bwd ms", True), ("peak_gib", "peak GiB", True)],
             "PipelinedLLEP against the MoE layer baselines"),
    "sco": (lambda r: r["status"] == "ok", lambda r: f"T={r['T']} L={r['L']}", lambda r: r["arm"],
            [("step_ms_median", "step ms", True), ("peak_above_base_gib", "peak above weights+grads, GiB", True)],
            "SCO against activation checkpointing"),
    "optim": (lambda r: r["step_s"] != "" and r["arm"] not in ("pinned_bw",),
              lambda r: f"{int(number(r['params'])) >> 20} Mi params\n{r['layout']}", lambda r: r["arm"],
              [("step_s", "optimizer step s", False)], "StreamAdamW against CPU-offloaded AdamW"),
    "demo": (lambda r: r["status"] == "ok", lambda r: f"context {r['context']}", lambda r: r["mode"],
             [("peak_gib", "peak GiB", True), ("tokens_per_s", "tokens/s", False)],
             "The composed demo model, one GPU: moepeak against plain PyTorch"),
    "demo_reach": (lambda r: r["status"] == "ok", lambda r: f"{int(r['seq_len']) >> 10}k", lambda r: r["arm"],
                   [("peak_gib", "peak per rank, GiB", True), ("tokens_per_s", "tokens/s", False)],
                   "The demo model at P=2 with context parallelism: reach"),
    "transport": (lambda r: r["status"] == "ok", lambda r: f"{int(r['bytes']) >> 10} KiB",
                  lambda r: f"{r['transport']} {r['op']} x{r['world_size']}",
                  [("gbps", "GB/s", True)], "Transport: moepeak's NCCL calls against torch.distributed"),
    "ceilings": (lambda r: True, lambda r: r["metric"], lambda r: r["unit"], [("value", "value", True)],
                 "Machine ceilings"),
}


def plot_component(name: str, rows: Sequence[Row], out_path: str) -> Optional[str]:
    """Grouped bars of the component's latest ok rows, one panel per metric; returns the PNG
    path, or None when no row qualifies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keep, setting, series, metrics, title = SPECS[name]
    rows = [r for r in rows if keep(r)]
    if not rows:
        return None
    cells = latest(rows, lambda r: (setting(r), series(r)))
    settings = sorted(dict.fromkeys(setting(r) for r in rows), key=natural_key)
    arms = list(dict.fromkeys(series(r) for r in rows))
    width = 0.8 / len(arms)
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(9.0, 0.25 * len(settings) * len(arms) + 4.0),
                                                         3.6 * len(metrics)), squeeze=False)
    for ax, (column, label, log) in zip(axes[:, 0], metrics):
        for i, arm in enumerate(arms):
            ys = [number(cells[(s, arm)][column]) if (s, arm) in cells else math.nan for s in settings]
            xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(settings))]
            ax.bar(xs, [0 if math.isnan(y) else y for y in ys], width, label=arm)
        ax.set_xticks(range(len(settings)))
        ax.set_xticklabels(settings, fontsize=8)
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    newest = max(r["timestamp"] for r in cells.values())
    commits = sorted({r["commit"] for r in cells.values()})
    gpus = sorted({r["gpu"] for r in cells.values()})
    fig.suptitle(f"{title}\n{', '.join(gpus)}; latest row per bar, newest {newest[:16]}; "
                 f"commit {', '.join(commits)}", fontsize=10)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("components", nargs="*", help=f"which CSVs to plot (default: all of {sorted(SPECS)})")
    ap.add_argument("--results", default=os.path.join(HERE, "results"), help="folder of <component>.csv")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: --results)")
    a = ap.parse_args(argv)
    unknown = sorted(set(a.components) - set(SPECS))
    if unknown:
        ap.error(f"unknown components {unknown}; choose from {sorted(SPECS)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_results: needs matplotlib (pip install -e \".[plot]\")", file=sys.stderr)
        return 1
    out = a.out or a.results
    os.makedirs(out, exist_ok=True)
    for name in a.components or sorted(SPECS):
        path = os.path.join(a.results, name + ".csv")
        if not os.path.exists(path):
            print(f"{name}: no {path}, skipped")
            continue
        made = plot_component(name, read_rows(path), os.path.join(out, name + ".png"))
        print(f"{name}: {made}" if made else f"{name}: no ok rows, skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
