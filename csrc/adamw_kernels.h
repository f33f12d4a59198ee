/* adamw_kernels.h: the CPU AdamW kernel of StreamAdamW (adamw_kernels.c),
 * shared by the binding and the bucket pipeline (adamw.c). */
#ifndef MP_ADAMW_KERNELS_H
#define MP_ADAMW_KERNELS_H

#include "moepeak.h"

/* dtype codes of gradients and low-precision parameter copies */
enum { MP_DT_F32 = 0, MP_DT_BF16 = 1, MP_DT_F16 = 2 };

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
} mp_adamw_coef;

void mp_adamw_coef_init(mp_adamw_coef *c, double lr, double beta1, double beta2, double eps, double wd,
                        double step, int maximize);
/* Emulate torch's fused CPU AdamW chunking for a parameter of `numel`
 * elements run with `torch_threads` OpenMP threads and `vlen` float lanes
 * (8 for torch's AVX2 kernels, 16 for AVX512); vlen <= 0 disables it. */
void mp_adamw_coef_set_tails(mp_adamw_coef *c, int64_t numel, int torch_threads, int vlen);

/* One contiguous run of n elements updated with one coefficient set.
 *   p, m, v : [n] fp32, updated in place
 *   vmax    : [n] fp32 max_exp_avg_sq (amsgrad), updated in place; NULL: no amsgrad
 *   g       : [n] of gdt (MP_DT_*), read only
 *   lp      : [n] of ldt, written with the rounded new p; NULL for none
 *   coef    : the parameter's scalars (shared by all its segments) */
typedef struct {
  float *p, *m, *v;
  float *vmax;
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
} mp_adamw_seg;

/* Update every segment, split over the thread pool (nthreads <= 0: default).
 * isa: MP_ISA_* (must be <= mp_cpu_best_isa()). Call without the GIL. */
mp_status mp_adamw_run(const mp_adamw_seg *segs, int nseg, int isa, int nthreads);

#endif
