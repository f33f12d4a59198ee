"""Benchmark: Ring-DTP over P ranks (torchrun), bf16 forward + backward.

Problem (the same in every arm): rank r has its own tokens X_r: [T_r, H] and
labels y_r: [T_r], and the vocab shard W_r: [V/P, H] (rows [r*V/P, (r+1)*V/P)
of the lm_head, as FSDP2 / a vocab-parallel lm_head holds it). Each rank
reports the mean loss of its own tokens; gradients are those of the sum of
all ranks' losses: dX_r, and dW_r for the rank's shard (Ring-DTP's contract).

Arms, in one process per rank, on the same inputs:
  ring_weights / ring_activations / ring_auto / ring_gather
      moepeak.linear_cross_entropy(X_r, W_r, y_r, group=WORLD, ring=...), over
      the default transport (torch.distributed on the nccl group) and, for the
      two variants and gather, moepeak's NCCL-from-C transport (transport column
      "nccl"). ring_gather is moepeak's all-gather schedule (the whole weight, the
      single-device op, each shard's gradient summed at its owner).
      The bench hands the ring its own NcclTransport as linear_cross_entropy's
      `transport` (a Transport instance; transport="nccl" selects the same class
      through a shared communicator).
  megatron_vp
      Megatron-style vocab-parallel cross-entropy, plain PyTorch autograd
      (_VocabParallelCE below): all-gather the hidden (every rank sees all
      P*T_r tokens), logits shard [P*T_r, V/P] in bf16, its fp32 copy, all-
      reduce of the row max, of the target logit and of sum-exp; backward
      softmax - onehot in place in the fp32 copy, through autograd into the
      GEMMs; the hidden's gradient reduce-scattered back.
  allgather_w
      all-gather the full weight [V, H], the single-GPU moepeak op on the local
      tokens, the weight gradient [V, H] reduce-scattered back to the shards.
  compute_only_{weights,activations}
      the ring schedule driven by LocalTransport: every exchange is a local
      copy of the same bytes (send -> recv on this GPU), so it runs exactly
      the ring's kernels and GEMMs with no link traffic (same shapes: every
      rank has the same T_r and V/P). t_compute. Its numbers are not the
      problem's (each rank folds its own shard P times), so no error column.
  comm_only_{weights,activations} (per transport)
      the exchanges the ring issued (recorded through RecordingTransport in a
      compute-only call: same sizes, order and peers) replayed back to back
      with no compute. t_comm. Issued all at once they serialise on the
      transport's one stream, as in the ring.
For a ring arm: exposed = t_ring - t_compute; hidden_frac = 1 - exposed /
t_comm (raw, not clamped: > 1 means the ring ran faster than its compute-only
reference, which also pays the local copies, ~1% of it; < 0 means more time
exposed than the transfers take alone). megatron_vp and allgather_w: t_comm
is their collectives alone; those block the compute that needs them, so
nothing of it is hidden (hidden_frac left empty).

Per arm and shape: per-rank peak = max_memory_allocated - allocated before
the call (inputs excluded; dX and dW included), max over ranks; time = median
of --iters fwd+bwd timed with CUDA events on each rank (p10, p90 too), max
over ranks. Errors: norm-wise relative error of the rank's loss, dX and dW
shard against an fp32 reference (megatron_vp's arithmetic on fp32 copies of
the inputs, TF32 off), max over ranks; max_rel_err is the largest of the
three (megatron_vp in bf16 is the naive-bf16 yardstick). An OOM (or any
error) is recorded as the arm's status on every rank, never a crash; the
ranks agree on it with an all-reduce after each arm.

  NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/bench_ring_dtp_dist.py --out DIR [--quick]
  torchrun --nproc_per_node=2 benchmarks/bench_ring_dtp_dist.py --smoke        # CPU, gloo, tiny shapes
Rows go to DIR/ring_dtp_dist.csv (rank 0 appends after each shape).

over 500 lines: every arm of the comparison in one script, so that they run in one process per
rank on the same inputs (docs/design.md section 4, benchmarks).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
from _common import append_results, cuda_times_ms, is_oom, peak_above, relerr, wall_times_s  # noqa: E402
import moepeak  # noqa: E402
from moepeak.core import Handle, Transport  # noqa: E402

GiB = 1 << 30
IGNORE = -100
# torch >= 2.12 renames all_gather_into_tensor / reduce_scatter_tensor (*_single); the
# old names are what torch 2.4 .. 2.11 have, so keep them and keep the output readable.
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.")
FIELDS = ["P", "arm", "transport", "T_per_rank", "H", "V", "dtype", "peak_gib",
          "ms", "p10_ms", "p90_ms", "t_compute_ms", "t_comm_ms", "exposed_ms", "hidden_frac", "comm_gib",
          "err_loss", "err_dx", "err_dw", "max_rel_err", "status", "note"]
QUICK = [(32768, 4096, 151936)]
FULL = [(8192, 4096, 151936), (32768, 4096, 151936), (16384, 7168, 256000)]
SMOKE = [(96, 64, 512, torch.float32), (80, 48, 1000, torch.bfloat16)]


# ---------------------------------------------------------------------------
# Transports for the compute-only and comm-only references
# ---------------------------------------------------------------------------
class LocalTransport(Transport):
    """No link traffic: send_recv copies send into recv on this device, and
    all_gather repeats this rank's input for every rank (the bench's ranks
    all have the same shapes, so the ring's geometry is the real one)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def send_recv(self, send, dst, recv, src):
        recv.copy_(send)
        return Handle()

    def all_gather(self, out, inp):
        out.copy_(inp.unsqueeze(0).expand_as(out))

    def all_reduce_(self, t, op="sum"):
        raise NotImplementedError("LocalTransport: the ring does not all-reduce")


