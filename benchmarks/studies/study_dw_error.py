"""Study: dW's error against fp64 when Ring-DTP's fused modes accumulate dW in
bf16 over n token chunks, with and without the finish (ring_dtp.sched.fused: the label
column of every chunk's dZ taken out of the per-chunk GEMMs and added once in fp32,
ring_dtp.blocks.finish_dw) and with the centering too (the dW GEMMs on X - mu, colsum(dZ) mu^T
added in the finish; RingDTPOptions.center_chunks), beside vocab_outer_lowp's dX error with and without its
mirror, dX's finish (each token's label term tc[t] * W[y_t] taken out of the per-vocab-block
dX GEMMs and added once in fp32, ring_dtp.blocks.finish_dx). Errors are norm-wise relative,
divided by naive bf16's (F.linear in bf16, then F.cross_entropy(.float())).

Inputs are chosen to stress the accumulation: labels uniform over V (a dW row
rarely gets its label in more than one chunk), Zipf(1.1) (frequent labels in
every chunk, as in real text) or a 64-token vocabulary in use (byte-level, as the
demo); hidden states randn plus `--x-mean` times one shared random direction (the
anisotropy of real final hidden states makes the non-label terms of a dW row
add up coherently over chunks).

  python benchmarks/study_dw_error.py                      # CPU, small shapes
  python benchmarks/study_dw_error.py --device cuda --T 8192 --H 4096 --V 151936

CPU runs apply the bf16 rounding of the logits that CUDA's GEMM output has, and
CUDA's two roundings of each accumulating GEMM (rn(acc + rn(product))), so the same
numerics are studied; they are not timings.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moepeak  # noqa: E402
from _common import relerr, ring_dtp_options  # noqa: E402


def make_inputs(T, H, V, labels, x_mean, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) + x_mean * torch.randn(1, H, generator=g)
    w = torch.randn(V, H, generator=g) / H ** 0.5
    if labels == "uniform":
        y = torch.randint(0, V, (T,), generator=g)
    elif labels == "zipf":
        p = torch.arange(1, V + 1, dtype=torch.float64) ** -1.1
        y = torch.multinomial(p / p.sum(), T, replacement=True, generator=g)
    elif labels == "bytes":
        y = torch.randint(0, min(64, V), (T,), generator=g)
    else:
        raise ValueError(f"labels must be uniform, zipf or bytes, got {labels!r}")
    return (x.to(device, torch.bfloat16), w.to(device, torch.bfloat16), y.to(device))


def grads(fn, x, w, y, dtype=None):
    """(dX, dW) of fn at leaves of x's dtype, or of `dtype` (fp64 for the reference: its
    gradients must not be rounded back to bf16)."""
    xl = x.detach().to(dtype or x.dtype).requires_grad_()
    wl = w.detach().to(dtype or w.dtype).requires_grad_()
    fn(xl, wl, y).backward()
    return xl.grad, wl.grad


# The fused_lowp variants of a cell: finish + centering, finish only, neither.
VARIANTS = {"center": dict(center_chunks=0), "finish": dict(center_chunks=1 << 30),
            "none": dict(dw_finish=False, center_chunks=1 << 30)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=128)
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--chunks", default="1,8,20,64")
    ap.add_argument("--labels", default="uniform,zipf,bytes")
    ap.add_argument("--x-mean", default="0,1,3")
    args = ap.parse_args()
    T, H, V = args.T, args.H, args.V
    print(f"dW / dX error vs fp64 relative to naive bf16's; T={T} H={H} V={V} on {args.device}, torch "
          f"{torch.__version__}")
    print(f"{'labels':8s} {'x_mean':>6s} {'naive dW':>9s}  " + "  ".join(
        f"n={n}: center / finish / none" for n in args.chunks.split(",")) + "  vocab_outer_lowp dX: finish / none")
    for labels in args.labels.split(","):
        for xm in (float(a) for a in args.x_mean.split(",")):
            x, w, y = make_inputs(T, H, V, labels, xm, args.device)
            xd, wd = grads(lambda a, b, c: F.cross_entropy(a @ b.T, c), x, w, y, torch.float64)
            nx, nw = grads(lambda a, b, c: F.cross_entropy(F.linear(a, b).float(), c), x, w, y)
            ex, ew = relerr(nx, xd), relerr(nw, wd)
            cells = []
            for n in (int(a) for a in args.chunks.split(",")):
                errs = []
                for how in VARIANTS.values():
                    op = functools.partial(moepeak.linear_cross_entropy, mode="fused_lowp", chunk_tokens=-(-T // n),
                                           options=ring_dtp_options(**how))
                    errs.append(relerr(grads(op, x, w, y)[1], wd) / ew)
                cells.append(" / ".join(f"{e:5.2f}" for e in errs))
            dx_errs = []
            for how in (True, False):
                vo = functools.partial(moepeak.linear_cross_entropy, mode="vocab_outer_lowp",
                                       options=ring_dtp_options(dx_finish=how))
                dx_errs.append(relerr(grads(vo, x, w, y)[0], xd) / ex)
            print(f"{labels:8s} {xm:6.1f} {ew:9.2e}  " + "  ".join(f"{c:>26s}" for c in cells)
                  + "  " + " / ".join(f"{e:5.2f}" for e in dx_errs))


if __name__ == "__main__":
    main()
