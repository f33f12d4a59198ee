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
  grouped_mm     permute rows by expert (the T*K*H expanded copy) + torch._grouped_mm
  moepeak_1chunk moepeak.llep_moe with chunk_rows = T*K (one chunk: unchunked)
  pipelined      moepeak.llep_moe with the default chunk budget (and the default
                 1536 MiB activation cache: backward skips the first chunks' recompute;
                 one chunk with h cached whole where that peaks no higher than
                 grouped_mm, llep_workspace.one_chunk_fits: 16k tokens at E = 128)
  pipelined_nocache  the same with save_budget_mb=0 (every chunk recomputed)
Arms at P = 2 (T tokens per rank):
  standard_ep    all_to_all_single dispatch/combine (torch.distributed.nn, autograd)
                 of the expanded rows, local grouped GEMMs
  llep_1chunk    LLEP plan, one chunk
  pipelined      PipelinedLLEP, default chunk budget (16384 rows at P > 1) and cache; the
                 step runs as one chunk (standard EP's one dispatch, grouped GEMM and
                 combine, h and grouped x kept for backward) when every rank's rows fit
                 the chunked working-set bound (llep_workspace.one_chunk_ep_rows); the
                 log line says which ("1 chunk" or "n chunks")
  pipelined_nocache  the same with save_budget_mb=0
  pipelined_c32k PipelinedLLEP with chunk_rows=32768 (the P = 1 default)
Imbalance "x:4": x% of tokens send all K picks to experts 0..3 (K > 4: experts
0..3 plus K-4 random others). Peak = max_memory_allocated - allocated before
the layer call (inputs and weights excluded; weight gradients included).
Timing: CUDA events, median (min-max) of the timed iterations; tokens/s =
T / median fwd+bwd time. P = 2: a barrier starts every timed call on all
ranks together; each statistic is the max over ranks. An OOM is a result.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import append_results  # noqa: E402
from moepeak import llep_sched  # noqa: E402
from moepeak.llep import llep_moe  # noqa: E402

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
    from moepeak import llep_plan as lp
    cnt = torch.bincount(ids.flatten(), minlength=E)
    loads = [torch.empty_like(cnt) for _ in range(P)]
    dist.all_gather(loads, cnt, group=group)
    plan = lp.llep_plan(torch.stack(loads).cpu(), 1.0, 1024, 1.3)
    return max(P * int(plan.S.max()), P)


# ---------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------
def _measure(fn, x, tw, params, gy, iters, warmup):
    if not x.is_cuda:  # --smoke: check the code paths on CPU, no numbers
        y = fn()
        y.backward(gy)
        return 0, [0.0]
    times = []
    peak = 0
    for it in range(warmup + iters):
        for p in params + [x, tw]:
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


