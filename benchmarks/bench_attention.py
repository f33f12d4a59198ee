"""Attention at the ceiling (issue 38, item 3): causal bf16 forward + backward of one attention
call at head_dim 128, per backend and per head grouping, the way moepeak's tiled block core
calls it (moepeak/tiled/block.py: once per kv-head group).

Backends: flash, cudnn, efficient (F.scaled_dot_product_attention under
torch.nn.attention.sdpa_kernel with FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION),
default (F.scaled_dot_product_attention with torch's own choice), auto (the same call inside
moepeak.tiled.attention_backend_context("auto"): what the tiled core and apply_moepeak's attention
run by default, cuDNN first on Hopper for bf16), and flex (torch.compile(flex_attention) with a
causal BlockMask; eager on CPU).
Models (q heads / kv heads): qwen3 = the 2.0B Qwen3-MoE, 16 / 4; olmoe = OLMoE, 16 / 16.
Groupings: kv heads per call g (a divisor of the kv heads), q heads per call g * hq / hkv,
hkv / g calls per layer: g = hkv is one call with all heads, g = 1 is tiled.py's per kv-head
group (qwen3: 4 q + 1 kv head, 4 calls; olmoe: 1 + 1, 16 calls), the rest intermediate.
GQA (q heads per call > kv heads per call): "gqa" = enable_gqa=True (k, v read in place;
flex_attention's enable_gqa for flex), "expand" = k and v expanded to the q heads inside the
call as transformers' repeat_kv does (expand + reshape: a copy); "mha" where hq = hkv.
Layout (--layout): bshd (default) = q, k, v as [1, h, T, d] views of [1, T, h, d] storage, as
the transformers adapters' tiled buffers hold them; bhsd = contiguous [1, h, T, d].

Per timing case (kind "time"): one call's forward + backward (torch.autograd.grad of the
output with a fixed dout) and its forward alone, each the median of --reps CUDA-event
timings after one warm-up (the first fwd+bwd call, whose wall time is first_call_s: flex
compiles there); peak = max_memory_allocated during a timed fwd+bwd minus what was allocated
before it (q, k, v, dout). FLOP per call: forward 2 * T^2 * d * hq_call (causal: half of
the 4 * T^2 * d * h of QK^T and PV), backward 2.5x forward; TFLOP/s = FLOP / time.
layer_fwd_bwd_ms = calls per layer x one call's time (the calls of one layer are the same
shape and run one after another, so one call is timed and multiplied).
Accuracy (kind "accuracy", at --acc-T, all heads in one call): relative error (norm-wise, fp64)
of the output and dq, dk, dv against an fp64 reference (explicit softmax(q k^T / sqrt(d)) v
with the causal mask, autograd); backend "math" (torch's unfused bf16 SDPA) is listed as a
yardstick. Packed documents (kind "docmask", at --acc-T): flex with a document-causal mask
(three documents of unaligned lengths) against the same fp64 reference with the dense mask.

A case a backend refuses is a row (status "unsupported: <torch's reason>"), as is an OOM.
--max-seconds: a case whose estimated time (from the FLOP and the rate measured so far) does
not fit what is left is skipped (printed, not written); rows are appended to
OUT/attention.csv as each case finishes.

  python benchmarks/bench_attention.py --out benchmarks/results          # default grid, ~3 min
  python benchmarks/bench_attention.py --quick --out DIR                 # 128k only
  python benchmarks/bench_attention.py --full --max-seconds 540 --out DIR  # every grouping/backend at every T
  python benchmarks/bench_attention.py --T 524288 --models olmoe --backends flash --groups all
  python benchmarks/bench_attention.py --smoke --out /tmp/a              # CPU, tiny T: code paths
  python benchmarks/bench_attention.py --quick --backends auto,cudnn,flash --groups all --gqa gqa \
      --reps 2 --max-seconds 70 --out benchmarks/results   # the tiled core's defaults (~1 min): backend
      # and head groups per call, both models at 128k, fwd+bwd rate, layer time and peak per grouping

Default grid, in this order (the first T of --T is T0, default 128k, then 256k, 512k):
accuracy and docmask at 4k; at T0 flash and cudnn x {all heads, an intermediate grouping, per
kv head} x GQA modes for both models, then efficient (both GQA modes), default and flex (gqa)
with all heads and per kv head; at the longer T cudnn and flash per kv head (gqa) for both
models. About 3-3.5 minutes on an H200 (flex compiles once per shape, ~6 s); --max-seconds cuts
the tail. At 512k one all-heads fwd+bwd of 16 heads is 3.5 x 1.1e15 FLOP, 7-12 s: all-heads
cases beyond T0 run only with --full or --groups.

over 500 lines: every backend, model and grouping of the comparison in one script, so that they
run in one process on the same shapes (docs/design.md section 4, benchmarks).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from _common import TimeBudget, append_results, cuda_times_and_peak, is_oom, relerr  # noqa: E402

from moepeak.tiled import attention_backend_context  # noqa: E402

D = 128
MODELS = {"qwen3": (16, 4), "olmoe": (16, 16)}  # (q heads, kv heads)
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
BACKENDS = ("flash", "cudnn", "efficient", "default", "auto", "flex")
BWD_FACTOR = 2.5  # backward FLOP / forward FLOP
FIELDS = ["kind", "model", "T", "head_dim", "backend", "gqa", "layout", "q_heads", "kv_heads", "calls_per_layer",
          "status", "reps", "fwd_ms", "fwd_bwd_ms", "bwd_ms", "layer_fwd_bwd_ms", "fwd_tflops", "bwd_tflops",
          "fwd_bwd_tflops", "peak_gib", "first_call_s", "err_out", "err_dq", "err_dk", "err_dv"]


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    T: int
    backend: str
    kv_per_call: int
    gqa: str  # "gqa", "expand" or "mha"

    @property
    def ratio(self) -> int:
        hq, hkv = MODELS[self.model]
        return hq // hkv

    @property
    def q_heads(self) -> int:
        return self.kv_per_call * self.ratio

    @property
    def calls(self) -> int:
        return MODELS[self.model][1] // self.kv_per_call

    def label(self) -> str:
        return (f"{self.model:5s} T={self.T:7d} {self.backend:9s} {self.q_heads:2d}q/{self.kv_per_call:2d}kv "
                f"x{self.calls:2d} {self.gqa:6s}")


def fwd_flop(T: int, q_heads: int, d: int = D) -> float:
    """Causal forward FLOP of one call: QK^T and PV over the T(T+1)/2 ~ T^2/2 kept pairs."""
    return 2.0 * T * T * d * q_heads


def groupings(model: str, which: str):
    """kv heads per call, all heads first: 'default' (all, one intermediate, 1), 'all'
    (every divisor), 'full' (all heads), 'per_kv' (1), or a comma list of numbers."""
    hkv = MODELS[model][1]
    divisors = [g for g in range(hkv, 0, -1) if hkv % g == 0]
    if which == "all":
        return divisors
    if which == "full":
        return [hkv]
    if which == "per_kv":
        return [1]
    if which == "default":
        mid = [g for g in divisors if 1 < g < hkv]
        return [hkv] + ([mid[len(mid) // 2]] if mid else []) + ([1] if hkv > 1 else [])
    picked = [int(g) for g in which.split(",")]
    bad = [g for g in picked if g not in divisors]
    if bad:
        raise SystemExit(f"--groups: {bad} do not divide {model}'s {hkv} kv heads (divisors: {divisors})")
    return picked


def gqa_modes(model: str, kv_per_call: int, wanted):
    if MODELS[model][0] == MODELS[model][1]:
        return ["mha"]
    return [m for m in ("gqa", "expand") if m in wanted]


def default_grid(Ts, models, backends, scope, groups_flag, gqa_wanted):
    """Timing cases in priority order (see the module docstring): scope 'quick' (T0 only),
    'default', 'full' (every backend x grouping x GQA mode at every T)."""
    cases, T0 = [], Ts[0]
    sdpa = [b for b in backends if b != "flex"]

    def add(T, bs, which, modes):
        for b in bs:
            for m in models:
                for g in groupings(m, which):
                    for mode in gqa_modes(m, g, modes):
                        c = Case(m, T, b, g, mode)
                        if c not in cases:
                            cases.append(c)

    if scope == "full":
        for T in Ts:
            add(T, backends, groups_flag or "all", gqa_wanted)
        return cases
    add(T0, [b for b in ("flash", "cudnn") if b in sdpa], groups_flag or "default", gqa_wanted)
    for which in ("full", "per_kv"):
        add(T0, [b for b in ("efficient",) if b in sdpa], groups_flag or which, gqa_wanted)
        # torch's own choice and moepeak's default as the tiled core calls them (GQA in place), and flex
        add(T0, [b for b in ("default", "auto", "flex") if b in backends], groups_flag or which, gqa_wanted[:1])
    if scope == "default":
        for T in Ts[1:]:
            add(T, [b for b in ("cudnn", "flash") if b in backends], groups_flag or "per_kv", gqa_wanted[:1])
    return cases


# ---------------------------------------------------------------------------
# the attention call
# ---------------------------------------------------------------------------
def expand_kv(t: torch.Tensor, r: int) -> torch.Tensor:
    """[B, h, T, d] -> [B, h*r, T, d], kv head j read by q heads [j*r, (j+1)*r) (a copy)."""
    if r == 1:
        return t
    B, h, T, d = t.shape
    return t[:, :, None].expand(B, h, r, T, d).reshape(B, h * r, T, d)


class Flex:
    """flex_attention (compiled on CUDA, eager on CPU) and causal BlockMasks per length."""

    def __init__(self, device: torch.device):
        from torch.nn.attention.flex_attention import flex_attention
        self.device = device
        if device.type == "cuda":
            import torch._dynamo
            for knob in ("cache_size_limit", "recompile_limit"):  # one compile per shape
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
            self.fn = torch.compile(flex_attention, dynamic=False)
        else:
            self.fn = flex_attention
        self.masks = {}

    def mask(self, T: int, mask_mod=None, key=None):
        """The causal BlockMask of length T (mask_mod None), else mask_mod's (from its dense
        evaluation: short T only), cached under key."""
        from torch.nn.attention.flex_attention import create_block_mask
        key = key or ("causal", T)
        if key not in self.masks:
            if mask_mod is None:
                self.masks[key] = causal_block_mask(T, self.device)
            else:
                self.masks[key] = create_block_mask(mask_mod, None, None, T, T, device=self.device)
        return self.masks[key]


def causal_block_mask(T: int, device, block: int = 128):
    """flex_attention's causal BlockMask built from its block lists (no T x T evaluation, no
    compile): query block i reads kv blocks 0..i-1 whole and block i through q >= kv."""
    from torch.nn.attention.flex_attention import BlockMask
    n = -(-T // block)
    ar = torch.arange(n, dtype=torch.int32, device=device)
    kv_indices = torch.zeros(1, 1, n, n, dtype=torch.int32, device=device)
    kv_indices[0, 0, :, 0] = ar                                   # the diagonal block, partial
    full_indices = ar.view(1, 1, 1, n).expand(1, 1, n, n).contiguous()  # row i: blocks 0..i-1 valid
    return BlockMask.from_kv_blocks(torch.ones(1, 1, n, dtype=torch.int32, device=device), kv_indices,
                                    ar.view(1, 1, n).clone(), full_indices, BLOCK_SIZE=block,
                                    mask_mod=lambda b, h, q, kv: q >= kv, seq_lengths=(T, T))


def attention_call(backend: str, gqa: str, r: int, flex: Flex = None, block_mask=None):
    """call(q, k, v) -> out: one causal attention call of `backend`, GQA per `gqa`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(q, k, v):
        if gqa == "expand":
            k, v = expand_kv(k, r), expand_kv(v, r)
        if backend == "flex":
            return flex.fn(q, k, v, block_mask=block_mask, enable_gqa=gqa == "gqa")
        if backend == "default":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa == "gqa")
        if backend == "auto":
            with attention_backend_context("auto", q.device, q.dtype):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa == "gqa")
        with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa == "gqa")
    return call


