"""Long-context training reach of a Hugging Face MoE model: transformers as users run it,
with Liger-Kernel, with ALST (DeepSpeed + ArcticTraining), and with moepeak.hf.apply_moepeak.

Models (random init, --model):
  qwen3_moe  (issue 24, about 2.0B parameters) Qwen3MoeForCausalLM, 16 layers, hidden
             2048, 16/4 heads, head_dim 128, 16 experts, top-4, moe_intermediate 768,
             vocab 151936. Rows go to benchmarks/results/hf.csv.
  olmoe      the OLMoE-1B-7B shape (about 6.9B parameters): OlmoeForCausalLM, 16 layers,
             hidden 2048, 16/16 heads, 64 experts, top-8, intermediate 1024, vocab 50304.
             Rows go to benchmarks/results/hf_olmoe.csv.
One sequence of T tokens, T doubling from 8k until out of memory or a step takes longer
than --max-step-s.

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
           liger_kernel is not importable or has no patch for the model (OLMoE).
  alst     ALST's single-GPU recipe (benchmarks/alst_arm.py): bf16 params, DeepSpeed
           ZeRO-3 with params and optimizer offloaded to CPU, DeepSpeedCPUAdam,
           ArcticTraining's checkpoint offload, DeepSpeed's TiledMLP over each MoE
           block and TiledFusedLogitsLoss; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
           Before the sweep, a row of status "match"/"mismatch" at --check-T: its first
           step's loss against stock transformers' (fp32, bf16 autocast, bf16 params)
           on the same weights and batch (alst_arm.check_first_step states the rule).
  alst_liger  alst with Liger's fused linear cross-entropy, RMSNorm and RoPE for the
           loss (the recipes' model.type liger); Qwen3-MoE only.
  moepeak  bf16 params, moepeak.hf.apply_moepeak (llep_moe experts, the loss
           without logits, SCO checkpointing) + moepeak.StreamAdamW.
  moepeak_tiled  moepeak with the decoder layers sequence-tiled (--tile-tokens).
ALST needs deepspeed 0.19.8 and arctic_training 0.8.0 (benchmarks/wheels.txt); without
them its rows are "skipped".

Per (arm, T): --warmup steps then --steps timed steps (wall clock around a
synchronized step); peak = torch.cuda.max_memory_allocated over the timed
steps (absolute: weights, grads and optimizer state included, what has to
fit on the GPU); tokens/s = T / median step time. Every step is timed: a row's
note gives the first step at that T ("first step ... s"), marked "(the process's
first)" at the arm's first T, where it includes one-time work (Triton compilation,
pinned host buffers, optimizer state, allocator growth); with --warmup 0 the
timed step is that first step. The note also gives the worker's peak host RSS.
An OOM is a result (status "oom") and ends the arm; so does a step over
--max-step-s ("too_slow"). A T whose estimated time (the previous T's step x
2.5 per step) no longer fits --budget-s is recorded as "budget" and ends the
arm. Rows are appended to --csv (default: the model's file above).

One H200, each command under ~9 minutes (see RESULTS.md):
  python benchmarks/bench_hf.py --arms hf,liger --budget-s 520
  python benchmarks/bench_hf.py --arms moepeak --T 8192,16384,32768,65536,131072,262144 --budget-s 520
  python benchmarks/bench_hf.py --arms moepeak --T 524288 --budget-s 540
  python benchmarks/bench_hf.py --arms alst --budget-s 540     # after installing .whl/ (gpu_env.sh)
  python benchmarks/bench_hf.py --model olmoe --arms hf,alst,moepeak_tiled
  python benchmarks/bench_hf.py --model olmoe --arms moepeak --T 262144 --sco-keep-last 10   # the manual setting
  python benchmarks/bench_hf.py --model olmoe --arms moepeak_tiled --layers 4 --T 1048576    # 1M on 4 of 16 layers
  python benchmarks/bench_hf.py --model olmoe --arms moepeak_tiled --T 262144 --attention auto  # cuDNN, head groups
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
ALST_ARMS = ("alst", "alst_liger")  # alst_arm.ARMS, without importing it in the parent
ARMS = ("hf", "hf_offload", "liger", "moepeak", "moepeak_tiled") + ALST_ARMS
# Qwen3-MoE ~2.0B (issue 24): 16 x (10.5M attention + 75.5M experts) + 2 x 311M embeddings.
FULL = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=16,
            num_experts_per_tok=4)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)
# OLMoE-1B-7B's shape, ~6.9B: 16 x (16.8M attention + 402.7M experts) + 2 x 103M embeddings.
OLMOE_FULL = dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8)
OLMOE_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, eos_token_id=None)  # 50279 > vocab
# family: (transformers config class, model class, full shape, tiny shape, default results file)
MODELS = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", FULL, TINY, "hf.csv"),
          "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", OLMOE_FULL, OLMOE_TINY, "hf_olmoe.csv")}
LIGER_PATCHES = {"qwen3_moe": "apply_liger_kernel_to_qwen3_moe"}  # liger_kernel 0.8.5 has none for OLMoE
FULL_T = [8192 << i for i in range(7)]  # 8k .. 512k
TINY_T = [64, 128]


def build_model(shape, max_T, dtype, device, family="qwen3_moe"):
    """The random-init model of `family` (MODELS) with `shape`, built in fp32 on `device` from
    seed 0 (so every arm starts from the same weights), then cast to dtype."""
    import transformers

    if family not in MODELS:
        raise ValueError(f"build_model: family must be one of {sorted(MODELS)}, got {family!r}")
    config_cls, model_cls = (getattr(transformers, name) for name in MODELS[family][:2])
    cfg = config_cls(**shape, max_position_embeddings=max(max_T, 4096), tie_word_embeddings=False,
                     use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(cfg)
    with torch.no_grad():  # transformers zero-initialises routers: random ones make routing real
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, cfg.initializer_range)
    return model.to(dtype)


def setup_arm(arm, shape, max_T, device, tile_tokens=8192, family="qwen3_moe", keep_last=None, attention=None):
    """(model, optimizer, autocast dtype or None, note). moepeak_tiled: moepeak with the
    decoder layers sequence-tiled (apply_moepeak's tile_tokens). keep_last: the moepeak arms'
    SCO boundaries kept on the GPU, set by hand (SCOConfig(keep_last=...): the automatic
    placement then leaves SCO as given); None: apply_moepeak's automatic placement. attention:
    the moepeak arms' apply_moepeak(attention_backend=..., attention_head_groups=...) (None:
    apply_moepeak's defaults; "auto": both "auto", the head groups only where tiled)."""
    note = ""
    if arm == "liger":
        import liger_kernel.transformers
        # patches the model module's classes: before the model is built
        getattr(liger_kernel.transformers, LIGER_PATCHES[family])()
    if arm in ("moepeak", "moepeak_tiled"):
        import moepeak
        from moepeak.hf import apply_moepeak
        model = build_model(shape, max_T, torch.bfloat16, device, family)
        tile = tile_tokens if arm == "moepeak_tiled" else None
        extra = {} if keep_last is None else dict(sco_config=moepeak.SCOConfig(keep_last=keep_last))
        if attention is not None:
            extra["attention_backend"] = attention
        if tile and attention == "auto":
            extra["attention_head_groups"] = "auto"
        report = apply_moepeak(model, tile_tokens=tile, **extra)
        lean = any(line.startswith("final norm:") for line in report.patched)
        note = (f"manual keep_last {keep_last}; " if keep_last is not None else "") + \
            (f"attention {attention}; " if attention is not None else "") + \
            (f"tile_tokens {tile}; " if tile else "") + ("lean final norm; " if lean else "") + \
            f"experts on moepeak: {len(report.experts_on_moepeak)}" + "".join(
            f"; left alone: {line}" for line in report.left_alone)
        opt = moepeak.StreamAdamW(model.parameters(), lr=1e-4)
        return model, opt, None, note
    model = build_model(shape, max_T, torch.float32, device, family)
    model.gradient_checkpointing_enable(offload=(arm in ("hf_offload", "liger")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, opt, torch.bfloat16, note


def plain_step(model, opt, autocast, device):
    """One training step of a transformers model on labels = ids; returns the loss (detached)."""
    def step(ids):
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()
    return step


def timed(step, ids, device):
    """(loss, wall seconds) of step(ids), the device synchronized at the end."""
    t0 = time.perf_counter()
    loss = step(ids)
    if device == "cuda":
        torch.cuda.synchronize()
    return loss, time.perf_counter() - t0


def setup_alst(args, arm, shape, device, base):
    """The ALST arm's step and note, after its check row at args.check_T: the model is built
    as the other arms' (fp32, seed 0), stock transformers' losses of one batch are taken
    (alst_arm.stock_losses; the model is left in bf16), ALST is applied, and its first
    step on that batch is compared (alst_arm.check_first_step). (None, None) after a
    "skipped" row (ALST's components not importable) or an "oom" row (ZeRO-3's offloaded
    state alone would not fit in the host RAM available). Adds params to base."""
    import alst_arm

    try:
        alst_arm.import_components()
        if arm == "alst_liger":
            import liger_kernel  # noqa: F401
    except ImportError as e:
        emit(dict(base, T=0, status="skipped", note=f"ALST not importable: {e}"))
        return None, None
    params = sum(p.numel() for p in build_model(shape, 1, torch.float32, "meta", args.model).parameters())
    base.update(params=params)
    offload_param = args.alst_offload_param == "cpu"
    state, avail = alst_arm.host_state_bytes(params, offload_param), host_available()
    host = f"host: ZeRO-3 offloaded state {state / 2**30:.1f} GiB" + (
        f" of {avail / 2**30:.1f} GiB available" if avail is not None else "")
    if avail is not None and state > avail:
        emit(dict(base, T=args.check_T, status="oom", note=f"{host}: refused before building anything"))
        return None, None
    model = build_model(shape, max(args.T), torch.float32, device, args.model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (1, args.check_T), generator=gen).to(device)
    refs = alst_arm.stock_losses(model, ids, liger=arm == "alst_liger")
    tiny_tiles = dict(tokens_per_tile=16, logits_tiles=3) if args.tiny else {}  # many tiles at T = 64
    step, note = alst_arm.setup(arm, model, device, optimizer=args.alst_optimizer, offload_param=offload_param,
                                **tiny_tiles)
    note = f"{note}; {host}"
    if device == "cuda":
        torch.cuda.empty_cache()
    loss, first_s = timed(step, ids, device)
    within, check = alst_arm.check_first_step(loss.item(), refs, same="liger" if arm == "alst_liger" else "bf16")
    emit(dict(base, T=args.check_T, status="match" if within else "mismatch", loss=f"{loss.item():.6f}",
              note=f"{check}; the process's first step {first_s:.3f} s; {note}"))
    return step, note


def host_available():
    """Bytes of pageable host memory available now (moepeak.core.host_memory), or None if unknown."""
    try:
        from moepeak.core.host_memory import available_bytes
    except ImportError:
        return None
    return available_bytes(pinned=False)


def run_arm(args, arm):
    family = args.model
    shape = MODELS[family][3] if args.tiny else MODELS[family][2]
    if args.layers is not None:
        shape = dict(shape, num_hidden_layers=args.layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = dict(arm=arm)
    if arm in ("liger", "alst_liger") and family not in LIGER_PATCHES:
        emit(dict(base, T=0, status="skipped", note=f"liger_kernel has no patch for {family}"))
        return
    if arm == "liger":
        try:
            import liger_kernel  # noqa: F401
        except ImportError as e:
            emit(dict(base, T=0, status="skipped", note=f"liger_kernel not importable: {e}"))
            return
    if arm == "hf_offload" and device == "cpu":
        emit(dict(base, T=0, status="skipped", note="save_on_cpu pins host memory: needs CUDA"))
        return
    if arm in ALST_ARMS:
        step, note = setup_alst(args, arm, shape, device, base)
        if step is None:
            return
        model = None  # built and held inside the ALST engine
        first_of_process = False  # the check row's step was the process's first
    else:
        model, opt, autocast, note = setup_arm(arm, shape, max(args.T), device, args.tile_tokens, family,
                                               args.sco_keep_last, args.attention)
        if args.layers is not None:
            note = f"{args.layers} layers; " + note
        params = sum(p.numel() for p in model.parameters())
        base.update(params=params)
        model.train()
        step = plain_step(model, opt, autocast, device)
        first_of_process = True
    last_step = None
    for T in args.T:
        left = args.deadline - time.time()
        if last_step is not None and last_step * 2.5 * (args.warmup + args.steps) > left:
            emit(dict(base, T=T, status="budget", note=f"{left:.0f} s left, previous step {last_step:.1f} s"))
            break
        ids = torch.randint(0, shape["vocab_size"], (1, T), device=device)
        try:
            times = []
            for i in range(args.warmup + args.steps):
                if i == args.warmup and device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                loss, seconds = timed(step, ids, device)
                times.append(seconds)
        except Exception as e:  # an OOM (also cuBLAS's or an allocator's) is a result; anything else a bug
            if not is_oom(e):
                raise
            del e
            gc.collect()
            emit(dict(base, T=T, status="oom", note=note))
            break
        first = f"first step {times[0]:.3f} s" + (" (the process's first)" if first_of_process else "")
        first_of_process = False
        timed_steps = times[args.warmup:]
        med = statistics.median(timed_steps)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        row = dict(base, T=T, status="ok", peak_gib=f"{peak:.2f}", step_s=f"{med:.3f}",
                   step_s_spread=f"{max(timed_steps) - min(timed_steps):.3f}", tokens_per_s=f"{T / med:.0f}",
                   loss=f"{loss.item():.4f}",
                   note="; ".join(x for x in (note, first, host_rss(), placement_line(model)) if x))
        last_step = med
        if med > args.max_step_s:
            row["status"] = "too_slow"
        emit(row)
        if row["status"] == "too_slow":
            break


def placement_line(model):
    """moepeak's automatic placement for this step, on one line (empty for the other arms)."""
    if getattr(model, "_moepeak_placement", None) is None:
        return ""
    from moepeak.hf import placement_report

    return "placement: " + " | ".join(line.strip() for line in placement_report(model).splitlines() if line.strip())


def host_rss():
    """The worker's peak resident host memory so far (Linux ru_maxrss is in KiB)."""
    import resource

    return f"host peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB"


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
    print(f"{r['arm']:10s} T={r['T']:>7} {r['status']:8s} peak={r.get('peak_gib', ''):>7} GiB "
          f"step={r.get('step_s', ''):>8} s tok/s={r.get('tokens_per_s', ''):>7} {r.get('note', '')[:160]}",
          flush=True)


def worker_env(arm):
    """The environment of an arm's worker: ALST's arms run under its allocator setting unless
    the caller set PYTORCH_CUDA_ALLOC_CONF."""
    env = dict(os.environ)
    if arm in ALST_ARMS:
        import alst_arm

        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", alst_arm.ALLOC_CONF)
    return env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {ARMS}")
    ap.add_argument("--model", default="qwen3_moe", choices=sorted(MODELS), help="the model family's shape")
    ap.add_argument("--T", default=None, help="comma list of sequence lengths (default 8k doubling to 512k)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per T")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per T")
    ap.add_argument("--max-step-s", type=float, default=300.0, help="an arm stops after a step slower than this")
    ap.add_argument("--budget-s", type=float, default=520.0, help="wall-clock budget of the whole call")
    ap.add_argument("--csv", default=None, help="results file (default benchmarks/results/<the model's file>)")
    ap.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke run)")
    ap.add_argument("--tile-tokens", type=int, default=8192, help="tile of the moepeak_tiled arm")
    ap.add_argument("--check-T", type=int, default=None,
                    help="the ALST arms' correctness check length (default 8192; --tiny 64)")
    ap.add_argument("--alst-optimizer", default="cpu_adam", choices=("cpu_adam", "torch"),
                    help="ALST's DeepSpeedCPUAdam (JIT-built on first use), or torch.optim.AdamW on the "
                         "offloaded state (CPU smoke runs: no build)")
    ap.add_argument("--alst-offload-param", default="cpu", choices=("cpu", "none"),
                    help="ZeRO-3 offload_param of the ALST arms (the recipes': cpu)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of the model (default: the family's shape; e.g. 4 of OLMoE's 16 at 1M)")
    ap.add_argument("--sco-keep-last", type=int, default=None,
                    help="the moepeak arms' SCO boundaries on the GPU set by hand (default: automatic placement)")
    ap.add_argument("--attention", default=None, choices=("auto", "torch"),
                    help="the moepeak arms' attention_backend and (tiled) attention_head_groups "
                         "(default: apply_moepeak's)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one arm, print rows
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.T = [int(t) for t in args.T.split(",")] if args.T else (TINY_T if args.tiny else FULL_T)
    if args.check_T is None:
        args.check_T = 64 if args.tiny else 8192
    if args.check_T < 2:
        ap.error(f"--check-T: the correctness check needs at least 2 tokens, got {args.check_T}")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers: a model needs at least 1 decoder layer, got {args.layers}")
    if args.sco_keep_last is not None and args.sco_keep_last < 0:
        ap.error(f"--sco-keep-last must be >= 0, got {args.sco_keep_last}")
    if args.csv is None:
        args.csv = os.path.join(HERE, "results", MODELS[args.model][4])
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
               "--model", args.model, "--T", ",".join(map(str, args.T)), "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--max-step-s", str(args.max_step_s), "--tile-tokens",
               str(args.tile_tokens), "--check-T", str(args.check_T), "--alst-optimizer", args.alst_optimizer,
               "--alst-offload-param", args.alst_offload_param] + (["--tiny"] if args.tiny else []) + \
            (["--layers", str(args.layers)] if args.layers is not None else []) + \
            (["--sco-keep-last", str(args.sco_keep_last)] if args.sco_keep_last is not None else []) + \
            (["--attention", args.attention] if args.attention is not None else [])
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=worker_env(arm))
            got = 0
            for line in proc.stdout:  # rows are recorded as they come: a killed call keeps them
                if line.startswith("ROW "):
                    record(args.csv, {**info, **json.loads(line[4:])})
                    got += 1
            rc = proc.wait()
            failed = rc != 0
            err.seek(0)
            tail = err.read().strip().splitlines()[-3:]
            if rc < 0:  # e.g. SIGKILL from the host's OOM killer, which leaves no message
                tail.append(f"worker killed by signal {-rc}")
        if failed or not got:
            record(args.csv, {**info, **dict(arm=arm, T=0, status="error", note=" / ".join(tail)[:500])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
