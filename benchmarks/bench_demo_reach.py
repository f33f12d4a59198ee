"""Context reach of the composed demo model at P ranks with context parallelism:
the longest context one full training step (forward + backward + optimizer)
completes, moepeak's four schedules on vs off, and tokens/s at each length.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/bench_demo_reach.py --out benchmarks/results
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/bench_demo_reach.py --quick --out benchmarks/results
    torchrun --nproc_per_node=2 benchmarks/bench_demo_reach.py --smoke --out /tmp/reach   # CPU gloo, tiny

Model: moepeak.demo.DEFAULTS["cuda"] (L=4, H=1024, 8/2 heads, E=16, K=2, I=512,
V=65536, bf16), batch 1, one sequence of `seq_len` tokens split over the P
ranks (each holds seq_len/P; attention all-gathers K/V, moepeak.demo.context_parallel).
    moepeak arm: PipelinedLLEP (experts split over the ranks), Ring-DTP head
                 (vocab shards over the ranks), SCO, StreamAdamW; FSDP2 on the rest.
    plain arm:   FSDP2 on everything, dense MoE, F.linear + F.cross_entropy on full
                 fp32 logits, torch.utils.checkpoint per block, torch.optim.AdamW.
Context doubles from --min-len (64k; --quick 128k) to --max-len (1M; --quick 512k); per
length `--steps` steps (default 2: the last one is timed, the first allocates
optimizer state and pinned arenas); an arm stops at its first failure, or when
the next length is predicted (step time x 4 per doubling: attention is
quadratic) to overrun the arm's --max-seconds (recorded as status "time-cap":
that arm's reach is then bounded by compute, not memory).

How an OOM stays a result on every rank, with no hang: each point runs in a
fresh child process per rank with its own process group (a rank that runs out
of memory mid-step would leave the other blocked in a collective). The child
writes its outcome to a file; a parent whose sibling reports a failure kills
its own (possibly blocked) child after a grace period; the parents (gloo, CPU
only, never touching the GPU) then all-gather the outcomes, so every rank
takes the same decision. Memory is freed with the child.

Recorded (DIR/demo_reach.csv, after _common.RESULT_COLUMNS): P, arm, seq_len,
status (ok / oom / time-cap / timeout / error), peak_gib (max over ranks of
max_memory_allocated over the whole run: weights, grads, activations, optimizer
state on the GPU), step_s (timed step, max over ranks), tokens_per_s
(seq_len / step_s), model, steps, note. The summary prints each arm's longest
completed context, the ratio, and a linear projection of where the last
arm's peak would reach the GPU's memory (a projection, not a measurement).

Expected runtime on 2 x H200 (estimated from the 1-GPU demo's 83k tok/s at 131k,
not measured): full ~5-6 min (moepeak up to 1M, ~50 s a step there, attention-
bound; plain stops at its OOM, expected at 512k: its fp32 logits need ~768 KiB
per local token, ~100 GiB at 128k per rank), --quick ~3 min. One longer point,
attention-bound (~200 s a step), memory ~75 GiB per rank expected:
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/bench_demo_reach.py --arms moepeak \
        --min-len 2097152 --max-len 2097152 --steps 1 --max-seconds 420 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repo root
from _common import append_results, is_oom  # noqa: E402

GiB = 2 ** 30
SMOKE = dict(layers=2, hidden=64, heads=4, kv_heads=2, experts=4, top_k=2, intermediate=64, vocab=264,
             dtype="float32", chunk_rows=256)
FIELDS = ["P", "arm", "seq_len", "status", "peak_gib", "step_s",
          "tokens_per_s", "model", "steps", "note"]


def _model_tag(d):
    return (f"L{d['layers']}-H{d['hidden']}-h{d['heads']}/{d['kv_heads']}-E{d['experts']}-K{d['top_k']}"
            f"-I{d['intermediate']}-V{d['vocab']}-{d['dtype']}")


# --------------------------------------------------------------------------- child: one point

def _child(arm, seq_len, steps, rank, world, port, d, device_kind, out_file, simulate_oom):
    """One (arm, seq_len) point on one rank; writes {"status", ...} to out_file."""
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # our own store, not torchrun's
    res = {"status": "error", "rank": rank}
    try:
        from moepeak.demo.context_parallel import cp_slice
        from moepeak.demo.data import TokenStream
        from moepeak.demo import shard_model
        from moepeak.demo.models import MoEConfig, MoELM, build_optimizer, resolve
        cuda = device_kind == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
            dev = torch.device("cuda", rank)
            res["gpu"] = torch.cuda.get_device_name(dev)
            res["total_gib"] = torch.cuda.get_device_properties(dev).total_memory / GiB
        else:
            dev = torch.device("cpu")
            torch.set_num_threads(1)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
        cfg = MoEConfig(vocab_size=d["vocab"], hidden=d["hidden"], layers=d["layers"], heads=d["heads"],
                        kv_heads=d["kv_heads"], experts=d["experts"], top_k=d["top_k"],
                        intermediate=d["intermediate"], chunk_rows=d.get("chunk_rows"),
                        context_parallel=True)
        on = arm == "moepeak"
        cfg, opt_kind, notes = resolve(cfg, "stream", want_moepeak=dict.fromkeys(
            ("moe", "head", "checkpoint", "optimizer"), on))
        res["settings"] = f"{cfg.moe}/{cfg.head}/{cfg.checkpoint}/{opt_kind}"
        cfg.validate(world_size=world, seq_len=seq_len)
        model = MoELM(cfg, group=dist.group.WORLD, world_size=world, device=dev,
                      dtype=getattr(torch, d["dtype"]), seed=0)
        local = shard_model(model, world)
        opt = build_optimizer(model.parameters(), opt_kind, lr=1e-3, weight_decay=0.0)
        data = TokenStream("auto", max_bytes=8 << 20)
        times, losses = [], []
        for s in range(steps):
            x, y = (cp_slice(t, rank, world).to(dev) for t in data.batch(s, 1, seq_len))
            if cuda:
                torch.cuda.synchronize(dev)
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(x, y)
            if simulate_oom and simulate_oom == (arm, seq_len, rank):
                raise torch.cuda.OutOfMemoryError("simulated: CUDA out of memory (bench --simulate-oom)")
            loss.backward()
            for p in local:
                if p.grad is not None:
                    p.grad.div_(world)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
        res.update(status="ok", step_s=times, loss=losses,
                   peak_gib=torch.cuda.max_memory_allocated(dev) / GiB if cuda else None)
        model.close()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - an OOM is a result
        res.update(status="oom" if is_oom(e) else "error", note=f"{type(e).__name__}: {str(e)[:300]}")
        if res["status"] == "error":
            res["traceback"] = traceback.format_exc()[-2000:]
    _write_json(out_file, res)
    sys.stdout.flush()
    sys.stderr.flush()
    # leave at once: a failed rank's peer may be blocked in a collective, and any
    # cleanup (destroy_process_group, freeing) could block too; exiting frees it all
    os._exit(0 if res["status"] == "ok" else 3)


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- parent: the sweep

def _run_point(arm, L, a, d, rank, world, port, workdir, timeout, device_kind):
    import multiprocessing as mp
    files = [os.path.join(workdir, f"{arm}_{L}_r{r}.json") for r in range(world)]
    for f in files[rank:rank + 1]:
        if os.path.exists(f):
            os.remove(f)
    dist.barrier()
    sim = None
    if a.simulate_oom:
        sa, sl, sr = a.simulate_oom.split(":")
        sim = (sa, int(sl), int(sr))
    p = mp.get_context("spawn").Process(target=_child, args=(arm, L, a.steps, rank, world, port, d,
                                                             device_kind, files[rank], sim))
    p.start()
    t0, failed_at, verdict = time.monotonic(), None, None
    while True:
        p.join(0.25)
        if p.exitcode is not None:
            break
        now = time.monotonic()
        if failed_at is None:
            for f in files:
                r = _read_json(f)
                if r is not None and r["status"] != "ok":
                    failed_at = now  # a peer failed: our child may be blocked in a collective
        if failed_at is not None and now - failed_at > a.grace:
            verdict = "peer-failed"
        elif now - t0 > timeout:
            verdict = "timeout"
        if verdict:
            p.kill()
            p.join(10)
            break
    mine = _read_json(files[rank]) or {"status": verdict or "error", "rank": rank,
                                       "note": f"child exit code {p.exitcode}, no result"}
    outs = [None] * world
    dist.all_gather_object(outs, mine)
    return outs


def _combine(outs):
    """(status, peak GiB max over ranks, timed step s max over ranks, note). An OOM on
    any rank makes the point an OOM (its peers then fail in a collective or are killed:
    those consequences are not reported as errors of their own)."""
    st = [o["status"] for o in outs]
    for s in ("oom", "timeout", "error", "peer-failed"):
        if s in st:
            note = "; ".join(f"rank {o['rank']}: {o.get('note', o['status'])}" for o in outs
                             if o["status"] == s)
            return s, None, None, note
    peak = max(o["peak_gib"] for o in outs) if outs[0].get("peak_gib") is not None else None
    step = max(o["step_s"][-1] for o in outs)
    return "ok", peak, step, outs[0].get("settings", "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="lengths 128k..512k, 150 s per arm")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU gloo (test the script)")
    ap.add_argument("--min-len", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None, help="cap (default 1M; --quick 512k)")
    ap.add_argument("--steps", type=int, default=2, help="steps per length; the last is timed")
    ap.add_argument("--max-seconds", type=float, default=None, help="wall-clock budget per arm "
                    "(default 270; --quick 150)")
    ap.add_argument("--arms", default="moepeak,plain")
    ap.add_argument("--grace", type=float, default=20.0, help="seconds a rank waits after its peer "
                    "failed before killing its own child")
    ap.add_argument("--simulate-oom", default=None, help=argparse.SUPPRESS)  # ARM:LEN:RANK (tests)
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world < 2 or "LOCAL_WORLD_SIZE" in os.environ and int(os.environ["LOCAL_WORLD_SIZE"]) != world:
        print("bench_demo_reach: run under torchrun on one host with >= 2 ranks, e.g.\n  "
              "NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/bench_demo_reach.py --out DIR")
        return 2
    from moepeak.demo import DEFAULTS
    if a.smoke:
        d, device_kind = dict(SMOKE), "cpu"
        lo, hi, budget = a.min_len or 64, a.max_len or 256, a.max_seconds or 120.0
    else:
        d, device_kind = dict(DEFAULTS["cuda"]), "cuda"
        lo = a.min_len or ((1 << 17) if a.quick else (1 << 16))
        hi = a.max_len or ((1 << 19) if a.quick else (1 << 20))
        budget = a.max_seconds or (150.0 if a.quick else 270.0)
    dist.init_process_group("gloo")  # the parents coordinate on the CPU; children own the GPUs
    workdir = os.path.join(a.out, ".reach_tmp")
    os.makedirs(workdir, exist_ok=True)
    # gpu= for append_results: asking torch for the GPU name would create a CUDA context
    # on GPU 0 in both parents; the children report the GPU instead
    say = (lambda *x: print(*x, flush=True)) if rank == 0 else (lambda *x: None)
    lengths = []
    L = lo
    while L <= hi:
        lengths.append(L)
        L *= 2
    say(f"bench_demo_reach: P={world}, model {_model_tag(d)}, lengths {lengths[0]}..{lengths[-1]}, "
        f"{a.steps} steps each, budget {budget:.0f} s per arm")
    say(f"{'arm':>8} {'seq_len':>9} {'status':>9} {'peak GiB':>9} {'step s':>8} {'tok/s':>10}  note")
    reach, stop, last_ok, gpu, total_gib = {}, {}, {}, "cpu", None
    for arm in a.arms.split(","):
        t_arm, prev = time.monotonic(), None  # prev: (L, step_s, point wall s) of the last ok point
        reach[arm], stop[arm] = 0, f"--max-len {lengths[-1]} reached"
        for L in lengths:
            # rank 0 decides (time cap, port) and tells the others: every rank takes the same path
            plan = [None, None]
            if rank == 0:
                if prev is not None:
                    est = prev[2] + (prev[1] * (L / prev[0]) ** 2 - prev[1]) * a.steps
                    left = budget - (time.monotonic() - t_arm)
                    if est > left:
                        plan[0] = (f"next step predicted {prev[1] * (L / prev[0]) ** 2:.1f} s x {a.steps} "
                                   f"(point ~{est:.0f} s): over the arm's budget ({left:.0f} s left)")
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    plan[1] = s.getsockname()[1]
            dist.broadcast_object_list(plan, src=0)
            if plan[0] is not None:
                row = dict(status="time-cap", note=plan[0])
                stop[arm] = f"time-cap before {L}"
                say(f"{arm:>8} {L:>9} {'time-cap':>9} {'':>9} {'':>8} {'':>10}  {row['note']}")
                if rank == 0:
                    append_results(a.out, "demo_reach", [dict(
                        P=world, arm=arm, seq_len=L, model=_model_tag(d), steps=a.steps,
                        peak_gib="", step_s="", tokens_per_s="", **row)], FIELDS, gpu=gpu)
                break
            port = plan[1]
            t0 = time.monotonic()
            timeout = max(60.0, budget - (t0 - t_arm) + 60.0)
            outs = _run_point(arm, L, a, d, rank, world, port, workdir, timeout, device_kind)
            wall = time.monotonic() - t0
            gpu = outs[0].get("gpu", gpu)
            total_gib = outs[0].get("total_gib", total_gib)
            status, peak, step, note = _combine(outs)
            tps = L / step if step else None
            say(f"{arm:>8} {L:>9} {status:>9} {(f'{peak:.2f}' if peak is not None else '-'):>9} "
                f"{(f'{step:.2f}' if step else '-'):>8} {(f'{tps:.0f}' if tps else '-'):>10}  {note}")
            if rank == 0:
                if status == "error":
                    for o in outs:
                        if o.get("traceback"):
                            print(f"rank {o['rank']} traceback:\n{o['traceback']}", flush=True)
                append_results(a.out, "demo_reach", [dict(
                    P=world, arm=arm, seq_len=L, status=status,
                    peak_gib=f"{peak:.3f}" if peak is not None else "", step_s=f"{step:.4f}" if step else "",
                    tokens_per_s=f"{tps:.1f}" if tps else "", model=_model_tag(d), steps=a.steps,
                    note=note)], FIELDS, gpu=gpu)
            if status != "ok":
                stop[arm] = f"{status} at {L}"
                break
            reach[arm] = L
            last_ok.setdefault(arm, []).append((L, peak))
            prev = (L, step, wall)
    say("")
    for arm in reach:
        say(f"{arm}: longest context completed {reach[arm]} tokens ({reach[arm] // world} per rank); "
            f"stopped: {stop[arm]}")
        pts = [p for p in last_ok.get(arm, []) if p[1] is not None]
        if total_gib and len(pts) >= 2:
            (l1, p1), (l2, p2) = pts[-2], pts[-1]
            slope = (p2 - p1) / (l2 - l1)
            if slope > 0:
                say(f"  projection (linear in the last two peaks, not measured): {total_gib:.0f} GiB "
                    f"reached near {l2 + (total_gib - p2) / slope:.3g} tokens")
    if reach.get("moepeak") and reach.get("plain"):
        r = reach["moepeak"] / reach["plain"]
        exact = stop["moepeak"].startswith("oom") and stop["plain"].startswith("oom")
        say(f"reach ratio moepeak/plain: {r:.1f}x" + ("" if exact else
            f" (not both arms stopped by OOM: moepeak {stop['moepeak']}, plain {stop['plain']}; "
            f"a lower bound if only plain hit its OOM)"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
