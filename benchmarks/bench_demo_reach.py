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
The largest MoE of issue 29, Qwen3-30B-A3B-shaped (SHAPES), tiled blocks, on 8 GPUs; with every
block's input on the GPU, since on one 560 GiB host SCO's boundaries of 8 ranks would bind near
1.2M tokens (moepeak plan --host-mem 560):
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=8 benchmarks/bench_demo_reach.py --model qwen3-30b-a3b \
        --tile-tokens 8192 --sco-keep-last 48 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repo root
from _common import append_results, doubling  # noqa: E402
from _dist_points import finish, parse_simulated_oom, rank0_say, sweep, timed_steps, torchrun_ranks  # noqa: E402

GiB = 2 ** 30
MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "experts", "top_k", "intermediate", "vocab")
SHAPES = {
    # Qwen3-30B-A3B's config.json numbers, but 16 query heads of 128 (the demo's head_dim is
    # hidden / heads: 32 heads would be 64 wide): 48 layers, 128 experts top-8, 30.1B params.
    "qwen3-30b-a3b": dict(layers=48, hidden=2048, heads=16, kv_heads=4, experts=128, top_k=8, intermediate=768,
                          vocab=151936),
}
SMOKE = dict(layers=2, hidden=64, heads=4, kv_heads=2, experts=4, top_k=2, intermediate=64, vocab=264,
             dtype="float32", chunk_rows=256)
FIELDS = ["P", "arm", "seq_len", "status", "peak_gib", "step_s",
          "tokens_per_s", "model", "steps", "note"]


def _model_tag(d):
    return (f"L{d['layers']}-H{d['hidden']}-h{d['heads']}/{d['kv_heads']}-E{d['experts']}-K{d['top_k']}"
            f"-I{d['intermediate']}-V{d['vocab']}-{d['dtype']}" + (f"-tile{d['tile']}" if d.get("tile") else "")
            + (f"-keep{d['keep']}" if d.get("keep") else ""))


def parse_model(text):
    """--model "L,H,heads,kv_heads,E,K,I,V" or a name of SHAPES -> dict of MODEL_FIELDS."""
    if text in SHAPES:
        return dict(SHAPES[text])
    parts = text.split(",")
    if len(parts) != len(MODEL_FIELDS) or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
        raise ValueError(f"--model must be one of {sorted(SHAPES)} or {len(MODEL_FIELDS)} positive integers "
                         f"{','.join(MODEL_FIELDS)}, got {text!r}")
    return dict(zip(MODEL_FIELDS, map(int, parts)))


# --------------------------------------------------------------------------- child: one point

def _point(rank, world, dev, arm, seq_len, steps, d, simulate_oom):
    """One (arm, seq_len) point on one rank (run by _dist_points in a fresh child process)."""
    from moepeak.demo.context_parallel import cp_slice
    from moepeak.demo.data import TokenStream
    from moepeak.demo import shard_model
    from moepeak.demo.config import MoEConfig, build_optimizer, resolve
    from moepeak.demo.models import MoELM
    cfg = MoEConfig(vocab_size=d["vocab"], hidden=d["hidden"], layers=d["layers"], heads=d["heads"],
                    kv_heads=d["kv_heads"], experts=d["experts"], top_k=d["top_k"],
                    intermediate=d["intermediate"], chunk_rows=d.get("chunk_rows"),
                    context_parallel=True, tile_tokens=d.get("tile") if arm == "moepeak" else None,
                    sco_keep_last=d.get("keep") or 0)
    on = arm == "moepeak"
    cfg, opt_kind, notes = resolve(cfg, "stream", want_moepeak=dict.fromkeys(
        ("moe", "head", "checkpoint", "optimizer"), on))
    settings = f"{cfg.moe}/{cfg.head}/{cfg.checkpoint}/{opt_kind}"
    cfg.validate(world_size=world, seq_len=seq_len)
    model = MoELM(cfg, group=dist.group.WORLD, world_size=world, device=dev,
                  dtype=getattr(torch, d["dtype"]), seed=0)
    local = shard_model(model, world)
    opt = build_optimizer(model.parameters(), opt_kind, lr=1e-3, weight_decay=0.0)
    data = TokenStream("auto", max_bytes=8 << 20)

    def backward(loss):
        loss.backward()
        for p in local:
            if p.grad is not None:
                p.grad.div_(world)

    times, losses = timed_steps(
        steps, dev, lambda s: [cp_slice(t, rank, world).to(dev) for t in data.batch(s, 1, seq_len)],
        lambda xy: model(*xy), backward, opt,
        simulated_oom=bool(simulate_oom) and tuple(simulate_oom) == (arm, seq_len, rank))
    model.close()
    return dict(step_s=times, loss=losses, settings=settings)


