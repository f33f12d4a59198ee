"""PipelinedLLEP's sizes: the buffers one call allocates, from the chunk size C alone
(never from the routing), the activation cache's size, and the defaults they start from
(default_chunk_rows, default_save_budget_mb). Public by design: the one statement of these
byte formulas, which the schedule (moepeak/llep/moe.py, sched.py, one_chunk.py) and the
planner (moepeak.plan) both call; pure arithmetic on ints, no torch.

Buffers (allocated once per call, before the chunk loop; names as in
moepeak/llep/sched.py; b = bytes per element of x):
  forward, P = 1:  xr [C, H], h [C, 2I], a [C, I], o [C, H]          (b each)
  forward, P > 1:  sx, rx, yb, back [C, H] (send, receive, combine-send,
                   combine-receive: one each, sched orders the chunks'
                   collectives around them); gx [C, H] grouped rows; h [C, 2I];
                   a [C, I]; o [C, H]
  backward, P = 1: xr, gr, o, do [C, H]; h, dh [C, 2I]; s, a, da [C, I];
                   wr, wp, dwr [C] fp32
  backward, P > 1: sx, sg, rx, rg, dxb, back [C, H]; gx, gg, o, do [C, H];
                   h, dh [C, 2I]; s, a, da [C, I]; sw, rw, dwb, dwback [C]
                   fp32; wr, wp, dwr [C] fp32
  plus int64 index rings (3 x [C] send indices, [C] perm and inverse perm).
  Options add: "gpt_oss" s [C, I] in forward, t [C, I] and a bool mask
  [C, I] in backward; biases a scratch of C * max(2I, H) elements (b each;
  the per-row bias gather, and fp32 blocks for the bias-gradient sums);
  split gate/up weights an allocated h [C, 2I] (two GEMMs write its halves).
  With torch._grouped_mm (CUDA bf16) the GEMM outputs h, o, da are not
  allocated in the workspace (counted all the same): each GEMM's own output,
  at most [C, N], is used in place, no copy; the grouped weight gradient's
  result [G, H, 2I] (or [G, I, H]) has G = C // H (C // I) experts at most,
  no larger than the [C, 2I] ([C, H]) buffer it replaces. Worked once: C =
  32768, H = I = 2880, bf16: G = 11, [11, 2880, 5760] x 2 B = 348 MiB, vs
  [32768, 5760] x 2 B = 360 MiB.
Activation cache (fixed at launch by save_budget_mb, kept from forward to
  backward): cache [slots, C*2I] (b each), slot j = chunk j's h [C, 2I];
  slots = min(budget // (b*C*2I), ceil(T*K / (C//P))), so its bytes are <=
  the budget whatever the routing; backward recomputes h only for chunks
  j >= slots. The budget is capped (capped_save_bytes) so that cache +
  backward working set + the fp32 dx accumulator <= what permute +
  grouped_mm holds above its weight gradients at its peak for the same T.
One chunk at P = 1 (one_chunk_fits; llep_moe's default chunk size): the
  whole h is cached and backward allocates its buffers at first use and
  drops them after the last, writing dh over the cached h; its peak is
  one_chunk_peak_bytes.
One chunk at P > 1 (one_chunk; when no rank sends or receives more
  rows than one_chunk_ep_rows allows): buffers sized by the step's rows,
  each held from first to last use (Held); its peak is one_chunk_ep_bytes
  (plus the kept cache: h [R, 2I] and grouped x [R, H], b each), and
  one_chunk_ep_rows keeps it within working_set_bound at the call's C.
Outside the working set: fp32 accumulators [T, H] (forward y, backward dx),
  the send list [T*K] int64, and borrowed experts' weights (and their grads).
(moepeak/llep/workspace.py's Workspace and Held own and count the buffers.)
"""
from __future__ import annotations


