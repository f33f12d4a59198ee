"""Benchmark: the MoE layer's fwd+bwd peak memory and throughput.

One GPU (P = 1):   python benchmarks/bench_llep.py --out benchmarks/results [--quick]
  issue 26's P = 1 check (pipelined vs grouped_mm, summary with ratios at the end):
  python benchmarks/bench_llep.py --quick --tokens 16384,65536,262144 --arms grouped_mm,pipelined --iters 5
Two GPUs (P = 2):  torchrun --nproc-per-node 2 benchmarks/bench_llep.py --out benchmarks/results [--quick]
  issue 26's P = 2 check (pipelined vs standard EP, summary with ratios at the end):
  NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/bench_llep.py --tokens 8192,32768
      --arms standard_ep,pipelined --out benchmarks/results
  (--smoke runs the same arms on gloo CPU ranks at tiny shapes: code paths only)

Arms at P = 1 (same inputs, same process):
  hf_loop        Hugging Face-style loop over experts (one-hot mask, index_add)
  grouped_mm_hf  transformers' own Qwen3MoeExperts with experts_implementation="grouped_mm"
                 (transformers.integrations.moe.grouped_mm_experts_forward: sort, gather the
                 T*K*H expanded copy, grouped GEMMs on Hugging Face's [E, 2I, H] / [E, H, I]
                 weights, routing weights in the activation dtype as its router returns
                 them, un-permute, sum over K); the weights are copies of the bench's
  grouped_mm_titan  torchtitan's RoutedExperts (the MoE layer of
                 torchtitan.models.common.moe without its router: LocalTokenDispatcher +
                 GroupedExperts on w1/w3 [E, I, H], w2 [E, H, I]), fp32 routing scores as
                 its router returns them (its combine multiplies in fp32 and rounds to bf16,
                 then a deterministic scatter_add); "unavailable" where torchtitan does not
                 import
  grouped_mm_bf16w  the bench's own permute + torch._grouped_mm with the routing weights
                 in the activation dtype (no dependency)
  grouped_mm_fp32w  the same with fp32 routing weights: the [T*K, H] product is promoted
                 to fp32 (74.6 GiB at 256k). Named grouped_mm before issue 38; its rows
                 (arm "grouped_mm" in llep.csv) are superseded by the arms above
  moepeak_1chunk moepeak.llep_moe with chunk_rows = T*K (one chunk: unchunked)
  pipelined      moepeak.llep_moe with the default options: one chunk with h cached whole
                 where that peaks no higher than permute + grouped_mm
                 (llep.sizes.one_chunk_fits: 16k and 64k tokens at E = 128), else the
                 chunk budget with as many chunks' h cached as the room below that
                 layer's peak holds (llep.sizes.default_save_budget_mb: all 32 at 256k)
  pipelined_nocache  the same with save_budget_mb=0 (every chunk recomputed)
  pipelined_b1536    the same with save_budget_mb=1536 (the fixed cache of issues 6 and 26)
  pipelined_hf_layout    pipelined on grouped_mm_hf's weights (gate_up_proj and down_proj
                 through transpose(1, 2), as apply_moepeak passes them) and its bf16 weights
  pipelined_titan_layout pipelined on grouped_mm_titan's weights ((w1, w3) and w2 through
                 transpose(1, 2), as moepeak.titan passes them)
Issue 38's P = 1 check (E128 config, balanced and 95:4; fair arms; summary against the
faster of them at the end; about 2 minutes on an H200):
  python benchmarks/bench_llep.py --quick --tokens 16384,65536,262144
      --arms grouped_mm_hf,grouped_mm_titan,grouped_mm_bf16w,pipelined --iters 5 --out benchmarks/results
Arms at P = 2 (T tokens per rank):
  standard_ep    all_to_all_single dispatch/combine (torch.distributed.nn, autograd)
                 of the expanded rows, local grouped GEMMs
  llep_1chunk    LLEP plan, one chunk
  pipelined      PipelinedLLEP, default chunk budget (16384 rows at P > 1) and cache; the
                 step runs as one chunk (standard EP's one dispatch, grouped GEMM and
                 combine, h and grouped x kept for backward) when every rank's rows fit
                 the chunked working-set bound (llep.sizes.one_chunk_ep_rows); the
                 log line says which ("1 chunk" or "n chunks")
  pipelined_nocache  the same with save_budget_mb=0
  pipelined_c32k PipelinedLLEP with chunk_rows=32768 (the P = 1 default)
Imbalance "x:4": x% of tokens send all K picks to experts 0..3 (K > 4: experts
0..3 plus K-4 random others). Peak = max_memory_allocated - allocated before
the layer call (inputs and weights excluded; weight gradients included).
Timing: CUDA events, median (min-max) of the timed iterations; tokens/s =
T / median fwd+bwd time. P = 2: a barrier starts every timed call on all
ranks together; each statistic is the max over ranks. An OOM is a result.
--max-seconds: (T, routing) points not started within it are skipped (logged).

over 500 lines: every arm at P = 1 and P > 1 in one script, so that they run in one process on
the same routing and weights (docs/design.md section 4, benchmarks).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import append_results  # noqa: E402
from moepeak.llep import LLEPStats, llep_moe  # noqa: E402

# Every llep arm's calls fill this (forward and backward statistics of the last call).
LLEP_STATS = LLEPStats()


def llep_run(*args, **kw):
    """llep_moe, its statistics into LLEP_STATS."""
    return llep_moe(*args, stats=LLEP_STATS, **kw)

CONFIGS = {"E128_K4_H2880_I2880": (128, 4, 2880, 2880), "E256_K8_H7168_I2048": (256, 8, 7168, 2048)}
IMBALANCE = {"balanced": 0.0, "30:4": 0.30, "50:4": 0.50, "80:4": 0.80, "95:4": 0.95}


def make_routing(T, E, K, frac, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(T, E, device=device, generator=g).topk(K, dim=1).indices
    nh = int(round(frac * T))
    if nh:
        if K <= 4:
            hot = torch.rand(nh, 4, device=device, generator=g).topk(K, dim=1).indices
        else:
            rest = torch.rand(nh, E - 4, device=device, generator=g).topk(K - 4, dim=1).indices + 4
            hot = torch.cat([torch.arange(4, device=device).expand(nh, 4), rest], 1)
        ids[:nh] = hot
        ids = ids[torch.randperm(T, device=device, generator=g)]
    tw = torch.rand(T, K, device=device, generator=g)
    return ids, tw / tw.sum(1, keepdim=True)


# ---------------------------------------------------------------------------
# baselines (plain PyTorch, autograd)
# ---------------------------------------------------------------------------
def hf_loop(x, ids, tw, wgu, wd):
    E, I = wgu.shape[0], wd.shape[1]
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, E).permute(2, 1, 0)  # [E, K, T]
    hit = (mask.sum((-1, -2)) > 0).nonzero().flatten().tolist()
    for e in hit:
        k, t = torch.where(mask[e])
        h = x[t] @ wgu[e]
        o = (F.silu(h[:, :I]) * h[:, I:]) @ wd[e]
        out.index_add_(0, t, (o * tw[t, k, None]).to(x.dtype))
    return out


def _grouped(xs, W, counts):
    offs = counts.cumsum(0).to(torch.int32)
    return torch._grouped_mm(xs, W, offs=offs)


def grouped_mm_layer(x, ids, tw, wgu, wd):
    """Permute + torch._grouped_mm + index_add. The [T*K, H] expert outputs are multiplied
    by tw as given: fp32 tw promotes them to fp32 (the grouped_mm_fp32w arm), tw in x's
    dtype keeps them there (grouped_mm_bf16w)."""
    T, K = ids.shape
    E, I = wgu.shape[0], wd.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E)
    xs = x[order // K]                                    # [T*K, H] expanded copy
    h = _grouped(xs, wgu, counts)
    o = _grouped(F.silu(h[:, :I]) * h[:, I:], wd, counts)
    o = o * tw.flatten()[order, None]
    return torch.zeros_like(x).index_add(0, order // K, o.to(x.dtype))


RENAMED_ARMS = {"grouped_mm": "grouped_mm_fp32w (fp32 routing weights; superseded by grouped_mm_hf and "
                              "grouped_mm_titan, issue 38)"}


def hf_experts(E, K, H, I, wgu, wd):
    """transformers' Qwen3MoeExperts running its grouped_mm experts implementation, its
    weights copied from the bench's into Hugging Face's layout (gate_up_proj [E, 2I, H],
    rows [:I] gate and [I:] up; down_proj [E, H, I]). Called as experts(x, ids, tw) with tw
    in x's dtype (Qwen3MoeTopKRouter returns it so)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                         hidden_act="silu", experts_implementation="grouped_mm")
    cfg._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        experts = Qwen3MoeExperts(cfg)
    experts.gate_up_proj = torch.nn.Parameter(wgu.detach().transpose(1, 2).contiguous())
    experts.down_proj = torch.nn.Parameter(wd.detach().transpose(1, 2).contiguous())
    # use_experts_implementation's __init__ sets has_gate; without it forward is the eager loop
    if not hasattr(experts, "has_gate") or experts.config._experts_implementation != "grouped_mm":
        raise RuntimeError("this transformers' Qwen3MoeExperts has no grouped_mm experts implementation")
    return experts


