/* ce.c: Ring-DTP arithmetic on the CPU: the online log-sum-exp fold and the
 * softmax-gradient epilogue over one logits block, the scale, the centering and
 * the dW / dX finishes, as thread-pool range functions (csrc/ce_cpu.h). The
 * Python bindings that dispatch to them or to the CUDA launchers (cuda/ce_fold.cu,
 * ce_grad.cu, ce_finish.cu) are csrc/ce_bind.c.
 *
 * What a block is: Z: [t, ldz] x fp32, row i = token i of the chunk, columns
 * [0, v) = global vocab ids [v0, v0 + v). The GEMM that made Z comes from torch
 * (moepeak/ring_dtp/ops.py); these kernels never see the weight or the hidden.
 * Global columns >= v_valid are padding (vocab padded to a multiple, or the
 * zero rows of an uneven ring shard): they count as -inf logits (probability
 * 0, gradient 0), never as 0.
 *
 * Fold (forward), per row i, with c = softcap (c = 0: none), zc = c*tanh(z/c):
 *   bm = max_j zc_ij;  m' = max(m_i, bm);
 *   s_i = s_i * exp(m_i - m') + sum_j exp(zc_ij - m');  m_i = m'
 *   zsum_i += sum_j zc_ij          (label smoothing needs sum over classes)
 *   zy_i = zc_{i, y_i - v0}        (when the label falls in this block)
 *   sx_i: like s_i but without the target's term, so that 1 - p_y = sx/s
 *   keeps full relative precision when p_y -> 1 (1 - exp(zy - lse) would
 *   cancel: lse - zy is below fp32's resolution of lse there).
 * Partial (m, s, zy, zsum) of different blocks merge the same way, in any
 * order, on any rank. lse = m + log(s).
 *
 * Gradient (backward), in place (or into a low-precision copy on CUDA):
 *   p = exp((zc - m) - log s); coef = 1 + 2*zl*lse  (z-loss zl * lse^2)
 *   d_j = coef*p_j - (1-eps)*[j == y] - eps/n_classes
 *   at j == y: d = -(1-eps)*q + (eps + 2*zl*lse)*p_y - eps/n_classes, q = 1 - p_y = sx/s
 *     given per row (from the fold), never formed as p_y - 1
 *   dz_j = g_i * d_j * (1 - (zc_j/c)^2)   (softcap chain rule; 1 without softcap)
 * Rows whose label is ignore_index get dz = 0. The binding layer has already
 * replaced out-of-range labels by ignore_index (ring_dtp.py), and a label is
 * only ever compared with column ranges, never used as an address outside
 * the block, so no label value can make these kernels read out of bounds.
 *
 * Scale (backward of the fused modes): t *= g for the dX / dW made in forward,
 * in fp32 with one rounding to t's dtype; g is the upstream gradient, read where
 * t lives (on CUDA by the kernel: no host sync), and g == 1 costs nothing.
 */
#include <math.h>
#include <string.h>

#include "ce_cpu.h"
#include "mp_half.h"

static inline float ce_cap(float x, float c) { return c > 0.f ? c * tanhf(x / c) : x; }

/* Columns of this block that are real vocab (the rest are padding). */
static inline int64_t ce_valid_cols(const ce_args *a) {
  int64_t n = a->v_valid - a->v0;
  if (n < 0) n = 0;
  if (n > a->v) n = a->v;
  return n;
}

/* NaN-propagating max: once a NaN is seen the row's max stays NaN (torch's max and logsumexp
 * propagate NaN; a plain `x > bm ? x : bm` would skip it and hide a NaN row). */
static inline float ce_max_nan(float bm, float x) { return (x > bm || x != x) ? x : bm; }

/* Sums in double: the block's exponentials (up to ~2.5e5 terms, each <= 1) and logits summed
 * one after another in fp32 would carry an error of ~v * 2^-24 relative; in double the
 * block's sums round to fp32 once, so the fold stays within torch's own fp32 error. */
