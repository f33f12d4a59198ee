"""Transport benchmark: moepeak's NCCL-from-C transport vs torch.distributed.

What it measures (time per operation, CUDA events, median of >= 20 after warm-up):
  * >= 2 GPUs (under torchrun): a send/recv ring between the ranks (each rank
    sends S bytes to rank+1 and receives S bytes from rank-1), an equal-split
    all-to-all-v of S bytes per rank, and an all-reduce (float32, sum) of
    S bytes, for S = 4 KiB .. 1 GiB, with both transports on the same buffers.
    The time reported is the max over ranks; bandwidth = S / time (per rank,
    per direction). The GPU link (nvidia-smi topo -m, peer access) is printed
    and saved next to the CSV.
  * 1 GPU (plain python): the ceiling and the overhead of each path:
    device-to-device copy (torch copy_, S bytes read + S written), the NCCL
    transport's send/recv to self and all-to-all-v with one rank, and
    torch.distributed with the nccl backend at world size 1 (its all-to-all;
    TorchDistTransport.send_recv to self is a plain copy_, measured as such).
The small sizes give the latency of each path (what the schedules' per-chunk
all-to-alls and scalar all-reduces pay); the large ones the bandwidth.

Usage:
  python benchmarks/bench_transport.py --out benchmarks/results [--quick]
  NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/bench_transport.py --out benchmarks/results [--quick]
Appends rows to OUT/transport.csv (after _common.RESULT_COLUMNS: the NCCL
versions, world size, transport, op, bytes, median/p10/p90 us, GB/s, status).
An OOM or an error is recorded as that row's status, never a crash.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import statistics
import subprocess
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import append_results  # noqa: E402
from moepeak import _C  # noqa: E402
from moepeak.core import TorchDistTransport  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
FIELDS = ["nccl_moepeak", "nccl_torch", "world_size", "transport", "op",
          "bytes", "iters", "median_us", "p10_us", "p90_us", "gbps", "status"]


def _init():
    """World from torchrun's env, else a one-rank world; returns (rank, world, device)."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        rank, world, local = 0, 1, 0
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    # gloo for host-side agreement (OOM flags, max over ranks), nccl for torch's transport.
    dist.init_process_group(backend="cpu:gloo,cuda:nccl", rank=rank, world_size=world)
    return rank, world, device