def titan_experts(E, K, H, I, wgu, wd):
    """torchtitan's RoutedExperts (LocalTokenDispatcher + GroupedExperts: the MoE layer of
    torchtitan.models.common.moe without its router), w1 = gate [E, I, H], w3 = up
    [E, I, H], w2 = down [E, H, I] copied from the bench's weights. Called as in
    MoE.forward: experts(x [1, T, H], scores [1, T, K], ids [1, T, K], counts [E])."""
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    cfg = RoutedExperts.Config(inner_experts=GroupedExperts.Config(dim=H, hidden_dim=I, num_experts=E),
                               token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K))
    with torch.device("meta"):
        experts = cfg.build()
    inner = experts.inner_experts
    w = wgu.detach()
    inner.w1_EFD = torch.nn.Parameter(w[:, :, :I].transpose(1, 2).contiguous())
    inner.w3_EFD = torch.nn.Parameter(w[:, :, I:].transpose(1, 2).contiguous())
    inner.w2_EDF = torch.nn.Parameter(wd.detach().transpose(1, 2).contiguous())
    return experts


def titan_counts(ids, E):
    """Tokens per expert as torchtitan's MoE.forward counts them (a boolean routing map
    [T, E], summed over tokens)."""
    routing_map = torch.zeros(ids.shape[0], E, dtype=torch.bool, device=ids.device).scatter_(-1, ids, True)
    return routing_map.sum(dim=0)


