"""Choosing a transport (moepeak/core/transport.py's interface) for a process group:
get_transport (torch.distributed or moepeak's NCCL, per call) and shared_nccl_transport
(one NCCL transport per group and device, kept for the process). The NCCL module is
imported only when NCCL is asked for (it is CUDA-only)."""
from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.distributed as dist

from .torch_dist import TorchDistTransport
from .transport import TRANSPORTS, Transport


def get_transport(group=None, device: Optional[torch.device] = None, backend: str = "auto") -> Optional[Transport]:
    """The transport for `group` (None when there is no group: one rank).

    backend: "torch" (torch.distributed), "nccl" (moepeak's C NCCL transport,
    CUDA tensors only) or "auto". "auto" is torch.distributed until the NCCL
    transport is measured faster (docs/design.md: NCCL is the default only then).
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