def _any(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # CPU tensor: gloo
    return bool(t.item())


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_op(fn, iters: int, warmup: int):
    """Per-iteration GPU time (us) of fn() on the current stream, sorted."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) * 1e3 for s, e in ev)


def _ops(world, rank, transports, nbytes, device):
    """(transport, op, fn) for every case at this size; buffers allocated here."""
    send = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    recv = torch.empty_like(send)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    cases = []
    if world == 1:
        cases.append(("baseline", "d2d_copy", lambda: recv.copy_(send)))
    split = nbytes // world
    a2a_s, a2a_r = send[: split * world], recv[: split * world]
    counts = [split] * world
    f32 = send.view(torch.float32)[: max(1, nbytes // 4)] if nbytes >= 4 else None
    for name, t in transports.items():
        cases.append((name, "sendrecv", lambda t=t: t.send_recv(send, nxt, recv, prv).wait()))
        if split > 0:
            cases.append((name, "all_to_all_v", lambda t=t: t.all_to_all_v(a2a_s, counts, a2a_r, counts).wait()))
        if f32 is not None and nbytes <= 256 * MiB:
            # fill with zeros so repeated sums stay finite
            cases.append((name, "all_reduce", lambda t=t: t.all_reduce_(f32, "sum")))
    return cases, (send, recv, f32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--quick", action="store_true", help="sizes x16 apart, 20 iterations (< 1 min)")
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_transport: needs a CUDA GPU", file=sys.stderr)
        return 2
    rank, world, device = _init()
    iters = args.iters or (20 if args.quick else 50)
    iters = max(20, iters)
    step = 16 if args.quick else 4
    sizes, s = [], 4 * KiB
    while s <= GiB:
        sizes.append(s)
        s *= step
    if args.quick and sizes[-1] != 256 * MiB:
        sizes.append(256 * MiB)

    transports = {"torch": TorchDistTransport(dist.group.WORLD)}
    nccl_err = None
    try:
        from moepeak.core.nccl import NcclTransport
        transports["moepeak_nccl"] = NcclTransport(dist.group.WORLD, device)
    except Exception as e:  # recorded, and the torch arm still runs
        nccl_err = f"{type(e).__name__}: {e}"
    if _any(nccl_err is not None):
        transports.pop("moepeak_nccl", None)

    now = datetime.datetime.now(datetime.timezone.utc)
    gpu = torch.cuda.get_device_name(device)
    meta = dict(nccl_moepeak=(_C.nccl_loaded() or ("-",))[0],
                nccl_torch=_torch_nccl_version(), world_size=world)
    rows = []
    if rank == 0:
        print(f"# {gpu} x{world}, torch {torch.__version__}, NCCL (torch) {meta['nccl_torch']}, "
              f"NCCL (moepeak) {meta['nccl_moepeak']}, {now.isoformat(timespec='seconds')}")
        if nccl_err:
            print(f"# moepeak NCCL transport unavailable: {nccl_err}")
        topo = _topology(world)
        print(topo)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"transport_topo_{world}gpu.txt"), "w") as f:
            f.write(f"{meta}\n{topo}\n")
        print(f"{'transport':>13} {'op':>13} {'bytes':>11} {'median us':>10} {'p10':>9} {'p90':>9} {'GB/s':>8}  status")
    for nbytes in sizes:
        try:
            cases, keep = _ops(world, rank, transports, nbytes, device)
            oom = False
        except torch.cuda.OutOfMemoryError:
            cases, keep, oom = [], None, True
        if _any(oom):  # every rank skips this size together (no one waits in NCCL for a peer)
            cases = [(n, "sendrecv", None) for n in transports]
        for name, op, fn in cases:
            status, med, p10, p90 = "ok", float("nan"), float("nan"), float("nan")
            if fn is None:
                status = "oom"
            else:
                if op == "all_reduce":
                    keep[2].zero_()
                try:
                    ts = time_op(fn, iters, warmup=3)
                    med, p10, p90 = statistics.median(ts), ts[len(ts) // 10], ts[(9 * len(ts)) // 10]
                except torch.cuda.OutOfMemoryError:
                    status = "oom"
                except Exception as e:  # e.g. an NCCL error: a result, not a crash
                    status = f"error: {type(e).__name__}: {str(e)[:120]}"
                if _any(status != "ok"):
                    status = status if status != "ok" else "error on another rank"
                med, p10, p90 = _max(med), _max(p10), _max(p90)
            gbps = nbytes / (med * 1e-6) / 1e9 if status == "ok" else float("nan")
            row = dict(meta, transport=name, op=op, bytes=nbytes, iters=iters, median_us=round(med, 2),
                       p10_us=round(p10, 2), p90_us=round(p90, 2), gbps=round(gbps, 2), status=status)
            rows.append(row)
            if rank == 0:
                print(f"{name:>13} {op:>13} {nbytes:>11} {med:>10.1f} {p10:>9.1f} {p90:>9.1f} {gbps:>8.1f}  {status}",
                      flush=True)
        del cases, keep
        torch.cuda.empty_cache()
    if rank == 0:
        _summary(rows)
        path = append_results(args.out, "transport", rows, FIELDS, gpu=gpu)
        print(f"# appended {len(rows)} rows to {path}")
    for t in transports.values():
        if hasattr(t, "close"):
            t.close()
    dist.destroy_process_group()
    return 0


def _torch_nccl_version() -> str:
    try:
        v = torch.cuda.nccl.version()
    except Exception:
        return "-"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _topology(world: int) -> str:
    lines = [f"GPUs visible: {torch.cuda.device_count()}"]
    n = torch.cuda.device_count()
    if n >= 2:
        lines.append("peer access 0<->1: " + str(torch.cuda.can_device_access_peer(0, 1)))
    smi = shutil.which("nvidia-smi")
    if smi and n >= 2:
        try:
            lines.append(subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20).stdout)
        except Exception as e:
            lines.append(f"nvidia-smi topo -m failed: {e}")
    return "\n".join(lines)


def _summary(rows):
    """Per op: the median over sizes of time(moepeak_nccl) / time(torch); < 1 means NCCL-from-C is faster."""
    by = {}
    for r in rows:
        if r["status"] == "ok":
            by.setdefault((r["op"], r["bytes"]), {})[r["transport"]] = r["median_us"]
    print("# time ratio moepeak_nccl / torch (median over sizes; < 1: moepeak's transport is faster)")
    for op in ("sendrecv", "all_to_all_v", "all_reduce"):
        small = [v["moepeak_nccl"] / v["torch"] for (o, b), v in by.items()
                 if o == op and len(v) == 2 and b <= MiB]
        large = [v["moepeak_nccl"] / v["torch"] for (o, b), v in by.items()
                 if o == op and len(v) == 2 and b > MiB]
        if small or large:
            fmt = lambda xs: f"{statistics.median(xs):.3f} over {len(xs)} sizes" if xs else "-"  # noqa: E731
            print(f"#   {op:>13}: <= 1 MiB {fmt(small)}; > 1 MiB {fmt(large)}")


if __name__ == "__main__":
    sys.exit(main())