def p1_modules(arms, E, K, H, I, wgu, wd):
    """The Hugging Face and torchtitan modules the requested P = 1 arms run, built once per
    config: {"hf": module or the import/build error (str), "titan": ...}."""
    need = {"hf": any(a in arms for a in ("grouped_mm_hf", "pipelined_hf_layout")),
            "titan": any(a in arms for a in ("grouped_mm_titan", "pipelined_titan_layout"))}
    mods = {}
    for key, build in (("hf", hf_experts), ("titan", titan_experts)):
        if need[key]:
            try:
                mods[key] = build(E, K, H, I, wgu, wd)
            except Exception as err:  # an optional baseline: its rows say why it did not run
                mods[key] = f"unavailable: {type(err).__name__}: {str(err).splitlines()[0][:60]}"
    return mods


def p1_arm_fns(mods, x, ids, tw, tw_act, wgu, wd, T, K):
    """{arm: (fn, leaves)} at P = 1: fn() runs the layer's forward, leaves are the tensors
    whose .grad each measurement clears; an arm whose module is unavailable maps to its
    status string."""
    E = wgu.shape[0]
    fns = {
        "hf_loop": (lambda: hf_loop(x, ids, tw, wgu, wd), [x, tw, wgu, wd]),
        "grouped_mm_fp32w": (lambda: grouped_mm_layer(x, ids, tw, wgu, wd), [x, tw, wgu, wd]),
        "grouped_mm_bf16w": (lambda: grouped_mm_layer(x, ids, tw_act, wgu, wd), [x, tw_act, wgu, wd]),
        "moepeak_1chunk": (lambda: llep_run(x, ids, tw, wgu, wd, chunk_rows=max(T * K, 1)), [x, tw, wgu, wd]),
        "pipelined": (lambda: llep_run(x, ids, tw, wgu, wd), [x, tw, wgu, wd]),
        # the same without the activation cache: backward recomputes every chunk
        "pipelined_nocache": (lambda: llep_run(x, ids, tw, wgu, wd, save_budget_mb=0), [x, tw, wgu, wd]),
        "pipelined_b1536": (lambda: llep_run(x, ids, tw, wgu, wd, save_budget_mb=1536), [x, tw, wgu, wd]),
    }
    hf = mods.get("hf")
    if isinstance(hf, str):
        fns["grouped_mm_hf"] = fns["pipelined_hf_layout"] = hf
    elif hf is not None:
        hw = [hf.gate_up_proj, hf.down_proj]
        fns["grouped_mm_hf"] = (lambda: hf(x, ids, tw_act), [x, tw_act] + hw)
        fns["pipelined_hf_layout"] = (lambda: llep_run(x, ids, tw_act, hf.gate_up_proj.transpose(1, 2),
                                                       hf.down_proj.transpose(1, 2)), [x, tw_act] + hw)
    titan = mods.get("titan")
    if isinstance(titan, str):
        fns["grouped_mm_titan"] = fns["pipelined_titan_layout"] = titan
    elif titan is not None:
        inner = titan.inner_experts
        tw3 = [inner.w1_EFD, inner.w2_EDF, inner.w3_EFD]
        counts = titan_counts(ids, E)

        def titan_fn():
            return titan(x.view(1, T, -1), tw.view(1, T, K), ids.view(1, T, K), counts).view(T, -1)

        fns["grouped_mm_titan"] = (titan_fn, [x, tw] + tw3)
        fns["pipelined_titan_layout"] = (
            lambda: llep_run(x, ids, tw, (inner.w1_EFD.transpose(1, 2), inner.w3_EFD.transpose(1, 2)),
                             inner.w2_EDF.transpose(1, 2)), [x, tw] + tw3)
    return fns