def make_inputs(T, q_heads, kv_heads, layout, device, seed):
    """q [1, q_heads, T, D], k, v [1, kv_heads, T, D], dout like q (bf16, N(0, 1)), laid out
    per `layout`; q, k, v require grad."""
    g = torch.Generator(device=device).manual_seed(seed)

    def one(h, grad=True):
        if layout == "bshd":
            t = torch.randn(1, T, h, D, device=device, dtype=torch.bfloat16, generator=g).transpose(1, 2)
        else:
            t = torch.randn(1, h, T, D, device=device, dtype=torch.bfloat16, generator=g)
        return t.requires_grad_(grad)
    return one(q_heads), one(kv_heads), one(kv_heads), one(q_heads, grad=False)


def reference(q, k, v, dout, mask):
    """fp64 out, dq, dk, dv of softmax(q k^T / sqrt(d) masked) v with kv heads expanded."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    r = q.shape[1] // k.shape[1]
    s = (q64 @ k64.repeat_interleave(r, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    out = s.masked_fill(~mask, float("-inf")).softmax(-1) @ v64.repeat_interleave(r, 1)
    return (out.detach(),) + torch.autograd.grad(out, (q64, k64, v64), dout.double())


def _reason(err: BaseException, caught) -> str:
    """A refused case's status: torch's warnings say why a backend was not used."""
    why = [str(w.message).splitlines()[0] for w in caught if "because" in str(w.message) or "not" in str(w.message)]
    text = (why[0] if why else str(err).splitlines()[0])[:110]
    return f"unsupported: {text}"


def _release(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------
def time_case(c: Case, args, device, flex: Flex):
    """One timing row (a dict of FIELDS)."""
    row = dict(kind="time", model=c.model, T=c.T, head_dim=D, backend=c.backend, gqa=c.gqa, layout=args.layout,
               q_heads=c.q_heads, kv_heads=c.kv_per_call, calls_per_layer=c.calls)
    cuda = device.type == "cuda"
    try:
        q, k, v, dout = make_inputs(c.T, c.q_heads, c.kv_per_call, args.layout, device, seed=c.T + c.q_heads)
        bm = flex.mask(c.T) if c.backend == "flex" else None
        call = attention_call(c.backend, c.gqa, c.ratio, flex, bm)
    except RuntimeError as err:
        return dict(row, status="OOM" if is_oom(err) else f"error: {str(err).splitlines()[0][:100]}")

    def fwd():
        call(q, k, v)

    def fwd_bwd():
        out = call(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    status = "ok"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            try:
                fwd_bwd()
                timed = fwd_bwd
            except NotImplementedError as err:
                if not _no_backward(err):
                    raise
                # flex has no CPU backward: its forward alone, on inputs that need no gradient
                status, timed = f"fwd only: {str(err).splitlines()[0][:80]}", None
                qd, kd, vd = q.detach(), k.detach(), v.detach()

                def fwd():
                    call(qd, kd, vd)
                fwd()
            if cuda:
                torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - t0, 3)
    except RuntimeError as err:
        q = k = v = dout = None  # free now (the timing closures still name them)
        _release(device)
        return dict(row, status="OOM" if is_oom(err) else _reason(err, caught))
    try:
        f = fwd_flop(c.T, c.q_heads)
        fw, _ = cuda_times_and_peak(fwd, args.reps, warmup=1, cuda=cuda)
        row.update(fwd_ms=round(statistics.median(fw), 3), reps=args.reps)
        row["fwd_tflops"] = round(f / statistics.median(fw) / 1e9, 1)
        if timed is not None:
            fb, peak = cuda_times_and_peak(timed, args.reps, warmup=0, cuda=cuda)
            ms = statistics.median(fb)
            row.update(fwd_bwd_ms=round(ms, 3), bwd_ms=round(ms - row["fwd_ms"], 3),
                       layer_fwd_bwd_ms=round(ms * c.calls, 2), peak_gib=round(peak / 2 ** 30, 3),
                       fwd_bwd_tflops=round((1 + BWD_FACTOR) * f / ms / 1e9, 1))
            if ms > row["fwd_ms"]:
                row["bwd_tflops"] = round(BWD_FACTOR * f / (ms - row["fwd_ms"]) / 1e9, 1)
        row["status"] = status
    except RuntimeError as err:
        row["status"] = "OOM" if is_oom(err) else f"error: {str(err).splitlines()[0][:100]}"
    q = k = v = dout = call = None  # free now (the timing closures still name them)
    _release(device)
    return row


def accuracy_rows(args, device, models, backends, gqa_wanted, flex: Flex):
    """kind 'accuracy': every backend (and 'math') on each model's all-heads call at
    --acc-T against the fp64 reference; kind 'docmask': flex with packed documents."""
    T = args.acc_T
    rows = []
    idx = torch.arange(T, device=device)
    causal = idx[:, None] >= idx[None, :]
    for m in models:
        hq, hkv = MODELS[m]
        q, k, v, dout = make_inputs(T, hq, hkv, args.layout, device, seed=7)
        ref = reference(q, k, v, dout, causal)
        for b in list(backends) + ["math"]:
            for mode in gqa_modes(m, hkv, gqa_wanted):
                row = dict(kind="accuracy", model=m, T=T, head_dim=D, backend=b, gqa=mode, layout=args.layout,
                           q_heads=hq, kv_heads=hkv, calls_per_layer=1)
                bm = flex.mask(T) if b == "flex" else None
                rows.append(dict(row, **_errors(attention_call(b, mode, hq // hkv, flex, bm), q, k, v, dout, ref)))
        q = k = v = dout = ref = None  # free now (the timing closures still name them)
        _release(device)
    if "flex" in backends:
        rows.append(docmask_row(args, device, flex))
    return rows


def _no_backward(err: BaseException) -> bool:
    """flex_attention refuses inputs that need a gradient on the CPU (no CPU backward)."""
    return isinstance(err, NotImplementedError) and "backward" in str(err)


def _errors(call, q, k, v, dout, ref):
    """status and err_* of call(q, k, v) and its gradients against ref (out, dq, dk, dv);
    where the backend has no backward here (flex on the CPU) the forward alone, status
    'fwd only: ...'."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = call(q, k, v)
        except NotImplementedError as err:
            if not _no_backward(err):
                return dict(status=_reason(err, caught))
            out = call(q.detach(), k.detach(), v.detach())
            return dict(status=f"fwd only: {str(err).splitlines()[0][:80]}", err_out=f"{relerr(out, ref[0]):.3e}")
        except RuntimeError as err:
            return dict(status="OOM" if is_oom(err) else _reason(err, caught))
        res = dict(status="ok", err_out=f"{relerr(out, ref[0]):.3e}")
        grads = torch.autograd.grad(out, (q, k, v), dout)
    for name, g, r in zip(("err_dq", "err_dk", "err_dv"), grads, ref[1:]):
        res[name] = f"{relerr(g, r):.3e}"
    return res


