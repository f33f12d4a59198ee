/* llep_swiglu.c: PipelinedLLEP's SwiGLU on the CPU, forward and backward in one
 * pass each over a chunk's rows (the CUDA twins are in cuda/llep.cu; the
 * bindings in llep.c). What they replace: torch's silu, mul and silu_backward
 * on the strided gate/up column halves of h, five kernels and two extra
 * [rows, I] passes (s written then read back in forward; d silu in backward).
 *
 * Layout: h [rows, ldh] holds gate in columns [0, I) and up in [I, 2I); a, s,
 * da [rows, I] contiguous; dh like h (ldd; it may be h itself: each element
 * is read before its own position is written, nothing else is read). rnd(v):
 * v rounded once to the rows' dtype (mp_half.h, RNE). The arithmetic is
 * torch's, operation for operation, in fp32:
 *   forward   s = rnd(g / (1 + exp(-g)))           (aten silu)
 *             a = rnd(s * u)                        (aten mul)
 *   backward  du = rnd(da * s)
 *             t  = rnd(da * u)
 *             sg = 1 / (1 + exp(-g))
 *             dg = rnd(t * sg * (1 + g * (1 - sg)))  (aten silu_backward)
 * so the values are those of the unfused ops up to the exp's last bit (libm
 * here, Sleef in torch's vectorized CPU kernels). The bindings (llep.c's method
 * table lists them) take pointers as ints; moepeak/llep/plan.py checks the tensors. */
#include <math.h>
#include <string.h>

#include "llep.h"
#include "mp_checks.h"
#include "mp_half.h"
#include "mp_python.h"

#define P_(x) ((void *)(uintptr_t)(x))

/* bf16 rounding as mp_half.h's f32_to_bf16 (RNE, NaN -> 0x7FC0), written without a branch
 * so the row loops below vectorize. */
static inline uint16_t bf16_rne(float f) {
  const uint32_t u = mp_f32_bits(f);
  const uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? (uint16_t)0x7FC0 : r;
}

/* Row r's elements as fp32 (n of them, from dtype code dt) and back with one rounding. */
static inline void load_row(const void *p, int dt, int64_t off, int64_t n, float *dst) {
  if (dt == MP_DTYPE_F32) {
    memcpy(dst, (const float *)p + off, (size_t)n * sizeof(float));
  } else if (dt == MP_DTYPE_BF16) {
    const uint16_t *q = (const uint16_t *)p + off;
    for (int64_t j = 0; j < n; j++) dst[j] = bf16_to_f32(q[j]);
  } else {
    const uint16_t *q = (const uint16_t *)p + off;
    for (int64_t j = 0; j < n; j++) dst[j] = f16_to_f32(q[j]);
  }
}

static inline void store_row(void *p, int dt, int64_t off, int64_t n, const float *src) {
  if (dt == MP_DTYPE_F32) {
    memcpy((float *)p + off, src, (size_t)n * sizeof(float));
  } else if (dt == MP_DTYPE_BF16) {
    uint16_t *q = (uint16_t *)p + off;
    for (int64_t j = 0; j < n; j++) q[j] = bf16_rne(src[j]);
  } else {
    uint16_t *q = (uint16_t *)p + off;
    for (int64_t j = 0; j < n; j++) q[j] = f32_to_f16(src[j]);
  }
}

/* v rounded once to dtype code dt, as fp32 */
static inline float rnd(int dt, float v) {
  if (dt == MP_DTYPE_F32) return v;
  if (dt == MP_DTYPE_BF16) return bf16_to_f32(bf16_rne(v));
  return f16_to_f32(f32_to_f16(v));
}

/* Rows are processed in column blocks of kCols through fp32 scratch on the stack. */
enum { kCols = 256 };

void mp_llep_swiglu_fwd_range(void *c, int64_t b, int64_t e, int w) {
  (void)w;
  const mp_llep_swiglu_args *k = (const mp_llep_swiglu_args *)c;
  const int dt = k->dtype;
  float g[kCols], u[kCols];
  for (int64_t r = b; r < e; r++)
    for (int64_t j0 = 0; j0 < k->I; j0 += kCols) {
      const int64_t n = k->I - j0 < kCols ? k->I - j0 : kCols, hr = r * k->ldh + j0, ar = r * k->I + j0;
      load_row(k->h, dt, hr, n, g);
      load_row(k->h, dt, hr + k->I, n, u);
      for (int64_t j = 0; j < n; j++) g[j] = rnd(dt, g[j] / (1.0f + expf(-g[j])));  /* s */
      if (k->s) store_row(k->s, dt, ar, n, g);
      for (int64_t j = 0; j < n; j++) u[j] = g[j] * u[j];                             /* a */
      store_row(k->a, dt, ar, n, u);
    }
}

