"""moepeak.plan: `moepeak plan`, the memory planner: the four peaks per GPU (and the block,
the final norm) for plain FSDP2 + activation checkpointing and for moepeak, the binding
peak and the longest context that fits; moepeak's host RAM; and where each tensor class of
a step goes (GPU, host RAM, disk) on a given machine.

  model      ModelShape, Setup and the GPU peak formulas (peaks, longest_context); its
             docstring states every term and where it is read off the code
  sequence   Hugging Face sequence parallelism's layout (--sp): S, P_ep, tokens and
             parameters per rank, the attention exchange's bytes, the checks
  host       moepeak's host RAM per GPU, term by term (host_bytes, longest_host_context)
  placement  the placement on a machine: place() -> Placement (keep_last, host and disk
             boundaries, StreamAdamW's device tail, tiling), Margins, PlacementError
  integration  what moepeak.hf's, moepeak.titan's and the demo's automatic placement share:
             Ranks, job_ranks, place_rank (several ranks), StepPlacement, TilesNeeded
  machine    what the command reads off the machine it runs on (read_host_ram,
             disk_free_bytes) and Machine, the machine a report checks against
  presets    public models' and torchtitan flavors' shapes (PRESETS)
  table      the text `moepeak plan` prints (report, ROW_LEGEND)
  cli        the command line (build_parser, main; moepeak.cli's `plan`)
  chart      the --plot PNG and its data (plot, plot_spec)
(No submodule is named after a function exported here: the function would hide it.)

The planner reads the schedules' byte formulas and defaults from their public sizes modules
(moepeak.llep.sizes, moepeak.ring_dtp.sizes, moepeak.sco.sizes, moepeak.stream_adamw.sizes),
never from their internals.

Public face (exported here, for the `moepeak plan` command, for users who script the
planner, for the integrations that place a step automatically, and for the tests that
check it against measurements): the names below.
"""
from .cli import build_parser, from_args, main
from .model import (BINDING, IMPLS, PEAKS, GiB, ModelShape, Setup, keep_last, longest_context, peaks,
                    ring_dtp_vocab_bytes, tiled_full_len_bytes)
from .sequence import SHARDS, SP_ENGINES, sequence_attention_bytes
from .host import HOST_TERMS, host_bytes, longest_host_context
from .machine import Machine, disk_free_bytes, read_host_ram
from .placement import Margins, Placement, PlacementError, longest_placed_context, place
from .integration import (ALL_STATE_ON_GPU, Ranks, StepPlacement, TilesNeeded, activation_bytes, forward_tokens,
                          job_ranks, place_rank, rank_context, setup_problems)
from .chart import plot, plot_spec
from .presets import PRESETS
from .table import ROW_LEGEND, report

__all__ = ["ModelShape", "Setup", "PRESETS", "PEAKS", "BINDING", "IMPLS", "SP_ENGINES", "SHARDS", "GiB", "ROW_LEGEND",
           "peaks", "host_bytes", "HOST_TERMS", "keep_last", "longest_context", "longest_host_context",
           "ring_dtp_vocab_bytes", "sequence_attention_bytes", "tiled_full_len_bytes", "place", "Placement",
           "PlacementError", "Margins", "longest_placed_context", "Machine", "read_host_ram", "disk_free_bytes",
           "report", "build_parser", "from_args", "main", "plot", "plot_spec", "Ranks", "job_ranks", "place_rank",
           "StepPlacement", "TilesNeeded", "ALL_STATE_ON_GPU", "activation_bytes", "forward_tokens", "rank_context",
           "setup_problems"]