void mp_ce_fold_rows(void *ctx, int64_t begin, int64_t end, int worker) {
  (void)worker;
  const ce_args *a = (const ce_args *)ctx;
  const int64_t nv = ce_valid_cols(a);
  const float c = a->softcap;
  for (int64_t i = begin; i < end; ++i) {
    const float *row = a->z + i * a->ldz;
    float bm = -INFINITY;
    double zs = 0.0;
    for (int64_t j = 0; j < nv; ++j) {
      float x = ce_cap(row[j], c);
      bm = ce_max_nan(bm, x);
      zs += x;
    }
    const int64_t y = a->labels[i];
    if (y != a->ignore_index && y >= a->v0 && y < a->v0 + nv) a->zy[i] = ce_cap(row[y - a->v0], c);
    a->zsum[i] = (float)((double)a->zsum[i] + zs);
    if (nv == 0 || bm == -INFINITY) continue; /* nothing to fold (all padding / -inf) */
    const float mo = a->m[i];
    /* NaN in the block or in the state: m, s, sx become NaN (lse NaN, as torch's). A +inf logit:
     * m = +inf and exp(inf - inf) makes s NaN; ring_dtp/blocks.py's fin reads that as lse = +inf. */
    const float mn = (bm != bm || mo != mo) ? NAN : (mo > bm ? mo : bm);
    const int64_t jy = (y != a->ignore_index) ? y - a->v0 : -1;
    double se = 0.0, sy = 0.0; /* sum without the target, summed on its own: (se + e_y) - e_y would cancel */
    for (int64_t j = 0; j < nv; ++j) {
      const double e = exp((double)ce_cap(row[j], c) - (double)mn);
      if (j == jy) sy = e; else se += e;
    }
    const double scale = (mo == -INFINITY) ? 0.0 : exp((double)mo - (double)mn);
    a->m[i] = mn;
    a->s[i] = (float)((double)a->s[i] * scale + (se + sy));
    a->sx[i] = (float)((double)a->sx[i] * scale + se);
  }
}

void mp_ce_grad_rows(void *ctx, int64_t begin, int64_t end, int worker) {
  (void)worker;
  const ce_args *a = (const ce_args *)ctx;
  const int64_t nv = ce_valid_cols(a);
  const float c = a->softcap, eps = a->eps;
  const float uni = eps / (float)a->n_classes;
  for (int64_t i = begin; i < end; ++i) {
    float *row = a->z + i * a->ldz;
    const int64_t y = a->labels[i];
    const float gi = a->g[i * a->g_stride];
    if (y == a->ignore_index || gi == 0.f) {
      memset(row, 0, (size_t)a->v * sizeof(float));
      continue;
    }
    const float mi = a->mrow[i], lsi = a->ls[i], L = mi + lsi;
    const float coef = 1.f + 2.f * a->zloss * L;
    const int64_t jy = y - a->v0; /* outside [0, nv) when the target is elsewhere */
    for (int64_t j = 0; j < nv; ++j) {
      float x = row[j], dcap = 1.f;
      if (c > 0.f) {
        const float th = tanhf(x / c);
        x = c * th;
        dcap = 1.f - th * th;
      }
      const float p = expf((x - mi) - lsi); /* x - m is exact-ish; x - lse would lose ulp(lse) */
      float d;
      if (j == jy)
        d = -(1.f - eps) * a->q[i] + (eps + 2.f * a->zloss * L) * p - uni;
      else
        d = coef * p - uni;
      row[j] = gi * d * dcap;
    }
    for (int64_t j = nv; j < a->v; ++j) row[j] = 0.f; /* padding: -inf logit, zero gradient */
  }
}

/* ------------------------------------------------------------------------- */
/* Scale: t[0, n) *= g in fp32 with one rounding to t's dtype, i.e. exactly   */
/* (t.float() * g).to(t.dtype). The fused modes' dX and dW times the upstream */
/* gradient; g == 1 (loss.backward()) does nothing at all.                    */
/* ------------------------------------------------------------------------- */
/* conversions: csrc/mp_half.h (round to nearest even, like torch's casts) */


void mp_ce_scale_range(void *ctx, int64_t begin, int64_t end, int worker) {
  (void)worker;
  const ce_scale_args *a = (const ce_scale_args *)ctx;
  const float g = a->g;
  if (a->dtype == MP_DTYPE_F32) {
    float *p = (float *)a->t;
    for (int64_t i = begin; i < end; ++i) p[i] *= g;
  } else if (a->dtype == MP_DTYPE_BF16) {
    uint16_t *p = (uint16_t *)a->t;
    for (int64_t i = begin; i < end; ++i) p[i] = f32_to_bf16(bf16_to_f32(p[i]) * g);
  } else {
    uint16_t *p = (uint16_t *)a->t;
    for (int64_t i = begin; i < end; ++i) p[i] = f32_to_f16(f16_to_f32(p[i]) * g);
  }
}

/* ------------------------------------------------------------------------- */
/* Centering: out[i, :h] = x[i, :h] - mu, in fp32 with one rounding per     */
/* element (the arithmetic of torch.sub on two tensors of the dtype).         */
/* ------------------------------------------------------------------------- */
void mp_ce_sub_row_range(void *ctx, int64_t begin, int64_t end, int worker) {
  (void)worker;
  const ce_sub_row_args *a = (const ce_sub_row_args *)ctx;
  for (int64_t i = begin; i < end; ++i)
    for (int64_t j = 0; j < a->h; ++j)
      mp_st_el(a->out, a->dtype, i * a->ldo + j,
               mp_ld_el(a->x, a->dtype, i * a->ldx + j) - mp_ld_el(a->mu, a->dtype, j));
}

