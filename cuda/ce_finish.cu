// ce_finish.cu: the kernels around the GEMMs of the fused and lowp schedules: the in-place
// scale of the fused modes' gradients (t *= g), the centering's X - mu, dW's finish (the
// label terms, and the rank-1 term, added once in fp32) and dX's finish. Launchers right
// under their kernels; arithmetic identical to csrc/ce.c.
#include "ce_common.cuh"

namespace {

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

template <typename T>
void launch_scale(void *p, int64_t n, const float *g, cudaStream_t stream) {
  const int64_t vecs = n / Vec<T>::n + 1;
  const int64_t blocks = (vecs + kScaleThreads - 1) / kScaleThreads;
  ce_scale_kernel<T><<<(unsigned)(blocks < kScaleGrid ? blocks : kScaleGrid), kScaleThreads, 0, stream>>>((T *)p, n, g);
}

}  // namespace

// p: [n] x dtype (0 fp32, 1 bf16, 2 fp16) on the device, p *= *g (g: one fp32 on the device).
extern "C" mp_status mp_ce_scale_cuda(void *p, int dtype, int64_t n, const float *g, uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t sm = MP_STREAM(stream);
  if (n <= 0) return MP_OK;
  switch (dtype) {
    case MP_DTYPE_F32: launch_scale<float>(p, n, g, sm); break;
    case MP_DTYPE_BF16: launch_scale<__nv_bfloat16>(p, n, g, sm); break;
    case MP_DTYPE_F16: launch_scale<__half>(p, n, g, sm); break;
    default: MP_FAIL(st, MP_ERR_INVALID, "ce_scale: dtype must be 0, 1 or 2, got %d", dtype);
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}

namespace {

// =============================================================================
// Centering: out[i, :h] = x[i, :h] - mu (ring_dtp/sched.py's fused: X - mu for its dW GEMMs)
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

}  // namespace

// out: [n, ldo], x: [n, ldx], mu: [h], all dtype (0 fp32, 1 bf16, 2 fp16), on the device; h, ldx and
// ldo multiples of the 16-byte vector's element count, the pointers 16-byte aligned.
extern "C" mp_status mp_ce_sub_row_cuda(void *out, int64_t ldo, const void *x, int64_t ldx, const void *mu, int64_t n, int64_t h,
                             int dtype, uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t sm = MP_STREAM(stream);
  const int64_t vec = dtype == MP_DTYPE_F32 ? 4 : 8;
  if (n <= 0 || h <= 0) return MP_OK;
  if (!mp_dtype_valid(dtype)) MP_FAIL(st, MP_ERR_INVALID, "ce_sub_row: dtype must be 0, 1 or 2, got %d", dtype);
  if (h % vec || ldx % vec || ldo % vec || (((uintptr_t)out | (uintptr_t)x | (uintptr_t)mu) & 15u))
    MP_FAIL(st, MP_ERR_INVALID, "ce_sub_row: h, ldx, ldo must be multiples of %lld and the pointers 16-byte aligned",
            (long long)vec);
  {
    const int64_t hv = h / vec, per_block = (int64_t)kSubThreads * kSubUnroll;
    const int64_t blocks = (n * hv + per_block - 1) / per_block;
    const unsigned grid = (unsigned)(blocks < kScaleGrid ? blocks : kScaleGrid);
    switch (dtype) {
      case MP_DTYPE_F32:
        ce_sub_row_kernel<float><<<grid, kSubThreads, 0, sm>>>((float *)out, ldo, (const float *)x, ldx,
                                                               (const float *)mu, n, hv);
        break;
      case MP_DTYPE_BF16:
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

namespace {

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
// rank-1 term cs[r] * mu first in the same sum (the centering of ring_dtp/sched.py's fused:
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
// A long run stays on one warp: splitting it over warps would change the sum's order (and
// so the CPU kernel's too). Column slabs go across grid.x, so all slabs of a run are
// dispatched together.
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

// 16-byte lanes of bf16/fp16 fit 96 registers: 5 CTAs per SM (unbounded, the two groups in
// flight take 106 registers: 4 CTAs).
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
// vectors, a scalar tail (one vector in flight per thread and a scalar load of mu per element:
// the slower path, taken only where the vector path cannot be).
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

// The finish's two kernels for one dtype (mp_ce_dw_finish_cuda checked the sizes).
template <typename T>
void launch_dw_finish(T *dw, int64_t ldw, int64_t v0, int64_t nv, const T *x, int64_t ldx, int64_t h,
                      const int64_t *sy, const int64_t *perm, const float *tcs, int64_t t, const float *cs,
                      const float *mu, unsigned char *flags, cudaStream_t sm) {
  constexpr int64_t N = Vec<T>::n;
  if (t > 0) {
    // Column slabs across grid.x, so a run's slabs are dispatched together.
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

}  // namespace

// dw: [nv, ldw] rows for labels v0 .. v0 + nv - 1, x: [t, ldx], both dtype (0 fp32, 1 bf16, 2 fp16);
// sy, perm: the labels sorted stably and their token indices; tcs: [t] x fp32, the label terms in sy's
// order (tc[perm[k]] at k); cs: [nv], mu: [h] x fp32
// (the rank-1 term cs[r] * mu, or both null) and then flags: [nv] bytes, zero (the rows the label
// runs wrote; set whenever cs is: py_ce_dw_finish checks). All on the device.
extern "C" mp_status mp_ce_dw_finish_cuda(void *dw, int dtype, int64_t ldw, int64_t v0, int64_t nv, const void *x,
                               int64_t ldx, int64_t h, const int64_t *sy, const int64_t *perm, const float *tcs,
                               int64_t t, const float *cs, const float *mu, unsigned char *flags, uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t sm = MP_STREAM(stream);
  if (nv <= 0 || h <= 0 || (t <= 0 && !cs)) return MP_OK;
  {
    if (t > INT_MAX) MP_FAIL(st, MP_ERR_INVALID, "ce_dw_finish: t = %lld tokens, at most %d", (long long)t, INT_MAX);
    switch (dtype) {
      case MP_DTYPE_F32:
        launch_dw_finish<float>((float *)dw, ldw, v0, nv, (const float *)x, ldx, h, sy, perm, tcs, t, cs, mu, flags, sm);
        break;
      case MP_DTYPE_BF16:
        launch_dw_finish<__nv_bfloat16>((__nv_bfloat16 *)dw, ldw, v0, nv, (const __nv_bfloat16 *)x, ldx, h, sy, perm,
                                        tcs, t, cs, mu, flags, sm);
        break;
      case MP_DTYPE_F16:
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

namespace {

// dX's finish (vocab_outer_lowp): dx[t] += tc[t] * w[labels[t] - v0], fmaf in fp32 then one
// rounding, for the tokens whose label is one of w's rows [v0, v0 + nv); other rows untouched.
// One CTA per token row (grid-stride); the condition is uniform over the CTA. The same
// arithmetic as csrc/ce.c mp_ce_dx_finish_range.
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

}  // namespace

// dx: [t, ldx], w: [nv, ldw] rows for labels v0 .. v0 + nv - 1, both dtype (0 fp32, 1 bf16, 2 fp16);
// labels: [t] int64; tc: [t] x fp32. All on the device.
extern "C" mp_status mp_ce_dx_finish_cuda(void *dx, int dtype, int64_t ldx, const void *w, int64_t ldw, int64_t v0,
                               int64_t nv, int64_t h, const int64_t *labels, const float *tc, int64_t t,
                               uintptr_t stream) {
  mp_status st = MP_OK;
  cudaStream_t sm = MP_STREAM(stream);
  if (nv <= 0 || h <= 0 || t <= 0) return MP_OK;
  {
    const unsigned grid = grid_for(t);
    switch (dtype) {
      case MP_DTYPE_F32:
        ce_dx_finish_kernel<float><<<grid, kFinishThreads, 0, sm>>>((float *)dx, ldx, (const float *)w, ldw, v0, nv,
                                                                   h, labels, tc, t);
        break;
      case MP_DTYPE_BF16:
        ce_dx_finish_kernel<__nv_bfloat16><<<grid, kFinishThreads, 0, sm>>>(
            (__nv_bfloat16 *)dx, ldx, (const __nv_bfloat16 *)w, ldw, v0, nv, h, labels, tc, t);
        break;
      case MP_DTYPE_F16:
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
