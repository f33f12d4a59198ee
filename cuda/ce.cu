// ce.cu: Ring-DTP's CUDA C kernels: the online log-sum-exp fold and the
// softmax-gradient epilogue over one logits block Z: [t, ldz] x In (fp32, or
// bf16/fp16 straight from a low-precision GEMM; row i = token i, columns
// [0, v) = global vocab ids [v0, v0 + v)), and the in-place scale t *= g of the
// fused modes' gradients. Same arithmetic as the CPU kernels in csrc/ce.c (see
// the formulas there). The GEMM producing Z is torch's; nothing here ever holds
// more than the one block it is given, and no [T, V] logits tensor exists.
//
// Layout of work: one thread block (kThreads = 512) per row, grid-stride over
// rows; threads stride over the row's columns in 16-byte vectors, kUnroll = 4
// vectors in flight per thread, block-wide reductions through shared memory.
// A row is split as
//   [0, h)            scalar head up to the first 16-byte boundary (h < 16 B),
//   [h, h + nvec * N) 16-byte vectors of N = 16 / sizeof(In) elements,
//   [.., nv)          scalar tail (< N elements), nv = the real (non-padding) columns,
// so rows of any V (odd, prime) run vectorized; column indices inside a row are
// int (v < 2^31, checked by the launchers), row offsets int64.
//
// Cost per element (bf16 logits, no softcap; one H200 SM must retire ~15e9
// elements/s for 4 TB/s, i.e. ~17 instructions per element at 4 warp-instr/clk):
//   fold: unpack 1, max 1, sum of logits 1, exponent FFMA 1, ex2 1, sum 1: ~6,
//         plus one compare per vector for the target and one max-update branch
//         per kUnroll vectors (the first kernel: a compare-and-branch, expf ~10,
//         int64 compares per element, ~25+).
//   grad: unpack 1, FADD 1, FFMA 1, ex2 1, FFMA 1, cvt 0.5: ~6 (+ tanhf with softcap).
// Exponentials are 2^(log2e * (x - ref)) with the multiply fused, one MUFU.EX2
// each (ex2_ftz: < 2^-22 relative error; results below 2^-126 flushed to 0).
// H200, [2048, 151936] bf16 blocks: fold 3.4 TB/s, grad 3.9 TB/s (read + write,
// with evict-first hints; 2.7 without), against an HBM copy rate of 4.2.
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include <atomic>
#include <type_traits>

#include "common.cuh"

namespace {

// Row blocks: 512 threads (16 warps), 2 resident per SM (ptxas keeps <= 64 registers), 4 16-byte
// loads in flight per thread: 64 KB per SM, above the ~30 KB that 4 TB/s needs at ~1 us latency.
// Why 512 x 2 and not 256 x 4 (same bytes in flight): the fused_lowp chunk is t = 2048 rows on
// 132 SMs, 15 or 16 rows per SM; the last row of an SM often runs alone, and one 16-warp block
// keeps twice the loads in flight that an 8-warp one would.
constexpr int kThreads = 512;
constexpr int kMinBlocks = 2;
constexpr int kUnroll = 4;
constexpr int kMaxGrid = 65535;     // rows beyond this are handled by the grid-stride loop
constexpr int kScaleThreads = 256;  // the scale kernel: grid-stride, up to kScaleGrid blocks (~8 per SM)
constexpr int kScaleGrid = 2048;
constexpr float kLog2e = 1.4426950408889634f;

// 2^x for the per-element exponentials (x <= 0 there: the exponent is taken
// relative to the row max): one MUFU.EX2, relative error < 2^-22, results below
// 2^-126 flushed to 0 (terms that small add nothing to a sum whose largest term is
// 1, and a gradient that small is 0 at bf16/fp16 anyway). exp2f would spend ~3
// more instructions per element on the subnormal range (it was measured when the
// grad kernel ran at 2.9 TB/s, before the evict-first hints).
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
struct Vec { static constexpr int n = 16 / (int)sizeof(T); };  // elements per 16-byte vector

// Elements of p before its first 16-byte boundary, at most n (the scalar head).
template <typename T>
__device__ __forceinline__ int head_cols(const T *p, int64_t n) {
  const int h = (int)(((16u - (unsigned)(reinterpret_cast<uintptr_t>(p) & 15u)) & 15u) / sizeof(T));
  return n < h ? (int)n : h;
}

// ---- element conversions ----------------------------------------------------
template <typename T>
__device__ __forceinline__ float ld(const T *p, int64_t j) { return to_f32(p[j]); }

__device__ __forceinline__ uint4 ldv(const void *p) { return *reinterpret_cast<const uint4 *>(p); }
// The gradient kernel's read is the logits' last use: evict-first (ld.global.cs).
__device__ __forceinline__ uint4 ldv_last(const void *p) { return __ldcs(reinterpret_cast<const uint4 *>(p)); }

// One 16-byte vector -> Vec<In>::n floats (element k at the lower address first).
__device__ __forceinline__ void unpack(const uint4 &u, float (&x)[4]) {
  x[0] = __uint_as_float(u.x); x[1] = __uint_as_float(u.y);
  x[2] = __uint_as_float(u.z); x[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack_bf16(uint32_t w, float &a, float &b) {
  a = __uint_as_float(w << 16);
  b = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack_f16(uint32_t w, float &a, float &b) {
  a = __half2float(__ushort_as_half((unsigned short)(w & 0xffffu)));
  b = __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}
template <typename In>
__device__ __forceinline__ void unpack(const uint4 &u, float (&x)[8]) {
  static_assert(sizeof(In) == 2, "8 elements per vector: bf16 or fp16");
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (std::is_same<In, __nv_bfloat16>::value) unpack_bf16(w[k], x[2 * k], x[2 * k + 1]);
    else unpack_f16(w[k], x[2 * k], x[2 * k + 1]);
  }
}
template <typename In>
__device__ __forceinline__ void unpack_vec(const uint4 &u, float (&x)[Vec<In>::n]) {
  if constexpr (sizeof(In) == 4) unpack(u, x);
  else unpack<In>(u, x);
}

__device__ __forceinline__ uint32_t pack2(__nv_bfloat16 *, float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);  // a in the low half (lower address)
  return *reinterpret_cast<const uint32_t *>(&h);
}
__device__ __forceinline__ uint32_t pack2(__half *, float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t *>(&h);
}

// The 16-byte vector of Vec<T>::n floats rounded to T (plain bit packing for fp32).
template <typename T>
__device__ __forceinline__ uint4 pack_vec(const float (&d)[Vec<T>::n]) {
  if constexpr (sizeof(T) == 4) {
    return make_uint4(__float_as_uint(d[0]), __float_as_uint(d[1]), __float_as_uint(d[2]), __float_as_uint(d[3]));
  } else {
    T *tag = nullptr;
    return make_uint4(pack2(tag, d[0], d[1]), pack2(tag, d[2], d[3]), pack2(tag, d[4], d[5]), pack2(tag, d[6], d[7]));
  }
}

// N floats -> N Out elements at p (N * sizeof(Out) = 8 or 16 bytes, p aligned to that), with
// evict-first stores (st.global.cs): dZ is next read by a GEMM that streams far more than L2
// holds. With these hints and the last-use loads the grad kernel went from 7.45 to 5.12 ms for
// the 16 [2048, 151936] bf16 chunks of T = 32k (2.7 -> 3.9 TB/s, H200; profile_kernels).
template <int N>
__device__ __forceinline__ void store_vec(float *p, const float (&d)[N]) {
  static_assert(N == 4, "fp32 output: 4 elements per 16-byte vector");
  __stcs(reinterpret_cast<uint4 *>(p), pack_vec<float>(d));
}
template <typename Out, int N>
__device__ __forceinline__ void store_vec(Out *p, const float (&d)[N]) {
  static_assert(sizeof(Out) == 2 && (N == 4 || N == 8), "bf16/fp16 output: 4 or 8 elements");
  if constexpr (N == 8) {
    __stcs(reinterpret_cast<uint4 *>(p), pack_vec<Out>(d));
  } else {
    __stcs(reinterpret_cast<uint2 *>(p), make_uint2(pack2(p, d[0], d[1]), pack2(p, d[2], d[3])));
  }
}

template <bool kCap>
__device__ __forceinline__ float capf(float x, float c) { return kCap ? c * tanhf(x / c) : x; }

// Pairwise sum of v[o, o + n) (n a power of two): log2(n) dependent adds, all indices compile-time.
template <int n, int o = 0, int K>
__device__ __forceinline__ float tree_sum(const float (&v)[K]) {
  if constexpr (n == 1) return v[o];
  else return tree_sum<n / 2, o>(v) + tree_sum<n / 2, o + n / 2>(v);
}

// =============================================================================
// Fold
// =============================================================================
// Per-thread online state. The exponent reference is kept in base 2: mL =
// rn(tm * log2e), and se = sum over the non-target columns of 2^(x*log2e - mL),
// each term one FFMA (exact product, one rounding) + exp2f. The rounding of mL
// itself (e = tm*log2e - mL, exact by FMA) is taken out once per row at the end,
// so the result is sum exp(x - tm) with expf's accuracy even at |tm| ~ 1e3.
struct FoldAcc {
  float tm = -INFINITY;  // running max of the columns seen (target included)
  float mL = 0.f;        // rn(tm * log2e); 0 while tm == -inf (then se == 0 and every x is -inf)
  float se = 0.f;        // non-target sum, relative to mL
  float zs = 0.f;        // sum of x
  float xy = 0.f;        // the target's (capped) logit if this thread saw it, else 0
};

// Take a new candidate max: rescale se at most once per call (once per kUnroll vectors).
__device__ __forceinline__ void fold_raise(FoldAcc &a, float mx) {
  if (mx > a.tm) {
    const float nL = __fmul_rn(mx, kLog2e);  // _rn: never contracted into an FMA (mL must be this value)
    a.se = (a.tm == -INFINITY) ? 0.f : a.se * exp2f(a.mL - nL);
    a.tm = mx;
    a.mL = nL;
  }
}

template <bool kCap>
__device__ __forceinline__ void fold_one(FoldAcc &a, float x, int j, int jy, float c) {
  x = capf<kCap>(x, c);
  a.zs += x;
  fold_raise(a, x);
  if (j == jy) a.xy = x;
  else a.se += exp2f(fmaf(x, kLog2e, -a.mL));
}

// U vectors of the aligned body at vector indices vi + u * kThreads; jyb = target column - h.
template <typename In, bool kCap, int U>
__device__ __forceinline__ void fold_vectors(const In *__restrict__ body, int vi, int jyb, float c, FoldAcc &a) {
  constexpr int N = Vec<In>::n;
  uint4 u[U];
#pragma unroll
  for (int k = 0; k < U; ++k) u[k] = ldv(body + (vi + k * kThreads) * N);  // all loads issued first
  float x[U * N];  // the logits, then (in place) their exponentials: 32 registers for bf16
  float mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < U; ++k) {
    float t[N];
    unpack_vec<In>(u[k], t);
#pragma unroll
    for (int q = 0; q < N; ++q) {
      x[k * N + q] = capf<kCap>(t[q], c);
      mx = fmaxf(mx, x[k * N + q]);
    }
  }
  a.zs += tree_sum<U * N>(x);
  fold_raise(a, mx);
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int off = jyb - (vi + k * kThreads) * N;  // the target's place in vector k, if any
    if ((unsigned)off < (unsigned)N) {              // rare: one vector per row
#pragma unroll
      for (int q = 0; q < N; ++q) {
        a.xy = (q == off) ? x[k * N + q] : a.xy;
        x[k * N + q] = (q == off) ? -INFINITY : x[k * N + q];  // kept out of se: 1 - p_y = sx/s never cancels
      }
    }
  }
#pragma unroll
  for (int q = 0; q < U * N; ++q) x[q] = ex2_ftz(fmaf(x[q], kLog2e, -a.mL));  // independent: ILP
  a.se += tree_sum<U * N>(x);
}

