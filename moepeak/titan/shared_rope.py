"""moepeak.titan.rope's component: torchtitan's RoPE modules with one rotary table per
configuration and device instead of one per block (the contract: moepeak.titan's docstring)."""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE, RoPE

# Rotary tables: one per configuration and device, not one per block
_ROTARY_TABLES: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_MODULE_FIELDS = {f.name for f in dataclasses.fields(RoPE.__bases__[0].Config)}  # init/sharding: not the table's


class _SharedRotaryTable:
    """Over a torchtitan RoPE: every block whose RoPE config is equal, on the same device,
    holds the same cache tensor ([max_seq_len, ...], fp32 or complex64; torchtitan builds
    one per block). Built on the meta device (torchtitan's init flow), the buffer is a
    0-row placeholder, so to_empty() allocates no table per block; init_weights()
    (_init_self_buffers) then points it at the shared table. A later .to(device) copies
    each block's buffer apart again (values unchanged)."""

    def _precompute_cache(self) -> torch.Tensor:
        device = torch.get_default_device()  # the device both callers build the cache on
        if device.type == "meta":
            return super()._precompute_cache()[:0]
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, getattr(torch, device.type).current_device())
        key = (type(self), tuple(getattr(self.config, f.name) for f in dataclasses.fields(self.config)
                                 if f.name not in _MODULE_FIELDS), device)
        table = _ROTARY_TABLES.get(key)
        if table is None:
            table = super()._precompute_cache()
            _ROTARY_TABLES[key] = table
        return table


class SharedCosSinRoPE(_SharedRotaryTable, CosSinRoPE):
    """CosSinRoPE with one table for all blocks (see _SharedRotaryTable)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass


class SharedComplexRoPE(_SharedRotaryTable, ComplexRoPE):
    """ComplexRoPE with one table for all blocks (see _SharedRotaryTable)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        pass


SHARED_ROPE = {CosSinRoPE.Config: SharedCosSinRoPE.Config, ComplexRoPE.Config: SharedComplexRoPE.Config}
