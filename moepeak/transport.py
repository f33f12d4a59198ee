"""The transport the multi-rank schedules (Ring-DTP, PipelinedLLEP) talk to.

One small interface, two implementations (DESIGN.md section 1):
  * TorchDistTransport: torch.distributed (gloo on CPU, so every multi-rank
    schedule runs in CI; NCCL through torch on GPU).
  * NcclTransport (moepeak/nccl.py): NCCL called from C on CUDA tensors, on its
    own communicator created from an ncclUniqueId broadcast over the group.
The schedule code is the same for both. Every rank must issue the same calls
in the same order (NCCL's rule); the schedules guarantee it by deriving all
control flow from values that are identical on every rank.

Ranks here are ranks *within the group* (0..world_size-1).
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from .process_groups import group_info


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

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchDistTransport(Transport):
    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        info = group_info(group)
        self.group, self.rank, self.world_size = info.group, info.rank, info.world_size
        self._global = info.global_ranks  # group rank -> global rank (what P2P ops address)

    def send_recv(self, send, dst, recv, src):
        ops = []
        if dst == self.rank and src == self.rank:
            recv.copy_(send)
            return Handle()
        ops.append(dist.P2POp(dist.isend, send, self._global[dst], self.group))
        ops.append(dist.P2POp(dist.irecv, recv, self._global[src], self.group))
        return Handle(dist.batch_isend_irecv(ops))

    def all_to_all_v(self, send, send_counts, recv, recv_counts):
        w = dist.all_to_all_single(recv, send, output_split_sizes=list(map(int, recv_counts)),
                                   input_split_sizes=list(map(int, send_counts)), group=self.group,
                                   async_op=True)
        return Handle([w])

    def all_gather(self, out, inp):
        if out.shape[0] != self.world_size or out.shape[1:] != inp.shape:
            raise ValueError(f"moepeak: all_gather out must be [{self.world_size}, *{tuple(inp.shape)}], "
                             f"got {tuple(out.shape)}")
        dist.all_gather(list(out.unbind(0)), inp.contiguous(), group=self.group)

    def all_reduce_(self, t, op="sum"):
        if op not in _OPS:
            raise ValueError(f"moepeak: all_reduce op must be one of {sorted(_OPS)}, got {op!r}")
        dist.all_reduce(t, op=_OPS[op], group=self.group)


def get_transport(group=None, device: Optional[torch.device] = None, backend: str = "auto") -> Optional[Transport]:
    """The transport for `group` (None when there is no group: one rank).

    backend: "torch" (torch.distributed), "nccl" (moepeak's C NCCL transport,
    CUDA tensors only) or "auto". "auto" is torch.distributed until the NCCL
    transport is measured faster (DESIGN.md: NCCL is the default only then).
    """
    if group is None:
        return None
    if backend not in TRANSPORTS:
        raise ValueError(f"moepeak: transport backend must be one of {TRANSPORTS}, got {backend!r}")
    if backend == "nccl":
        from .nccl import NcclTransport  # noqa: WPS433 (optional, CUDA only)
        return NcclTransport(group, device)
    return TorchDistTransport(group)


# One NcclTransport per (group, device), made on first use and kept for the process
# (a communicator costs a collective to create; the schedules call this per step).
_SHARED_NCCL = {}
_SHARED_LOCK = threading.Lock()


def shared_nccl_transport(group, device: torch.device) -> Transport:
    """moepeak's C NCCL transport for `group` on `device`, created once (a collective:
    every rank of the group must make its first call together) and reused."""
    from .nccl import NcclTransport  # noqa: WPS433 (optional, CUDA only)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"moepeak: transport='nccl' moves CUDA tensors only, got tensors on {device}; "
                         "use transport='torch' (torch.distributed, e.g. gloo) for CPU tensors")
    key = (group if group is not None else dist.group.WORLD,
           device.index if device.index is not None else torch.cuda.current_device())
    with _SHARED_LOCK:
        t = _SHARED_NCCL.get(key)
        if t is None or t.closed:  # closed by the user: make a new one
            t = NcclTransport(key[0], torch.device("cuda", key[1]))
            _SHARED_NCCL[key] = t
        return t


def check_transport_choice(transport: Union[str, Transport]) -> None:
    """Raise ValueError unless `transport` is one of TRANSPORTS or a Transport."""
    if not isinstance(transport, Transport) and transport not in TRANSPORTS:
        raise ValueError(f"moepeak: transport must be one of {TRANSPORTS} or a moepeak Transport instance, "
                         f"got {transport!r}")