def run_arm(name, fn, x, tw, params, gy, iters, warmup):
    try:
        peak, times = _measure(fn, x, tw, params, gy, iters, warmup)
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
        for p in params + [x, tw]:
            p.grad = None
        gc.collect()
        if x.is_cuda:
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for llep.csv (appended)")
    ap.add_argument("--quick", action="store_true", help="E=128 config, T in {16k, 256k}, balanced and 95:4")
    ap.add_argument("--tokens", default=None, help="comma-separated T per rank (default 16k,64k,256k)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--arms", default=None, help="comma-separated subset of arms")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (gloo under torchrun): code paths only")
    args = ap.parse_args()

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
    iters = args.iters or (2 if args.quick else 5) + (4 if P > 1 else 0)
    warmup = 1
    if P == 1:
        arms = {"hf_loop": None, "grouped_mm": None, "moepeak_1chunk": None, "pipelined": None,
                "pipelined_nocache": None}
    else:
        arms = {"standard_ep": None, "llep_1chunk": None, "pipelined": None, "pipelined_nocache": None,
                "pipelined_c32k": None}
    if args.arms:
        arms = {a: None for a in args.arms.split(",")}

    meta = dict(P=P, dtype="bf16")
    rows, flushed = [], 0
    for cname, (E, K, H, I) in configs.items():
        El = E // P
        g = torch.Generator(device=dev).manual_seed(1234 + rank)
        wgu = (torch.randn(El, H, 2 * I, device=dev, dtype=dtype, generator=g) * H ** -0.5).requires_grad_()
        wd = (torch.randn(El, I, H, device=dev, dtype=dtype, generator=g) * I ** -0.5).requires_grad_()
        for T in tokens:
            for iname, frac in imb.items():
                ids, tw0 = make_routing(T, E, K, frac, dev, seed=T + rank)
                x = torch.randn(T, H, device=dev, dtype=dtype).requires_grad_()
                tw = tw0.clone().requires_grad_()
                gy = torch.randn(T, H, device=dev, dtype=dtype)
                fns = {
                    "hf_loop": lambda: hf_loop(x, ids, tw, wgu, wd),
                    "grouped_mm": lambda: grouped_mm_layer(x, ids, tw, wgu, wd),
                    "moepeak_1chunk": lambda: llep_moe(x, ids, tw, wgu, wd, chunk_rows=max(T * K, 1)),
                    "pipelined": lambda: llep_moe(x, ids, tw, wgu, wd, group=group),
                    # the same without the activation cache: backward recomputes every chunk
                    "pipelined_nocache": lambda: llep_moe(x, ids, tw, wgu, wd, group=group, save_budget_mb=0),
                    "standard_ep": lambda: standard_ep(x, ids, tw, wgu, wd, group),
                    "llep_1chunk": lambda: llep_moe(x, ids, tw, wgu, wd, group=group, chunk_rows=c1),
                    # P = 1's chunk budget at P = 2 (twice the default working set)
                    "pipelined_c32k": lambda: llep_moe(x, ids, tw, wgu, wd, group=group, chunk_rows=32768),
                }
                c1 = one_chunk_rows(ids, E, group, P) if P > 1 else None
                if args.smoke:  # the arms compute the same layer
                    with torch.no_grad():
                        outs = {a: fns[a]().float() for a in arms}
                    first = next(iter(outs.values()))
                    for a, o in outs.items():
                        err = (o - first).abs().max().item()
                        assert err <= 3e-2 * first.abs().max().item() + 1e-3, f"{a} differs by {err}"
                for arm in arms:
                    llep_sched.LAST_STATS.clear()
                    res = run_arm(arm, fns[arm], x, tw, [wgu, wd], gy, iters, warmup)
                    n_chunks = llep_sched.LAST_STATS.get("n_chunks")  # the last llep call's (its backward)
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
                del x, tw, gy, ids
        del wgu, wd
        if rank == 0 and args.out:  # per config, so a run cut short keeps what it measured
            append_results(args.out, "llep", rows[flushed:], gpu=torch.cuda.get_device_name() if dev.type == "cuda"
                           else "cpu")
            flushed = len(rows)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    if rank == 0:
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
    """Per (config, T, imbalance) at P = 1: pipelined vs grouped_mm, time and
    peak ratios, against issue 26's targets (time <= 1.02x, peak <= 1.0x)."""
    by = {(r["config"], r["T"], r["imbalance"], r["arm"]): r for r in rows if r["P"] == 1 and r["status"] == "ok"}
    keys = sorted({k[:3] for k in by if k[3] == "pipelined" and k[:3] + ("grouped_mm",) in by})
    if not keys:
        return
    print(f"\npipelined vs grouped_mm (targets: time <= {max_time_ratio}x, peak <= 1.0x):")
    for k in keys:
        p, g = by[k + ("pipelined",)], by[k + ("grouped_mm",)]
        if not (g["ms_fwd_bwd"] > 0 and g["peak_gib"] > 0):  # CPU smoke runs measure neither
            continue
        tr, pr = p["ms_fwd_bwd"] / g["ms_fwd_bwd"], p["peak_gib"] / g["peak_gib"]
        ok = "PASS" if tr <= max_time_ratio and pr <= 1.0 else "FAIL"
        print(f"  {k[0]} T={k[1]:7d} {k[2]:8s} time {tr:.3f}x  peak {pr:.3f}x  {ok}")


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
