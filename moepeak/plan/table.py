"""`moepeak plan`'s report: the table of the four peaks and the other terms per GPU, plain
FSDP2 + AC next to moepeak, the binding peak and the longest context that fits, moepeak's
host RAM, and the legend of the rows (ROW_LEGEND, also under `moepeak plan --help`)."""
from __future__ import annotations

from typing import Optional

from .model import PEAKS, GiB, ModelShape, Setup, host_bytes, longest_context, longest_host_context, peaks

# What the table's rows beside the four peaks hold (report() prints it under the table;
# `moepeak plan --help` shows it too).
ROW_LEGEND = """\
rows (GiB per GPU):
  dispatch    the MoE layer's forward + backward (expert dispatch, combine, their saved rows)
  vocab       the lm_head + cross-entropy's forward + backward (the [T, V] logits in plain)
  boundaries  the checkpoint inputs kept from forward to backward, one [T, H] per block in plain;
              moepeak: the larger of the head phase's (W forward copies) and the block phase's
              (the reloaded input + the prefetch; a tiled block starts its prefetch after its peak)
  optimizer   AdamW's state on the GPU (moepeak's StreamAdamW keeps it in host RAM: 0, or
              the --device-state-gib tail)
  fixed       always resident: parameters + gradients (plain: fp32 grads; moepeak: params and
              grads in the activation dtype), FSDP2's two all-gathered blocks when P > 1,
              the RoPE tables
  block       the saved tensors of the one block being recomputed in backward (norms,
              attention, router) and the gradient flowing into it; with --tile-tokens the
              attention core's full-length tensors + one tile's position-wise working set
  head_act    what the head's backward holds besides the vocab peak: the final RMSNorm's
              saved tensors and the head's input
  final_norm  the final RMSNorm's own backward at its peak: moepeak.norms.rms_norm, its saved
              input + grads in and out + chunk temporaries (--eager-norm, and plain: the
              eager norm's fp32 saved tensors and temporaries)
  total       fixed + optimizer + the larger phase: block phase = its boundaries + block +
              dispatch, head phase = its boundaries + max(head_act + vocab, final_norm); the
              step's peak (the block's backward and the head's backward do not overlap);
              --impl hf, moepeak: the head phase holds the params and the head's gradients
              only (no block has run its backward yet)"""


def report(m: ModelShape, s: Setup, context: int, host_gib: Optional[float] = None,
           gpus_per_node: Optional[int] = None) -> str:
    rows = []
    res = {p: peaks(m, s, context, p) for p in ("plain", "moepeak")}
    rows.append(f"model: {m.params() / 1e9:.2f} B params, L={m.layers} H={m.hidden} E={m.experts} "
                f"K={m.top_k} I={m.intermediate} V={m.vocab} heads={m.heads}/{m.kv_heads}")
    rows.append(f"context {context} tokens over {s.gpus} GPU(s) of {s.gpu_mem_gib:g} GiB "
                f"({-(-context // s.gpus)} tokens per GPU), activations {s.act_bytes} B/elem"
                + (", Hugging Face layers (--impl hf)" if s.impl == "hf" else ""))
    rows.append("")
    rows.append(f"{'GiB per GPU':<22}{'plain FSDP2+AC':>16}{'moepeak':>12}")
    for k in PEAKS + ("fixed", "block", "head_act", "final_norm", "total"):
        rows.append(f"{k:<22}{res['plain'][k] / GiB:>16.2f}{res['moepeak'][k] / GiB:>12.2f}")
    cap = s.gpu_mem_gib * GiB
    for p in ("plain", "moepeak"):
        r = res[p]
        fits = "fits" if r["total"] <= cap else "does NOT fit"
        rows.append(f"{p}: binding peak = {r['binding']}; {fits}; longest context that fits: "
                    f"{longest_context(m, s, p)} tokens")
    h, node = host_bytes(m, s, context), min(s.gpus, gpus_per_node or 8)
    line = (f"moepeak host RAM per GPU: SCO boundaries {h['sco_boundaries'] / GiB:.2f} + StreamAdamW state "
            f"{h['optimizer_state'] / GiB:.2f} + pinned slots {h['pinned_slots'] / GiB:.2f} = "
            f"{h['total'] / GiB:.2f} GiB; per host of {node} GPU(s): {node * h['total'] / GiB:.2f} GiB")
    if host_gib is not None:
        fits = "fits in" if node * h["total"] <= host_gib * GiB else "does NOT fit in"
        c = longest_host_context(m, s, host_gib, node)
        line += (f", {fits} --host-mem {host_gib:g} GiB; longest context the host RAM holds: "
                 + (f"{c} tokens" if c < 1 << 26 else "not bound by context (no boundary in host RAM)"))
    rows += [line, "", ROW_LEGEND]
    return "\n".join(rows)
