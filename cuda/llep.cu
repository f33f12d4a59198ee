// llep.cu: PipelinedLLEP's CUDA kernels: expert counting, the route that
// orders (t, k) picks into the dst-major send list, row gathers into chunk
// staging, and the weighted scatter-add combine with fp32 accumulation.
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

inline int row_blocks(int64_t rows) { return (int)(rows < kMaxBlocks ? (rows < 1 ? 1 : rows) : kMaxBlocks); }

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

mp_status mp_llep_combine_cuda(float *acc, const void *y, int dtype, const int64_t *idx, const float *w,
                               int64_t rows, int64_t div, int64_t H, uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t cs = MP_STREAM(stream);
  const int nb = row_blocks(rows);
  if (rows <= 0 || H <= 0) return MP_OK;
  switch (dtype) {
    case MP_LLEP_F32:
      combine_kernel<float><<<nb, kThreads, 0, cs>>>(acc, static_cast<const float *>(y), idx, w, rows, div, H);
      break;
    case MP_LLEP_BF16:
      combine_kernel<__nv_bfloat16><<<nb, kThreads, 0, cs>>>(acc, static_cast<const __nv_bfloat16 *>(y), idx, w,
                                                              rows, div, H);
      break;
    case MP_LLEP_F16:
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
    case MP_LLEP_F32:
      down_bwd_kernel<float><<<nb, kThreads, 0, cs>>>(static_cast<float *>(D), static_cast<float *>(a), w, wp, dwr,
                                                       rows, I);
      break;
    case MP_LLEP_BF16:
      down_bwd_kernel<__nv_bfloat16><<<nb, kThreads, 0, cs>>>(static_cast<__nv_bfloat16 *>(D),
                                                               static_cast<__nv_bfloat16 *>(a), w, wp, dwr, rows, I);
      break;
    case MP_LLEP_F16:
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
