"""Probes (GPU): which GEMM paths torch offers here and what they cost.
  1. torch._grouped_mm bf16 x bf16 with out_dtype=fp32 (2D x 3D, MoE shapes) vs bf16 out.
  2. torch._grouped_mm 2D x 2D (weight-gradient form) with empty groups: what lands there.
  3. Ring-DTP chunk GEMMs: dX and dW+= of one chunk issued on two streams vs one.
  4. The BLAS library torch dispatches plain bf16 GEMMs to (cuBLAS vs cuBLASLt): Ring-DTP's
     three chunk GEMMs and the whole fused_lowp op at T = 32k, H = 4096, V = 151936.
  5. The cost of fused_lowp's centering (RingDTPOptions.center_chunks): one chunk's gradient
     kernel alone, with the column sum of dZ as a [1, n] x [n, V] GEMM after it, and with the
     sum made in the kernel (RingDTPOptions.fused_colsum); the whole op at T = 32k (16 chunks) with
     the centering off and on both ways, in rotating rounds.
  6. TunableOp (torch.cuda.tunable: cuBLAS's default plus cuBLASLt's top heuristic algorithms,
     each timed, the fastest kept): Ring-DTP's three chunk GEMMs, the 8192^3 probe and the whole
     fused_lowp op at T = 32k, default vs tuned in alternating rounds (after one tuning pass).
  8. The logits block's layout: fused_lowp's three chunk GEMMs with the block token-major
     ([n, V], today's) and vocab-major ([V, n], so Z = W X^T, dW = Z X, dX = Z^T W): each GEMM
     alone, then 16 chunks of all three in alternating rounds (sustained clocks).
  7. dW's finish (B.finish_dw) at T = 32k, H = 4096, V = 151936, bf16: label terms only (uniform
     labels, Zipf labels, and Zipf's counts on shuffled ids) and with the centering's rank-1
     term (every row), against the bytes it moves.
  python benchmarks/probe_gemm_paths.py [grouped] [streams] [blas] [center[=rounds]] [tunable[=rounds]]
      [finish] [rounding] [layout[=rounds]]
  (default: all but tunable)
"""
import sys

import torch

from _common import cuda_time_ms, ring_dtp_options


def t(fn, iters=10):
    return cuda_time_ms(fn, reps=iters, warmup=3)


