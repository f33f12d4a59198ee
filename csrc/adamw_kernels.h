/* adamw_kernels.h: the CPU AdamW kernel of StreamAdamW (adamw_kernels.c),
 * shared by the binding and the bucket pipeline (adamw.c).
 *
 * Optimizer state dtype (mp_adamw_seg.sdt): exp_avg m, exp_avg_sq v and
 * amsgrad's max_exp_avg_sq vm are fp32 (MP_DTYPE_F32, 12 B/param with the fp32
 * master) or bf16 (MP_DTYPE_BF16, 8 B/param). bf16 state is widened to fp32,
 * updated by exactly the fp32 arithmetic below (the denominator and the new p
 * use the fp32 m, v, vm before rounding), and stored back with stochastic
 * rounding (SR):
 *
 *   SR(x) = (bits(x) + r) >> 16, r uniform in [0, 2^16)   (bits: the fp32 pattern)
 *
 * i.e. the bf16 neighbour away from zero with probability (low 16 bits of x) /
 * 2^16, else the one toward zero. Properties (tests/test_adamw_bf16_state_kernel.py):
 *  - unbiased: E[SR(x)] = x exactly for finite |x| <= the largest bf16 (over
 *    r uniform; the hash below is a bijection of the element index's low 32
 *    bits, so over those 2^32 elements each r occurs equally often);
 *  - error bound: |SR(x) - x| < ulp_bf16(x) = 2^(e-7) for 2^e <= |x| < 2^(e+1)
 *    (relative < 2^-7; twice round-to-nearest's bound; 2^-133 absolute for
 *    subnormals), variance <= ulp^2 / 4;
 *  - x exactly representable in bf16 (low 16 bits 0, zeros and +-inf included)
 *    is stored unchanged; the sign is kept (v >= 0 stays >= 0); NaN is stored
 *    as 0x7FC0 (torch's bf16 NaN); a finite |x| above the largest bf16
 *    rounds to +-inf with probability (low bits) / 2^16.
 * r comes from a counter-based hash, so the result is a function of (seed,
 * step, element index within the parameter) only: the same bits for every
 * thread count, bucket split and ISA (AVX-512, AVX2, scalar). In uint64 /
 * uint32 arithmetic (wrapping), with splitmix64's and Wellons' lowbias32
 * finalizers:
 *
 *   mix64(z): z += 0x9E3779B97F4A7C15; z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9;
 *             z = (z ^ z >> 27) * 0x94D049BB133111EB; return z ^ z >> 31
 *   mix32(x): x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B;
 *             return x ^ x >> 16
 *
 *   key = mix64(mix64(seed) ^ bits64(double step))       per parameter and step
 *   k   = mix64(key + (idx >> 32)); k0 = low 32 bits, k1 = high 32 bits of k
 *   h   = mix32(mix32(uint32(idx) ^ k0) ^ k1)            idx: element index in the parameter
 *   r_m = h >> 16 (exp_avg), r_v = h & 0xFFFF (exp_avg_sq and max_exp_avg_sq)
 *
 * vm uses v's r, so where vm takes the new v it rounds to the same bf16 as v
 * (SR with one r is monotone: stored vm >= stored v always). Give each
 * parameter its own seed: parameters sharing (seed, step) draw the same r at
 * the same index. */
#ifndef MP_ADAMW_KERNELS_H
#define MP_ADAMW_KERNELS_H

#include "moepeak.h"

/* The per-step scalars of one parameter, cast to float as torch does. */
typedef struct {
  float wd_scale;      /* f(1 - lr*wd) */
  float c1;            /* lerp coefficient: f(1-beta1), or f(1-beta1) - 1 when not small */
  float b2, c2;        /* f(beta2), f(1 - beta2) */
  float bc2_sqrt;      /* f(sqrt(1 - beta2^step)) */
  float eps;           /* f(eps) */
  float neg_step_size; /* f(-lr / (1 - beta1^step)) */
  /* torch's scalar-tail emulation (see adamw_kernels.c): elements at or
   * after tail_from of the parameter are split into ranges of tail_chunk
   * (the last shorter); the last (len % tail_vlen) of each range use the
   * scalar-tail formula. tail_from = numel means none. */
  int64_t tail_from, tail_chunk, numel;
  int tail_vlen;
  int do_wd;           /* wd != 0 */
  int maximize;        /* 1: step along +g (torch's maximize=True: g is negated after loading) */
  int w1_small;        /* |f(1-beta1)| < 0.5: lerp base is m, else g */
  uint64_t sr_key;     /* bf16 state: mix64(mix64(seed) ^ bits64(step)) (header comment) */
} mp_adamw_coef;

void mp_adamw_coef_init(mp_adamw_coef *c, double lr, double beta1, double beta2, double eps, double wd,
                        double step, int maximize);
/* Emulate torch's fused CPU AdamW chunking for a parameter of `numel`
 * elements run with `torch_threads` OpenMP threads and `vlen` float lanes
 * (8 for torch's AVX2 kernels, 16 for AVX512); vlen <= 0 disables it. */
void mp_adamw_coef_set_tails(mp_adamw_coef *c, int64_t numel, int torch_threads, int vlen);
/* The stochastic-rounding key of bf16 state for this parameter's (seed, step). */
void mp_adamw_coef_set_rounding(mp_adamw_coef *c, uint64_t seed, double step);

/* One contiguous run of n elements updated with one coefficient set.
 *   p       : [n] fp32 master, updated in place
 *   m, v    : [n] of sdt (MP_DTYPE_F32 or MP_DTYPE_BF16), updated in place
 *   vmax    : [n] of sdt, max_exp_avg_sq (amsgrad), updated in place; NULL: no amsgrad
 *   g       : [n] of gdt (MP_DTYPE_*), read only
 *   lp      : [n] of ldt, written with the rounded new p; NULL for none
 *   coef    : the parameter's scalars (shared by all its segments) */
typedef struct {
  float *p;
  void *m, *v;
  void *vmax;
  const void *g;
  void *lp;
  int64_t n;
  int64_t base; /* index of element 0 of this segment inside its parameter */
  int gdt, ldt;
  const mp_adamw_coef *coef;
  /* 1: write lp with non-temporal (streaming) stores where aligned. For lp in
   * a pinned slot that only the copy engine reads next, this skips the
   * read-for-ownership of each line: 2 of the ~32 B/param of DRAM traffic of
   * an offloaded step. 0 (default) for params the CPU may read again. */
  int lp_stream;
  int sdt; /* dtype of m, v, vmax: MP_DTYPE_F32 or MP_DTYPE_BF16 */
} mp_adamw_seg;

/* Update every segment, split over the thread pool (nthreads <= 0: default).
 * isa: MP_ISA_* (must be <= mp_cpu_best_isa()). Call without the GIL. */
mp_status mp_adamw_run(const mp_adamw_seg *segs, int nseg, int isa, int nthreads);

#endif
