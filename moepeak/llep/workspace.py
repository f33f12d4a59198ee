"""PipelinedLLEP's buffer owners: Workspace (the chunked schedule's working set, allocated
once per call before the chunk loop and frozen) and Held (the one-chunk steps' buffers,
each held from first to last use, counted). Their sizes are moepeak/llep/sizes.py's
formulas (its docstring lists every buffer)."""
from __future__ import annotations

from typing import List, Optional

import torch


class Workspace:
    """Every working-set buffer of one call; frozen before the chunk loop so
    that nothing routing-dependent can be allocated inside it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.nbytes = 0
        self.frozen = False

    def alloc(self, shape, dtype) -> torch.Tensor:
        if self.frozen:
            raise RuntimeError("moepeak: internal error: workspace allocation inside the chunk loop")
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self.nbytes += t.numel() * t.element_size()
        return t

    def gemm_out(self, shape, dtype, grouped: bool) -> Optional[torch.Tensor]:
        """A GEMM output buffer. With torch._grouped_mm the GEMM allocates its
        own [rows <= C, N] output (no copy into the workspace), so the buffer is
        only counted (the bound is the same), not allocated: None."""
        if not grouped:
            return self.alloc(shape, dtype)
        self.nbytes += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return None

    def ring(self, k: int, shape, dtype) -> List[torch.Tensor]:
        return [self.alloc(shape, dtype) for _ in range(k)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Held:
    """Bytes held by the buffers of a schedule that allocates each buffer at
    its first use and drops it after its last (the one-chunk steps): `live`
    now and `peak` at most, from `base` (e.g. an activation cache held
    throughout). GEMM outputs torch allocates are counted through gemm();
    alloc/gemm_out make it usable wherever a Workspace is."""

    def __init__(self, device: torch.device, base: int = 0):
        self.device = device
        self.live = self.peak = int(base)

    def count(self, nbytes: int) -> None:
        self.live += int(nbytes)
        self.peak = max(self.peak, self.live)

    def new(self, shape, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self.count(_nbytes(t))
        return t

    alloc = new

    def gemm_out(self, shape, dtype, grouped: bool) -> Optional[torch.Tensor]:
        """As Workspace.gemm_out: counted either way, allocated only without
        torch._grouped_mm (which returns its own output)."""
        if not grouped:
            return self.new(shape, dtype)
        self.count(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())
        return None

    def gemm(self, t: torch.Tensor) -> torch.Tensor:
        """t, a tensor torch allocated (a GEMM's output), counted."""
        self.count(_nbytes(t))
        return t

    def drop(self, *tensors: torch.Tensor) -> None:
        """The tensors' bytes are no longer held (their last use is issued)."""
        for t in tensors:
            self.live -= _nbytes(t)

    def release_to(self, mark: int) -> None:
        """Back to `live` = mark (everything counted since then dropped)."""
        self.live = mark