# --------------------------------------------------------------------------- parent: the sweep

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
    ap.add_argument("--model", default=None, help=f"the model: one of {sorted(SHAPES)} or "
                    f"{','.join(MODEL_FIELDS)} (default: the demo's; --smoke: a tiny one)")
    ap.add_argument("--tile-tokens", type=int, default=None,
                    help="the moepeak arm's blocks sequence-tiled (moepeak.tiled) in tiles of this many tokens")
    ap.add_argument("--sco-keep-last", type=int, default=0,
                    help="the moepeak arm's last n blocks keep their input on the GPU (SCO): host RAM, which "
                         "the node's GPUs share, for GPU memory (moepeak plan --host-mem shows when it binds)")
    ap.add_argument("--simulate-oom", default=None, help=argparse.SUPPRESS)  # ARM:LEN:RANK (tests)
    a = ap.parse_args()
    try:
        model = parse_model(a.model) if a.model else None
    except ValueError as e:
        ap.error(str(e))
    if a.tile_tokens is not None and a.tile_tokens < 1:
        ap.error(f"--tile-tokens must be >= 1, got {a.tile_tokens}")
    if a.sco_keep_last < 0:
        ap.error(f"--sco-keep-last must be >= 0, got {a.sco_keep_last}")
    ranks = torchrun_ranks("bench_demo_reach")
    if ranks is None:
        return 2
    rank, world = ranks
    from moepeak.demo import DEFAULTS
    if a.smoke:
        d, device_kind = dict(SMOKE), "cpu"
        lo, hi, budget = a.min_len or 64, a.max_len or 256, a.max_seconds or 120.0
    else:
        d, device_kind = dict(DEFAULTS["cuda"]), "cuda"
        lo = a.min_len or ((1 << 17) if a.quick else (1 << 16))
        hi = a.max_len or ((1 << 19) if a.quick else (1 << 20))
        budget = a.max_seconds or (150.0 if a.quick else 270.0)
    d.update(model or {}, tile=a.tile_tokens, keep=a.sco_keep_last)
    dist.init_process_group("gloo")  # the parents coordinate on the CPU; children own the GPUs
    workdir = os.path.join(a.out, ".reach_tmp")
    os.makedirs(workdir, exist_ok=True)
    # gpu= for append_results: asking torch for the GPU name would create a CUDA context
    # on GPU 0 in both parents; the children report the GPU instead
    say = rank0_say(rank)
    lengths = doubling(lo, hi)
    say(f"bench_demo_reach: P={world}, model {_model_tag(d)}, lengths {lengths[0]}..{lengths[-1]}, "
        f"{a.steps} steps each, budget {budget:.0f} s per arm")
    say(f"{'arm':>8} {'seq_len':>9} {'status':>11} {'peak GiB':>9} {'step s':>8} {'tok/s':>10}  note")
    seen = {"gpu": "cpu", "total_gib": None}

    def on_point(arm, L, status, peak, step, note, outs):
        if outs is not None:
            seen["gpu"] = outs[0].get("gpu", seen["gpu"])
            seen["total_gib"] = outs[0].get("total_gib", seen["total_gib"])
        tps = L / step if step else None
        if rank != 0:
            return
        append_results(a.out, "demo_reach", [dict(
            P=world, arm=arm, seq_len=L, status=status,
            peak_gib=f"{peak:.3f}" if peak is not None else "", step_s=f"{step:.4f}" if step else "",
            tokens_per_s=f"{tps:.1f}" if tps else "", model=_model_tag(d), steps=a.steps,
            note=note)], FIELDS, gpu=seen["gpu"])

    sim = parse_simulated_oom(a.simulate_oom)
    res = sweep(a.arms.split(","), lengths, _point, lambda arm, L: (arm, L, a.steps, d, sim), rank=rank,
                world=world, steps=a.steps, budget=budget, grace=a.grace, workdir=workdir,
                device_kind=device_kind, on_point=on_point, say=say)
    reach = {arm: r[0] for arm, r in res.items()}
    stop = {arm: r[1] for arm, r in res.items()}
    total_gib = seen["total_gib"]
    for arm in reach:
        say(f"{arm}: longest context completed {reach[arm]} tokens ({reach[arm] // world} per rank); "
            f"stopped: {stop[arm]}")
        pts = [p for p in res[arm][2] if p[1] is not None]
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
    finish(rank, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