/* ------------------------------------------------------------------------- */
/* dW's finish: dw[v - v0] += [cs[v - v0] * mu +] sum over tokens t labelled  */
/* v of tc[t] * x[t], given as tcs[k] = tc[perm[k]] (the terms in sy's order: */
/* the CUDA kernel loads them beside sy and perm, no load waiting on another) */
/* per element the optional rank-1 term, then the label terms by fmaf in the  */
/* order of sy (labels sorted stably), then one rounding of dw + sum. The     */
/* label terms are the column the fused modes took out of their per-chunk dW  */
/* GEMMs, the rank-1 term their centering's colsum(dZ) mu^T (ring_dtp/sched.py's fused; */
/* why: cuda/ce_finish.cu ce_dw_finish_runs_kernel, the same order and arithmetic).  */
/* ------------------------------------------------------------------------- */
static int64_t ce_lower_bound(const int64_t *a, int64_t n, int64_t key) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (a[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

/* Columns summed per pass over a row's label run: the fp32 accumulators live on the stack. */
#define CE_FINISH_TILE 256

/* [begin, end): rows r of dw (label v0 + r). */
void mp_ce_dw_finish_range(void *ctx, int64_t begin, int64_t end, int worker) {
  (void)worker;
  const ce_dw_finish_args *a = (const ce_dw_finish_args *)ctx;
  const size_t esz = a->dtype == MP_DTYPE_F32 ? 4 : 2;
  float acc[CE_FINISH_TILE];
  for (int64_t r = begin; r < end; ++r) {
    const int64_t v = a->v0 + r;
    const int64_t lo = ce_lower_bound(a->sy, a->t, v), hi = ce_lower_bound(a->sy, a->t, v + 1);
    if (lo == hi && !a->cs) continue; /* no token labelled v, no rank-1 term: the row is untouched */
    void *row = (char *)a->dw + (size_t)(r * a->ldw) * esz;
    for (int64_t c0 = 0; c0 < a->h; c0 += CE_FINISH_TILE) {
      const int64_t nc = a->h - c0 < CE_FINISH_TILE ? a->h - c0 : CE_FINISH_TILE;
      for (int64_t c = 0; c < nc; ++c) acc[c] = a->cs ? a->cs[r] * a->mu[c0 + c] : 0.f;
      for (int64_t k = lo; k < hi; ++k) {
        const int64_t p = a->perm[k];
        const float w = a->tcs[k];
        const void *xr = (const char *)a->x + (size_t)(p * a->ldx + c0) * esz;
        for (int64_t c = 0; c < nc; ++c) acc[c] = fmaf(w, mp_ld_el(xr, a->dtype, c), acc[c]);
      }
      void *seg = (char *)row + (size_t)c0 * esz;
      for (int64_t c = 0; c < nc; ++c) mp_st_el(seg, a->dtype, c, mp_ld_el(seg, a->dtype, c) + acc[c]);
    }
  }
}

/* ------------------------------------------------------------------------- */
/* dX's finish: dx[t] += tc[t] * w[labels[t] - v0] for the tokens whose label  */
/* is one of w's rows [v0, v0 + nv), per element one fmaf in fp32 and one     */
/* rounding; other rows (ignore_index, labels of other shards) untouched. The */
/* label column vocab_outer_lowp took out of its per-vocab-block dX GEMMs     */
/* (ring_dtp/sched.py's backward_blocked; cuda/ce_finish.cu ce_dx_finish_kernel, the same  */
/* arithmetic). A token has one label, so no sum and no order to fix.         */
/* ------------------------------------------------------------------------- */
/* [begin, end): token rows t of dx. */
void mp_ce_dx_finish_range(void *ctx, int64_t begin, int64_t end, int worker) {
  (void)worker;
  const ce_dx_finish_args *a = (const ce_dx_finish_args *)ctx;
  const size_t esz = a->dtype == MP_DTYPE_F32 ? 4 : 2;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t r = a->labels[t] - a->v0;
    if (r < 0 || r >= a->nv) continue;
    const float c = a->tc[t];
    void *row = (char *)a->dx + (size_t)(t * a->ldx) * esz;
    const void *wr = (const char *)a->w + (size_t)(r * a->ldw) * esz;
    for (int64_t j = 0; j < a->h; ++j)
      mp_st_el(row, a->dtype, j, fmaf(c, mp_ld_el(wr, a->dtype, j), mp_ld_el(row, a->dtype, j)));
  }
}