// Fold one block into the per-row state in ONE pass over the logits: each thread
// keeps (tm, se, zs) online; the block then merges the threads' (tm, se) at the
// row max bm. The target's term is kept out of se (no cancellation in 1 - p_y =
// sx/s) and added by thread 0 from the target's own logit (reduced with the sums).
template <typename In, bool kCap>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    ce_fold_kernel(const In *__restrict__ z, int64_t ldz, int64_t t, int nv, int64_t v0,
                   const int64_t *__restrict__ labels, int64_t ignore_index, float c, float *m, float *s, float *zy,
                   float *zsum, float *sx) {
  __shared__ float sh[kThreads / 32 * 3];
  constexpr int N = Vec<In>::n;
  const int tid = threadIdx.x;
  for (int64_t i = blockIdx.x; i < t; i += gridDim.x) {
    const In *row = z + i * ldz;
    const int64_t y = labels[i];
    const bool has_y = y != ignore_index && y >= v0 && y < v0 + nv;
    const int jy = has_y ? (int)(y - v0) : -1;
    const int h = head_cols(row, nv);
    const int nvec = (nv - h) / N;
    const In *body = row + h;
    FoldAcc a;
    if (tid < h) fold_one<kCap>(a, ld(row, tid), tid, jy, c);
    int vi = tid;
    for (; vi + (kUnroll - 1) * kThreads < nvec; vi += kUnroll * kThreads)
      fold_vectors<In, kCap, kUnroll>(body, vi, jy - h, c, a);
    if (vi + kThreads < nvec) {  // the rest: at most 3 vectors per thread, 2 then 1 in flight
      fold_vectors<In, kCap, 2>(body, vi, jy - h, c, a);
      vi += 2 * kThreads;
    }
    if (vi < nvec) fold_vectors<In, kCap, 1>(body, vi, jy - h, c, a);
    const int jt = h + nvec * N + tid;  // tail: fewer than N <= kThreads columns
    if (jt < nv) fold_one<kCap>(a, ld(row, jt), jt, jy, c);

    float bm[1] = {a.tm};
    block_reduce<kThreads, 1, true>(bm, sh);
    const float bmL = (bm[0] == -INFINITY) ? 0.f : __fmul_rn(bm[0], kLog2e);
    float r[3] = {a.zs, a.tm == -INFINITY ? 0.f : a.se * exp2f(a.mL - bmL), a.xy};  // se at the row's bmL
    block_reduce<kThreads, 3, false>(r, sh);
    if (tid == 0) {
      const float xy = r[2];  // one thread contributed it, the others 0
      if (has_y) zy[i] = xy;
      zsum[i] += r[0];
      if (nv > 0 && bm[0] != -INFINITY) {
        const float mo = m[i];
        const float mn = fmaxf(mo, bm[0]);
        const float scale = (mo == -INFINITY) ? 0.f : expf(mo - mn);
        // r[1] is relative to bmL = bm*log2e - eb (eb exact by FMA): times 2^-eb it is relative to bm
        const float seb = r[1] * exp2f(-fmaf(bm[0], kLog2e, -bmL)) * expf(bm[0] - mn);
        const float sy = has_y ? expf(xy - mn) : 0.f;
        m[i] = mn;
        s[i] = s[i] * scale + (seb + sy);
        sx[i] = sx[i] * scale + seb;
      }
    }
  }
}

// =============================================================================
// Gradient
// =============================================================================
// Per-row constants: d = g*(coef*p - uni) off target, g*((eps + 2 zl lse) p - (1-eps) q - uni)
// at the target, p = 2^(log2e (x - m) - log2e ls) = exp((x - m) - ls).
struct GradRow {
  float mi, lsL, c;  // m, rn(ls * log2e), softcap
  float cg, ug;      // g * coef, g * uni
  float gi, ya, yb;  // target: g * (yb * p + ya), ya = -(1-eps) q - uni, yb = eps + 2 zl lse
  int jy;            // target column in this block, -1 if none
  int live;          // 0: an ignored or zero-weight row (dZ = 0, nothing read); the fields above unset
};

// Row i's constants (both gradient kernels).
__device__ __forceinline__ GradRow grad_row(int64_t i, int nv, int64_t v0, const int64_t *__restrict__ labels,
                                            int64_t ignore_index, float c, const float *__restrict__ mrow,
                                            const float *__restrict__ ls, const float *__restrict__ q,
                                            const float *__restrict__ g, int64_t g_stride, float eps, float uni,
                                            float zloss) {
  GradRow r;
  const int64_t y = labels[i];
  const float gi = g[i * g_stride];
  r.live = !(y == ignore_index || gi == 0.f);
  if (!r.live) return r;
  r.mi = mrow[i];
  const float lsi = ls[i], L = r.mi + lsi;
  r.lsL = __fmul_rn(lsi, kLog2e);
  r.c = c;
  r.cg = gi * (1.f + 2.f * zloss * L);
  r.ug = gi * uni;
  r.gi = gi;
  r.ya = -(1.f - eps) * q[i] - uni;
  r.yb = eps + 2.f * zloss * L;
  r.jy = (y >= v0 && y < v0 + nv) ? (int)(y - v0) : -1;
  return r;
}

template <bool kCap>
__device__ __forceinline__ float grad_one(float x, const GradRow &r, bool target) {
  float dcap = 1.f;
  if (kCap) {
    const float th = tanhf(x / r.c);
    x = r.c * th;
    dcap = 1.f - th * th;
  }
  const float p = ex2_ftz(fmaf(x - r.mi, kLog2e, -r.lsL));  // x - m is exact-ish; x - lse would lose ulp(lse)
  const float d = target ? r.gi * fmaf(r.yb, p, r.ya) : fmaf(r.cg, p, -r.ug);
  return kCap ? d * dcap : d;
}

// U vectors at vector indices vi + u * kThreads of the aligned body; read, then written (in place allowed).
template <typename In, typename Out, bool kCap, int U>
__device__ __forceinline__ void grad_vectors(const In *body, Out *obody, int vi, int jyb, const GradRow &r) {
  constexpr int N = Vec<In>::n;
  uint4 u[U];
#pragma unroll
  for (int k = 0; k < U; ++k) u[k] = ldv_last(body + (vi + k * kThreads) * N);  // all loads before any store
#pragma unroll
  for (int k = 0; k < U; ++k) {
    float x[N], d[N];
    unpack_vec<In>(u[k], x);
#pragma unroll
    for (int q = 0; q < N; ++q) d[q] = grad_one<kCap>(x[q], r, false);
    const int off = jyb - (vi + k * kThreads) * N;
    if ((unsigned)off < (unsigned)N) {  // rare: the target's vector
#pragma unroll
      for (int q = 0; q < N; ++q) d[q] = (q == off) ? grad_one<kCap>(x[q], r, true) : d[q];
    }
    store_vec(obody + (vi + k * kThreads) * N, d);
  }
}

