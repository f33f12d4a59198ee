"""`moepeak plan --plot`: the plan's peaks against context, as data (plot_spec) and as a PNG
(plot; needs matplotlib, the [plot] extra)."""
from __future__ import annotations

from typing import Dict, Optional

from .host import longest_host_context
from .machine import Machine
from .model import BINDING, GiB, ModelShape, Setup, longest_context, peaks
from .placement import Margins

CURVES = BINDING + ("total",)  # the four peaks, the block and the final norm (each can bind), the total


def plot_spec(m: ModelShape, s: Setup, context: Optional[int] = None, name: Optional[str] = None,
              machine: Optional[Machine] = None, margins: Margins = Margins()) -> Dict:
    """What plot() draws, as data: the contexts (x, tokens; a power-of-two grid from 4096
    to 4x past the longest context that fits and the requested one), one curve per term
    that can bind (CURVES: the four peaks, the block, the final norm) and the total for
    each plan (GiB per GPU; a term that is zero at every context has nothing to draw on a
    log axis and is listed under "not_drawn" instead), the GPU memory limit, the longest
    contexts that fit, the longest context the host RAM holds (machine's host RAM less its
    margin, as the report checks it; None when the host RAM is unknown) and the title."""
    fits = {p: longest_context(m, s, p) for p in ("plain", "moepeak")}
    host_fits = host_label = None
    if machine is not None and machine.host_bytes is not None:
        usable = margins.host_room(machine.host_bytes)
        host_fits = longest_host_context(m, s, usable / GiB, machine.ranks_per_host)
        host_label = f"moepeak's host RAM ({usable / GiB:.0f} GiB usable per host) holds to {host_fits:,}"
    right = 4 * max([1 << 16, context or 0, min(host_fits or 0, 1 << 24)] + list(fits.values()))
    ctxs = [1 << k for k in range(12, right.bit_length())]
    curves, not_drawn = [], []
    for p in ("plain", "moepeak"):
        rows = [peaks(m, s, c, p) for c in ctxs]
        for k in CURVES:
            ys = [r[k] / GiB for r in rows]
            if any(y > 0 for y in ys):
                curves.append({"plan": p, "peak": k, "label": f"{p}: {k}", "gib": ys})
            else:
                not_drawn.append(f"{p} {k}")
    label = name or f"{m.params() / 1e9:.1f} B-param MoE"
    title = f"moepeak plan: {label} on {s.gpus} GPU(s) of {s.gpu_mem_gib:g} GiB"
    if not_drawn:
        title += "\n(zero at every context, not drawn: " + ", ".join(not_drawn) + ")"
    return {"contexts": ctxs, "curves": curves, "not_drawn": not_drawn, "fits": fits,
            "limit_gib": s.gpu_mem_gib, "limit_label": f"GPU memory ({s.gpu_mem_gib:g} GiB)",
            "host_fits": host_fits, "host_label": host_label, "context": context, "title": title}


def plot(m: ModelShape, s: Setup, path: str, context: Optional[int] = None,
         name: Optional[str] = None, machine: Optional[Machine] = None) -> bool:
    """PNG of plot_spec(): each term that can bind and the total per GPU against context
    (log-log), plain dashed and moepeak solid, the GPU memory as a labelled line, the
    longest contexts that fit as grey verticals, the host RAM's as a red one and the
    requested `context` as a dotted brown one. False when matplotlib is absent; OSError
    when the file cannot be written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("moepeak plan: matplotlib is not installed (pip install moepeak[plot]); skipping --plot")
        return False
    spec = plot_spec(m, s, context, name, machine)
    ctxs = spec["contexts"]
    styles = {"plain": "--", "moepeak": "-"}
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for c in spec["curves"]:
        i = CURVES.index(c["peak"])
        ax.plot(ctxs, c["gib"], styles[c["plan"]], color=f"C{i}", lw=2.2 if c["peak"] == "total" else 1.2,
                label=c["label"])
    ax.axhline(spec["limit_gib"], color="k", lw=1.0, label=spec["limit_label"])
    for p, n in spec["fits"].items():
        if n:
            ax.axvline(n, color="0.5", ls=styles[p], lw=0.8)
            ax.annotate(f"{p} fits to {n:,}", (n, spec["limit_gib"]), rotation=90, fontsize=7,
                        ha="right", va="top", xytext=(-2, -4), textcoords="offset points")
    if spec["host_fits"] and spec["host_fits"] < ctxs[-1]:
        ax.axvline(spec["host_fits"], color="crimson", ls="-.", lw=1.4, label=spec["host_label"])
    if context:
        ax.axvline(context, color="saddlebrown", ls=":", lw=1.8, label=f"requested context ({context:,} tokens)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlim(ctxs[0], ctxs[-1])
    ax.set_xlabel("context (tokens, all GPUs together)")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(spec["title"], fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
