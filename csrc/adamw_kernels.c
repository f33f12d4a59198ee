/* adamw_kernels.c: the CPU AdamW update of StreamAdamW.
 *
 * What it computes, per element i of a segment (fp32 master p; m, v (and vm)
 * fp32, or bf16 widened to fp32; the gradient g read as fp32/bf16/fp16 and
 * widened to fp32):
 *
 *   g  = -g                                     (only when maximize)
 *   p  = p * f(1 - lr*wd)                       (only when wd != 0)
 *   m  = fma(c1, g - m, small ? m : g)          (= m.lerp_(g, 1 - beta1))
 *   v  = fma(f(1 - beta2) * g, g, v * f(beta2))
 *   vm = max(vm, v); d = sqrt(vm) / ...          (only with amsgrad: vm = max_exp_avg_sq)
 *   d  = sqrt(v) / f(sqrt(1 - beta2^t)) + f(eps)
 *   p  = p + (f(-lr / (1 - beta1^t)) * m) / d
 *   lp = round_to_nearest_even(p)               (optional bf16/fp16 copy)
 *   m, v, vm stored as fp32, or as bf16 with stochastic rounding (the SR and
 *   its counter-based hash: adamw_kernels.h)
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
 * The SR hash is integer arithmetic on the element index, so bf16 state gets
 * the same bits on every path; each path is compiled twice (fp32 / bf16
 * state) from one always-inline body, so the fp32 loop carries no SR code.
 * Ranges handed to the paths never cross a multiple of 2^32 of the parameter's
 * element index (run_range splits them), so a vector's lanes share the key k.
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

/* ---- stochastic rounding of bf16 state (spec: adamw_kernels.h) ---- */
static inline uint64_t sr_mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline uint32_t sr_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

void mp_adamw_coef_set_rounding(mp_adamw_coef *c, uint64_t seed, double step) {
  uint64_t step_bits;
  memcpy(&step_bits, &step, sizeof step_bits);
  c->sr_key = sr_mix64(sr_mix64(seed) ^ step_bits);
}

/* The per-element key (k0, k1) of the elements whose index has high word `hi`. */
typedef struct {
  uint32_t k0, k1;
} sr_keys;

static inline sr_keys sr_keys_for(const mp_adamw_coef *c, uint64_t hi) {
  uint64_t k = sr_mix64(c->sr_key + hi);
  sr_keys r = {(uint32_t)k, (uint32_t)(k >> 32)};
  return r;
}

static inline uint32_t sr_hash(sr_keys k, uint32_t idx_lo) { return sr_mix32(sr_mix32(idx_lo ^ k.k0) ^ k.k1); }

/* SR of x to bf16 with 16 random bits r (< 2^16): NaN -> 0x7FC0; bits + r
 * cannot carry into the sign for any non-NaN pattern (<= 0xFF800000). */
static inline uint16_t sr_bf16(float x, uint32_t r) {
  if (x != x) return 0x7FC0;
  return (uint16_t)((mp_f32_bits(x) + r) >> 16);
}

static inline float load_state(const void *p, int bf16, int64_t i) {
  return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_state(void *p, int bf16, int64_t i, float x, uint32_t r) {
  if (bf16)
    ((uint16_t *)p)[i] = sr_bf16(x, r);
  else
    ((float *)p)[i] = x;
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
    case MP_DTYPE_BF16: return bf16_to_f32(((const uint16_t *)g)[i]);
    case MP_DTYPE_F16: return f16_to_f32(((const uint16_t *)g)[i]);
    default: return ((const float *)g)[i];
  }
}

