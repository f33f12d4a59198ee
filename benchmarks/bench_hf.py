"""Long-context training reach of a Hugging Face Qwen3-MoE model: transformers
as users run it, with Liger-Kernel, and with moepeak.hf.apply_moepeak.

Model (issue 24, about 2.0B parameters, random init): Qwen3MoeForCausalLM, 16
layers, hidden 2048, 16/4 heads, head_dim 128, 16 experts, top-4,
moe_intermediate 768, vocab 151936; one sequence of T tokens, T doubling from
8k until out of memory or a step takes longer than --max-step-s.

Arms (each in its own subprocess, so one arm's patches and allocator state
never reach the next):
  hf       fp32 params + bf16 autocast, gradient_checkpointing_enable(),
           experts through transformers' grouped_mm, the model's own loss
           (full logits), torch.optim.AdamW(fused=True) on the device.
  hf_offload  hf with gradient_checkpointing_enable(offload=True) (torch checkpoint
           under save_on_cpu: HF's own activation offload, what SCO replaces).
  liger    hf + apply_liger_kernel_to_qwen3_moe (fused linear cross-entropy,
           RMSNorm, SwiGLU, RoPE) + gradient_checkpointing_enable(offload=True)
           (torch checkpoint under save_on_cpu). Skipped with a note when
           liger_kernel is not importable.
  moepeak  bf16 params, moepeak.hf.apply_moepeak (llep_moe experts, the loss
           without logits, SCO checkpointing) + moepeak.StreamAdamW.

Per (arm, T): --warmup steps then --steps timed steps (wall clock around a
synchronized step); peak = torch.cuda.max_memory_allocated over the timed
steps (absolute: weights, grads and optimizer state included, what has to
fit on the GPU); tokens/s = T / median step time. An OOM is a result (status
"oom") and ends the arm; so does a step over --max-step-s ("too_slow"). A T
whose estimated time (the previous T's step x 2.5 per step) no longer fits
--budget-s is recorded as "budget" and ends the arm. Rows are appended to
--csv (default benchmarks/results/hf.csv).

One H200, each command under ~9 minutes (see the report / RESULTS.md):
  python benchmarks/bench_hf.py --arms hf,liger --budget-s 520
  python benchmarks/bench_hf.py --arms moepeak --T 8192,16384,32768,65536,131072,262144 --budget-s 520
  python benchmarks/bench_hf.py --arms moepeak --T 524288 --budget-s 540
CPU smoke run (the test suite runs it): python benchmarks/bench_hf.py --tiny --csv /tmp/hf.csv
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's moepeak, also in the workers
sys.path.insert(0, HERE)
from _common import append_results, is_oom  # noqa: E402

# The figure columns of hf.csv, after _common.RESULT_COLUMNS (timestamp, gpu, torch, moepeak, commit).
FIELDS = ["transformers", "arm", "T", "status", "peak_gib", "step_s", "step_s_spread", "tokens_per_s", "loss",
          "params", "note"]
ARMS = ("hf", "hf_offload", "liger", "moepeak", "moepeak_tiled")
# Qwen3-MoE ~2.0B (issue 24): 16 x (10.5M attention + 75.5M experts) + 2 x 311M embeddings.
FULL = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=16,
            num_experts_per_tok=4)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)
FULL_T = [8192 << i for i in range(7)]  # 8k .. 512k
TINY_T = [64, 128]


def build_model(shape, max_T, dtype, device):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(**shape, max_position_embeddings=max(max_T, 4096), tie_word_embeddings=False,
                         use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # transformers zero-initialises routers: random ones make routing real
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, cfg.initializer_range)
    return model.to(dtype)


def setup_arm(arm, shape, max_T, device, tile_tokens=8192):
    """(model, optimizer, autocast dtype or None, note). moepeak_tiled: moepeak with the
    decoder layers sequence-tiled (apply_moepeak's tile_tokens)."""
    note = ""
    if arm == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe
        apply_liger_kernel_to_qwen3_moe()  # patches the qwen3_moe module's classes: before the model is built
    if arm in ("moepeak", "moepeak_tiled"):
        import moepeak
        from moepeak.hf import apply_moepeak
        model = build_model(shape, max_T, torch.bfloat16, device)
        tile = tile_tokens if arm == "moepeak_tiled" else None
        report = apply_moepeak(model, tile_tokens=tile)
        lean = any(line.startswith("final norm:") for line in report.patched)
        note = (f"tile_tokens {tile}; " if tile else "") + ("lean final norm; " if lean else "") + \
            f"experts on moepeak: {len(report.experts_on_moepeak)}" + "".join(
            f"; left alone: {line}" for line in report.left_alone)
        opt = moepeak.StreamAdamW(model.parameters(), lr=1e-4)
        return model, opt, None, note
    model = build_model(shape, max_T, torch.float32, device)
    model.gradient_checkpointing_enable(offload=(arm in ("hf_offload", "liger")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, opt, torch.bfloat16, note


def run_arm(args, arm):
    shape = TINY if args.tiny else FULL
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = dict(arm=arm)
    if arm == "liger":
        try:
            import liger_kernel  # noqa: F401
        except ImportError as e:
            emit(dict(base, T=0, status="skipped", note=f"liger_kernel not importable: {e}"))
            return
    if arm == "hf_offload" and device == "cpu":
        emit(dict(base, T=0, status="skipped", note="save_on_cpu pins host memory: needs CUDA"))
        return
    model, opt, autocast, note = setup_arm(arm, shape, max(args.T), device, args.tile_tokens)
    params = sum(p.numel() for p in model.parameters())
    base.update(params=params)
    model.train()
    last_step = None
    for T in args.T:
        left = args.deadline - time.time()
        if last_step is not None and last_step * 2.5 * (args.warmup + args.steps) > left:
            emit(dict(base, T=T, status="budget", note=f"{left:.0f} s left, previous step {last_step:.1f} s"))
            break
        ids = torch.randint(0, shape["vocab_size"], (1, T), device=device)

        def step():
            with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
                out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return out.loss.detach()

        try:
            for _ in range(args.warmup):
                step()
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                loss = step()
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        except Exception as e:  # an OOM (also cuBLAS's or an allocator's) is a result; anything else a bug
            if not is_oom(e):
                raise
            del e
            opt.zero_grad(set_to_none=True)
            gc.collect()
            emit(dict(base, T=T, status="oom", note=note))
            break
        med = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        row = dict(base, T=T, status="ok", peak_gib=f"{peak:.2f}", step_s=f"{med:.3f}",
                   step_s_spread=f"{max(times) - min(times):.3f}", tokens_per_s=f"{T / med:.0f}",
                   loss=f"{loss.item():.4f}", note=note)
        last_step = med
        if med > args.max_step_s:
            row["status"] = "too_slow"
        emit(row)
        if row["status"] == "too_slow":
            break


def emit(row):
    """A worker's row goes to the parent at once (one "ROW <json>" line), so a
    call cut short by an outer timeout keeps every length already measured."""
    print("ROW " + json.dumps(row), flush=True)


def append(path, rows):
    """Append rows (dicts of FIELDS) to the CSV at path through _common.append_results."""
    out_dir, name = os.path.split(os.path.abspath(path))
    if not name.endswith(".csv"):
        raise SystemExit(f"bench_hf: --csv must name a .csv file, got {path!r}")
    append_results(out_dir, name[:-len(".csv")], rows, fields=FIELDS)


def record(path, r):
    append(path, [r])
    print(f"{r['arm']:8s} T={r['T']:>7} {r['status']:8s} peak={r.get('peak_gib', ''):>7} GiB "
          f"step={r.get('step_s', ''):>8} s tok/s={r.get('tokens_per_s', ''):>7} {r.get('note', '')[:80]}",
          flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {ARMS}")
    ap.add_argument("--T", default=None, help="comma list of sequence lengths (default 8k doubling to 512k)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per T")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per T")
    ap.add_argument("--max-step-s", type=float, default=300.0, help="an arm stops after a step slower than this")
    ap.add_argument("--budget-s", type=float, default=520.0, help="wall-clock budget of the whole call")
    ap.add_argument("--csv", default=os.path.join(HERE, "results", "hf.csv"))
    ap.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke run)")
    ap.add_argument("--tile-tokens", type=int, default=8192, help="tile of the moepeak_tiled arm")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one arm, print rows
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.T = [int(t) for t in args.T.split(",")] if args.T else (TINY_T if args.tiny else FULL_T)
    if args.worker:
        run_arm(args, args.worker)
        return 0
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"--arms: unknown {bad}; expected some of {ARMS}")
    import transformers

    start = time.time()
    info = dict(transformers=transformers.__version__)
    for i, arm in enumerate(arms):
        # each remaining arm gets an equal share of what is left
        deadline = time.time() + (args.budget_s - (time.time() - start)) / (len(arms) - i)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", arm, "--deadline", str(deadline),
               "--T", ",".join(map(str, args.T)), "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--max-step-s", str(args.max_step_s), "--tile-tokens", str(args.tile_tokens)] + (
                   ["--tiny"] if args.tiny else [])
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
            got = 0
            for line in proc.stdout:  # rows are recorded as they come: a killed call keeps them
                if line.startswith("ROW "):
                    record(args.csv, {**info, **json.loads(line[4:])})
                    got += 1
            failed = proc.wait() != 0
            err.seek(0)
            tail = err.read().strip().splitlines()[-3:]
        if failed or not got:
            record(args.csv, {**info, **dict(arm=arm, T=0, status="error", note=" / ".join(tail)[:500])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
