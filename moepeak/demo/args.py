"""`moepeak demo`'s command line: the device defaults (DEFAULTS), the parser
(build_parser), and the model config and training settings it gives (config_from_args,
validate_train). The job that runs them is moepeak/demo/train.py."""
from __future__ import annotations

import argparse
import math
import os

import torch

from .config import MoEConfig

# Learning rate: linear warm-up over `warmup` steps to `lr`, then cosine decay to
# --min-lr-ratio x lr at the last step. The GPU model (245 M params) takes a peak of
# 6e-4 (at 131072 tokens a step, after 20 warm-up steps, the loss fell 7.7 -> 2.4 nats/byte
# over 150 steps, most of it in the first 40; a peak of 2e-3 stalls it near 2.7 with spikes).
#
# The GPU run is sized to take 1-2 minutes on an H200: one sequence of 65536 tokens, 80
# steps, then 20 plain-PyTorch steps. From benchmarks/RESULTS.md's demo rows (moepeak 145.7k
# tokens/s at 32k and 85.9k at 131k, plain 130.1k and 81.7k), a step time a*T + b*T^2 gives
# 0.55 s (moepeak) and 0.60 s (plain) at 64k: 44 s + 12 s of training, plus start-up, the
# corpus and the peak probes (~20 s). Plain PyTorch's peak at 64k is ~50 GiB (26.0 at 32k,
# 99.7 at 131k), Ring-DTP's vocabulary peak stays under 1 GiB: the peaks still show.
DEFAULTS = {
    "cuda": dict(layers=4, hidden=1024, heads=8, kv_heads=2, experts=16, top_k=2, intermediate=512,
                 vocab=65536, seq_len=65536, batch=1, steps=80, lr=6e-4, dtype="bfloat16",
                 warmup=10, chunk_rows=None, compare_steps=20),
    "cpu": dict(layers=2, hidden=64, heads=4, kv_heads=2, experts=8, top_k=2, intermediate=64,
                vocab=264, seq_len=256, batch=4, steps=120, lr=3e-3, dtype="float32",
                # 2048 routed rows a step: chunks of 256 rows bound the dispatch working set
                # (the GPU default, 32768 rows, would exceed the whole tiny layer)
                warmup=10, chunk_rows=256, compare_steps=None),  # None: every step
}
DESCRIPTION = ("train a small MoE LM with all four moepeak schedules, overlay plain PyTorch's loss "
               "on the same weights and batches, and measure the four memory peaks against plain "
               "PyTorch's (see moepeak.demo)")
SCHEDULES = (("llep", "moe", "PipelinedLLEP expert dispatch"),
             ("ring_dtp", "head", "Ring-DTP vocabulary projection + CE"),
             ("sco", "checkpoint", "SCO checkpoint-boundary offload"),
             ("stream_adamw", "optimizer", "StreamAdamW optimizer (state in host RAM)"))