def grouped():
    E, H, I, C = 128, 2880, 2880, 32768
    for name, counts in (("balanced", [C // E] * E), ("4 hot", [C // 4] * 4 + [0] * (E - 4))):
        offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        x = torch.randn(C, H, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16)
        fl = 2 * C * H * I / 1e9
        tb = t(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs))
        try:
            r = torch._grouped_mm(x, w.transpose(1, 2), offs=offs, out_dtype=torch.float32)
            ref = torch._grouped_mm(x, w.transpose(1, 2), offs=offs).float()
            tf = t(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs, out_dtype=torch.float32))
            err = float((r - ref).abs().max() / ref.abs().max())
            print(f"grouped {name}: bf16 out {tb:.3f} ms ({fl / tb:.0f} TF/s), fp32 out {tf:.3f} ms "
                  f"({fl / tf:.0f} TF/s) dtype {r.dtype} rel diff vs bf16 {err:.2e}")
        except Exception as e:
            print(f"grouped {name}: bf16 out {tb:.3f} ms; fp32 out unsupported: {type(e).__name__}: {str(e)[:200]}")
    # 2D x 2D with an empty group
    a = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 32, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([128, 128, 256], device="cuda", dtype=torch.int32)
    for trial in range(2):
        torch.cuda.empty_cache()
        junk = torch.full((3, 64, 32), 7.0, device="cuda", dtype=torch.bfloat16)
        del junk
        r = torch._grouped_mm(a.t(), b, offs=offs)
        print(f"2Dx2D empty group {trial}: shape {tuple(r.shape)}, group1 max|.| {float(r[1].abs().max())}, "
              f"group0 err {float((r[0].float() - a[:128].t().float() @ b[:128].float()).abs().max()):.3e}")


def ring_streams():
    H, V = 4096, 151936
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16)
    dw = torch.zeros(V, H, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    for ct in (1728, 2048):
        x = torch.randn(ct, H, device="cuda", dtype=torch.bfloat16)
        z = torch.randn(ct, V, device="cuda", dtype=torch.bfloat16)
        dx = torch.empty(ct, H, device="cuda", dtype=torch.bfloat16)

        def seq():
            torch.mm(z, w, out=dx)
            dw.addmm_(z.t(), x)

        def conc():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.mm(z, w, out=dx)
            dw.addmm_(z.t(), x)
            torch.cuda.current_stream().wait_stream(side)

        def conc2():  # dX as two vocab halves on two streams (fp32 out then sum): not exact order; timing only
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.mm(z, w, out=dx)
            torch.cuda.current_stream().wait_stream(side)
            dw.addmm_(z.t(), x)
        print(f"ct={ct}: dX;dW sequential {t(seq):.3f} ms, dX on a side stream || dW {t(conc):.3f} ms, "
              f"side stream serialised {t(conc2):.3f} ms")


def _target_inputs():
    """The issue's target shape (H = 4096, V = 151936, fused_lowp's 2048-row chunks, T = 32k):
    H, V, ct, T, a seeded generator, w [V, H] (scaled like a trained head), x [T, H], y [T]."""
    H, V, ct, T = 4096, 151936, 2048, 32768
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5).to(torch.bfloat16)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    y = torch.randint(0, V, (T,), device="cuda", generator=g)
    return H, V, ct, T, g, w, x, y


def _fused_lowp_step(x, w, y):
    """(step, clear): one fused_lowp fwd + bwd on copies of x and w (step(options): with
    Ring-DTP's options), and what drops their gradients (step does it first, so a timed step
    does not hold the previous ones)."""
    import moepeak
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()

    def clear():
        xl.grad = wl.grad = None

    def op(options=None):
        clear()
        moepeak.linear_cross_entropy(xl, wl, y, mode="fused_lowp", options=options).backward()
    return op, clear


