"""`moepeak demo`'s automatic placement: before the model is built, moepeak.plan.place decides
from the demo's config, its tokens per step (known up front: batch x seq_len) and this
machine's measured free bytes how many blocks keep their input on the GPU (sco_keep_last),
the pinned arena SCO reserves for the others, and whether blocks run sequence-tiled.

Measured: the GPU's free + reserved bytes (torch.cuda.mem_get_info, in a process that holds
nothing yet: under torchrun this rank's GPU, LOCAL_RANK's) and the host's MemAvailable
(moepeak.core.host_memory), both before the model, the optimizer state and the arena exist.
Explicit settings win: --tile-tokens is the plan's tiling. --no-auto-placement turns it off
(MoEConfig's defaults: KEEP_LAST_DEMO, an arena grown on demand, whole blocks). It runs on a
GPU with all four schedules (the plan's step); elsewhere (CPU, a schedule off) it does
nothing and says why. A machine too small raises moepeak.plan.PlacementError before
anything is allocated.
Under torchrun (moepeak.plan.integration states the rule) each rank places its own share
(its tokens: seq_len / world of each sequence with context parallelism, else its own batch;
the parameters over the world, as the planner's default layout is the demo's) from its own
GPU and its share of the host (LOCAL_WORLD_SIZE), with no collective. PipelinedLLEP's
all-to-all runs per tile, so the ranks' tiling is not picked for them: where whole blocks do
not fit and --tile-tokens was not given, moepeak.plan.TilesNeeded names the --tile-tokens to
give.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch

from ..core import host_memory
from ..plan import ModelShape, Placement, Setup, StepPlacement, job_ranks, place_rank
from ..stream_adamw import StreamAdamWOptions
from .config import MoEConfig, param_count


def demo_shape(cfg: MoEConfig) -> ModelShape:
    """The planner's shape of the demo model (its own parameter count)."""
    return ModelShape(layers=cfg.layers, hidden=cfg.hidden, experts=cfg.experts, top_k=cfg.top_k,
                      intermediate=cfg.intermediate, vocab=cfg.vocab_size, heads=cfg.heads, kv_heads=cfg.kv_heads,
                      head_dim=cfg.head_dim, param_count=param_count(cfg))


def measure(device: torch.device) -> Optional[Tuple[float, float]]:
    """(GPU bytes the step may use: free + what torch already reserved, the host's available
    RAM) on a CUDA device; None elsewhere or where MemAvailable cannot be read."""
    if device.type != "cuda":
        return None
    if device.index is None:  # before torch.cuda.set_device: this rank's GPU under torchrun
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    gpu, host = host_memory.device_room(device)
    return (gpu, host) if host else None


class DemoPlacement:
    """The demo's placement: note (one line: what was decided or why nothing was), placement
    (None when off), lines() for the demo's report."""

    def __init__(self, note: str, placement: Optional[Placement] = None):
        self.note, self.placement = note, placement

    def lines(self) -> List[str]:
        out = [f"placement: {self.note}"]
        if self.placement is not None:
            out += [f"  {k}: {v}" for k, v in self.placement.reasons.items()]
        return out

    def arena_bytes(self) -> Optional[int]:
        """SCOConfig.arena_bytes to apply (None: off, the config's)."""
        return None if self.placement is None else self.placement.sco_options()["arena_bytes"]

    def device_state_bytes(self) -> int:
        """StreamAdamW's device tail (StreamAdamW.backward_tail's budget; 0: all state in host RAM)."""
        return 0 if self.placement is None else self.placement.device_state_bytes


def place_demo(cfg: MoEConfig, opt_kind: str, *, enabled: bool, device: torch.device, world: int, batch: int,
               seq_len: int, dtype: torch.dtype, bucket_mb: Optional[float],
               state_dtype: Optional[str]) -> Tuple[MoEConfig, DemoPlacement]:
    """The config to build (sco_keep_last, tile_tokens placed) and the placement (see the module
    docstring); PlacementError when the machine is too small."""
    if not enabled:
        return cfg, DemoPlacement("off (--no-auto-placement)")
    schedules = (cfg.moe, cfg.head, cfg.checkpoint, opt_kind)
    if schedules != ("llep", "ring_dtp", "sco", "stream"):
        return cfg, DemoPlacement("off: the plan's step runs all four schedules; here "
                                  "moe=%s head=%s checkpoint=%s optimizer=%s" % schedules)
    measured = measure(device)
    if measured is None:
        return cfg, DemoPlacement("off on CPU (no-op)" if device.type != "cuda" else
                                  "off: this host's available RAM could not be read (/proc/meminfo)")
    gpu, host = measured
    ranks = job_ranks(tiles_agree=True, world=world)
    setup = Setup(gpus=world, impl="demo", act_bytes=torch.empty((), dtype=dtype).element_size(), batch=batch,
                  chunk_rows=cfg.chunk_rows, tile_tokens=cfg.tile_tokens, lean_norm=cfg.lean_norm,
                  bucket_mb=StreamAdamWOptions.bucket_mb if bucket_mb is None else bucket_mb,
                  state_dtype_bytes=2 if state_dtype == "bfloat16" else 4)
    # the context whose tokens per rank are this rank's: context parallelism splits seq_len over
    # the ranks; without it each rank runs its own batch x seq_len
    context = seq_len if cfg.context_parallel or world == 1 else seq_len * world
    p = place_rank(demo_shape(cfg), setup, context, gpu_bytes=gpu, host_bytes=host, ranks=ranks,
                   tile_option="--tile-tokens N")
    note = StepPlacement.summary(p, f"{batch * seq_len} tokens per step", gpu, host, "measured", ranks)
    return cfg.replace(sco_keep_last=p.keep_last, tile_tokens=p.tile_tokens), DemoPlacement(note, p)


__all__ = ["DemoPlacement", "demo_shape", "measure", "place_demo"]
