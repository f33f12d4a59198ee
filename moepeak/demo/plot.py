"""The demo's PNG: one panel per thing the run measured, none left empty.

    loss        moepeak's loss per global step and its trailing 10-step mean; plain
                PyTorch's (same weights, same batches) drawn over it for the steps it ran
    difference  |moepeak - plain PyTorch| per step (log scale; only with a comparison)
    peaks       the four measured peaks, moepeak vs plain PyTorch (single-process runs)
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

MiB = 2 ** 20
SMOOTH_STEPS = 10  # the loss panel's trailing mean
# One colour per arm in every panel (the loss curves and the peak bars); the difference
# between the arms is neither, so it is drawn in grey.
COLORS = {"moepeak": "tab:blue", "plain": "tab:orange", "difference": "0.35"}


def plot_run(path: str, losses: List[float], start: int, plain: Dict, table: Optional[List[Dict]],
             title: str, say: Callable[..., None]) -> bool:
    """Write the PNG to `path`; False (and a message) when matplotlib is absent.
    losses: moepeak's, for global steps 1..len(losses) (a resumed run includes the
    saved ones); plain["losses"]: plain PyTorch's for steps start+1.. ."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("moepeak demo: matplotlib is not installed (pip install -e \".[plot]\" in the moepeak checkout, "
            "or pip install matplotlib); skipping --plot")
        return False
    plain_losses = plain.get("losses") or []
    mine = losses[start:start + len(plain_losses)]
    diffs = [abs(p - m) for p, m in zip(plain_losses, mine)]
    panels = ["loss"] + (["difference"] if diffs else []) + (["peaks"] if table else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    ax = dict(zip(panels, axes[0]))

    a = ax["loss"]
    a.plot(range(1, len(losses) + 1), losses, lw=1.0, color=COLORS["moepeak"], label="moepeak")
    k = min(SMOOTH_STEPS, len(losses))
    if k > 1:  # each step sees other text: the trend is clearer as a trailing mean
        means = [sum(losses[i + 1 - k:i + 1]) / k for i in range(k - 1, len(losses))]
        a.plot(range(k, len(losses) + 1), means, lw=2.2, color=COLORS["moepeak"], alpha=0.45,
               label=f"moepeak, mean of {k} steps")
    if plain_losses:
        xs = range(start + 1, start + len(plain_losses) + 1)
        a.plot(xs, plain_losses, "--", lw=1.2, color=COLORS["plain"],
               label=f"plain PyTorch ({len(plain_losses)} steps)")
    a.set_xlabel("step")
    a.set_ylabel("loss (nats/byte)")
    note = plain.get("note")
    if note:
        a.text(0.02, 0.03, f"plain PyTorch: {note}", transform=a.transAxes, ha="left", va="bottom",
               fontsize=7, wrap=True)
    a.legend(loc="upper right", fontsize=8)
    a.set_title("training loss")

    if diffs:
        a = ax["difference"]
        xs = list(range(start + 1, start + len(diffs) + 1))
        if any(d > 0 for d in diffs):
            a.semilogy([x for x, d in zip(xs, diffs) if d > 0], [d for d in diffs if d > 0], ".-", lw=0.8,
                       color=COLORS["difference"])
        else:  # identical curves: a log axis would draw nothing
            a.plot(xs, diffs, ".-", lw=0.8, color=COLORS["difference"])
        a.set_xlabel("step")
        a.set_ylabel("|loss - plain PyTorch's loss|")
        a.set_title(f"difference (max {max(diffs):.2g})")

    if table:
        a = ax["peaks"]
        names = [r["peak"] for r in table]
        def num(v):
            return v / MiB if isinstance(v, (int, float)) else 0.0
        xs = range(len(names))
        for off, key, label in ((-0.2, "plain", "plain PyTorch"), (0.2, "moepeak", "moepeak")):
            bars = a.bar([i + off for i in xs], [num(r[key]) for r in table], 0.4, label=label,
                         color=COLORS[key])
            for bar, r in zip(bars, table):
                if isinstance(r[key], str):  # "OOM": no bar to draw, say so
                    a.annotate(r[key], (bar.get_x() + bar.get_width() / 2, 0), ha="center",
                               va="bottom", fontsize=8)
        a.set_xticks(list(xs))
        a.set_xticklabels(names)
        a.set_ylabel("MiB")
        a.set_title("measured peaks")
        a.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    say(f"wrote {path}")
    return True