static inline void store_lp(void *lp, int dt, int64_t i, float x) {
  switch (dt) {
    case MP_DTYPE_BF16: ((uint16_t *)lp)[i] = f32_to_bf16(x); break;
    case MP_DTYPE_F16: ((uint16_t *)lp)[i] = f32_to_f16(x); break;
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
  const int bf16 = s->sdt == MP_DTYPE_BF16;
  uint64_t hi = UINT64_MAX; /* high word of the element index the keys are for (none yet) */
  sr_keys keys = {0, 0};
  for (int64_t i = b; i < e; i++) {
    float g = load_grad(s->g, s->gdt, i);
    float p = s->p[i], m = load_state(s->m, bf16, i), v = load_state(s->v, bf16, i);
    const int torch_tail = emulate && is_torch_tail(c, s->base + i);
    /* maximize: m reads -g; v reads -g in torch's scalar tail, g in its vector body */
    const float gm = c->maximize ? -g : g;
    if (c->do_wd) p = p * c->wd_scale;
    m = fmaf(c->c1, gm - m, c->w1_small ? m : gm);
    if (torch_tail)
      v = fmaf(v, c->b2, (c->c2 * gm) * gm);
    else
      v = fmaf(c->c2 * g, g, v * c->b2);
    uint32_t h = 0; /* SR bits: r_m = h >> 16, r_v = h & 0xFFFF */
    if (bf16) {
      const uint64_t idx = (uint64_t)(s->base + i);
      if (idx >> 32 != hi) {
        hi = idx >> 32;
        keys = sr_keys_for(c, hi);
      }
      h = sr_hash(keys, (uint32_t)idx);
    }
    float vd = v; /* the second moment the denominator uses */
    if (s->vmax) {
      float vm = load_state(s->vmax, bf16, i);
      vd = torch_tail ? (vm < v ? v : vm) : amsgrad_max_vec(vm, v);
      store_state(s->vmax, bf16, i, vd, h & 0xFFFFu);
    }
    float d = sqrtf(vd) / c->bc2_sqrt;
    d = d + c->eps;
    float q = c->neg_step_size * m;
    q = q / d;
    p = p + q;
    s->p[i] = p;
    store_state(s->m, bf16, i, m, h >> 16);
    store_state(s->v, bf16, i, v, h & 0xFFFFu);
    if (s->lp) store_lp(s->lp, s->ldt, i, p);
  }
}

#if MP_X86
/* ---- AVX2 + FMA + F16C: 8 lanes ---- */
#define MP_T_AVX2 __attribute__((target("avx2,fma,f16c")))

MP_T_AVX2 static inline __m256 avx2_load_grad(const void *g, int dt, int64_t i) {
  if (dt == MP_DTYPE_BF16) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)g + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  if (dt == MP_DTYPE_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)g + i)));
  return _mm256_loadu_ps((const float *)g + i);
}

MP_T_AVX2 static inline void avx2_store_lp(void *lp, int dt, int64_t i, __m256 x, int nt) {
  if (dt == MP_DTYPE_BF16) {
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
  } else if (dt == MP_DTYPE_F16) {
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
  size_t es = s->ldt == MP_DTYPE_F32 ? 4 : 2;
  return ((uintptr_t)((const char *)s->lp + (size_t)b * es) % (es * (size_t)lanes)) == 0;
}

/* bf16 state: 8 x bf16 -> fp32 (exact widening). */
MP_T_AVX2 static inline __m256 avx2_load_bf16(const void *p, int64_t i) {
  __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

MP_T_AVX2 static inline __m256 avx2_load_state(const void *p, int bf16, int64_t i) {
  return bf16 ? avx2_load_bf16(p, i) : _mm256_loadu_ps((const float *)p + i);
}

/* mix32 (adamw_kernels.h) on 8 lanes. */
MP_T_AVX2 static inline __m256i avx2_mix32(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846CA68Bu));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* sr_bf16 on 8 lanes: (bits + r) >> 16, NaN -> 0x7FC0. */
MP_T_AVX2 static inline void avx2_store_sr_bf16(void *p, int64_t i, __m256 x, __m256i r) {
  __m256i t = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  t = _mm256_blendv_epi8(t, _mm256_set1_epi32(0x7FC0), nan);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)); /* t <= 0xFFFF */
  _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
}

MP_T_AVX2 static inline void avx2_store_state(void *p, int bf16, int64_t i, __m256 x, __m256i r) {
  if (bf16)
    avx2_store_sr_bf16(p, i, x, r);
  else
    _mm256_storeu_ps((float *)p + i, x);
}

