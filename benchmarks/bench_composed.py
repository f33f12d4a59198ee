"""Composed training step on one GPU, one sequence, the ~2.0B MoE LM of issue 26
(16 layers, H = 2048, 16/4 heads, E = 16, K = 4, I = 768, V = 151936), arms in
one process, context T doubling from --min-len (8k) until OOM, a step over
--max-step-s (300 s), --max-len, or the wall budget.

    python benchmarks/bench_composed.py --budget-s 500 --out benchmarks/results
    python benchmarks/bench_composed.py --arms moepeak --min-len 65536 --budget-s 500
    python benchmarks/bench_composed.py --tiny --out /tmp/composed        # CPU, tiny model (the test)

Arms (moepeak.demo.models.MoELM, the same parameters in each):
    plain    torch checkpoint per block + F.linear/F.cross_entropy on fp32 logits
             + torch.optim.AdamW(fused=True) on the GPU; fp32 params, bf16 autocast
    liger    as plain with Liger's fused linear cross-entropy head (skipped with a
             note when liger_kernel is not importable)
    moepeak  PipelinedLLEP + Ring-DTP head (and the lean final norm) + SCO +
             StreamAdamW(overlap_backward=True), bf16 params (fp32 master/state in host RAM)
    moepeak_gpu_embed  moepeak with StreamAdamW(device_state=[embed.weight]): the input
             embedding's optimizer state on the GPU (+12 B per element: 3.5 GiB at this shape),
             so its update, the last in backward, is not a host update after backward
    moepeak_gpu_tail  moepeak with StreamAdamW(device_state=StreamAdamW.backward_tail(
             model.parameters(), DEVICE_TAIL_GIB)): the state of the params whose gradients
             are final last in backward (the embedding, then the first blocks) on the GPU
    moepeak_tiled  moepeak with sequence-tiled blocks (MoEConfig.tile_tokens = 8192;
             --tiny: 32), the fifth peak's schedule

Per (arm, T): --warmup untimed steps then --steps timed ones (defaults 1 and 1).
A timed step is forward + backward, synchronize (t_bwd), optimizer step(),
synchronize; step_s is the whole, opt_exposed_s the part after t_bwd: for
moepeak the optimizer time backward did not hide. For moepeak the standalone
StreamAdamW step (set_overlap(False): every update in step()) is timed once
at the first length and reported beside it (opt_standalone_s; issue 26's
target: opt_exposed_s <= 0.15 x opt_standalone_s at 32k).

Budget: the arms left share what remains of --budget-s; a length whose
predicted time (last step x 3 per doubling, warmup + steps of them) would
overrun its arm's share is recorded as status "budget" and ends the arm.

Recorded (DIR/composed.csv, after _common.RESULT_COLUMNS): arm, seq_len,
status (ok / oom / budget / slow / skipped / error), peak_gib
(max_memory_allocated over the timed steps), step_s, tokens_per_s,
opt_exposed_s, opt_standalone_s, params, model, note.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repo root
from _common import append_results, doubling, is_oom  # noqa: E402
from bench_demo_reach import SMOKE  # noqa: E402  (the CPU smoke shape of the demo model)

GiB = 2 ** 30
ARMS = ("plain", "liger", "moepeak", "moepeak_gpu_embed", "moepeak_gpu_tail", "moepeak_tiled")
DEVICE_TAIL_GIB = 12  # the moepeak_gpu_tail arm's device_state budget (the --tiny shape: half its state)
TILE_TOKENS = 8192  # the moepeak_tiled arm's (the --tiny shape: 32)
SHAPE_2B = dict(layers=16, hidden=2048, heads=16, kv_heads=4, experts=16, top_k=4, intermediate=768,
                vocab=151936, dtype="bfloat16", chunk_rows=None)
FIELDS = ["arm", "seq_len", "status", "peak_gib", "step_s", "tokens_per_s", "opt_exposed_s",
          "opt_standalone_s", "params", "model", "note"]


def model_tag(d):
    return (f"L{d['layers']}-H{d['hidden']}-h{d['heads']}/{d['kv_heads']}-E{d['experts']}-K{d['top_k']}"
            f"-I{d['intermediate']}-V{d['vocab']}")


class LigerHead(torch.nn.Module):
    """PlainLMHead's parameter (head.weight [V, H]) under Liger's fused linear cross-entropy."""

    def __init__(self, plain_head):
        super().__init__()
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        self.weight = plain_head.weight
        self.loss = LigerFusedLinearCrossEntropyLoss(ignore_index=plain_head.ignore_index,
                                                     reduction=plain_head.reduction)

    def forward(self, hidden, labels):
        return self.loss(self.weight, hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1))


def build_arm(arm, d, device):
    """(model, optimizer, autocast dtype or None, note)."""
    import moepeak
    from moepeak.demo.config import MoEConfig, resolve
    from moepeak.demo.models import MoELM
    from moepeak.stream_adamw.device import device_state_bytes
    cfg = MoEConfig(vocab_size=d["vocab"], hidden=d["hidden"], layers=d["layers"], heads=d["heads"],
                    kv_heads=d["kv_heads"], experts=d["experts"], top_k=d["top_k"],
                    intermediate=d["intermediate"], chunk_rows=d.get("chunk_rows"))
    on = arm.startswith("moepeak")
    cfg, opt_kind, notes = resolve(cfg, "stream", want_moepeak=dict.fromkeys(("moe", "head", "checkpoint",
                                                                               "optimizer"), on))
    if arm == "moepeak_tiled":
        cfg = cfg.replace(tile_tokens=d.get("tile_tokens", TILE_TOKENS))
        notes.append(f"tile_tokens {cfg.tile_tokens}")
    if on:
        model = MoELM(cfg, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        device_state = None
        if arm == "moepeak_gpu_embed":
            device_state = [model.embed.weight]
            notes.append("embedding's optimizer state on the device")
        elif arm == "moepeak_gpu_tail":
            budget = (DEVICE_TAIL_GIB * GiB if device.type == "cuda"
                      else sum(device_state_bytes(p) for p in model.parameters()) // 2)
            device_state = moepeak.StreamAdamW.backward_tail(model.parameters(), budget)
            used = sum(p.numel() for p in device_state)
            notes.append(f"optimizer state of the first {len(device_state)} of {len(list(model.parameters()))} "
                         f"params ({used / 1e6:.1f}M elements) on the device")
        opt = moepeak.StreamAdamW(model.parameters(), lr=1e-4, weight_decay=0.0, overlap_backward=True,
                                  device_state=device_state, threads=d.get("opt_threads"))
        if d.get("opt_threads"):
            notes.append(f"StreamAdamW threads {d['opt_threads']}")
        return model, opt, None, "; ".join(notes)
    model = MoELM(cfg, device=device, dtype=torch.float32)
    if arm == "liger":
        model.head = LigerHead(model.head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    return model, opt, (torch.bfloat16 if device.type == "cuda" else None), "; ".join(notes)


def timed_step(model, opt, ids, autocast, device):
    """(step s, optimizer s after backward, the perf_counter time backward ended) of one training step."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    sync()
    t_bwd = time.perf_counter()
    opt.step()
    sync()
    t1 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    return t1 - t0, t1 - t_bwd, t_bwd


