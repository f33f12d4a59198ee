// common.cuh: what every CUDA C file of moepeak includes.
// MP_CUDA_STATUS(expr) is the mp_status of one runtime call; MP_CUDA_CHECK records file:line and cudaGetErrorString and jumps to the
// caller's `fail:` label with `st` set (docs/design.md section 4, C errors). On a
// failure it also calls cudaGetLastError(), which clears a non-sticky error
// (a refused cudaHostAlloc, a bad launch configuration) so the next launch
// check anywhere in the process does not report it as its own; a sticky error
// (a device fault) stays, as the runtime keeps it for every later call.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "moepeak.h"

static inline mp_status mp_cuda_status(cudaError_t e, const char *file, int line, const char *expr) {
  if (e == cudaSuccess) return MP_OK;
  mp_set_error(file, line, "%s: %s", expr, cudaGetErrorString(e));
  (void)cudaGetLastError(); /* clear it when not sticky */
  return MP_ERR_CUDA;
}
// The status of one runtime call: MP_OK, or MP_ERR_CUDA with "file:line: expr: reason"
// recorded and a non-sticky error cleared.
#define MP_CUDA_STATUS(expr) mp_cuda_status((expr), __FILE__, __LINE__, #expr)
#define MP_CUDA_CHECK(st, expr)                                                 \
  do {                                                                          \
    const mp_status mp_s_ = MP_CUDA_STATUS(expr);                               \
    if (mp_s_ != MP_OK) {                                                       \
      (st) = mp_s_;                                                             \
      goto fail;                                                                \
    }                                                                           \
  } while (0)

// After a kernel launch: a bad configuration shows up here, not later.
#define MP_CUDA_CHECK_LAUNCH(st) MP_CUDA_CHECK(st, cudaGetLastError())

#define MP_STREAM(s) (reinterpret_cast<cudaStream_t>(s))
#define MP_EVENT(e) (reinterpret_cast<cudaEvent_t>(e))

// Element conversions the kernels share: any float type to fp32, and fp32 back
// with one rounding to nearest even (torch's cast).
static __device__ __forceinline__ float to_f32(float v) { return v; }
static __device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
static __device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// Block-wide reduction of K floats over a block of kBlock threads (kMax: max, else sum):
// butterfly shuffles within each warp, then every thread combines the warps' values in
// warp order, so every thread gets the same result, bitwise. sh: [kBlock / 32 * K] floats
// of shared memory; the leading barrier lets a previous reduction's readers finish first.
template <int kBlock, int K, bool kMax>
__device__ __forceinline__ void block_reduce(float (&x)[K], float *sh) {
  static_assert(kBlock % 32 == 0, "whole warps");
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float y = __shfl_xor_sync(0xffffffffu, x[k], o);
      x[k] = kMax ? fmaxf(x[k], y) : x[k] + y;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) sh[warp * K + k] = x[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    x[k] = sh[k];
    for (int w = 1; w < kBlock / 32; ++w) x[k] = kMax ? fmaxf(x[k], sh[w * K + k]) : x[k] + sh[w * K + k];
  }
}