class RecordingTransport(Transport):
    """Forwards to `inner` and logs every exchange (kind, sizes, dtypes, peers)."""

    def __init__(self, inner: Transport):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.log = []

    def send_recv(self, send, dst, recv, src):
        self.log.append(("send_recv", tuple(send.shape), send.dtype, dst, tuple(recv.shape), recv.dtype, src))
        return self.inner.send_recv(send, dst, recv, src)

    def all_gather(self, out, inp):
        self.log.append(("all_gather", tuple(out.shape), out.dtype, tuple(inp.shape)))
        return self.inner.all_gather(out, inp)


def replay_fn(log, tr: Transport, dev):
    """A function issuing the logged exchanges on `tr`, back to back, then
    waiting for all of them; and the bytes this rank sends in them."""
    bufs = {}

    def buf(key, shape, dtype):
        if (key, shape, dtype) not in bufs:
            bufs[(key, shape, dtype)] = torch.empty(shape, dtype=dtype, device=dev)
        return bufs[(key, shape, dtype)]

    ops, sent = [], 0
    for op in log:
        if op[0] == "send_recv":
            _, ss, sd, dst, rs, rd, src = op
            ops.append(("sr", buf("s", ss, sd), dst, buf("r", rs, rd), src))
            sent += math.prod(ss) * torch.empty((), dtype=sd).element_size()
        else:
            _, os_, od, is_ = op
            inp = buf("s", is_, od)
            ops.append(("ag", buf("r", os_, od), inp))
            sent += inp.numel() * inp.element_size() * (tr.world_size - 1)

    def run():
        hs = []
        for op in ops:
            if op[0] == "sr":
                hs.append(tr.send_recv(op[1], op[2], op[3], op[4]))
            else:
                tr.all_gather(op[1], op[2])
        for h in hs:
            h.wait()
    return run, sent