void mp_llep_swiglu_bwd_range(void *c, int64_t b, int64_t e, int w) {
  (void)w;
  const mp_llep_swiglu_args *k = (const mp_llep_swiglu_args *)c;
  const int dt = k->dtype;
  float g[kCols], u[kCols], d[kCols], s[kCols];
  for (int64_t r = b; r < e; r++)
    for (int64_t j0 = 0; j0 < k->I; j0 += kCols) {
      const int64_t n = k->I - j0 < kCols ? k->I - j0 : kCols, hr = r * k->ldh + j0, dr = r * k->ldd + j0;
      const int64_t ar = r * k->I + j0;
      load_row(k->h, dt, hr, n, g);
      load_row(k->h, dt, hr + k->I, n, u);
      load_row(k->da, dt, ar, n, d);
      load_row(k->s, dt, ar, n, s);
      for (int64_t j = 0; j < n; j++) {
        const float t = rnd(dt, d[j] * u[j]);
        const float sg = 1.0f / (1.0f + expf(-g[j]));
        u[j] = d[j] * s[j];                                /* d up */
        g[j] = t * sg * (1.0f + g[j] * (1.0f - sg));       /* d gate */
      }
      store_row(k->dh, dt, dr + k->I, n, u);
      store_row(k->dh, dt, dr, n, g);
    }
}

/* ---- bindings ------------------------------------------------------------ */
/* The SwiGLU passes' shape checks (llep.h): ldh, ldd >= 2I; pointers of the extents used. */
static int llep_check_swiglu(const char *fn, const mp_llep_swiglu_args *k, int bwd) {
  if (!mp_dtype_valid(k->dtype) || k->rows < 0 || k->I < 0 || k->ldh < 2 * k->I ||
      (bwd && k->ldd < 2 * k->I)) {
    PyErr_Format(PyExc_ValueError, "moepeak: %s needs dtype code 0..2, rows, I >= 0, ldh (and ldd) >= 2I", fn);
    return -1;
  }
  const long long n = k->rows ? (k->rows - 1) * k->ldh + 2 * k->I : 0;
  return mp_check_extent(fn, "h's bytes (rows x ldh x 4)", k->rows, k->ldh, 4, NULL) ||
         mp_check_extent(fn, "dh's bytes (rows x ldd x 4)", k->rows, bwd ? k->ldd : 0, 4, NULL) ||
         mp_check_ptr(fn, "h", (uintptr_t)k->h, n) || mp_check_ptr(fn, bwd ? "da" : "a", (uintptr_t)(bwd ? k->da : k->a),
                                                                   k->rows * k->I) ||
         (bwd && (mp_check_ptr(fn, "s", (uintptr_t)k->s, k->rows * k->I) ||
                  mp_check_ptr(fn, "dh", (uintptr_t)k->dh, k->rows ? (k->rows - 1) * k->ldd + 2 * k->I : 0)));
}

/* llep_swiglu_fwd(h, ldh, a, s_or_0, rows, I, dtype, is_cuda, stream) */
PyObject *mp_llep_py_swiglu_fwd(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long h, a, sp, stream;
  long long ldh, rows, I;
  int dtype, cuda;
  if (!PyArg_ParseTuple(args, "KLKKLLipK", &h, &ldh, &a, &sp, &rows, &I, &dtype, &cuda, &stream)) return NULL;
  mp_llep_swiglu_args k = {P_(h), ldh, P_(a), P_(sp), NULL, NULL, 0, rows, I, dtype};
  if (llep_check_swiglu("llep_swiglu_fwd", &k, 0)) return NULL;
  if (cuda) {
#if MP_WITH_CUDA
    return mp_return_none(mp_llep_swiglu_fwd_cuda(&k, (uintptr_t)stream));
#else
    return mp_raise_no_cuda("llep swiglu_fwd");
#endif
  }
  return mp_py_parallel_for(rows, 16, mp_llep_swiglu_fwd_range, &k);
}

/* llep_swiglu_bwd(h, ldh, da, s, dh, ldd, rows, I, dtype, is_cuda, stream) */
PyObject *mp_llep_py_swiglu_bwd(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long h, da, sp, dh, stream;
  long long ldh, ldd, rows, I;
  int dtype, cuda;
  if (!PyArg_ParseTuple(args, "KLKKKLLLipK", &h, &ldh, &da, &sp, &dh, &ldd, &rows, &I, &dtype, &cuda, &stream))
    return NULL;
  mp_llep_swiglu_args k = {P_(h), ldh, NULL, P_(sp), P_(da), P_(dh), ldd, rows, I, dtype};
  if (llep_check_swiglu("llep_swiglu_bwd", &k, 1)) return NULL;
  if (cuda) {
#if MP_WITH_CUDA
    return mp_return_none(mp_llep_swiglu_bwd_cuda(&k, (uintptr_t)stream));
#else
    return mp_raise_no_cuda("llep swiglu_bwd");
#endif
  }
  return mp_py_parallel_for(rows, 16, mp_llep_swiglu_bwd_range, &k);
}
