// ce_grad.cu: the softmax-gradient epilogue dZ = g (softmax - onehot) (+ label smoothing,
// z-loss, softcap) over one logits block, written in place or to a dZ buffer; and the same
// kernel by column slabs that also sums dZ's columns and can take the label column out
// (the fused modes' centering and dW finish). Launchers right under their kernels.
#include "ce_common.cuh"

namespace {

// =============================================================================
// Gradient
// =============================================================================
// Per-row constants of dZ = g (softmax - onehot) with label smoothing eps, z-loss zl and softcap:
// with p = exp((x - m) - ls) = 2^(log2e (x - m) - log2(s)), lse = m + ls,
//   off target: d = g coef p - g uni,                   coef = 1 + 2 zl lse
//   at target:  d = g ((eps + 2 zl lse) p - (1-eps) q - uni).
struct GradRow {
  float row_max;       // m: the row's max logit
  float log2_sum;      // rn(ls * log2e): log2 of the row's sum of exp(x - m)
  float softcap;       // c of the softcap c tanh(x / c) (used only by the capped kernels)
  float off_scale;     // g * coef: off target, d = off_scale * p - off_shift
  float off_shift;     // g * uni
  float grad_out;      // g: the row's upstream gradient
  float target_shift;  // -(1-eps) q - uni: at the target, d = grad_out * (target_scale * p + target_shift)
  float target_scale;  // eps + 2 zl lse
  int target_col;      // the target's column in this block, -1 if none
  int live;            // 0: an ignored or zero-weight row (dZ = 0, nothing read); the fields above unset
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
  r.row_max = mrow[i];
  const float lsi = ls[i], lse = r.row_max + lsi;
  r.log2_sum = __fmul_rn(lsi, kLog2e);
  r.softcap = c;
  r.off_scale = gi * (1.f + 2.f * zloss * lse);
  r.off_shift = gi * uni;
  r.grad_out = gi;
  r.target_shift = -(1.f - eps) * q[i] - uni;
  r.target_scale = eps + 2.f * zloss * lse;
  r.target_col = (y >= v0 && y < v0 + nv) ? (int)(y - v0) : -1;
  return r;
}

template <bool kCap>
__device__ __forceinline__ float grad_one(float x, const GradRow &r, bool target) {
  float dcap = 1.f;
  if (kCap) {
    const float th = tanhf(x / r.softcap);
    x = r.softcap * th;
    dcap = 1.f - th * th;
  }
  const float p = ex2_ftz(fmaf(x - r.row_max, kLog2e, -r.log2_sum));  // x - m is exact-ish; x - lse would lose ulp(lse)
  const float d = target ? r.grad_out * fmaf(r.target_scale, p, r.target_shift) : fmaf(r.off_scale, p, -r.off_shift);
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
      for (int j = tid; j < h; j += kThreads) orow[j] = from_f32<Out>(grad_one<kCap>(ld(row, j), r, j == r.target_col));
      int vi = tid;
      for (; vi + (kUnroll - 1) * kThreads < nvec; vi += kUnroll * kThreads)
        grad_vectors<In, Out, kCap, kUnroll>(row + h, orow + h, vi, r.target_col - h, r);
      if (vi + kThreads < nvec) {  // the rest: at most 3 vectors per thread
        grad_vectors<In, Out, kCap, 2>(row + h, orow + h, vi, r.target_col - h, r);
        vi += 2 * kThreads;
      }
      if (vi < nvec) grad_vectors<In, Out, kCap, 1>(row + h, orow + h, vi, r.target_col - h, r);
      for (int j = h + nvec * N + tid; j < nc; j += kThreads)
        orow[j] = from_f32<Out>(grad_one<kCap>(ld(row, j), r, j == r.target_col));
    }
    zero_cols(orow, nc, v);
  }
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

constexpr int dtype_pair(int z_dtype, int out_dtype) { return z_dtype * MP_DTYPE_COUNT + out_dtype; }

