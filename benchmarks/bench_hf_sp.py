"""Sequence parallelism across GPUs: a Hugging Face MoE model trained on one sequence of T tokens
split over the P ranks by DeepSpeed Ulysses, the same engine with and without moepeak.

Models (random init, --model):
  qwen3_moe      bench_hf.py's Qwen3-MoE, about 2.0B parameters (16 layers, hidden 2048, 16/4
                 heads of 128, 16 experts top-4, vocab 151936).
  qwen3_30b_a3b  the Qwen3-30B-A3B shape, about 30.5B parameters (48 layers, hidden 2048, 32/4
                 heads of 128, 128 experts top-8 of intermediate 768, vocab 151936).
Arms (one sequence per step, rank r holding tokens [r T/P, (r+1) T/P) with their global
position_ids and the shifted labels; bf16 parameters; the attention core --attn behind
Ulysses' all-to-all, "sdpa" by default):
  ulysses  the engine as users run it: DeepSpeed Ulysses (UlyssesSPAttentionHF, no DeepSpeed
           engine), FSDP2 (fully_shard per decoder layer and at the root: a replicated 30B model
           does not fit), gradient_checkpointing_enable() (torch's checkpoint), experts through
           transformers' grouped_mm, the model's own loss on the rank's shard (full logits),
           torch.optim.AdamW (fused on CUDA).
  moepeak  the same Ulysses with apply_moepeak(model, group=sp, sequence_group=sp,
           tile_tokens=--tile-tokens): the experts split over the P ranks (PipelinedLLEP),
           tiled layers, SCO, the loss without logits (the rank's share of the sequence's);
           DistributedDataParallel for the replicated parameters; moepeak.StreamAdamW.

Per (arm, T): --steps steps, the last timed (from a barrier to the end of the optimizer step);
T doubles from --min-len to --max-len until a failure or the arm's --max-seconds (every point in
fresh child processes, so an OOM on one rank is that point's result: _dist_points.py).
Recorded (DIR/hf_sp.csv, after _common.RESULT_COLUMNS): P, model, arm, T (tokens of the
sequence), tokens_per_rank, status (ok / oom / time-cap / timeout / error / peer-failed),
peak_gib (max over ranks of max_memory_allocated), step_s (max over ranks), tokens_per_s (T /
step), loss (rank 0's), transformers, deepspeed, note.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/bench_hf_sp.py --out benchmarks/results
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=8 benchmarks/bench_hf_sp.py --model qwen3_30b_a3b \\
        --min-len 131072 --max-len 4194304 --out benchmarks/results
    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 benchmarks/bench_hf_sp.py --smoke --out /tmp/r   # CPU (the test)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repo root
from _common import doubling  # noqa: E402
from _dist_points import (add_sweep_args, header_line, parse_sweep, rank0_say, say_reach, sweep_to_csv,  # noqa: E402
                          timed_steps)
from bench_hf import FULL, TINY  # noqa: E402

FIELDS = ["P", "model", "arm", "T", "tokens_per_rank", "status", "peak_gib", "step_s", "tokens_per_s", "loss",
          "transformers", "deepspeed", "note"]
ARMS = ("ulysses", "moepeak")
# Qwen3-30B-A3B's shape (its config.json): 48 x (21.0M attention + 302M experts) + 2 x 311M embeddings.
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8)
MODELS = {"qwen3_moe": FULL, "qwen3_30b_a3b": QWEN3_30B_A3B}


def build_model(shape, T, device, dtype):
    """The random-init Qwen3-MoE of `shape`, built in `dtype` on `device` from seed 0 (a 30B model
    in fp32 would not fit one GPU), routers drawn at random (transformers zero-inits them)."""
    import transformers
    cfg = transformers.Qwen3MoeConfig(**shape, max_position_embeddings=max(T, 4096), tie_word_embeddings=False,
                                      use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, cfg.initializer_range)
    return model.train()


def ulysses(model, attn, P):
    """DeepSpeed Ulysses over the P ranks (deepspeed.comm on the point's process group);
    returns the sequence group."""
    import deepspeed
    if not torch.cuda.is_available():
        import deepspeed.ops  # its shared-memory CPU all-reduce is not used: do not JIT-build it
        deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    model.set_attn_implementation(attn)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation=attn,
                                                          sequence_parallel_size=P, micro_batch_size=1,
                                                          seq_length_is_variable=True)
    return mpu.get_sequence_parallel_group()


def _point(rank, world, dev, arm, T, steps, model_name, shape, tile_tokens, attn):
    """One (arm, T) point on one rank: build the arm, `steps` steps on this rank's shard of one
    sequence, the last timed."""
    if dev.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(shape, T, dev, dtype)
    sp = ulysses(model, attn, world)
    if arm == "ulysses":
        from torch.distributed.fsdp import fully_shard
        model.gradient_checkpointing_enable()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda, foreach=not cuda)
        run, settings = model, f"Ulysses ({attn}) + FSDP2 + HF checkpointing + torch AdamW"
    else:
        import moepeak
        from moepeak.hf import apply_moepeak
        report = apply_moepeak(model, group=sp, sequence_group=sp, tile_tokens=tile_tokens)
        run = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if cuda else None)
        opt = moepeak.StreamAdamW(model.parameters(), lr=1e-5)
        settings = (f"Ulysses ({attn}) + apply_moepeak: experts split over {world} ranks "
                    f"({len(report.experts_on_moepeak)} modules); tile_tokens {tile_tokens}; DDP + StreamAdamW")
    S = T // world
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)

    def batch(step):  # the same sequence on every rank (one seed per step); this rank's shard of it
        g = torch.Generator().manual_seed(1000 * step + T)
        ids = torch.randint(0, shape["vocab_size"], (1, T + 1), generator=g)
        mine = slice(rank * S, (rank + 1) * S)
        return dict(input_ids=ids[:, :T][:, mine].to(dev), position_ids=torch.arange(T)[None, mine].to(dev),
                    shift_labels=ids[:, 1:][:, mine].to(dev))

    def forward(b):
        return run(**b, labels=b["shift_labels"], use_cache=False).loss

    times, losses = timed_steps(steps, dev, batch, forward, lambda loss: loss.backward(), opt)
    return dict(step_s=times, loss=losses, settings=settings)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_args(ap, ARMS)
    ap.add_argument("--model", default="qwen3_moe", choices=sorted(MODELS))
    ap.add_argument("--smoke", action="store_true", help="bench_hf's tiny model on CPU gloo ranks (the test)")
    ap.add_argument("--min-len", type=int, default=None, help="tokens of the sequence (default 16384; --smoke 64)")
    ap.add_argument("--max-len", type=int, default=None, help="(default 4194304; --smoke 128)")
    ap.add_argument("--tile-tokens", type=int, default=None, help="moepeak arm's tile_tokens (default 8192; "
                                                                  "--smoke 16)")
    ap.add_argument("--attn", default="sdpa", help="the attention core behind Ulysses")
    parsed = parse_sweep("bench_hf_sp", ap, ARMS, argv)
    if parsed is None:
        return 2
    a, arms, rank, world = parsed
    import deepspeed
    import transformers
    shape, device_kind = (TINY, "cpu") if a.smoke else (MODELS[a.model], "cuda")
    model_name = "tiny" if a.smoke else a.model
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    if shape["num_experts"] % world or heads % world or (kv % world and world % kv):
        raise SystemExit(f"bench_hf_sp: P={world} must divide the {shape['num_experts']} experts and the {heads} "
                         f"heads, and divide or be a multiple of the {kv} kv heads (Ulysses)")
    tile = a.tile_tokens or (16 if a.smoke else 8192)
    lo = a.min_len or (64 if a.smoke else 16384)
    hi = a.max_len or (128 if a.smoke else 1 << 22)
    lengths = doubling(lo, hi, multiple_of=world)
    say = rank0_say(rank)
    say(f"bench_hf_sp: P={world}, {model_name}, sequence of {lengths[0]}..{lengths[-1]} tokens, {a.steps} steps "
        f"each, budget {a.max_seconds:.0f} s per arm")
    say(header_line("T", "tok/s"))

    def row(L, step):
        return dict(model=model_name, T=L, tokens_per_rank=L // world, tokens_per_s=f"{L / step:.1f}" if step else "",
                    transformers=transformers.__version__, deepspeed=deepspeed.__version__)

    res = sweep_to_csv(a, "hf_sp", FIELDS, row, arms, lengths, _point,
                       lambda arm, L: (arm, L, a.steps, model_name, shape, tile, a.attn), rank=rank, world=world,
                       device_kind=device_kind, say=say)
    say_reach(res, say, lambda L: f"sequence completed {L} tokens ({L // world} per rank)", baseline="ulysses")
    return 0


if __name__ == "__main__":
    sys.exit(main())