def blas_library():
    """Each of fused_lowp's chunk GEMMs (ct = 2048 rows) and the whole op, with torch's
    preferred BLAS library set to cuBLAS, then cuBLASLt, then cuBLAS again (drift check)."""
    H, V, ct, T, g, w, x, y = _target_inputs()
    z = torch.empty(ct, V, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(ct, H, device="cuda", dtype=torch.bfloat16)
    dw = torch.zeros(V, H, device="cuda", dtype=torch.bfloat16)
    xc = x[:ct]
    fl = 2.0 * ct * V * H / 1e9
    op, clear = _fused_lowp_step(x, w, y)

    keep = torch.backends.cuda.preferred_blas_library()
    try:
        for lib in ("cublas", "cublaslt", "cublas"):
            torch.backends.cuda.preferred_blas_library(lib)
            tz = t(lambda: torch.mm(xc, w.t(), out=z))
            tx = t(lambda: torch.mm(z, w, out=dx))
            tw = t(lambda: dw.addmm_(z.t(), xc))
            top = cuda_time_ms(op, reps=5, warmup=2)
            print(f"{lib:9s} Z {tz:.3f} ms ({fl / tz:.0f} TF/s)  dX {tx:.3f} ({fl / tx:.0f})  dW+= {tw:.3f} "
                  f"({fl / tw:.0f})  3 chunk GEMMs x 16 = {16 * (tz + tx + tw):.1f} ms;  op fwd+bwd {top:.1f} ms")
    finally:
        torch.backends.cuda.preferred_blas_library(keep)


def centering(rounds=8):
    import statistics
    from moepeak.ring_dtp import blocks as B
    H, V, ct, T, g, w, x, y = _target_inputs()
    # One chunk's gradient kernel alone, + the column sum as a ones-row GEMM, and fused into it.
    z0 = (torch.randn(ct, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
    z = z0.clone()
    yc = y[:ct].clone()
    m = z0.float().amax(1) + 1.0
    ls = torch.full((ct,), 9.0, device="cuda")
    q = torch.full((ct,), 0.5, device="cuda")
    one = torch.ones(1, device="cuda")
    cs = torch.zeros(V, device="cuda")
    part = torch.empty(B.COLSUM_GROUPS, V, device="cuda")
    ones = torch.ones(1, ct, device="cuda", dtype=torch.bfloat16)

    def grad(colsum=None):
        z.copy_(z0)  # the kernel works in place: time the copy too and subtract it
        B.grad_block(z, 0, V, yc, -100, 0.0, m, ls, q, one, 0.0, V, 0.0, torch.bfloat16, colsum=colsum)
    tcopy = t(lambda: z.copy_(z0))
    tg = t(grad) - tcopy
    tgg = t(lambda: (grad(), B.colsum_acc_(cs, z, ones, first=False))) - tcopy
    tgf = t(lambda: grad((cs, part, False))) - tcopy
    gb = ct * V * 2 * 2 / 1e9  # read + write
    print(f"gradient of one [{ct}, {V}] bf16 chunk (dZ in place): {tg:.3f} ms ({gb / tg:.2f} TB/s); "
          f"+ ones-row GEMM colsum {tgg:.3f} ms; with the colsum in the kernel {tgf:.3f} ms ({gb / tgf:.2f} TB/s)")
    op, clear = _fused_lowp_step(x, w, y)

    arms = (("off", 1 << 30, True), ("on, GEMM colsum", 1, False), ("on, fused colsum", 1, True))
    ts = {a[0]: [] for a in arms}
    peaks = {}
    for r in range(rounds):
        for name, k, fused in arms[r % 3:] + arms[:r % 3]:
            options = ring_dtp_options(center_chunks=k, fused_colsum=fused)
            clear()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ts[name].append(cuda_time_ms(lambda: op(options), reps=3, warmup=1))
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    for name, _, _ in arms:
        print(f"fused_lowp T={T} (16 chunks), centering {name:16s}: {statistics.median(ts[name]):.1f} ms "
              f"(min {min(ts[name]):.1f}, max {max(ts[name]):.1f}; {rounds} rounds), peak above inputs incl. "
              f"grads {peaks[name]:.3f} GiB")


def tunable(rounds=6):
    """Does another cuBLAS/cuBLASLt algorithm beat the default one on these shapes?"""
    import os
    import statistics
    from torch.cuda import tunable as tun
    H, V, ct, T, g, w, x, y = _target_inputs()
    z = torch.randn(ct, V, device="cuda", generator=g).to(torch.bfloat16)
    dx = torch.empty(ct, H, device="cuda", dtype=torch.bfloat16)
    dw = torch.zeros(V, H, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    xc = x[:ct]
    op, clear = _fused_lowp_step(x, w, y)
    fl = 2.0 * ct * V * H / 1e9
    cases = {"Z": (lambda: torch.mm(xc, w.t(), out=z), fl), "dX": (lambda: torch.mm(z, w, out=dx), fl),
             "dW=": (lambda: torch.mm(z.t(), xc, out=dw), fl), "dW+=": (lambda: dw.addmm_(z.t(), xc), fl),
             "8192^3": (lambda: torch.mm(a, a, out=c), 2.0 * 8192 ** 3 / 1e9)}
    tun.set_filename(os.path.join(os.environ.get("OUT", "."), "tunableop_results%d.csv"))
    tun.set_max_tuning_duration(200)
    tun.enable(True)
    tun.tuning_enable(True)
    for fn, _ in cases.values():
        fn()
    op()
    torch.cuda.synchronize()
    tun.tuning_enable(False)
    for res in tun.get_results():
        print("tuned:", res)
    ts = {(k, on): [] for k in list(cases) + ["op"] for on in (False, True)}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            tun.enable(on)
            for k, (fn, _) in cases.items():
                ts[(k, on)].append(t(fn))
            ts[("op", on)].append(cuda_time_ms(op, reps=3, warmup=1))
    tun.enable(False)
    for k in list(cases) + ["op"]:
        d, u = statistics.median(ts[(k, False)]), statistics.median(ts[(k, True)])
        rate = "" if k == "op" else f"  ({cases[k][1] / d:.0f} -> {cases[k][1] / u:.0f} TF/s)"
        print(f"{k:7s} default {d:8.3f} ms  tuned {u:8.3f} ms  ({u / d:.3f}x){rate}")


def finish():
    from moepeak.ring_dtp import blocks as B
    H, V, T = 4096, 151936, 32768
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    dw = torch.randn(V, H, device="cuda", generator=g).to(torch.bfloat16)
    tc = torch.randn(T, device="cuda", generator=g)
    cs = torch.randn(V, device="cuda", generator=g)
    mu = torch.randn(H, device="cuda", generator=g)
    ranks = torch.arange(1, V + 1, device="cuda", dtype=torch.float64)
    labels = {"uniform": torch.randint(0, V, (T,), device="cuda", generator=g),
              "Zipf(1.1)": torch.multinomial(ranks ** -1.1, T, replacement=True, generator=g)}
    # the same counts on randomly permuted ids: the frequent labels' runs anywhere in sorted order
    labels["Zipf shuf"] = torch.randperm(V, device="cuda", generator=g)[labels["Zipf(1.1)"]]
    for name, y in labels.items():
        rows = int(y.unique().numel())
        for rank1 in (False, True):
            extra = dict(cs=cs, mu=mu) if rank1 else {}
            ms = t(lambda: B.finish_dw(dw, x, y, tc, **extra), iters=20)
            gb = ((V if rank1 else rows) * H * 2 * 2 + T * H * 2) / 1e9
            print(f"finish_dw {name:9s} labels ({rows} rows labelled), {'with' if rank1 else 'no  '} rank-1 term: "
                  f"{ms:.3f} ms, {gb:.2f} GB moved ({gb / ms:.2f} TB/s)")


def rounding():
    """How many roundings does cuBLAS's bf16 dW += A^T B (torch addmm_, beta = 1) make? Against
    C + A^T B in fp64 rounded once to bf16, the fraction of elements that differ: a few per mille
    is the fp32 accumulation's own error; tens of percent is a second rounding (the product
    rounded to bf16 before C is added, or split-K partial sums reduced in bf16). At fused_lowp's
    last-chunk shape (K = 2048 tokens, + 2 rows: the centering's rank-1 term in the GEMM), the
    first K row carrying a large term as cs_hi does; with torch's
    allow_bf16_reduced_precision_reduction on (its default) and off."""
    H, V = 4096, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    mm = torch.backends.cuda.matmul
    keep = mm.allow_bf16_reduced_precision_reduction
    try:
        for K in (2048, 2050, 2056):
            a = (torch.randn(K, V, device="cuda", generator=g) * 0.01).to(torch.bfloat16)
            a[0] = 3.0                                            # a large rank-1 row
            b = torch.randn(K, H, device="cuda", generator=g).to(torch.bfloat16)
            c0 = (torch.randn(V, H, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
            once = torch.addmm(c0.double(), a.t().double(), b.double()).to(torch.bfloat16)
            for allow in (True, False):
                mm.allow_bf16_reduced_precision_reduction = allow
                c = c0.clone()
                c.addmm_(a.t(), b)
                differ = (c != once).float().mean().item() * 100
                exact = (c0.double() + torch.mm(a.t(), b).double()).to(torch.bfloat16)
                twice = (c != exact).float().mean().item() * 100
                ms = t(lambda: c.addmm_(a.t(), b))            # (c is scratch from here on)
                print(f"K={K} reduced-precision reduction {'allowed' if allow else 'off    '}: {differ:.3f}% of "
                      f"elements differ from one rounding of C + A^T B, {twice:.3f}% from rn(C + rn(A^T B)); "
                      f"{ms:.3f} ms ({2.0 * K * V * H / ms / 1e9:.0f} TFLOP/s)")
            a = b = c0 = once = c = None  # free now (the timing closures still name them)
    finally:
        mm.allow_bf16_reduced_precision_reduction = keep


def layout(rounds=6):
    """Token-major [n, V] against vocab-major [V, n] logits blocks for the three chunk GEMMs."""
    H, V, ct, T, g, w, x, y = _target_inputs()
    fl = 2.0 * ct * V * H / 1e9
    z = torch.empty(ct, V, device="cuda", dtype=torch.bfloat16)
    zt = torch.empty(V, ct, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(ct, H, device="cuda", dtype=torch.bfloat16)
    dw = torch.zeros(V, H, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tp = t(lambda: torch.mm(a, a))
    print(f"8192^3 probe {tp:.3f} ms ({2 * 8192 ** 3 / tp / 1e9:.0f} TF/s)")
    gemms = {  # layout: (its block, its Z, dW += and dX GEMMs of one chunk of rows xc)
        "token-major": (z, lambda xc: torch.mm(xc, w.t(), out=z), lambda xc: dw.addmm_(z.t(), xc),
                        lambda xc: torch.mm(z, w, out=dx)),
        "vocab-major": (zt, lambda xc: torch.mm(w, xc.t(), out=zt), lambda xc: dw.addmm_(zt, xc),
                        lambda xc: torch.mm(zt.t(), w, out=dx)),
    }
    xc = x[:ct]
    for name, (_, fz, fw, fx) in gemms.items():
        tz, tw, tx = t(lambda: fz(xc)), t(lambda: fw(xc)), t(lambda: fx(xc))
        print(f"{name}: Z {tz:.3f} ms ({fl / tz:.0f} TF/s)  dW+= {tw:.3f} ({fl / tw:.0f})  dX {tx:.3f} ({fl / tx:.0f})"
              f"  x 16 = {16 * (tz + tw + tx):.1f} ms")

    def seq(block, fz, fw, fx, stand_ins):
        for t0 in range(0, T, ct):
            xs = x[t0:t0 + ct]
            fz(xs)
            if stand_ins:   # for the fold (one read of the block) and the gradient (read + write)
                block.sum(); block.mul_(1.0)
            fw(xs); fx(xs)
    extra = " + memory-bound stand-ins"
    tot = {k + s: [] for k in gemms for s in ("", extra)}
    for r in range(rounds):
        names = list(gemms) if r % 2 == 0 else list(gemms)[::-1]
        for stand_ins in (False, True):
            for k in names:
                tot[k + (extra if stand_ins else "")].append(
                    cuda_time_ms(lambda: seq(*gemms[k], stand_ins), reps=3, warmup=1))
    tp2 = t(lambda: torch.mm(a, a))
    for k, v in tot.items():
        v = sorted(v)
        print(f"{k}: 16 chunks x 3 GEMMs, {rounds} rounds: median {v[len(v) // 2]:.1f} ms, "
              f"min {v[0]:.1f}, max {v[-1]:.1f}")
    print(f"8192^3 probe after: {tp2:.3f} ms ({2 * 8192 ** 3 / tp2 / 1e9:.0f} TF/s)")


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    which = sys.argv[1:] or ["grouped", "streams", "blas", "center"]
    for arg in which:
        name, _, n = arg.partition("=")  # center=16: that many rounds
        fn = {"grouped": grouped, "streams": ring_streams, "blas": blas_library, "center": centering,
              "rounding": rounding,
              "tunable": tunable, "finish": finish, "layout": layout}[name]
        fn(int(n)) if n else fn()
