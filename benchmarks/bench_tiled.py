"""Sequence-tiled block benchmark: one decoder block's forward + backward, peak memory
and time, tiled (moepeak.tiled.tiled_block) vs untiled (torch.utils.checkpoint of the
same block, use_reentrant=False: the recompute a checkpointed model runs), at each T.

The block is the demo model's Block (RMSNorm, GQA attention with RoPE through causal
SDPA, PipelinedLLEPMoE), bf16, default shape that of the 2.0B model of issue 25:
H = 2048, 16/4 heads of 128, E = 16, K = 4, I = 768.

  resident   = memory allocated before the step (weights, their grads, x, grad_y)
  peak       = max_memory_allocated during forward + backward minus resident
  KB/token   = peak / T / 1024  (the block's transient per token)
  ms         = forward + backward of one step (CUDA events) after one warm-up step
An OOM is a result (written as such). Rows go to benchmarks/results/tiled.csv.

  python benchmarks/bench_tiled.py                               # T = 128k..512k both arms, 1M, 2M tiled
  python benchmarks/bench_tiled.py --T 1048576 2097152 --arms tiled
  python benchmarks/bench_tiled.py --tiny                        # CPU smoke run (H = 64)
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.utils.checkpoint as torch_ckpt

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from _common import append_results, is_oom  # noqa: E402
from moepeak.tiled import demo_block_spec, tiled_block  # noqa: E402

from moepeak.demo import models as demo_models  # noqa: E402

K128 = 131072
DEFAULT_T = {"untiled": [K128, 2 * K128, 4 * K128], "tiled": [K128, 2 * K128, 4 * K128, 8 * K128, 16 * K128]}
FIELDS = ["arm", "T", "tile_tokens", "H", "heads", "kv_heads",
          "experts", "top_k", "intermediate", "dtype", "status", "resident_gib", "peak_gib", "kb_per_token",
          "bf16_TH_equiv", "ms"]



def build_block(args, device, dtype):
    cfg = demo_models.MoEConfig(hidden=args.H, heads=args.heads, kv_heads=args.kv_heads, experts=args.E,
                                top_k=args.K, intermediate=args.I, moe="llep", head="plain", checkpoint="none",
                                chunk_rows=args.chunk_rows)
    blk = demo_models.Block(cfg, demo_models.Rotary(cfg.head_dim, cfg.rope_theta), device=device, dtype=dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, p in blk.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(dtype))
    return blk


def one_step(blk, x, gy, arm, tile):
    if arm == "tiled":
        y = tiled_block(x, demo_block_spec(blk, x), tile)
    else:
        y = torch_ckpt.checkpoint(blk, x, use_reentrant=False)
    torch.autograd.backward(y, gy)


def measure(blk, args, arm, T, device, dtype):
    cuda = device.type == "cuda"
    x = torch.randn(1, T, args.H, device=device, dtype=dtype).requires_grad_(True)
    gy = torch.randn(1, T, args.H, device=device, dtype=dtype)
    for p in blk.parameters():  # resident grads, as in training
        p.grad = torch.zeros_like(p)
    if cuda:
        torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated() if cuda else 0
    one_step(blk, x, gy, arm, args.tile)  # warm-up (kernels, plans)
    x.grad = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
    t0 = time.perf_counter()
    one_step(blk, x, gy, arm, args.tile)
    if cuda:
        e.record()
        e.synchronize()
        ms = s.elapsed_time(e)
        peak = torch.cuda.max_memory_allocated() - resident
    else:
        ms, peak = (time.perf_counter() - t0) * 1e3, float("nan")
    return resident, peak, ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", help="token counts (default: 128k..512k untiled, to 2M tiled)")
    ap.add_argument("--arms", nargs="+", default=["untiled", "tiled"], choices=["untiled", "tiled"])
    ap.add_argument("--tile", type=int, default=8192, help="tile_tokens of the tiled arm")
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", dest="kv_heads", type=int, default=4)
    ap.add_argument("--E", type=int, default=16)
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--I", type=int, default=768)
    ap.add_argument("--chunk-rows", dest="chunk_rows", type=int, default=None, help="PipelinedLLEP chunk budget")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized smoke run (H = 64, T <= 512)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder of tiled.csv")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16
    if args.tiny:
        args.H, args.heads, args.kv_heads, args.E, args.K, args.I, args.tile = 64, 4, 2, 4, 2, 32, 64
        Ts = {a: args.T or [256, 512] for a in args.arms}
    else:
        Ts = {a: args.T or DEFAULT_T[a] for a in args.arms}
    blk = build_block(args, device, dtype)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    base = {"H": args.H, "heads": args.heads,
            "kv_heads": args.kv_heads, "experts": args.E, "top_k": args.K, "intermediate": args.I, "dtype": "bf16"}
    for T in sorted({t for a in args.arms for t in Ts[a]}):
        for arm in args.arms:
            if T not in Ts[arm]:
                continue
            row = dict(base, arm=arm, T=T, tile_tokens=args.tile if arm == "tiled" else "")
            try:
                resident, peak, ms = measure(blk, args, arm, T, device, dtype)
                row.update(status="ok", resident_gib=f"{resident / 2**30:.3f}", peak_gib=f"{peak / 2**30:.3f}",
                           kb_per_token=f"{peak / T / 1024:.2f}", bf16_TH_equiv=f"{peak / T / (2 * args.H):.2f}",
                           ms=f"{ms:.1f}")
            except Exception as exc:  # an OOM is a result; anything else is a bug
                if not is_oom(exc):
                    raise
                row.update(status="oom")
            for p in blk.parameters():
                p.grad = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(",".join(str(row.get(k, "")) for k in ("arm", "T", "status", "peak_gib", "kb_per_token",
                                                          "bf16_TH_equiv", "ms")), flush=True)
            if not args.tiny or args.out != ap.get_default("out"):
                append_results(args.out, "tiled", [row], fields=FIELDS, gpu=gpu)


if __name__ == "__main__":
    main()
