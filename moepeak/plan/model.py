"""The model of `moepeak plan`: the four memory peaks per GPU, for plain FSDP2 (+
activation checkpointing) and for moepeak, and the longest context that fits. Where a
schedule states its sizes (moepeak.llep.sizes, moepeak.ring_dtp.sizes, moepeak.sco.sizes,
moepeak.stream_adamw.sizes) the model calls them rather than restating them.

Notation (docs/design.md): T tokens per rank (= context / P: the sequence is split
over the P ranks by context parallelism), H hidden, I expert intermediate,
V vocab, E experts, K top-k, L layers, b bytes per activation element (bf16 = 2),
N parameters.

Peaks (bytes per GPU; each term read off the code that allocates it, see peaks())
                 plain FSDP2 + AC                     moepeak
  dispatch   T*K*(b*H+4b*I+8H+20) saved rows          T*(b*H+4K) saved + b*C*(2H+3I) (P>1:
             + 4*T*H (fp32 combine accumulator)        4H+3I) + 4*T*H + 4*T*K (bwd dX, d(w))
  vocab      12*T*V (fp32 log-softmax saved,          Ring-DTP (ring_dtp_vocab_bytes): fused_lowp
             nll grad, log-softmax grad)               (<= 128 token chunks): one <= 600 MiB
                                                       [ct, V] block + b*T*H dX; else 256 MiB
                                                       + (4+b)*T*H or + 4*cv*H + b*T*H + 4*T
                                                       (cv: vocab_outer_lowp's block); + 32*T
  boundaries L*T*H*b (one checkpoint input/block)     head phase W=2, block phase 1+prefetch=2
                                                       (tiled blocks: 1) *T*H*b (SCO)
  optimizer  12*N/P (fp32 master, m, v)               0 (host RAM + pinned slots); with a device
                                                       tail, its budget, at most 12*N/P
Also held: 'fixed' = params + grads (plain 4*N/P fp32 grads; moepeak bf16 params + grads
2*b*N/P), two all-gathered blocks when P > 1, RoPE tables 8*d*T; 'block' = the saved
tensors of the block being recomputed (two RMSNorms 2*(8H+4), lean: 4 + (b*H+4), attention b*(H+5*nh*d) +
4*nh, router 4H+4E+12K, the incoming grad b*H, per token); 'head_act' = what the final
RMSNorm saves + the head's input b*H per token; 'final_norm' = the final RMSNorm's own
backward at its peak. The final norm (Setup.lean_norm): moepeak.norms.rms_norm (the
default: the demo's with the Ring-DTP head, apply_moepeak's) saves x b*H and rstd 4
('head_act' = 2*b*H + 4) and its backward holds those, the incoming grad b*H, dx b*H and
three fp32 [c, H] chunk temporaries (c = min(norm chunk, T)): 'final_norm' = T*(3*b*H + 4)
+ 12*c*H. The eager demo norm (plain, or --eager-norm: MoEConfig(lean_norm=False)) saves
fp32 x and the fp32 normalised rows ('head_act' = 8H + 4 + b*H) and its backward peaks at
24H per token, as transformers' (checked on CPU, tests/test_plan.py).

Host RAM: moepeak/plan/host.py (every host allocation of the step, per GPU); where each
tensor class goes when a machine's GPU, RAM and disk are given: moepeak/plan/placement.py.
`--sco-keep-last keep` moves boundaries from host RAM to the GPU's boundary terms (default:
keep_last).

The step's peak is the larger of two phases:
  total = fixed + optimizer + max(boundaries_block + block + dispatch,
                                  boundaries_head + max(head_act + vocab, final_norm)).

--impl hf (Setup.impl = "hf"): the layers are a Hugging Face transformers model under
moepeak.hf.apply_moepeak (read off transformers 5.17's Qwen3-MoE / Mixtral code, checked on
CPU by tests/test_plan_hf.py and against bench_hf.py's H200 peaks), where three terms differ:
  RoPE      cos, sin [B, T, d] in the activation dtype + position_ids int64, made once by the
            model and held by every layer's checkpoint: 2*b*d + 8 per token (not 8*d)
  head      the final RMSNorm. apply_moepeak's lean norm: as above. transformers' eager
            RMSNorm (apply_moepeak(lean_norm=False); plan --eager-norm, Setup.lean_norm=False:
            x.to(fp32), pow, mean, rsqrt, mul, .to(dtype), * weight) saves fp32 x 4H, rstd 4
            and the normalised bf16 b*H ('head_act' = 4H + 4 + 2*b*H); its backward peaks at
            the saved fp32 x + five fp32 [T, H] temporaries (the mul's dx, mean's expanded
            grad, pow's x^1, 2*x^1 and grad * 2x): 'final_norm' = 24H per token
  phase     the head's backward runs before any block's: with zero_grad(set_to_none=True)
            only the head's gradients exist then (lm_head V*H, the norm's H), so the moepeak
            head phase holds params + those gradients, not every gradient (demo: 'fixed')
  moepeak total = optimizer + boundaries + max(fixed + block + dispatch,
                                               head_fixed + max(head_act + vocab, final_norm)).
(The untiled block term stays the demo block's saved-tensor count; bench_hf measured the
untiled HF model within 15% of it.)
With --tile-tokens t (moepeak.tiled; moepeak plan only): the block term becomes
  T * tiled_full_len_bytes (the attention core's full-length tensors at the backward peak,
  see tiled_full_len_bytes) + min(t, T) * (the untiled block's per-token bytes), and the
  dispatch term is that of one tile of min(t, T) tokens (the MoE runs per tile).
--impl hf --sp {ulysses,ring} (Setup.sp: moepeak.hf's sequence_group, README "Across GPUs with
sequence parallelism"): one sequence over S = --sp-size ranks (default P; P / S data-parallel
replicas), T = batch * ceil(context / S) tokens per rank; the experts over P_ep = --ep-size ranks
(default S: the sequence group, E % P_ep == 0); the non-expert weights --shard ddp (replicated,
DistributedDataParallel: Ulysses' default) or fsdp2 (ring's default). Where the terms differ:
  block     + the engine's attention exchange per local token (sequence_attention_bytes:
            Ulysses' full-sequence q, k, v, out of the rank's heads; ring's kv buffer in flight
            and fp32 merge state); Ulysses' tiled layer calls the core with one head group
            (tiled_full_len_bytes(groups=1)), ring's with nkv
  fixed     ddp: 2*b*((N - N_e) + N_e/P_ep) + DDP's gradient buckets b*(N - N_e), no gathered
            blocks; fsdp2: 2*b*N/P + the gathered blocks, as above (N_e: expert_params)
  vocab     ddp: the replicated head's Ring-DTP without the shard's ring buffers; fsdp2: as above
  dispatch  PipelinedLLEP over P_ep ranks
  optimizer StreamAdamW's state of local_params (host.py: 12*((N - N_e) + N_e/P_ep) under ddp)
The plain plan there: stock transformers under the same engine (its attention exchange, no
expert parallelism: every rank runs its tokens through every expert), FSDP2/ZeRO-3 sharded.
Validation (sequence_problems): S divides P and the heads; Ulysses: S divides the kv heads or is
a multiple of them; P_ep divides P and E.
The binding peak is the largest of the four and the block term; the longest context is
found by bisection on the total. Checked against H200 measurements in tests/test_plan.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from ..ring_dtp import sizes as RS
from ..sco import sizes as SCO
from ..stream_adamw import StreamAdamWOptions
from ..stream_adamw import sizes as SA
from ..tiled import sizes as TS
from .sequence import (expert_params, expert_ranks, local_params, sequence_attention_bytes,
                       sequence_problems, shard_of, tokens_per_rank)

GiB = 2 ** 30


@dataclass
class ModelShape:
    layers: int
    hidden: int
    experts: int
    top_k: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: Optional[int] = None          # default hidden // heads (MLA: the value head size)
    qk_head_dim: Optional[int] = None       # q and k head size when it differs (MLA: nope + rope)
    attn_params_per_layer: Optional[int] = None  # override (e.g. MLA)
    shared_experts: int = 0
    dense_layers: int = 0                   # leading dense-MLP layers (DeepSeek-V3)
    dense_intermediate: int = 0
    tied_embeddings: bool = False
    param_count: Optional[int] = None       # a model's own count (sum of numel): overrides params()' formula

    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def dqk(self) -> int:
        return self.qk_head_dim or self.d()

    def problems(self, flags: bool = False) -> List[str]:
        """What is wrong with the shape, one sentence per bad field (flags=True: named as
        `moepeak plan`'s flags, --kv-heads; else as the fields, kv_heads); [] if nothing."""
        def name(f: str) -> str:
            return "--" + f.replace("_", "-") if flags else f
        bad = []
        for f in ("layers", "hidden", "experts", "top_k", "intermediate", "vocab", "heads", "kv_heads"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad.append(f"{name(f)} must be a positive integer, got {v!r}")
        for f in ("head_dim", "qk_head_dim"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                bad.append(f"{name(f)} must be a positive integer, got {v!r}")
        if bad:
            return bad
        if self.head_dim is None and self.hidden % self.heads:
            bad.append(f"{name('heads')} ({self.heads}) must divide {name('hidden')} ({self.hidden}), "
                       f"or give {name('head_dim')}")
        if self.heads % self.kv_heads:
            bad.append(f"{name('kv_heads')} ({self.kv_heads}) must divide {name('heads')} ({self.heads})")
        if self.top_k > self.experts:
            bad.append(f"{name('top_k')} ({self.top_k}) must be <= {name('experts')} ({self.experts})")
        if self.dense_layers > self.layers:
            bad.append(f"dense_layers ({self.dense_layers}) must be <= {name('layers')} ({self.layers})")
        return bad

    def validate(self) -> "ModelShape":
        """self, or ValueError listing problems()."""
        bad = self.problems()
        if bad:
            raise ValueError("moepeak.plan: ModelShape: " + "; ".join(bad))
        return self

    def attn_params(self) -> int:
        if self.attn_params_per_layer is not None:
            return self.attn_params_per_layer
        d = self.d()
        return self.hidden * d * (2 * self.heads + 2 * self.kv_heads)

    def block_params(self, moe: bool = True) -> int:
        H = self.hidden
        if moe:
            mlp = self.experts * 3 * H * self.intermediate + self.experts * H \
                + self.shared_experts * 3 * H * self.intermediate
        else:
            mlp = 3 * H * self.dense_intermediate
        return self.attn_params() + mlp + 2 * H

    def params(self) -> int:
        if self.param_count is not None:
            return self.param_count
        emb = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        moe_layers = self.layers - self.dense_layers
        return emb + self.hidden + moe_layers * self.block_params(True) \
            + self.dense_layers * self.block_params(False)


PEAKS = ("dispatch", "vocab", "boundaries", "optimizer")
BINDING = PEAKS + ("block", "final_norm")  # what the report can name as binding
# Whose modeling code runs the layers (Setup.impl, --impl): moepeak's demo model, or a Hugging
# Face transformers model under moepeak.hf.apply_moepeak.
IMPLS = ("demo", "hf")
def tiled_full_len_bytes(m: "ModelShape", b: int, groups: Optional[int] = None) -> float:
    """Bytes per token of the full-length tensors of a sequence-tiled block at its backward
    peak, the block input x excluded (the boundaries term's): moepeak.tiled.sizes.
    full_length_bytes_per_token for this shape in b-byte activations, with G = groups head
    groups (default nkv; 1 under Ulysses, whose attention function needs every head in one
    call). dqk = d except for MLA, whose q and k heads are wider than v's."""
    return TS.full_length_bytes_per_token(hidden=m.hidden, q_heads=m.heads, kv_heads=m.kv_heads, qk_dim=m.dqk(),
                                          v_dim=m.d(), elem_bytes=b, head_groups=groups or m.kv_heads)


@dataclass
class Setup:
    gpus: int = 8
    gpu_mem_gib: float = 141.0
    act_bytes: int = 2          # b
    imbalance: float = 1.5      # rho for plain EP (capped to [1, P])
    chunk_rows: Optional[int] = None  # PipelinedLLEP C (None: its default, llep.sizes.default_chunk_rows)
    llep_save_budget_mb: Optional[int] = None  # PipelinedLLEP activation cache (None: llep.default_save_budget_mb)
    ring_workspace_mb: Optional[float] = None  # Ring-DTP's fused workspace (None: its defaults)
    tile_tokens: Optional[int] = None  # moepeak.tiled's tile (None: whole blocks)
    impl: str = "demo"          # IMPLS: whose modeling code runs the layers
    lean_norm: bool = True      # moepeak plan: the RMSNorms are moepeak.norms.rms_norm (False: the eager ones)
    norm_chunk_tokens: Optional[int] = None  # its chunk (None: moepeak.norms.default_chunk_rows(H))
    bucket_mb: float = StreamAdamWOptions.bucket_mb  # StreamAdamW bucket (slots: pinned host memory, 0 GPU bytes)
    device_state_gib: float = 0.0  # StreamAdamW device_state budget (backward_tail): on the GPU
    state_dtype_bytes: int = 4  # StreamAdamW state_dtype's element size: 4 float32, 2 bfloat16 (host state only)
    sco_in_flight: int = SCO.DEFAULTS.max_in_flight  # SCOConfig.max_in_flight (W): forward D2H copies referenced
    sco_prefetch: int = SCO.DEFAULTS.prefetch  # SCOConfig.prefetch: boundaries loaded ahead in backward
    sco_keep_last: Optional[int] = None  # SCOConfig.keep_last (None: the layers' code's default, keep_last)
    batch: int = 1
    # Hugging Face sequence parallelism (moepeak.hf's sequence_group; --impl hf only). None: the
    # sequence split over every GPU, FSDP2-sharded, the experts over every GPU.
    sp: Optional[str] = None    # SP_ENGINES: DeepSpeed Ulysses or torch context_parallel (ring)
    sp_size: Optional[int] = None  # S, the ranks holding one sequence (None: gpus); gpus / S replicas
    shard: Optional[str] = None  # SHARDS: how the non-expert weights are held (None: ddp for
    #                              ulysses, fsdp2 for ring)
    ep_size: Optional[int] = None  # P_ep, the ranks the experts are split over (None: S)
    # plain plan's bytes per parameter: FSDP2 mixed precision keeps fp32 master,
    # m, v (12, "optimizer") and fp32 grads (4, fixed). The demo's plain run on
    # bf16 params with torch AdamW: m, v bf16 (4) and bf16 params + grads (4).
    plain_opt_bytes: float = 12.0
    plain_fixed_bytes: float = 4.0


def keep_last(s: Setup) -> int:
    """How many last blocks keep their input on the GPU: Setup.sco_keep_last, else the default
    of whose code runs the layers (the demo model's MoEConfig.sco_keep_last, KEEP_LAST_DEMO;
    apply_moepeak's SCOConfig().keep_last, KEEP_LAST)."""
    if s.sco_keep_last is not None:
        return s.sco_keep_last
    return SCO.KEEP_LAST if s.impl == "hf" else SCO.KEEP_LAST_DEMO


def ring_dtp_vocab_bytes(T: int, H: int, V: int, b: int, budget_mb: Optional[float] = None) -> float:
    """Ring-DTP's own bytes at its peak on one device, for the schedule `auto` picks
    (moepeak.ring_dtp.sizes.auto_peak_bytes: the op's own sizing and choice; its docstring
    lists each schedule's buffers). dW [V, H] is the parameter's gradient: counted in 'fixed'.
    budget_mb overrides the fused workspaces (Setup.ring_workspace_mb)."""
    return RS.auto_peak_bytes(T, H, V, b, int(budget_mb * 2 ** 20) if budget_mb else None)


def peaks(m: ModelShape, s: Setup, context: int, plan: str) -> Dict[str, float]:
    """Bytes per GPU of each peak and of the fixed part, for plan 'plain' or 'moepeak'.

    Every per-token term below is read off the code that allocates it (moepeak/demo/models.py's
    blocks, the components' autograd), not fitted; tests/test_plan.py checks the saved-
    tensor terms on CPU with autograd hooks and the totals against GPU measurements.
    """
    if plan not in ("plain", "moepeak"):
        raise ValueError(f"moepeak.plan: plan must be 'plain' or 'moepeak', got {plan!r}")
    if s.impl not in IMPLS:
        raise ValueError(f"moepeak.plan: Setup.impl must be one of {IMPLS}, got {s.impl!r}")
    bad = sequence_problems(m, s)
    if bad:
        raise ValueError("moepeak.plan: Setup: " + "; ".join(bad))
    hf = s.impl == "hf"
    P, b = s.gpus, s.act_bytes
    T = tokens_per_rank(s, context)
    Pep, ddp = expert_ranks(s), shard_of(s) == "ddp"
    H, I, V, K, L, E = m.hidden, m.intermediate, m.vocab, m.top_k, m.layers, m.experts
    N = m.params()
    nblock = m.block_params(True)
    d = m.d()
    Hq, Hqk = m.heads * d, m.heads * m.dqk()
    # FSDP2: current + prefetched block (the plain plan is always FSDP2/ZeRO-3 sharded over the P GPUs)
    gathered = 2 * b * nblock if P > 1 and not (ddp and plan == "moepeak") else 0
    # Per token, saved by autograd for the one block being recomputed (its backward):
    #   RMSNorm x2: fp32 x (pow, mul) + fp32 normalised y (mul by weight) + rstd = 8H + 4 each;
    #   attention: the norm output (q/k/v input) b*H; flash SDPA keeps q, k and v repeated to
    #   nh heads, the output and fp32 lse (4 * b*Hq + 4*nh; MLA: q, k 2 * b*Hqk, v and the
    #   output 2 * b*Hq); o_proj's input copy b*Hq;
    #   router: fp32 copy of its input 4H, softmax output 4E, top-k ids 8K, top-k values 4K,
    #   their sum 4 (normalisation).
    #   with lean norms (moepeak.norms.rms_norm: Setup.lean_norm, moepeak plan) each saves its input and
    #   rstd, b*H + 4; the first one's input is the block input itself (in 'boundaries'), so 4 + (b*H + 4).
    lean = s.lean_norm and plan == "moepeak"
    saved_norm = b * H + 4 if lean else 8 * H + 4
    norms = (4 + saved_norm) if lean else 2 * saved_norm
    attn = b * (H + 2 * Hqk + 3 * Hq) + 4 * m.heads
    router = 4 * H + 4 * E + 12 * K + 4
    out = {"saved_norm": saved_norm, "saved_router": router}  # per token (checked on CPU)
    rope = 2 * b * d + 8 if hf else 8 * d       # hf: cos, sin [B, T, d] x b + position_ids int64;
    #                                             demo: cos, sin tables [T, d] x fp32, cached
    if lean:                                     # moepeak.norms.rms_norm (module docstring)
        from ..norms import BACKWARD_CHUNK_FP32, default_chunk_rows
        c = min(s.norm_chunk_tokens or default_chunk_rows(H), T)
        head_act = b * H + 4 + b * H             # saved x, rstd + the head's input
        # its backward: saved x, rstd, the incoming grad, dx + the chunk's fp32 temporaries
        out["final_norm"] = T * (3 * b * H + 4) + BACKWARD_CHUNK_FP32 * 4 * c * H
    else:  # eager RMSNorm; its backward peaks at 24H per token, transformers' and the demo's alike
        # saved: transformers' fp32 x, rstd, normalised b*H / the demo's fp32 x, fp32 normalised
        # rows, rstd; + the head's input
        head_act = (4 * H + 4 + 2 * b * H) if hf else (8 * H + 4 + b * H)
        out["final_norm"] = T * 24 * H
    if plan == "plain":
        # stock transformers' experts: no expert parallelism under sequence parallelism (every
        # rank runs its own tokens through every expert), else plain EP's imbalance
        rho = 1.0 if s.sp else min(max(s.imbalance, 1.0), float(P))
        # DenseMoE per routed row (K per token): gathered x b*H, gate_up output b*2I (silu, mul),
        # silu b*I, act b*I, the fp32 expert output 4H and its gate-scaled copy 4H (mul,
        # index_add), the gate weight 4 and the row/slot ids 16; P > 1: rho x.
        moe_saved = rho * K * (b * H + 4 * b * I + 8 * H + 20)
        out["saved_moe"] = moe_saved
        # + the incoming grad [T, H]; + the sequence-parallel attention's exchange (one call)
        block = T * (norms + attn + router + b * H + sequence_attention_bytes(m, s, b, tiled=False))
        out["dispatch"] = T * moe_saved + 4 * T * H    # + the fp32 [T, H] combine accumulator
        # F.linear -> .float() -> F.cross_entropy: backward holds the saved fp32 log-softmax,
        # nll_loss's fp32 grad and log_softmax's fp32 grad, all [T, V]: 12 B per logit.
        out["vocab"] = 12.0 * T * V
        out["boundaries"] = bounds_head = bounds_block = L * T * H * b
        out["optimizer"] = s.plain_opt_bytes * N / P
        out["fixed"] = s.plain_fixed_bytes * N / P + gathered + T * rope
    else:
        from ..llep.sizes import (cache_slots, capped_save_bytes, default_chunk_rows, default_save_budget_mb,
                                  effective_chunk_rows, slot_elems, workspace_bytes)
        C = effective_chunk_rows(s.chunk_rows or default_chunk_rows(Pep), T, K, Pep)  # llep_moe's chunk size
        # llep_dispatch saves its input b*H + the normalised weights 4K (ids: the router's)
        # + forward's send list 8K (int64, so backward need not route again);
        # its backward adds an fp32 [T, H]
        # dX and fp32 [T*K] d(weights); the chunk's GEMM working set C*(2H + 3I)
        # (P > 1 adds the single-buffered send, receive and combine buffers of C rows: llep.sizes.workspace_bytes).
        out["saved_moe"] = b * H + 4 * K + 8 * K
        block = T * (norms + attn + router + b * H + sequence_attention_bytes(m, s, b, tiled=False))
        Tm = T  # tokens one MoE call sees
        if s.tile_tokens:
            Tm = min(s.tile_tokens, T)
            groups = 1 if s.sp == "ulysses" else None   # the tiled layer's head groups
            block = T * (tiled_full_len_bytes(m, b, groups) + sequence_attention_bytes(m, s, b, tiled=True)) \
                + Tm * (norms + attn + router + b * H)
        # + the activation cache, alive from the layer's (re)computed forward to its
        # backward: whole slots of h [C, 2I] within the launch budget, never more
        # slots than chunks (llep.sizes.cache_slots, as llep_moe sizes it).
        budget = s.llep_save_budget_mb if s.llep_save_budget_mb is not None else default_save_budget_mb(Pep)
        slots = cache_slots(capped_save_bytes(budget << 20, T, K, C, H, I, Pep, b), Tm, K, C, I, Pep, b)
        cache = slots * b * slot_elems(C, I)
        out["llep_cache"] = cache
        # the chunk's working set: P = 1, forward's (llep.sizes.workspace_bytes); P > 1, the chunk
        # budget's bound b*C*(16H + 7I) (backward's double-buffered send/receive rings and the
        # cache room they leave)
        chunk_ws = workspace_bytes(C, H, I, 1, b, False) if Pep == 1 else b * C * (16 * H + 7 * I)
        out["dispatch"] = Tm * out["saved_moe"] + chunk_ws + 4 * Tm * H + 4 * Tm * K + cache
        ws = ring_dtp_vocab_bytes(T, H, V, b, s.ring_workspace_mb)
        if P > 1 and not ddp:   # a vocab-sharded head's ring: the shard in flight and its fp32 dW
            ws += 2 * (V // P) * H * b + 4 * (V // P) * H
        out["vocab"] = ws
        # SCO (moepeak/sco/checkpoint.py): the last W forward copies stay referenced until the first
        # reload polls them (through the head's backward); in a block's backward: the input
        # being recomputed + `prefetch` loaded ahead, except that a tiled block holds its
        # prefetch back until its attention core's backward peak has passed. Flat in L.
        # keep_last: those inputs never leave the GPU; all are live in the head phase, all but
        # the one being recomputed in the first block's backward (conservative: in full).
        boundary = SCO.boundary_bytes(T, H, b)
        bounds_head = SCO.gpu_head_bytes(L, keep_last(s), s.sco_in_flight, boundary)
        bounds_block = SCO.gpu_block_bytes(L, keep_last(s), s.sco_prefetch, bool(s.tile_tokens), boundary)
        out["boundaries"] = max(bounds_head, bounds_block)
        # StreamAdamW: fp32 master/m/v in host RAM, its bucket slots pinned host memory;
        # on the GPU only a device_state tail: at most the budget, at most all the state
        # (12 B per bf16/fp16 param, 8 per fp32). Params + grads are in 'fixed'.
        Nloc = local_params(m, s)
        out["optimizer"] = min(s.device_state_gib * GiB, SA.device_state_bytes_per_param(b) * Nloc)
        # ddp: DistributedDataParallel's gradient buckets, a flat copy of the replicated
        # gradients (its default gradient_as_bucket_view=False; the expert slices are left out)
        buckets = b * (N - expert_params(m)) if ddp else 0
        out["fixed"] = 2 * b * Nloc + buckets + gathered + T * rope
    out["block"] = block                   # the recomputed block's saved tensors (+ its grad in)
    out["head_act"] = T * head_act         # what the head's backward also holds
    # Held during the head's backward: every gradient (demo, plain: conservative), or (hf,
    # moepeak) the params and the head's gradients only, lm_head [V, H] and the norm's [H].
    out["head_fixed"] = out["fixed"]
    if hf and plan == "moepeak":   # less every gradient but the head's (replicated under ddp)
        out["head_fixed"] -= b * (local_params(m, s) - (V * H + H) / (1 if ddp else P))
    head = max(out["head_act"] + out["vocab"], out["final_norm"])
    out["boundaries_block"], out["boundaries_head"] = bounds_block, bounds_head  # each phase's
    out["total"] = out["optimizer"] + max(bounds_block + out["fixed"] + out["block"] + out["dispatch"],
                                          bounds_head + out["head_fixed"] + head)
    out["binding"] = max(BINDING, key=lambda k: out[k])
    return out


def largest_fitting_context(fits, limit: int = 1 << 26) -> int:
    """Largest context (multiple of 1024, <= limit) for which fits(context) holds, fits being
    monotone (true up to some context, false beyond); 0 if it fails at 1024."""
    if not fits(1024):
        return 0
    lo, hi = 1, limit // 1024
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * 1024) else (lo, mid - 1)
    return lo * 1024


def longest_context(m: ModelShape, s: Setup, plan: str, limit: int = 1 << 26) -> int:
    """Largest context (multiple of 1024, <= limit) whose predicted total fits; 0 if none."""
    return largest_fitting_context(lambda c: peaks(m, s, c, plan)["total"] <= s.gpu_mem_gib * GiB, limit)
