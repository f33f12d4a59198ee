/* adamw_kernels.c: the CPU AdamW update of StreamAdamW.
 *
 * What it computes, per element i of a segment (fp32 master p, fp32 m, v; the
 * gradient g read as fp32/bf16/fp16 and widened to fp32):
 *
 *   g  = -g                                     (only when maximize)
 *   p  = p * f(1 - lr*wd)                       (only when wd != 0)
 *   m  = fma(c1, g - m, small ? m : g)          (= m.lerp_(g, 1 - beta1))
 *   v  = fma(f(1 - beta2) * g, g, v * f(beta2))
 *   vm = max(vm, v); d = sqrt(vm) / ...          (only with amsgrad: vm = max_exp_avg_sq)
 *   d  = sqrt(v) / f(sqrt(1 - beta2^t)) + f(eps)
 *   p  = p + (f(-lr / (1 - beta1^t)) * m) / d
 *   lp = round_to_nearest_even(p)               (optional bf16/fp16 copy)
 *
 * f(x) is the double -> float cast of a scalar computed in double, and
 * c1 = f(1-beta1) when |f(1-beta1)| < 0.5 else f(1-beta1) - 1 (then the base
 * is g). This is, operation by operation, the vector body of torch's CPU
 * fused AdamW (ATen/native/cpu/FusedAdamKernel.cpp, ADAM_MODE::ADAMW, fp32),
 * as torch's release builds compile it, so the fp32 results are bitwise equal
 * to torch.optim.AdamW(fused=True). Note the second fma: torch's source
 * writes v*b2 + c2*g*g, but GCC (-ffp-contract=fast, C++) contracts it into
 * fma(c2*g, g, v*b2) (torch 2.13 release builds; the bitwise tests check it). This file is
 * compiled with -std=c11, where GCC never contracts, so both fused
 * multiply-adds are explicit (fmaf / _mm*_fmadd_ps) and nothing else is.
 *
 * amsgrad's max follows torch's two code paths: its vector body uses
 * at::vec::maximum (x86 max, and an all-ones NaN when either input is NaN),
 * its scalar tail std::max(vm, v) = (vm < v ? v : vm). maximize negates the
 * gradient (a sign flip) for m; for v, g*g is the same number either way, and
 * only a NaN's sign tells which one torch's build uses: its vector body
 * squares g itself (the compiler folds (-g)*(-g)), its scalar tail -g.
 *
 * It never materialises an fp32 copy of the gradient or of the parameter:
 * each element is loaded, widened, updated and stored once (28 bytes of DRAM
 * traffic per element for fp32 state + bf16 grad + bf16 param copy... plus 4
 * when the fp32 copy is written for an fp32 GPU parameter).
 *
 * Three paths with identical arithmetic: AVX-512F (16 lanes),
 * AVX2+FMA+F16C (8 lanes), each
 * with the scalar code for its last < 16 (< 8) elements, scalar. Chosen at run time.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MP_X86 1
#else
#define MP_X86 0
#endif

#include "adamw_kernels.h"
#include "mp_half.h"

/* Elements per pool task: a multiple of 16 (one 64-byte line of fp32) and
 * large enough (64 KiB of fp32 per stream) that the dispatch cost (~5 us)
 * is small against the work (~2 us per 2^14 elements per thread... so one
 * task per thread per bucket is the common case; this grain only matters for
 * tiny buckets, which then run on fewer threads). */
#define MP_ADAMW_GRAIN 16384

