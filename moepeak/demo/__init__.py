"""`moepeak demo`: train a small MoE LM with all four moepeak schedules, show
the loss fall next to plain PyTorch's on the same weights and batches, and
measure the four peaks next to the same model in plain PyTorch.

Defaults (DEFAULTS): on a GPU, 65536 tokens per step (one sequence of 64k)
through a 4-layer, 16-expert model with a 65536-row vocabulary (bytes +
specials + padding rows, so the vocabulary peak is realistic), bf16, 80 steps:
about 1-2 minutes on an H200, the comparison included; on CPU a tiny fp32 model
at 1024 tokens per step that trains in well under 2 minutes on 2 cores. After
the run the same model is trained again in plain PyTorch (dense MoE,
F.cross_entropy, torch.utils.checkpoint, torch.optim.AdamW) from the same
initial weights on the same batches, for every step on CPU and the first
DEFAULTS["cuda"]["compare_steps"] on a GPU (it stops at an OOM):
`--plot` overlays the two loss curves.

Under torchrun (WORLD_SIZE > 1): FSDP2 `fully_shard` on the replicated parts,
experts split over the ranks (PipelinedLLEP's group) and the Ring-DTP vocab
shards over the same ranks. Context parallelism is on by default there
(--no-context-parallel turns it off): the ranks train on the same sequences,
each holding a contiguous 1/P slice of every sequence (--seq-len is the whole
context, so P GPUs reach P times the context); attention all-gathers K and V
(moepeak.demo.context_parallel). With --no-context-parallel each rank reads its
own batch of --seq-len tokens (data parallel).

    python -m moepeak demo --plot demo.png
    torchrun --nproc_per_node=2 -m moepeak demo --seq-len 262144   # 128k tokens per GPU

Modules: train (the job: run, main), args (its command line: DEFAULTS, build_parser),
models (the model), config (MoEConfig and the schedule switches), tiled (the block as a
moepeak.tiled spec), data (the corpus and batches), peaks (the peak measurement),
context_parallel (sequence sharding), plot (the PNG), autoplace (the automatic placement:
on a GPU (each rank its share under torchrun), SCO's kept blocks, its arena, StreamAdamW's
device tail and the tiling placed from the config, the tokens per step and the machine
before the model is built, printed as the report's placement lines; --no-auto-placement
turns it off).

Public face (exported here, for `moepeak demo`, the benchmarks and the tests): DEFAULTS,
build_parser, main, run, shard_model, warmup_cosine. The tests and benchmarks also build
the model from moepeak.demo.models and moepeak.demo.config directly.
"""
from .args import DEFAULTS, build_parser
from .train import main, run, shard_model, warmup_cosine

__all__ = ["DEFAULTS", "build_parser", "main", "run", "shard_model", "warmup_cosine"]