/* The AVX2 loop; bf16 is a compile-time constant in each caller. */
MP_T_AVX2 static inline __attribute__((always_inline)) void adamw_avx2_body(const mp_adamw_seg *s, int64_t b,
                                                                             int64_t e, const int bf16) {
  const mp_adamw_coef *c = s->coef;
  const __m256 wd = _mm256_set1_ps(c->wd_scale), c1 = _mm256_set1_ps(c->c1), b2 = _mm256_set1_ps(c->b2);
  const __m256 c2 = _mm256_set1_ps(c->c2), bc2 = _mm256_set1_ps(c->bc2_sqrt), eps = _mm256_set1_ps(c->eps);
  const __m256 nss = _mm256_set1_ps(c->neg_step_size);
  const __m256 gsign = _mm256_set1_ps(c->maximize ? -0.0f : 0.0f); /* xor: maximize's negation */
  const int nt = lp_stream_ok(s, b, 8);
  /* SR: lane j of element i hashes uint32(base + i) + j (no wrap: see the file comment) */
  const sr_keys keys = bf16 ? sr_keys_for(c, (uint64_t)(s->base + b) >> 32) : (sr_keys){0, 0};
  const __m256i k0 = _mm256_set1_epi32((int)keys.k0), k1 = _mm256_set1_epi32((int)keys.k1);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), low16 = _mm256_set1_epi32(0xFFFF);
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    __m256 g = avx2_load_grad(s->g, s->gdt, i);
    __m256 p = _mm256_loadu_ps(s->p + i), m = avx2_load_state(s->m, bf16, i), v = avx2_load_state(s->v, bf16, i);
    const __m256 gm = _mm256_xor_ps(g, gsign);
    if (c->do_wd) p = _mm256_mul_ps(p, wd);
    m = _mm256_fmadd_ps(c1, _mm256_sub_ps(gm, m), c->w1_small ? m : gm);
    v = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(v, b2));
    __m256i h = _mm256_setzero_si256(), rv = h; /* SR bits: r_m = h >> 16, r_v = h & 0xFFFF */
    if (bf16) {
      __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)(s->base + i)), lane);
      h = avx2_mix32(_mm256_xor_si256(avx2_mix32(_mm256_xor_si256(idx, k0)), k1));
      rv = _mm256_and_si256(h, low16);
    }
    __m256 vd = v;
    if (s->vmax) { /* at::vec::maximum: max, or all-ones NaN where either is NaN */
      __m256 vm = avx2_load_state(s->vmax, bf16, i);
      vd = _mm256_or_ps(_mm256_max_ps(vm, v), _mm256_cmp_ps(vm, v, _CMP_UNORD_Q));
      avx2_store_state(s->vmax, bf16, i, vd, rv);
    }
    __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vd), bc2), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(nss, m), d));
    _mm256_storeu_ps(s->p + i, p);
    avx2_store_state(s->m, bf16, i, m, _mm256_srli_epi32(h, 16));
    avx2_store_state(s->v, bf16, i, v, rv);
    if (s->lp) avx2_store_lp(s->lp, s->ldt, i, p, nt);
  }
  if (nt) _mm_sfence(); /* streaming stores visible before the copy engine reads the slot */
  if (i < e) adamw_scalar(s, i, e, 0);
}

MP_T_AVX2 static void adamw_avx2(const mp_adamw_seg *s, int64_t b, int64_t e) {
  if (s->sdt == MP_DTYPE_BF16)
    adamw_avx2_body(s, b, e, 1);
  else
    adamw_avx2_body(s, b, e, 0);
}

/* ---- AVX-512F: 16 lanes (F-level only: no BW/VL instructions) ---- */
#define MP_T_AVX512 __attribute__((target("avx512f")))

MP_T_AVX512 static inline __m512 avx512_load_grad(const void *g, int dt, int64_t i) {
  if (dt == MP_DTYPE_BF16) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  if (dt == MP_DTYPE_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i)));
  return _mm512_loadu_ps((const float *)g + i);
}

MP_T_AVX512 static inline void avx512_store_lp(void *lp, int dt, int64_t i, __m512 x, int nt) {
  if (dt == MP_DTYPE_BF16) {
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
  } else if (dt == MP_DTYPE_F16) {
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

MP_T_AVX512 static inline __m512 avx512_load_state(const void *p, int bf16, int64_t i) {
  if (bf16) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_loadu_ps((const float *)p + i);
}

/* mix32 (adamw_kernels.h) on 16 lanes. */
MP_T_AVX512 static inline __m512i avx512_mix32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846CA68Bu));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

MP_T_AVX512 static inline void avx512_store_state(void *p, int bf16, int64_t i, __m512 x, __m512i r) {
  if (!bf16) {
    _mm512_storeu_ps((float *)p + i, x);
    return;
  }
  /* sr_bf16 on 16 lanes: (bits + r) >> 16, NaN -> 0x7FC0 */
  __m512i t = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16);
  t = _mm512_mask_mov_epi32(t, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(t));
}

