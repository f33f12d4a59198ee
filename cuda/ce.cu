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

// Logits element -> fp32 (the block is fp32, or bf16/fp16 straight from a low-precision GEMM).
__device__ __forceinline__ float ld(const float *p, int64_t j) { return p[j]; }
__device__ __forceinline__ float ld(const __nv_bfloat16 *p, int64_t j) { return __bfloat162float(p[j]); }
__device__ __forceinline__ float ld(const __half *p, int64_t j) { return __half2float(p[j]); }

__device__ __forceinline__ int64_t valid_cols(int64_t v, int64_t v0, int64_t v_valid) {
  int64_t n = v_valid - v0;
  return n < 0 ? 0 : (n > v ? v : n);
}

// One column of the fold: running per-thread max tm, sum se of exp(x - tm) over
// the non-target columns (online: rescaled when the max grows), sum zs of x.
__device__ __forceinline__ void fold_col(float x, int64_t j, int64_t jy, float &tm, float &se, float &zs) {
  zs += x;
  if (x > tm) {
    se *= expf(tm - x);  // tm = -inf at first: se is 0 and stays 0
    tm = x;
  }
  if (j != jy && x > -INFINITY) se += expf(x - tm);
}

// 16-byte vectors: kVec<In> elements per load, used where the row is 16-byte aligned
// (rows of an fp32 block with V % 4 == 0, of a bf16/fp16 block with V % 8 == 0).
template <typename In>
struct kVec { static constexpr int n = 16 / (int)sizeof(In); };