// orow[j0, j1) = 0 (padding columns, or the whole row of an ignored / zero-weight token: no reads).
template <typename Out>
__device__ __forceinline__ void zero_cols(Out *orow, int j0, int j1) {
  constexpr int M = Vec<Out>::n;
  const int h = j0 + head_cols(orow + j0, j1 - j0);
  const int nz = (j1 - h) / M;
  for (int j = j0 + (int)threadIdx.x; j < h; j += kThreads) orow[j] = from_f32<Out>(0.f);
  for (int k = threadIdx.x; k < nz; k += kThreads)
    *reinterpret_cast<uint4 *>(orow + h + k * M) = make_uint4(0, 0, 0, 0);
  for (int j = h + nz * M + (int)threadIdx.x; j < j1; j += kThreads) orow[j] = from_f32<Out>(0.f);
}

// dZ = g * (softmax - target distribution) (+ z-loss term) * softcap', row by
// row, with 1 - p_y = q[i] (from the fold's sx / s, see csrc/ce.c). out may alias z
// when Out == In (same element size and ld): each element is read, then written, by
// the same thread, so dZ is made in place in the logits block. One pass over the
// real columns; padding columns and dead rows are only written (zeros).
template <typename In, typename Out, bool kCap>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    ce_grad_kernel(const In *z, int64_t ldz, int64_t t, int v, int nv, int64_t v0, const int64_t *__restrict__ labels,
                   int64_t ignore_index, float c, const float *__restrict__ mrow, const float *__restrict__ ls,
                   const float *__restrict__ q, const float *__restrict__ g, int64_t g_stride, float eps, float uni,
                   float zloss, Out *out, int64_t ldo) {
  constexpr int N = Vec<In>::n;
  constexpr int kOutBytes = N * (int)sizeof(Out);  // 16 (same width) or 8 (fp32 -> bf16/fp16)
  static_assert(kOutBytes == 16 || kOutBytes == 8, "output vector must be 8 or 16 bytes");
  const int tid = threadIdx.x;
  for (int64_t i = blockIdx.x; i < t; i += gridDim.x) {
    const In *row = z + i * ldz;
    Out *orow = out + i * ldo;
    const GradRow r = grad_row(i, nv, v0, labels, ignore_index, c, mrow, ls, q, g, g_stride, eps, uni, zloss);
    const int nc = r.live ? nv : 0;  // columns computed; [nc, v) are written 0
    if (nc > 0) {
      int h = head_cols(row, nc);
      if ((reinterpret_cast<uintptr_t>(orow + h) & (kOutBytes - 1)) != 0) h = nc;  // out misaligned: all scalar
      const int nvec = (nc - h) / N;
      for (int j = tid; j < h; j += kThreads) orow[j] = from_f32<Out>(grad_one<kCap>(ld(row, j), r, j == r.jy));
      int vi = tid;
      for (; vi + (kUnroll - 1) * kThreads < nvec; vi += kUnroll * kThreads)
        grad_vectors<In, Out, kCap, kUnroll>(row + h, orow + h, vi, r.jy - h, r);
      if (vi + kThreads < nvec) {  // the rest: at most 3 vectors per thread
        grad_vectors<In, Out, kCap, 2>(row + h, orow + h, vi, r.jy - h, r);
        vi += 2 * kThreads;
      }
      if (vi < nvec) grad_vectors<In, Out, kCap, 1>(row + h, orow + h, vi, r.jy - h, r);
      for (int j = h + nvec * N + tid; j < nc; j += kThreads)
        orow[j] = from_f32<Out>(grad_one<kCap>(ld(row, j), r, j == r.jy));
    }
    zero_cols(orow, nc, v);
  }
}

// =============================================================================
// Gradient + column sums (the centering of ring_dtp._fused)
// =============================================================================
// The same dZ as ce_grad_kernel, element for element, made by column slabs: a thread owns one
// 16-byte vector of columns and walks down a group of rows, so it also sums its columns over
// those rows: part[gy, j] = sum over group gy's rows of dZ[i, j] as stored (rounded to Out), in
// fp32 and in row order, the target element excluded (the caller takes the label column out
// of dZ for the dW GEMM: this is colsum of what that GEMM reads). ce_colsum_reduce_kernel then
// adds the G partial rows to cs in group order: the result depends on G (fixed per device),
// never on timing (no atomics). The row's constants are staged in shared memory, one tile of
// kSlabThreads rows at a time. Needs 16-byte aligned rows of z (and 8/16 of out; checked by the
// launcher): every row then has the same vector boundaries.
// With tc ([t] x fp32, optional) the kernel also takes the label column out of the dZ it writes, as
// ring_dtp_blocks.take_label_column would right after it: tc[i] = dZ[i, jy] as stored (rounded to
// Out) and 0 written there; tc[i] = 0 for a row with no target in the block (ignored, zero weight, or
// its label in another block). So the dZ written is the dW GEMM's operand, and the caller puts the
// column back for dX's GEMM (put_label_column): bitwise what the separate take gives.
constexpr int kSlabThreads = 256;
constexpr int kSlabMinBlocks = 4;  // <= 64 registers: 1024 threads and 64 KB of loads in flight per SM
constexpr int kSlabUnroll = 4;     // rows in flight per thread

template <typename Out>
__device__ __forceinline__ float stored(float d) { return to_f32(from_f32<Out>(d)); }

// Does the row have a target element in this block (then exactly one thread sees it)?
__device__ __forceinline__ bool has_target(const GradRow &r) { return r.live && r.jy >= 0; }

// Rows i0 .. i0 + U - 1 (constants rows[0 .. U)) at this thread's full vector of columns col .. col + N - 1.
// tc (optional): the label column taken out (see ce_grad_colsum_kernel).
template <typename In, typename Out, bool kCap, int U>
__device__ __forceinline__ void slab_rows(const In *z, int64_t ldz, Out *out, int64_t ldo, int64_t i0,
                                          const GradRow *rows, int col, float (&acc)[Vec<In>::n], float *tc) {
  constexpr int N = Vec<In>::n;
  uint4 u[U];
#pragma unroll
  for (int k = 0; k < U; ++k) u[k] = rows[k].live ? ldv_last(z + (i0 + k) * ldz + col) : make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const GradRow &r = rows[k];
    float d[N];
    if (r.live) {  // uniform over the CTA
      float x[N];
      unpack_vec<In>(u[k], x);
#pragma unroll
      for (int e = 0; e < N; ++e) d[e] = grad_one<kCap>(x[e], r, false);
      const int off = r.jy - col;     // the target's place in this vector, if any
      if ((unsigned)off < (unsigned)N) {  // rare: the target's vector
#pragma unroll
        for (int e = 0; e < N; ++e) d[e] = stored<Out>(e == off ? grad_one<kCap>(x[e], r, true) : d[e]);
#pragma unroll
        for (int e = 0; e < N; ++e) acc[e] += (e == off) ? 0.f : d[e];
        if (tc) {  // uniform over the grid
          float dy = 0.f;
#pragma unroll
          for (int e = 0; e < N; ++e) {
            dy = (e == off) ? d[e] : dy;
            d[e] = (e == off) ? 0.f : d[e];
          }
          tc[i0 + k] = dy;
        }
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) {
          d[e] = stored<Out>(d[e]);
          acc[e] += d[e];
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) d[e] = 0.f;
    }
    if (tc && col == 0 && !has_target(r)) tc[i0 + k] = 0.f;
    store_vec(out + (i0 + k) * ldo + col, d);
  }
}

template <typename In, typename Out, bool kCap>
__global__ void __launch_bounds__(kSlabThreads, kSlabMinBlocks)
    ce_grad_colsum_kernel(const In *z, int64_t ldz, int64_t t, int v, int nv, int64_t v0,
                          const int64_t *__restrict__ labels, int64_t ignore_index, float c,
                          const float *__restrict__ mrow, const float *__restrict__ ls, const float *__restrict__ q,
                          const float *__restrict__ g, int64_t g_stride, float eps, float uni, float zloss, Out *out,
                          int64_t ldo, float *__restrict__ part, int64_t ldp, int64_t rows_per_group,
                          float *__restrict__ tc) {
  __shared__ GradRow rows[kSlabThreads];
  constexpr int N = Vec<In>::n;
  const int col = (int)(((int64_t)blockIdx.x * kSlabThreads + threadIdx.x) * N);  // < v + kSlabThreads * N
  const bool full = col + N <= nv;  // all N columns real: the vector path; else per element (the row's end)
  const int64_t r0 = (int64_t)blockIdx.y * rows_per_group;
  const int64_t r1 = r0 + rows_per_group < t ? r0 + rows_per_group : t;
  float acc[N];
#pragma unroll
  for (int e = 0; e < N; ++e) acc[e] = 0.f;
  for (int64_t i0 = r0; i0 < r1; i0 += kSlabThreads) {
    const int nr = (int)(r1 - i0 < kSlabThreads ? r1 - i0 : kSlabThreads);
    __syncthreads();  // the previous tile's constants are read by every thread before they are replaced
    if ((int)threadIdx.x < nr)
      rows[threadIdx.x] =
          grad_row(i0 + threadIdx.x, nv, v0, labels, ignore_index, c, mrow, ls, q, g, g_stride, eps, uni, zloss);
    __syncthreads();
    if (col >= v) continue;  // past the row's end (the last slab): only the barriers
    if (full) {
      int k = 0;
      for (; k + kSlabUnroll <= nr; k += kSlabUnroll)
        slab_rows<In, Out, kCap, kSlabUnroll>(z, ldz, out, ldo, i0 + k, rows + k, col, acc, tc);
      for (; k < nr; ++k) slab_rows<In, Out, kCap, 1>(z, ldz, out, ldo, i0 + k, rows + k, col, acc, tc);
    } else {
      for (int k = 0; k < nr; ++k) {
        const GradRow &r = rows[k];
        const In *row = z + (i0 + k) * ldz;
        Out *orow = out + (i0 + k) * ldo;
        if (tc && col == 0 && !has_target(r)) tc[i0 + k] = 0.f;
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const int j = col + e;
          if (j >= v) break;
          float d = 0.f;  // padding columns [nv, v) and dead rows: 0
          if (r.live && j < nv) {
            d = stored<Out>(grad_one<kCap>(ld(row, j), r, j == r.jy));
            acc[e] += (j == r.jy) ? 0.f : d;
            if (tc && j == r.jy) {
              tc[i0 + k] = d;
              d = 0.f;
            }
          }
          orow[j] = from_f32<Out>(d);
        }
      }
    }
  }
  float *prow = part + (int64_t)blockIdx.y * ldp;