void mp_adamw_coef_init(mp_adamw_coef *c, double lr, double beta1, double beta2, double eps, double wd,
                        double step, int maximize) {
  /* Scalars in double, then cast, exactly as torch's fused CPU kernel. */
  double bias_correction1 = 1.0 - pow(beta1, step);
  double bias_correction2 = 1.0 - pow(beta2, step);
  double step_size = lr / bias_correction1;
  float w1 = (float)(1.0 - beta1);
  c->do_wd = wd != 0.0;
  c->maximize = maximize != 0;
  c->wd_scale = (float)(1.0 - lr * wd);
  c->w1_small = fabsf(w1) < 0.5f;
  c->c1 = c->w1_small ? w1 : w1 - 1.0f;
  c->b2 = (float)beta2;
  c->c2 = (float)(1.0 - beta2);
  c->bc2_sqrt = (float)sqrt(bias_correction2);
  c->eps = (float)eps;
  c->neg_step_size = (float)(-step_size);
}

/* torch's fused CPU AdamW splits a tensor of n floats for T OpenMP threads
 * as: chunk = ceil(n / T) rounded down to a multiple of 16 (one cache line);
 * [0, A = chunk * T) in ranges of `chunk`; then [A, n) (r = n - A elements)
 * split again into T ranges of ceil(r / T) (one range if T == 1 or r <= 1).
 * Each range runs the vector body on its first floor(len / V) * V elements
 * and a scalar loop on the rest, and that scalar loop (as compiled) differs
 * in one rounding: v = fma(v, b2, (c2*g)*g) instead of fma(c2*g, g, v*b2).
 * Worked example: n = 1000, T = 16, V = 8: chunk = 63 -> 48, A = 768,
 * r = 232 -> 16 ranges of 15 (the last 7): the last 7 of each of the first 15
 * ranges and all 7 of the last are "tail" elements, 112 in all. */
void mp_adamw_coef_set_tails(mp_adamw_coef *c, int64_t numel, int torch_threads, int vlen) {
  c->numel = numel;
  c->tail_vlen = vlen;
  if (vlen <= 0 || numel <= 0) {
    c->tail_from = numel;
    c->tail_chunk = 1;
    return;
  }
  int64_t T = torch_threads > 0 ? torch_threads : 1;
  int64_t chunk = ((numel + T - 1) / T) / 16 * 16;
  int64_t A = chunk * T;
  int64_t r = numel - A;
  c->tail_from = A;
  c->tail_chunk = (T == 1 || r <= 1) ? (r > 0 ? r : 1) : (r + T - 1) / T;
}

static inline int is_torch_tail(const mp_adamw_coef *c, int64_t i) {
  if (i < c->tail_from) return 0;
  int64_t k = (i - c->tail_from) / c->tail_chunk;
  int64_t s = c->tail_from + k * c->tail_chunk;
  int64_t len = c->numel - s < c->tail_chunk ? c->numel - s : c->tail_chunk;
  return i - s >= len / c->tail_vlen * c->tail_vlen;
}

static inline float load_grad(const void *g, int dt, int64_t i) {
  switch (dt) {
    case MP_DT_BF16: return bf16_to_f32(((const uint16_t *)g)[i]);
    case MP_DT_F16: return f16_to_f32(((const uint16_t *)g)[i]);
    default: return ((const float *)g)[i];
  }
}

static inline void store_lp(void *lp, int dt, int64_t i, float x) {
  switch (dt) {
    case MP_DT_BF16: ((uint16_t *)lp)[i] = f32_to_bf16(x); break;
    case MP_DT_F16: ((uint16_t *)lp)[i] = f32_to_f16(x); break;
    default: ((float *)lp)[i] = x; break;
  }
}

/* amsgrad's max(vm, v) as torch's vector body computes it (at::vec::maximum):
 * x86 max (vm > v ? vm : v), or the all-ones NaN when either is NaN. */
static inline float amsgrad_max_vec(float vm, float v) {
  if (vm != vm || v != v) {
    union { uint32_t u; float f; } nan = {0xFFFFFFFFu};
    return nan.f;
  }
  return vm > v ? vm : v;
}

/* Scalar path over [b, e) of one segment; also the SIMD paths' tails and
 * every element past coef->tail_from. `emulate`: use torch's scalar-tail
 * rounding on the elements is_torch_tail() names. */
