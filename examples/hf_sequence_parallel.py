"""Train a Hugging Face MoE model with one sequence split over the ranks: DeepSpeed Ulysses
sequence parallelism (its attention wrapper and data-loader adapter, no DeepSpeed engine) with
moepeak.hf.apply_moepeak (tiled layers, SCO, the loss without logits, the experts split over
the same ranks), DistributedDataParallel for the replicated gradients and moepeak.StreamAdamW.

    # CPU ranks (gloo):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/hf_sequence_parallel.py \\
        --model tiny-qwen3-moe --seq-len 64 --tile-tokens 8 --steps 2 --packed --check
    # GPUs (NCCL), e.g. Qwen3-30B-A3B on the 8 GPUs of a host, 1M tokens a sequence:
    torchrun --nproc_per_node 8 examples/hf_sequence_parallel.py --model Qwen/Qwen3-30B-A3B \\
        --seq-len 1048576 --attn flash_attention_2 --tile-tokens 16384 --bf16

Every rank reads its own samples (rank r: samples r, r + P, ...); DeepSpeed's
UlyssesSPDataLoaderAdapter gathers one from each rank and hands every rank its T/P-token shard
of each in turn (input_ids, position_ids, and labels shifted before the split: shift_labels),
so every step trains one whole sequence on all P ranks. --packed packs two documents in each
sequence (position_ids restart), which the attention implementation must separate:
moepeak_varlen_sdpa (the default; moepeak.hf.register_varlen_sdpa) or flash_attention_2/3.
--check (CPU, tiny model) also trains one process on the whole sequences with stock
transformers and torch.optim.AdamW and compares every step's loss; it exits non-zero on a
mismatch.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

TINY = "tiny-qwen3-moe"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=TINY, help=f"{TINY} (random init) or a Hugging Face model name or path")
    p.add_argument("--seq-len", type=int, default=64, help="tokens of one sequence (all ranks together)")
    p.add_argument("--tile-tokens", type=int, default=8, help="apply_moepeak's tile_tokens (0: untiled)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps, one sequence each")
    p.add_argument("--attn", default="moepeak_varlen_sdpa", help="attention core behind Ulysses' all-to-all")
    p.add_argument("--packed", action="store_true", help="two documents per sequence (position_ids restart)")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters (GPU)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--check", action="store_true", help="compare every step's loss with one stock process (CPU)")
    return p.parse_args(argv)


def init_distributed():
    """deepspeed.comm over torch.distributed (gloo on CPU ranks, NCCL on GPUs); (rank, P, device)."""
    import deepspeed
    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    if not cuda:
        # DeepSpeed would JIT-compile its shared-memory CPU all-reduce (a minute of compiler time
        # on a fresh machine) that nothing here uses: gloo runs every collective.
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return rank, dist.get_world_size(), device


def build_model(name, bf16, device):
    import transformers
    if name == TINY:
        torch.manual_seed(0)
        config = transformers.Qwen3MoeConfig(
            vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=1 << 16, intermediate_size=48, moe_intermediate_size=24,
            num_experts=8, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
        model = transformers.Qwen3MoeForCausalLM(config)
        with torch.no_grad():  # transformers' zero router init ties every route
            for pname, p in model.named_parameters():
                if ".gate.weight" in pname:
                    p.normal_(0, 1.0)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16 if bf16 else torch.float32)
    model = model.to(device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
    return model.train()


def samples(n, seq_len, vocab, packed):
    """n token sequences (the same on every rank: one seed): input_ids, labels (a few ignored),
    position_ids (restarting at the second document when packed)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (seq_len,), generator=g)
        labels = ids.clone()
        labels[2 + i:6 + 2 * i] = -100
        pos = torch.arange(seq_len)
        if packed:
            cut = seq_len // 2 + 3 + i
            pos = torch.cat([torch.arange(cut), torch.arange(seq_len - cut)])
            labels[cut] = -100  # the second document's first token is not predicted from the first
        out.append(dict(input_ids=ids, labels=labels, position_ids=pos))
    return out


def adamw_options(lr):
    return dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def train(args, rank, P, device, model, data):
    """The sequence-parallel run; returns each step's loss (the whole sequence's, every rank)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    import moepeak
    from moepeak.hf import apply_moepeak, register_varlen_sdpa
    register_varlen_sdpa()
    model.set_attn_implementation(args.attn)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation=args.attn, sequence_parallel_size=P, micro_batch_size=1,
        seq_length_is_variable=True)
    sp = mpu.get_sequence_parallel_group()
    report = apply_moepeak(model, group=sp, sequence_group=sp, tile_tokens=args.tile_tokens or None)
    if rank == 0:
        print(report, flush=True)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = moepeak.StreamAdamW(model.parameters(), **adamw_options(args.lr))
    loader = torch.utils.data.DataLoader(data[rank::P], batch_size=1)
    shards = UlyssesSPDataLoaderAdapter(loader, sp_rank=rank, sp_group=sp, sp_world_size=P, device=device)
    losses = []
    for step, batch in zip(range(args.steps), shards):
        batch = {k: v.to(device) for k, v in batch.items()}
        # through ddp(...): DDP prepares its gradient reduction in its forward
        out = ddp(**batch, labels=batch["shift_labels"], use_cache=False)
        out.loss.backward()  # the value is the sequence's loss; DDP averages P x this rank's share
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
    return losses


def one_process(model, data, args):
    """The same steps on one process, stock transformers on the whole sequences."""
    opt = torch.optim.AdamW(model.parameters(), **adamw_options(args.lr))
    losses = []
    for sample in data[:args.steps]:
        batch = {k: v[None] for k, v in sample.items()}
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))
    rank, P, device = init_distributed()
    if args.seq_len % P:
        raise SystemExit(f"--seq-len {args.seq_len} must be a multiple of the {P} ranks")
    model = build_model(args.model, args.bf16, device)
    stock = copy.deepcopy(model) if args.check else None
    # whole refills of the loader adapter: every rank reads as many samples
    data = samples(-(-args.steps // P) * P, args.seq_len, model.config.vocab_size, args.packed)
    losses = train(args, rank, P, device, model, data)
    ok = True
    if args.check and rank == 0:
        stock.set_attn_implementation("eager")  # Ulysses has taken over the "sdpa" name in this process
        expected = one_process(stock, data, args)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
        ok = worst < 1e-4
        print(f"check: losses {losses} vs one process {expected}: worst relative difference {worst:.1e} "
              f"({'exact within fp32 rounding' if ok else 'MISMATCH'})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