#pragma unroll
  for (int e = 0; e < N; ++e)
    if (col + e < nv) prow[col + e] = acc[e];
}

// cs[j] = (first ? 0 : cs[j]) + part[0, j] + ... + part[G - 1, j], in that order, for the real
// columns j < nv; the padding columns [nv, v) have zero dZ: cs[j] = 0 (first) or unchanged.
__global__ void __launch_bounds__(kScaleThreads)
    ce_colsum_reduce_kernel(const float *__restrict__ part, int64_t ldp, int groups, int nv, int v, float *cs,
                            int first) {
  for (int j = blockIdx.x * kScaleThreads + threadIdx.x; j < v; j += gridDim.x * kScaleThreads) {
    float s = first ? 0.f : cs[j];
    if (j < nv)
      for (int gy = 0; gy < groups; ++gy) s += part[(int64_t)gy * ldp + j];
    cs[j] = s;
  }
}

// =============================================================================
// Scale: p[0, n) *= *g in fp32, one rounding; nothing at all when *g == 1.
// =============================================================================
template <typename T>
__global__ void __launch_bounds__(kScaleThreads) ce_scale_kernel(T *p, int64_t n, const float *__restrict__ g) {
  const float gv = __ldg(g);  // device scalar: no host sync
  if (gv == 1.0f) return;     // loss.backward() with grad 1: x * 1 == x bitwise
  constexpr int N = Vec<T>::n;
  const int64_t nth = (int64_t)gridDim.x * kScaleThreads;
  const int64_t tid = (int64_t)blockIdx.x * kScaleThreads + threadIdx.x;
  const int h = head_cols(p, n);
  const int64_t nvec = (n - h) / N;
  T *body = p + h;
  if (tid < h) p[tid] = from_f32<T>(ld(p, tid) * gv);
  for (int64_t k = tid; k < nvec; k += nth) {
    float x[N];
    unpack_vec<T>(ldv(body + k * N), x);
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] *= gv;
    store_vec(body + k * N, x);
  }
  const int64_t j = h + nvec * N + tid;  // tail: fewer than N columns
  if (j < n) p[j] = from_f32<T>(ld(p, j) * gv);
}

inline unsigned grid_for(int64_t t) { return (unsigned)(t < kMaxGrid ? t : kMaxGrid); }

// =============================================================================
// Centering: out[i, :h] = x[i, :h] - mu (ring_dtp._fused's X - mu for its dW GEMMs)
// =============================================================================
// The subtraction in fp32, one rounding to T: the arithmetic of torch.sub on two T tensors.
// torch broadcasts mu with a zero stride, which takes its elementwise kernel off the 16-byte
// vector path (1.2 TB/s on an H200 for the 16 chunks of T = 32k, H = 4096); here every access
// is a 16-byte vector (the launcher requires h, ldx, ldo multiples of Vec<T>::n and the three
// pointers 16-byte aligned) and the stores are plain: the dW GEMM reads them next.
constexpr int kSubThreads = 256;
constexpr int kSubUnroll = 4;  // vectors per thread per step, their loads issued first

template <typename T>
__global__ void __launch_bounds__(kSubThreads)
    ce_sub_row_kernel(T *out, int64_t ldo, const T *__restrict__ x, int64_t ldx, const T *__restrict__ mu, int64_t n,
                      int64_t hv) {
  constexpr int N = Vec<T>::n;
  const int64_t total = n * hv;  // 16-byte vectors
  const int64_t step = (int64_t)gridDim.x * kSubThreads * kSubUnroll;
  for (int64_t k0 = (int64_t)blockIdx.x * kSubThreads * kSubUnroll + threadIdx.x; k0 < total; k0 += step) {
    uint4 u[kSubUnroll], m[kSubUnroll];
#pragma unroll
    for (int q = 0; q < kSubUnroll; ++q) {
      const int64_t k = k0 + (int64_t)q * kSubThreads;
      const int64_t i = k / hv, j = k - i * hv;
      if (k < total) {
        u[q] = ldv(x + i * ldx + j * N);
        m[q] = ldv(mu + j * N);
      }
    }
#pragma unroll
    for (int q = 0; q < kSubUnroll; ++q) {
      const int64_t k = k0 + (int64_t)q * kSubThreads;
      if (k >= total) break;
      const int64_t i = k / hv, j = k - i * hv;
      float a[N], b[N];
      unpack_vec<T>(u[q], a);
      unpack_vec<T>(m[q], b);
#pragma unroll
      for (int e = 0; e < N; ++e) a[e] = __fsub_rn(a[e], b[e]);
      *reinterpret_cast<uint4 *>(out + i * ldo + j * N) = pack_vec<T>(a);
    }
  }
}

// =============================================================================
// dW's finish: dW[v] += sum over the tokens t labelled v of tc[t] * X[t]
// =============================================================================
// The fused modes add each token chunk's dZ^T X into dW with the GEMM, a bf16/fp16
// rounding or two per chunk (torch's addmm_ rounds the product before adding it). The
// label column's terms (dZ[t, y_t] = p - 1: the largest, and a frequent label has one in
// every chunk) would add up over the chunks and make those roundings grow with the chunk
// count, so the caller takes that column out of dZ into tc (fp32) before the dW GEMM and
// this kernel adds it once: per element the label terms summed by fmaf in the order of sy
// (labels sorted stably: deterministic), then one rounding of dW + sum. Optionally a
// rank-1 term cs[r] * mu first in the same sum (the centering of ring_dtp._fused:
// colsum(dZ) mu^T), which touches every row. Without the rank-1 term, rows no token is
// labelled with are left untouched. Labels outside [v0, v0 + nv) (ignore_index, other
// shards) are never rows.
//
// Two kernels. ce_dw_finish_runs_kernel: one warp per label run (the tokens of one label
// are consecutive in sy; the warp at a position where the label changes owns that run) and
// per slab of 32 x Vec<T>::n columns (grid.x), each lane one 16-byte vector of consecutive
// columns (kVec: the launcher checked h, the leading dims and the pointers for it; else the
// same columns element by element). A warp, not a CTA: runs are mostly a few tokens long, so
// what bounds the kernel is how many runs are in flight and how many bytes each latency
// brings. A warp reads sy, perm and tcs a window of 32 positions at a time (a lane each, the
// next window in flight while this one is walked) and walks its run a group of 8 tokens at a
// time, two groups' rows of x in flight, the fmafs in sy's order. With the rank-1 term it
// also marks its row, and a rank-1 kernel then adds cs[r] * mu (the same arithmetic:
// acc = cs[r] * mu, no label term, one rounding) to every row not marked (below).
// (Measured on an H200 at T = 32k, V = 151936: a CTA per row finding its run by two binary
// searches in sy, then a token at a time, took 1.75 ms for uniform labels; a CTA per run
// with the batch loads under their predicates, which the compiler serialised, 7.4 ms for
// Zipf(1.1) labels, whose most frequent run is ~4300 tokens; a warp per run with a lane's 4
// columns 32 apart, 2-byte loads, 1.0 ms for uniform labels; session 11's warp per run, 8
// tokens per step, slabs across grid.y, with the sort: 0.60 ms uniform, 1.68 ms Zipf, 1.55 ms
// Zipf's counts on shuffled ids. This one on the same machine: 0.59-0.65, 0.55-0.59 and
// 0.64-0.71 ms (results/probe_finish_s12.log). Zipf had been slow for two reasons: a warp
// walked its run one latency per 8 tokens, and with slabs across grid.y the last slab of a run
// near the start of sy was dispatched only after 15/16 of the grid. Splitting a long run over
// warps would change the sum's order, and so the CPU kernel's too.)
constexpr int kFinishThreads = 128;                         // 4 warps, 4 runs
constexpr int kFinishWarps = kFinishThreads / 32;
constexpr int kFinishWindow = 32;                           // positions of sy a warp holds: one per lane
constexpr int kFinishGroup = 8;                             // tokens whose rows of x are loaded at once
constexpr int kFinishGroups = kFinishWindow / kFinishGroup;
constexpr unsigned kFullWarp = 0xffffffffu;
constexpr unsigned kFullGroup = (1u << kFinishGroup) - 1;
template <typename T>
constexpr int64_t finish_slab() { return 32 * Vec<T>::n; }  // columns per warp: 256 (bf16, fp16), 128 (fp32)

