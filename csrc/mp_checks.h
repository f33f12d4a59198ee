/* mp_checks.h: argument checks for the binding layer (the py_* functions).
 *
 * A binding receives tensors as raw (pointer, size) ints and must not trust
 * them: every size is checked before any memory is touched, every product of
 * sizes that becomes an address offset is computed with overflow detection,
 * every pointer a non-empty buffer needs is non-zero, and every float that an
 * address or a loop bound derives from (or that has no meaning when NaN/inf)
 * is finite. Each check raises ValueError naming the function, the argument
 * and what was expected, and returns -1 (0 when the argument is fine), so a
 * binding reads as a list of `if (mp_check_...(...)) return NULL;`.
 *
 * What a binding cannot check: the extent of the memory behind a pointer
 * (the caller, the ops in moepeak/, sized the tensor); the checks here make every
 * index the kernels form a well-defined int64 inside the extents the
 * arguments describe. */
#ifndef MP_CHECKS_H
#define MP_CHECKS_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "mp_python.h"

/* v >= lo, else ValueError "fn: name must be >= lo, got v". */
static inline int mp_check_min(const char *fn, const char *name, long long v, long long lo) {
  if (v >= lo) return 0;
  PyErr_Format(PyExc_ValueError, "moepeak._C.%s: %s must be >= %lld, got %lld", fn, name, lo, v);
  return -1;
}

/* lo <= v < hi. */
static inline int mp_check_range(const char *fn, const char *name, long long v, long long lo, long long hi) {
  if (v >= lo && v < hi) return 0;
  PyErr_Format(PyExc_ValueError, "moepeak._C.%s: %s must be in [%lld, %lld), got %lld", fn, name, lo, hi, v);
  return -1;
}

/* A pointer that a buffer of `count` elements lives at: non-zero when count > 0. */
static inline int mp_check_ptr(const char *fn, const char *name, unsigned long long p, long long count) {
  if (p != 0 || count <= 0) return 0;
  PyErr_Format(PyExc_ValueError, "moepeak._C.%s: %s is a null pointer but must hold %lld elements", fn, name,
               count);
  return -1;
}

/* A finite float (not NaN, not +-inf). */
static inline int mp_check_finite(const char *fn, const char *name, double v) {
  if (isfinite(v)) return 0;
  char buf[32];
  snprintf(buf, sizeof buf, "%g", v); /* PyErr_Format has no %g */
  PyErr_Format(PyExc_ValueError, "moepeak._C.%s: %s must be a finite number, got %s", fn, name, buf);
  return -1;
}

/* v > 0 (+inf allowed, NaN not). */
static inline int mp_check_positive(const char *fn, const char *name, double v) {
  if (v > 0.0) return 0;
  char buf[32];
  snprintf(buf, sizeof buf, "%g", v);
  PyErr_Format(PyExc_ValueError, "moepeak._C.%s: %s must be > 0, got %s", fn, name, buf);
  return -1;
}

/* Not NaN (+-inf allowed). */
static inline int mp_check_not_nan(const char *fn, const char *name, double v) {
  if (!isnan(v)) return 0;
  PyErr_Format(PyExc_ValueError, "moepeak._C.%s: %s must be a number, got nan", fn, name);
  return -1;
}

/* *out = a * b * c (all >= 0) as an int64 byte or element extent; ValueError
 * when it does not fit (an address offset computed from it would wrap). */
static inline int mp_check_extent(const char *fn, const char *what, long long a, long long b, long long c,
                                  long long *out) {
  long long ab, abc;
  if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc)) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.%s: %s = %lld x %lld x %lld overflows int64", fn, what, a, b, c);
    return -1;
  }
  if (out) *out = abc;
  return 0;
}

/* a + b fits in int64. */
static inline int mp_check_sum(const char *fn, const char *what, long long a, long long b) {
  long long s;
  if (!__builtin_add_overflow(a, b, &s)) return 0;
  PyErr_Format(PyExc_ValueError, "moepeak._C.%s: %s = %lld + %lld overflows int64", fn, what, a, b);
  return -1;
}

#endif
