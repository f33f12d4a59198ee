"""PipelinedLLEP's per-call statistics: LLEPStats, filled by the ops of the calls it is
given to (llep_moe(..., stats=s); PipelinedLLEPMoE keeps one as `last_stats`).

Why an object reached through a key. The ops (moepeak::llep_dispatch and its backward
ops) take only tensors and scalars, and their backward runs inside autograd, so neither
a Python object nor a second return value reaches them or comes back from backward. An
LLEPStats registers itself under a string key (weakly: dropping the object ends it),
the ops take the key as an argument (str, like the group's key) and, after their body
ran, put the call's record into the object (`forward` from llep_dispatch, `backward`
from either backward op). Under torch.compile the ops stay opaque and run their body at
run time, so the record is filled there too; the key is a constant of the graph (one
object per module, PipelinedLLEPMoE's, keeps it one graph). No state is shared between
calls: each call's record is its own dict.

Keys of a record (absent where the path does not set them):
  n_chunks, chunk_rows, max_rows, spilled, borrowed, one_chunk_ep    the plan and layout
  host_syncs, h2d_copies                      device->host reads, host->device copies
  grouped_mm, grouped_dw                      GEMM calls (and weight-gradient passes)
                                              through torch._grouped_mm
  grouped_fallback                            1 when torch._grouped_mm raised under
                                              grouped_mm="auto" (per-expert GEMMs after)
  cached_chunks, cache_bytes                  forward: chunks whose h the cache keeps
  workspace_bytes / workspace_bytes_bwd       the working set (forward / backward)
  recomputed_chunks, lean_one_chunk           backward: chunks whose h was recomputed;
                                              whether the one-chunk lean path ran
  recv_rows, send_rows                        P > 1 one-chunk step: this rank's rows
"""
from __future__ import annotations

import itertools
import weakref
from typing import Dict

_LIVE: "weakref.WeakValueDictionary[str, LLEPStats]" = weakref.WeakValueDictionary()
_NEXT = itertools.count()


class LLEPStats:
    """What the last llep call given this object did: `forward` and `backward`, one dict
    each (keys: this module's docstring), replaced by every call's forward and backward."""

    def __init__(self):
        self.forward: Dict[str, object] = {}
        self.backward: Dict[str, object] = {}
        self.key = f"llep_stats:{next(_NEXT)}"
        _LIVE[self.key] = self

    def __repr__(self) -> str:
        return f"LLEPStats(forward={self.forward}, backward={self.backward})"


def stats_key(stats) -> str:
    """The ops' argument for `stats` (an LLEPStats or None: "")."""
    if stats is None:
        return ""
    if not isinstance(stats, LLEPStats):
        raise TypeError(f"moepeak: stats must be an LLEPStats or None, got {type(stats).__name__}")
    return stats.key


def publish(key: str, phase: str, record: Dict[str, object]) -> None:
    """The record of one op call into the LLEPStats registered under key (phase "forward" or
    "backward"); nothing when the key is "" or its object is gone."""
    target = _LIVE.get(key) if key else None
    if target is not None:
        setattr(target, phase, dict(record))


__all__ = ["LLEPStats", "stats_key", "publish"]