static void adamw_scalar(const mp_adamw_seg *s, int64_t b, int64_t e, int emulate) {
  const mp_adamw_coef *c = s->coef;
  for (int64_t i = b; i < e; i++) {
    float g = load_grad(s->g, s->gdt, i);
    float p = s->p[i], m = s->m[i], v = s->v[i];
    const int torch_tail = emulate && is_torch_tail(c, s->base + i);
    /* maximize: m reads -g; v reads -g in torch's scalar tail, g in its vector body */
    const float gm = c->maximize ? -g : g;
    if (c->do_wd) p = p * c->wd_scale;
    m = fmaf(c->c1, gm - m, c->w1_small ? m : gm);
    if (torch_tail)
      v = fmaf(v, c->b2, (c->c2 * gm) * gm);
    else
      v = fmaf(c->c2 * g, g, v * c->b2);
    float vd = v; /* the second moment the denominator uses */
    if (s->vmax) {
      float vm = s->vmax[i];
      vd = torch_tail ? (vm < v ? v : vm) : amsgrad_max_vec(vm, v);
      s->vmax[i] = vd;
    }
    float d = sqrtf(vd) / c->bc2_sqrt;
    d = d + c->eps;
    float q = c->neg_step_size * m;
    q = q / d;
    p = p + q;
    s->p[i] = p;
    s->m[i] = m;
    s->v[i] = v;
    if (s->lp) store_lp(s->lp, s->ldt, i, p);
  }
}

#if MP_X86
/* ---- AVX2 + FMA + F16C: 8 lanes ---- */
#define MP_T_AVX2 __attribute__((target("avx2,fma,f16c")))

MP_T_AVX2 static inline __m256 avx2_load_grad(const void *g, int dt, int64_t i) {
  if (dt == MP_DT_BF16) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)g + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  if (dt == MP_DT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)g + i)));
  return _mm256_loadu_ps((const float *)g + i);
}

MP_T_AVX2 static inline void avx2_store_lp(void *lp, int dt, int64_t i, __m256 x, int nt) {
  if (dt == MP_DT_BF16) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    if (nt)
      _mm_stream_si128((__m128i *)((uint16_t *)lp + i), packed);
    else
      _mm_storeu_si128((__m128i *)((uint16_t *)lp + i), packed);
  } else if (dt == MP_DT_F16) {
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    if (nt)
      _mm_stream_si128((__m128i *)((uint16_t *)lp + i), h);
    else
      _mm_storeu_si128((__m128i *)((uint16_t *)lp + i), h);
  } else if (nt) {
    _mm256_stream_ps((float *)lp + i, x);
  } else {
    _mm256_storeu_ps((float *)lp + i, x);
  }
}

/* Streaming stores need the store address aligned to the vector's bytes
 * (16 for 8 x 16-bit, 32 for 8 x fp32 with AVX2; twice that with AVX-512).
 * The loop steps by whole vectors, so alignment at b holds at every i. */
static inline int lp_stream_ok(const mp_adamw_seg *s, int64_t b, int lanes) {
  if (!s->lp || !s->lp_stream) return 0;
  size_t es = s->ldt == MP_DT_F32 ? 4 : 2;
  return ((uintptr_t)((const char *)s->lp + (size_t)b * es) % (es * (size_t)lanes)) == 0;
}