// Fold one block into the per-row state in ONE pass over the logits: each thread
// keeps (tm, se, zs) online; the block then merges the threads' (tm, se) at the
// row max. The target's term is kept out of se (no cancellation in 1 - p_y = sx/s)
// and added by thread 0 from the target's own logit.
template <typename In>
__global__ void ce_fold_kernel(const In *__restrict__ z, int64_t ldz, int64_t t, int64_t v, int64_t v0,
                               int64_t v_valid, const int64_t *__restrict__ labels, int64_t ignore_index,
                               float c, float *m, float *s, float *zy, float *zsum, float *sx) {
  __shared__ float sh[kThreads / 32];
  constexpr int N = kVec<In>::n;
  const int64_t nv = valid_cols(v, v0, v_valid);
  for (int64_t i = blockIdx.x; i < t; i += gridDim.x) {
    const In *row = z + i * ldz;
    const int64_t y = labels[i];
    const int64_t jy = (y != ignore_index) ? y - v0 : -1;
    float tm = -INFINITY, se = 0.f, zs = 0.f;
    const bool vec = (reinterpret_cast<uintptr_t>(row) & 15) == 0;
    const int64_t nvec = vec ? (nv / N) * N : 0;
    for (int64_t j0 = (int64_t)threadIdx.x * N; j0 < nvec; j0 += (int64_t)kThreads * N) {
      const uint4 u = *reinterpret_cast<const uint4 *>(row + j0);
      const In *e = reinterpret_cast<const In *>(&u);
#pragma unroll
      for (int k = 0; k < N; ++k) fold_col(cap(ld(e, k), c), j0 + k, jy, tm, se, zs);
    }
    for (int64_t j = nvec + threadIdx.x; j < nv; j += kThreads) fold_col(cap(ld(row, j), c), j, jy, tm, se, zs);
    const float bm = block_reduce(tm, 0, sh);
    zs = block_reduce(zs, 1, sh);
    se = block_reduce(tm == -INFINITY ? 0.f : se * expf(tm - bm), 1, sh);  // all at the row max bm
    if (threadIdx.x == 0) {
      const bool has_y = y != ignore_index && y >= v0 && y < v0 + nv;
      const float xy = has_y ? cap(ld(row, y - v0), c) : 0.f;
      if (has_y) zy[i] = xy;
      zsum[i] += zs;
      if (nv > 0 && bm != -INFINITY) {
        const float mo = m[i];
        const float mn = fmaxf(mo, bm);
        const float scale = (mo == -INFINITY) ? 0.f : expf(mo - mn);
        const float seb = se * expf(bm - mn);
        const float sy = has_y ? expf(xy - mn) : 0.f;
        m[i] = mn;
        s[i] = s[i] * scale + (seb + sy);
        sx[i] = sx[i] * scale + seb;
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

// Per-row constants of the gradient epilogue.
struct GradRow {
  float mi, lsi, qi, gi, coef, zl2L, eps, uni, c;
  int64_t jy, nv;
  bool live;
};

// dZ of one column j with logit x (see csrc/ce.c for the formula).
__device__ __forceinline__ float grad_col(float x, int64_t j, const GradRow &r) {
  if (!r.live || j >= r.nv) return 0.f;  // ignored row, zero weight, or padding column (-inf logit)
  float dcap = 1.f;
  if (r.c > 0.f) {
    const float th = tanhf(x / r.c);
    x = r.c * th;
    dcap = 1.f - th * th;
  }
  const float p = expf((x - r.mi) - r.lsi);
  const float d = (j == r.jy) ? -(1.f - r.eps) * r.qi + (r.eps + r.zl2L) * p - r.uni : r.coef * p - r.uni;
  return r.gi * d * dcap;
}

// dZ = g * (softmax - target distribution) (+ z-loss term) * softcap', row by
// row, with 1 - p_y = q[i] (from the fold's sx / s, see csrc/ce.c). out may alias z
// when Out == In (same element size and ld): each element is read, then written, by
// the same thread, so dZ is made in place in the logits block. One pass: 16-byte
// loads (and stores when both rows are 16-byte aligned and Out is no wider than In).
template <typename In, typename Out>
__global__ void ce_grad_kernel(const In *z, int64_t ldz, int64_t t, int64_t v, int64_t v0, int64_t v_valid,
                               const int64_t *__restrict__ labels, int64_t ignore_index, float c,
                               const float *__restrict__ mrow, const float *__restrict__ ls,
                               const float *__restrict__ q,
                               const float *__restrict__ g, int64_t g_stride,
                               float eps, float uni, float zloss, Out *out, int64_t ldo) {
  constexpr int N = kVec<In>::n;
  constexpr int kOutBytes = N * (int)sizeof(Out);  // 16 (same width) or 8 (fp32 -> bf16/fp16)
  static_assert(kOutBytes == 16 || kOutBytes == 8, "output vector must be 8 or 16 bytes");
  for (int64_t i = blockIdx.x; i < t; i += gridDim.x) {
    const In *row = z + i * ldz;
    Out *orow = out + i * ldo;
    GradRow r;
    const int64_t y = labels[i];
    r.gi = g[i * g_stride];
    r.live = !(y == ignore_index || r.gi == 0.f);
    r.mi = mrow[i];
    r.lsi = ls[i];
    r.qi = q[i];
    const float L = r.mi + r.lsi;
    r.coef = 1.f + 2.f * zloss * L;
    r.zl2L = 2.f * zloss * L;
    r.eps = eps;
    r.uni = uni;
    r.c = c;
    r.jy = y - v0;
    r.nv = valid_cols(v, v0, v_valid);
    const bool vec = ((reinterpret_cast<uintptr_t>(row) & 15) == 0) &&
                     ((reinterpret_cast<uintptr_t>(orow) & (kOutBytes - 1)) == 0);
    const int64_t nvec = vec ? (v / N) * N : 0;
    for (int64_t j0 = (int64_t)threadIdx.x * N; j0 < nvec; j0 += (int64_t)kThreads * N) {
      const uint4 u = *reinterpret_cast<const uint4 *>(row + j0);
      const In *e = reinterpret_cast<const In *>(&u);
      if constexpr (kOutBytes == 16) {
        uint4 o;
        Out *ov = reinterpret_cast<Out *>(&o);
#pragma unroll
        for (int k = 0; k < N; ++k) ov[k] = to_out<Out>(grad_col(ld(e, k), j0 + k, r));
        *reinterpret_cast<uint4 *>(orow + j0) = o;
      } else {
        uint2 o;
        Out *ov = reinterpret_cast<Out *>(&o);
#pragma unroll
        for (int k = 0; k < N; ++k) ov[k] = to_out<Out>(grad_col(ld(e, k), j0 + k, r));
        *reinterpret_cast<uint2 *>(orow + j0) = o;
      }
    }
    for (int64_t j = nvec + threadIdx.x; j < v; j += kThreads) orow[j] = to_out<Out>(grad_col(ld(row, j), j, r));
  }
}

inline unsigned grid_for(int64_t t) { return (unsigned)(t < kMaxGrid ? t : kMaxGrid); }

template <typename In>
void launch_fold(const void *z, int64_t ldz, int64_t t, int64_t v, int64_t v0, int64_t v_valid, const int64_t *labels,
                 int64_t ignore_index, float softcap, float *m, float *s, float *zy, float *zsum, float *sx,
                 cudaStream_t stream) {
  ce_fold_kernel<In><<<grid_for(t), kThreads, 0, stream>>>((const In *)z, ldz, t, v, v0, v_valid, labels,
                                                           ignore_index, softcap, m, s, zy, zsum, sx);
}

template <typename In, typename Out>
void launch_grad(const void *z, int64_t ldz, int64_t t, int64_t v, int64_t v0, int64_t v_valid,
                 const int64_t *labels, int64_t ignore_index, float softcap, const float *mrow, const float *ls,
                 const float *q, const float *g, int64_t g_stride, float eps, float uni, float zloss, void *out,
                 int64_t ldo, cudaStream_t stream) {
  ce_grad_kernel<In, Out><<<grid_for(t), kThreads, 0, stream>>>((const In *)z, ldz, t, v, v0, v_valid, labels,
                                                                ignore_index, softcap, mrow, ls, q, g, g_stride,
                                                                eps, uni, zloss, (Out *)out, ldo);
}

}  // namespace

extern "C" {

// z_dtype / out_dtype: 0 fp32, 1 bf16, 2 fp16. Low-precision logits (z_dtype 1, 2)
// need out_dtype == z_dtype (dZ in place: out == z, ldo == ldz, checked by the binding).
mp_status mp_ce_fold_cuda(const void *z, int z_dtype, int64_t ldz, int64_t t, int64_t v, int64_t v0,
                          int64_t v_valid, const int64_t *labels, int64_t ignore_index, float softcap, float *m,
                          float *s, float *zy, float *zsum, float *sx, uintptr_t stream) {
  mp_status st = MP_OK;
  if (t <= 0) return MP_OK;
  switch (z_dtype) {
    case 0: launch_fold<float>(z, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, m, s, zy, zsum, sx,
                               MP_STREAM(stream)); break;
    case 1: launch_fold<__nv_bfloat16>(z, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, m, s, zy, zsum,
                                       sx, MP_STREAM(stream)); break;
    case 2: launch_fold<__half>(z, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, m, s, zy, zsum, sx,
                                MP_STREAM(stream)); break;
    default: MP_FAIL(st, MP_ERR_INVALID, "ce_fold: z_dtype must be 0, 1 or 2, got %d", z_dtype);
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
  switch (z_dtype * 3 + out_dtype) {
    case 0:  // fp32 logits, fp32 dZ in place
      launch_grad<float, float>(z, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, mrow, ls, q, g, g_stride,
                                eps, uni, zloss, (void *)z, ldz, sm);
      break;
    case 1:
      launch_grad<float, __nv_bfloat16>(z, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, mrow, ls, q, g,
                                        g_stride, eps, uni, zloss, out, ldo, sm);
      break;
    case 2:
      launch_grad<float, __half>(z, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, mrow, ls, q, g, g_stride,
                                 eps, uni, zloss, out, ldo, sm);
      break;
    case 4:  // bf16 logits, bf16 dZ in place
      launch_grad<__nv_bfloat16, __nv_bfloat16>(z, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, mrow, ls,
                                                q, g, g_stride, eps, uni, zloss, out, ldo, sm);
      break;
    case 8:  // fp16 logits, fp16 dZ in place
      launch_grad<__half, __half>(z, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, mrow, ls, q, g,
                                  g_stride, eps, uni, zloss, out, ldo, sm);
      break;
    default:
      MP_FAIL(st, MP_ERR_INVALID, "ce_grad: (z_dtype, out_dtype) must be (0, 0..2), (1, 1) or (2, 2), got (%d, %d)",
              z_dtype, out_dtype);
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

}  // extern "C"