// A lane's Vec<T>::n consecutive columns of a row from col0: one 16-byte vector kept as loaded
// (4 registers, unpacked only at the fmafs: a group in flight costs half the registers of its
// floats in bf16/fp16) where kVec, else element by element as floats. Past h the lane reads the
// row's last columns instead (its sums there are never stored): no load is predicated, so a
// group's loads all issue before the first one returns (predicated, the compiler had serialised
// them: one latency per token).
template <typename T, bool kVec>
struct LaneCols {
  float e[Vec<T>::n];
  __device__ __forceinline__ void load(const T *p, int64_t col0, int64_t h) {
#pragma unroll
    for (int i = 0; i < Vec<T>::n; ++i) e[i] = ld(p, col0 + i < h ? col0 + i : h - 1);
  }
  __device__ __forceinline__ void get(float (&x)[Vec<T>::n]) const {
#pragma unroll
    for (int i = 0; i < Vec<T>::n; ++i) x[i] = e[i];
  }
};
template <typename T>
struct LaneCols<T, true> {  // h is a multiple of Vec<T>::n
  uint4 r;
  __device__ __forceinline__ void load(const T *p, int64_t col0, int64_t h) {
    r = ldv(p + (col0 < h ? col0 : h - Vec<T>::n));
  }
  __device__ __forceinline__ void get(float (&x)[Vec<T>::n]) const { unpack_vec<T>(r, x); }
};

// Positions wb .. wb + 31 of sy, one per lane (past t clamped to t - 1: every load unconditional,
// one coalesced load of each array per window): its label, its token, its label term (tcs is in
// sy's order, so no load waits on a token index).
struct RunWindow {
  int64_t lab;
  int p;    // token index (t < 2^31: checked by the launcher)
  float w;
};

__device__ __forceinline__ void load_window(RunWindow &q, const int64_t *__restrict__ sy,
                                            const int64_t *__restrict__ perm, const float *__restrict__ tcs,
                                            int64_t wb, int64_t t, int lane) {
  const int64_t j = wb + lane < t ? wb + lane : t - 1;
  q.lab = sy[j];
  q.p = (int)perm[j];
  q.w = tcs[j];
}

// Where a warp is in its run: the window it reads (q), the next one, in flight once this one is
// all the run's (nq), which of q's positions are the run's (in: a prefix, sy being sorted and
// every earlier position of the window before being the run's), and the group of q it is at.
struct RunCursor {
  RunWindow q, nq;
  int64_t wb;
  unsigned in;
  int gi;
};

__device__ __forceinline__ unsigned run_mask(const RunWindow &q, int64_t wb, int64_t t, int64_t v, int lane) {
  return __ballot_sync(kFullWarp, (wb + lane < t) & (q.lab == v));
}

// Steps to the run's next group of kFinishGroup positions (into the next window after the last
// group of this one, which the caller only does when that group was all the run's, so in is
// full) and returns which of them are the run's (a prefix).
__device__ __forceinline__ unsigned next_group(RunCursor &c, const int64_t *__restrict__ sy,
                                               const int64_t *__restrict__ perm, const float *__restrict__ tcs,
                                               int64_t t, int64_t v, int lane) {
  if (++c.gi == kFinishGroups) {
    c.wb += kFinishWindow;
    c.q = c.nq;
    c.in = run_mask(c.q, c.wb, t, v, lane);
    if (c.in == kFullWarp) load_window(c.nq, sy, perm, tcs, c.wb + kFinishWindow, t, lane);
    c.gi = 0;
  }
  return (c.in >> (c.gi * kFinishGroup)) & kFullGroup;
}

// A whole group of a run: this lane's columns of its tokens' rows of x, and where their label
// terms are (lanes gi * kFinishGroup + u of its window's w, kept as one register per lane).
template <typename T, bool kVec>
struct RunGroup {
  LaneCols<T, kVec> x[kFinishGroup];
  float wq;
  int gi;
};

template <typename T, bool kVec>
__device__ __forceinline__ void load_group(RunGroup<T, kVec> &g, const RunCursor &c, const T *__restrict__ x,
                                           int64_t ldx, int64_t c0, int64_t h) {
  int p[kFinishGroup];
#pragma unroll
  for (int u = 0; u < kFinishGroup; ++u) p[u] = __shfl_sync(kFullWarp, c.q.p, c.gi * kFinishGroup + u);
#pragma unroll
  for (int u = 0; u < kFinishGroup; ++u) g.x[u].load(x + (int64_t)p[u] * ldx, c0, h);
  g.wq = c.q.w;
  g.gi = c.gi;
}

// acc += w[u] * x[u], u in sy's order: the sum's order is the CPU kernel's (csrc/ce.c).
template <typename T, bool kVec>
__device__ __forceinline__ void fma_group(float (&acc)[Vec<T>::n], const RunGroup<T, kVec> &g) {
#pragma unroll
  for (int u = 0; u < kFinishGroup; ++u) {
    const float w = __shfl_sync(kFullWarp, g.wq, g.gi * kFinishGroup + u);
    float e[Vec<T>::n];
    g.x[u].get(e);
#pragma unroll
    for (int i = 0; i < Vec<T>::n; ++i) acc[i] = fmaf(w, e[i], acc[i]);
  }
}

// 16-byte lanes of bf16/fp16 fit 96 registers: 5 CTAs per SM, as many runs in flight as session
// 11's kernel (8 tokens at a time, 91 registers); unbounded, the two groups took 106 (4 CTAs).
// The element-wise and fp32 lanes (fallback shapes, and fp32 inputs, which the op never
// finishes) would spill at 96: bounded at 3 CTAs, as unbounded they take up to 168.
template <typename T, bool kVec>
constexpr int finish_min_ctas() { return kVec && sizeof(T) == 2 ? 5 : 3; }

template <typename T, bool kVec>
__global__ void __launch_bounds__(kFinishThreads, finish_min_ctas<T, kVec>())
    ce_dw_finish_runs_kernel(T *dw, int64_t ldw, int64_t v0, int64_t nv, const T *__restrict__ x, int64_t ldx,
                             int64_t h, const int64_t *__restrict__ sy, const int64_t *__restrict__ perm,
                             const float *__restrict__ tcs, int64_t t, const float *__restrict__ cs,
                             const float *__restrict__ mu, unsigned char *flags) {
  constexpr int N = Vec<T>::n;
  const int lane = threadIdx.x & 31;
  const int64_t c0 = (int64_t)blockIdx.x * finish_slab<T>() + (int64_t)lane * N;  // this lane's first column
  const int64_t nwarps = (int64_t)gridDim.y * kFinishWarps;
  for (int64_t k = (int64_t)blockIdx.y * kFinishWarps + (threadIdx.x >> 5); k < t; k += nwarps) {
    RunCursor c;
    c.wb = k;
    c.gi = 0;
    load_window(c.q, sy, perm, tcs, k, t, lane);
    const int64_t before = sy[k > 0 ? k - 1 : 0];              // issued with the window's loads
    const int64_t v = __shfl_sync(kFullWarp, c.q.lab, 0);     // sy[k]
    if (v < v0 || v >= v0 + nv || (k > 0 && before == v)) continue;  // not a run start: uniform over the warp
    c.in = run_mask(c.q, k, t, v, lane);
    if (c.in == kFullWarp) load_window(c.nq, sy, perm, tcs, k + kFinishWindow, t, lane);
    const int64_t r = v - v0;
    if (flags && blockIdx.x == 0 && lane == 0) flags[r] = 1;
    T *row = dw + r * ldw;
    LaneCols<T, kVec> old;
    old.load(row, c0, h);  // the row's loads first: they overlap the run's
    float acc[N];
    if (cs) {  // uniform over the grid; the loads unconditional (clamped), so issued together
      const float cr = cs[r];
      float m[N];
#pragma unroll
      for (int i = 0; i < N; ++i) m[i] = mu[c0 + i < h ? c0 + i : h - 1];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = __fmul_rn(cr, m[i]);  // _rn: never contracted
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = 0.f;
    }
    // Whole groups, two in flight: a group's loads are issued before the previous group's
    // fmafs, which wait for that group's (issued one step earlier). Unrolled by two so the
    // groups stay in their registers (a copy of a group in flight would wait for its loads).
    unsigned bits = c.in & kFullGroup;
    if (bits == kFullGroup) {
      RunGroup<T, kVec> a, b;
      load_group(a, c, x, ldx, c0, h);
      for (;;) {
        bits = next_group(c, sy, perm, tcs, t, v, lane);
        if (bits != kFullGroup) { fma_group(acc, a); break; }
        load_group(b, c, x, ldx, c0, h);
        fma_group(acc, a);
        bits = next_group(c, sy, perm, tcs, t, v, lane);
        if (bits != kFullGroup) { fma_group(acc, b); break; }
        load_group(a, c, x, ldx, c0, h);
        fma_group(acc, b);
      }
    }
    // The run's last tokens: a prefix (bits) of group c.gi, one at a time (a run of one token,
    // the common case for uniform labels, loads one row).
#pragma unroll
    for (int u = 0; u < kFinishGroup; ++u) {
      const int src = c.gi * kFinishGroup + u;
      const int p = __shfl_sync(kFullWarp, c.q.p, src);
      const float w = __shfl_sync(kFullWarp, c.q.w, src);
      if ((bits >> u) & 1u) {
        LaneCols<T, kVec> xr;
        xr.load(x + (int64_t)p * ldx, c0, h);
        float xv[N];
        xr.get(xv);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = fmaf(w, xv[i], acc[i]);
      }
    }
    float d[N];
    old.get(d);
#pragma unroll
    for (int i = 0; i < N; ++i) d[i] = __fadd_rn(d[i], acc[i]);
    if constexpr (kVec) {
      if (c0 < h) *reinterpret_cast<uint4 *>(row + c0) = pack_vec<T>(d);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i)
        if (c0 + i < h) row[c0 + i] = from_f32<T>(d[i]);
    }
  }
}

