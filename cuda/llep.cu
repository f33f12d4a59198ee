// llep.cu: PipelinedLLEP's CUDA kernels: expert counting, the route that
// orders (t, k) picks into the dst-major send list, row gathers into chunk
// staging (plain, or scaled per row: backward's w*dy rows in one pass), and
// the weighted scatter-add combine with fp32 accumulation.
//
// What is never materialised: the T*K*H expanded token copy. A chunk's send
// rows are gathered straight from x [T, H] by flat (t, k) index (row t = idx/K),
// and expert outputs are folded into an fp32 [T, H] accumulator the same way.
// GEMMs are torch's (cuBLAS); nothing here multiplies matrices.
#include "common.cuh"
#include "llep.h"

namespace {

constexpr int kThreads = 256;        // one block size for every kernel: 8 warps
constexpr int64_t kMaxBlocks = 65535; // grid-stride beyond this (any row count works)

inline int blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  return (int)(b > kMaxBlocks ? kMaxBlocks : b);
}

// cnt [E + 1]: cnt[e] += 1 for each id e in [0, E); cnt[E] counts the others
// (the host reads it with the counts and reports bad ids without another sync).
__global__ void count_kernel(const int64_t *__restrict__ ids, int64_t n, int E,
                             unsigned long long *__restrict__ cnt) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t e = ids[i];
    atomicAdd(&cnt[(e >= 0 && e < E) ? e : E], 1ULL);
  }
}

// sorted_pos [n]: flat (t, k) indices stably sorted by expert; sorted_ids the
// experts in that order. tables [4, E*P] = Ar, cum, blk, estart (see llep.h).
// Position i is the p-th row of its expert; its dst segment d satisfies
// cum[e,d] <= p < cum[e,d] + Ar[e,d]; it lands at blk[e,d] + p - cum[e,d].
__global__ void route_kernel(const int64_t *__restrict__ sorted_pos, const int64_t *__restrict__ sorted_ids,
                             int64_t n, int E, int P, const int64_t *__restrict__ tables,
                             int64_t *__restrict__ out) {
  const int64_t EP = (int64_t)E * P;
  const int64_t *Ar = tables, *cum = tables + EP, *blk = tables + 2 * EP, *estart = tables + 3 * EP;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t e = sorted_ids[i];
    if (e < 0 || e >= E) continue;  // refused on the host before any launch
    const int64_t p = i - estart[e];
    int d = 0;
    while (d < P - 1 && p >= cum[e * P + d] + Ar[e * P + d]) d++;
    out[blk[e * P + d] + p - cum[e * P + d]] = sorted_pos[i];
  }
}

// out[i, :] = src[idx[i] / div, :], rows of row_bytes bytes. VecT is the widest
// type that divides the row and both base addresses (16, 8, 4, 2 or 1 bytes).
// One block per row (grid-stride over rows), threads over the row's vectors:
// one 64-bit division per row, none per element.
template <typename VecT>
__global__ void gather_kernel(const char *__restrict__ src, const int64_t *__restrict__ idx, int64_t rows,
                              int64_t div, int64_t row_bytes, char *__restrict__ out) {
  const int64_t vpr = row_bytes / (int64_t)sizeof(VecT);
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const VecT *s = reinterpret_cast<const VecT *>(src + (idx[i] / div) * row_bytes);
    VecT *o = reinterpret_cast<VecT *>(out + i * row_bytes);
    for (int64_t v = threadIdx.x; v < vpr; v += blockDim.x) o[v] = s[v];
  }
}

