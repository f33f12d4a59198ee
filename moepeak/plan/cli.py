"""`moepeak plan`: predict the four memory peaks per GPU, for plain FSDP2 (+
activation checkpointing) and for moepeak, the longest context that fits, moepeak's
host RAM against the host's, and where each tensor class goes on the machine.

The command line (add_args, build_parser, from_args, main); the model is
moepeak/plan/model.py (its docstring has every formula), the host RAM host.py, the
placement placement.py, the presets presets.py, the table table.py and the --plot PNG
chart.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import List, Optional, Tuple

from ..version import __version__
from .chart import plot
from .machine import Machine, disk_free_bytes, read_host_ram
from .model import IMPLS, GiB, ModelShape, Setup
from .sequence import SHARDS, SP_ENGINES, sequence_problems
from .presets import PRESETS
from .table import ROW_LEGEND, report

SHAPE_FLAGS = ("layers", "hidden", "experts", "top_k", "intermediate", "vocab", "heads", "kv_heads", "head_dim",
               "qk_head_dim")
STATE_DTYPES = {"float32": 4, "bfloat16": 2}  # StreamAdamW state_dtype -> bytes per element


def add_args(ap: argparse.ArgumentParser):
    ap.add_argument("--version", action="version", version=f"moepeak {__version__}")
    ap.add_argument("--explain", action="store_true",
                    help="print what each row of the table holds (alone: only that)")
    ap.add_argument("--preset", metavar="NAME", choices=sorted(PRESETS), default=None,
                    help="a model's shape: " + ", ".join(sorted(PRESETS)) + " (titan:* are torchtitan's flavors; "
                         "the flags below override its fields; default: none, give them all)")
    for f, what in (("layers", "decoder blocks L"), ("hidden", "hidden size H"),
                    ("experts", "routed experts E"), ("top-k", "experts per token K"),
                    ("intermediate", "expert intermediate size I"), ("vocab", "vocabulary size V"),
                    ("heads", "attention heads"),
                    ("kv-heads", "key/value heads (default: the preset's, else --heads)"),
                    ("head-dim", "attention head size (MLA: the value head size; default: the preset's, else "
                                 "hidden / heads)"),
                    ("qk-head-dim", "q and k head size where it differs from --head-dim (MLA: nope + rope; "
                                    "default: the preset's, else --head-dim)")):
        ap.add_argument(f"--{f}", type=int, default=None, metavar="N",
                        help=what if "default:" in what else what + " (default: the preset's)")
    ap.add_argument("--context", type=int, default=131072, metavar="TOKENS",
                    help="tokens per sequence, split over the GPUs by context parallelism (default: 131072)")
    ap.add_argument("--gpus", type=int, default=8, metavar="P",
                    help="GPUs, the experts and the context split over them (default: 8)")
    ap.add_argument("--gpu-mem", type=float, default=141.0, metavar="GIB", help="GiB per GPU (default: 141)")
    ap.add_argument("--imbalance", type=float, default=1.5, metavar="RHO",
                    help="routing imbalance of plain expert parallelism, >= 1: the busiest GPU gets rho x the "
                         "mean rows (above --gpus it counts as --gpus: one GPU gets every row; default: 1.5)")
    ap.add_argument("--act-bytes", type=int, default=2, choices=(2, 4),
                    help="bytes per activation element, 2 (bf16/fp16) or 4 (fp32) (default: 2)")
    ap.add_argument("--impl", choices=IMPLS, default="demo",
                    help="whose modeling code runs the layers: moepeak's demo model, or a Hugging Face "
                         "transformers model under moepeak.hf.apply_moepeak (its RoPE tables, its final "
                         "RMSNorm's fp32 backward, the head's backward before any block's gradient exists) "
                         "(default: demo)")
    ap.add_argument("--sp", choices=SP_ENGINES, default=None,
                    help="--impl hf with sequence parallelism from an engine (apply_moepeak(sequence_group=...)): "
                         "ulysses (DeepSpeed Ulysses) or ring (torch context_parallel, accelerate's cp_size) "
                         "(default: none, the context split over --gpus with FSDP2)")
    ap.add_argument("--sp-size", type=int, default=None, metavar="S",
                    help="with --sp: the GPUs holding one sequence, dividing --gpus (--gpus / S data-parallel "
                         "replicas) (default: --gpus)")
    ap.add_argument("--shard", choices=SHARDS, default=None,
                    help="with --sp: the non-expert weights replicated (ddp: DistributedDataParallel, their "
                         "optimizer state on every rank) or sharded (fsdp2) (default: ddp for ulysses, fsdp2 for "
                         "ring; DeepSpeed ZeRO-3 is not modelled)")
    ap.add_argument("--ep-size", type=int, default=None, metavar="N",
                    help="with --sp: the GPUs the experts are split over, dividing --gpus and the experts "
                         "(default: --sp-size)")
    ap.add_argument("--eager-norm", action="store_true",
                    help="moepeak's RMSNorms (the final one, the checkpointed blocks') run their eager autograd "
                         "backward (apply_moepeak(lean_norm=False), the demo's MoEConfig(lean_norm=False)) "
                         "instead of moepeak.norms.rms_norm's")
    ap.add_argument("--tile-tokens", type=int, default=None, metavar="N",
                    help="sequence-tiled blocks (moepeak.tiled) with tiles of N tokens (default: whole blocks; "
                         "the placement tiles when whole blocks do not fit)")
    ap.add_argument("--device-state-gib", type=float, default=0.0, metavar="GIB",
                    help="GiB per GPU of StreamAdamW's state kept on the GPU (device_state, "
                         "StreamAdamW.backward_tail) (default: 0)")
    ap.add_argument("--state-dtype", choices=sorted(STATE_DTYPES), default="float32",
                    help="StreamAdamW's state_dtype: bfloat16 keeps exp_avg and exp_avg_sq in bf16, 8 instead of "
                         "12 bytes of host RAM per bf16 parameter (default: float32)")
    ap.add_argument("--sco-keep-last", type=int, default=None, metavar="N",
                    help="the last N blocks whose inputs SCO keeps on the GPU (SCOConfig.keep_last), GPU memory "
                         "for host RAM (default: that of the code running the layers, 0 for --impl demo, 1 for "
                         "--impl hf)")
    ap.add_argument("--host-mem", type=float, default=None, metavar="GIB",
                    help="GiB of host RAM available on each host of the training machine (default: this "
                         "machine's MemAvailable, which the report names)")
    ap.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                    help="GPUs sharing one host's RAM and disk (default: min(--gpus, 8))")
    ap.add_argument("--spill-dir", default=None, metavar="DIR",
                    help="a directory on a local disk for SCO's disk tier: the placement reads its free space "
                         "(default: no disk tier)")
    ap.add_argument("--disk-free", type=float, default=None, metavar="GIB",
                    help="GiB free for SCO's disk tier on each host of the training machine, instead of reading "
                         "--spill-dir (default: no disk tier)")
    ap.add_argument("--placement", action="store_true",
                    help="print where each tensor class goes (GPU, host RAM, disk) on the machine: the GPU of "
                         "--gpu-mem, the host RAM and the disk tier above")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="write a PNG of each peak against context (needs matplotlib: moepeak[plot]; "
                         "default: no plot)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moepeak plan", description=__doc__.split("\n\n")[0],
                                 epilog="--explain prints what each row of the table holds.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    return ap


def _flag_problems(a) -> List[str]:
    """One sentence per bad flag, naming only that flag."""
    bad = []
    for flag, value, ok, want in (
            ("--context", a.context, a.context >= 1, ">= 1"),
            ("--gpus", a.gpus, a.gpus >= 1, ">= 1"),
            ("--gpu-mem", a.gpu_mem, a.gpu_mem > 0, "> 0"),
            ("--imbalance", a.imbalance, a.imbalance >= 1, ">= 1 (the busiest GPU gets at least the mean)"),
            ("--tile-tokens", a.tile_tokens, a.tile_tokens is None or a.tile_tokens >= 1, ">= 1"),
            ("--device-state-gib", a.device_state_gib, a.device_state_gib >= 0, ">= 0"),
            ("--sco-keep-last", a.sco_keep_last, a.sco_keep_last is None or a.sco_keep_last >= 0, ">= 0"),
            ("--host-mem", a.host_mem, a.host_mem is None or a.host_mem > 0, "> 0"),
            ("--gpus-per-node", a.gpus_per_node, a.gpus_per_node is None or a.gpus_per_node >= 1, ">= 1"),
            ("--disk-free", a.disk_free, a.disk_free is None or a.disk_free >= 0, ">= 0")):
        if not ok:
            bad.append(f"{flag} must be {want}, got {value:g}" if isinstance(value, float) else
                       f"{flag} must be {want}, got {value}")
    if a.spill_dir is not None and a.disk_free is not None:
        bad.append("give --spill-dir (its free space is read) or --disk-free, not both")
    elif a.spill_dir is not None and not os.path.isdir(a.spill_dir):
        bad.append(f"--spill-dir {a.spill_dir!r} is not a directory")
    if a.plot is not None:
        where = os.path.dirname(os.path.abspath(a.plot))
        if not os.path.isdir(where):
            bad.append(f"--plot {a.plot!r}: the directory {where!r} does not exist")
        elif not os.access(where, os.W_OK):
            bad.append(f"--plot {a.plot!r}: the directory {where!r} is not writable")
    return bad


def from_args(a) -> Tuple[ModelShape, Setup]:
    """The model and the setup the flags describe; ValueError naming the bad flags."""
    given = {f: getattr(a, f) for f in SHAPE_FLAGS if getattr(a, f) is not None}
    if a.preset:
        m = dataclasses.replace(PRESETS[a.preset], **given)
    else:
        missing = [f for f in SHAPE_FLAGS[:7] if f not in given]
        if missing:
            raise ValueError("give --preset or all of --" + ", --".join(x.replace("_", "-") for x in missing))
        given.setdefault("kv_heads", given["heads"])
        m = ModelShape(**given)
    bad = m.problems(flags=True) + _flag_problems(a)
    if not bad and a.sp is None and m.experts % a.gpus and a.gpus <= m.experts:
        bad.append(f"--gpus ({a.gpus}) must divide the experts ({m.experts})")
    s = Setup(gpus=a.gpus, gpu_mem_gib=a.gpu_mem, act_bytes=a.act_bytes, imbalance=a.imbalance,
              tile_tokens=a.tile_tokens, impl=a.impl, lean_norm=not a.eager_norm,
              device_state_gib=a.device_state_gib, state_dtype_bytes=STATE_DTYPES[a.state_dtype],
              sco_keep_last=a.sco_keep_last, sp=a.sp, sp_size=a.sp_size, shard=a.shard, ep_size=a.ep_size)
    if not bad:
        bad = sequence_problems(m, s, flags=True)
    if bad:
        raise ValueError("; ".join(bad))
    return m, s


def machine_of(a, gpus: int) -> Machine:
    """The machine the report checks against: --host-mem or this machine's MemAvailable (or
    none: unknown), --disk-free or --spill-dir's free space (or none: no disk tier)."""
    per_node = min(gpus, a.gpus_per_node or 8)
    if a.host_mem is not None:
        host, host_from = a.host_mem * GiB, f"--host-mem {a.host_mem:g}"
    else:
        ram = read_host_ram()
        host = None if ram is None else ram.available
        host_from = None if ram is None else (
            f"MemAvailable of this machine ({ram.machine}" + (f", of {ram.total / GiB:.1f} GiB MemTotal" if ram.total
                                                              else "") + ")")
    disk: Optional[float] = None
    disk_from = None
    if a.disk_free is not None:
        disk, disk_from = a.disk_free * GiB, f"--disk-free {a.disk_free:g}"
    elif a.spill_dir is not None:
        disk, disk_from = float(disk_free_bytes(a.spill_dir)), f"free in --spill-dir {a.spill_dir}"
    return Machine(gpu_bytes=a.gpu_mem * GiB, host_bytes=host, host_from=host_from, disk_bytes=disk,
                   disk_from=disk_from, ranks_per_host=per_node)


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.explain and a.preset is None and all(getattr(a, f) is None for f in SHAPE_FLAGS):
        print(ROW_LEGEND)
        return 0
    try:
        m, s = from_args(a)
    except ValueError as e:
        ap.error(str(e))
    machine = machine_of(a, s.gpus)
    print(report(m, s, a.context, machine, placement=a.placement, explain=a.explain))
    if a.plot:
        try:
            if plot(m, s, a.plot, context=a.context, name=a.preset, machine=machine):
                print(f"wrote {a.plot}")
        except OSError as e:
            print(f"moepeak plan: --plot {a.plot!r}: could not write it: {e.strerror or e}", file=sys.stderr)
            return 1
    return 0