def default_chunk_rows(P: int) -> int:
    """Rows per destination per chunk (C). P = 1: 32768; at H = I = 2880 in
    bf16 one [C, H] buffer is 180 MiB and the backward working set
    (C * (4H + 7I) * 2 bytes, workspace_bytes) 2.1 GiB -- small
    against an 80-141 GiB GPU, large enough for full GEMMs. P > 1: 16384,
    because the double-buffered send/receive rings make the backward working
    set C * (16H + 7I) * 2 bytes: 2.0 GiB at the same shapes (4.0 GiB at
    C = 32768). A chunk still gives each destination
    up to 16384 rows: full-size expert GEMMs."""
    return 32768 if P == 1 else max(16384, P)


# Activation-cache budget (save_budget_mb=None picks it from the group size).
# One rank: no budget of its own (a size no device has stands for it), so the
# caps that keep the layer's peak at or under permute + grouped_mm's for the same
# T decide: one chunk with its whole h cached where one_chunk_peak_bytes <=
# grouped_mm_peak_bytes (one_chunk_fits; its working-set bound holds trivially),
# else the chunked schedule caches as many chunks' h as capped_save_bytes' room
# holds (cache + backward working set + fp32 dx <= grouped_mm's activations, and
# both hold the weight gradients). So the cache grows with T as grouped_mm's saved
# activations do, below them. Worked once, E = 128, K = 4, H = I = 2880, bf16:
# 16k one chunk (peak 7.16 GiB vs 7.34); 64k one chunk (11.12 vs 11.56); 256k 32
# chunks all cached (11.25 GiB of cache in 17.75 of room: peak <= 28.43 GiB,
# grouped_mm's). save_budget_mb=1536 is the fixed budget of issues 6 and 26 (peak
# under 14 GiB at 256k, 28 of 32 chunks recomputed there).
# Several ranks: no cache beyond the room the single-buffered dispatch leaves
# within the chunk budget's bound (ep_cache_room), so the cache never raises
# the peak bound there.
NO_FIXED_BUDGET_MB = 1 << 40


def default_save_budget_mb(P: int) -> int:
    """The activation-cache budget (MiB) save_budget_mb=None picks for P
    ranks: NO_FIXED_BUDGET_MB on one rank (the grouped_mm caps decide, see
    above); beyond the chunk budget's own room (ep_cache_room at P > 1,
    which the bound b*C*(16H + 7I) already holds) nothing on several."""
    return NO_FIXED_BUDGET_MB if P == 1 else 0


def slot_elems(C: int, I: int) -> int:
    """Elements of one activation-cache slot: h [C, 2I] (o is never cached:
    backward does not need it)."""
    return C * 2 * I


