/* cpu_features.c: which SIMD paths this CPU (and OS) can run. Decided once;
 * AVX-512 needs avx512f (the kernels use only F-level instructions). */
#include "moepeak.h"

int mp_cpu_best_isa(void) {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return MP_ISA_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return MP_ISA_AVX2;
#endif
  return MP_ISA_SCALAR;
}