MP_T_AVX2 static void adamw_avx2(const mp_adamw_seg *s, int64_t b, int64_t e) {
  const mp_adamw_coef *c = s->coef;
  const __m256 wd = _mm256_set1_ps(c->wd_scale), c1 = _mm256_set1_ps(c->c1), b2 = _mm256_set1_ps(c->b2);
  const __m256 c2 = _mm256_set1_ps(c->c2), bc2 = _mm256_set1_ps(c->bc2_sqrt), eps = _mm256_set1_ps(c->eps);
  const __m256 nss = _mm256_set1_ps(c->neg_step_size);
  const __m256 gsign = _mm256_set1_ps(c->maximize ? -0.0f : 0.0f); /* xor: maximize's negation */
  const int nt = lp_stream_ok(s, b, 8);
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    __m256 g = avx2_load_grad(s->g, s->gdt, i);
    __m256 p = _mm256_loadu_ps(s->p + i), m = _mm256_loadu_ps(s->m + i), v = _mm256_loadu_ps(s->v + i);
    const __m256 gm = _mm256_xor_ps(g, gsign);
    if (c->do_wd) p = _mm256_mul_ps(p, wd);
    m = _mm256_fmadd_ps(c1, _mm256_sub_ps(gm, m), c->w1_small ? m : gm);
    v = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(v, b2));
    __m256 vd = v;
    if (s->vmax) { /* at::vec::maximum: max, or all-ones NaN where either is NaN */
      __m256 vm = _mm256_loadu_ps(s->vmax + i);
      vd = _mm256_or_ps(_mm256_max_ps(vm, v), _mm256_cmp_ps(vm, v, _CMP_UNORD_Q));
      _mm256_storeu_ps(s->vmax + i, vd);
    }
    __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vd), bc2), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(nss, m), d));
    _mm256_storeu_ps(s->p + i, p);
    _mm256_storeu_ps(s->m + i, m);
    _mm256_storeu_ps(s->v + i, v);
    if (s->lp) avx2_store_lp(s->lp, s->ldt, i, p, nt);
  }
  if (nt) _mm_sfence(); /* streaming stores visible before the copy engine reads the slot */
  if (i < e) adamw_scalar(s, i, e, 0);
}

/* ---- AVX-512F: 16 lanes (F-level only: no BW/VL instructions) ---- */
#define MP_T_AVX512 __attribute__((target("avx512f")))

MP_T_AVX512 static inline __m512 avx512_load_grad(const void *g, int dt, int64_t i) {
  if (dt == MP_DT_BF16) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  if (dt == MP_DT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i)));
  return _mm512_loadu_ps((const float *)g + i);
}

MP_T_AVX512 static inline void avx512_store_lp(void *lp, int dt, int64_t i, __m512 x, int nt) {
  if (dt == MP_DT_BF16) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    __m256i h = _mm512_cvtepi32_epi16(r);
    if (nt)
      _mm256_stream_si256((__m256i *)((uint16_t *)lp + i), h);
    else
      _mm256_storeu_si256((__m256i *)((uint16_t *)lp + i), h);
  } else if (dt == MP_DT_F16) {
    __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    if (nt)
      _mm256_stream_si256((__m256i *)((uint16_t *)lp + i), h);
    else
      _mm256_storeu_si256((__m256i *)((uint16_t *)lp + i), h);
  } else if (nt) {
    _mm512_stream_ps((float *)lp + i, x);
  } else {
    _mm512_storeu_ps((float *)lp + i, x);
  }
}

