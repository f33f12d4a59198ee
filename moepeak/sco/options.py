"""SCO's options: the one home of the schedule's defaults and their validation.

SCOConfig is pure data (frozen, comparable, copyable): it holds no arena, stream or
statistics. The runtime that does (one engine per device: the pinned arena, the copy and
load streams, the spill file, the counters) is moepeak.sco.SCOOffloader, built from a
config. apply_sco, sco_checkpoint's callers, moepeak.hf, moepeak.titan and the demo take a
config; the planner (moepeak.plan) reads the defaults below and the byte formulas of
moepeak.sco.sizes. Every error names the field and what was expected, and is raised when
the config is built.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

# keep_last defaults, one per caller that chose its own:
# KEEP_LAST is SCOConfig's, so apply_sco's, the Hugging Face drop-in's and the torchtitan
# override's: the last block's input is needed first in backward, so offloading it would
# only cost a round trip over PCIe.
KEEP_LAST = 1
# KEEP_LAST_DEMO is the demo model's (MoEConfig.sco_keep_last): every block's input
# offloaded, the setting the demo's published peaks (benchmarks/RESULTS.md) were measured
# with, where the GPU's boundary bytes stay flat in depth.
KEEP_LAST_DEMO = 0


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"moepeak: SCOConfig.{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class SCOConfig:
    """How SCO places and moves the checkpoint boundaries (the blocks' inputs).

    max_in_flight (W): forward D2H copies in flight before compute waits on the oldest.
    prefetch: boundaries loaded ahead in backward (block k-1 .. k-prefetch), from host RAM
        or, read ahead, from the spill file.
    keep_last: how many of the last blocks keep their input on the GPU under apply_sco
        (True = 1, False = 0; kept as an int). The last block's input is needed first in
        backward; more trade GPU memory (one [T, H] each) for host RAM and PCIe traffic,
        the last ones first since their inputs come back first.
    arena_bytes: pinned bytes reserved at first use (0: grow on demand).
    grow: whether the arena may grow past arena_bytes.
    grow_bytes: smallest chunk added when the arena must grow.
    max_arena_bytes: cap on the arena (None: no cap; with grow=False the cap is
        arena_bytes). Needing more raises instead of keeping data on the GPU.
    spill_dir: the disk tier (opt-in): a directory on a local disk where the boundaries
        that do not fit host_budget_bytes go, in an anonymous file (unlinked while open).
    host_budget_bytes: with spill_dir, the pinned host bytes the boundaries may take (the
        arena's cap); the newest boundaries stay in host RAM, the earliest go to disk.
    spill_slots: pinned staging slots between the GPU and the spill file, one boundary
        each: forward copies into one and writes it behind; backward reads ahead into them.
    spill_threads: I/O threads of the spill file.
    """

    max_in_flight: int = 2
    prefetch: int = 1
    keep_last: int = KEEP_LAST
    arena_bytes: int = 0
    grow: bool = True
    grow_bytes: int = 1 << 30
    max_arena_bytes: Optional[int] = None
    spill_dir: Optional[str] = None
    host_budget_bytes: Optional[int] = None
    spill_slots: int = 2
    spill_threads: int = 4

    def __post_init__(self):
        _check_int("max_in_flight", self.max_in_flight, 1)
        _check_int("prefetch", self.prefetch, 0)
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ValueError(f"moepeak: SCOConfig.keep_last must be a bool or an int >= 0, got {self.keep_last!r}")
        object.__setattr__(self, "keep_last", int(self.keep_last))
        _check_int("arena_bytes", self.arena_bytes, 0)
        _check_int("grow_bytes", self.grow_bytes, 0)
        if self.max_arena_bytes is not None:
            _check_int("max_arena_bytes", self.max_arena_bytes, 0)
        if not isinstance(self.grow, bool):
            raise ValueError(f"moepeak: SCOConfig.grow must be a bool, got {self.grow!r}")
        if not self.grow and self.arena_bytes == 0:
            raise ValueError("moepeak: SCOConfig(grow=False) needs arena_bytes > 0 (the fixed arena size)")
        self._check_spill()

    def _check_spill(self) -> None:
        _check_int("spill_slots", self.spill_slots, 1)
        _check_int("spill_threads", self.spill_threads, 1)
        if self.spill_dir is None and self.host_budget_bytes is None:
            return
        if self.spill_dir is None or self.host_budget_bytes is None:
            given = "spill_dir" if self.spill_dir is not None else "host_budget_bytes"
            raise ValueError(f"moepeak: SCOConfig.{given} needs both spill_dir (where boundaries beyond the host "
                             "budget go) and host_budget_bytes (the pinned host bytes they may take)")
        if not isinstance(self.spill_dir, (str, os.PathLike)) or not os.fspath(self.spill_dir):
            raise ValueError(f"moepeak: SCOConfig.spill_dir must be a directory path, got {self.spill_dir!r}")
        object.__setattr__(self, "spill_dir", os.fspath(self.spill_dir))
        _check_int("host_budget_bytes", self.host_budget_bytes, 0)
        if self.arena_bytes > self.host_budget_bytes:
            raise ValueError(f"moepeak: SCOConfig.arena_bytes ({self.arena_bytes}) must be <= host_budget_bytes "
                             f"({self.host_budget_bytes}): the arena holds the boundaries kept in host RAM")

    @property
    def spills(self) -> bool:
        """Whether the disk tier is on (spill_dir and host_budget_bytes given)."""
        return self.spill_dir is not None

    @property
    def arena_cap(self) -> Optional[int]:
        """The most pinned bytes the arena may hold (None: no cap): arena_bytes with grow=False,
        else max_arena_bytes, and never more than host_budget_bytes with the disk tier on."""
        cap = self.max_arena_bytes if self.grow else self.arena_bytes
        if self.host_budget_bytes is not None:
            cap = self.host_budget_bytes if cap is None else min(cap, self.host_budget_bytes)
        return cap

    def kept_blocks(self, blocks) -> list:
        """The blocks (in forward order) whose input stays on the GPU: the last keep_last."""
        blocks = list(blocks)
        return blocks[max(len(blocks) - self.keep_last, 0):]