def standard_ep(x, ids, tw, wgu, wd, group):
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn
    P, El = dist.get_world_size(group), wgu.shape[0]
    T, K = ids.shape
    I = wd.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=El * P)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    send_split = counts.view(P, El).sum(1).tolist()
    rc = recv_counts.view(P, El)
    recv_split = rc.sum(1).tolist()
    xs = x[order // K]
    xr = dnn.all_to_all_single(x.new_empty(sum(recv_split), x.shape[1]), xs, recv_split, send_split, group=group)
    eid = torch.repeat_interleave(torch.arange(El, device=x.device).repeat(P), rc.flatten())
    o2 = eid.argsort(stable=True)
    xg = xr[o2]
    ecount = rc.sum(0)
    h = _grouped(xg, wgu, ecount)
    og = _grouped(F.silu(h[:, :I]) * h[:, I:], wd, ecount)
    orr = torch.empty_like(og).index_copy(0, o2, og)
    back = dnn.all_to_all_single(x.new_empty(xs.shape[0], x.shape[1]), orr, send_split, recv_split, group=group)
    back = back * tw.flatten()[order, None]
    return torch.zeros_like(x).index_add(0, order // K, back.to(x.dtype))


def one_chunk_rows(ids, E, group, P):
    """The smallest chunk budget that gives LLEP a single chunk for this
    routing: P * max over pairs of rows sent (so buffers are sized by the
    actual busiest pair, not by the worst case)."""
    import torch.distributed as dist
    from moepeak.llep import plan as lp
    cnt = torch.bincount(ids.flatten(), minlength=E)
    loads = [torch.empty_like(cnt) for _ in range(P)]
    dist.all_gather(loads, cnt, group=group)
    plan = lp.llep_plan(torch.stack(loads).cpu(), 1.0, 1024, 1.3)
    return max(P * int(plan.S.max()), P)


# ---------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------
def _measure(fn, leaves, gy, iters, warmup):
    if not gy.is_cuda:  # --smoke: check the code paths on CPU, no numbers
        y = fn()
        y.backward(gy)
        return 0, [0.0]
    times = []
    peak = 0
    for it in range(warmup + iters):
        for p in leaves:
            p.grad = None
        gc.collect()
        torch.cuda.synchronize()
        if _dist_on():  # every rank starts the timed call together: no rank times another's lag
            import torch.distributed as dist
            dist.barrier()
            torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y = fn()
        y.backward(gy)
        e.record()
        torch.cuda.synchronize()
        peak = max(peak, torch.cuda.max_memory_allocated() - before)
        del y
        if it >= warmup:
            times.append(s.elapsed_time(e))
    return peak, times


def _dist_on() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def run_arm(name, fn, leaves, gy, iters, warmup):
    """One arm's peak and times as a result dict (status "ok", "OOM" or "error: ...")."""
    try:
        peak, times = _measure(fn, leaves, gy, iters, warmup)
        return dict(status="ok", peak_gib=peak / 2 ** 30, ms=statistics.median(times), ms_min=min(times),
                    ms_max=max(times))
    except torch.cuda.OutOfMemoryError:
        return dict(status="OOM", peak_gib=float("nan"), ms=float("nan"), ms_min=float("nan"), ms_max=float("nan"))
    except RuntimeError as err:  # e.g. grouped_mm unavailable
        msg = str(err).splitlines()[0][:80]
        status = "OOM" if "out of memory" in msg else f"error: {msg}"
        return dict(status=status, peak_gib=float("nan"), ms=float("nan"), ms_min=float("nan"),
                    ms_max=float("nan"))
    finally:
        for p in leaves:
            p.grad = None
        gc.collect()
        if gy.is_cuda:
            torch.cuda.empty_cache()


P1_ARMS = ("hf_loop", "grouped_mm_hf", "grouped_mm_titan", "grouped_mm_bf16w", "grouped_mm_fp32w", "moepeak_1chunk",
           "pipelined", "pipelined_nocache", "pipelined_b1536", "pipelined_hf_layout", "pipelined_titan_layout")
P2_ARMS = ("standard_ep", "llep_1chunk", "pipelined", "pipelined_nocache", "pipelined_c32k")
# The grouped arms of the fair comparison (issue 38): routing weights as the library's own router returns them.
FAIR_ARMS = ("grouped_mm_hf", "grouped_mm_titan", "grouped_mm_bf16w")


def select_arms(spec, P, quick):
    """The arms to run, in order: --arms (checked against the arms of this P), else the defaults."""
    known = P1_ARMS if P == 1 else P2_ARMS
    if not spec:
        if P > 1:
            return list(P2_ARMS)
        base = ["grouped_mm_hf", "grouped_mm_titan", "pipelined"]
        return base if quick else ["hf_loop"] + base + ["grouped_mm_bf16w", "moepeak_1chunk", "pipelined_nocache"]
    arms = [a for a in spec.split(",") if a]
    for a in arms:
        if a in RENAMED_ARMS and a not in known:
            raise SystemExit(f"--arms: {a!r} is now {RENAMED_ARMS[a]}")
        if a not in known:
            raise SystemExit(f"--arms: {a!r} is not an arm at P = {P}; expected some of {', '.join(known)}")
    return arms


def _over_budget(t_start, max_seconds, dist_mode, dev):
    """Whether the run has used up --max-seconds (agreed over the ranks: all stop together)."""
    if max_seconds is None:
        return False
    over = time.monotonic() - t_start > max_seconds
    if dist_mode:
        import torch.distributed as dist
        flag = torch.tensor([float(over)], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        over = bool(flag.item())
    return over


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for llep.csv (appended after every point)")
    ap.add_argument("--quick", action="store_true", help="E=128 config, T in {16k, 256k}, balanced and 95:4")
    ap.add_argument("--tokens", default=None, help="comma-separated T per rank (default 16k,64k,256k)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--arms", default=None, help="comma-separated subset of arms")
    ap.add_argument("--routing", default=None,
                    help=f"comma-separated routings of {', '.join(IMBALANCE)} (default: all; --quick: balanced,95:4)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="skip the (T, routing) points not started within this many seconds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (gloo under torchrun): code paths only")
    args = ap.parse_args()
    t_start = time.monotonic()

    dist_mode = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    group, rank, P = None, 0, 1
    if dist_mode:
        import torch.distributed as dist
        dist.init_process_group("gloo" if args.smoke else "nccl")
        rank, P = dist.get_rank(), dist.get_world_size()
        if not args.smoke:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        group = dist.group.WORLD
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.bfloat16
    configs = {"E128_K4_H2880_I2880": CONFIGS["E128_K4_H2880_I2880"]} if args.quick else CONFIGS
    if args.smoke:
        configs = {"smoke_E8_K4_H16_I16": (8, 4, 16, 16), "smoke_E8_K6_H16_I8": (8, 6, 16, 8)}
        args.tokens = args.tokens or "64,100"
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    else:
        tokens = [16384, 262144] if args.quick else [16384, 65536, 262144]
        if P > 1 and not args.tokens:
            tokens = [8192, 32768]
    imb = {k: IMBALANCE[k] for k in ("balanced", "95:4")} if args.quick else IMBALANCE
    if args.routing:
        bad = [k for k in args.routing.split(",") if k not in IMBALANCE]
        if bad:
            raise SystemExit(f"--routing: {bad} not among {', '.join(IMBALANCE)}")
        imb = {k: IMBALANCE[k] for k in args.routing.split(",")}
    iters = args.iters or (2 if args.quick else 5) + (4 if P > 1 else 0)
    warmup = 1
    arms = select_arms(args.arms, P, args.quick)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"

    meta = dict(P=P, dtype="bf16")
    rows, flushed, skipped = [], 0, []
    for cname, (E, K, H, I) in configs.items():
        El = E // P
        g = torch.Generator(device=dev).manual_seed(1234 + rank)
        wgu = (torch.randn(El, H, 2 * I, device=dev, dtype=dtype, generator=g) * H ** -0.5).requires_grad_()
        wd = (torch.randn(El, I, H, device=dev, dtype=dtype, generator=g) * I ** -0.5).requires_grad_()
        mods = p1_modules(arms, E, K, H, I, wgu, wd) if P == 1 else {}
        for T in tokens:
            for iname, frac in imb.items():
                if _over_budget(t_start, args.max_seconds, dist_mode, dev):
                    skipped.append(f"{cname} T={T} {iname}")
                    continue
                ids, tw0 = make_routing(T, E, K, frac, dev, seed=T + rank)
                x = torch.randn(T, H, device=dev, dtype=dtype).requires_grad_()
                tw = tw0.clone().requires_grad_()
                tw_act = tw0.to(dtype).requires_grad_()  # as Hugging Face's router returns it
                gy = torch.randn(T, H, device=dev, dtype=dtype)
                if P == 1:
                    fns = p1_arm_fns(mods, x, ids, tw, tw_act, wgu, wd, T, K)
                else:
                    c1 = one_chunk_rows(ids, E, group, P)
                    fns = {
                        "standard_ep": (lambda: standard_ep(x, ids, tw, wgu, wd, group), [x, tw, wgu, wd]),
                        "llep_1chunk": (lambda: llep_run(x, ids, tw, wgu, wd, group=group, chunk_rows=c1),
                                        [x, tw, wgu, wd]),
                        "pipelined": (lambda: llep_run(x, ids, tw, wgu, wd, group=group), [x, tw, wgu, wd]),
                        "pipelined_nocache": (lambda: llep_run(x, ids, tw, wgu, wd, group=group, save_budget_mb=0),
                                              [x, tw, wgu, wd]),
                        # P = 1's chunk budget at P = 2 (twice the default working set)
                        "pipelined_c32k": (lambda: llep_run(x, ids, tw, wgu, wd, group=group, chunk_rows=32768),
                                           [x, tw, wgu, wd]),
                    }
                if args.smoke:  # the arms compute the same layer
                    with torch.no_grad():
                        outs = {a: fns[a][0]().float() for a in arms if not isinstance(fns[a], str)}
                    first = next(iter(outs.values()))
                    for a, o in outs.items():
                        err = (o - first).abs().max().item()
                        assert err <= 3e-2 * first.abs().max().item() + 1e-3, f"{a} differs by {err}"
                for arm in arms:
                    LLEP_STATS.forward, LLEP_STATS.backward = {}, {}
                    if isinstance(fns[arm], str):  # its library did not import or build
                        nan = float("nan")
                        res = dict(status=fns[arm], peak_gib=nan, ms=nan, ms_min=nan, ms_max=nan)
                    else:
                        res = run_arm(arm, fns[arm][0], fns[arm][1], gy, iters, warmup)
                    n_chunks = LLEP_STATS.backward.get("n_chunks")  # the last llep call's (its backward)
                    if P > 1:  # max over ranks
                        import torch.distributed as dist
                        v = torch.tensor([res["peak_gib"], res["ms"], res["ms_min"], res["ms_max"],
                                          float(res["status"] != "ok")], device=dev)
                        dist.all_reduce(v, op=dist.ReduceOp.MAX)
                        res["peak_gib"], res["ms"], res["ms_min"], res["ms_max"] = (float(t) for t in v[:4])
                        if v[4] > 0 and res["status"] == "ok":
                            res["status"] = "failed on another rank"
                    tps = T / (res["ms"] / 1e3) if res["status"] == "ok" and res["ms"] > 0 else float("nan")
                    row = dict(meta, config=cname, T=T, imbalance=iname, arm=arm, status=res["status"],
                               peak_gib=round(res["peak_gib"], 3), ms_fwd_bwd=round(res["ms"], 2),
                               ms_min=round(res["ms_min"], 2), ms_max=round(res["ms_max"], 2),
                               tokens_per_s=round(tps) if tps == tps else float("nan"))
                    rows.append(row)
                    if rank == 0:
                        path = "" if n_chunks is None else f"  {n_chunks} chunk{'s' if n_chunks != 1 else ''}"
                        print(f"{cname:22s} T={T:7d} {iname:8s} {arm:15s} {res['status']:6s} "
                              f"peak {res['peak_gib']:7.2f} GiB  {res['ms']:9.1f} ms "
                              f"({res['ms_min']:.1f}-{res['ms_max']:.1f})  {tps:12.0f} tok/s{path}", flush=True)
                x = tw = tw_act = gy = ids = fns = None  # free now (the timing closures still name them)
                if rank == 0 and args.out:  # per point, so a run cut short keeps what it measured
                    append_results(args.out, "llep", rows[flushed:], gpu=gpu)
                    flushed = len(rows)
        wgu = wd = mods = None  # free now (the timing closures still name them)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    if rank == 0:
        if skipped:
            print(f"\n--max-seconds {args.max_seconds:.0f}: skipped {len(skipped)} points: {'; '.join(skipped)}")
        _summary(rows)
        _vs_grouped_mm(rows)
        _vs_standard_ep(rows)
        if args.out:
            print(f"appended {len(rows)} rows to {os.path.join(args.out, 'llep.csv')}")
    if dist_mode:
        import torch.distributed as dist
        dist.destroy_process_group()


def _summary(rows):
    """Per (config, T): pipelined peak spread across imbalance configs."""
    print("\npipelined peak across imbalance (max/min - 1):")
    keys = sorted({(r["config"], r["T"]) for r in rows})
    for c, T in keys:
        peaks = [r["peak_gib"] for r in rows if r["config"] == c and r["T"] == T and r["arm"] == "pipelined"
                 and r["status"] == "ok"]
        if len(peaks) > 1 and min(peaks) > 0:
            print(f"  {c} T={T}: {min(peaks):.2f}-{max(peaks):.2f} GiB ({100 * (max(peaks) / min(peaks) - 1):.1f}%)")


def _vs_grouped_mm(rows, max_time_ratio=1.02):
    """Per (config, T, imbalance) at P = 1: each pipelined arm against each fair grouped arm
    present and against the faster of them, time and peak ratios, with issue 38's targets
    (time <= 1.02x and peak <= 1.0x the faster fair arm's). The fp32-weights arm is listed
    for reference only (superseded)."""
    by = {(r["config"], r["T"], r["imbalance"], r["arm"]): r for r in rows if r["P"] == 1 and r["status"] == "ok"
          and r["ms_fwd_bwd"] > 0 and r["peak_gib"] > 0}  # CPU smoke runs measure neither
    pipes = ("pipelined", "pipelined_hf_layout", "pipelined_titan_layout")
    refs = FAIR_ARMS + ("grouped_mm_fp32w",)
    keys = sorted({k[:3] for k in by if k[3] in pipes})
    lines = []
    for k in keys:
        fair = [by[k + (a,)] for a in FAIR_ARMS if k + (a,) in by]
        best = min(fair, key=lambda r: r["ms_fwd_bwd"]) if fair else None
        for p in (by[k + (a,)] for a in pipes if k + (a,) in by):
            for g in (by[k + (a,)] for a in refs if k + (a,) in by):
                tr, pr = p["ms_fwd_bwd"] / g["ms_fwd_bwd"], p["peak_gib"] / g["peak_gib"]
                mark = ""
                if g is best:
                    mark = "  faster fair arm: " + ("PASS" if tr <= max_time_ratio and pr <= 1.0 else "FAIL")
                lines.append(f"  {k[0]} T={k[1]:7d} {k[2]:8s} {p['arm']:22s} vs {g['arm']:16s} "
                             f"time {tr:.3f}x  peak {pr:.3f}x{mark}")
    if lines:
        print(f"\npipelined vs the grouped arms (issue 38 targets against the faster fair arm: "
              f"time <= {max_time_ratio}x, peak <= 1.0x):")
        print("\n".join(lines))


def _vs_standard_ep(rows):
    """Per (config, T, imbalance) at P > 1: pipelined vs standard_ep, time
    and peak ratios, against issue 26's P > 1 target (throughput >= standard
    EP's: time <= 1.0x) and the peak flat across imbalance (_summary)."""
    by = {(r["config"], r["T"], r["imbalance"], r["arm"]): r for r in rows if r["P"] > 1 and r["status"] == "ok"}
    keys = sorted({k[:3] for k in by if k[3] == "pipelined" and k[:3] + ("standard_ep",) in by})
    if not keys:
        return
    print("\npipelined vs standard_ep (target: time <= 1.0x):")
    for k in keys:
        p, s = by[k + ("pipelined",)], by[k + ("standard_ep",)]
        if not (s["ms_fwd_bwd"] > 0 and s["peak_gib"] > 0):  # CPU smoke runs measure neither
            continue
        tr, pr = p["ms_fwd_bwd"] / s["ms_fwd_bwd"], p["peak_gib"] / s["peak_gib"]
        print(f"  {k[0]} T={k[1]:7d} {k[2]:8s} time {tr:.3f}x  peak {pr:.3f}x  {'PASS' if tr <= 1.0 else 'FAIL'}")


if __name__ == "__main__":
    main()
