"""SCO's host arena: pinned chunks (CUDA) or virtual offsets (CPU) where the host-tier
boundaries wait between forward and backward.

Layout: chunks of pinned bytes (uint8 [nbytes] each); a slot is (chunk index, byte offset),
offsets aligned to sizes.ARENA_ALIGN. Slots are handed out by a bump pointer that rewinds
when no boundary is live (the engine calls rewind), so the arena's steady state is one
step's host-tier boundaries and nothing is allocated once it is sized. Its cap is
SCOConfig.arena_cap (arena_bytes with grow=False, max_arena_bytes, host_budget_bytes).
"""
from __future__ import annotations

import collections
import ctypes
from typing import List, Optional, Tuple

import torch

from ..core.host_memory import check_room
from .sizes import slot_bytes

Slot = Tuple[int, int]  # (chunk index, byte offset)


class Arena:
    def __init__(self, cfg, pinned: bool, counts: collections.Counter, ext):
        self.cfg, self.pinned, self.counts, self.ext = cfg, pinned, counts, ext
        self.chunks: List[list] = []  # [ptr, nbytes, ctypes buffer, uint8 tensor view]
        self.cur, self.off = 0, 0
        self.used = 0  # bytes handed out since the last rewind, the ends of skipped chunks included
        self.cap: Optional[int] = cfg.arena_cap
        if cfg.arena_bytes:
            self._check_room(cfg.arena_bytes)  # pure Python: refuses before any call into ext

    def reserve(self) -> None:
        """Allocate the arena_bytes reserved at first use (the caller binds the device for ext)."""
        if self.cfg.arena_bytes and not self.chunks:
            self._add_chunk(self.cfg.arena_bytes)

    @property
    def nbytes(self) -> int:
        return sum(c[1] for c in self.chunks)

    def _check_room(self, n: int) -> None:
        if self.pinned:
            check_room(n, "moepeak: SCO arena chunk", "each checkpoint boundary held by SCO takes tokens x hidden "
                       "x element bytes of it per block: shorten the sequence, split it over more ranks, "
                       "checkpoint fewer blocks with SCO, or spill the earliest to disk (SCOConfig.spill_dir)",
                       pinned=True)

    def _add_chunk(self, n: int) -> None:
        self._check_room(n)
        if self.pinned:
            ptr = self.ext.sco_arena_alloc(n)  # MemoryError naming the size on failure
            buf = (ctypes.c_uint8 * n).from_address(ptr)
            view = torch.frombuffer(buf, dtype=torch.uint8)
        else:
            ptr, buf, view = 0, None, None
        self.chunks.append([ptr, n, buf, view])
        self.counts["arena_chunks"] += 1  # cudaHostAlloc: slow, blocking; never in steady state

    def rewind(self) -> None:
        self.cur, self.off, self.used = 0, 0, 0

    def _placement(self, need: int):
        """Where a slot of `need` bytes would go: ("fit", chunk, offset, skipped bytes),
        ("grow", chunk size, skipped bytes), or ("full", None, skipped bytes)."""
        cur, off, skipped = self.cur, self.off, 0
        while cur < len(self.chunks):
            if off + need <= self.chunks[cur][1]:
                return "fit", (cur, off), skipped
            skipped += self.chunks[cur][1] - off
            cur, off = cur + 1, 0
        grow = max(need, self.cfg.grow_bytes if self.cfg.grow else 0)
        if not self.cfg.grow:
            return "full", None, skipped
        if self.cap is not None and self.nbytes + grow > self.cap:
            if self.nbytes + need > self.cap:
                return "full", None, skipped
            grow = need  # fits when growing by exactly what is needed
        return "grow", grow, skipped

    def fits(self, nbytes: int) -> bool:
        """Whether take(nbytes) would succeed (growing within the cap)."""
        return self._placement(slot_bytes(nbytes))[0] != "full"

    def take(self, nbytes: int) -> Slot:
        need = slot_bytes(nbytes)
        kind, where, skipped = self._placement(need)
        if kind == "full":
            raise RuntimeError(
                f"moepeak: SCO arena too small and cannot grow: a boundary of {nbytes} bytes does not fit "
                f"(arena {self.nbytes} bytes in use this iteration, cap "
                f"{self.cap if self.cap is not None else 'none'}, grow={self.cfg.grow}); raise "
                "SCOConfig.arena_bytes / max_arena_bytes. Nothing was kept on the GPU instead."
            )
        if kind == "grow":
            self._add_chunk(where)
            where = (len(self.chunks) - 1, 0)
        self.cur, self.off = where[0], where[1] + need
        self.used += skipped + need
        return where

    def view(self, slot: Slot, nbytes: int) -> torch.Tensor:
        c, off = slot
        return self.chunks[c][3][off:off + nbytes]

    def free(self) -> None:
        while self.chunks:
            ptr = self.chunks.pop()[0]
            if ptr:
                self.ext.sco_arena_free(ptr)
        self.rewind()
