"""`moepeak plan`: predict the four memory peaks per GPU, for plain FSDP2 (+
activation checkpointing) and for moepeak, and the longest context that fits.

The command line (add_args, build_parser, from_args, main); the model is
moepeak/plan/model.py (its docstring has every formula), the presets presets.py, the
table table.py and the --plot PNG chart.py.
"""
from __future__ import annotations

import argparse
import dataclasses

from .chart import plot
from .model import IMPLS, ModelShape, Setup
from .presets import PRESETS
from .table import ROW_LEGEND, report


def add_args(ap: argparse.ArgumentParser):
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="a public model's shape, titan:* torchtitan's flavors' (per-token terms: --impl's "
                         "code; the flags below override its fields; default %(default)s: give them all)")
    for f, what in (("layers", "decoder blocks L"), ("hidden", "hidden size H"),
                    ("experts", "routed experts E"), ("top-k", "experts per token K"),
                    ("intermediate", "expert intermediate size I"), ("vocab", "vocabulary size V"),
                    ("heads", "attention heads"), ("kv-heads", "key/value heads (default %(default)s: the preset's, else --heads)"),
                    ("head-dim", "attention head size (default %(default)s: the preset's, else "
                                 "hidden / heads; MLA: the value head size)"),
                    ("qk-head-dim", "q and k head size where it differs from --head-dim (MLA: nope + rope; "
                                    "default %(default)s: the preset's, else --head-dim)")):
        ap.add_argument(f"--{f}", type=int, default=None,
                        help=what if "%(default)" in what else what + " (default %(default)s: the preset's)")
    ap.add_argument("--context", type=int, default=131072,
                    help="tokens per sequence (split over the GPUs by context parallelism)")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs P (experts and context split over them)")
    ap.add_argument("--gpu-mem", type=float, default=141.0, help="GiB per GPU")
    ap.add_argument("--imbalance", type=float, default=1.5,
                    help="routing imbalance rho for plain expert parallelism (the busiest GPU gets "
                         "rho x the mean rows; capped to [1, P])")
    ap.add_argument("--act-bytes", type=int, default=2, choices=(2, 4),
                    help="bytes per activation element (2: bf16/fp16, 4: fp32)")
    ap.add_argument("--impl", choices=IMPLS, default="demo",
                    help="whose modeling code runs the layers: moepeak's demo model, or a Hugging Face "
                         "transformers model under moepeak.hf.apply_moepeak (its RoPE tables, its final "
                         "RMSNorm's fp32 backward, the head's backward before any block's gradient exists)")
    ap.add_argument("--eager-norm", action="store_true",
                    help="moepeak's RMSNorms (the final one, the checkpointed blocks') run their eager autograd "
                         "backward (apply_moepeak(lean_norm=False), the demo's MoEConfig(lean_norm=False)); "
                         "default: moepeak.norms.rms_norm")
    ap.add_argument("--tile-tokens", type=int, default=None,
                    help="moepeak plan: sequence-tiled blocks (moepeak.tiled) with tiles of this many tokens "
                         "(default %(default)s: whole blocks)")
    ap.add_argument("--device-state-gib", type=float, default=0.0,
                    help="moepeak plan: GiB per GPU of StreamAdamW device_state (StreamAdamW.backward_tail)")
    ap.add_argument("--sco-keep-last", type=int, default=None,
                    help="moepeak plan: the last blocks whose inputs SCO keeps on the GPU (SCOConfig.keep_last): "
                         "GPU memory for host RAM (default: that of the code running the layers, "
                         "0 for --impl demo, 1 for --impl hf)")
    ap.add_argument("--host-mem", type=float, default=None,
                    help="GiB of host RAM per host: the report checks moepeak's host RAM (SCO's boundaries, "
                         "StreamAdamW's state) against it (default %(default)s: no check)")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="GPUs sharing one host's RAM (default %(default)s: min(--gpus, 8))")
    ap.add_argument("--plot", default=None,
                    help="PNG path: peak vs context per component (needs matplotlib: moepeak[plot]; "
                         "default %(default)s: no plot)")


def build_parser() -> argparse.ArgumentParser:
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass
    ap = argparse.ArgumentParser(prog="moepeak plan", description=__doc__.split("\n\n")[0],
                                 epilog=ROW_LEGEND, formatter_class=Formatter)
    add_args(ap)
    return ap


def from_args(a) -> (ModelShape, Setup):
    fields = {"layers": "layers", "hidden": "hidden", "experts": "experts", "top_k": "top_k",
              "intermediate": "intermediate", "vocab": "vocab", "heads": "heads",
              "kv_heads": "kv_heads", "head_dim": "head_dim", "qk_head_dim": "qk_head_dim"}
    given = {k: getattr(a, v) for k, v in fields.items() if getattr(a, v) is not None}
    if a.preset:
        m = dataclasses.replace(PRESETS[a.preset], **given)
    else:
        missing = [f for f in ("layers", "hidden", "experts", "top_k", "intermediate", "vocab", "heads")
                   if f not in given]
        if missing:
            raise ValueError("moepeak plan: give --preset or all of --" +
                             ", --".join(x.replace("_", "-") for x in missing))
        given.setdefault("kv_heads", given["heads"])
        m = ModelShape(**given)
    m.validate()
    if a.context < 1 or a.gpus < 1 or a.gpu_mem <= 0 or a.imbalance < 1:
        raise ValueError(f"moepeak plan: need --context >= 1 (got {a.context}), --gpus >= 1 (got {a.gpus}), "
                         f"--gpu-mem > 0 (got {a.gpu_mem}), --imbalance >= 1 (got {a.imbalance})")
    if m.experts % a.gpus and a.gpus <= m.experts:
        raise ValueError(f"moepeak plan: experts ({m.experts}) must be divisible by --gpus ({a.gpus})")
    tile = getattr(a, "tile_tokens", None)
    if tile is not None and tile < 1:
        raise ValueError(f"moepeak plan: need --tile-tokens >= 1 (got {tile})")
    keep = getattr(a, "sco_keep_last", None)
    if keep is not None and keep < 0:
        raise ValueError(f"moepeak plan: need --sco-keep-last >= 0 (got {keep})")
    host, per_node = getattr(a, "host_mem", None), getattr(a, "gpus_per_node", None)
    if (host is not None and not host > 0) or (per_node is not None and per_node < 1):
        raise ValueError(f"moepeak plan: need --host-mem > 0 (got {host}) and --gpus-per-node >= 1 (got {per_node})")
    if not getattr(a, "device_state_gib", 0.0) >= 0:
        raise ValueError(f"moepeak plan: need --device-state-gib >= 0 (got {a.device_state_gib})")
    return m, Setup(gpus=a.gpus, gpu_mem_gib=a.gpu_mem, act_bytes=a.act_bytes, imbalance=a.imbalance,
                    tile_tokens=tile, impl=getattr(a, "impl", "demo"),
                    lean_norm=not getattr(a, "eager_norm", False),
                    device_state_gib=getattr(a, "device_state_gib", 0.0), sco_keep_last=keep)


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        m, s = from_args(a)
    except ValueError as e:
        ap.error(str(e))
    print(report(m, s, a.context, a.host_mem, a.gpus_per_node))
    if a.plot:
        if plot(m, s, a.plot, context=a.context, name=a.preset):
            print(f"wrote {a.plot}")
    return 0