DEVICE_DEFAULT = " (default %(default)s: the device's, moepeak.demo.DEFAULTS)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moepeak demo", description=DESCRIPTION,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda or cpu (default %(default)s: cuda if available)")
    g = ap.add_argument_group("model size")
    for f, what in (("layers", "decoder blocks"), ("hidden", "hidden size H"),
                    ("heads", "attention heads"), ("kv-heads", "key/value heads (GQA)"),
                    ("experts", "routed experts E"), ("top-k", "experts per token K"),
                    ("intermediate", "expert intermediate size I"),
                    ("vocab", "vocabulary rows V (>= 259: bytes + specials; the rest pad)")):
        g.add_argument(f"--{f}", type=int, default=None, help=what + DEVICE_DEFAULT)
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="parameter and activation dtype" + DEVICE_DEFAULT)
    t = ap.add_argument_group("training")
    t.add_argument("--seq-len", type=int, default=None, help="tokens per sequence" + DEVICE_DEFAULT)
    t.add_argument("--batch", type=int, default=None,
                   help="sequences per step (per rank without context parallelism)" + DEVICE_DEFAULT)
    t.add_argument("--context-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="under torchrun: shard each sequence over the ranks (default %(default)s: on when "
                        "WORLD_SIZE > 1; --seq-len must be divisible by WORLD_SIZE)")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps" + DEVICE_DEFAULT)
    t.add_argument("--lr", type=float, default=None, help="peak learning rate" + DEVICE_DEFAULT)
    t.add_argument("--warmup", type=int, default=None,
                   help="linear LR warmup steps (then cosine decay to --min-lr-ratio x lr)" + DEVICE_DEFAULT)
    t.add_argument("--lr-horizon", type=int, default=None,
                   help="step at which the cosine reaches its floor (default %(default)s: the last step of this "
                        "run; give the same value to a run and its --resume to get one curve)")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine's floor, x lr")
    t.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    t.add_argument("--data", choices=("auto", "stdlib", "synthetic"), default="auto",
                   help="corpus: the Python stdlib's sources, or a synthetic Markov language")
    t.add_argument("--data-mb", type=float, default=8.0, help="corpus size cap (MiB)")
    s = ap.add_argument_group("schedules (each on by default; --plain turns all four off)")
    for flag, _, what in SCHEDULES:
        s.add_argument(f"--{flag.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                       default=True, help=what)
    s.add_argument("--plain", action="store_true", help="plain PyTorch: dense MoE, F.cross_entropy, "
                   "torch.utils.checkpoint, torch.optim.AdamW")
    s.add_argument("--no-checkpoint", action="store_true", help="no activation checkpointing at all")
    s.add_argument("--bucket-mb", type=float, default=None,
                   help="StreamAdamW bucket size in MiB (default %(default)s: StreamAdamW's)")
    s.add_argument("--state-dtype", choices=("float32", "bfloat16"), default=None,
                   help="StreamAdamW's exp_avg/exp_avg_sq dtype in host RAM (bfloat16: 8 instead of 12 B per "
                        "bf16 param, stochastic rounding; default %(default)s: StreamAdamW's, float32)")
    s.add_argument("--auto-placement", action=argparse.BooleanOptionalAction, default=True,
                   help="on one GPU: place SCO's kept blocks, its arena, StreamAdamW's device tail and the "
                        "tiling from the model, the tokens per step and this machine's free GPU and host "
                        "memory (moepeak.plan.place; --tile-tokens, when given, is kept)")
    s.add_argument("--chunk-rows", type=int, default=None,
                   help="PipelinedLLEP chunk budget" + DEVICE_DEFAULT)
    s.add_argument("--tile-tokens", type=int, default=None,
                   help="sequence-tiled blocks (moepeak.tiled): position-wise parts in tiles of this many "
                        "tokens (default %(default)s: whole blocks)")
    c = ap.add_argument_group("comparison with plain PyTorch")
    c.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help="after the run, train the same model from the same weights on the same "
                        "batches in plain PyTorch and overlay its loss (default %(default)s: on, except under "
                        "torchrun on GPUs, where an OOM on one rank would stall the others)")
    c.add_argument("--compare-steps", type=int, default=None,
                   help="steps of the plain run (default %(default)s: every step on CPU, the first "
                        f"{DEFAULTS['cuda']['compare_steps']} on a GPU); it stops early at an OOM")
    o = ap.add_argument_group("output")
    o.add_argument("--save", default=None,
                   help="directory: torch.distributed.checkpoint at the end (default %(default)s: no save)")
    o.add_argument("--resume", default=None,
                   help="directory written by --save: continue from it (default %(default)s: start afresh)")
    o.add_argument("--plot", default=None,
                   help="PNG path: loss curves and peak table (needs matplotlib: pip install -e "
                        "'.[plot]' in the moepeak checkout; default %(default)s: no plot)")
    o.add_argument("--no-peaks", action="store_true", help="skip the per-component peak measurement")
    o.add_argument("--log-every", type=int, default=None, help="progress line every N steps "
                   "(default %(default)s: steps/10; on a terminal the bar updates every step)")
    o.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return ap


def config_from_args(a, dev_kind: str):
    d = DEFAULTS[dev_kind]

    def pick(k, v):
        return d[k] if v is None else v
    cfg = MoEConfig(vocab_size=pick("vocab", a.vocab), hidden=pick("hidden", a.hidden),
                    layers=pick("layers", a.layers), heads=pick("heads", a.heads),
                    kv_heads=pick("kv_heads", a.kv_heads), experts=pick("experts", a.experts),
                    top_k=pick("top_k", a.top_k), intermediate=pick("intermediate", a.intermediate),
                    checkpoint="none" if a.no_checkpoint else "sco",
                    chunk_rows=pick("chunk_rows", a.chunk_rows), tile_tokens=a.tile_tokens)
    train = dict(seq_len=pick("seq_len", a.seq_len), batch=pick("batch", a.batch),
                 steps=pick("steps", a.steps), lr=pick("lr", a.lr), warmup=pick("warmup", a.warmup),
                 dtype=getattr(torch, pick("dtype", a.dtype)),
                 compare_steps=pick("compare_steps", a.compare_steps))
    return cfg, train


def validate_train(train, a):
    bad = []
    if train["seq_len"] < 2:
        bad.append(f"--seq-len must be >= 2, got {train['seq_len']}")
    if train["batch"] < 1:
        bad.append(f"--batch must be >= 1, got {train['batch']}")
    if train["warmup"] < 0:
        bad.append(f"--warmup must be >= 0, got {train['warmup']}")
    if a.lr_horizon is not None and a.lr_horizon < 1:
        bad.append(f"--lr-horizon must be >= 1, got {a.lr_horizon}")
    if not 0.0 <= a.min_lr_ratio <= 1.0:
        bad.append(f"--min-lr-ratio must be in [0, 1], got {a.min_lr_ratio}")
    if train["steps"] < 0:
        bad.append(f"--steps must be >= 0, got {train['steps']}")
    if train["compare_steps"] is not None and train["compare_steps"] < 0:
        bad.append(f"--compare-steps must be >= 0, got {train['compare_steps']}")
    if not (train["lr"] > 0 and math.isfinite(train["lr"])):
        bad.append(f"--lr must be a positive number, got {train['lr']}")
    if a.resume and not os.path.isdir(a.resume):
        bad.append(f"--resume {a.resume!r} is not a directory written by --save")
    if bad:
        raise ValueError("moepeak demo: " + "; ".join(bad))
