"""`moepeak plan`'s report: the table of the four peaks and the other terms per GPU, plain
FSDP2 + AC next to moepeak, the binding peak and the longest context that fits, moepeak's
host RAM against the host's, the placement on the machine, and the legend of the rows
(ROW_LEGEND, under `moepeak plan --explain`)."""
from __future__ import annotations

from typing import Dict, List, Optional

from .host import HOST_TERMS, host_bytes, longest_host_context
from .machine import Machine
from .model import PEAKS, GiB, ModelShape, Setup, longest_context, peaks
from .sequence import expert_ranks, sequence_size, shard_of
from .placement import Margins, PlacementError, longest_placed_context, place

HOST_LABELS = {"sco_boundaries": "SCO boundaries", "sco_spill_staging": "SCO spill staging",
               "optimizer_state": "StreamAdamW state", "pinned_slots": "pinned slots",
               "state_init": "state creation copy"}
HOST_LIMIT = 1 << 26  # longest_host_context's search limit: past it, context does not bind host RAM

# What the table's rows beside the four peaks hold (`moepeak plan --explain` prints it).
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


def _fits_line(m: ModelShape, s: Setup, plan: str, r: Dict[str, float]) -> str:
    cap = s.gpu_mem_gib * GiB
    resident = r["fixed"] + r["optimizer"]
    if resident > cap:
        what = "parameters + gradients" + (" + optimizer state" if r["optimizer"] else "")
        return (f"{plan}: does NOT fit at any context: parameters alone exceed the GPU ({what} take "
                f"{resident / GiB:.2f} GiB per GPU over {s.gpus} GPU(s), of {s.gpu_mem_gib:g} GiB)")
    fits = "fits" if r["total"] <= cap else "does NOT fit"
    return (f"{plan}: binding peak = {r['binding']}; {fits}; longest context that fits: "
            f"{longest_context(m, s, plan)} tokens")


def _host_lines(m: ModelShape, s: Setup, context: int, machine: Machine, margins: Margins) -> List[str]:
    h, node = host_bytes(m, s, context), machine.ranks_per_host
    terms = " + ".join(f"{HOST_LABELS[k]} {h[k] / GiB:.2f}" for k in HOST_TERMS if h[k])
    rows = [f"moepeak host RAM per GPU: {terms} = {h['total'] / GiB:.2f} GiB; per host of {node} GPU(s): "
            f"{node * h['total'] / GiB:.2f} GiB"]
    if machine.host_bytes is None:
        rows.append("host RAM NOT checked: this machine's /proc/meminfo could not be read; give the training "
                    "machine's with --host-mem GIB")
        return rows
    usable = margins.host_room(machine.host_bytes)
    fits = "fits" if node * h["total"] <= usable else "does NOT fit"
    c = longest_host_context(m, s, usable / GiB, node)
    reach = f"{c} tokens" if c < HOST_LIMIT else "not bound by context (no boundary in host RAM)"
    rows.append(f"host RAM: {machine.host_bytes / GiB:.1f} GiB, {machine.host_from}, less its margin "
                f"({margins.host_bytes / GiB:g} GiB + {margins.host_fraction:.0%}) = {usable / GiB:.1f} GiB: {fits}; "
                f"longest context it holds: {reach}")
    if machine.host_from and machine.host_from.startswith("MemAvailable"):
        rows.append("  (read on this machine: for another one, give its host RAM with --host-mem GIB)")
    return rows


def _placement_lines(m: ModelShape, s: Setup, context: int, machine: Machine, margins: Margins,
                     full: bool) -> List[str]:
    kw = dict(gpu_bytes=machine.gpu_bytes, host_bytes=machine.host_bytes, disk_bytes=machine.disk_bytes,
              ranks_per_host=machine.ranks_per_host, margins=margins)
    disk = (f"disk {machine.disk_bytes / GiB:.1f} GiB ({machine.disk_from})" if machine.disk_bytes is not None
            else "no disk tier")
    head = f"placement (GPU {machine.gpu_bytes / GiB:g} GiB, host RAM above, {disk})"
    reach = longest_placed_context(m, s, **kw)
    try:
        p = place(m, s, context, **kw)
    except PlacementError as e:
        return [f"{head}: {e}", f"  longest context placed: {reach} tokens"]
    rows = [f"{head}: {p.keep_last} boundaries on the GPU, {p.host_boundaries} in host RAM, {p.disk_boundaries} "
            f"on disk; StreamAdamW device tail {p.device_state_bytes / GiB:.2f} GiB; "
            + (f"tiles of {p.tile_tokens} tokens" if p.tile_tokens else "whole blocks")
            + f"; longest context placed: {reach} tokens" + ("" if full else " (--placement: the table)")]
    if full:
        rows.append(p.describe())
    return rows


def report(m: ModelShape, s: Setup, context: int, machine: Optional[Machine] = None, *, placement: bool = False,
           explain: bool = False, margins: Margins = Margins()) -> str:
    """The text `moepeak plan` prints: the peaks table, whether each plan fits and its longest
    context, moepeak's host RAM against machine's (None: a machine with s.gpu_mem_gib GPUs and
    host RAM not checked), the placement on it (placement=True: its table), the legend
    (explain=True)."""
    machine = machine or Machine(gpu_bytes=s.gpu_mem_gib * GiB, ranks_per_host=min(s.gpus, 8))
    rows = []
    res = {p: peaks(m, s, context, p) for p in ("plain", "moepeak")}
    rows.append(f"model: {m.params() / 1e9:.2f} B params, L={m.layers} H={m.hidden} E={m.experts} "
                f"K={m.top_k} I={m.intermediate} V={m.vocab} heads={m.heads}/{m.kv_heads}")
    S = sequence_size(s)
    rows.append(f"context {context} tokens over {s.gpus} GPU(s) of {s.gpu_mem_gib:g} GiB "
                f"({-(-context // S)} tokens per GPU), activations {s.act_bytes} B/elem"
                + (", Hugging Face layers (--impl hf)" if s.impl == "hf" else ""))
    if s.sp:
        rows.append(f"sequence parallel: {s.sp} over {S} GPU(s) ({s.gpus // S} replica(s)), non-expert weights "
                    f"{shard_of(s)}, experts over {expert_ranks(s)} GPU(s)")
    rows.append("")
    rows.append(f"{'GiB per GPU':<22}{'plain FSDP2+AC':>16}{'moepeak':>12}")
    for k in PEAKS + ("fixed", "block", "head_act", "final_norm", "total"):
        rows.append(f"{k:<22}{res['plain'][k] / GiB:>16.2f}{res['moepeak'][k] / GiB:>12.2f}")
    rows += [_fits_line(m, s, p, res[p]) for p in ("plain", "moepeak")]
    rows += _host_lines(m, s, context, machine, margins)
    if machine.host_bytes is not None:
        rows += _placement_lines(m, s, context, machine, margins, placement)
    rows += ["", ROW_LEGEND] if explain else ["(--explain: what each row holds)"]
    return "\n".join(rows)
