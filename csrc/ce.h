/* ce.h: the extern "C" CUDA launchers of Ring-DTP's kernels (cuda/ce_fold.cu,
 * cuda/ce_grad.cu, cuda/ce_finish.cu), called by the bindings in csrc/ce_bind.c.
 * Shapes are [dims] with leading dimensions ld*; dtype codes 0 fp32, 1 bf16,
 * 2 fp16; every pointer is device memory; stream is a cudaStream_t as an int. */
#ifndef MOEPEAK_CE_H
#define MOEPEAK_CE_H
#include <stdint.h>

#include "moepeak.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- cuda/ce_fold.cu ---------------------------------------------------- */
/* z_dtype, out_dtype: 0 fp32, 1 bf16, 2 fp16 (low-precision logits: dZ in place, out == z). */
mp_status mp_ce_fold_cuda(const void *z, int z_dtype, int64_t ldz, int64_t t, int64_t v, int64_t v0,
                          int64_t v_valid, const int64_t *labels, int64_t ignore_index, float softcap, float *m,
                          float *s, float *zy, float *zsum, float *sx, uintptr_t stream);
/* ---- cuda/ce_grad.cu ---------------------------------------------------- */
mp_status mp_ce_grad_cuda(const void *z, int z_dtype, int64_t ldz, int64_t t, int64_t v, int64_t v0,
                          int64_t v_valid, const int64_t *labels, int64_t ignore_index, float softcap,
                          const float *mrow, const float *ls, const float *q, const float *g, int64_t g_stride,
                          float eps, int64_t n_classes, float zloss, void *out, int64_t ldo, int out_dtype,
                          uintptr_t stream);
/* ce_grad + column sums of the dZ written (target elements excluded) into cs [v] x fp32 (= or +=),
 * through part: [gmax, ldp] x fp32 scratch; tc [t] x fp32 or NULL: also the label column taken out
 * of dZ into tc (cuda/ce_grad.cu, ce_grad_colsum_kernel). */
mp_status mp_ce_grad_colsum_cuda(const void *z, int z_dtype, int64_t ldz, int64_t t, int64_t v, int64_t v0,
                                 int64_t v_valid, const int64_t *labels, int64_t ignore_index, float softcap,
                                 const float *mrow, const float *ls, const float *q, const float *g,
                                 int64_t g_stride, float eps, int64_t n_classes, float zloss, void *out, int64_t ldo,
                                 int out_dtype, float *part, int64_t ldp, int64_t gmax, float *cs, int first,
                                 float *tc, uintptr_t stream);
/* ---- cuda/ce_finish.cu: the scale, the centering's X - mu, the finishes -- */
/* p: [n] x dtype (0 fp32, 1 bf16, 2 fp16), p *= *g (g: one fp32), all on the device; nothing when *g == 1. */
mp_status mp_ce_scale_cuda(void *p, int dtype, int64_t n, const float *g, uintptr_t stream);
/* dw: [nv, ldw], x: [t, ldx] x dtype; sy, perm: [t] int64; tc: [t] fp32; all on the device. */
mp_status mp_ce_dw_finish_cuda(void *dw, int dtype, int64_t ldw, int64_t v0, int64_t nv, const void *x,
                               int64_t ldx, int64_t h, const int64_t *sy, const int64_t *perm, const float *tcs,
                               int64_t t, const float *cs, const float *mu, unsigned char *flags,
                               uintptr_t stream);
/* out: [n, ldo], x: [n, ldx], mu: [h] x dtype, on the device, 16-byte vectors: out = x - mu. */
mp_status mp_ce_sub_row_cuda(void *out, int64_t ldo, const void *x, int64_t ldx, const void *mu, int64_t n, int64_t h,
                             int dtype, uintptr_t stream);
/* dx: [t, ldx], w: [nv, ldw] x dtype; labels: [t] int64; tc: [t] fp32; all on the device. */
mp_status mp_ce_dx_finish_cuda(void *dx, int dtype, int64_t ldx, const void *w, int64_t ldw, int64_t v0,
                               int64_t nv, int64_t h, const int64_t *labels, const float *tc, int64_t t,
                               uintptr_t stream);

#ifdef __cplusplus
}
#endif
#endif /* MOEPEAK_CE_H */