// VEC elements of T moved as one access (16 bytes when VEC = 16 / sizeof(T)).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// out[i, :] = T(float(src[idx[i] / div, :]) * scale[i]), rows of N elements:
// one fp32 product per element, rounded once (RNE), the value torch's bf16/fp16
// x fp32 broadcast multiply stores. VEC elements per access (16 bytes where the
// row and both base addresses allow it, else 1). One block per row
// (grid-stride over rows), threads over the row's packs.
template <typename T, int VEC>
__global__ void gather_scaled_kernel(const T *__restrict__ src, const int64_t *__restrict__ idx,
                                     const float *__restrict__ scale, int64_t rows, int64_t div, int64_t N,
                                     T *__restrict__ out) {
  using P = Pack<T, VEC>;
  const int64_t packs = N / VEC;
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const P *s = reinterpret_cast<const P *>(src + (idx[i] / div) * N);
    P *o = reinterpret_cast<P *>(out + i * N);
    const float w = scale[i];
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      P a = s[p];
#pragma unroll
      for (int k = 0; k < VEC; k++) a.v[k] = from_f32<T>(to_f32(a.v[k]) * w);
      o[p] = a;
    }
  }
}

inline int row_blocks(int64_t rows) { return (int)(rows < kMaxBlocks ? (rows < 1 ? 1 : rows) : kMaxBlocks); }

// gather_scaled_kernel with 16-byte packs where the row and both bases allow it.
template <typename T>
void launch_gather_scaled(const void *src, const int64_t *idx, const float *scale, int64_t rows, int64_t div,
                          int64_t N, void *out, cudaStream_t cs) {
  constexpr int kVec = 16 / sizeof(T);
  const uintptr_t a = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(out) |
                      (uintptr_t)(N * (int64_t)sizeof(T));
  const T *s = static_cast<const T *>(src);
  T *o = static_cast<T *>(out);
  if (a % 16 == 0)
    gather_scaled_kernel<T, kVec><<<row_blocks(rows), kThreads, 0, cs>>>(s, idx, scale, rows, div, N, o);
  else
    gather_scaled_kernel<T, 1><<<row_blocks(rows), kThreads, 0, cs>>>(s, idx, scale, rows, div, N, o);
}

// SwiGLU over rows of h = [gate | up] (csrc/llep.h; csrc/llep_swiglu.c has the
// arithmetic in words): aten silu's, mul's and silu_backward's expressions in fp32,
// each result rounded once to T, so the values are the unfused ops' (expf is the
// accurate libdevice exp, as torch's kernels use without fast math). VEC elements
// per access where I, the row strides and every base allow 16 bytes (else 1);
// one block per row (grid-stride over rows), threads over the row's packs. In
// backward dh may be h: each thread reads its elements before writing them.
template <typename T, int VEC>
__global__ void swiglu_fwd_kernel(const T *__restrict__ h, int64_t ldh, T *__restrict__ a, T *__restrict__ s,
                                  int64_t rows, int64_t I) {
  using P = Pack<T, VEC>;
  const int64_t packs = I / VEC;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const P *g = reinterpret_cast<const P *>(h + r * ldh);
    const P *u = reinterpret_cast<const P *>(h + r * ldh + I);
    P *ar = reinterpret_cast<P *>(a + r * I);
    P *sr = s ? reinterpret_cast<P *>(s + r * I) : nullptr;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const P gv = g[p], uv = u[p];
      P av, sv;
#pragma unroll
      for (int k = 0; k < VEC; k++) {
        const float x = to_f32(gv.v[k]);
        sv.v[k] = from_f32<T>(x / (1.0f + expf(-x)));
        av.v[k] = from_f32<T>(to_f32(sv.v[k]) * to_f32(uv.v[k]));
      }
      if (sr) sr[p] = sv;
      ar[p] = av;
    }
  }
}

