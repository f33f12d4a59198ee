"""The disk tier's spill file (moepeak._C.spill_*, csrc/spill.h) against dd in the
same directory: write then read --total-mb through the spill file in requests of
--request-mb with --depth in flight (from a ring of depth host buffers: pinned
when CUDA is here, else page-aligned), and

    dd if=/dev/zero of=DIR/FILE bs=1M count=TOTAL oflag=direct   (write)
    dd if=DIR/FILE of=/dev/null bs=1M iflag=direct               (read)

GB/s = bytes / wall seconds (1e9), best of --reps. Neither side fsyncs: O_DIRECT
writes have left the page cache when they return. Where the filesystem refuses
O_DIRECT the spill file runs buffered (column direct = 0: its numbers then
measure the page cache) and dd's direct runs are recorded as refused. Appends
one row to <out>/spill.csv.

    python benchmarks/bench_spill.py --dir /local/nvme --out benchmarks/results
    python benchmarks/bench_spill.py --smoke --out /tmp/x      # tiny sizes
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import append_results  # noqa: E402
from moepeak import _C  # noqa: E402
from moepeak.core.spill import HostBuffer  # noqa: E402

MiB = 1 << 20
FIELDS = ["dir", "fstype", "direct", "threads", "depth", "request_MiB", "total_MiB", "host_buffers",
          "spill_write_GBs", "spill_read_GBs", "dd_write_GBs", "dd_read_GBs", "note"]


class HostBuffers:
    """`count` 4096-aligned buffers of `nbytes`: pinned (moepeak.core.spill.HostBuffer) when CUDA is usable,
    else slices of one anonymous mmap (page-aligned); filled with random bytes, so every page is
    faulted in before timing."""

    def __init__(self, count, nbytes):
        self.pinned = bool(_C.has_cuda) and torch.cuda.is_available()
        self.map = None
        if self.pinned:  # HostBuffer: 4096-aligned by construction (cudaHostAlloc alone is not always)
            self.host = [HostBuffer(nbytes, pinned=True) for _ in range(count)]
            self.ptrs = [b.address for b in self.host]
        else:
            self.map = mmap.mmap(-1, count * nbytes)
            base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
            self.ptrs = [base + i * nbytes for i in range(count)]
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        for p in self.ptrs:
            ctypes.memmove(p, src.data_ptr(), nbytes)

    def free(self):
        if self.pinned:
            for b in self.host:
                b.free()
        self.ptrs = []  # the mmap is unmapped when this object dies (no exported views are kept)


def spill_pass(handle, bufs, is_write, request, total):
    """Seconds to move `total` bytes in requests of `request`, len(bufs) in flight."""
    submit = _C.spill_submit_write if is_write else _C.spill_submit_read
    depth, inflight = len(bufs.ptrs), []
    t0 = time.perf_counter()
    for k in range(total // request):
        if len(inflight) == depth:
            _C.spill_wait(handle, inflight.pop(0))
        inflight.append(submit(handle, bufs.ptrs[k % depth], request, k * request))
    for t in inflight:
        _C.spill_wait(handle, t)
    return time.perf_counter() - t0


def dd_pass(args):
    """(GB/s, None) of one dd run, from its own byte count and our wall clock; (None, why) if refused."""
    t0 = time.perf_counter()
    p = subprocess.run(["dd", *args], capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if p.returncode != 0:
        return None, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"dd exited {p.returncode}"
    m = re.search(r"^(\d+) bytes", p.stderr, re.MULTILINE)
    return (int(m.group(1)) / secs / 1e9 if m else None), None


def fstype(path):
    p = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="directory of the spill file and dd's file")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--total-mb", type=int, default=2048)
    ap.add_argument("--request-mb", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4, help="requests in flight (host buffers)")
    ap.add_argument("--threads", type=int, default=4, help="I/O threads of the spill file")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="16 MiB in 1 MiB requests, one rep")
    args = ap.parse_args()
    if args.smoke:
        args.total_mb, args.request_mb, args.depth, args.reps = 16, 1, 2, 1
    if args.total_mb % args.request_mb:
        ap.error("--total-mb must be a multiple of --request-mb")
    total, request = args.total_mb * MiB, args.request_mb * MiB

    bufs = HostBuffers(args.depth, request)
    handle = _C.spill_open(args.dir, total, threads=args.threads)
    direct = _C.spill_info(handle)["direct"]
    write_s = min(spill_pass(handle, bufs, True, request, total) for _ in range(args.reps))
    read_s = min(spill_pass(handle, bufs, False, request, total) for _ in range(args.reps))
    _C.spill_close(handle)
    bufs.free()

    dd_file = os.path.join(args.dir, f".bench-spill-dd-{uuid.uuid4().hex}")
    notes = []
    try:
        dd_w = [dd_pass(["if=/dev/zero", f"of={dd_file}", "bs=1M", f"count={args.total_mb}", "oflag=direct"])
                for _ in range(args.reps)]
        dd_r = [dd_pass([f"if={dd_file}", "of=/dev/null", "bs=1M", "iflag=direct"]) for _ in range(args.reps)]
    finally:
        if os.path.exists(dd_file):
            os.unlink(dd_file)
    best = {}
    for name, runs in (("write", dd_w), ("read", dd_r)):
        ok = [g for g, _ in runs if g is not None]
        best[name] = max(ok) if ok else None
        notes += [f"dd {name}: {why}" for g, why in runs[:1] if g is None]
    if not direct:
        notes.append("spill file buffered (filesystem refused O_DIRECT): page-cache numbers")

    row = {"dir": args.dir, "fstype": fstype(args.dir), "direct": int(direct), "threads": args.threads,
           "depth": args.depth, "request_MiB": args.request_mb, "total_MiB": args.total_mb,
           "host_buffers": "pinned" if bufs.pinned else "pageable",
           "spill_write_GBs": f"{total / write_s / 1e9:.3f}", "spill_read_GBs": f"{total / read_s / 1e9:.3f}",
           "dd_write_GBs": "" if best["write"] is None else f"{best['write']:.3f}",
           "dd_read_GBs": "" if best["read"] is None else f"{best['read']:.3f}", "note": "; ".join(notes)}
    print(f"{args.dir} ({row['fstype']}, O_DIRECT {bool(direct)}), {args.total_mb} MiB in {args.request_mb} MiB "
          f"requests, depth {args.depth}, {args.threads} I/O threads, {row['host_buffers']} buffers")
    for way, flag in (("write", "oflag"), ("read", "iflag")):
        print(f"  spill {way:5s} {row[f'spill_{way}_GBs']:>8} GB/s   "
              f"dd {flag}=direct {row[f'dd_{way}_GBs'] or 'refused':>8} GB/s")
    for n in notes:
        print("  note:", n)
    path = append_results(args.out, "spill", [row], fields=FIELDS)
    print("appended", path)


if __name__ == "__main__":
    main()
