"""Multi-rank benchmark points where an OOM is a result on every rank, with no hang.

Each point (one arm at one length) runs in a fresh child process per rank with its own
process group: a rank that runs out of memory mid-step would leave its peer blocked in a
collective. The child writes its outcome to a JSON file and leaves with os._exit; a
parent whose sibling reports a failure kills its own (possibly blocked) child after a
grace period; the parents (gloo on the CPU, never touching a GPU) then all-gather the
outcomes, so every rank takes the same decision. Memory is freed with the child.

    outs = run_point(point_fn, point_args, rank, world, port, files, device_kind, grace, timeout)
    status, peak_gib, step_s, note = combine(outs)

point_fn(rank, world, device, *point_args) -> dict runs in the child after its process
group is up ("nccl" on CUDA with rank r on cuda:r, "gloo" on the CPU); it returns at
least step_s (a list, the last timed) and may add fields (settings, loss, ...). The
child adds status, rank, gpu, total_gib and peak_gib (max_memory_allocated on CUDA).
point_fn must be a module-level function (the child is spawned).

A sweep script (bench_hf_dist.py, bench_hf_sp.py) adds add_sweep_args' flags to its parser,
reads them with parse_sweep, and runs sweep_to_csv (lengths ascending per arm until a failure
or the arm's budget, one CSV row a point) and say_reach (the summary).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys
import time
import traceback

import torch
import torch.distributed as dist

from _common import append_results, is_oom

GiB = 2 ** 30
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FAILURES = ("oom", "timeout", "error", "peer-failed")  # worst first: what a point reports


def _child(point_fn, point_args, rank, world, port, device_kind, out_file):
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # our own store, not torchrun's
    res = {"status": "error", "rank": rank}
    try:
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
        res.update(point_fn(rank, world, dev, *point_args))
        res.update(status="ok", peak_gib=torch.cuda.max_memory_allocated(dev) / GiB if cuda else None)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - an OOM is a result
        res.update(status="oom" if is_oom(e) else "error", note=f"{type(e).__name__}: {str(e)[:300]}")
        if res["status"] == "error":
            res["traceback"] = traceback.format_exc()[-2000:]
    write_json(out_file, res)
    sys.stdout.flush()
    sys.stderr.flush()
    # leave at once: a failed rank's peer may be blocked in a collective, and any
    # cleanup (destroy_process_group, freeing) could block too; exiting frees it all
    os._exit(0 if res["status"] == "ok" else 3)


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_point(point_fn, point_args, rank, world, port, files, device_kind, grace, timeout):
    """Run point_fn on every rank (this parent's child is rank `rank`); files[r] is rank r's
    result file. Returns every rank's result dict (all-gathered over the parents' group)."""
    if os.path.exists(files[rank]):
        os.remove(files[rank])
    dist.barrier()
    p = mp.get_context("spawn").Process(target=_child, args=(point_fn, point_args, rank, world, port,
                                                             device_kind, files[rank]))
    p.start()
    t0, failed_at, verdict = time.monotonic(), None, None
    while True:
        p.join(0.25)
        if p.exitcode is not None:
            break
        now = time.monotonic()
        if failed_at is None:
            for f in files:
                r = read_json(f)
                if r is not None and r["status"] != "ok":
                    failed_at = now  # a peer failed: our child may be blocked in a collective
        if failed_at is not None and now - failed_at > grace:
            verdict = "peer-failed"
        elif now - t0 > timeout:
            verdict = "timeout"
        if verdict:
            p.kill()
            p.join(10)
            break
    mine = read_json(files[rank]) or {"status": verdict or "error", "rank": rank,
                                      "note": f"child exit code {p.exitcode}, no result"}
    outs = [None] * world
    dist.all_gather_object(outs, mine)
    return outs


def combine(outs):
    """(status, peak GiB max over ranks, timed step s max over ranks, note). An OOM on
    any rank makes the point an OOM (its peers then fail in a collective or are killed:
    those consequences are not reported as errors of their own)."""
    st = [o["status"] for o in outs]
    for s in FAILURES:
        if s in st:
            note = "; ".join(f"rank {o['rank']}: {o.get('note', o['status'])}" for o in outs if o["status"] == s)
            return s, None, None, note
    peak = max(o["peak_gib"] for o in outs) if outs[0].get("peak_gib") is not None else None
    step = max(o["step_s"][-1] for o in outs)
    return "ok", peak, step, outs[0].get("settings", "")


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sweep(arms, lengths, point_fn, point_args, *, rank, world, steps, budget, grace, workdir, device_kind,
          on_point, say):
    """Per arm, lengths ascending until a point fails or the next one is predicted (the last
    step x (L / last L)^2 per step: attention is quadratic) to overrun the arm's wall budget
    (status "time-cap"). point_args(arm, L) gives point_fn's arguments after (rank, world,
    device). Each point's line goes to say (with the failing ranks' tracebacks on rank 0, for
    an error); on_point(arm, L, status, peak_gib, step_s, note, outs) then records it (outs:
    every rank's result, None for a time-cap). Every rank takes the same path: rank 0 decides
    and broadcasts. Returns {arm: (longest ok length or 0, why it stopped, [(L, peak)] ok)}."""
    result = {}
    for arm in arms:
        t_arm, prev = time.monotonic(), None  # prev: (L, step_s, point wall s) of the last ok point
        reach, stop, ok = 0, f"--max-len {lengths[-1]} reached", []
        for L in lengths:
            plan = [None, None]
            if rank == 0:
                if prev is not None:
                    est = prev[2] + (prev[1] * (L / prev[0]) ** 2 - prev[1]) * steps
                    left = budget - (time.monotonic() - t_arm)
                    if est > left:
                        plan[0] = (f"next step predicted {prev[1] * (L / prev[0]) ** 2:.1f} s x {steps} "
                                   f"(point ~{est:.0f} s): over the arm's budget ({left:.0f} s left)")
                plan[1] = free_port()
            dist.broadcast_object_list(plan, src=0)
            if plan[0] is not None:
                stop = f"time-cap before {L}"
                say(point_line(arm, L, "time-cap", None, None, plan[0]))
                on_point(arm, L, "time-cap", None, None, plan[0], None)
                break
            t0 = time.monotonic()
            files = [os.path.join(workdir, f"{arm}_{L}_r{r}.json") for r in range(world)]
            timeout = max(60.0, budget - (t0 - t_arm) + 60.0)
            outs = run_point(point_fn, point_args(arm, L), rank, world, plan[1], files, device_kind, grace, timeout)
            status, peak, step, note = combine(outs)
            say(point_line(arm, L, status, peak, step, note))
            if rank == 0 and status == "error":
                print_tracebacks(outs)
            on_point(arm, L, status, peak, step, note, outs)
            if status != "ok":
                stop = f"{status} at {L}"
                break
            reach = L
            ok.append((L, peak))
            prev = (L, step, time.monotonic() - t0)
        result[arm] = (reach, stop, ok)
        say("")
    return result


def add_sweep_args(ap, arms) -> None:
    """The flags of a sweep script run through sweep_to_csv: --out, --arms (from `arms`), --steps,
    --max-seconds, --grace."""
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--arms", default=",".join(arms), help=f"comma list of {arms}")
    ap.add_argument("--steps", type=int, default=2, help="steps per length; the last is timed")
    ap.add_argument("--max-seconds", type=float, default=270.0, help="wall-clock budget per arm")
    ap.add_argument("--grace", type=float, default=20.0,
                    help="seconds a rank waits after its peer failed before killing its own child")


def parse_sweep(script, ap, arms, argv):
    """(flags, the --arms chosen, rank, world) of a sweep script under torchrun, its parser `ap`
    holding add_sweep_args' flags; SystemExit naming --arms unless each is one of `arms`; None
    (the usage printed) when not run under torchrun with >= 2 ranks."""
    a = ap.parse_args(argv)
    chosen = a.arms.split(",")
    if any(arm not in arms for arm in chosen):
        raise SystemExit(f"{script}: --arms must name some of {arms}, got {a.arms!r}")
    ranks = torchrun_ranks(script)
    return None if ranks is None else (a, chosen, *ranks)


def sweep_to_csv(a, table, fields, row, arms, lengths, point_fn, point_args, *, rank, world, device_kind, say):
    """A sweep (see sweep) recorded in a.out/<table>.csv, from the parents: their gloo group, the
    work folder a.out/.<table>_tmp, and each point's row appended by rank 0 with the GPU the
    children report: P, arm, status, peak_gib, step_s, loss (rank 0's last, for an ok point) and
    note, then the script's own columns row(L, step_s) (step_s None unless ok). a: the flags of
    add_sweep_args. Returns sweep's result, after finish."""
    dist.init_process_group("gloo")  # the parents coordinate on the CPU; children own the GPUs
    workdir = os.path.join(a.out, f".{table}_tmp")
    os.makedirs(workdir, exist_ok=True)
    gpu = {"name": "cpu"}  # asking torch here would create a CUDA context on GPU 0 in every parent

    def on_point(arm, L, status, peak, step, note, outs):
        loss = ""
        if outs is not None:
            gpu["name"] = outs[0].get("gpu", gpu["name"])
            if status == "ok":
                loss = f"{outs[0]['loss'][-1]:.4f}"
        if rank == 0:
            append_results(a.out, table, [dict(
                P=world, arm=arm, status=status, peak_gib=f"{peak:.3f}" if peak is not None else "",
                step_s=f"{step:.4f}" if step else "", loss=loss, note=note, **row(L, step))], fields, gpu=gpu["name"])

    res = sweep(arms, lengths, point_fn, point_args, rank=rank, world=world, steps=a.steps, budget=a.max_seconds,
                grace=a.grace, workdir=workdir, device_kind=device_kind, on_point=on_point, say=say)
    finish(rank, workdir)
    return res


def say_reach(res, say, reached, ours="moepeak", baseline=None) -> None:
    """sweep's result in words: per arm the longest length completed (reached(L): its words) and
    why the arm stopped, then ours' reach over baseline's where both completed one."""
    for arm, (reach, stop, _) in res.items():
        say(f"{arm}: longest {reached(reach)}; stopped: {stop}")
    if res.get(ours, (0,))[0] and res.get(baseline, (0,))[0]:
        say(f"reach ratio {ours}/{baseline}: {res[ours][0] / res[baseline][0]:.1f}x")


def rank0_say(rank: int):
    """print(..., flush=True) on rank 0, nothing on the others."""
    return (lambda *x: print(*x, flush=True)) if rank == 0 else (lambda *x: None)


def header_line(length: str, rate: str) -> str:
    """The column heads above point_line's lines: `length` and `rate` name its length and tokens/s."""
    return f"{'arm':>8} {length:>9} {'status':>11} {'peak GiB':>9} {'step s':>8} {rate:>10}  note"


def point_line(arm, L, status, peak, step, note) -> str:
    """One point's console line: arm, length, status, peak GiB, step s, tokens/s (per rank), note."""
    tps = L / step if step else None
    return (f"{arm:>8} {L:>9} {status:>11} {(f'{peak:.2f}' if peak is not None else '-'):>9} "
            f"{(f'{step:.2f}' if step else '-'):>8} {(f'{tps:.0f}' if tps else '-'):>10}  {note}")


def print_tracebacks(outs) -> None:
    """The tracebacks of the ranks whose point raised something other than an OOM."""
    for o in outs or ():
        if o.get("traceback"):
            print(f"rank {o['rank']} traceback:\n{o['traceback']}", flush=True)


def timed_steps(steps, dev, batch, forward, backward, opt, simulated_oom=False):
    """A point's training steps on this rank (in its child). Each step: inputs = batch(s)
    (not timed), then, timed from a barrier to the end of the optimizer step (CUDA
    synchronized on both sides), loss = forward(inputs), backward(loss) (the backward and
    any gradient reduction), opt.step(), opt.zero_grad(set_to_none=True). simulated_oom:
    raise a CUDA OOM right after the forward (--simulate-oom). Returns (step seconds, losses)."""
    cuda = dev.type == "cuda"
    times, losses = [], []
    for s in range(steps):
        inputs = batch(s)
        if cuda:
            torch.cuda.synchronize(dev)
        dist.barrier()
        t0 = time.perf_counter()
        loss = forward(inputs)
        if simulated_oom:
            raise torch.cuda.OutOfMemoryError("simulated: CUDA out of memory (bench --simulate-oom)")
        backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return times, losses


def parse_simulated_oom(spec):
    """--simulate-oom ARM:LEN:RANK (the tests' OOM on one rank) -> (arm, len, rank), or None."""
    if not spec:
        return None
    arm, length, rank = spec.split(":")
    return arm, int(length), int(rank)


def finish(rank, workdir) -> None:
    """End of a sweep: every parent done, rank 0 removes the result files, the group closes."""
    dist.barrier()
    if rank == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    dist.destroy_process_group()


def torchrun_ranks(script):
    """(rank, world) of this torchrun parent, or None (with the usage printed) when the script
    is not run under torchrun on one host with >= 2 ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world < 2 or "LOCAL_WORLD_SIZE" in os.environ and int(os.environ["LOCAL_WORLD_SIZE"]) != world:
        print(f"{script}: run under torchrun on one host with >= 2 ranks, e.g.\n  "
              f"NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/{script}.py --out DIR")
        return None
    return rank, world