template <typename T, int VEC>
__global__ void swiglu_bwd_kernel(const T *h, int64_t ldh, const T *__restrict__ da, const T *__restrict__ s,
                                  T *dh, int64_t ldd, int64_t rows, int64_t I) {
  using P = Pack<T, VEC>;
  const int64_t packs = I / VEC;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const P *g = reinterpret_cast<const P *>(h + r * ldh);
    const P *u = reinterpret_cast<const P *>(h + r * ldh + I);
    const P *dar = reinterpret_cast<const P *>(da + r * I);
    const P *sr = reinterpret_cast<const P *>(s + r * I);
    P *dg = reinterpret_cast<P *>(dh + r * ldd);
    P *du = reinterpret_cast<P *>(dh + r * ldd + I);
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const P gv = g[p], uv = u[p], dv = dar[p], sv = sr[p];
      P dgv, duv;
#pragma unroll
      for (int k = 0; k < VEC; k++) {
        const float x = to_f32(gv.v[k]), d = to_f32(dv.v[k]);
        duv.v[k] = from_f32<T>(d * to_f32(sv.v[k]));
        const float t = to_f32(from_f32<T>(d * to_f32(uv.v[k])));
        const float sg = 1.0f / (1.0f + expf(-x));
        dgv.v[k] = from_f32<T>(t * sg * (1.0f + x * (1.0f - sg)));
      }
      du[p] = duv;
      dg[p] = dgv;
    }
  }
}

// 16-byte packs where I, the row strides (elements) and the bases allow them.
template <typename T>
bool swiglu_vec_ok(const mp_llep_swiglu_args *k) {
  const uintptr_t b = sizeof(T);
  uintptr_t a = reinterpret_cast<uintptr_t>(k->h) | (uintptr_t)(k->I * b) | (uintptr_t)(k->ldh * b) |
                reinterpret_cast<uintptr_t>(k->s);
  a |= k->a ? reinterpret_cast<uintptr_t>(k->a) : 0;
  a |= k->da ? reinterpret_cast<uintptr_t>(k->da) | reinterpret_cast<uintptr_t>(k->dh) | (uintptr_t)(k->ldd * b) : 0;
  return a % 16 == 0;
}

template <typename T>
void launch_swiglu(const mp_llep_swiglu_args *k, bool bwd, cudaStream_t cs) {
  constexpr int kVec = 16 / sizeof(T);
  const T *h = static_cast<const T *>(k->h);
  T *s = static_cast<T *>(k->s);
  const int nb = row_blocks(k->rows);
  if (!bwd) {
    T *a = static_cast<T *>(k->a);
    if (swiglu_vec_ok<T>(k))
      swiglu_fwd_kernel<T, kVec><<<nb, kThreads, 0, cs>>>(h, k->ldh, a, s, k->rows, k->I);
    else
      swiglu_fwd_kernel<T, 1><<<nb, kThreads, 0, cs>>>(h, k->ldh, a, s, k->rows, k->I);
    return;
  }
  const T *da = static_cast<const T *>(k->da);
  T *dh = static_cast<T *>(k->dh);
  if (swiglu_vec_ok<T>(k))
    swiglu_bwd_kernel<T, kVec><<<nb, kThreads, 0, cs>>>(h, k->ldh, da, s, dh, k->ldd, k->rows, k->I);
  else
    swiglu_bwd_kernel<T, 1><<<nb, kThreads, 0, cs>>>(h, k->ldh, da, s, dh, k->ldd, k->rows, k->I);
}

mp_status swiglu_cuda(const mp_llep_swiglu_args *k, bool bwd, uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t cs = MP_STREAM(stream);
  if (k->rows <= 0 || k->I <= 0) return MP_OK;
  switch (k->dtype) {
    case MP_DTYPE_F32:
      launch_swiglu<float>(k, bwd, cs);
      break;
    case MP_DTYPE_BF16:
      launch_swiglu<__nv_bfloat16>(k, bwd, cs);
      break;
    case MP_DTYPE_F16:
      launch_swiglu<__half>(k, bwd, cs);
      break;
    default:
      MP_FAIL(st, MP_ERR_INVALID, "llep swiglu: unknown dtype code %d", k->dtype);
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

// acc[idx[i] / div, h] += w[idx[i]] * y[i, h] (w == nullptr: weight 1), fp32.
// Rows of one chunk may hit the same token (its K picks), hence atomicAdd;
// the add order of those <= K terms is not fixed (fp32 rounding level).
// One block per row (grid-stride over rows), threads over h: the row's index,
// weight and token offset are computed once per row, not per element.
template <typename T>
__global__ void combine_kernel(float *__restrict__ acc, const T *__restrict__ y, const int64_t *__restrict__ idx,
                               const float *__restrict__ w, int64_t rows, int64_t div, int64_t H) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const int64_t id = idx[i];
    const float wt = w ? w[id] : 1.0f;
    float *a = acc + (id / div) * H;
    const T *yr = y + i * H;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) atomicAdd(&a[h], wt * to_f32(yr[h]));
  }
}

