"""SCO benchmark: peak GPU memory and step time of a stack of L blocks
(RMSNorm + 4H MLP, bf16, H = 4096) at T tokens, four arms in one process:

  none      no checkpointing
  ckpt      torch.utils.checkpoint(use_reentrant=False) per block
  ckpt_cpu  the same inside torch.autograd.graph.save_on_cpu(pin_memory=True)
  sco       moepeak.sco_checkpoint per block (last block's input kept on GPU)
  sco_disk  the same with the disk tier: half the offloaded boundaries (the earliest) in a
            spill file in --spill-dir (only with --spill-dir; a tmpfs there measures RAM, not disk)

Peak = max_memory_allocated during timed steps minus the memory allocated
before them (weights + their grads + input + output gradient), so it is the
activation/boundary peak. Step = forward + backward, CUDA events, median over
--iters after --warmup steps. An OOM (GPU or pinned host memory) is a result.
Sizes worked once: boundary = T·H·2 B = 32768·4096·2 = 256 MiB at T = 32k
(1 GiB at 128k); block weights = 8·H²·2 B = 256 MiB (+ as much for grads).

  python benchmarks/bench_sco.py --out benchmarks/results --quick   # T=32k, L in {8, 32}
  python benchmarks/bench_sco.py --out benchmarks/results --T 131072 --L 8 16 32 48
  python benchmarks/bench_sco.py --quick --spill-dir /local/nvme   # adds the sco_disk arm
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings

import torch
import torch.utils.checkpoint as tuc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import append_results  # noqa: E402
import moepeak  # noqa: E402
from moepeak.sco import SCOConfig, SCOOffloader, sizes  # noqa: E402
from tests.refs import SCOBlock  # noqa: E402

GiB = float(1 << 30)
ARMS = ("none", "ckpt", "ckpt_cpu", "sco", "sco_disk")


def _host_empty_cache():
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            try:
                fn()
            except Exception:
                pass
            return


def _cleanup():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _host_empty_cache()


def make_stack(L, H, dtype):
    with torch.device("cuda"):  # init each block in fp32 on the GPU, then cast it (no fp32 stack)
        return torch.nn.ModuleList([SCOBlock(H, attention=False).to(dtype) for _ in range(L)])


def step(blocks, x, g, arm, sco):
    h = x
    if arm == "none":
        for b in blocks:
            h = b(h)
    elif arm == "ckpt":
        for b in blocks:
            h = tuc.checkpoint(b, h, use_reentrant=False)
    elif arm == "ckpt_cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            for b in blocks:
                h = tuc.checkpoint(b, h, use_reentrant=False)
    elif arm in ("sco", "sco_disk"):
        for i, b in enumerate(blocks):
            h = moepeak.sco_checkpoint(b, h, sco_offloader=sco, sco_block_from_end=len(blocks) - 1 - i)
    else:
        raise ValueError(arm)
    h.backward(g)


def run_arm(blocks, T, H, arm, warmup, iters, spill_dir=None):
    """Returns dict(status, peak_gib, step_ms list)."""
    L = len(blocks)
    sco = None
    boundary = sizes.boundary_bytes(T, H, 2)
    if arm == "sco":  # exact arena: L-1 boundaries (the last stays on the GPU)
        arena = sizes.arena_bytes(L, 1, boundary)
        sco = SCOOffloader(SCOConfig(max_in_flight=2, prefetch=1, keep_last=1, arena_bytes=arena))
    elif arm == "sco_disk":  # host room for half the offloaded boundaries, the earliest on disk
        budget = sizes.offloaded_blocks(L, 1) // 2 * sizes.slot_bytes(boundary)
        sco = SCOOffloader(SCOConfig(keep_last=1, arena_bytes=budget, spill_dir=spill_dir, host_budget_bytes=budget))
    res = {"status": "ok", "peak_gib": float("nan"), "ms": []}
    x = g = None
    caught = []
    warn_ctx = warnings.catch_warnings(record=True)  # names the arm a (once-per-process) torch warning came from
    try:
        caught = warn_ctx.__enter__()
        warnings.simplefilter("always")
        x = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16)
        for _ in range(warmup):  # also allocates grads and (sco) the arena
            step(blocks, x, g, arm, sco)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        st0 = sco.stats("cuda") if sco is not None else None
        for _ in range(iters):
            for p in blocks.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            step(blocks, x, g, arm, sco)
            e1.record()
            e1.synchronize()
            res["ms"].append(e0.elapsed_time(e1))
        torch.cuda.synchronize()
        res["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GiB
        if sco is not None:  # timed steps must not grow the pinned arena or create events
            st1 = sco.stats("cuda")
            grew = {k: st1[k] - st0[k] for k in ("arena_chunks", "events_created") if st1[k] != st0[k]}
            if grew:
                print(f"  [{arm}] WARNING: timed steps allocated {grew}", file=sys.stderr)
            if arm == "sco_disk":
                print(f"  [{arm}] spilled {st1['spilled'] - st0['spilled']} boundaries, O_DIRECT "
                      f"{st1['spill_direct']}", file=sys.stderr)
    except torch.cuda.OutOfMemoryError:
        res["status"] = "oom"
    except RuntimeError as e:  # e.g. torch's pinned host allocator: "CUDA error: out of memory"
        if "out of memory" not in str(e):
            raise
        res["status"] = "oom"
        print(f"  [{arm}] {str(e).splitlines()[0]}", file=sys.stderr)
    except OSError as e:  # the spill directory: no room (ENOSPC) or an I/O error
        res["status"] = "disk_error"
        print(f"  [{arm}] {e}", file=sys.stderr)
    except MemoryError as e:  # pinned host arena
        res["status"] = "host_oom"
        print(f"  [{arm}] {e}", file=sys.stderr)
    finally:
        warn_ctx.__exit__(None, None, None)
        for w in {str(w.message) for w in caught}:
            print(f"  [{arm}] warning: {w}", file=sys.stderr)
        del x, g
        for p in blocks.parameters():
            p.grad = None
        gc.collect()
        if sco is not None:
            try:
                sco.free()
            except RuntimeError as e:
                print(f"  [{arm}] arena not freed: {e}", file=sys.stderr)
        _cleanup()
    return res


def reach(T, H, max_L=512):
    """Largest L (doubling from 8) at which one step of ckpt / sco runs. Host RAM
    bounds SCO too: its arena holds (L-1)·T·H·2 bytes pinned."""
    for arm in ("ckpt", "sco"):
        best, L = 0, 8
        while L <= max_L:
            try:
                blocks = make_stack(L, H, torch.bfloat16)
            except torch.cuda.OutOfMemoryError:
                _cleanup()
                print(f"reach T={T} {arm}: weights of L={L} do not fit")
                break
            r = run_arm(blocks, T, H, arm, warmup=1, iters=1)
            del blocks
            _cleanup()
            print(f"reach T={T} L={L} {arm}: {r['status']}", flush=True)
            if r["status"] != "ok":
                break
            best, L = L, 2 * L
        print(f"reach T={T} {arm}: max L ok = {best} (depth x tokens = {best * T})", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory; rows appended to OUT/sco.csv")
    ap.add_argument("--quick", action="store_true", help="T=32k, L in {8, 32} (< 2 min on an H200)")
    ap.add_argument("--T", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--L", type=int, nargs="+", default=[8, 16, 32, 48])
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--arms", nargs="+", default=None, choices=ARMS,
                    help="default: every arm, sco_disk only with --spill-dir")
    ap.add_argument("--spill-dir", default=None, help="a directory on a local disk for the sco_disk arm")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--reach", action="store_true",
                    help="optional probe: at T = first --T, double L from 8 until ckpt / sco fail (one step each)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sco needs a CUDA GPU")
    if a.quick:
        a.T, a.L = [32768], [8, 32]
    if a.arms is None:
        a.arms = [arm for arm in ARMS if arm != "sco_disk" or a.spill_dir]
    if "sco_disk" in a.arms and not a.spill_dir:
        ap.error("--arms sco_disk needs --spill-dir")
    if a.reach:
        return reach(a.T[0], a.H)
    gpu = torch.cuda.get_device_name()
    rows = []
    print(f"{gpu}  torch {torch.__version__}  moepeak {moepeak.__version__}  H={a.H} bf16")
    print(f"{'T':>7} {'L':>3} {'arm':>9} {'status':>8} {'peak GiB':>9} {'step ms':>9} {'min':>8} {'max':>8} "
          f"{'vs ckpt':>8}")
    for T in a.T:
        for L in a.L:
            t0 = time.time()
            try:
                blocks = make_stack(L, a.H, torch.bfloat16)
            except torch.cuda.OutOfMemoryError:
                print(f"{T:>7} {L:>3} weights do not fit: OOM")
                _cleanup()
                continue
            ckpt_ms = None
            for arm in a.arms:
                r = run_arm(blocks, T, a.H, arm, a.warmup, a.iters, a.spill_dir)
                med = statistics.median(r["ms"]) if r["status"] == "ok" else float("nan")
                lo = min(r["ms"]) if r["status"] == "ok" else float("nan")
                hi = max(r["ms"]) if r["status"] == "ok" else float("nan")
                if arm == "ckpt" and r["status"] == "ok":
                    ckpt_ms = med
                rel = med / ckpt_ms if ckpt_ms and r["status"] == "ok" else float("nan")
                print(f"{T:>7} {L:>3} {arm:>9} {r['status']:>8} {r['peak_gib']:>9.2f} {med:>9.1f} {lo:>8.1f} "
                      f"{hi:>8.1f} {rel:>8.3f}", flush=True)
                rows.append(dict(H=a.H, T=T, L=L, dtype="bf16", arm=arm, status=r["status"],
                                 peak_above_base_gib=round(r["peak_gib"], 4), step_ms_median=round(med, 2),
                                 step_ms_min=round(lo, 2), step_ms_max=round(hi, 2), iters=a.iters))
            del blocks
            _cleanup()
            print(f"  ({time.time() - t0:.0f} s)", flush=True)
    if a.out:
        path = append_results(a.out, "sco", rows, gpu=gpu)
        print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
