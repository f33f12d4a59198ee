"""Two torch names torchtitan 0.3.0 uses that the torch releases around it lack,
provided only where missing (no effect on a torch that has them):

  torch.distributed.fsdp.DataParallelMeshDims (torch >= 2.12)
      torchtitan 0.3 imports it at module level, but passes it to fully_shard only
      under its full-DTensor SPMD modes (``dp_mesh_dims=``); in every other mode the
      name is only a type annotation. The placeholder lets torchtitan import on
      torch 2.11; a job that does reach ``fully_shard(..., dp_mesh_dims=...)`` on
      such a torch still fails there, with torch's own "unexpected keyword" error.
  torch.distributed.set_timeout(timeout, group=None)
      torchtitan.train lowers the process groups' timeouts after step 1 with it
      (torch 2.11 and 2.13 lack it); provided through the public
      ProcessGroup.set_timeout.

moepeak.titan calls provide_missing_torch_names() before it imports torchtitan.
A stock torchtitan job imports torchtitan before its --override.imports, so on
torch < 2.12 its launcher must call this first (tests/titan_cpu.py does); importing
this module runs moepeak.titan's __init__, which already has (and then imports torchtitan).
"""
from __future__ import annotations

from dataclasses import dataclass



def provide_missing_torch_names() -> list[str]:
    """Add the names above where this torch lacks them; returns those added."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    added = []
    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclass(frozen=True)
        class DataParallelMeshDims:
            """Placeholder (moepeak.titan.compat): this torch has no full-DTensor FSDP."""
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        added.append("torch.distributed.fsdp.DataParallelMeshDims")
    if dist.is_available() and not hasattr(dist, "set_timeout"):

        def set_timeout(timeout, group=None):
            (group if group is not None else dist.group.WORLD).set_timeout(timeout)

        dist.set_timeout = set_timeout
        added.append("torch.distributed.set_timeout")
    return added


__all__ = ["provide_missing_torch_names"]