template <typename F>
bool with_grad_dtypes(int z_dtype, int out_dtype, F &&f) {
  switch (dtype_pair(z_dtype, out_dtype)) {
    case dtype_pair(MP_DTYPE_F32, MP_DTYPE_F32): f(Tag<float>{}, Tag<float>{}); return true;
    case dtype_pair(MP_DTYPE_F32, MP_DTYPE_BF16): f(Tag<float>{}, Tag<__nv_bfloat16>{}); return true;
    case dtype_pair(MP_DTYPE_F32, MP_DTYPE_F16): f(Tag<float>{}, Tag<__half>{}); return true;
    case dtype_pair(MP_DTYPE_BF16, MP_DTYPE_BF16): f(Tag<__nv_bfloat16>{}, Tag<__nv_bfloat16>{}); return true;
    case dtype_pair(MP_DTYPE_F16, MP_DTYPE_F16): f(Tag<__half>{}, Tag<__half>{}); return true;
    default: return false;
  }
}

}  // namespace

extern "C" mp_status mp_ce_grad_cuda(const void *z, int z_dtype, int64_t ldz, int64_t t, int64_t v, int64_t v0,
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

namespace {

// =============================================================================
// Gradient + column sums (the centering of ring_dtp/sched.py's fused)
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
// ring_dtp/blocks.py's take_label_column would right after it: tc[i] = dZ[i, jy] as stored (rounded to
// Out) and 0 written there; tc[i] = 0 for a row with no target in the block (ignored, zero weight, or
// its label in another block). So the dZ written is the dW GEMM's operand, and the caller puts the
// column back for dX's GEMM (put_label_column): bitwise what the separate take gives.
constexpr int kSlabThreads = 256;
constexpr int kSlabMinBlocks = 4;  // <= 64 registers: 1024 threads and 64 KB of loads in flight per SM
constexpr int kSlabUnroll = 4;     // rows in flight per thread

template <typename Out>
__device__ __forceinline__ float stored(float d) { return to_f32(from_f32<Out>(d)); }

// Does the row have a target element in this block (then exactly one thread sees it)?
__device__ __forceinline__ bool has_target(const GradRow &r) { return r.live && r.target_col >= 0; }

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
      const int off = r.target_col - col;     // the target's place in this vector, if any
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
            d = stored<Out>(grad_one<kCap>(ld(row, j), r, j == r.target_col));
            acc[e] += (j == r.target_col) ? 0.f : d;
            if (tc && j == r.target_col) {
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

// SMs x resident CTAs per SM of the colsum kernel <In, Out, kCap> on the current device: queried
// once per device (not at every chunk's launch), 0 when a
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

}  // namespace

// ce_grad + the column sums of the dZ written, target elements excluded, into cs: [v] x fp32 (padding columns: 0)
// (first: cs = sums, else cs += sums), through part: [gmax, ldp] x fp32 scratch (ldp >= nv). tc: [t] x fp32 or
// null: also take the label column out of dZ into tc (ce_grad_colsum_kernel).
// Needs z 16-byte aligned rows (z and ldz * sizeof) and out aligned rows to its vector width.
extern "C" mp_status mp_ce_grad_colsum_cuda(const void *z, int z_dtype, int64_t ldz, int64_t t, int64_t v, int64_t v0,
                                 int64_t v_valid, const int64_t *labels, int64_t ignore_index, float softcap,
                                 const float *mrow, const float *ls, const float *q, const float *g,
                                 int64_t g_stride, float eps, int64_t n_classes, float zloss, void *out, int64_t ldo,
                                 int out_dtype, float *part, int64_t ldp, int64_t gmax, float *cs, int first,
                                 float *tc, uintptr_t stream) {
  mp_status st = MP_OK;
  const float uni = eps / (float)n_classes;
  cudaStream_t sm = MP_STREAM(stream);
  if (t <= 0) return MP_OK;
  if (v < 0 || v > INT_MAX) MP_FAIL(st, MP_ERR_INVALID, "ce_grad_colsum: v must be in [0, 2^31), got %lld", (long long)v);
  if (!mp_dtype_valid(z_dtype) || !mp_dtype_valid(out_dtype))
    MP_FAIL(st, MP_ERR_INVALID, "ce_grad_colsum: dtype codes must be 0..2, got (%d, %d)", z_dtype, out_dtype);
  {
    const int nv = valid_cols(v, v0, v_valid);
    const int64_t zb = (int64_t)mp_dtype_bytes(z_dtype), ob = (int64_t)mp_dtype_bytes(out_dtype);
    const int64_t ovec = 16 / zb * ob;  // out's vector bytes
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