// Down projection's backward epilogue (csrc/llep.h): one block per row
// (grid-stride), threads over the I columns; the dot product is summed in
// fp32 by each thread, then across the block. The row factor w/wp is 1 for
// all but rows with a tiny or zero weight, which alone are rewritten.
template <typename T>
__global__ void down_bwd_kernel(T *__restrict__ D, T *__restrict__ a, const float *__restrict__ w,
                                const float *__restrict__ wp, float *__restrict__ dwr, int64_t rows, int64_t I) {
  __shared__ float sh[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T *Dr = D + r * I;
    T *ar = a + r * I;
    float dot[1] = {0.f};
    for (int64_t i = threadIdx.x; i < I; i += kThreads) dot[0] += to_f32(Dr[i]) * to_f32(ar[i]);
    block_reduce<kThreads, 1, false>(dot, sh);  // its leading barrier also guards sh's reuse per row
    if (threadIdx.x == 0) dwr[r] = dot[0] / wp[r];
    const float sc = w[r] / wp[r];
    if (sc != 1.0f)
      for (int64_t i = threadIdx.x; i < I; i += kThreads) {
        Dr[i] = from_f32<T>(sc * to_f32(Dr[i]));
        ar[i] = from_f32<T>(sc * to_f32(ar[i]));
      }
  }
}

}  // namespace

