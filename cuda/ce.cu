// ce.cu: Ring-DTP's CUDA C kernels: the online log-sum-exp fold and the
// softmax-gradient epilogue over one fp32 logits block Z: [t, ldz] (row i =
// token i, columns [0, v) = global vocab ids [v0, v0 + v)). Same arithmetic as
// the CPU kernels in csrc/ce.c (see the formulas there). The GEMM producing Z
// is torch's; nothing here ever holds more than the one block it is given, and
// no [T, V] logits tensor exists anywhere.
//
// Layout of work: one thread block per row (grid-stride over rows), threads
// stride over the row's columns, block-wide reductions through shared memory.
// A row is thousands of columns (a vocab block), so a block per row keeps every
// load coalesced and the reductions short.
#include <math.h>
#include <stdint.h>

#include "common.cuh"

namespace {

constexpr int kThreads = 256;     // threads per row: 8 warps, enough loads in flight per SM
constexpr int kMaxGrid = 65535;   // rows beyond this are handled by the grid-stride loop

__device__ __forceinline__ float cap(float x, float c) { return c > 0.f ? c * tanhf(x / c) : x; }

// Block-wide reduction of one float (op: 0 max, 1 sum); every thread gets the result.
__device__ float block_reduce(float x, int op, float *sh) {
  for (int o = 16; o > 0; o >>= 1) {
    float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = op == 0 ? fmaxf(x, y) : x + y;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // sh may still be read by a previous reduction
  if (lane == 0) sh[warp] = x;
  __syncthreads();
  x = sh[0];
  for (int w = 1; w < kThreads / 32; ++w) x = op == 0 ? fmaxf(x, sh[w]) : x + sh[w];
  return x;
}

__device__ __forceinline__ int64_t valid_cols(int64_t v, int64_t v0, int64_t v_valid) {
  int64_t n = v_valid - v0;
  return n < 0 ? 0 : (n > v ? v : n);
}

__global__ void ce_fold_kernel(const float *__restrict__ z, int64_t ldz, int64_t t, int64_t v, int64_t v0,
                               int64_t v_valid, const int64_t *__restrict__ labels, int64_t ignore_index,
                               float c, float *m, float *s, float *zy, float *zsum, float *sx) {
  __shared__ float sh[kThreads / 32];
  const int64_t nv = valid_cols(v, v0, v_valid);
  for (int64_t i = blockIdx.x; i < t; i += gridDim.x) {
    const float *row = z + i * ldz;
    float bm = -INFINITY, zs = 0.f;
    for (int64_t j = threadIdx.x; j < nv; j += kThreads) {
      const float x = cap(row[j], c);
      bm = fmaxf(bm, x);
      zs += x;
    }
    bm = block_reduce(bm, 0, sh);
    zs = block_reduce(zs, 1, sh);
    const float mo = m[i];
    const float mn = fmaxf(mo, bm);
    const int64_t y = labels[i];
    const int64_t jy = (y != ignore_index) ? y - v0 : -1;
    float se = 0.f, sy = 0.f;
    if (bm != -INFINITY)
      for (int64_t j = threadIdx.x; j < nv; j += kThreads) {
        const float e = expf(cap(row[j], c) - mn);
        if (j == jy) sy = e; else se += e;  // sum without the target kept apart (no cancellation)
      }
    se = block_reduce(se, 1, sh);
    sy = block_reduce(sy, 1, sh);  // only the thread that saw the target contributes
    if (threadIdx.x == 0) {
      if (y != ignore_index && y >= v0 && y < v0 + nv) zy[i] = cap(row[y - v0], c);
      zsum[i] += zs;
      if (nv > 0 && bm != -INFINITY) {
        const float scale = (mo == -INFINITY) ? 0.f : expf(mo - mn);
        m[i] = mn;
        s[i] = s[i] * scale + (se + sy);
        sx[i] = sx[i] * scale + se;
      }
    }
  }
}

template <typename Out>
__device__ __forceinline__ Out to_out(float x);
template <>
__device__ __forceinline__ float to_out<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half to_out<__half>(float x) { return __float2half_rn(x); }

// dZ = g * (softmax - target distribution) (+ z-loss term) * softcap', row by
// row, with 1 - p_y = q[i] (from the fold's sx / s, see csrc/ce.c); out may alias z when Out is float (each element is read before written
// by the same thread).
template <typename Out>
__global__ void ce_grad_kernel(const float *z, int64_t ldz, int64_t t, int64_t v, int64_t v0, int64_t v_valid,
                               const int64_t *__restrict__ labels, int64_t ignore_index, float c,
                               const float *__restrict__ mrow, const float *__restrict__ ls,
                               const float *__restrict__ q,
                               const float *__restrict__ g, int64_t g_stride,
                               float eps, float uni, float zloss, Out *out, int64_t ldo) {
  const int64_t nv = valid_cols(v, v0, v_valid);
  for (int64_t i = blockIdx.x; i < t; i += gridDim.x) {
    const float *row = z + i * ldz;
    Out *orow = out + i * ldo;
    const int64_t y = labels[i];
    const float gi = g[i * g_stride];
    if (y == ignore_index || gi == 0.f) {
      for (int64_t j = threadIdx.x; j < v; j += kThreads) orow[j] = to_out<Out>(0.f);
      continue;
    }
    const float mi = mrow[i], lsi = ls[i], L = mi + lsi;
    const float coef = 1.f + 2.f * zloss * L;
    const int64_t jy = y - v0;
    for (int64_t j = threadIdx.x; j < v; j += kThreads) {
      float r = 0.f;  // padding columns: -inf logit, zero gradient
      if (j < nv) {
        float x = row[j], dcap = 1.f;
        if (c > 0.f) {
          const float th = tanhf(x / c);
          x = c * th;
          dcap = 1.f - th * th;
        }
        const float p = expf((x - mi) - lsi);
        const float d = (j == jy) ? -(1.f - eps) * q[i] + (eps + 2.f * zloss * L) * p - uni
                                  : coef * p - uni;
        r = gi * d * dcap;
      }
      orow[j] = to_out<Out>(r);
    }
  }
}

inline unsigned grid_for(int64_t t) { return (unsigned)(t < kMaxGrid ? t : kMaxGrid); }

}  // namespace

extern "C" {

mp_status mp_ce_fold_cuda(float *z, int64_t ldz, int64_t t, int64_t v, int64_t v0, int64_t v_valid,
                          const int64_t *labels, int64_t ignore_index, float softcap, float *m, float *s,
                          float *zy, float *zsum, float *sx, uintptr_t stream) {
  mp_status st = MP_OK;
  if (t <= 0) return MP_OK;
  ce_fold_kernel<<<grid_for(t), kThreads, 0, MP_STREAM(stream)>>>(z, ldz, t, v, v0, v_valid, labels,
                                                                  ignore_index, softcap, m, s, zy, zsum, sx);
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

mp_status mp_ce_grad_cuda(float *z, int64_t ldz, int64_t t, int64_t v, int64_t v0, int64_t v_valid,
                          const int64_t *labels, int64_t ignore_index, float softcap, const float *mrow,
                          const float *ls,
                          const float *q, const float *g, int64_t g_stride, float eps, int64_t n_classes,
                          float zloss, void *out,
                          int64_t ldo, int out_dtype, uintptr_t stream) {
  mp_status st = MP_OK;
  const float uni = eps / (float)n_classes;
  if (t <= 0) return MP_OK;
  switch (out_dtype) {
    case 0:
      ce_grad_kernel<float><<<grid_for(t), kThreads, 0, MP_STREAM(stream)>>>(
          z, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, mrow, ls, q, g, g_stride, eps, uni, zloss,
          z, ldz);  // fp32 output is always in place
      break;
    case 1:
      ce_grad_kernel<__nv_bfloat16><<<grid_for(t), kThreads, 0, MP_STREAM(stream)>>>(
          z, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, mrow, ls, q, g, g_stride, eps, uni, zloss,
          (__nv_bfloat16 *)out, ldo);
      break;
    case 2:
      ce_grad_kernel<__half><<<grid_for(t), kThreads, 0, MP_STREAM(stream)>>>(
          z, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, mrow, ls, q, g, g_stride, eps, uni, zloss,
          (__half *)out, ldo);
      break;
    default:
      MP_FAIL(st, MP_ERR_INVALID, "ce_grad: out_dtype must be 0 (fp32), 1 (bf16) or 2 (fp16), got %d", out_dtype);
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

}  // extern "C"