/* The AVX-512 loop; bf16 is a compile-time constant in each caller. */
MP_T_AVX512 static inline __attribute__((always_inline)) void adamw_avx512_body(const mp_adamw_seg *s, int64_t b,
                                                                                 int64_t e, const int bf16) {
  const mp_adamw_coef *c = s->coef;
  const __m512 wd = _mm512_set1_ps(c->wd_scale), c1 = _mm512_set1_ps(c->c1), b2 = _mm512_set1_ps(c->b2);
  const __m512 c2 = _mm512_set1_ps(c->c2), bc2 = _mm512_set1_ps(c->bc2_sqrt), eps = _mm512_set1_ps(c->eps);
  const __m512 nss = _mm512_set1_ps(c->neg_step_size);
  const __m512i gsign = _mm512_set1_epi32(c->maximize ? (int)0x80000000u : 0); /* xor: maximize's negation */
  const int nt = lp_stream_ok(s, b, 16);
  /* SR: lane j of element i hashes uint32(base + i) + j (no wrap: see the file comment) */
  const sr_keys keys = bf16 ? sr_keys_for(c, (uint64_t)(s->base + b) >> 32) : (sr_keys){0, 0};
  const __m512i k0 = _mm512_set1_epi32((int)keys.k0), k1 = _mm512_set1_epi32((int)keys.k1);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  int64_t i = b;
  for (; i + 16 <= e; i += 16) {
    __m512 g = avx512_load_grad(s->g, s->gdt, i);
    __m512 p = _mm512_loadu_ps(s->p + i), m = avx512_load_state(s->m, bf16, i), v = avx512_load_state(s->v, bf16, i);
    const __m512 gm = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), gsign)); /* F-level xor */
    if (c->do_wd) p = _mm512_mul_ps(p, wd);
    m = _mm512_fmadd_ps(c1, _mm512_sub_ps(gm, m), c->w1_small ? m : gm);
    v = _mm512_fmadd_ps(_mm512_mul_ps(c2, g), g, _mm512_mul_ps(v, b2));
    __m512i h = _mm512_setzero_si512(), rv = h; /* SR bits: r_m = h >> 16, r_v = h & 0xFFFF */
    if (bf16) {
      __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)(s->base + i)), lane);
      h = avx512_mix32(_mm512_xor_si512(avx512_mix32(_mm512_xor_si512(idx, k0)), k1));
      rv = _mm512_and_si512(h, low16);
    }
    __m512 vd = v;
    if (s->vmax) { /* at::vec::maximum: max, or all-ones NaN where either is NaN */
      __m512 vm = avx512_load_state(s->vmax, bf16, i);
      __mmask16 unord = _mm512_cmp_ps_mask(vm, v, _CMP_UNORD_Q);
      vd = _mm512_mask_mov_ps(_mm512_max_ps(vm, v), unord, _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
      avx512_store_state(s->vmax, bf16, i, vd, rv);
    }
    __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vd), bc2), eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(nss, m), d));
    _mm512_storeu_ps(s->p + i, p);
    avx512_store_state(s->m, bf16, i, m, _mm512_srli_epi32(h, 16));
    avx512_store_state(s->v, bf16, i, v, rv);
    if (s->lp) avx512_store_lp(s->lp, s->ldt, i, p, nt);
  }
  if (nt) _mm_sfence(); /* streaming stores visible before the copy engine reads the slot */
  if (i < e) adamw_scalar(s, i, e, 0);
}

MP_T_AVX512 static void adamw_avx512(const mp_adamw_seg *s, int64_t b, int64_t e) {
  if (s->sdt == MP_DTYPE_BF16)
    adamw_avx512_body(s, b, e, 1);
  else
    adamw_avx512_body(s, b, e, 0);
}
#endif /* MP_X86 */

/* ---- the parallel runner over a list of segments ---- */
typedef struct {
  const mp_adamw_seg *segs;
  const int64_t *start; /* start[k]: first flat element of segment k; start[nseg] = total */
  int nseg;
  int isa;
} run_ctx;

/* [b, e) of one segment, inside one 2^32 block of its parameter's indices. */
static void update_piece(const mp_adamw_seg *s, int64_t b, int64_t e, int isa) {
  /* [b, split): plain vector formula; [split, e): per-element torch tail test */
  int64_t split = s->coef->tail_from - s->base;
  if (split < b) split = b;
  if (split < e) {
    adamw_scalar(s, split, e, 1);
    e = split;
    if (b >= e) return;
  }
#if MP_X86
  if (isa == MP_ISA_AVX512) {
    adamw_avx512(s, b, e);
    return;
  }
  if (isa == MP_ISA_AVX2) {
    adamw_avx2(s, b, e);
    return;
  }
#else
  (void)isa;
#endif
  adamw_scalar(s, b, e, 0);
}

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
    /* pieces that do not cross a multiple of 2^32 of the parameter's element index */
    while (sb < se) {
      int64_t next = (((s->base + sb) >> 32) + 1) * ((int64_t)1 << 32) - s->base;
      int64_t pe = next < se ? next : se;
      update_piece(s, sb, pe, r->isa);
      sb = pe;
    }
  }
}

mp_status mp_adamw_run(const mp_adamw_seg *segs, int nseg, int isa, int nthreads) {
  mp_status st = MP_OK;
  int64_t local[65];
  int64_t *start = local;
  if (nseg <= 0) return MP_OK;
  if (isa < 0 || isa > mp_cpu_best_isa()) MP_FAIL(st, MP_ERR_INVALID, "adamw: isa %d not supported by this CPU", isa);
  for (int k = 0; k < nseg; k++)
    if (segs[k].sdt != MP_DTYPE_F32 && segs[k].sdt != MP_DTYPE_BF16)
      MP_FAIL(st, MP_ERR_INVALID, "adamw: state dtype code %d of segment %d is not 0 (fp32) or 1 (bf16)",
              segs[k].sdt, k);
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