def overlap_note(opt, t_bwd):
    """What of StreamAdamW's overlapped update was left when backward ended (its last round's jobs)."""
    jobs = opt.overlap_stats()["last_round"]
    late = [j for j in jobs if j[3] > t_bwd]
    if not late:
        return "overlap: every job done before backward ended"
    n_late = sum(j[0] for j in late)
    last = jobs[-1]
    return (f"overlap: {len(late)} of {len(jobs)} jobs ({n_late / 1e6:.1f}M params) ran after backward, "
            f"the worker until +{max(j[3] for j in late) - t_bwd:.3f} s; last job {last[0] / 1e6:.1f}M params "
            f"in {last[3] - last[2]:.3f} s")


def run_arm(arm, a, d, device, lengths, arm_deadline, gpu):
    base = dict(arm=arm, model=model_tag(d))
    if arm == "liger":
        try:
            import liger_kernel  # noqa: F401
        except ImportError as e:
            return report(a, [dict(base, seq_len="", status="skipped", note=f"liger_kernel not importable: {e}")],
                          gpu)
    return report(a, sweep(arm, a, d, device, lengths, arm_deadline, base), gpu)


def report(a, rows, gpu):
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['arm']:>8} {r['seq_len']!s:>8} {r['status']}  {r.get('note', '')}", flush=True)
    if a.out:
        append_results(a.out, "composed", rows, fields=FIELDS, gpu=gpu)
    return rows


