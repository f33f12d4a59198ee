"""Byte formulas of the sequence-tiled block (public by design: the planner reads them) and the
head-group choice they drive.

Full-length tensors at the backward peak (the first head group's core backward), in bf16
[T, H] equivalents for the 2.0B model of issue 25 (H = 2048, 16 q / 4 kv heads of 128,
head_groups = 4; one unit = 4 KiB per token), with torch's flash attention:
    x (block input, reloaded by SCO)                    1
    grad_y (held by autograd for this node)             1
    dx (post-attention part's contribution so far)     1
    q (4 groups)                                        1
    k, v (4 groups each, kv heads only)                 0.5
    out (4 groups, saved by the core)                   1
    dout (4 groups)                                     1
    lse (fp32 [16 heads, T])                            0.02
    group 0's flash backward: dq_accum fp32 (4 heads)   0.5
        dk, dv expanded to the group's 4 q heads        0.5
        dq, dk, dv of the group                         0.38
    total                                               7.9  (31.6 KiB/token)
Only the last three lines depend on the head groups G: they scale as 1/G (5.5 units at G = 1,
all 16 heads in one call). Under SCO the previous block's boundary is not in this list: its
prefetch is held back until half the head groups' core backward is done (moepeak.sco.
DeferredPrefetch), when the set above has shrunk by more than it adds. Untiled checkpoint
recompute of the same block (for comparison): ~17 units measured. The tile's own working set
(one tile of the position-wise parts, PipelinedLLEP's chunk) is O(tile_tokens) and not counted.

full_length_bytes_per_token is that list without x (the boundary, counted where boundaries
are); the planner's tiled_full_len_bytes reads it. cuDNN's
backward keeps the same inputs and outputs; its scratch is not larger than flash's fp32 dq
accumulator and expanded dk, dv, which the formula counts for any backend.

Head groups: fewer groups, one attention call for more heads, let the backend run larger
problems (all heads in one call is the issue-38 rate) at the cost of the 1/G terms.
fewest_head_groups picks the fewest groups whose full-length set fits a budget in bytes;
free_memory_budget is the default budget when no planner gives one: FREE_MEMORY_SHARE of
the device memory free at the forward call (the driver's free bytes plus what torch's caching
allocator holds unused). The share leaves room for what backward adds beyond the forward's
state (gradients, the SCO prefetch, allocator fragmentation, a core that repeats k and v).
"""
from __future__ import annotations

from typing import List, Optional

import torch

FREE_MEMORY_SHARE = 0.5
FREE = "free"  # TiledBlockSpec.head_group_budget: FREE_MEMORY_SHARE of the free device memory


def full_length_bytes_per_token(hidden: int, q_heads: int, kv_heads: int, qk_dim: int, v_dim: int,
                                elem_bytes: int, head_groups: int, hidden_elem_bytes: Optional[int] = None) -> float:
    """Bytes per token (per sequence position of one row) of the tiled block's full-length
    tensors at its backward peak, x excluded: grad_y, dx [hidden] (hidden_elem_bytes, default
    elem_bytes); q [q_heads*qk_dim]; out, dout [q_heads*v_dim]; k [kv_heads*qk_dim], v
    [kv_heads*v_dim] (elem_bytes each); lse fp32 [q_heads]; and, divided by head_groups, the
    first group's backward: fp32 dq accumulator, dk and dv expanded to the group's q heads,
    dq, dk, dv of the group."""
    hb = elem_bytes if hidden_elem_bytes is None else hidden_elem_bytes
    b = elem_bytes
    Qq, Qo, Kk, Kv = q_heads * qk_dim, q_heads * v_dim, kv_heads * qk_dim, kv_heads * v_dim
    held = 2 * hb * hidden + b * (Qq + 2 * Qo + Kk + Kv) + 4 * q_heads
    return held + (4 * Qq + b * (Qq + Qo) + b * (Qq + Kk + Kv)) / head_groups


def head_group_counts(most: int) -> List[int]:
    """The head-group counts a core separable into `most` groups also runs with: the divisors
    of `most`, fewest groups first (groups of consecutive groups stay whole GQA groups)."""
    return [g for g in range(1, most + 1) if most % g == 0]


def fewest_head_groups(most: int, budget_bytes: Optional[int], tokens: int, **shape) -> int:
    """The fewest head groups (a divisor of `most`) whose full-length set for `tokens` tokens
    (batch rows x sequence length) fits budget_bytes; `most` when none does or when there is
    no budget (None). shape: full_length_bytes_per_token's arguments but head_groups."""
    if budget_bytes is None:
        return most
    for g in head_group_counts(most):
        if tokens * full_length_bytes_per_token(head_groups=g, **shape) <= budget_bytes:
            return g
    return most


def head_groups_to_run(most: int, budget_bytes: Optional[int], x: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, head_dim: int) -> int:
    """fewest_head_groups for a tiled block's input x (hidden size last, batch rows x tokens =
    x.numel() / hidden) and its first tile's q, k, v (heads at head_dim, head size last)."""
    if budget_bytes is None or most == 1:
        return most
    hidden = x.shape[-1]
    return fewest_head_groups(most, budget_bytes, x.numel() // hidden, hidden=hidden, q_heads=q.shape[head_dim],
                              kv_heads=k.shape[head_dim], qk_dim=q.shape[-1], v_dim=v.shape[-1],
                              elem_bytes=q.element_size(), hidden_elem_bytes=x.element_size())


def free_memory_budget(device: torch.device) -> Optional[int]:
    """FREE_MEMORY_SHARE of the memory free on a CUDA device now (the driver's free bytes plus
    the bytes torch's caching allocator reserved and does not use); None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(FREE_MEMORY_SHARE * (free + unused))


def resolve_budget(budget, device: torch.device) -> Optional[int]:
    """A TiledBlockSpec.head_group_budget as bytes: None stays None (run the spec's head_groups),
    FREE measures (free_memory_budget), an int is itself."""
    if budget == FREE:
        return free_memory_budget(device)
    return budget


def check_head_group_budget(budget, argument: str = "head_group_budget") -> None:
    """None, FREE or a non-negative int of bytes; a ValueError naming `argument` otherwise."""
    if budget is None or budget == FREE:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"moepeak: {argument} must be None (the spec's head_groups), {FREE!r} (a share of the free "
                         f"device memory) or a non-negative number of bytes, got {budget!r}")
