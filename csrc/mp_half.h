/* mp_half.h: scalar bf16 / fp16 <-> fp32 conversions for the CPU kernels
 * (round to nearest even, like torch's casts; NaN and subnormals handled).
 * Header-only (static inline): every C file that converts uses these. */
#ifndef MOEPEAK_HALF_H
#define MOEPEAK_HALF_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "mp_abi.h"

/* fp32 <-> its bit pattern (memcpy: no aliasing rules broken, compiled to a move). */
static inline uint32_t mp_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float mp_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float bf16_to_f32(uint16_t h) { return mp_bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = mp_f32_bits(f);
  if (f != f) return 0x7FC0; /* NaN: torch's canonical bf16 NaN */
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) return mp_bits_f32(sign | 0x7F800000u | (man << 13));
  if (exp == 0) /* zero, or subnormal: value = man * 2^-24, exact in fp32 */
    return man == 0 ? mp_bits_f32(sign) : mp_bits_f32(mp_f32_bits((float)man * 5.9604644775390625e-8f) | sign);
  return mp_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t f32_to_f16(float f) {
  uint32_t u = mp_f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u; /* NaN */
  if (a >= 0x477FF000u) return sign | 0x7C00u; /* rounds to >= 65520: inf */
  if (a < 0x38800000u) {                      /* below 2^-14: fp16 subnormal or 0 */
    /* |f| * 2^24 is exact up to rounding in the integer conversion (RNE) */
    float scaled = mp_bits_f32(a) * 16777216.0f;
    return sign | (uint16_t)lrintf(scaled);
  }
  uint32_t r = a + 0xFFFu + ((a >> 13) & 1u); /* RNE on the 13 dropped bits */
  return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

/* Element i of a buffer of dtype `code` (mp_dtype of mp_abi.h: fp32, bf16 or fp16), as fp32;
 * and the store with one rounding. */
static inline float mp_ld_el(const void *p, int code, int64_t i) {
  if (code == MP_DTYPE_F32) return ((const float *)p)[i];
  if (code == MP_DTYPE_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
  return f16_to_f32(((const uint16_t *)p)[i]);
}

static inline void mp_st_el(void *p, int code, int64_t i, float v) {
  if (code == MP_DTYPE_F32) ((float *)p)[i] = v;
  else if (code == MP_DTYPE_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
  else ((uint16_t *)p)[i] = f32_to_f16(v);
}

#endif
