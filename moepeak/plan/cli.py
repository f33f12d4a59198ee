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


def _option(ap: argparse.ArgumentParser, flag: str, help: str, default=None, shown=None, **kw) -> None:
    """ap.add_argument(flag, ...) whose help ends with its one default: `shown` (words) where
    given, else the default value itself."""
    ap.add_argument(flag, default=default, help=f"{help} (default: {default if shown is None else shown})", **kw)


# The model's shape flags (ModelShape fields): what each is, and its default where it is not
# only the preset's.
SHAPE_HELP = (("layers", "decoder blocks L", None), ("hidden", "hidden size H", None),
              ("experts", "routed experts E", None), ("top-k", "experts per token K", None),
              ("intermediate", "expert intermediate size I", None), ("vocab", "vocabulary size V", None),
              ("heads", "attention heads", None),
              ("kv-heads", "key/value heads", "the preset's, else --heads"),
              ("head-dim", "attention head size (MLA: the value head size)", "the preset's, else hidden / heads"),
              ("qk-head-dim", "q and k head size where it differs from --head-dim (MLA: nope + rope)",
               "the preset's, else --head-dim"))


def add_args(ap: argparse.ArgumentParser):
    ap.add_argument("--version", action="version", version=f"moepeak {__version__}")
    ap.add_argument("--explain", action="store_true",
                    help="print what each row of the table holds (alone: only that)")
    _option(ap, "--preset", "a model's shape: " + ", ".join(sorted(PRESETS)) + " (titan:* are torchtitan's "
            "flavors; the flags below override its fields)", shown="none, give them all", metavar="NAME",
            choices=sorted(PRESETS))
    for flag, what, shown in SHAPE_HELP:
        _option(ap, f"--{flag}", what, shown=shown or "the preset's", type=int, metavar="N")
    _option(ap, "--context", "tokens per sequence, split over the GPUs by context parallelism", 131072, type=int,
            metavar="TOKENS")
    _option(ap, "--gpus", "GPUs, the experts and the context split over them", 8, type=int, metavar="P")
    _option(ap, "--gpu-mem", "GiB per GPU", 141.0, shown="141", type=float, metavar="GIB")
    _option(ap, "--imbalance", "routing imbalance of plain expert parallelism, >= 1: the busiest GPU gets rho x "
            "the mean rows (above --gpus it counts as --gpus: one GPU gets every row)", 1.5, type=float,
            metavar="RHO")
    _option(ap, "--act-bytes", "bytes per activation element, 2 (bf16/fp16) or 4 (fp32)", 2, type=int,
            choices=(2, 4))
    _option(ap, "--impl", "whose modeling code runs the layers: moepeak's demo model, or a Hugging Face "
            "transformers model under moepeak.hf.apply_moepeak (its RoPE tables, its final RMSNorm's fp32 "
            "backward, the head's backward before any block's gradient exists)", "demo", choices=IMPLS)
    _option(ap, "--sp", "--impl hf with sequence parallelism from an engine (apply_moepeak(sequence_group=...)): "
            "ulysses (DeepSpeed Ulysses) or ring (torch context_parallel, accelerate's cp_size)",
            shown="none, the context split over --gpus with FSDP2", choices=SP_ENGINES)
    _option(ap, "--sp-size", "with --sp: the GPUs holding one sequence, dividing --gpus (--gpus / S data-parallel "
            "replicas)", shown="--gpus", type=int, metavar="S")
    _option(ap, "--shard", "with --sp: the non-expert weights replicated (ddp: DistributedDataParallel, their "
            "optimizer state on every rank) or sharded (fsdp2); DeepSpeed ZeRO-3 is not modelled",
            shown="ddp for ulysses, fsdp2 for ring", choices=SHARDS)
    _option(ap, "--ep-size", "with --sp: the GPUs the experts are split over, dividing --gpus and the experts",
            shown="--sp-size", type=int, metavar="N")
    ap.add_argument("--eager-norm", action="store_true",
                    help="moepeak's RMSNorms (the final one, the checkpointed blocks') run their eager autograd "
                         "backward (apply_moepeak(lean_norm=False), the demo's MoEConfig(lean_norm=False)) "
                         "instead of moepeak.norms.rms_norm's")
    _option(ap, "--tile-tokens", "sequence-tiled blocks (moepeak.tiled) with tiles of N tokens",
            shown="whole blocks; the placement tiles when whole blocks do not fit", type=int, metavar="N")
    _option(ap, "--device-state-gib", "GiB per GPU of StreamAdamW's state kept on the GPU (device_state, "
            "StreamAdamW.backward_tail)", 0.0, shown="0", type=float, metavar="GIB")
    _option(ap, "--state-dtype", "StreamAdamW's state_dtype: bfloat16 keeps exp_avg and exp_avg_sq in bf16, 8 "
            "instead of 12 bytes of host RAM per bf16 parameter", "float32", choices=sorted(STATE_DTYPES))
    _option(ap, "--sco-keep-last", "the last N blocks whose inputs SCO keeps on the GPU (SCOConfig.keep_last), "
            "GPU memory for host RAM", shown="that of the code running the layers, 0 for --impl demo, 1 for "
            "--impl hf", type=int, metavar="N")
    _option(ap, "--host-mem", "GiB of host RAM available on each host of the training machine",
            shown="this machine's MemAvailable, which the report names", type=float, metavar="GIB")
    _option(ap, "--gpus-per-node", "GPUs sharing one host's RAM and disk", shown="min(--gpus, 8)", type=int,
            metavar="N")
    _option(ap, "--spill-dir", "a directory on a local disk for SCO's disk tier: the placement reads its free "
            "space", shown="no disk tier", metavar="DIR")
    _option(ap, "--disk-free", "GiB free for SCO's disk tier on each host of the training machine, instead of "
            "reading --spill-dir", shown="no disk tier", type=float, metavar="GIB")
    ap.add_argument("--placement", action="store_true",
                    help="print where each tensor class goes (GPU, host RAM, disk) on the machine: the GPU of "
                         "--gpu-mem, the host RAM and the disk tier above")
    _option(ap, "--plot", "write a PNG of each peak against context (needs matplotlib: moepeak[plot])",
            shown="no plot", metavar="PNG")


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