def docmask_row(args, device, flex: Flex):
    """flex with a document-causal mask over three packed documents of unaligned lengths
    (not multiples of the 128-token block) against the fp64 reference on the dense mask."""
    T = args.acc_T
    hq, hkv = MODELS["qwen3"]
    lengths = [T // 4 + 7, T // 2 - 5]  # T >= 64: three documents, none a multiple of 128 at 4k
    lengths.append(T - sum(lengths))
    doc = torch.repeat_interleave(torch.arange(3, device=device), torch.tensor(lengths, device=device))
    idx = torch.arange(T, device=device)
    dense = (idx[:, None] >= idx[None, :]) & (doc[:, None] == doc[None, :])

    def doc_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

    row = dict(kind="docmask", model="qwen3", T=T, head_dim=D, backend="flex", gqa="gqa", layout=args.layout,
               q_heads=hq, kv_heads=hkv, calls_per_layer=1)
    q, k, v, dout = make_inputs(T, hq, hkv, args.layout, device, seed=11)
    ref = reference(q, k, v, dout, dense)
    bm = flex.mask(T, doc_causal, key=("docs", T, tuple(lengths)))
    return dict(row, **_errors(attention_call("flex", "gqa", hq // hkv, flex, bm), q, k, v, dout, ref))


def summary(rows):
    """Per (model, T, backend, GQA mode): one layer's fwd+bwd per grouping against the
    all-heads call."""
    timed = [r for r in rows if r["kind"] == "time" and r.get("layer_fwd_bwd_ms")]
    if not timed:
        return
    print("\none layer's fwd+bwd (calls x one call), per grouping, vs all heads in one call:")
    keys = sorted({(r["model"], r["T"], r["backend"], r["gqa"]) for r in timed})
    for key in keys:
        group = sorted((r for r in timed if (r["model"], r["T"], r["backend"], r["gqa"]) == key),
                       key=lambda r: -r["kv_heads"])
        full = next((r for r in group if r["calls_per_layer"] == 1), None)
        cells = []
        for r in group:
            rel = f" ({r['layer_fwd_bwd_ms'] / full['layer_fwd_bwd_ms']:.2f}x)" if full else ""
            cells.append(f"{r['q_heads']}q/{r['kv_heads']}kv x{r['calls_per_layer']}: {r['layer_fwd_bwd_ms']:.1f} ms"
                         f"{rel} {r['fwd_bwd_tflops']} TF/s")
        print(f"  {key[0]:5s} T={key[1]:7d} {key[2]:9s} {key[3]:6s} " + "; ".join(cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for attention.csv (appended per case)")
    ap.add_argument("--T", default="131072,262144,524288", help="comma-separated lengths; the first is T0")
    ap.add_argument("--models", default="qwen3,olmoe", help=f"some of {', '.join(MODELS)}")
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"some of {', '.join(BACKENDS)}")
    ap.add_argument("--groups", default=None, help="kv heads per call: default, all, full, per_kv, or numbers "
                                                   "(replaces the grid's choice at every T)")
    ap.add_argument("--gqa", default="gqa,expand", help="GQA modes for qwen3: gqa (enable_gqa), expand")
    ap.add_argument("--layout", default="bshd", choices=["bshd", "bhsd"])
    ap.add_argument("--reps", type=int, default=3, help="timed calls per case (median), after one warm-up")
    ap.add_argument("--acc-T", type=int, default=4096, help="length of the accuracy and docmask checks")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=180.0, help="wall budget of the run (0: none)")
    scope = ap.add_mutually_exclusive_group()
    scope.add_argument("--quick", action="store_true", help="timing at T0 only")
    scope.add_argument("--full", action="store_true", help="every backend x grouping x GQA mode at every T")
    ap.add_argument("--smoke", action="store_true", help="CPU, T = 128, accuracy at 64, one rep: code paths")
    args = ap.parse_args()

    models = [m for m in args.models.split(",") if m]
    backends = [b for b in args.backends.split(",") if b]
    gqa_wanted = [g for g in args.gqa.split(",") if g]
    for name, got, known in (("--models", models, MODELS), ("--backends", backends, BACKENDS),
                             ("--gqa", gqa_wanted, ("gqa", "expand"))):
        bad = [x for x in got if x not in known]
        if bad or not got:
            raise SystemExit(f"{name}: {bad or 'nothing'} not among {', '.join(known)}")
    if args.smoke:
        args.T, args.acc_T, args.reps = "128", 64, 1
    Ts = [int(t) for t in args.T.split(",") if t]
    if args.reps < 1 or args.acc_T < 64 or not Ts or min(Ts) < 1:
        raise SystemExit("--reps and every --T must be positive, --acc-T at least 64")
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_attention: no CUDA device (use --smoke for the CPU code paths)")
    budget = TimeBudget(args.max_seconds if args.max_seconds > 0 else None)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    flex = Flex(device) if "flex" in backends else None
    rows, skipped = [], []

    def emit(row):
        rows.append(row)
        if args.out:
            append_results(args.out, "attention", [row], fields=FIELDS, gpu=gpu)

    if not args.no_accuracy:
        for row in accuracy_rows(args, device, models, backends, gqa_wanted, flex):
            emit(row)
            print(f"{row['kind']:8s} {row['model']:5s} T={row['T']:6d} {row['backend']:9s} {row['gqa']:6s} "
                  f"{row['status'][:60]:12s} out {row.get('err_out', '-')} dq {row.get('err_dq', '-')} "
                  f"dk {row.get('err_dk', '-')} dv {row.get('err_dv', '-')}", flush=True)

    scope_name = "quick" if args.quick else "full" if args.full else "default"
    rates = []  # measured fwd+bwd TFLOP/s, for the time estimates
    for c in default_grid(Ts, models, backends, scope_name, args.groups, gqa_wanted):
        rate = statistics.median(rates) * 1e12 if rates else 300e12
        est = (1 + BWD_FACTOR) * fwd_flop(c.T, c.q_heads) / rate * (1 + args.reps) * (1 + 1 / (1 + BWD_FACTOR))
        est += 15.0 if c.backend == "flex" and device.type == "cuda" else 0.0  # a compile per shape
        if not budget.fits(est):
            skipped.append(f"{c.label().strip()} (~{est:.0f} s)")
            continue
        row = time_case(c, args, device, flex)
        if row.get("fwd_bwd_tflops"):
            rates.append(row["fwd_bwd_tflops"])
        emit(row)
        print(f"time     {c.label()} {row['status'][:40]:8s} fwd {row.get('fwd_ms', '-')} ms  "
              f"fwd+bwd {row.get('fwd_bwd_ms', '-')} ms ({row.get('fwd_bwd_tflops', '-')} TF/s, fwd "
              f"{row.get('fwd_tflops', '-')}, bwd {row.get('bwd_tflops', '-')})  layer "
              f"{row.get('layer_fwd_bwd_ms', '-')} ms  peak {row.get('peak_gib', '-')} GiB  "
              f"first {row.get('first_call_s', '-')} s  [{budget.elapsed():.0f} s]", flush=True)
    if skipped:
        print(f"\n--max-seconds {args.max_seconds:.0f}: skipped {len(skipped)} cases: " + "; ".join(skipped))
    summary(rows)
    if args.out:
        print(f"appended {len(rows)} rows to {os.path.join(args.out, 'attention.csv')}")


if __name__ == "__main__":
    main()