// Rows the runs kernel did not mark: dw[r] = rn(dw[r] + rn(cs[r] * mu[j])), element by element
// the arithmetic of the runs kernel's rank-1 start (no label term) and of csrc/ce.c.
// ce_dw_finish_rank1_kernel, 16-byte lanes (h a multiple of Vec<T>::n, rows 16-byte aligned: the
// launcher checks): a thread owns one vector of columns for every row it visits, holds its
// Vec<T>::n values of mu in registers (loaded once), and takes kRank1Rows rows per step with their
// loads issued together (grid.x: column slabs of kScaleThreads vectors; grid.y: row groups,
// grid-stride). ce_dw_finish_rank1_rows_kernel, any h and alignment: one CTA per row, a scalar head,
// vectors, a scalar tail. (H200, T = 32k, V = 151936, uniform labels, ~122k unmarked rows: the
// CTA-per-row kernel took 0.81 ms for ~2 GB of reads + writes, 2.5 TB/s: one vector in flight
// per thread, and eight scalar loads of mu per vector.)
constexpr int kRank1Rows = 4;

template <typename T>
__global__ void __launch_bounds__(kScaleThreads)
    ce_dw_finish_rank1_kernel(T *dw, int64_t ldw, int64_t nv, int64_t h, const float *__restrict__ cs,
                              const float *__restrict__ mu, const unsigned char *__restrict__ flags) {
  constexpr int N = Vec<T>::n;
  const int64_t col = ((int64_t)blockIdx.x * kScaleThreads + threadIdx.x) * N;
  if (col >= h) return;  // (no barrier below)
  float m[N];
#pragma unroll
  for (int i = 0; i < N; ++i) m[i] = mu[col + i];
  for (int64_t r0 = (int64_t)blockIdx.y * kRank1Rows; r0 < nv; r0 += (int64_t)gridDim.y * kRank1Rows) {
    bool live[kRank1Rows];
    float c[kRank1Rows];
    uint4 u[kRank1Rows];
#pragma unroll
    for (int k = 0; k < kRank1Rows; ++k) {  // the rows' loads all issue before the first is used
      const int64_t r = r0 + k;
      live[k] = r < nv && !flags[r];
      c[k] = live[k] ? cs[r] : 0.f;
      u[k] = live[k] ? ldv_last(dw + r * ldw + col) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kRank1Rows; ++k) {
      if (!live[k]) continue;
      float e[N];
      unpack_vec<T>(u[k], e);
#pragma unroll
      for (int i = 0; i < N; ++i) e[i] = __fadd_rn(e[i], __fmul_rn(c[k], m[i]));
      store_vec(dw + (r0 + k) * ldw + col, e);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kScaleThreads)
    ce_dw_finish_rank1_rows_kernel(T *dw, int64_t ldw, int64_t nv, int64_t h, const float *__restrict__ cs,
                                   const float *__restrict__ mu, const unsigned char *__restrict__ flags) {
  constexpr int N = Vec<T>::n;
  const int tid = threadIdx.x;
  for (int64_t r = blockIdx.x; r < nv; r += gridDim.x) {
    if (flags[r]) continue;  // uniform over the CTA
    const float c = cs[r];
    T *row = dw + r * ldw;
    const int hd = head_cols(row, h);
    const int64_t nvec = (h - hd) / N;
    T *body = row + hd;
    if (tid < hd) row[tid] = from_f32<T>(__fadd_rn(ld(row, tid), __fmul_rn(c, mu[tid])));
    for (int64_t k = tid; k < nvec; k += kScaleThreads) {
      float e[N];
      unpack_vec<T>(ldv(body + k * N), e);
#pragma unroll
      for (int j = 0; j < N; ++j) e[j] = __fadd_rn(e[j], __fmul_rn(c, mu[hd + k * N + j]));
      store_vec(body + k * N, e);
    }
    const int64_t j = hd + nvec * N + tid;  // tail: fewer than N columns
    if (j < h) row[j] = from_f32<T>(__fadd_rn(ld(row, j), __fmul_rn(c, mu[j])));
  }
}

// dX's finish (vocab_outer_lowp): dx[t] += tc[t] * w[labels[t] - v0], fmaf in fp32 then one
// rounding, for the tokens whose label is one of w's rows [v0, v0 + nv); other rows untouched.
// One CTA per token row (grid-stride); the condition is uniform over the CTA. The same
// arithmetic as csrc/ce.c ce_dx_finish_range.
template <typename T>
__global__ void __launch_bounds__(kFinishThreads)
    ce_dx_finish_kernel(T *dx, int64_t ldx, const T *__restrict__ w, int64_t ldw, int64_t v0, int64_t nv, int64_t h,
                        const int64_t *__restrict__ labels, const float *__restrict__ tc, int64_t t) {
  for (int64_t i = blockIdx.x; i < t; i += gridDim.x) {
    const int64_t r = labels[i] - v0;
    if (r < 0 || r >= nv) continue;
    const float c = tc[i];
    T *row = dx + i * ldx;
    const T *wr = w + r * ldw;
    for (int64_t j = threadIdx.x; j < h; j += kFinishThreads) row[j] = from_f32<T>(fmaf(c, ld(wr, j), ld(row, j)));
  }
}

inline int valid_cols(int64_t v, int64_t v0, int64_t v_valid) {
  int64_t n = v_valid - v0;
  return (int)(n < 0 ? 0 : (n > v ? v : n));
}

template <typename In>
void launch_fold(const void *z, int64_t ldz, int64_t t, int nv, int64_t v0, const int64_t *labels,
                 int64_t ignore_index, float softcap, float *m, float *s, float *zy, float *zsum, float *sx,
                 cudaStream_t stream) {
  if (softcap > 0.f)
    ce_fold_kernel<In, true><<<grid_for(t), kThreads, 0, stream>>>((const In *)z, ldz, t, nv, v0, labels,
                                                                   ignore_index, softcap, m, s, zy, zsum, sx);
  else
    ce_fold_kernel<In, false><<<grid_for(t), kThreads, 0, stream>>>((const In *)z, ldz, t, nv, v0, labels,
                                                                    ignore_index, softcap, m, s, zy, zsum, sx);
}

template <typename In, typename Out>
void launch_grad(const void *z, int64_t ldz, int64_t t, int v, int nv, int64_t v0, const int64_t *labels,
                 int64_t ignore_index, float softcap, const float *mrow, const float *ls, const float *q,
                 const float *g, int64_t g_stride, float eps, float uni, float zloss, void *out, int64_t ldo,
                 cudaStream_t stream) {
  if (softcap > 0.f)
    ce_grad_kernel<In, Out, true><<<grid_for(t), kThreads, 0, stream>>>(
        (const In *)z, ldz, t, v, nv, v0, labels, ignore_index, softcap, mrow, ls, q, g, g_stride, eps, uni, zloss,
        (Out *)out, ldo);
  else
    ce_grad_kernel<In, Out, false><<<grid_for(t), kThreads, 0, stream>>>(
        (const In *)z, ldz, t, v, nv, v0, labels, ignore_index, softcap, mrow, ls, q, g, g_stride, eps, uni, zloss,
        (Out *)out, ldo);
}

// The (logits, dZ) element types the gradient kernels take, by dtype code (0 fp32, 1 bf16, 2 fp16):
// (0, 0..2), (1, 1), (2, 2). Calls f(Tag<In>{}, Tag<Out>{}) for a known pair; false for any other.
template <typename T>
struct Tag { using type = T; };

template <typename F>
bool with_grad_dtypes(int z_dtype, int out_dtype, F &&f) {
  switch (z_dtype * 3 + out_dtype) {
    case 0: f(Tag<float>{}, Tag<float>{}); return true;
    case 1: f(Tag<float>{}, Tag<__nv_bfloat16>{}); return true;
    case 2: f(Tag<float>{}, Tag<__half>{}); return true;
    case 4: f(Tag<__nv_bfloat16>{}, Tag<__nv_bfloat16>{}); return true;
    case 8: f(Tag<__half>{}, Tag<__half>{}); return true;
    default: return false;
  }
}

// SMs x resident CTAs per SM of the colsum kernel <In, Out, kCap> on the current device: queried
// once per device (each chunk's launch used to query the device and the occupancy), 0 when a
// query fails. Threads may race to fill an entry; they write the same value.
template <typename In, typename Out, bool kCap, typename K>
int resident_ctas(K kernel) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // zero-initialised: not queried yet
  int dev = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev >= 0 && dev < kMaxDevices) {
    const int known = cache[dev].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kSlabThreads, 0) != cudaSuccess)
    return 0;
  const int resident = sms * (per_sm > 0 ? per_sm : 1);
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(resident, std::memory_order_relaxed);
  return resident;
}