extern "C" {

mp_status mp_llep_count_cuda(const int64_t *ids, int64_t n, int E, int64_t *cnt, uintptr_t stream) {
  mp_status st = MP_OK;
  MP_CUDA_CHECK(st, cudaMemsetAsync(cnt, 0, sizeof(int64_t) * ((size_t)E + 1), MP_STREAM(stream)));
  if (n > 0) {
    count_kernel<<<blocks_for(n), kThreads, 0, MP_STREAM(stream)>>>(ids, n, E,
                                                                   reinterpret_cast<unsigned long long *>(cnt));
    MP_CUDA_CHECK_LAUNCH(st);
  }
fail:
  return st;
}

mp_status mp_llep_route_cuda(const int64_t *sorted_pos, const int64_t *sorted_ids, int64_t n, int E, int P,
                             const int64_t *tables, int64_t *out, uintptr_t stream) {
  mp_status st = MP_OK;
  if (n > 0) {
    route_kernel<<<blocks_for(n), kThreads, 0, MP_STREAM(stream)>>>(sorted_pos, sorted_ids, n, E, P, tables, out);
    MP_CUDA_CHECK_LAUNCH(st);
  }
fail:
  return st;
}

mp_status mp_llep_gather_cuda(const void *src, const int64_t *idx, int64_t rows, int64_t div, int64_t row_bytes,
                              void *out, uintptr_t stream) {
  mp_status st = MP_OK;
  const uintptr_t a = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(out) | (uintptr_t)row_bytes;
  const char *s = static_cast<const char *>(src);
  char *o = static_cast<char *>(out);
  cudaStream_t cs = MP_STREAM(stream);
  if (rows <= 0 || row_bytes <= 0) return MP_OK;
  if (a % 16 == 0) gather_kernel<uint4><<<row_blocks(rows), kThreads, 0, cs>>>(s, idx, rows, div, row_bytes, o);
  else if (a % 8 == 0) gather_kernel<uint2><<<row_blocks(rows), kThreads, 0, cs>>>(s, idx, rows, div, row_bytes, o);
  else if (a % 4 == 0) gather_kernel<uint32_t><<<row_blocks(rows), kThreads, 0, cs>>>(s, idx, rows, div, row_bytes, o);
  else if (a % 2 == 0) gather_kernel<uint16_t><<<row_blocks(rows), kThreads, 0, cs>>>(s, idx, rows, div, row_bytes, o);
  else gather_kernel<uint8_t><<<row_blocks(rows), kThreads, 0, cs>>>(s, idx, rows, div, row_bytes, o);
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

mp_status mp_llep_gather_scaled_cuda(const void *src, const int64_t *idx, const float *scale, int64_t rows,
                                     int64_t div, int64_t N, int dtype, void *out, uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t cs = MP_STREAM(stream);
  if (rows <= 0 || N <= 0) return MP_OK;
  switch (dtype) {
    case MP_DTYPE_F32:
      launch_gather_scaled<float>(src, idx, scale, rows, div, N, out, cs);
      break;
    case MP_DTYPE_BF16:
      launch_gather_scaled<__nv_bfloat16>(src, idx, scale, rows, div, N, out, cs);
      break;
    case MP_DTYPE_F16:
      launch_gather_scaled<__half>(src, idx, scale, rows, div, N, out, cs);
      break;
    default:
      MP_FAIL(st, MP_ERR_INVALID, "llep gather_scaled: unknown dtype code %d", dtype);
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

mp_status mp_llep_swiglu_fwd_cuda(const mp_llep_swiglu_args *args, uintptr_t stream) {
  return swiglu_cuda(args, false, stream);
}

mp_status mp_llep_swiglu_bwd_cuda(const mp_llep_swiglu_args *args, uintptr_t stream) {
  return swiglu_cuda(args, true, stream);
}

mp_status mp_llep_combine_cuda(float *acc, const void *y, int dtype, const int64_t *idx, const float *w,
                               int64_t rows, int64_t div, int64_t H, uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t cs = MP_STREAM(stream);
  const int nb = row_blocks(rows);
  if (rows <= 0 || H <= 0) return MP_OK;
  switch (dtype) {
    case MP_DTYPE_F32:
      combine_kernel<float><<<nb, kThreads, 0, cs>>>(acc, static_cast<const float *>(y), idx, w, rows, div, H);
      break;
    case MP_DTYPE_BF16:
      combine_kernel<__nv_bfloat16><<<nb, kThreads, 0, cs>>>(acc, static_cast<const __nv_bfloat16 *>(y), idx, w,
                                                              rows, div, H);
      break;
    case MP_DTYPE_F16:
      combine_kernel<__half><<<nb, kThreads, 0, cs>>>(acc, static_cast<const __half *>(y), idx, w, rows, div, H);
      break;
    default:
      MP_FAIL(st, MP_ERR_INVALID, "llep combine: unknown dtype code %d", dtype);
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

mp_status mp_llep_down_bwd_cuda(void *D, void *a, int dtype, const float *w, const float *wp, float *dwr,
                                int64_t rows, int64_t I, uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t cs = MP_STREAM(stream);
  const int nb = row_blocks(rows);
  if (rows <= 0) return MP_OK;
  switch (dtype) {
    case MP_DTYPE_F32:
      down_bwd_kernel<float><<<nb, kThreads, 0, cs>>>(static_cast<float *>(D), static_cast<float *>(a), w, wp, dwr,
                                                       rows, I);
      break;
    case MP_DTYPE_BF16:
      down_bwd_kernel<__nv_bfloat16><<<nb, kThreads, 0, cs>>>(static_cast<__nv_bfloat16 *>(D),
                                                               static_cast<__nv_bfloat16 *>(a), w, wp, dwr, rows, I);
      break;
    case MP_DTYPE_F16:
      down_bwd_kernel<__half><<<nb, kThreads, 0, cs>>>(static_cast<__half *>(D), static_cast<__half *>(a), w, wp,
                                                        dwr, rows, I);
      break;
    default:
      MP_FAIL(st, MP_ERR_INVALID, "llep down_bwd: unknown dtype code %d", dtype);
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

}  // extern "C"
