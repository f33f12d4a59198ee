"""Ring-DTP's chunk sizes, `auto`'s schedule choice and the bytes it holds at its peak:
integer arithmetic on (T, H, V, bytes per element), importing nothing, so that the op
(sched.py, blocks.py) and `moepeak plan`'s memory model read the same numbers from one
place. Public by design: any moepeak subpackage may import this module (moepeak.plan does).

b is the element size of the low-precision buffers: 2 for bf16/fp16 inputs, 0
for fp32 inputs (the fp32 orders make dZ in place and need no second buffer).
"""
from __future__ import annotations

from typing import Optional, Tuple

# Workspace the block loops may hold at once (bytes), unless chunk sizes are
# given. 512 MiB keeps Ring-DTP's working set a small fraction of the 2 GiB
# target at T = 32k, H = 4096, V = 151936 (docs/design.md section 2).
DEFAULT_WORKSPACE_BYTES = 512 << 20
# fused_lowp's single [ct, V] block (see fused_chunk_tokens): what the 2 GiB at
# T = 32k, H = 4096, V = 151936 leaves beside dX + dW (2048 - 256 - 1187 = 605 MiB).
LOWP_WORKSPACE_BYTES = 600 << 20
LOWP_MAX_ROWS = 2048
# The 4-GEMM orders also hold an fp32 [T, H] dX accumulator (vocab_outer:
# 512 MiB at T = 32k, H = 4096), so their block workspace gets half as much.
BLOCKED_WORKSPACE_BYTES = 256 << 20
# auto: fused_lowp for at most this many token chunks, i.e. bf16 roundings of the
# part of a dW row the finish and the centering leave in the GEMMs (why 128: the
# "Error growth" bounds in sched's docstring reach 128 chunks).
FUSED_MAX_CHUNKS = 128
# vocab_outer_lowp: vocab blocks dX is accumulated over: at least 8, more where the
# block's fp32 dW accumulator [cv, H] would pass LOWP_DW_BLOCK_BYTES (H = 7168,
# V = 256000: 24 blocks, 298 MiB, where 8 would take 875 MiB). The block count costs
# little error thanks to dX's finish (sched.backward_blocked; its bounds are
# in sched's "Error growth").
LOWP_DX_BLOCKS = 8
LOWP_DW_BLOCK_BYTES = 300 << 20
# The fused modes center X for their dW GEMMs past this many token chunks
# (sched.fused; RingDTPOptions.center_chunks defaults to it): uncentered, dW's
# error on very anisotropic hidden states, x_mean = 3, grows past naive's 2x between 8
# chunks, 1.85x, and 16, 2.39x (sched's "Error growth"). The centering's column
# sums go through a [<= COLSUM_GROUPS, V] x fp32 scratch in the chunk's dX rows where the
# gradient kernel makes them (no memory of its own).
FUSED_CENTER_CHUNKS = 8
COLSUM_GROUPS = 8