// The slab kernel + the reduction; returns the number of row groups used (<= gmax), 0 on a bad launch.
template <typename In, typename Out, bool kCap>
int launch_grad_colsum_t(const void *z, int64_t ldz, int64_t t, int v, int nv, int64_t v0, const int64_t *labels,
                         int64_t ignore_index, float softcap, const float *mrow, const float *ls, const float *q,
                         const float *g, int64_t g_stride, float eps, float uni, float zloss, void *out, int64_t ldo,
                         float *part, int64_t ldp, int gmax, float *cs, int first, float *tc, cudaStream_t stream) {
  constexpr int N = Vec<In>::n;
  auto kernel = ce_grad_colsum_kernel<In, Out, kCap>;
  const int resident = resident_ctas<In, Out, kCap>(kernel);
  if (resident == 0) return 0;
  // One wave: as many row groups as fit next to the column slabs (at V = 151936, bf16: 75 slabs of
  // 2048 columns, 4 x 132 resident CTAs, 7 groups of <= 293 rows), at most gmax (part's rows).
  const int64_t slabs = ((int64_t)v + (int64_t)kSlabThreads * N - 1) / ((int64_t)kSlabThreads * N);
  int64_t groups = (int64_t)resident / (slabs > 0 ? slabs : 1);
  groups = groups < 1 ? 1 : (groups > gmax ? gmax : groups);
  groups = groups > t ? t : groups;
  const int64_t rows_per_group = (t + groups - 1) / groups;
  groups = (t + rows_per_group - 1) / rows_per_group;  // no empty group
  kernel<<<dim3((unsigned)slabs, (unsigned)groups), kSlabThreads, 0, stream>>>(
      (const In *)z, ldz, t, v, nv, v0, labels, ignore_index, softcap, mrow, ls, q, g, g_stride, eps, uni, zloss,
      (Out *)out, ldo, part, ldp, rows_per_group, tc);
  const int64_t rblocks = ((int64_t)v + kScaleThreads - 1) / kScaleThreads;
  if (v > 0)
    ce_colsum_reduce_kernel<<<(unsigned)(rblocks < kScaleGrid ? rblocks : kScaleGrid), kScaleThreads, 0, stream>>>(
        part, ldp, (int)groups, nv, v, cs, first);
  return (int)groups;
}

template <typename In, typename Out>
int launch_grad_colsum(const void *z, int64_t ldz, int64_t t, int v, int nv, int64_t v0, const int64_t *labels,
                       int64_t ignore_index, float softcap, const float *mrow, const float *ls, const float *q,
                       const float *g, int64_t g_stride, float eps, float uni, float zloss, void *out, int64_t ldo,
                       float *part, int64_t ldp, int gmax, float *cs, int first, float *tc, cudaStream_t stream) {
  return softcap > 0.f
             ? launch_grad_colsum_t<In, Out, true>(z, ldz, t, v, nv, v0, labels, ignore_index, softcap, mrow, ls, q, g,
                                                   g_stride, eps, uni, zloss, out, ldo, part, ldp, gmax, cs, first,
                                                   tc, stream)
             : launch_grad_colsum_t<In, Out, false>(z, ldz, t, v, nv, v0, labels, ignore_index, softcap, mrow, ls, q,
                                                    g, g_stride, eps, uni, zloss, out, ldo, part, ldp, gmax, cs,
                                                    first, tc, stream);
}

template <typename T>
void launch_scale(void *p, int64_t n, const float *g, cudaStream_t stream) {
  const int64_t vecs = n / Vec<T>::n + 1;
  const int64_t blocks = (vecs + kScaleThreads - 1) / kScaleThreads;
  ce_scale_kernel<T><<<(unsigned)(blocks < kScaleGrid ? blocks : kScaleGrid), kScaleThreads, 0, stream>>>((T *)p, n, g);
}

}  // namespace

// The finish's two kernels for one dtype (mp_ce_dw_finish_cuda checked the sizes).
template <typename T>
void launch_dw_finish(T *dw, int64_t ldw, int64_t v0, int64_t nv, const T *x, int64_t ldx, int64_t h,
                      const int64_t *sy, const int64_t *perm, const float *tcs, int64_t t, const float *cs,
                      const float *mu, unsigned char *flags, cudaStream_t sm) {
  constexpr int64_t N = Vec<T>::n;
  if (t > 0) {
    // Column slabs across x, so a run's slabs are dispatched together (a run's warps in grid.y
    // order had the last slab of a frequent label's run start only after 15/16 of the grid).
    const dim3 runs((unsigned)((h + finish_slab<T>() - 1) / finish_slab<T>()),
                    grid_for((t + kFinishWarps - 1) / kFinishWarps));
    // 16-byte lanes: every row of dw and x starts on a 16-byte boundary and h fills whole vectors
    const bool vec = h % N == 0 && ldw % N == 0 && ldx % N == 0 && ((uintptr_t)dw & 15u) == 0 &&
                     ((uintptr_t)x & 15u) == 0;
    if (vec)
      ce_dw_finish_runs_kernel<T, true><<<runs, kFinishThreads, 0, sm>>>(dw, ldw, v0, nv, x, ldx, h, sy, perm, tcs, t,
                                                                         cs, mu, flags);
    else
      ce_dw_finish_runs_kernel<T, false><<<runs, kFinishThreads, 0, sm>>>(dw, ldw, v0, nv, x, ldx, h, sy, perm, tcs,
                                                                          t, cs, mu, flags);
  }
  if (!cs) return;
  if (h % N == 0 && ldw % N == 0 && ((uintptr_t)dw & 15u) == 0) {
    const int64_t per_cta = (int64_t)kScaleThreads * N;  // columns of one column slab
    const dim3 grid((unsigned)((h + per_cta - 1) / per_cta), grid_for((nv + kRank1Rows - 1) / kRank1Rows));
    ce_dw_finish_rank1_kernel<T><<<grid, kScaleThreads, 0, sm>>>(dw, ldw, nv, h, cs, mu, flags);
  } else {
    ce_dw_finish_rank1_rows_kernel<T><<<grid_for(nv), kScaleThreads, 0, sm>>>(dw, ldw, nv, h, cs, mu, flags);
  }
}