def cache_slots(budget_bytes: int, T: int, K: int, C: int, I: int, P: int, b: int) -> int:
    """Chunks whose forward intermediates fit the launch-time byte budget.
    From shapes and the budget only (never the routing): at most
    budget // (b * C * 2I) slots, and no more than ceil(T*K / (C//P)),
    the chunks this rank's own T*K picks can need (exactly the chunk count at
    P = 1; at P > 1 the global count may differ either way, which only
    changes how many chunks are recomputed, never a result). llep_moe passes
    the budget through capped_save_bytes first. Worked once: budget 1536 MiB,
    C = 32768, I = 2880, bf16: one slot is 32768 x 5760 x 2 B = 360 MiB, so 4
    slots (1440 MiB): T = 256k (32 chunks) recomputes 28."""
    per = b * slot_elems(C, I)
    if budget_bytes <= 0 or per <= 0:
        return 0
    return int(min(budget_bytes // per, -(-T * K // (C // P))))


def workspace_bytes(C: int, H: int, I: int, P: int, b: int, backward: bool, *, activation: str = "swiglu",
                    bias: bool = False, split: bool = False) -> int:
    """The working set in bytes, from C alone (see the module docstring)."""
    idx = 8 * C * (3 + 2) if P > 1 else 0
    extra = b * C * max(2 * I, H) if bias else 0
    if activation == "gpt_oss":
        extra += (b + 1) * C * I if backward else b * C * I
    if not backward:
        if P == 1:
            return b * C * (2 * H + 3 * I) + extra
        return b * C * (6 * H + 3 * I) + idx + extra
    if P == 1:
        return b * C * (4 * H + 7 * I) + 12 * C + extra
    return b * C * (10 * H + 7 * I) + 4 * C * 7 + idx + extra


def ep_cache_room(C: int, H: int, b: int) -> int:
    """At P > 1, the activation-cache bytes save_budget_mb=None gives the
    chunked schedule: b*C*6H, so that backward's working set and the cache
    together hold b*C*(16H + 7I) (+ fp32 rows and index rings), the chunk
    budget's bound. Worked once: C = 16384, H = I = 2880, bf16: 540 MiB,
    three [C, 2I] slots of h."""
    return 6 * b * C * H


def effective_chunk_rows(C: int, T: int, K: int, P: int) -> int:
    """The chunk size a call uses: C, or on one rank T*K when that is smaller
    (one chunk; no buffer larger than the rows). At P > 1, C itself (every
    rank must agree on it)."""
    return max(1, min(int(C), T * K)) if P == 1 else int(C)


def grouped_mm_saved_bytes(T: int, K: int, H: int, I: int, b: int) -> int:
    """What permute + torch._grouped_mm's autograd saves from forward for
    backward (unchunked): the permuted x [T*K, H], h [T*K, 2I] (gate and up
    views), silu(gate) [T*K, I], a [T*K, I] and o [T*K, H] (kept by the
    pick-weight product for d(topk_weights))."""
    return b * T * K * (2 * H + 4 * I)


def grouped_mm_peak_bytes(T: int, K: int, E: int, H: int, I: int, b: int) -> int:
    """permute + torch._grouped_mm's fwd+bwd peak above its inputs and
    weights: at the gate/up GEMM's backward, both weight gradients
    (b*E*(H*2I + I*H)) plus the permuted x [T*K, H] it saved, dh [T*K, 2I]
    and the permuted dx [T*K, H] it makes (forward's peak, the saved
    b*T*K*(2H + 4I) plus an fp32 and a bf16 [T*K, H] of the pick-weight
    product, holds no weight gradient and is below it at these shapes).
    Worked once: T = 16k, K = 4, E = 128, H = I = 2880, bf16: weight
    gradients 128 x 3 x 2880^2 x 2 B = 5.93 GiB, activations 65536 x 11520 x
    2 B = 1.41 GiB: 7.34 GiB (measured on an H200: 7.43 GiB; the rest is the
    bf16 dx [T, H] and GEMM workspaces)."""
    return b * E * 3 * H * I + b * T * K * (2 * H + 2 * I)


def capped_save_bytes(budget_bytes: int, T: int, K: int, C: int, H: int, I: int, P: int, b: int,
                      **options) -> int:
    """The activation-cache budget actually used by the chunked schedule: at
    most budget_bytes, and at most what grouped_mm holds above its weight
    gradients at its peak (grouped_mm_peak_bytes) minus the backward working
    set and the fp32 dx accumulator [T, H], so that cache + working set +
    accumulator never exceed it (never below 0). options: workspace_bytes'
    keywords. Worked once: T = 64k, K = 4, H = I = 2880, bf16, C = 32768:
    grouped_mm holds 256k x 11520 x 2 B = 5.6 GiB, the P = 1 backward working
    set is 32768 x 31680 x 2 B + 384 KiB = 1.93 GiB and the accumulator 0.7
    GiB: 2.99 GiB of room, all 8 slots (2.81 GiB) fit; at T = 16k it holds
    1.41 GiB, less than the working set: no cache (one_chunk_fits covers
    that length)."""
    room = b * T * K * (2 * H + 2 * I) - workspace_bytes(C, H, I, P, b, True, **options) - 4 * T * H
    return max(0, min(int(budget_bytes), room))


def one_chunk_peak_bytes(T: int, K: int, E: int, H: int, I: int, b: int, split: bool = False) -> int:
    """Peak above inputs and weights of the one-chunk P = 1 schedule
    (sched's lean path: R = T*K rows, h cached, buffers held from first
    to last use, dh written over the cached h), counted as
    grouped_mm_peak_bytes counts: cache b*R*2I and the fp32 dx accumulator
    4*T*H throughout, plus the largest of
      forward:  b*R*max(H + 3I, 2H + I)   (gathered x, a and h's GEMM output
                                           before its copy into the cache;
                                           gathered x, a and o; split gate/up
                                           weights: [R, I] GEMM outputs)
      backward: dW_down + b*R*(H + 3I)    (w*dy, a, silu(gate), da)
                dW_down + b*R*2H          (split only: the dx rows of the
                                           gate and of the up GEMM)
                dW_down + dW_gate_up + b*R*H  (gathered x for dW_gate_up)
                dW_down + dW_gate_up + b*T*H  (the dx copy)
    and 12*R bytes of fp32 row vectors. Worked once: T = 16k, K = 4, E =
    128, H = I = 2880, bf16: 5.93 GiB weight gradients + 0.70 cache + 0.18
    accumulator + 0.35 gathered x = 7.16 GiB <= grouped_mm's 7.34 GiB."""
    R = T * K
    dwd, dwgu = b * E * I * H, b * E * H * 2 * I
    fwd = b * R * max(H + 3 * I, 2 * H + I)
    bwd = max(dwd + b * R * (H + 3 * I), dwd + dwgu + b * R * H, dwd + dwgu + b * T * H)
    if split:
        bwd = max(bwd, dwd + 2 * b * R * H)
    return b * R * 2 * I + 4 * T * H + 12 * R + max(fwd, bwd)


def one_chunk_fits(T: int, K: int, E: int, H: int, I: int, C: int, b: int, budget_bytes: int,
                   split: bool = False) -> bool:
    """On one rank, whether T*K rows run as one chunk with the whole h cached
    (no recompute): the cache b*T*K*2I fits budget_bytes, the peak
    (one_chunk_peak_bytes) is no larger than grouped_mm's, and what it holds
    besides the weight gradients and the accumulator stays within the
    chunked schedule's bound (working_set_bound at chunk size C; with
    save_budget_mb=None, default_save_budget_mb, that bound does not bind:
    the peak test decides). split: gate/up weights apart."""
    R = T * K
    if R <= 0 or b * R * 2 * I > budget_bytes:
        return False
    if one_chunk_peak_bytes(T, K, E, H, I, b, split) > grouped_mm_peak_bytes(T, K, E, H, I, b):
        return False
    phases = max(2 * H + I, H + 3 * I, 2 * H if split else 0)
    held = b * R * 2 * I + 12 * R + b * R * phases  # cache + largest phase's buffers
    return held <= working_set_bound(C, H, I, 1, b, True, budget_bytes, split=split)


def working_set_bound(C: int, H: int, I: int, P: int, b: int, backward: bool, save_budget_bytes: int,
                      **options) -> int:
    """Bytes above the [T, H]-sized tensors and weight gradients: the working
    set plus the activation cache (alive in both passes), from C and the
    launch-time budget alone. options: workspace_bytes' keywords."""
    return workspace_bytes(C, H, I, P, b, backward, **options) + max(0, save_budget_bytes)


def one_chunk_ep_bytes(R: int, N: int, H: int, I: int, b: int, backward: bool, *, keep: bool, lean: bool = False,
                       activation: str = "swiglu", bias: bool = False, split: bool = False,
                       grouped: bool = False) -> int:
    """The most the P > 1 one-chunk step (moepeak/llep/one_chunk.py) holds
    above the kept cache (b*R*(2I + H) with keep) on a rank that receives R
    rows and sends N, buffer by buffer as workspace.Held counts them
    (b bytes per element of x; fp32 row vectors 4 B, int64 8 B). keep:
    forward kept h and grouped x (backward re-sends x and recomputes h
    without); lean: backward's lean rows path (experts.lean_ok, eager);
    grouped: GEMMs through torch._grouped_mm (its own h before the copy into
    the kept cache counts in forward). The phases, each the live set when its
    last buffer is allocated:
      forward   sx + rx [N + R, H]; rx + grouped x [R, H] (no keep) + perms
                16R; grouped x (no keep) + h, a, (s), o, (bias scratch)
                [R, .] + perms; o + ungrouped y [R, H] + perms; y + back
                [R + N, H]
      backward  dy rows [N + R, H] (+ x rows [N + R, H] without keep) +
                pick weights 4(N + R); received rows + grouped ones + perms
                + weights; the rows backward (lean: do [R, H], a, s, da
                [R, I], 3 fp32 rows, then dx rows and ungrouped dx [R, H];
                else experts.Bufs of R rows (no h when kept) over dy,
                x (no keep) rows, plus the ungrouped dx); dx + back [R + N, H]
                + d(pick weight) 4(R + N)."""
    RH, NH, RI = b * R * H, b * N * H, b * R * I
    perms = 16 * R
    gpt = activation == "gpt_oss"
    scr = b * R * max(2 * I, H) if bias else 0
    if not backward:
        h = 2 * RI if (not keep or grouped) else 0
        xg = 0 if keep else RH
        bufs = h + RI + (RI if gpt else 0) + RH + scr
        return max(NH + RH, RH + xg + perms, xg + perms + bufs, 2 * RH + perms, RH + NH)
    x_rows = 0 if keep else NH + RH
    arrive = NH + RH + 4 * (N + R) + x_rows
    if keep:
        grouping = RH + 4 * R + perms + 4 * R                                 # rg, rw, perms, wg
    else:
        grouping = max(2 * RH + 4 * R + perms + 4 * R, 3 * RH + perms + 4 * R)  # ... then grouped x
    if keep and lean:
        rows_bwd = max(2 * RH + perms + 8 * R,                                # rg, do; wg, w1
                       RH + 3 * RI + perms + 12 * R,                          # do, a, s, da; wg, w1, dwr
                       (2 if split else 1) * RH + perms + 12 * R)             # dx rows (split: 2), then
                                                                              # ungrouped dx; wg, dwr, dwb
    else:
        before = (RH if keep else 2 * RH) + perms + 4 * R                     # dy (+ x) grouped, perms, wg
        bufs = (b * R * (2 * H + 5 * I) + 8 * R + (0 if keep else 2 * RI)
                + ((RI + R * I) if gpt else 0) + scr)
        rows_bwd = max(before + RH, before + bufs + RH + 4 * R)               # gg over rg; + dx, dwb
    back = RH + NH + 4 * (R + N)
    return max(arrive, grouping, rows_bwd, back)


def one_chunk_ep_rows(C: int, H: int, I: int, P: int, b: int, save_budget_bytes: int, *, keep: bool,
                      grad: bool, lean: bool, **options) -> int:
    """The most rows any rank may send or receive for the P > 1 one-chunk
    step to stay within the chunked schedule's bound at chunk size C
    (working_set_bound with the same budget and options): per row, the
    larger of one_chunk_ep_bytes' forward and (with grad) backward at R = N =
    1, plus the kept cache b*(2I + H) with keep; less, up front, one grouped
    weight-gradient result of borrowed experts, at most b*C*max(2I, H)
    (gemm.dw_accumulate). options: activation, bias, split, grouped."""
    bound = working_set_bound(C, H, I, P, b, True, save_budget_bytes,
                              **{k: v for k, v in options.items() if k != "grouped"})
    bound -= b * C * max(2 * I, H)
    per_row = one_chunk_ep_bytes(1, 1, H, I, b, False, keep=keep, **options)
    if grad:
        per_row = max(per_row, one_chunk_ep_bytes(1, 1, H, I, b, True, keep=keep, lean=lean, **options))
    per_row += b * (2 * I + H) if keep else 0
    return max(0, bound // per_row)
