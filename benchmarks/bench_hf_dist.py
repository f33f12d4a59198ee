"""Two (or more) GPUs: the Hugging Face Qwen3-MoE of bench_hf.py trained data parallel,
one sequence of T tokens per rank, HF's own multi-GPU setup against apply_moepeak with
the experts split over the ranks.

Arms (the same random-init model; every point in fresh child processes, see
_dist_points.py):
  fsdp     HF's FSDP2 setup as accelerate builds it (its FSDP2 plugin with the decoder
           layer as the wrap unit): torch fully_shard per Qwen3MoeDecoderLayer and at the
           root, fp32 params, MixedPrecisionPolicy(bf16 params, fp32 reduce) on CUDA,
           gradient_checkpointing_enable(), experts through transformers' grouped_mm,
           the model's own loss, torch.optim.AdamW (fused on CUDA) on the shards.
  moepeak  bf16 params, apply_moepeak(model, group=WORLD[, tile_tokens]): each rank
           keeps E/P experts and PipelinedLLEP moves the tokens to them; the loss without
           logits; SCO checkpointing; the lean final norm. The replicated parameters'
           gradients are averaged over the ranks (moepeak.hf.average_gradients), so every
           gradient is the mean loss's, as the expert slices' already are; moepeak.StreamAdamW.

Per (arm, T): --steps steps (the first allocates optimizer state and pinned arenas),
the last timed; T doubles from --min-len to --max-len until a failure or the arm's
--max-seconds. Recorded (DIR/hf_dist.csv, after _common.RESULT_COLUMNS): P, arm,
tokens_per_rank, status (ok / oom / time-cap / timeout / error / peer-failed),
peak_gib (max over ranks of max_memory_allocated: weights, grads, optimizer state and
activations), step_s (timed step, max over ranks), tokens_per_s_per_gpu, loss (rank 0),
transformers, note.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/bench_hf_dist.py --out benchmarks/results
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/bench_hf_dist.py --arms moepeak \\
        --tile-tokens 8192 --min-len 262144 --max-len 524288 --out benchmarks/results
    torchrun --nproc_per_node=2 benchmarks/bench_hf_dist.py --tiny --out /tmp/r   # CPU gloo (the test)
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
from _dist_points import (add_sweep_args, header_line, parse_simulated_oom, parse_sweep, rank0_say,  # noqa: E402
                          say_reach, sweep_to_csv, timed_steps)
from bench_hf import FULL, TINY, build_model  # noqa: E402

FIELDS = ["P", "arm", "tokens_per_rank", "status", "peak_gib", "step_s", "tokens_per_s_per_gpu", "loss",
          "transformers", "note"]
ARMS = ("fsdp", "moepeak")


def _point(rank, world, dev, arm, T, steps, shape, tile_tokens, simulate_oom):
    """One (arm, T) point on one rank: build the arm, `steps` steps, the last timed."""
    cuda = dev.type == "cuda"
    if arm == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        model = build_model(shape, T, torch.float32, dev)
        model.gradient_checkpointing_enable()
        mp = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) \
            if cuda else {}
        for layer in model.model.layers:
            fully_shard(layer, **mp)
        fully_shard(model, **mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda, foreach=not cuda)
        dense, settings = [], "FSDP2 + HF checkpointing + torch AdamW"
        reduce_grads = lambda: None  # noqa: E731 (FSDP2 reduced them in backward)
    else:
        import moepeak
        from moepeak.hf import apply_moepeak, average_gradients, expert_slices
        model = build_model(shape, T, torch.bfloat16, dev)
        report = apply_moepeak(model, group=dist.group.WORLD, tile_tokens=tile_tokens)
        opt = moepeak.StreamAdamW(model.parameters(), lr=1e-4)
        slices = expert_slices(model)
        dense = [p for n, p in model.named_parameters() if n not in slices]
        reduce_grads = lambda: average_gradients(model)  # noqa: E731
        settings = (f"experts on moepeak: {len(report.experts_on_moepeak)} split over {world} ranks"
                    + (f"; tile_tokens {tile_tokens}" if tile_tokens else ""))
    model.train()
    gen = torch.Generator().manual_seed(1000 * rank + T)

    def backward(loss):
        loss.backward()
        reduce_grads()

    times, losses = timed_steps(
        steps, dev, lambda _: torch.randint(0, shape["vocab_size"], (1, T), generator=gen).to(dev),
        lambda ids: model(input_ids=ids, labels=ids).loss, backward, opt,
        simulated_oom=bool(simulate_oom) and tuple(simulate_oom) == (arm, T, rank))
    if dense:  # the replicated parameters took the same update on every rank
        sums = torch.stack([p.detach().double().sum() for p in dense])
        ref = sums.clone()
        dist.broadcast(ref, src=0)
        if not torch.equal(sums, ref):
            raise RuntimeError(f"bench_hf_dist: rank {rank}'s replicated parameters differ from rank 0's")
    return dict(step_s=times, loss=losses, settings=settings)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_args(ap, ARMS)
    ap.add_argument("--tiny", action="store_true", help="bench_hf's tiny model on CPU gloo (tests the script)")
    ap.add_argument("--min-len", type=int, default=None, help="tokens per rank (default 8192; --tiny 64)")
    ap.add_argument("--max-len", type=int, default=None, help="(default 524288; --tiny 128)")
    ap.add_argument("--tile-tokens", type=int, default=None, help="moepeak arm: apply_moepeak's tile_tokens")
    ap.add_argument("--simulate-oom", default=None, help=argparse.SUPPRESS)  # ARM:LEN:RANK (tests)
    parsed = parse_sweep("bench_hf_dist", ap, ARMS, argv)
    if parsed is None:
        return 2
    a, arms, rank, world = parsed
    import transformers
    shape, device_kind = (TINY, "cpu") if a.tiny else (FULL, "cuda")
    if shape["num_experts"] % world:
        raise SystemExit(f"bench_hf_dist: {shape['num_experts']} experts do not split over {world} ranks")
    lo = a.min_len or (64 if a.tiny else 8192)
    hi = a.max_len or (128 if a.tiny else 1 << 19)
    lengths = doubling(lo, hi)
    say = rank0_say(rank)
    say(f"bench_hf_dist: P={world}, Qwen3-MoE {'tiny' if a.tiny else '2.0B'}, tokens per rank "
        f"{lengths[0]}..{lengths[-1]}, {a.steps} steps each, budget {a.max_seconds:.0f} s per arm")
    say(header_line("T/rank", "tok/s/GPU"))

    def row(L, step):
        return dict(tokens_per_rank=L, tokens_per_s_per_gpu=f"{L / step:.1f}" if step else "",
                    transformers=transformers.__version__)

    sim = parse_simulated_oom(a.simulate_oom)
    res = sweep_to_csv(a, "hf_dist", FIELDS, row, arms, lengths, _point,
                       lambda arm, L: (arm, L, a.steps, shape, a.tile_tokens, sim), rank=rank, world=world,
                       device_kind=device_kind, say=say)
    say_reach(res, say, lambda L: f"length completed {L} tokens per rank", baseline="fsdp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
