"""The transport interface the multi-rank schedules (Ring-DTP, PipelinedLLEP) talk to.

One small interface (Transport, Handle; docs/design.md section 1), two implementations:
  * TorchDistTransport (moepeak/core/torch_dist.py): torch.distributed (gloo on CPU,
    so every multi-rank schedule runs in CI; NCCL through torch on GPU).
  * NcclTransport (moepeak/core/nccl.py): NCCL called from C on CUDA tensors, on its
    own communicator created from an ncclUniqueId broadcast over the group.
Both import this module; moepeak/core/transport_choice.py picks one (get_transport).
The schedule code is the same for both. Every rank must issue the same calls
in the same order (NCCL's rule); the schedules guarantee it by deriving all
control flow from values that are identical on every rank.

Ranks here are ranks *within the group* (0..world_size-1).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch


class Handle:
    """An in-flight operation. wait() makes its result usable on the current
    stream (GPU) or the host (CPU)."""

    def __init__(self, works=()):
        self._works = list(works)

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []


class Transport:
    rank: int
    world_size: int

    def send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> Handle:
        """Send `send` to `dst` and receive `recv` from `src`, asynchronously."""
        raise NotImplementedError

    def all_to_all_v(self, send: torch.Tensor, send_counts: Sequence[int], recv: torch.Tensor,
                     recv_counts: Sequence[int]) -> Handle:
        """Rows [sum(send_counts[:j]), +send_counts[j]) of `send` go to rank j;
        rows from rank i land at [sum(recv_counts[:i]), ...) of `recv`.
        Counts are in rows of dim 0 and must agree pairwise across ranks."""
        raise NotImplementedError

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out[r] = inp of rank r (out has shape [world_size, *inp.shape])."""
        raise NotImplementedError

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> None:
        """In place; op in {"sum", "max", "min"}."""
        raise NotImplementedError


TRANSPORTS = ("auto", "torch", "nccl")  # get_transport's backends; the schedules' `transport` choices


def check_transport_choice(transport: Union[str, Transport]) -> None:
    """Raise ValueError unless `transport` is one of TRANSPORTS or a Transport."""
    if not isinstance(transport, Transport) and transport not in TRANSPORTS:
        raise ValueError(f"moepeak: transport must be one of {TRANSPORTS} or a moepeak Transport instance, "
                         f"got {transport!r}")
