// ce_fold.cu: the online log-sum-exp fold of one logits block into the per-row state
// (m, s, zy, zsum, sx; moepeak/ring_dtp/blocks.py), one pass over the block, the target's term kept
// out of s. Layout of work and per-element cost: ce_common.cuh. Launcher under its kernel.
#include "ce_common.cuh"

namespace {

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

}  // namespace

// z_dtype / out_dtype: 0 fp32, 1 bf16, 2 fp16. Low-precision logits (z_dtype 1, 2)
// need out_dtype == z_dtype (dZ in place: out == z, ldo == ldz, checked by the binding).
extern "C" mp_status mp_ce_fold_cuda(const void *z, int z_dtype, int64_t ldz, int64_t t, int64_t v, int64_t v0,
                          int64_t v_valid, const int64_t *labels, int64_t ignore_index, float softcap, float *m,
                          float *s, float *zy, float *zsum, float *sx, uintptr_t stream) {
  mp_status st = MP_OK;
  if (t <= 0) return MP_OK;
  if (v < 0 || v > INT_MAX) MP_FAIL(st, MP_ERR_INVALID, "ce_fold: v must be in [0, 2^31), got %lld", (long long)v);
  {
    const int nv = valid_cols(v, v0, v_valid);
    cudaStream_t sm = MP_STREAM(stream);
    switch (z_dtype) {
      case MP_DTYPE_F32:
        launch_fold<float>(z, ldz, t, nv, v0, labels, ignore_index, softcap, m, s, zy, zsum, sx, sm);
        break;
      case MP_DTYPE_BF16:
        launch_fold<__nv_bfloat16>(z, ldz, t, nv, v0, labels, ignore_index, softcap, m, s, zy, zsum, sx, sm);
        break;
      case MP_DTYPE_F16:
        launch_fold<__half>(z, ldz, t, nv, v0, labels, ignore_index, softcap, m, s, zy, zsum, sx, sm);
        break;
      default: MP_FAIL(st, MP_ERR_INVALID, "ce_fold: z_dtype must be 0, 1 or 2, got %d", z_dtype);
    }
  }
  MP_CUDA_CHECK_LAUNCH(st);
fail:
  return st;
}