MP_T_AVX512 static void adamw_avx512(const mp_adamw_seg *s, int64_t b, int64_t e) {
  const mp_adamw_coef *c = s->coef;
  const __m512 wd = _mm512_set1_ps(c->wd_scale), c1 = _mm512_set1_ps(c->c1), b2 = _mm512_set1_ps(c->b2);
  const __m512 c2 = _mm512_set1_ps(c->c2), bc2 = _mm512_set1_ps(c->bc2_sqrt), eps = _mm512_set1_ps(c->eps);
  const __m512 nss = _mm512_set1_ps(c->neg_step_size);
  const __m512i gsign = _mm512_set1_epi32(c->maximize ? (int)0x80000000u : 0); /* xor: maximize's negation */
  const int nt = lp_stream_ok(s, b, 16);
  int64_t i = b;
  for (; i + 16 <= e; i += 16) {
    __m512 g = avx512_load_grad(s->g, s->gdt, i);
    __m512 p = _mm512_loadu_ps(s->p + i), m = _mm512_loadu_ps(s->m + i), v = _mm512_loadu_ps(s->v + i);
    const __m512 gm = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), gsign)); /* F-level xor */
    if (c->do_wd) p = _mm512_mul_ps(p, wd);
    m = _mm512_fmadd_ps(c1, _mm512_sub_ps(gm, m), c->w1_small ? m : gm);
    v = _mm512_fmadd_ps(_mm512_mul_ps(c2, g), g, _mm512_mul_ps(v, b2));
    __m512 vd = v;
    if (s->vmax) { /* at::vec::maximum: max, or all-ones NaN where either is NaN */
      __m512 vm = _mm512_loadu_ps(s->vmax + i);
      __mmask16 unord = _mm512_cmp_ps_mask(vm, v, _CMP_UNORD_Q);
      vd = _mm512_mask_mov_ps(_mm512_max_ps(vm, v), unord, _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
      _mm512_storeu_ps(s->vmax + i, vd);
    }
    __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vd), bc2), eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(nss, m), d));
    _mm512_storeu_ps(s->p + i, p);
    _mm512_storeu_ps(s->m + i, m);
    _mm512_storeu_ps(s->v + i, v);
    if (s->lp) avx512_store_lp(s->lp, s->ldt, i, p, nt);
  }
  if (nt) _mm_sfence(); /* streaming stores visible before the copy engine reads the slot */
  if (i < e) adamw_scalar(s, i, e, 0);
}
#endif /* MP_X86 */

/* ---- the parallel runner over a list of segments ---- */
typedef struct {
  const mp_adamw_seg *segs;
  const int64_t *start; /* start[k]: first flat element of segment k; start[nseg] = total */
  int nseg;
  int isa;
} run_ctx;

static void run_range(void *vctx, int64_t b, int64_t e, int worker) {
  (void)worker;
  const run_ctx *r = (const run_ctx *)vctx;
  /* first segment with start[k+1] > b */
  int lo = 0, hi = r->nseg - 1;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (r->start[mid + 1] <= b) lo = mid + 1; else hi = mid;
  }
  for (int k = lo; k < r->nseg && r->start[k] < e; k++) {
    int64_t sb = b > r->start[k] ? b - r->start[k] : 0;
    int64_t se = (e < r->start[k + 1] ? e : r->start[k + 1]) - r->start[k];
    if (sb >= se) continue;
    const mp_adamw_seg *s = &r->segs[k];
    /* [sb, split): plain vector formula; [split, se): per-element torch tail test */
    int64_t split = s->coef->tail_from - s->base;
    if (split < sb) split = sb;
    if (split < se) {
      adamw_scalar(s, split, se, 1);
      se = split;
      if (sb >= se) continue;
    }
#if MP_X86
    if (r->isa == MP_ISA_AVX512) { adamw_avx512(s, sb, se); continue; }
    if (r->isa == MP_ISA_AVX2) { adamw_avx2(s, sb, se); continue; }
#endif
    adamw_scalar(s, sb, se, 0);
  }
}

mp_status mp_adamw_run(const mp_adamw_seg *segs, int nseg, int isa, int nthreads) {
  mp_status st = MP_OK;
  int64_t local[65];
  int64_t *start = local;
  if (nseg <= 0) return MP_OK;
  if (isa < 0 || isa > mp_cpu_best_isa()) MP_FAIL(st, MP_ERR_INVALID, "adamw: isa %d not supported by this CPU", isa);
  if (nseg >= 64) {
    start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(nseg + 1));
    if (!start) MP_FAIL(st, MP_ERR_NOMEM, "adamw: out of host memory for %d segments", nseg);
  }
  start[0] = 0;
  for (int k = 0; k < nseg; k++) start[k + 1] = start[k] + segs[k].n;
  run_ctx r = {segs, start, nseg, isa};
  MP_TRY(st, mp_parallel_for(start[nseg], MP_ADAMW_GRAIN, nthreads, run_range, &r));
fail:
  if (start != local) free(start);
  return st;
}