def round_down(x: int, q: int) -> int:
    return max(q, (x // q) * q)


def round_up(x: int, q: int) -> int:
    return -(-x // q) * q


def rows_per_block(ct: int, q: int = 64) -> int:
    """ct rounded down to a multiple of q, or ct itself (at least 1) below q."""
    return round_down(int(ct), q) if ct >= q else max(1, int(ct))


def fused_chunk_tokens(V: int, b: int, budget: Optional[int] = None, lowp_logits: bool = False) -> int:
    """Token rows per chunk when a chunk holds whole vocab rows (modes 'fused*').

    fp32 logits: Z [ct, V] x fp32 and dZ [ct, V] x b bytes: ct = budget / (V * (4 + b)),
                 budget 512 MiB, rounded down to a multiple of 64;
    lowp logits: Z [ct, V] x b bytes with dZ in place:     ct = budget / (V * b),
                 budget 600 MiB, rounded down to a multiple of 128 and at most
                 LOWP_MAX_ROWS = 2048. The row count matters to the dX GEMM
                 [ct, V] @ [V, H] with 256-row tiles: on 132 SMs (H200) 2048 rows
                 fill 1.94 waves where 1728 fill 1.7, and more rows than 2048 gain
                 nothing for the whole op. At V = 256000 the 600 MiB give 1152 rows.
    Worked once: V = 151936, bf16 (b = 2):
      fp32 logits 536870912 / (151936 * 6) = 588.9 -> ct = 576 (Z 334 MiB + dZ 167 MiB);
      lowp logits 629145600 / (151936 * 2) = 2070.4 -> ct = 2048 (Z/dZ 594 MiB; with
      dX + dW 1.41 GiB at T = 32k, H = 4096 the op peaks at 1.99 GiB).
    """
    if lowp_logits and b:
        ct = (budget or LOWP_WORKSPACE_BYTES) // (V * b)
        if ct >= 128:
            return min(LOWP_MAX_ROWS, round_down(int(ct), 128))
        return rows_per_block(ct)
    return rows_per_block((budget or DEFAULT_WORKSPACE_BYTES) // (V * (4 + b)))


def lowp_dx_chunk_tokens(cv: int, b: int, budget: int = BLOCKED_WORKSPACE_BYTES) -> int:
    """Token rows per block for vocab_outer_lowp: Z [ct, cv] x fp32 and dZ [ct, cv]
    x b bytes within the budget (the dX and dW partials go straight into dX and the
    fp32 dW block: no [ct, H] or second [cv, H] buffer on CUDA), multiple of 64.
    Worked once: V = 151936 in 8 blocks: cv = 18992 rounded up to 128 = 19072; bf16,
    256 MiB: 268435456 / (19072 * 6) = 2345.8 -> ct = 2304 (Z 168 MiB + dZ 84 MiB)."""
    return rows_per_block(budget // (cv * (4 + b)))


def lowp_dx_block_cols(V: int, H: int) -> int:
    """vocab_outer_lowp's vocab block: V / LOWP_DX_BLOCKS rounded up to 128 columns, or
    fewer columns (a multiple of 128) so that the fp32 dW block [cv, H] stays within
    LOWP_DW_BLOCK_BYTES. Worked once: V = 151936, H = 4096: 18992 -> 19072 (cap 19200):
    8 blocks, dW block 298 MiB; V = 256000, H = 7168: 32000 (cap 10880): 24 blocks."""
    return min(round_up(-(-V // LOWP_DX_BLOCKS), 128), round_down(LOWP_DW_BLOCK_BYTES // (4 * H), 128))


def blocked_chunks(T: int, H: int, b: int, budget: int = BLOCKED_WORKSPACE_BYTES,
                   chunk_tokens: Optional[int] = None) -> Tuple[int, int]:
    """(ct, cv) for the 4-GEMM orders (a [ct, cv] block at a time).

    Per block: Z [ct, cv] x fp32, dZ [ct, cv] x b bytes, the dX partial
    [ct, H] x fp32, and the dW partial and its accumulator [cv, H] x fp32:
      ct*cv*(4+b) + 8*cv*H + 4*ct*H <= budget
      cv = (budget - 4*ct*H) / (ct*(4+b) + 8*H), rounded down to 128.
    Worked once: ct = 4096, H = 4096, bf16, budget 256 MiB:
      (268435456 - 67108864) / (4096*6 + 8*4096) = 3510.9 -> cv = 3456
      (Z 54 MiB + dZ 27 MiB + dX partial 64 MiB + dW partial/accumulator 108 MiB).
    ct is fixed (default 4096), never T-dependent, so the working set is too.
    """
    ct = chunk_tokens or 4096
    per_col = ct * (4 + b) + 8 * H
    cv = (budget - 4 * ct * H) // per_col
    return ct, round_down(int(max(cv, 128)), 128)


def auto_lowp_schedule(fusable: bool, T: int, H: int, V: int, b: int, chunk_tokens: int = 0) -> str:
    """auto's schedule for bf16/fp16 inputs: 'fused_lowp' when backward is certain
    (fusable) and it takes at most FUSED_MAX_CHUNKS token chunks; otherwise
    'vocab_outer' (exact) while its fp32 [T, H] dX accumulator fits the 512 MiB
    workspace, else 'vocab_outer_lowp'."""
    ct = chunk_tokens or fused_chunk_tokens(V, b, lowp_logits=True)
    if fusable and -(-T // ct) <= FUSED_MAX_CHUNKS:
        return "fused_lowp"
    if 4 * T * H <= DEFAULT_WORKSPACE_BYTES:
        return "vocab_outer"
    return "vocab_outer_lowp"


def fused_extra_bytes(T: int, H: int, V: int, b: int, ct: int) -> int:
    """Bytes the fused modes hold beside the [ct, V] block and dX when dW spans token
    chunks in low precision: the finish's label terms tc [T] x fp32, and past
    FUSED_CENTER_CHUNKS chunks the centering's cs [V] x fp32, mu [H] in fp32 and in b
    bytes, and a ones row [ct] x b (X - mu and the column sums' scratch live in dX)."""
    if not b or T <= ct:
        return 0
    extra = 4 * T
    if -(-T // ct) > FUSED_CENTER_CHUNKS:
        extra += 4 * V + (4 + b) * H + b * ct
    return extra


# Per token, beside the blocks: the fold's state (m, s, zy, zsum, sx) and the three rows forward
# saves for backward (m, log s, 1 - p_y), all fp32.
STATE_ROW_BYTES = 4 * (5 + 3)


def auto_peak_bytes(T: int, H: int, V: int, elem_bytes: int, fused_budget: Optional[int] = None) -> int:
    """Ring-DTP's own bytes at its peak on one device, for the schedule `auto` picks when
    backward is certain (loss.backward() after a mean or sum), on inputs of elem_bytes per
    element (4: fp32, 2: bf16/fp16). dW [V, H] is not counted: it is the parameter's gradient.
      fp32      fused: one [ct, V] fp32 block (dZ made in place) + dX [T, H] x 4;
      fused_lowp       one [ct, V] block in the input dtype + dX [T, H] + fused_extra_bytes;
      vocab_outer      the block workspace + the fp32 [T, H] dX accumulator and its cast;
      vocab_outer_lowp the block workspace + the fp32 dW block [cv, H] + dX [T, H] + the dX
                       finish's label terms [T] x fp32;
    each + STATE_ROW_BYTES per token. fused_budget: the fused modes' workspace in bytes (None:
    DEFAULT_WORKSPACE_BYTES for fp32 logits, LOWP_WORKSPACE_BYTES for low-precision ones).
    Worked once: T = 32768, H = 4096, V = 151936, bf16: fused_lowp, ct = 2048, 16 chunks:
    2048*151936*2 + 2*32768*4096 + 32*32768 + (4*32768 + 4*151936 + 6*4096 + 2*2048) bytes
    = 851.2 MiB."""
    if elem_bytes == 4:
        ct = fused_chunk_tokens(V, 0, fused_budget)
        return min(ct, T) * V * 4 + 4 * T * H + STATE_ROW_BYTES * T
    b = elem_bytes
    ct = fused_chunk_tokens(V, b, fused_budget, lowp_logits=True)
    schedule = auto_lowp_schedule(True, T, H, V, b, ct)
    if schedule == "fused_lowp":
        return min(ct, T) * V * b + b * T * H + STATE_ROW_BYTES * T + fused_extra_bytes(T, H, V, b, ct)
    if schedule == "vocab_outer":
        return BLOCKED_WORKSPACE_BYTES + (4 + b) * T * H + STATE_ROW_BYTES * T
    cv = min(V, lowp_dx_block_cols(V, H))
    return BLOCKED_WORKSPACE_BYTES + 4 * cv * H + b * T * H + STATE_ROW_BYTES * T + 4 * T
