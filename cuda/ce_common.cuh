// ce_common.cuh: what Ring-DTP's CUDA C kernels (ce_fold.cu, ce_grad.cu, ce_finish.cu)
// share: constants, 16-byte vector loads/stores and element conversions. The kernels: the online log-sum-exp fold and the
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
//         per kUnroll vectors.
//   grad: unpack 1, FADD 1, FFMA 1, ex2 1, FFMA 1, cvt 0.5: ~6 (+ tanhf with softcap).
// Exponentials are 2^(log2e * (x - ref)) with the multiply fused, one MUFU.EX2
// each (ex2_ftz: < 2^-22 relative error; results below 2^-126 flushed to 0).
// On an H200, [2048, 151936] bf16 blocks: fold ~3.4 TB/s, grad ~3.9 TB/s (read + write),
// against an HBM copy rate of ~4.2 (benchmarks/profile_kernels.py).
#pragma once
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include <atomic>
#include <type_traits>

#include "ce.h"
#include "common.cuh"

// Internal linkage: each ce_*.cu compiles its own copy of these helpers.
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
// more instructions per element on the subnormal range.
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
// holds (with these hints and the last-use loads the grad kernel streams ~3.9 TB/s on an
// H200 where it streams ~2.7 without; benchmarks/profile_kernels.py measures it).
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

inline unsigned grid_for(int64_t t) { return (unsigned)(t < kMaxGrid ? t : kMaxGrid); }

inline int valid_cols(int64_t v, int64_t v0, int64_t v_valid) {
  int64_t n = v_valid - v0;
  return (int)(n < 0 ? 0 : (n > v ? v : n));
}

}  // namespace
