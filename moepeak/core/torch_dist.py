"""TorchDistTransport: the Transport interface (moepeak/core/transport.py) on
torch.distributed (gloo on CPU, so every multi-rank schedule runs in CI; NCCL
through torch on GPU)."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .process_groups import group_info
from .transport import Handle, Transport

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
