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

--model: the whole 2.0B demo LM's training step instead of one block (16 layers, H = 2048,
16/4 heads, E = 16, K = 4, I = 768, V = 151936, bf16 params; PipelinedLLEP, Ring-DTP, SCO,
StreamAdamW), arms untiled (SCO per block) and tiled (SCO around the tiled block,
MoEConfig.tile_tokens), each (arm, T) in a fresh child process (an OOM is a result;
memory is freed with the child). `--steps` steps per point (the first allocates the
optimizer's and SCO's pinned host memory), the last one timed.
  peak_gib       max_memory_allocated over the whole run (weights, grads, activations)
  resident_gib   memory_allocated after the last step (weights + grads)
  kb_per_token   (peak - resident) / T / 1024
  proj_peak_gib  with --project-layers N: peak + the resident bytes of the N - layers missing
                 blocks (bf16 params + grads): a deep model's peak from a shallow run
                 (one block's transient does not depend on depth), not a measurement
Rows go to benchmarks/results/tiled_model.csv. One device call (~9 min) each:
  python benchmarks/bench_tiled.py --model --T 131072 262144                      # 16 layers, both arms
  python benchmarks/bench_tiled.py --model --T 524288 --steps 1                   # 16 layers, both arms
  python benchmarks/bench_tiled.py --model --layers 2 --arms tiled --T 1048576 2097152 --steps 1 \
      --project-layers 16
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.utils.checkpoint as torch_ckpt

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from _common import append_results, is_oom  # noqa: E402
from moepeak.tiled import tiled_block  # noqa: E402
from moepeak.demo.tiled import demo_block_spec  # noqa: E402

from moepeak.demo import config as demo_config  # noqa: E402
from moepeak.demo import models as demo_models  # noqa: E402

K128 = 131072
DEFAULT_T = {"untiled": [K128, 2 * K128, 4 * K128], "tiled": [K128, 2 * K128, 4 * K128, 8 * K128, 16 * K128]}
FIELDS = ["arm", "T", "tile_tokens", "H", "heads", "kv_heads",
          "experts", "top_k", "intermediate", "dtype", "status", "resident_gib", "peak_gib", "kb_per_token",
          "bf16_TH_equiv", "ms"]



def build_block(args, device, dtype):
    cfg = demo_config.MoEConfig(hidden=args.H, heads=args.heads, kv_heads=args.kv_heads, experts=args.E,
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


MODEL_FIELDS = ["arm", "T", "tile_tokens", "layers", "H", "heads", "kv_heads", "experts", "top_k",
                "intermediate", "vocab", "steps", "status", "peak_gib", "resident_gib", "kb_per_token",
                "bf16_TH_equiv", "step_s", "project_layers", "proj_peak_gib"]


def _model_cfg(args, arm):
    return demo_config.MoEConfig(vocab_size=args.V, hidden=args.H, layers=args.layers, heads=args.heads,
                                 kv_heads=args.kv_heads, experts=args.E, top_k=args.K, intermediate=args.I,
                                 moe="llep", head="ring_dtp", checkpoint="sco", chunk_rows=args.chunk_rows,
                                 tile_tokens=args.tile if arm == "tiled" else None)


def model_child(args, arm, T, out_file):
    """One (arm, T) point of --model, in this process: writes a JSON result to out_file."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    cuda = device.type == "cuda"
    res = {"status": "error"}
    try:
        cfg = _model_cfg(args, arm)
        model = demo_models.MoELM(cfg, device=device, dtype=torch.bfloat16)
        opt = demo_config.build_optimizer(model.parameters(), "stream", lr=1e-5)
        g = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, args.V, (1, T), generator=g).to(device)
        labels = ids.roll(-1, 1)
        step_s = float("nan")
        for _ in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(ids, labels).backward()
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if cuda else float("nan")
        resident = torch.cuda.memory_allocated() - ids.nbytes - labels.nbytes if cuda else float("nan")
        missing = max(0, (args.project_layers or args.layers) - args.layers)
        block_bytes = (demo_config.param_count(cfg.replace(layers=2)) - demo_config.param_count(cfg.replace(layers=1)))
        res = {"status": "ok", "peak": peak, "resident": resident, "step_s": step_s,
               "proj_peak": peak + missing * block_bytes * 2 * 2}  # bf16 params + bf16 grads
        model.close()
    except Exception as exc:  # an OOM is a result; anything else is reported as an error
        res = {"status": "oom" if is_oom(exc) else "error", "error": f"{type(exc).__name__}: {exc}"[:500]}
    with open(out_file, "w") as f:
        json.dump(res, f)


def model_main(args, argv):
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu"
    Ts = args.T or [K128, 2 * K128]
    for T in Ts:
        for arm in args.arms:
            with tempfile.TemporaryDirectory() as tmp:
                out_file = os.path.join(tmp, "point.json")
                cmd = [sys.executable, os.path.abspath(__file__)] + list(argv) + ["--child", arm, str(T), out_file]
                try:
                    subprocess.run(cmd, timeout=args.point_seconds, check=False)
                    with open(out_file) as f:
                        res = json.load(f)
                except subprocess.TimeoutExpired:
                    res = {"status": "timeout"}
                except (OSError, ValueError):
                    res = {"status": "error"}
            row = dict(arm=arm, T=T, tile_tokens=args.tile if arm == "tiled" else "", layers=args.layers, H=args.H,
                       heads=args.heads, kv_heads=args.kv_heads, experts=args.E, top_k=args.K, intermediate=args.I,
                       vocab=args.V, steps=args.steps, status=res["status"], project_layers=args.project_layers or "")
            if res["status"] == "ok":
                tr = res["peak"] - res["resident"]
                row.update(peak_gib=f"{res['peak'] / 2**30:.3f}", resident_gib=f"{res['resident'] / 2**30:.3f}",
                           kb_per_token=f"{tr / T / 1024:.2f}", bf16_TH_equiv=f"{tr / T / (2 * args.H):.2f}",
                           step_s=f"{res['step_s']:.2f}",
                           proj_peak_gib=f"{res['proj_peak'] / 2**30:.3f}" if args.project_layers else "")
            elif "error" in res:
                print(f"{arm} T={T}: {res['error']}", flush=True)
            print(",".join(str(row.get(k, "")) for k in ("arm", "T", "layers", "status", "peak_gib", "resident_gib",
                                                          "kb_per_token", "bf16_TH_equiv", "step_s", "proj_peak_gib")),
                  flush=True)
            if not args.tiny or args.out != DEFAULT_OUT:
                append_results(args.out, "tiled_model", [row], fields=MODEL_FIELDS, gpu=gpu)


DEFAULT_OUT = os.path.join(HERE, "results")


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
    ap.add_argument("--out", default=DEFAULT_OUT, help="folder of tiled.csv / tiled_model.csv")
    ap.add_argument("--model", action="store_true", help="the whole LM's training step (see above)")
    ap.add_argument("--layers", type=int, default=16, help="--model: decoder blocks")
    ap.add_argument("--V", type=int, default=151936, help="--model: vocabulary")
    ap.add_argument("--steps", type=int, default=2, help="--model: steps per point, the last timed")
    ap.add_argument("--project-layers", dest="project_layers", type=int, default=None,
                    help="--model: also give the peak projected to this many layers")
    ap.add_argument("--point-seconds", dest="point_seconds", type=float, default=540,
                    help="--model: wall-clock cap per (arm, T) child")
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)  # ARM T OUT_FILE
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.model:
        if args.tiny:
            args.H, args.heads, args.kv_heads, args.E, args.K, args.I, args.tile, args.V = 64, 4, 2, 4, 2, 32, 64, 512
            args.layers = min(args.layers, 2)
            args.T = args.T or [256, 512]
        if args.child:
            model_child(args, args.child[0], int(args.child[1]), args.child[2])
        else:
            model_main(args, argv)
        return
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
            if not args.tiny or args.out != DEFAULT_OUT:
                append_results(args.out, "tiled", [row], fields=FIELDS, gpu=gpu)


if __name__ == "__main__":
    main()