extern "C" {

// z_dtype / out_dtype: 0 fp32, 1 bf16, 2 fp16. Low-precision logits (z_dtype 1, 2)
// need out_dtype == z_dtype (dZ in place: out == z, ldo == ldz, checked by the binding).
mp_status mp_ce_fold_cuda(const void *z, int z_dtype, int64_t ldz, int64_t t, int64_t v, int64_t v0,
                          int64_t v_valid, const int64_t *labels, int64_t ignore_index, float softcap, float *m,
                          float *s, float *zy, float *zsum, float *sx, uintptr_t stream) {
  mp_status st = MP_OK;
  if (t <= 0) return MP_OK;
  if (v < 0 || v > INT_MAX) MP_FAIL(st, MP_ERR_INVALID, "ce_fold: v must be in [0, 2^31), got %lld", (long long)v);
  {
    const int nv = valid_cols(v, v0, v_valid);
    cudaStream_t sm = MP_STREAM(stream);
    switch (z_dtype) {
      case 0: launch_fold<float>(z, ldz, t, nv, v0, labels, ignore_index, softcap, m, s, zy, zsum, sx, sm); break;
      case 1: launch_fold<__nv_bfloat16>(z, ldz, t, nv, v0, labels, ignore_index, softcap, m, s, zy, zsum, sx, sm);
              break;
      case 2: launch_fold<__half>(z, ldz, t, nv, v0, labels, ignore_index, softcap, m, s, zy, zsum, sx, sm); break;
      default: MP_FAIL(st, MP_ERR_INVALID, "ce_fold: z_dtype must be 0, 1 or 2, got %d", z_dtype);
    }
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

mp_status mp_ce_grad_cuda(const void *z, int z_dtype, int64_t ldz, int64_t t, int64_t v, int64_t v0,
                          int64_t v_valid, const int64_t *labels, int64_t ignore_index, float softcap,
                          const float *mrow, const float *ls, const float *q, const float *g, int64_t g_stride,
                          float eps, int64_t n_classes, float zloss, void *out, int64_t ldo, int out_dtype,
                          uintptr_t stream) {
  mp_status st = MP_OK;
  const float uni = eps / (float)n_classes;
  cudaStream_t sm = MP_STREAM(stream);
  if (t <= 0) return MP_OK;
  if (v < 0 || v > INT_MAX) MP_FAIL(st, MP_ERR_INVALID, "ce_grad: v must be in [0, 2^31), got %lld", (long long)v);
  {
    const int vi = (int)v, nv = valid_cols(v, v0, v_valid);
    const bool known = with_grad_dtypes(z_dtype, out_dtype, [&](auto in, auto out_tag) {
      using In = typename decltype(in)::type;
      using Out = typename decltype(out_tag)::type;
      constexpr bool in_place = std::is_same<In, Out>::value;  // fp32 / fp32 included: dZ in place
      launch_grad<In, Out>(z, ldz, t, vi, nv, v0, labels, ignore_index, softcap, mrow, ls, q, g, g_stride, eps, uni,
                           zloss, in_place ? (void *)z : out, in_place ? ldz : ldo, sm);
    });
    if (!known)
      MP_FAIL(st, MP_ERR_INVALID, "ce_grad: (z_dtype, out_dtype) must be (0, 0..2), (1, 1) or (2, 2), got (%d, %d)",
              z_dtype, out_dtype);
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

// ce_grad + the column sums of the dZ written, target elements excluded, into cs: [v] x fp32 (padding columns: 0)
// (first: cs = sums, else cs += sums), through part: [gmax, ldp] x fp32 scratch (ldp >= nv). tc: [t] x fp32 or
// null: also take the label column out of dZ into tc (ce_grad_colsum_kernel).
// Needs z 16-byte aligned rows (z and ldz * sizeof) and out aligned rows to its vector width.
mp_status mp_ce_grad_colsum_cuda(const void *z, int z_dtype, int64_t ldz, int64_t t, int64_t v, int64_t v0,
                                 int64_t v_valid, const int64_t *labels, int64_t ignore_index, float softcap,
                                 const float *mrow, const float *ls, const float *q, const float *g,
                                 int64_t g_stride, float eps, int64_t n_classes, float zloss, void *out, int64_t ldo,
                                 int out_dtype, float *part, int64_t ldp, int64_t gmax, float *cs, int first,
                                 float *tc, uintptr_t stream) {
  mp_status st = MP_OK;
  const float uni = eps / (float)n_classes;
  cudaStream_t sm = MP_STREAM(stream);
  static const int kBytes[3] = {4, 2, 2};
  if (t <= 0) return MP_OK;
  if (v < 0 || v > INT_MAX) MP_FAIL(st, MP_ERR_INVALID, "ce_grad_colsum: v must be in [0, 2^31), got %lld", (long long)v);
  if (z_dtype < 0 || z_dtype > 2 || out_dtype < 0 || out_dtype > 2)
    MP_FAIL(st, MP_ERR_INVALID, "ce_grad_colsum: dtype codes must be 0..2, got (%d, %d)", z_dtype, out_dtype);
  {
    const int nv = valid_cols(v, v0, v_valid);
    const int64_t zb = kBytes[z_dtype], ob = kBytes[out_dtype], ovec = 16 / zb * ob;  // out's vector bytes
    if (((uintptr_t)z & 15) || (ldz * zb) % 16 || ((uintptr_t)out % ovec) || (ldo * ob) % ovec)
      MP_FAIL(st, MP_ERR_INVALID, "ce_grad_colsum: needs 16-byte aligned logits rows (z %p, ldz %lld) and "
              "%lld-byte aligned dZ rows (out %p, ldo %lld)", z, (long long)ldz, (long long)ovec, out, (long long)ldo);
    if (gmax < 1 || gmax > 65535 || ldp < nv)
      MP_FAIL(st, MP_ERR_INVALID, "ce_grad_colsum: needs 1 <= gmax <= 65535 and ldp >= nv, got gmax %lld, ldp %lld, "
              "nv %d", (long long)gmax, (long long)ldp, nv);
    const int vi = (int)v, gm = (int)gmax;
    int used = 0;
    const bool known = with_grad_dtypes(z_dtype, out_dtype, [&](auto in, auto out_tag) {
      using In = typename decltype(in)::type;
      using Out = typename decltype(out_tag)::type;
      used = launch_grad_colsum<In, Out>(z, ldz, t, vi, nv, v0, labels, ignore_index, softcap, mrow, ls, q, g, g_stride,
                                         eps, uni, zloss, out, ldo, part, ldp, gm, cs, first, tc, sm);
    });
    if (!known)
      MP_FAIL(st, MP_ERR_INVALID,
              "ce_grad_colsum: (z_dtype, out_dtype) must be (0, 0..2), (1, 1) or (2, 2), got (%d, %d)", z_dtype,
              out_dtype);
    if (used == 0)
      MP_FAIL(st, MP_ERR_CUDA, "ce_grad_colsum: device query failed: %s", cudaGetErrorString(cudaGetLastError()));
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

// out: [n, ldo], x: [n, ldx], mu: [h], all dtype (0 fp32, 1 bf16, 2 fp16), on the device; h, ldx and
// ldo multiples of the 16-byte vector's element count, the pointers 16-byte aligned.
mp_status mp_ce_sub_row_cuda(void *out, int64_t ldo, const void *x, int64_t ldx, const void *mu, int64_t n, int64_t h,
                             int dtype, uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t sm = MP_STREAM(stream);
  const int64_t vec = dtype == 0 ? 4 : 8;
  if (n <= 0 || h <= 0) return MP_OK;
  if (dtype < 0 || dtype > 2) MP_FAIL(st, MP_ERR_INVALID, "ce_sub_row: dtype must be 0, 1 or 2, got %d", dtype);
  if (h % vec || ldx % vec || ldo % vec || (((uintptr_t)out | (uintptr_t)x | (uintptr_t)mu) & 15u))
    MP_FAIL(st, MP_ERR_INVALID, "ce_sub_row: h, ldx, ldo must be multiples of %lld and the pointers 16-byte aligned",
            (long long)vec);
  {
    const int64_t hv = h / vec, per_block = (int64_t)kSubThreads * kSubUnroll;
    const int64_t blocks = (n * hv + per_block - 1) / per_block;
    const unsigned grid = (unsigned)(blocks < kScaleGrid ? blocks : kScaleGrid);
    switch (dtype) {
      case 0:
        ce_sub_row_kernel<float><<<grid, kSubThreads, 0, sm>>>((float *)out, ldo, (const float *)x, ldx,
                                                               (const float *)mu, n, hv);
        break;
      case 1:
        ce_sub_row_kernel<__nv_bfloat16><<<grid, kSubThreads, 0, sm>>>(
            (__nv_bfloat16 *)out, ldo, (const __nv_bfloat16 *)x, ldx, (const __nv_bfloat16 *)mu, n, hv);
        break;
      default:
        ce_sub_row_kernel<__half><<<grid, kSubThreads, 0, sm>>>((__half *)out, ldo, (const __half *)x, ldx,
                                                                (const __half *)mu, n, hv);
    }
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

// dw: [nv, ldw] rows for labels v0 .. v0 + nv - 1, x: [t, ldx], both dtype (0 fp32, 1 bf16, 2 fp16);
// sy, perm: the labels sorted stably and their token indices; tcs: [t] x fp32, the label terms in sy's
// order (tc[perm[k]] at k); cs: [nv], mu: [h] x fp32
// (the rank-1 term cs[r] * mu, or both null) and then flags: [nv] bytes, zero (the rows the label
// runs wrote; set whenever cs is: py_ce_dw_finish checks). All on the device.
mp_status mp_ce_dw_finish_cuda(void *dw, int dtype, int64_t ldw, int64_t v0, int64_t nv, const void *x,
                               int64_t ldx, int64_t h, const int64_t *sy, const int64_t *perm, const float *tcs,
                               int64_t t, const float *cs, const float *mu, unsigned char *flags, uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t sm = MP_STREAM(stream);
  if (nv <= 0 || h <= 0 || (t <= 0 && !cs)) return MP_OK;
  {
    if (t > INT_MAX) MP_FAIL(st, MP_ERR_INVALID, "ce_dw_finish: t = %lld tokens, at most %d", (long long)t, INT_MAX);
    switch (dtype) {
      case 0:
        launch_dw_finish<float>((float *)dw, ldw, v0, nv, (const float *)x, ldx, h, sy, perm, tcs, t, cs, mu, flags, sm);
        break;
      case 1:
        launch_dw_finish<__nv_bfloat16>((__nv_bfloat16 *)dw, ldw, v0, nv, (const __nv_bfloat16 *)x, ldx, h, sy, perm,
                                        tcs, t, cs, mu, flags, sm);
        break;
      case 2:
        launch_dw_finish<__half>((__half *)dw, ldw, v0, nv, (const __half *)x, ldx, h, sy, perm, tcs, t, cs, mu, flags,
                                 sm);
        break;
      default: MP_FAIL(st, MP_ERR_INVALID, "ce_dw_finish: dtype must be 0, 1 or 2, got %d", dtype);
    }
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

// dx: [t, ldx], w: [nv, ldw] rows for labels v0 .. v0 + nv - 1, both dtype (0 fp32, 1 bf16, 2 fp16);
// labels: [t] int64; tc: [t] x fp32. All on the device.
mp_status mp_ce_dx_finish_cuda(void *dx, int dtype, int64_t ldx, const void *w, int64_t ldw, int64_t v0,
                               int64_t nv, int64_t h, const int64_t *labels, const float *tc, int64_t t,
                               uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t sm = MP_STREAM(stream);
  if (nv <= 0 || h <= 0 || t <= 0) return MP_OK;
  {
    const unsigned grid = grid_for(t);
    switch (dtype) {
      case 0:
        ce_dx_finish_kernel<float><<<grid, kFinishThreads, 0, sm>>>((float *)dx, ldx, (const float *)w, ldw, v0, nv,
                                                                   h, labels, tc, t);
        break;
      case 1:
        ce_dx_finish_kernel<__nv_bfloat16><<<grid, kFinishThreads, 0, sm>>>(
            (__nv_bfloat16 *)dx, ldx, (const __nv_bfloat16 *)w, ldw, v0, nv, h, labels, tc, t);
        break;
      case 2:
        ce_dx_finish_kernel<__half><<<grid, kFinishThreads, 0, sm>>>((__half *)dx, ldx, (const __half *)w, ldw, v0,
                                                                    nv, h, labels, tc, t);
        break;
      default: MP_FAIL(st, MP_ERR_INVALID, "ce_dx_finish: dtype must be 0, 1 or 2, got %d", dtype);
    }
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

// p: [n] x dtype (0 fp32, 1 bf16, 2 fp16) on the device, p *= *g (g: one fp32 on the device).
mp_status mp_ce_scale_cuda(void *p, int dtype, int64_t n, const float *g, uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t sm = MP_STREAM(stream);
  if (n <= 0) return MP_OK;
  switch (dtype) {
    case 0: launch_scale<float>(p, n, g, sm); break;
    case 1: launch_scale<__nv_bfloat16>(p, n, g, sm); break;
    case 2: launch_scale<__half>(p, n, g, sm); break;
    default: MP_FAIL(st, MP_ERR_INVALID, "ce_scale: dtype must be 0, 1 or 2, got %d", dtype);
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

}  // extern "C"
