"""Two-stream profile of Ring-DTP over the ranks of one host (rank 0's kernel
trace): where the ring's exposed time goes.

For each ring variant, one fwd+bwd of linear_cross_entropy(group=WORLD) under
torch.profiler, after warm-up; wall time is the median of --iters CUDA-event
timings. From the trace (NCCL kernels told apart by name):
  * NCCL kernel time, and how much of it ran while no compute kernel did
    (communication the schedule left exposed);
  * compute-stream idle: gaps between consecutive compute kernels, with the
    kernels on either side (the ring waiting on a transfer);
  * each GEMM kind's mean duration when an NCCL kernel overlapped most of it
    against when none did: NCCL's CTAs taking SMs from the GEMMs shows as a
    slowdown here even when no wait does.

  torchrun --nproc_per_node=2 benchmarks/profile_ring_dist.py --out DIR [--rings activations,weights]
Run it under different NCCL settings (e.g. NCCL_MAX_NCHANNELS) to compare;
the settings in effect are printed.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import moepeak  # noqa: E402
from _common import cuda_event_ms  # noqa: E402


def _kernels(prof):
    ks = []
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA") and getattr(ev, "time_range", None) is not None:
            if ev.name == "mp_step":
                continue
            ks.append((ev.time_range.start / 1000.0, ev.time_range.end / 1000.0, ev.name))
    ks.sort()
    return ks


def _union(iv):
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(a, b, union):
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union if y > a and x < b)


def analyse(ks, log):
    is_nccl = [("nccl" in n.lower()) for _, _, n in ks]
    comm = [(a, b) for (a, b, _), c in zip(ks, is_nccl) if c]
    comp = [(a, b, n) for (a, b, n), c in zip(ks, is_nccl) if not c]
    cu, mu = _union(comm), _union([(a, b) for a, b, _ in comp])
    t_comm = sum(b - a for a, b in cu)
    exposed = sum(b - a - _overlap(a, b, mu) for a, b in cu)
    span = max(b for _, b, _ in ks) - ks[0][0]
    t_comp = sum(b - a for a, b in mu)
    log(f"  span {span:.2f} ms: compute kernels busy {t_comp:.2f} ms, NCCL kernels {t_comm:.2f} ms "
        f"({len(comm)} kernels), NCCL with no compute beside it {exposed:.2f} ms")
    gaps, end, prev = [], comp[0][1], comp[0][2]
    for a, b, n in comp[1:]:
        if a > end:
            gaps.append((a - end, prev, n, _overlap(end, a, cu)))
        if b > end:
            end, prev = b, n
    log(f"  compute idle inside the span: {sum(g for g, *_ in gaps):.2f} ms in {len(gaps)} gaps "
        f"(of it with NCCL running: {sum(o for *_, o in gaps):.2f} ms); largest:")
    for g, a, b, o in sorted(gaps, reverse=True)[:6]:
        log(f"    {g:7.3f} ms (NCCL {o:6.3f})  after {a[:48]}  before {b[:48]}")
    kinds = {}
    for a, b, n in comp:
        if b - a < 0.05:
            continue
        f = _overlap(a, b, cu) / (b - a)
        kinds.setdefault(n[:60], ([], []))[0 if f > 0.5 else 1].append(b - a)
    log("  kernels >= 50 us, mean ms with NCCL overlapping > 50% | without  (count):")
    for n, (w, wo) in sorted(kinds.items(), key=lambda kv: -sum(kv[1][0] + kv[1][1])):
        mw = f"{statistics.mean(w):7.3f} ({len(w):3d})" if w else "      -      "
        mo = f"{statistics.mean(wo):7.3f} ({len(wo):3d})" if wo else "      -      "
        slow = f"  x{statistics.mean(w) / statistics.mean(wo):.3f}" if w and wo else ""
        log(f"    {mw} | {mo}{slow}  {n}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rings", default="activations,weights")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    rank, P = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    g = torch.Generator(device=dev).manual_seed(rank)
    T, H, V = a.tokens, a.hidden, a.vocab
    x = torch.randn(T, H, generator=g, device=dev).bfloat16().requires_grad_()
    w = (torch.randn(V // P, H, generator=g, device=dev) / math.sqrt(H)).bfloat16().requires_grad_()
    y = torch.randint(0, V, (T,), generator=g, device=dev)
    lines = []

    def log(s):
        if rank == 0:
            print(s, flush=True)
            lines.append(s)
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_") and k != "NCCL_ASYNC_ERROR_HANDLING"}
    log(f"{torch.cuda.get_device_name(dev)} x{P}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, "
        f"T/rank {T} H {H} V {V} bf16; NCCL env {env}")
    for variant in a.rings.split(","):
        def step():
            x.grad = w.grad = None
            moepeak.linear_cross_entropy(x, w, y, group=dist.group.WORLD, ring=variant).backward()
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        ts = []
        for _ in range(a.iters):
            dist.barrier(device_ids=[dev.index])
            ts.append(cuda_event_ms(step))
        dist.barrier(device_ids=[dev.index])
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        log(f"\n== ring={variant}: wall {statistics.median(ts):.2f} ms (median of {a.iters})")
        if rank == 0:
            analyse(_kernels(prof), log)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "profile_ring_dist.txt"), "a") as f:
            f.write("\n".join(lines) + "\n\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