# ---------------------------------------------------------------------------
# Baselines: Megatron-style vocab-parallel cross-entropy, all-gathered weight
# ---------------------------------------------------------------------------
class _GatherRows(torch.autograd.Function):
    """[n, ...] on each rank -> [P*n, ...] (rank-major); backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        P = dist.get_world_size(group)
        out = t.new_empty((P * t.shape[0],) + tuple(t.shape[1:]))
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        P = dist.get_world_size(ctx.group)
        out = g.new_empty((g.shape[0] // P,) + tuple(g.shape[1:]))
        dist.reduce_scatter_tensor(out, g.contiguous(), group=ctx.group)
        return out, None


class _VocabParallelCE(torch.autograd.Function):
    """Per-token loss [N] x fp32 from the logits shard [N, Vs] (global vocab ids
    [lo, lo + Vs)) of every rank, as Megatron's vocab-parallel cross-entropy:
    an fp32 copy z of the shard, all-reduce(max) of the row max, all-reduce(sum)
    of the target logit and of sum(exp(z - max)); z becomes the softmax shard in
    place and is kept for backward, where it becomes the logits' gradient
    (softmax - onehot) * g in place. Ignored labels: loss 0, gradient 0."""

    @staticmethod
    def forward(ctx, logits, target, lo, group):
        z = logits.float() if logits.dtype != torch.float32 else logits.clone()   # [N, Vs] x fp32
        m = z.amax(dim=1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z.sub_(m.unsqueeze(1))
        t = target - lo
        mine = (t >= 0) & (t < z.shape[1])          # the target column is in this shard
        tc = t.clamp(0, z.shape[1] - 1)
        zy = torch.where(mine, z.gather(1, tc.unsqueeze(1)).squeeze(1), torch.zeros_like(m))
        dist.all_reduce(zy, group=group)
        z.exp_()
        se = z.sum(dim=1)
        dist.all_reduce(se, group=group)
        valid = target != IGNORE
        loss = torch.where(valid, se.log() - zy, torch.zeros_like(zy))
        z.div_(se.unsqueeze(1))
        ctx.save_for_backward(z, tc, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        z, tc, mine, valid = ctx.saved_tensors
        rows = torch.arange(z.shape[0], device=z.device)
        z[rows, tc] -= mine.to(z.dtype)
        z.mul_((g * valid).unsqueeze(1))
        return z.to(ctx.dtype), None, None, None


def megatron_vp(x, w, y, group):
    """(this rank's mean loss, the objective sum_j loss_j, identical on every rank)."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    X = _GatherRows.apply(x, group)                       # [P*T, H]
    Y = torch.empty(P * y.shape[0], dtype=y.dtype, device=y.device)
    dist.all_gather_into_tensor(Y, y, group=group)        # [P*T]
    rows = _VocabParallelCE.apply(F.linear(X, w), Y, r * w.shape[0], group)
    per_rank = rows.view(P, -1).sum(1) / (Y != IGNORE).view(P, -1).sum(1).clamp_min(1)
    return per_rank[r], per_rank.sum()


def allgather_w(x, w, y, group):
    W = _GatherRows.apply(w, group)                       # [V, H]
    loss = moepeak.linear_cross_entropy(x, W, y)
    return loss, loss


def ring(variant, group, transport="auto"):
    def fn(x, w, y):
        loss = moepeak.linear_cross_entropy(x, w, y, group=group, ring=variant, transport=transport)
        return loss, loss
    return fn


def collectives_fn(kind, pb, group):
    """The collectives of megatron_vp or allgather_w alone; (fn, bytes each rank sends)."""
    P, T, H, Vs = pb.P, pb.T, pb.H, pb.w.shape[0]
    dev, dt = pb.dev, pb.w.dtype
    b = torch.empty((), dtype=dt).element_size()
    if kind == "megatron_vp":
        x, X = torch.empty(T, H, dtype=dt, device=dev), torch.empty(P * T, H, dtype=dt, device=dev)
        y, Y = torch.empty(T, dtype=torch.int64, device=dev), torch.empty(P * T, dtype=torch.int64, device=dev)
        s = torch.empty(P * T, dtype=torch.float32, device=dev)

        def fn():
            dist.all_gather_into_tensor(X, x, group=group)
            dist.all_gather_into_tensor(Y, y, group=group)
            for op in (dist.ReduceOp.MAX, dist.ReduceOp.SUM, dist.ReduceOp.SUM):
                dist.all_reduce(s, op=op, group=group)
            dist.reduce_scatter_tensor(x, X, group=group)
        f = (P - 1) / P
        return fn, int(f * (2 * P * T * H * b + P * T * 8) + 3 * 2 * f * P * T * 4)
    W = torch.empty(P * Vs, H, dtype=dt, device=dev)
    w = torch.empty(Vs, H, dtype=dt, device=dev)

    def fn():
        dist.all_gather_into_tensor(W, w, group=group)
        dist.reduce_scatter_tensor(w, W, group=group)
    return fn, int(2 * (P - 1) * Vs * H * b)


# ---------------------------------------------------------------------------
# Problem, measurement, agreement across ranks
# ---------------------------------------------------------------------------
class Problem:
    def __init__(self, T, H, V, dtype, dev, rank, P, seed=0):
        g = torch.Generator(device=dev).manual_seed(seed * 1000 + rank)
        self.T, self.H, self.V, self.P, self.dev = T, H, V, P, dev
        self.x = torch.randn(T, H, generator=g, device=dev).to(dtype).requires_grad_()
        # logits of std ~1, as bench_ring_dtp.py's data
        self.w = (torch.randn(V // P, H, generator=g, device=dev) / math.sqrt(H)).to(dtype).requires_grad_()
        self.y = torch.randint(0, V, (T,), generator=g, device=dev)

    def step_fn(self, fn):
        def step():
            self.x.grad = self.w.grad = None
            rep, obj = fn(self.x, self.w, self.y)
            obj.backward()
            return rep.detach()
        return step


def max_over_ranks(vals, dev):
    """Element-wise max over ranks of a list of floats (NaN = no value)."""
    t = torch.tensor([-math.inf if (v is None or math.isnan(v)) else float(v) for v in vals], dtype=torch.float64,
                     device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [math.nan if v == -math.inf else v for v in t.tolist()]


def times_ms(fn, dev, reps, warmup):
    dist.barrier(device_ids=[dev.index]) if dev.type == "cuda" else dist.barrier()  # start in step
    if dev.type == "cuda":
        return cuda_times_ms(fn, reps=reps, warmup=warmup)
    return [t * 1e3 for t in wall_times_s(fn, reps=reps, warmup=warmup)]


def _release(pb):
    pb.x.grad = pb.w.grad = None
    gc.collect()
    if pb.dev.type == "cuda":
        torch.cuda.empty_cache()


def measure(pb, fn, args, ref=None, first=None):
    """Run one arm: warm-up call (`first` may replace it), peak call (errors vs
    `ref` from its outputs), then --iters timed calls. Returns a dict of the
    row's measured fields (max over ranks) and the status agreed by all ranks."""
    step = pb.step_fn(fn) if fn is not None else None
    res, code, msg = {}, 0, ""
    try:
        (first or step)()
        if pb.dev.type == "cuda":
            # The warm-up's gradients go first: step() would free them inside the measured
            # call, and the peak, taken above the allocation before it, would come out
            # their size (dX + the dW shard: 0.83 GiB at the --quick shape) too low.
            pb.x.grad = pb.w.grad = None
            loss, peak = peak_above(step)
        else:
            loss, peak = step(), math.nan
        res["peak"] = peak / GiB
        if ref is not None:
            res["err"] = [relerr(loss, ref[0]), relerr(pb.x.grad, ref[1]), relerr(pb.w.grad, ref[2])]
        ts = times_ms(step, pb.dev, args.iters, args.warmup)
        res["t"] = [statistics.median(ts), _pct(ts, 10), _pct(ts, 90)]
    except Exception as e:  # OOM (or anything else) is a result
        code, msg = (1, "oom") if is_oom(e) else (2, f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        if code == 2:
            traceback.print_exc()
    _release(pb)
    return _agree(res, code, msg, pb.dev)


def measure_fn(pb, run, args):
    """Time a plain function (comm-only replays); no peak, no errors."""
    res, code, msg = {}, 0, ""
    try:
        ts = times_ms(run, pb.dev, args.iters, args.warmup)
        res["t"] = [statistics.median(ts), _pct(ts, 10), _pct(ts, 90)]
    except Exception as e:
        code, msg = (1, "oom") if is_oom(e) else (2, f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    _release(pb)
    return _agree(res, code, msg, pb.dev)


def _pct(ts, p):
    s = sorted(ts)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def _agree(res, code, msg, dev):
    codes = max_over_ranks([code], dev)
    worst = int(codes[0])
    if worst and not code:
        msg = "oom on another rank" if worst == 1 else "error on another rank"
    vals = [res.get("peak", math.nan)] + res.get("t", [math.nan] * 3) + res.get("err", [math.nan] * 3)
    vals = max_over_ranks(vals, dev)
    out = {"peak": vals[0], "t": vals[1:4], "err": vals[4:7], "status": "ok" if not worst else (msg or "failed")}
    return out


# ---------------------------------------------------------------------------
# One shape
# ---------------------------------------------------------------------------
def run_shape(T, H, V, dtype, args, dev, nccl_tr, nccl_why):
    P, r = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    base = dict(P=P, T_per_rank=T, H=H, V=V, dtype=str(dtype).replace("torch.", ""))
    rows = []

    def row(arm, transport, m, **kw):
        rw = dict(base, arm=arm, transport=transport, status=m["status"])
        if m["status"] == "ok":
            rw.update(peak_gib=_fmt(m["peak"], 3), ms=_fmt(m["t"][0], 2), p10_ms=_fmt(m["t"][1], 2),
                      p90_ms=_fmt(m["t"][2], 2))
            if not math.isnan(m["err"][0]):
                rw.update(err_loss=f"{m['err'][0]:.3e}", err_dx=f"{m['err'][1]:.3e}", err_dw=f"{m['err'][2]:.3e}",
                          max_rel_err=f"{max(m['err']):.3e}")
        rw.update({k: v for k, v in kw.items() if v is not None})
        rows.append(rw)
        return rw

    if V % P:
        raise SystemExit(f"V={V} must be divisible by P={P} (equal shards)")
    pb = Problem(T, H, V, dtype, dev, r, P, seed=args.seed)

    # fp32 reference (plain PyTorch: megatron_vp's arithmetic on fp32 copies)
    ref, ref_status = None, "ok"
    try:
        xf = pb.x.detach().float().requires_grad_()
        wf = pb.w.detach().float().requires_grad_()
        rep, obj = megatron_vp(xf, wf, pb.y, group)
        obj.backward()
        ref = (rep.detach(), xf.grad, wf.grad)
        del xf, wf, rep, obj
    except Exception as e:
        ref_status = "oom" if is_oom(e) else f"error: {type(e).__name__}: {e}"
    _release(pb)
    if _agree({}, 0 if ref_status == "ok" else 1, ref_status, dev)["status"] != "ok":
        ref = None  # every rank drops it, so the arms' error all-reduces stay in step
    transports = [("torch", None)] + ([("nccl", nccl_tr)] if nccl_tr is not None else [])

    # compute-only and comm-only references per variant
    t_comp, t_comm = {}, {}
    for variant in ("weights", "activations"):
        local = LocalTransport(r, P)
        rec = RecordingTransport(local)
        first = pb.step_fn(ring(variant, group, rec))  # the warm-up call records one call's exchanges
        m = measure(pb, ring(variant, group, local), args, first=first)
        log = rec.log
        if m["status"] == "ok":
            t_comp[variant] = m["t"][0]
        row(f"compute_only_{variant}", "none", m, note="ring kernels/GEMMs, exchanges as local copies")
        for tname, tr in transports:
            tr = tr if tr is not None else moepeak.get_transport(group)
            run, sent = replay_fn(log, tr, dev)
            m = measure_fn(pb, run, args)
            if m["status"] == "ok":
                t_comm[(variant, tname)] = m["t"][0]
            gbps = sent / (m["t"][0] * 1e-3) / 1e9 if m["status"] == "ok" and m["t"][0] > 0 else math.nan
            row(f"comm_only_{variant}", tname, m, comm_gib=_fmt(sent / GiB, 3),
                note=f"{len(log)} exchanges, {gbps:.0f} GB/s sent per rank")

    # the ring arms
    auto = "weights" if V // P <= T else "activations"  # ring_dtp.ring's rule (V_max <= T_max)
    arms = [("weights", "torch"), ("activations", "torch"), ("auto", "torch"), ("gather", "torch")]
    if nccl_tr is not None:
        arms += [("weights", "nccl"), ("activations", "nccl"), ("gather", "nccl")]
    for variant, tname in arms:
        real = auto if variant == "auto" else variant
        m = measure(pb, ring(variant, group, nccl_tr if tname == "nccl" else "auto"), args, ref=ref)
        kw = {}
        if m["status"] == "ok" and real in t_comp and (real, tname) in t_comm:
            tc, tm = t_comp[real], t_comm[(real, tname)]
            exposed = m["t"][0] - tc
            kw = dict(t_compute_ms=_fmt(tc, 2), t_comm_ms=_fmt(tm, 2), exposed_ms=_fmt(exposed, 2),
                      hidden_frac=_fmt(1 - exposed / tm, 3) if tm > 0 else None)
        note = f"auto -> {auto} (V/P={V // P} {'<=' if auto == 'weights' else '>'} T_r={T})" if variant == "auto" \
            else None
        row(f"ring_{variant}", tname, m, note=note, **kw)
    if nccl_tr is None:
        for variant in ("weights", "activations", "gather"):
            rows.append(dict(base, arm=f"ring_{variant}", transport="nccl", status=f"skipped: {nccl_why}"))

    # baselines
    for name, fn in (("megatron_vp", megatron_vp), ("allgather_w", allgather_w)):
        m = measure(pb, lambda x, w, y, fn=fn: fn(x, w, y, group), args, ref=ref)
        cfn, sent = collectives_fn(name, pb, group)
        mc = measure_fn(pb, cfn, args)
        kw = {}
        if mc["status"] == "ok":
            kw = dict(t_comm_ms=_fmt(mc["t"][0], 2), comm_gib=_fmt(sent / GiB, 3))
        note = "collectives block the compute that needs them" + ("" if name != "megatron_vp" else
                                                                  "; bf16 logits: the naive-bf16 error yardstick")
        row(name, "torch", m, note=note, **kw)
    if ref is None:
        for rw in rows:
            rw["note"] = (rw.get("note", "") + f"; no fp32 reference ({ref_status})").lstrip("; ")
    del pb, ref
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _fmt(v, nd):
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def print_table(rows):
    cols = [("arm", 24), ("transport", 9), ("peak_gib", 9), ("ms", 9), ("t_compute_ms", 12), ("t_comm_ms", 10),
            ("exposed_ms", 10), ("hidden_frac", 11), ("max_rel_err", 11), ("status", 8)]
    r0 = rows[0]
    print(f"\nP={r0['P']} T_r={r0['T_per_rank']} H={r0['H']} V={r0['V']} {r0['dtype']} "
          f"({torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, torch {torch.__version__})")
    print(" ".join(f"{c:>{w}}" for c, w in cols))
    for rw in rows:
        print(" ".join(f"{str(rw.get(c, '')):>{w}}" for c, w in cols))


# ---------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for ring_dtp_dist.csv (required unless --smoke)")
    ap.add_argument("--quick", action="store_true", help="T_r = 32k, H = 4096, V = 151936 only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU gloo ranks (checks errors, exits 1 "
                                                         "if an arm disagrees)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("run under torchrun, e.g. NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 "
                         "benchmarks/bench_ring_dtp_dist.py --out DIR")
    if args.out is None and not args.smoke:
        raise SystemExit("--out DIR is required (or --smoke)")
    if args.smoke:
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
        dev = torch.device("cpu")
        torch.set_num_threads(1)
        shapes = SMOKE
    else:
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        if not torch.cuda.is_available() or torch.cuda.device_count() <= local:
            raise SystemExit(f"needs a GPU per rank ({world} ranks, {torch.cuda.device_count()} GPUs visible); "
                             "use --smoke for the CPU path")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10))
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is fp32
        shapes = [s + (torch.bfloat16,) for s in (QUICK if args.quick else FULL)]
    rank = dist.get_rank()
    nccl_tr, nccl_why = None, "needs CUDA tensors (CPU smoke run)"
    if dev.type == "cuda":
        try:
            nccl_tr = moepeak.get_transport(dist.group.WORLD, device=dev, backend="nccl")
        except Exception as e:  # recorded as the NCCL arms' status
            nccl_why = f"NcclTransport unavailable: {e}"[:200]
    failed = []
    for T, H, V, dtype in shapes:
        t0 = time.perf_counter()
        rows = run_shape(T, H, V, dtype, args, dev, nccl_tr, nccl_why)
        if rank == 0:
            print_table(rows)
            print(f"({time.perf_counter() - t0:.0f} s)", flush=True)
            if args.out:
                append_results(args.out, "ring_dtp_dist", rows, FIELDS)
        if args.smoke:
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            for rw in rows:
                bad = rw["status"] != "ok" and not rw["status"].startswith("skipped")
                if bad or (rw.get("max_rel_err") and float(rw["max_rel_err"]) > tol):
                    failed.append((T, H, V, rw["arm"], rw["transport"], rw["status"], rw.get("max_rel_err")))
    if nccl_tr is not None:
        nccl_tr.close()
    dist.barrier()
    dist.destroy_process_group()
    if failed:
        if rank == 0:
            print("SMOKE FAILED:", *failed, sep="\n  ")
        sys.exit(1)
    if args.smoke and rank == 0:
        print("smoke ok")


if __name__ == "__main__":
    main()
