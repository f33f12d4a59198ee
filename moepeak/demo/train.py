"""The demo job: one training loop used for moepeak's run and for plain PyTorch's
comparison run, checkpoint save/resume, and clean exit on Ctrl-C (see moepeak.demo for
what the demo shows; its command line is moepeak/demo/args.py).

run(argv) is the whole job as a function (tests call it); it returns a dict
with the losses (moepeak's and plain PyTorch's), the peak table and the settings.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..version import __version__
from . import peaks as peakmod
from .args import build_parser, config_from_args, validate_train
from .autoplace import place_demo
from .config import build_optimizer, param_count, resolve
from .context_parallel import cp_slice
from .data import TokenStream
from .models import MoELM
from .plot import plot_run

GiB = 2 ** 30


class Run:
    """Everything the job owns, so that Ctrl-C (or any error) can release it."""

    def __init__(self):
        self.model = None
        self.opt = None
        self.pg_owned = False

    def release_model(self):
        """Close and drop the model and optimizer (SCO's pinned arena, StreamAdamW's
        host state and threads), then return cached GPU memory."""
        for obj in (self.opt, self.model):
            for m in ([obj] if obj is self.opt else (obj.modules() if obj is not None else [])):
                fn = getattr(m, "close", None)
                if callable(fn):
                    with contextlib.suppress(Exception):
                        fn()
        self.opt = self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self):
        self.release_model()
        if self.pg_owned and dist.is_initialized():
            dist.destroy_process_group()
            self.pg_owned = False


class StopRequest:
    """SIGINT handler for the training loops: the first Ctrl-C asks the job to stop
    at the next step boundary (stop_point raises KeyboardInterrupt there), so no
    step, collective or optimizer copy is cut in half; a second Ctrl-C raises at once.
    Installed only from the main thread (signal handlers cannot be set elsewhere)."""

    def __init__(self):
        self.requested = False
        self._old = None

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
        return False

    def stop_point(self):
        if self.requested:
            raise KeyboardInterrupt


def _host_mem_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 50


def shard_model(model: MoELM, world: int) -> set:
    """FSDP2 on what every rank replicates. Experts (split by the EP group) stay
    rank-local; the Ring-DTP head weight becomes a Shard(0) DTensor the ring
    uses in place (its gradient arrives averaged over the ranks, as FSDP2's do).
    Returns the params whose gradient is a sum over ranks (the caller divides
    their .grad by `world` after backward)."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    # Gradients are reduce-scattered in fp32 and rounded once to the param
    # dtype (a bf16 reduction would round the sum of the ranks' partial
    # gradients once more than one process does).
    from torch.distributed.device_mesh import init_device_mesh
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    # The mesh's device type is the model's: without it FSDP2 picks CUDA
    # whenever a GPU is visible and would move a CPU model's params there.
    mesh = init_device_mesh("cuda" if model.embed.weight.is_cuda else "cpu", (world,))
    summed = set()
    for blk in model.layers:
        mine = {blk.moe.w_gate_up, blk.moe.w_down} if model.cfg.moe == "llep" else set()
        summed |= mine
        fully_shard(blk, mesh=mesh, ignored_params=mine or None, mp_policy=mp)
    ignored = set(summed)
    if model.cfg.head == "ring_dtp":
        model.head.shard_(mesh)
        ignored |= set(model.head.parameters())
    fully_shard(model, mesh=mesh, ignored_params=ignored or None, mp_policy=mp)
    return summed


class Progress:
    def __init__(self, total: int, enabled: bool, every: int, label: str = ""):
        self.total, self.enabled, self.every = total, enabled, max(1, every)
        self.tty = enabled and sys.stderr.isatty()
        self.label = label

    def update(self, step: int, loss: float, tok_s: float, peak: Optional[float]):
        if not self.enabled:
            return
        done = step + 1
        if not self.tty and done % self.every and done != self.total:
            return
        w = 24
        fill = int(w * done / max(1, self.total))
        pk = f" peak {peak / GiB:6.2f} GiB" if peak is not None else ""
        line = (f"{self.label}[{'#' * fill}{'.' * (w - fill)}] step {done:>5}/{self.total} "
                f"loss {loss:7.4f} {tok_s / 1e3:8.1f}k tok/s{pk}")
        if self.tty:
            sys.stderr.write("\r" + line)
            if done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            print(line, flush=True)


def params_text(cfg) -> str:
    """The model's parameter count as every line of the demo writes it (three significant
    digits: "0.256 M params", "245 M params")."""
    return f"{param_count(cfg) / 1e6:.3g} M params"


def warmup_cosine(warmup: int, horizon: int, floor: float):
    """LR multiplier at global step s: linear warmup (s+1)/warmup over the first
    `warmup` steps, then cosine from 1 down to `floor` at step `horizon`, flat after.
    E.g. warmup=15, horizon=150, floor=0.1: s=0 -> 0.067, s=14 -> 1, s=82 -> 0.55, s>=150 -> 0.1."""
    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        frac = min(1.0, (s - warmup) / max(1, horizon - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
    return f


def _ckpt_state(model, opt, local_names, rank):
    """(replicated/DTensor part, rank-local part). Rank-local params (experts of
    this EP rank, the Ring-DTP vocab shard) differ between ranks under the same
    name, so DCP would treat them as replicated and keep one copy: they are
    stored under a per-rank key instead, with their optimizer state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)  # StreamAdamW returns DTensor state for FSDP2 params
    local = {"model": {}, "optim": {}}
    for n in local_names:
        local["model"][n] = msd.pop(n)
        if n in osd.get("state", {}):
            local["optim"][n] = osd["state"].pop(n)
    return msd, osd, local


def save(path: str, model, opt, step: int, losses: List[float], local_names=(), rank=0):
    import torch.distributed.checkpoint as dcp
    msd, osd, local = _ckpt_state(model, opt, local_names, rank)
    sd = {"model": msd, "optim": osd, "meta": {"step": step, "losses": list(losses)}}
    if local_names:
        sd[f"local_rank{rank}"] = local
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=path)


def load(path: str, model, opt, local_names=(), rank=0):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    msd, osd, local = _ckpt_state(model, opt, local_names, rank)
    sd = {"model": msd, "optim": osd, "meta": {"step": 0, "losses": []}}
    if local_names:
        sd[f"local_rank{rank}"] = local
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=path)
    sd["model"].update(local["model"])
    sd["optim"].setdefault("state", {}).update(local["optim"])
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return int(sd["meta"]["step"]), list(sd["meta"]["losses"])


def run(argv=None) -> Dict:
    a = build_parser().parse_args(argv)
    res = Run()
    try:
        with StopRequest() as stop:
            return _run(a, res, stop)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            print("\nmoepeak demo: interrupted; releasing pinned memory, GPU memory and process groups",
                  file=sys.stderr)
        # drop the finished frames' locals (the autograd graph, live SCO boundaries)
        # so that close() can free the pinned arena and GPU memory right away
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        res.close()


class _Job:
    """What both training loops share: ranks, device, data, batch shape, LR schedule."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _train(job: _Job, model: MoELM, opt, start: int, steps: int, local_params, stop: StopRequest,
           progress: Progress, measure_first_step: bool = False, losses: Optional[List[float]] = None):
    """Train `steps` optimizer steps from global step `start`. Returns (losses,
    step_times, peak GPU bytes seen, first-step optimizer measurements); the
    losses are appended to `losses` when given (what an exception leaves is kept).
    Stops between steps on a Ctrl-C (on every rank at the same step: the request
    travels with the loss all-reduce)."""
    device, world, cuda = job.device, job.world, job.device.type == "cuda"
    for g in opt.param_groups:  # a loaded checkpoint may have stored a scheduled lr
        g["lr"] = g["initial_lr"] = job.lr
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: job.lr_at(start + i))
    losses = [] if losses is None else losses
    step_times, opt_meas, peak_seen = [], {}, 0
    # under several ranks a stop is taken only once every rank knows of it (from the
    # all-reduce), so that no rank is left waiting in a collective of the next step
    agreed_stop = False
    stop_now = (lambda: agreed_stop) if world > 1 else (lambda: stop.requested)
    for step in range(start, start + steps):
        if stop_now():
            raise KeyboardInterrupt
        if job.cp:  # one batch for the group, each rank takes its slice of every sequence
            x, y = (cp_slice(t, job.rank, world).to(device) for t in job.data.batch(step, job.B, job.T))
        else:
            x, y = job.data.batch(step, job.B, job.T, rank=job.rank, device=device)
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        if local_params and world > 1:
            # rank-local params got the sum over ranks of each rank's loss gradient;
            # FSDP averaged the rest: divide to match (global loss = mean over ranks;
            # under context parallelism MoELM scales each rank's loss so that this mean
            # is the full sequences' mean loss).
            for p in local_params:
                if p.grad is not None:
                    p.grad.div_(world)
        first = measure_first_step and cuda and step == start
        if first:  # isolate the first optimizer step (state is created there)
            peak_seen = max(peak_seen, torch.cuda.max_memory_allocated(device))
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        opt.step()
        if first:
            torch.cuda.synchronize(device)
            opt_meas = {"step_peak": torch.cuda.max_memory_allocated(device) - before,
                        "state": torch.cuda.memory_allocated(device) - before}
        sched.step()
        opt.zero_grad(set_to_none=True)
        # [loss, stop requested]: one all-reduce tells every rank the mean loss and
        # whether any rank was interrupted
        lv = torch.stack([loss.detach().float().reshape(()),
                          torch.tensor(float(stop.requested), device=loss.device)])
        if world > 1:
            dist.all_reduce(lv)
            lv[0] /= world
        lv, stopping = lv.tolist()
        agreed_stop = stopping > 0
        dt = time.perf_counter() - t0
        step_times.append(dt)
        losses.append(lv)
        if cuda:
            peak_seen = max(peak_seen, torch.cuda.max_memory_allocated(device))
        if not math.isfinite(lv):
            raise FloatingPointError(f"moepeak demo: loss is {lv} at step {step}")
        progress.update(step - start, lv, job.tok_step / dt, peak_seen if cuda else None)
    if stop_now():
        raise KeyboardInterrupt
    return losses, step_times, peak_seen, opt_meas


def _run(a, res: Run, stop: StopRequest) -> Dict:
    # ---- where, and how many ranks
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    dev_name = _device_name(a)
    cfg, train = config_from_args(a, dev_name)
    cp = world > 1 and (a.context_parallel is None or a.context_parallel)
    cfg = cfg.replace(context_parallel=cp)
    want = {"moe": a.llep, "head": a.ring_dtp, "checkpoint": a.sco, "optimizer": a.stream_adamw}
    if a.plain:
        want = dict.fromkeys(want, False)
    # ---- validate everything before any work
    validate_train(train, a)
    cfg.validate(world_size=world, seq_len=train["seq_len"], batch=train["batch"], dtype=train["dtype"],
                 arena_limit_bytes=_host_mem_bytes() // 2)
    cfg, opt_kind, notes = resolve(cfg, "stream", want_moepeak=want)
    # before anything is allocated: PlacementError (a ValueError) on a machine too small
    cfg, placed = place_demo(cfg, opt_kind, enabled=a.auto_placement, device=torch.device(dev_name), world=world,
                             batch=train["batch"], seq_len=train["seq_len"], dtype=train["dtype"],
                             bucket_mb=a.bucket_mb, state_dtype=a.state_dtype)
    rank, group, device = _join_ranks(world, dev_name, res)
    say = (lambda *x: print(*x, flush=True)) if (rank == 0 and not a.quiet) else (lambda *x: None)
    T, B, steps = train["seq_len"], train["batch"], train["steps"]
    data = TokenStream(a.data, seed=a.seed, max_bytes=max(1 << 16, int(a.data_mb * 2 ** 20)))
    job = _Job(world=world, rank=rank, device=device, cp=cp, data=data, B=B, T=T, lr=train["lr"],
               tok_step=B * T if cp else B * T * world)  # tokens per optimizer step, all ranks
    _say_settings(say, a, job, cfg, train, opt_kind, notes, placed)

    # ---- model + optimizer
    build = functools.partial(_build, a, job, group, train, placed, res)  # build(cfg, opt_kind)
    model, opt, local_params = build(cfg, opt_kind)
    local_names = sorted(n for n, p in model.named_parameters() if p in local_params)  # rank-local: saved per rank
    start, losses = 0, []
    if a.resume:
        start, losses = load(a.resume, model, opt, local_names, rank)
        say(f"resumed from {a.resume} at step {start}")
    # the LR schedule is a function of the global step, so a resumed run continues it
    job.lr_at = warmup_cosine(train["warmup"], a.lr_horizon or (start + steps), a.min_lr_ratio)

    # ---- train
    every = a.log_every or max(1, steps // 10)
    show = rank == 0 and not a.quiet
    new, step_times, peak_seen, opt_meas = _train(job, model, opt, start, steps, local_params, stop,
                                                  Progress(steps, show, every), measure_first_step=True)
    losses += new
    if steps:
        k = max(1, min(10, len(new) // 5))
        say(f"loss: first {sum(new[:k]) / k:.4f} -> last {sum(new[-k:]) / k:.4f} (mean of {k} steps)"
            + (f"; peak GPU memory {peak_seen / GiB:.2f} GiB" if device.type == "cuda" else ""))
    if a.save:
        save(a.save, model, opt, start + steps, losses, local_names, rank)
        say(f"saved step {start + steps} to {a.save}")
    table = _peak_table(a, job, model, cfg, opt_kind, opt, opt_meas, stop, say)

    # ---- the same model, weights and batches in plain PyTorch
    plain = _compare(a, job, train, cfg, opt_kind, start, steps, res, build, stop, say, show, every)
    if plain["losses"]:
        n = len(plain["losses"])
        plain["max_abs_diff"] = max(abs(p - m) for p, m in zip(plain["losses"], new))
        say(f"plain PyTorch, same weights and batches: {n} step(s), max |loss - moepeak's| = "
            f"{plain['max_abs_diff']:.3g}")
    if plain["note"]:
        say(f"plain PyTorch: {plain['note']}")
    if a.plot and rank == 0:
        title = (f"moepeak demo: {params_text(cfg)}, {job.tok_step} tokens/step, "
                 f"{str(train['dtype']).replace('torch.', '')}, {device.type} x{world}")
        plot_run(a.plot, losses, start, plain, table, title, say)
    return {"losses": losses, "start": start, "step_times": step_times, "peak": peak_seen, "cfg": cfg,
            "optimizer": opt_kind, "peaks": table, "tokens_per_step": job.tok_step, "notes": notes,
            "data": data.source, "plain": plain, "placement": placed}


def _device_name(a) -> str:
    """--device, or cuda when torch sees one, else cpu; refused unless cuda or cpu and usable."""
    dev_name = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_name not in ("cuda", "cpu"):
        raise ValueError(f"moepeak demo: --device must be cuda or cpu, got {a.device!r}")
    if dev_name == "cuda" and not torch.cuda.is_available():
        raise ValueError("moepeak demo: --device cuda, but torch sees no CUDA device")
    return dev_name


def _join_ranks(world: int, dev_name: str, res: Run):
    """(rank, group, device): the default group if world > 1 (res owns it if started here); CUDA: LOCAL_RANK's."""
    rank, group = 0, None
    if world > 1:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev_name == "cuda" else "gloo")
            res.pg_owned = True
        rank, group = dist.get_rank(), dist.group.WORLD
    if dev_name == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, group, torch.device("cuda", local)
    return rank, group, torch.device("cpu")


def _say_settings(say, a, job: _Job, cfg, train, opt_kind, notes, placed) -> None:
    """The run's header: version and device, model, data and batch, LR, schedules, notes, placement."""
    world, device, B, T, steps = job.world, job.device, job.B, job.T, train["steps"]
    say(f"moepeak {__version__} demo on {device} x{world}, torch {torch.__version__}")
    say(f"model: {params_text(cfg)}; L={cfg.layers} H={cfg.hidden} heads={cfg.heads}/"
        f"{cfg.kv_heads} E={cfg.experts} K={cfg.top_k} I={cfg.intermediate} V={cfg.vocab_size} "
        f"{str(train['dtype']).replace('torch.', '')}")
    split = (f"step, context parallel over {world} ranks ({B} x {T // world} tokens per rank)" if job.cp
             else "step per rank")
    say(f"data: {job.data.source} ({len(job.data) / 1e6:.1f} M byte tokens); {B} x {T} = {B * T} tokens per "
        f"{split}, {steps} steps")
    say(f"learning rate: {train['lr']:g} peak, {train['warmup']} warm-up steps, cosine to {a.min_lr_ratio:g} x")
    say("schedules: moe=%s head=%s checkpoint=%s optimizer=%s" % (cfg.moe, cfg.head, cfg.checkpoint, opt_kind))
    for n in notes:
        say("  note: " + n)
    if placed.placement is not None or device.type == "cuda":  # on CPU a no-op: the report stays as it was
        for line in placed.lines():
            say(line)


def _build(a, job: _Job, group, train, placed, res: Run, cfg, opt_kind):
    """(model, optimizer, rank-local params), both kept in res so that an error or Ctrl-C releases them."""
    model = MoELM(cfg, group=group, world_size=job.world, device=job.device, dtype=train["dtype"], seed=a.seed)
    res.model = model
    local_params = shard_model(model, job.world) if job.world > 1 else set()
    if placed.placement is not None and cfg.checkpoint == "sco":
        model.sco.reconfigure(arena_bytes=placed.arena_bytes())  # one pinned chunk for the step
    res.opt = build_optimizer(model.parameters(), opt_kind, lr=train["lr"], weight_decay=0.0,
                              bucket_mb=a.bucket_mb,
                              state_dtype=getattr(torch, a.state_dtype) if a.state_dtype else None,
                              device_state_bytes=placed.device_state_bytes() if opt_kind == "stream" else 0)
    return model, res.opt, local_params


def _peak_table(a, job: _Job, model, cfg, opt_kind, opt, opt_meas, stop: StopRequest, say):
    """The per-component peak table (single-process runs only; None with --no-peaks)."""
    if not a.no_peaks and job.world > 1:
        say("(the per-component peak table is measured in single-process runs only)")
    if a.no_peaks or job.world != 1:
        return None
    stop.stop_point()
    table = peakmod.measure(model, cfg, opt_kind, opt, job.data, job.B, job.T, job.device, opt_meas)
    say(peakmod.format_table(table, cfg, job.B * job.T, job.device))
    return table


def _compare(a, job, train, cfg, opt_kind, start, steps, res, build, stop, say, show, every) -> Dict:
    """Plain PyTorch from the same initial weights over the same batches (steps start ..
    start+n-1). Returns {"losses": [...], "note": why it is shorter or absent}."""
    plain_cfg = cfg.plain()
    out = {"losses": [], "note": "", "oom_step": None}
    n = steps if train["compare_steps"] is None else min(steps, train["compare_steps"])
    on = a.compare if a.compare is not None else not (job.world > 1 and job.device.type == "cuda")
    if (cfg.moe, cfg.head, cfg.checkpoint, opt_kind) == (plain_cfg.moe, plain_cfg.head,
                                                          plain_cfg.checkpoint, "torch"):
        out["note"] = "this run is plain PyTorch already"
    elif not on or n == 0:
        out["note"] = "comparison off (--compare to turn it on)" if not on else "--compare-steps 0"
    elif start:
        out["note"] = "no comparison for a resumed run (plain PyTorch would need the steps before it)"
    if out["note"]:
        return out
    res.release_model()  # moepeak's model and optimizer: free their memory for the plain run
    model, opt, local_params = build(plain_cfg, "torch")
    say(f"plain PyTorch ({plain_cfg.moe} MoE, {plain_cfg.head} head + F.cross_entropy, checkpoint="
        f"{plain_cfg.checkpoint}, torch.optim.AdamW), same weights and batches, {n} steps:")
    prog = Progress(n, show, every if a.log_every else max(1, n // 10), label="plain   ")
    try:
        _train(job, model, opt, start, n, local_params, stop, prog, losses=out["losses"])
    except torch.cuda.OutOfMemoryError:
        # one process unless --compare was given under torchrun (see its help)
        out["oom_step"] = start + len(out["losses"])
        out["note"] = f"out of GPU memory at step {out['oom_step'] + 1} ({job.tok_step} tokens per step)"
    finally:
        model = opt = None
        res.release_model()
    return out


def main(argv=None) -> int:
    try:
        run(argv)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    return 0
