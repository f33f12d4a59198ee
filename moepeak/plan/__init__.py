"""moepeak.plan: `moepeak plan`, the memory planner: the four peaks per GPU (and the block,
the final norm, the host RAM) for plain FSDP2 + activation checkpointing and for moepeak,
the binding peak and the longest context that fits.

  model     ModelShape, Setup and the peak formulas (peaks, host_bytes, longest_context);
            its docstring states every term and where it is read off the code
  presets   public models' and torchtitan flavors' shapes (PRESETS)
  table     the table `moepeak plan` prints (report, ROW_LEGEND)
  cli       the command line (build_parser, main; moepeak.cli's `plan`)
  chart     the --plot PNG and its data (plot, plot_spec)
(No submodule is named after a function exported here: the function would hide it.)

The planner reads the schedules' byte formulas from their public sizes modules
(moepeak.llep.sizes, moepeak.ring_dtp.sizes), never from their internals.

Public face (exported here, for the `moepeak plan` command, for users who script the
planner and for the tests that check it against measurements): the names below.
"""
from .cli import build_parser, from_args, main
from .model import (BINDING, IMPLS, PEAKS, GiB, ModelShape, Setup, host_bytes, keep_last, longest_context,
                    longest_host_context, peaks, ring_dtp_vocab_bytes, tiled_full_len_bytes)
from .chart import plot, plot_spec
from .presets import PRESETS
from .table import ROW_LEGEND, report

__all__ = ["ModelShape", "Setup", "PRESETS", "PEAKS", "BINDING", "IMPLS", "GiB", "ROW_LEGEND", "peaks", "host_bytes",
           "keep_last", "longest_context", "longest_host_context", "ring_dtp_vocab_bytes", "tiled_full_len_bytes",
           "report", "build_parser", "from_args", "main", "plot", "plot_spec"]
