"""`moepeak plan`: predict the four memory peaks per GPU, for plain FSDP2 (+
activation checkpointing) and for moepeak, and the longest context that fits.

Notation (DESIGN.md): T tokens per rank (= context / P: the sequence is split
over the P ranks by context parallelism), H hidden, I expert intermediate,
V vocab, E experts, K top-k, L layers, b bytes per activation element (bf16 = 2),
N parameters.

Peaks (bytes per GPU)                      plain FSDP2 + AC            moepeak
  dispatch   b*[c0*T*K*H + rho*T*K*(c1*H + c2*I)] + 4*T*H      b*C*(4H + 3I) + 4*T*H (P=1: 2H+3I)
             (c0=1 the expanded copy, c1=1 expert output rows,  (2 recv + 1 send buffers of
              c2=4 gate_up [2I] + silu(gate) [I] + act [I];      C rows, GEMM C*(3I+H), fp32
              rho = max rows a rank receives / (T*K),            [T, H] accumulator)
              1 balanced .. P; fp32 [T, H] combine buffer)
  vocab      T*V*(b + 8) (bf16 logits, fp32 copy, fp32          512 MiB workspace + 8*T + 4*T*H
             log-softmax; b=4: T*V*8)                             (+ 2 shard buffers + fp32 dW shard, P>1)
  boundaries L*T*H*b (one checkpoint input per block)            min(L, 5)*T*H*b (kept, recomputing,
                                                                  prefetch, 2 in flight)
  optimizer  12*N/P (fp32 master, m, v)                          5*bucket (3 grad + 2 param slots)
Fixed parts: plain: fp32 sharded grads 4*N/P, two all-gathered bf16 blocks
2*2*N_block (P > 1 only); moepeak: bf16 sharded params + grads 4*N/P (its master copy is in
host RAM), the same two blocks. Both: attention's O(T) tensors of the block
being recomputed, T*b*(4H + nh*d + 2*nkv*d) + 4*T*nh (lse).

What coexists at the step's peak (backward of the first block to recompute):
fixed + optimizer + boundaries + max(dispatch, vocab). The binding peak is the
largest of the four; the longest context is found by bisection on the total.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional

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
    head_dim: Optional[int] = None          # default hidden // heads
    attn_params_per_layer: Optional[int] = None  # override (e.g. MLA)
    shared_experts: int = 0
    dense_layers: int = 0                   # leading dense-MLP layers (DeepSeek-V3)
    dense_intermediate: int = 0
    tied_embeddings: bool = False

    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def validate(self):
        bad = []
        for f in ("layers", "hidden", "experts", "top_k", "intermediate", "vocab", "heads", "kv_heads"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                bad.append(f"{f} must be a positive integer, got {v!r}")
        if not bad:
            if self.head_dim is None and self.hidden % self.heads:
                bad.append(f"heads ({self.heads}) must divide hidden ({self.hidden}) or give --head-dim")
            if self.heads % self.kv_heads:
                bad.append(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
            if self.top_k > self.experts:
                bad.append(f"top_k ({self.top_k}) must be <= experts ({self.experts})")
            if self.dense_layers > self.layers:
                bad.append(f"dense_layers ({self.dense_layers}) must be <= layers ({self.layers})")
        if bad:
            raise ValueError("moepeak plan: " + "; ".join(bad))
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
        emb = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        moe_layers = self.layers - self.dense_layers
        return emb + self.hidden + moe_layers * self.block_params(True) \
            + self.dense_layers * self.block_params(False)


# Public configs (their config.json numbers).
PRESETS: Dict[str, ModelShape] = {
    "Qwen3-30B-A3B": ModelShape(layers=48, hidden=2048, experts=128, top_k=8, intermediate=768,
                                vocab=151936, heads=32, kv_heads=4, head_dim=128),
    "Qwen3-235B-A22B": ModelShape(layers=94, hidden=4096, experts=128, top_k=8, intermediate=1536,
                                  vocab=151936, heads=64, kv_heads=4, head_dim=128),
    # MLA attention: q_a 7168x1536, q_b 1536x(128*192), kv_a 7168x576, kv_b 512x(128*256), o (128*128)x7168
    "DeepSeek-V3": ModelShape(layers=61, hidden=7168, experts=256, top_k=8, intermediate=2048,
                              vocab=129280, heads=128, kv_heads=128, head_dim=128,
                              attn_params_per_layer=7168 * 1536 + 1536 * 128 * 192 + 7168 * 576
                              + 512 * 128 * 256 + 128 * 128 * 7168,
                              shared_experts=1, dense_layers=3, dense_intermediate=18432),
    "gpt-oss-120b": ModelShape(layers=36, hidden=2880, experts=128, top_k=4, intermediate=2880,
                               vocab=201088, heads=64, kv_heads=8, head_dim=64),
    "Mixtral-8x22B": ModelShape(layers=56, hidden=6144, experts=8, top_k=2, intermediate=16384,
                                vocab=32768, heads=48, kv_heads=8, head_dim=128),
}

PEAKS = ("dispatch", "vocab", "boundaries", "optimizer")


@dataclass
class Setup:
    gpus: int = 8
    gpu_mem_gib: float = 141.0
    act_bytes: int = 2          # b
    imbalance: float = 1.5      # rho for plain EP (capped to [1, P])
    chunk_rows: int = 32768     # PipelinedLLEP C (its default, llep_plan.default_chunk_rows)
    ring_workspace_mb: float = 512.0  # Ring-DTP block workspace (its default budget)
    bucket_mb: float = 64.0     # StreamAdamW bucket
    sco_window: int = 5         # boundaries resident under SCO
    batch: int = 1
    # plain plan's bytes per parameter: FSDP2 mixed precision keeps fp32 master,
    # m, v (12, "optimizer") and fp32 grads (4, fixed). The demo's plain run on
    # bf16 params with torch AdamW: m, v bf16 (4) and bf16 params + grads (4).
    plain_opt_bytes: float = 12.0
    plain_fixed_bytes: float = 4.0


def peaks(m: ModelShape, s: Setup, context: int, plan: str) -> Dict[str, float]:
    """Bytes per GPU of each peak and of the fixed part, for plan 'plain' or 'moepeak'."""
    if plan not in ("plain", "moepeak"):
        raise ValueError(f"moepeak plan: plan must be 'plain' or 'moepeak', got {plan!r}")
    P, b = s.gpus, s.act_bytes
    T = s.batch * -(-context // P)
    H, I, V, K, L = m.hidden, m.intermediate, m.vocab, m.top_k, m.layers
    N = m.params()
    nblock = m.block_params(True)
    d = m.d()
    attn = T * b * (4 * H + m.heads * d + 2 * m.kv_heads * d) + 4 * T * m.heads
    gathered = 2 * b * nblock if P > 1 else 0   # FSDP2: current + prefetched block
    out = {}
    if plan == "plain":
        rho = min(max(s.imbalance, 1.0), float(P))
        out["dispatch"] = b * (T * K * H + rho * T * K * (H + 4 * I)) + 4 * T * H
        out["vocab"] = T * V * (8 + (b if b < 4 else 0))
        out["boundaries"] = L * T * H * b
        out["optimizer"] = s.plain_opt_bytes * N / P
        out["fixed"] = s.plain_fixed_bytes * N / P + gathered + attn
    else:
        C = min(s.chunk_rows, max(1, T * K))
        # P = 1: the chunk's GEMM working set C*(2H + 3I); P > 1 adds 2 recv + 1 send buffers
        out["dispatch"] = b * C * ((2 * H + 3 * I) if P == 1 else (4 * H + 3 * I)) + 4 * T * H
        # workspace (bounded by its budget, never above the full T x V block) + lse/m,s [T]
        # + an fp32 [T, H] dX accumulator
        ws = min(s.ring_workspace_mb * 2 ** 20, T * V * (4 + (b if b < 4 else 0))) + 8 * T + 4 * T * H
        if P > 1:
            ws += 2 * (V // P) * H * b + 4 * (V // P) * H
        out["vocab"] = ws
        out["boundaries"] = min(L, s.sco_window) * T * H * b
        out["optimizer"] = 5 * s.bucket_mb * 2 ** 20
        out["fixed"] = 2 * b * N / P + gathered + attn
    out["total"] = out["fixed"] + out["optimizer"] + out["boundaries"] + max(out["dispatch"], out["vocab"])
    out["binding"] = max(PEAKS, key=lambda k: out[k])
    return out


def longest_context(m: ModelShape, s: Setup, plan: str, limit: int = 1 << 26) -> int:
    """Largest context (multiple of 1024, <= limit) whose predicted total fits; 0 if none."""
    cap = s.gpu_mem_gib * GiB
    if peaks(m, s, 1024, plan)["total"] > cap:
        return 0
    lo, hi = 1, limit // 1024
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peaks(m, s, mid * 1024, plan)["total"] <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo * 1024


def report(m: ModelShape, s: Setup, context: int) -> str:
    rows = []
    res = {p: peaks(m, s, context, p) for p in ("plain", "moepeak")}
    rows.append(f"model: {m.params() / 1e9:.2f} B params, L={m.layers} H={m.hidden} E={m.experts} "
                f"K={m.top_k} I={m.intermediate} V={m.vocab} heads={m.heads}/{m.kv_heads}")
    rows.append(f"context {context} tokens over {s.gpus} GPU(s) of {s.gpu_mem_gib:g} GiB "
                f"({-(-context // s.gpus)} tokens per GPU), activations {s.act_bytes} B/elem")
    rows.append("")
    rows.append(f"{'GiB per GPU':<22}{'plain FSDP2+AC':>16}{'moepeak':>12}")
    for k in PEAKS + ("fixed", "total"):
        rows.append(f"{k:<22}{res['plain'][k] / GiB:>16.2f}{res['moepeak'][k] / GiB:>12.2f}")
    cap = s.gpu_mem_gib * GiB
    for p in ("plain", "moepeak"):
        r = res[p]
        fits = "fits" if r["total"] <= cap else "does NOT fit"
        rows.append(f"{p}: binding peak = {r['binding']}; {fits}; longest context that fits: "
                    f"{longest_context(m, s, p)} tokens")
    return "\n".join(rows)


def plot(m: ModelShape, s: Setup, path: str, max_context: int = 1 << 21) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("moepeak plan: matplotlib is not installed (pip install matplotlib); skipping --plot")
        return False
    ctxs = [1 << k for k in range(12, max(13, max_context.bit_length()))]
    fig, ax = plt.subplots(figsize=(8, 5))
    for p, style in (("plain", "--"), ("moepeak", "-")):
        for k in PEAKS + ("total",):
            ax.plot(ctxs, [peaks(m, s, c, p)[k] / GiB for c in ctxs], style, label=f"{p}: {k}")
    ax.axhline(s.gpu_mem_gib, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("GiB per GPU")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def add_args(ap: argparse.ArgumentParser):
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    for f in ("layers", "hidden", "experts", "top-k", "intermediate", "vocab", "heads", "kv-heads",
              "head-dim"):
        ap.add_argument(f"--{f}", type=int, default=None)
    ap.add_argument("--context", type=int, default=131072, help="tokens per sequence")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu-mem", type=float, default=141.0, help="GiB per GPU")
    ap.add_argument("--imbalance", type=float, default=1.5, help="rho for plain EP")
    ap.add_argument("--act-bytes", type=int, default=2, choices=(2, 4))
    ap.add_argument("--plot", default=None, help="PNG path: peak vs context per component")


def from_args(a) -> (ModelShape, Setup):
    fields = {"layers": "layers", "hidden": "hidden", "experts": "experts", "top_k": "top_k",
              "intermediate": "intermediate", "vocab": "vocab", "heads": "heads",
              "kv_heads": "kv_heads", "head_dim": "head_dim"}
    given = {k: getattr(a, v) for k, v in fields.items() if getattr(a, v) is not None}
    if a.preset:
        m = dataclasses.replace(PRESETS[a.preset], **given)
    else:
        missing = [f for f in ("layers", "hidden", "experts", "top_k", "intermediate", "vocab", "heads")
                   if f not in given]
        if missing:
            raise ValueError("moepeak plan: give --preset or all of --" +
                             ", --".join(x.replace("_", "-") for x in missing))
        given.setdefault("kv_heads", given["heads"])
        m = ModelShape(**given)
    m.validate()
    if a.context < 1 or a.gpus < 1 or a.gpu_mem <= 0 or a.imbalance < 1:
        raise ValueError(f"moepeak plan: need --context >= 1 (got {a.context}), --gpus >= 1 (got {a.gpus}), "
                         f"--gpu-mem > 0 (got {a.gpu_mem}), --imbalance >= 1 (got {a.imbalance})")
    if m.experts % a.gpus and a.gpus <= m.experts:
        raise ValueError(f"moepeak plan: experts ({m.experts}) must be divisible by --gpus ({a.gpus})")
    return m, Setup(gpus=a.gpus, gpu_mem_gib=a.gpu_mem, act_bytes=a.act_bytes, imbalance=a.imbalance)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moepeak plan", description=__doc__.split("\n\n")[0])
    add_args(ap)
    a = ap.parse_args(argv)
    try:
        m, s = from_args(a)
    except ValueError as e:
        ap.error(str(e))
    print(report(m, s, a.context))
    if a.plot:
        if plot(m, s, a.plot):
            print(f"wrote {a.plot}")
    return 0
