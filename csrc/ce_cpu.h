/* ce_cpu.h: Ring-DTP's CPU kernels (csrc/ce.c) as thread-pool range functions
 * (mp_parallel_for's fn: ctx is the kernel's args struct below, [begin, end) its
 * rows or elements), called by the bindings in csrc/ce_bind.c. The math and the
 * block layout are in csrc/ce.c's header. */
#ifndef MOEPEAK_CE_CPU_H
#define MOEPEAK_CE_CPU_H
#include <stdint.h>

/* Rows per thread-pool grain: a row is v (up to ~2.5e5) floats, so a few rows
 * already amortise the dispatch. */
#define CE_ROW_GRAIN 4

typedef struct {
  float *z;
  int64_t ldz, t, v, v0, v_valid;
  const int64_t *labels;
  int64_t ignore_index;
  float softcap;
  float *m, *s, *zy, *zsum, *sx;
  /* gradient only */
  const float *mrow, *ls, *g, *q; /* m and log(s) of the full row: lse = m + ls */
  int64_t g_stride;
  float eps, zloss;
  int64_t n_classes;
} ce_args;

typedef struct {
  void *t;
  int dtype;
  float g;
} ce_scale_args;

/* Elements per thread-pool grain: 64k elements (128-256 KiB) amortise the dispatch. */
#define CE_SCALE_GRAIN (1 << 16)
typedef struct {
  void *out;
  int64_t ldo;
  const void *x;
  int64_t ldx;
  const void *mu;
  int64_t h;
  int dtype;
} ce_sub_row_args;

typedef struct {
  void *dw;
  int dtype;
  int64_t ldw, v0, nv;
  const void *x;
  int64_t ldx, h;
  const int64_t *sy, *perm;
  const float *tcs; /* the label terms in sy's order */
  int64_t t;
  const float *cs, *mu; /* optional rank-1 term cs[r] * mu[c] (both NULL or both set) */
} ce_dw_finish_args;

typedef struct {
  void *dx;
  int dtype;
  int64_t ldx;
  const void *w;
  int64_t ldw, v0, nv, h;
  const int64_t *labels;
  const float *tc;
} ce_dx_finish_args;

/* fold / gradient of one logits block: ctx is a ce_args, [begin, end) rows of z */
void mp_ce_fold_rows(void *ctx, int64_t begin, int64_t end, int worker);
void mp_ce_grad_rows(void *ctx, int64_t begin, int64_t end, int worker);
/* t *= g: ctx is a ce_scale_args, [begin, end) elements of t */
void mp_ce_scale_range(void *ctx, int64_t begin, int64_t end, int worker);
/* out = x - mu: ctx is a ce_sub_row_args, [begin, end) rows */
void mp_ce_sub_row_range(void *ctx, int64_t begin, int64_t end, int worker);
/* dW's finish: ctx is a ce_dw_finish_args, [begin, end) rows of dw */
void mp_ce_dw_finish_range(void *ctx, int64_t begin, int64_t end, int worker);
/* dX's finish: ctx is a ce_dx_finish_args, [begin, end) token rows of dx */
void mp_ce_dx_finish_range(void *ctx, int64_t begin, int64_t end, int worker);

#endif /* MOEPEAK_CE_CPU_H */
