"""StreamAdamW's sizes: the bytes its optimizer state and its pinned staging take. Public by
design: the one statement of these formulas, which the optimizer (its host-room check before
it creates state, its bucket plan, backward_tail's device budget) and the planner
(moepeak.plan) both call. Pure arithmetic; a dtype argument is a torch.dtype or its element
size in bytes (4 for float32, 2 for bfloat16/float16).

Per parameter element (state_dtype s: 4 B for torch.float32, 2 B for torch.bfloat16):
  host state        exp_avg + exp_avg_sq (+ max_exp_avg_sq with amsgrad): 2 (3) x s, plus the
                    fp32 master (4 B) unless the param is an fp32 CPU tensor updated in place
                    (it is its own master). bf16/fp16 params: 12 B with fp32 state, 8 B with
                    bf16 state; fp32 CUDA params (a host fp32 copy is the master): the same.
  device_state      fp32 always: exp_avg + exp_avg_sq (+ max) 8 (12) B, plus the fp32 master
                    (4 B) of a bf16/fp16 param: 12 B for bf16, 8 B for fp32 params.
Pinned staging (CUDA params, allocated once): grad_slots slots of a bucket's grads and
  param_slots slots of its params, a bucket being bucket_elements(bucket_mb) fp32-master
  elements; each param's segment in a slot starts on a SEGMENT_ALIGN boundary, so a bucket
  packing k small params takes up to k x 63 B more than the formula (the plan's exact
  figure: StreamAdamW.pinned_bytes()). Defaults (64 MiB, 3 + 2 slots, bf16): 160 MiB.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .options import StreamAdamWOptions

DType = Union[torch.dtype, int]  # a torch.dtype, or its element size in bytes
SEGMENT_ALIGN = 64  # bytes: each param's segment in a pinned slot starts on a cache line
MASTER_BYTES = 4  # the fp32 master weight
DEFAULTS = StreamAdamWOptions


def element_bytes(dtype: DType, what: str = "dtype") -> int:
    """Bytes of one element: a torch float32/bfloat16/float16 dtype, or 4 or 2 itself."""
    if isinstance(dtype, torch.dtype):
        size = dtype.itemsize if dtype.is_floating_point and not dtype.is_complex else None
    else:
        size = dtype if isinstance(dtype, int) and not isinstance(dtype, bool) else None
    if size not in (2, 4):
        raise ValueError(f"moepeak.stream_adamw.sizes: {what} must be torch.float32, torch.bfloat16, "
                         f"torch.float16 or an element size of 4 or 2 bytes, got {dtype!r}")
    return size


def state_bytes_per_param(param_dtype: DType, state_dtype: DType = 4, *, amsgrad: bool = False,
                          in_place: bool = False) -> int:
    """Host bytes of one param element's state: its moments in state_dtype and the fp32
    master. in_place: the param is an fp32 CPU tensor updated in place (its own master)."""
    own_master = in_place and element_bytes(param_dtype, "param_dtype") == 4
    moments = (3 if amsgrad else 2) * element_bytes(state_dtype, "state_dtype")
    return moments + (0 if own_master else MASTER_BYTES)


def device_state_bytes_per_param(param_dtype: DType, *, amsgrad: bool = False) -> int:
    """Device bytes of one device_state param element: fp32 moments, and the fp32 master of a
    bf16/fp16 param (the step counter is one scalar per param, not counted)."""
    master = 0 if element_bytes(param_dtype, "param_dtype") == 4 else MASTER_BYTES
    return (3 if amsgrad else 2) * 4 + master


def bucket_elements(bucket_mb: Optional[float] = None) -> int:
    """fp32-master elements per bucket of bucket_mb MiB (None: the default), at least 16."""
    mb = DEFAULTS.bucket_mb if bucket_mb is None else bucket_mb
    return max(16, int(mb * (1 << 20)) // 4)


def segment_bytes(elements: int, dtype: DType) -> int:
    """Bytes a segment of `elements` elements takes in a pinned slot (padded to SEGMENT_ALIGN)."""
    return -(-elements * element_bytes(dtype) // SEGMENT_ALIGN) * SEGMENT_ALIGN


def pinned_staging_bytes(bucket_mb: Optional[float] = None, *, grad_dtype: DType = 2, param_dtype: DType = 2,
                         grad_slots: Optional[int] = None, param_slots: Optional[int] = None) -> int:
    """Pinned host bytes of the bucket pipeline's slots for full buckets of one grad and
    param dtype (None: StreamAdamWOptions' defaults; alignment padding not counted)."""
    n = bucket_elements(bucket_mb)
    gs = DEFAULTS.grad_slots if grad_slots is None else grad_slots
    ps = DEFAULTS.param_slots if param_slots is None else param_slots
    return gs * n * element_bytes(grad_dtype, "grad_dtype") + ps * n * element_bytes(param_dtype, "param_dtype")
