"""torchtitan on one GPU: the stock job's best memory settings against the same
job with moepeak's four overrides (moepeak.titan), one sequence per step.

Model: torchtitan's qwen3 MoE (the 30B-A3B flavor's shapes) cut to ~2.1B
parameters: H = 2048, 16 layers, 16 experts top-4, F = 768, V = 151936
(--tiny: the qwen3 MoE debug flavor cut to 2 layers / 8 experts, CPU).
Both jobs are built from torchtitan's Trainer.Config through its build API,
with FSDP2 (fully_shard per block and at the root, world size 1,
bf16 params / fp32 reduce on CUDA):
  stock    FullAC, ChunkedLossWrapper (8 chunks), CPUOffloadPolicy, AdamW
  moepeak  --override.imports moepeak.titan.{experts,loss,sco,stream_adamw}
  moepeak_tiled  the same with sequence-tiled blocks: moepeak.titan.sco={"tile_tokens": 8192}
           (--tiny: 32); not in the default --jobs
Attention is torchtitan's ScaledDotProductAttention (causal) in both jobs; the
rotary tables cover --max-t positions and all blocks share one (moepeak.titan.rope,
in both jobs: job_config).

Per job: T doubles from --start-t until an OOM, a step over --max-step-s or
the time budget; each length runs 1 warm-up + --steps timed steps, a length
above --warmup-max-t one timed step only (its kernels were compiled at the
shorter lengths of the same process). peak_gib is max_memory_allocated over
the length's steps, everything resident included. Rows
(timestamp, gpu, torch, moepeak, commit, job, T, status, peak_gib,
step_s_median, step_s_spread, tokens_per_s) go to benchmarks/results/titan.csv.
An OOM is a row (status "oom").

    PYTHONPATH=... python benchmarks/bench_titan.py            # one H200
    python benchmarks/bench_titan.py --tiny --out /tmp/t.csv   # CPU smoke run
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

ALL = ["experts", "loss", "sco", "stream_adamw"]
JOBS = ("stock", "moepeak", "moepeak_tiled")
TILE_TOKENS = 8192  # the moepeak_tiled job's sequence tile (--tiny: 32)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's moepeak
sys.path.insert(0, HERE)
from _common import append_results, is_oom  # noqa: E402
from moepeak.titan.compat import provide_missing_torch_names  # noqa: E402


def build_config(tiny: bool, max_seq_len: int):
    from moepeak.titan import qwen3_moe_config

    if tiny:
        return qwen3_moe_config(2, 8, 2, 64, max_seq_len=max_seq_len)
    return qwen3_moe_config(16, 16, 4, 768, flavor="30B-A3B", max_seq_len=max_seq_len)


def job_config(name: str, tiny: bool, max_seq_len: int):
    """The job's Trainer.Config: build_config with its moepeak overrides. Both jobs run
    moepeak.titan.rope (one rotary table for all blocks: torchtitan keeps a copy per block,
    [max_seq_len, 2 * head_dim] fp32, 2 GiB each at 2M positions, 32 GiB over 16 blocks)."""
    from torchtitan.config.override import OverrideConfig, apply_overrides

    cfg = build_config(tiny, max_seq_len)
    imports = ["moepeak.titan.rope"]
    if name.startswith("moepeak"):
        imports += [f"moepeak.titan.{n}" for n in ALL]
        if name == "moepeak_tiled":
            imports[1 + ALL.index("sco")] = ("moepeak.titan.sco", {"tile_tokens": 32 if tiny else TILE_TOKENS})
    apply_overrides(OverrideConfig(imports=imports), cfg)
    return cfg


class Job:
    def __init__(self, name: str, tiny: bool, device: torch.device, max_seq_len: int):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from torchtitan.components.loss import ChunkedLossWrapper

        cfg = job_config(name, tiny, max_seq_len)
        if not name.startswith("moepeak"):
            cfg.optimizer.implementation = "for-loop" if device.type == "cpu" else "foreach"
        self.vocab = cfg.model_spec.model.vocab_size
        torch.manual_seed(0)
        with torch.device("meta"):
            model = cfg.model_spec.model.build()
        cfg.activation_checkpoint.build().apply(model)
        kw = {}
        if device.type == "cuda":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if name == "stock":
                kw["offload_policy"] = CPUOffloadPolicy()
        for block in model.layers.values():
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        init_device = "cpu" if "offload_policy" in kw else device
        model.to_empty(device=init_device)
        with torch.no_grad():
            model.init_weights(buffer_device=device)
        model.train()
        self.loss_fn = cfg.loss.build()
        if isinstance(self.loss_fn, ChunkedLossWrapper):
            self.loss_fn.set_lm_head(model.lm_head)
            model._skip_lm_head = True
        self.model, self.device = model, device
        self.optimizer = cfg.optimizer.build(model_parts=[model])

    def step(self, T: int) -> float:
        tokens = torch.randint(0, self.vocab, (1, T), device=self.device)
        labels = torch.randint(0, self.vocab, (1, T), device=self.device)
        pos = torch.arange(T, device=self.device).unsqueeze(0)
        sync(self.device)
        t0 = time.perf_counter()
        pred = self.model(tokens, positions=pos)
        loss, _ = self.loss_fn(pred, labels, torch.tensor(float(T), device=self.device))
        del pred
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        sync(self.device)
        return time.perf_counter() - t0


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def append(path, rows):
    """Append rows (dicts of FIELDS) to the CSV at path through _common.append_results."""
    out_dir, name = os.path.split(os.path.abspath(path))
    if not name.endswith(".csv"):
        raise SystemExit(f"bench_titan: --out must name a .csv file, got {path!r}")
    append_results(out_dir, name[:-len(".csv")], rows, fields=FIELDS)


def run_job(name, args, device, deadline, out):
    job = Job(name, args.tiny, device, max_seq_len=args.max_t)
    results = {}
    T = args.start_t
    while T <= args.max_t:
        if time.time() > deadline:
            print(f"{name}: time budget spent before T={T}", flush=True)
            break
        row = dict(job=name, T=T)
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            times = [job.step(T)]
            if T <= args.warmup_max_t and times[0] <= args.max_step_s:
                times = [job.step(T) for _ in range(args.steps)]
            peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else 0.0
            med = statistics.median(times)
            status = "ok" if med <= args.max_step_s else "slow"
            row.update(status=status, peak_gib=f"{peak:.3f}", step_s_median=f"{med:.4f}",
                       step_s_spread=f"{max(times) - min(times):.4f}", tokens_per_s=f"{T / med:.1f}")
        except Exception as e:  # an OOM is a result
            if not is_oom(e):
                raise
            job.optimizer.zero_grad()
            gc.collect()
            row.update(status="oom", peak_gib="", step_s_median="", step_s_spread="", tokens_per_s="")
        append(out, [row])
        print(row, flush=True)
        results[T] = row
        if row["status"] != "ok":
            break
        T *= 2
    del job
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


# The figure columns of titan.csv, after _common.RESULT_COLUMNS (timestamp, gpu, torch, moepeak, commit).
FIELDS = ["job", "T", "status", "peak_gib", "step_s_median", "step_s_spread", "tokens_per_s"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="debug-size model on the CPU")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "titan.csv"))
    ap.add_argument("--jobs", default="stock,moepeak", help=f"comma list of {JOBS}")
    ap.add_argument("--start-t", type=int, default=None)
    ap.add_argument("--max-t", type=int, default=None)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup-max-t", type=int, default=None,
                    help="longer lengths run one timed step and no warm-up (default: --max-t)")
    ap.add_argument("--max-step-s", type=float, default=300.0)
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget per job (default 240 s)")
    args = ap.parse_args(argv)
    provide_missing_torch_names()  # torchtitan 0.3 on torch 2.11 (moepeak/titan/compat.py)
    if args.start_t is None:
        args.start_t = 64 if args.tiny else 4096
    if args.max_t is None:
        args.max_t = 256 if args.tiny else 1 << 21
    if args.warmup_max_t is None:
        args.warmup_max_t = args.max_t
    bad = [j for j in args.jobs.split(",") if j not in JOBS]
    if bad:
        ap.error(f"--jobs: unknown {bad}; choose from {JOBS}")
    if args.start_t % 8:
        ap.error("--start-t must be a multiple of 8 (ChunkedLossWrapper's 8 chunks)")
    budget = args.budget_s if args.budget_s is not None else 240.0
    if args.tiny:
        device = torch.device("cpu")
        backend = "gloo"
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_titan: needs a CUDA GPU (use --tiny on the CPU)")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        backend = "nccl"
    import torch.distributed as dist
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group(backend, rank=0, world_size=1)
    summary = {}
    for name in args.jobs.split(","):
        summary[name] = run_job(name, args, device, time.time() + budget, args.out)
    for name, rows in summary.items():
        ok = [T for T, r in rows.items() if r["status"] == "ok"]
        print(f"{name}: longest T = {max(ok) if ok else 0}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