def sweep(arm, a, d, device, lengths, arm_deadline, base):
    """The rows of one arm: build it, then T ascending until a stop."""
    model = opt = None
    rows = []
    try:
        model, opt, autocast, note = build_arm(arm, d, device)
        base["params"] = sum(p.numel() for p in model.parameters())
        standalone, last = None, None
        gen = torch.Generator().manual_seed(0)
        for T in lengths:
            if last is not None:
                pred = last * 3.0 * (a.warmup + a.steps)
                left = arm_deadline - time.monotonic()
                if pred > left:
                    rows.append(dict(base, seq_len=T, status="budget",
                                     note=f"predicted {pred:.0f} s, {left:.0f} s left of the arm's share"))
                    break
            ids = torch.randint(0, d["vocab"], (1, T + 1), generator=gen).to(device)
            try:
                for _ in range(a.warmup):
                    timed_step(model, opt, ids, autocast, device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                times = [timed_step(model, opt, ids, autocast, device) for _ in range(a.steps)]
                row_note = note
                if arm.startswith("moepeak"):
                    row_note = "; ".join(n for n in (note, overlap_note(opt, times[-1][2])) if n)
                    if standalone is None:
                        opt.set_overlap(False)
                        standalone = timed_step(model, opt, ids, autocast, device)[1]
                        opt.set_overlap(True)
            except Exception as e:  # noqa: BLE001 - an OOM is a result
                status = "oom" if is_oom(e) else "error"
                rows.append(dict(base, seq_len=T, status=status, note=f"{type(e).__name__}: {str(e)[:200]}"))
                if status == "error":
                    traceback.print_exc()
                break
            step = min(t for t, _, _ in times)
            exposed = min(x for _, x, _ in times)
            peak = torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None
            rows.append(dict(base, seq_len=T, status="ok", peak_gib=f"{peak:.3f}" if peak is not None else "",
                             step_s=f"{step:.4f}", tokens_per_s=f"{T / step:.1f}", opt_exposed_s=f"{exposed:.4f}",
                             opt_standalone_s=f"{standalone:.4f}" if standalone is not None else "", note=row_note))
            print(f"{arm:>8} {T:>8} ok  peak {rows[-1]['peak_gib'] or '-':>8} GiB  step {step:8.3f} s  "
                  f"{T / step:9.0f} tok/s  opt after bwd {exposed:.3f} s"
                  + (f" (standalone {standalone:.3f} s)" if standalone is not None else "")
                  + (f"\n{'':>17}{row_note}" if row_note else ""), flush=True)
            last = step
            if step > a.max_step_s:
                rows.append(dict(base, seq_len=T * 2, status="slow",
                                 note=f"step {step:.0f} s > --max-step-s {a.max_step_s:.0f}"))
                break
    except Exception as e:  # noqa: BLE001 - building the arm failed (an OOM is still a result)
        rows.append(dict(base, seq_len="", status="oom" if is_oom(e) else "error",
                         note=f"{type(e).__name__}: {str(e)[:200]}"))
        traceback.print_exc()
    finally:
        if model is not None and hasattr(model, "close"):
            model.close()
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results", help="results dir ('' : do not write)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--min-len", type=int, default=None, help="first T (default 8192; --tiny 64)")
    ap.add_argument("--max-len", type=int, default=None, help="last T (default 1M; --tiny 128)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--max-step-s", type=float, default=300.0)
    ap.add_argument("--budget-s", type=float, default=500.0, help="wall budget of the whole call")
    ap.add_argument("--tiny", action="store_true", help="the demo's smoke shape on the CPU (tests the script)")
    ap.add_argument("--opt-threads", type=int, default=None,
                    help="StreamAdamW's host threads in the moepeak arms (default: all CPUs of the process)")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    arms = [x for x in a.arms.split(",") if x]
    bad = [x for x in arms if x not in ARMS]
    if bad:
        ap.error(f"--arms: unknown {bad}; choose from {ARMS}")
    if a.opt_threads is not None and a.opt_threads < 1:
        ap.error(f"--opt-threads must be >= 1, got {a.opt_threads}")
    if a.tiny:
        d, device = dict(SMOKE, tile_tokens=32), torch.device("cpu")
        lo, hi = a.min_len or 64, a.max_len or 128
    else:
        if not torch.cuda.is_available():
            print("bench_composed: needs a GPU (or --tiny)")
            return 2
        d, device = dict(SHAPE_2B), torch.device("cuda")
        lo, hi = a.min_len or 8192, a.max_len or (1 << 20)
    d["opt_threads"] = a.opt_threads
    lengths = doubling(lo, hi)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"bench_composed: {model_tag(d)} on {gpu}, T {lengths[0]}..{lengths[-1]}, arms {arms}, "
          f"budget {a.budget_s:.0f} s", flush=True)
    for i, arm in enumerate(arms):
        left = a.budget_s - (time.monotonic() - t_start)
        run_arm(arm, a, d, device, lengths, time.monotonic() + left / (len(arms) - i), gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
