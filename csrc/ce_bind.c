/* ce_bind.c: the Python bindings of Ring-DTP's arithmetic (moepeak._C.ce_*):
 * argument checks, then the CPU kernels (csrc/ce.c, csrc/ce_cpu.h) on the thread
 * pool without the GIL, or the CUDA launchers (csrc/ce.h). The math and the block
 * layout are in csrc/ce.c's header. */
#include <string.h>

#include "ce.h"
#include "ce_cpu.h"
#include "mp_checks.h"
#include "mp_python.h"

/* ------------------------------------------------------------------------- */
/* Bindings. Pointers arrive as ints from ring_dtp.py, which has checked the   */
/* tensors' shapes, dtypes, devices and contiguity (never call these directly). */
/* ------------------------------------------------------------------------- */
/* The block's fields both bindings share: logits z [t, ldz] (first v columns,
 * global columns v0.., v_valid of them real vocab), labels [t], options. */
static ce_args ce_block_args(unsigned long long z, long long ldz, long long t, long long v, long long v0,
                             long long v_valid, unsigned long long labels, long long ignore, double softcap) {
  ce_args a;
  memset(&a, 0, sizeof a);
  a.z = (float *)(uintptr_t)z;
  a.ldz = ldz; a.t = t; a.v = v; a.v0 = v0; a.v_valid = v_valid;
  a.labels = (const int64_t *)(uintptr_t)labels;
  a.ignore_index = ignore;
  a.softcap = (float)softcap;
  return a;
}

static int ce_check_sizes(const char *fn, const ce_args *a, int cuda) {
  if (a->t < 0 || a->v < 0 || a->ldz < a->v || a->n_classes < 0) {
    PyErr_Format(PyExc_ValueError,
                 "moepeak._C.ce: bad block sizes t=%lld v=%lld ldz=%lld (need t, v >= 0 and ldz >= v)",
                 (long long)a->t, (long long)a->v, (long long)a->ldz);
    return -1;
  }
  /* global columns: v0 >= 0, v0 + v in int64 (the kernels form v0 + nv and
   * y - v0); z [t, ldz] addressable; softcap c: 0 (none) or finite > 0 */
  if (mp_check_min(fn, "v0", a->v0, 0) || mp_check_min(fn, "v_valid", a->v_valid, 0) ||
      mp_check_sum(fn, "v0 + v", a->v0, a->v) ||
      mp_check_extent(fn, "z's bytes (t x ldz x 4)", a->t, a->ldz, 4, NULL) ||
      mp_check_ptr(fn, "z", (uintptr_t)a->z, a->v ? a->t : 0) ||
      mp_check_ptr(fn, "labels", (uintptr_t)a->labels, a->t) || mp_check_finite(fn, "softcap", a->softcap))
    return -1;
  if (a->softcap < 0.f) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.%s: softcap must be 0 (none) or > 0", fn);
    return -1;
  }
  /* CPU labels: ignore_index or >= 0 (ring_dtp.py maps labels outside the
   * vocabulary to ignore_index), so y - v0 never overflows */
  if (!cuda)
    for (int64_t i = 0; i < a->t; i++)
      if (a->labels[i] < 0 && a->labels[i] != a->ignore_index) {
        PyErr_Format(PyExc_ValueError, "moepeak._C.%s: labels[%lld] = %lld must be >= 0 or ignore_index (%lld)", fn,
                     (long long)i, (long long)a->labels[i], (long long)a->ignore_index);
        return -1;
      }
  return 0;
}

/* Per-row fp32 vectors [t] the block kernels read or write. */
static int ce_check_rows(const char *fn, long long t, const char *n1, unsigned long long p1, const char *n2,
                         unsigned long long p2, const char *n3, unsigned long long p3) {
  return mp_check_ptr(fn, n1, p1, t) || mp_check_ptr(fn, n2, p2, t) || mp_check_ptr(fn, n3, p3, t);
}

/* ce_fold(z, z_dtype, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, m, s, zy, zsum, sx, cuda, stream)
 * z_dtype: 0 fp32 (the only CPU choice), 1 bf16, 2 fp16 (CUDA). */
static PyObject *py_ce_fold(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long z, labels, m, s, zy, zsum, sx, stream;
  long long ldz, t, v, v0, v_valid, ignore;
  double softcap;
  int cuda, z_dtype;
  if (!PyArg_ParseTuple(args, "KiLLLLLKLdKKKKKpK:ce_fold", &z, &z_dtype, &ldz, &t, &v, &v0, &v_valid, &labels, &ignore,
                        &softcap, &m, &s, &zy, &zsum, &sx, &cuda, &stream))
    return NULL;
  ce_args a = ce_block_args(z, ldz, t, v, v0, v_valid, labels, ignore, softcap);
  a.m = (float *)(uintptr_t)m; a.s = (float *)(uintptr_t)s;
  a.zy = (float *)(uintptr_t)zy; a.zsum = (float *)(uintptr_t)zsum; a.sx = (float *)(uintptr_t)sx;
  a.n_classes = 1;
  if (ce_check_sizes("ce_fold", &a, cuda) || ce_check_rows("ce_fold", t, "m", m, "s", s, "zy", zy) ||
      ce_check_rows("ce_fold", t, "zsum", zsum, "sx", sx, "zsum", zsum))
    return NULL;
  if (!mp_dtype_valid(z_dtype) || (!cuda && z_dtype != MP_DTYPE_F32)) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.ce_fold: z_dtype must be 0 (fp32) on CPU, 0..2 on CUDA, got %d",
                 z_dtype);
    return NULL;
  }
  if (t == 0) Py_RETURN_NONE;
  if (cuda) {
#if MP_WITH_CUDA
    return mp_return_none(
        mp_ce_fold_cuda(a.z, z_dtype, ldz, t, v, v0, v_valid, a.labels, ignore, a.softcap, a.m, a.s, a.zy, a.zsum,
            a.sx, (uintptr_t)stream));
#else
    return mp_raise_no_cuda("ce_fold");
#endif
  } else {
    return mp_py_parallel_for(t, CE_ROW_GRAIN, mp_ce_fold_rows, &a);
  }
}

/* ce_grad(z, z_dtype, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, m, ls, q, g, g_stride, eps, n_classes,
 *         zloss, out, ldo, out_dtype, cuda, stream[, part, ldp, gmax, cs, first, tc])
 * part != 0 (CUDA): also cs (=, or += unless first) the column sums of the dZ written without the target
 * elements, through part: [gmax, ldp] x fp32 scratch, and with tc != 0 ([t] x fp32) the label column
 * taken out of dZ into tc (mp_ce_grad_colsum_cuda).
 * out_dtype: 0 fp32 in place (out must equal z; the only CPU choice), 1 bf16, 2 fp16 (CUDA).
 * z_dtype: 0 fp32; 1 bf16 / 2 fp16 logits (CUDA) need out_dtype == z_dtype, out == z, ldo == ldz. */
static PyObject *py_ce_grad(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long z, labels, mrow, ls, q, g, out, stream;
  long long ldz, t, v, v0, v_valid, ignore, g_stride, n_classes, ldo;
  double softcap, eps, zloss;
  int out_dtype, cuda, z_dtype;
  unsigned long long part = 0, cs = 0, tc = 0;
  long long ldp = 0, gmax = 0;
  int first = 0;
  if (!PyArg_ParseTuple(args, "KiLLLLLKLdKKKKLdLdKLipK|KLLKpK:ce_grad", &z, &z_dtype, &ldz, &t, &v, &v0, &v_valid,
                        &labels, &ignore, &softcap, &mrow, &ls, &q, &g, &g_stride, &eps, &n_classes, &zloss, &out,
                        &ldo, &out_dtype, &cuda, &stream, &part, &ldp, &gmax, &cs, &first, &tc))
    return NULL;
  ce_args a = ce_block_args(z, ldz, t, v, v0, v_valid, labels, ignore, softcap);
  a.mrow = (const float *)(uintptr_t)mrow;
  a.ls = (const float *)(uintptr_t)ls;
  a.g = (const float *)(uintptr_t)g;
  a.q = (const float *)(uintptr_t)q;
  a.g_stride = g_stride;
  a.eps = (float)eps; a.zloss = (float)zloss; a.n_classes = n_classes;
  const char *fn = "ce_grad";
  if (ce_check_sizes(fn, &a, cuda) || ce_check_rows(fn, t, "m", mrow, "ls", ls, "q", q) ||
      mp_check_ptr(fn, "g", g, t ? (g_stride ? t : 1) : 0) || mp_check_ptr(fn, "out", out, v ? t : 0) ||
      mp_check_finite(fn, "eps", eps) || mp_check_finite(fn, "zloss", zloss))
    return NULL;
  if (out != z && mp_check_extent(fn, "out's bytes (t x ldo x 4)", t, ldo, 4, NULL)) return NULL;
  if (part && (mp_check_min(fn, "ldp", ldp, 0) || mp_check_min(fn, "gmax", gmax, 0) ||
               mp_check_extent(fn, "part's bytes (gmax x ldp x 4)", gmax, ldp, 4, NULL) ||
               mp_check_ptr(fn, "cs", cs, v)))
    return NULL;
  if (n_classes < 1 || (g_stride != 0 && g_stride != 1) || !mp_dtype_valid(out_dtype)) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.ce_grad: need n_classes >= 1 (got %lld), g_stride 0 or 1 "
                 "(got %lld), out_dtype 0..2 (got %d)", n_classes, g_stride, out_dtype);
    return NULL;
  }
  if (!mp_dtype_valid(z_dtype) || (!cuda && z_dtype != MP_DTYPE_F32) ||
      (z_dtype != MP_DTYPE_F32 && (out_dtype != z_dtype || out != z || ldo != ldz))) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.ce_grad: z_dtype %d: low-precision logits (1, 2; CUDA only) "
                 "need out_dtype == z_dtype and dZ in place (out == z, ldo == ldz)", z_dtype);
    return NULL;
  }
  if (tc && !part) {
    PyErr_SetString(PyExc_ValueError, "moepeak._C.ce_grad: tc (the label column taken out) comes only with the "
                    "fused column sums (part, cs)");
    return NULL;
  }
  if (t == 0) Py_RETURN_NONE;
  if (cuda) {
#if MP_WITH_CUDA
    if (out_dtype != MP_DTYPE_F32 && ldo < v) {
      PyErr_Format(PyExc_ValueError, "moepeak._C.ce_grad: ldo=%lld < v=%lld", ldo, v);
      return NULL;
    }
    if (part)
      return mp_return_none(
          mp_ce_grad_colsum_cuda(a.z, z_dtype, ldz, t, v, v0, v_valid, a.labels, ignore, a.softcap, a.mrow, a.ls,
              a.q, a.g, g_stride, a.eps, n_classes, a.zloss,
              out_dtype == MP_DTYPE_F32 ? (void *)a.z : (void *)(uintptr_t)out, out_dtype == MP_DTYPE_F32 ? ldz : ldo,
              out_dtype, (float *)(uintptr_t)part, ldp, gmax, (float *)(uintptr_t)cs,
              first, (float *)(uintptr_t)tc, (uintptr_t)stream));
    else
      return mp_return_none(
          mp_ce_grad_cuda(a.z, z_dtype, ldz, t, v, v0, v_valid, a.labels, ignore, a.softcap, a.mrow, a.ls, a.q, a.g,
              g_stride, a.eps, n_classes, a.zloss, (void *)(uintptr_t)out, ldo, out_dtype, (uintptr_t)stream));
#else
    return mp_raise_no_cuda("ce_grad");
#endif
  } else {
    if (out_dtype != MP_DTYPE_F32 || out != z) {
      PyErr_SetString(PyExc_ValueError, "moepeak._C.ce_grad: on CPU the gradient is written in place (fp32)");
      return NULL;
    }
    if (part) {
      PyErr_SetString(PyExc_ValueError, "moepeak._C.ce_grad: the fused column sums (part, cs) are CUDA only "
                      "(on CPU: moepeak.ring_dtp.blocks.colsum_acc_ after the gradient)");
      return NULL;
    }
    return mp_py_parallel_for(t, CE_ROW_GRAIN, mp_ce_grad_rows, &a);
  }
}

/* ce_scale(t, dtype, n, g, cuda, stream): t: [n] x dtype (0 fp32, 1 bf16, 2 fp16), contiguous;
 * g: [1] x fp32 on the same device (read on the device on CUDA: no host sync). t *= g. */
static PyObject *py_ce_scale(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long t, g, stream;
  long long n;
  int dtype, cuda;
  if (!PyArg_ParseTuple(args, "KiLKpK:ce_scale", &t, &dtype, &n, &g, &cuda, &stream)) return NULL;
  if (!mp_dtype_valid(dtype) || n < 0) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.ce_scale: need dtype 0..2 (got %d) and n >= 0 (got %lld)", dtype, n);
    return NULL;
  }
  if (mp_check_extent("ce_scale", "t's bytes (n x 4)", n, 4, 1, NULL) || mp_check_ptr("ce_scale", "t", t, n) ||
      mp_check_ptr("ce_scale", "g", g, n ? 1 : 0))
    return NULL;
  if (n == 0) Py_RETURN_NONE;
  if (cuda) {
#if MP_WITH_CUDA
    return mp_return_none(
        mp_ce_scale_cuda((void *)(uintptr_t)t, dtype, n, (const float *)(uintptr_t)g, (uintptr_t)stream));
#else
    return mp_raise_no_cuda("ce_scale");
#endif
  } else {
    ce_scale_args a = {(void *)(uintptr_t)t, dtype, *(const float *)(uintptr_t)g};
    if (a.g == 1.0f) Py_RETURN_NONE; /* x * 1 == x exactly: nothing to do */
    return mp_py_parallel_for(n, CE_SCALE_GRAIN, mp_ce_scale_range, &a);
  }
}

/* ce_dw_finish(dw, dtype, ldw, v0, nv, x, ldx, h, sy, perm, tcs, t, cs, mu, flags, cuda, stream): dw:
 * [nv, ldw] and x: [t, ldx] x dtype (0 fp32, 1 bf16, 2 fp16); sy, perm: [t] int64 (labels sorted
 * stably, their token indices); tcs: [t] x fp32, the label terms in sy's order (tc[perm[k]] at k);
 * cs: [nv], mu: [h] x fp32, both 0 (no rank-1 term) or
 * both set; flags: [nv] zeroed bytes, the CUDA kernels' scratch with the rank-1 term (else unused).
 * dw[r, :h] += [cs[r] * mu +] sum_{t: label v0 + r} tc[t] * x[t, :h] in fp32, one rounding. */
static PyObject *py_ce_dw_finish(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long dw, x, sy, perm, tc, cs, mu, flags, stream;
  long long ldw, v0, nv, ldx, h, t;
  int dtype, cuda;
  if (!PyArg_ParseTuple(args, "KiLLLKLLKKKLKKKpK:ce_dw_finish", &dw, &dtype, &ldw, &v0, &nv, &x, &ldx, &h, &sy,
                        &perm, &tc, &t, &cs, &mu, &flags, &cuda, &stream))
    return NULL;
  if (!mp_dtype_valid(dtype) || t < 0 || nv < 0 || h < 0 || ldw < h || ldx < h || (!cs) != (!mu)) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.ce_dw_finish: need dtype 0..2, t, nv, h >= 0, ldw >= h, ldx >= h, "
                 "cs and mu both set or both 0 (got dtype=%d t=%lld nv=%lld h=%lld ldw=%lld ldx=%lld cs=%s mu=%s)",
                 dtype, t, nv, h, ldw, ldx, cs ? "set" : "0", mu ? "set" : "0");
    return NULL;
  }
  if (cuda && cs && !flags) {
    PyErr_SetString(PyExc_ValueError, "moepeak._C.ce_dw_finish: flags ([nv] zeroed bytes) must be set on CUDA with "
                                      "the rank-1 term (cs, mu)");
    return NULL;
  }
  const char *fn = "ce_dw_finish";
  const long long esz = dtype == MP_DTYPE_F32 ? 4 : 2;
  if (mp_check_min(fn, "v0", v0, 0) || mp_check_sum(fn, "v0 + nv", v0, nv) ||
      mp_check_extent(fn, "dw's bytes (nv x ldw x size)", nv, ldw, esz, NULL) ||
      mp_check_extent(fn, "x's bytes (t x ldx x size)", t, ldx, esz, NULL) ||
      mp_check_ptr(fn, "dw", dw, h ? nv : 0) || mp_check_ptr(fn, "x", x, h ? t : 0) || mp_check_ptr(fn, "sy", sy, t) ||
      mp_check_ptr(fn, "perm", perm, t) || mp_check_ptr(fn, "tcs", tc, t))
    return NULL;
  /* perm: token rows of x, each in [0, t) (CPU: read here; CUDA: the caller's) */
  if (!cuda)
    for (long long k = 0; k < t; k++) {
      const long long p = ((const int64_t *)(uintptr_t)perm)[k];
      if (mp_check_range(fn, "perm[k]", p, 0, t)) return NULL;
    }
  if (nv == 0 || h == 0 || (t == 0 && !cs)) Py_RETURN_NONE;
  if (cuda) {
#if MP_WITH_CUDA
    return mp_return_none(
        mp_ce_dw_finish_cuda((void *)(uintptr_t)dw, dtype, ldw, v0, nv, (const void *)(uintptr_t)x, ldx, h,
            (const int64_t *)(uintptr_t)sy, (const int64_t *)(uintptr_t)perm, (const float *)(uintptr_t)tc, t,
            (const float *)(uintptr_t)cs, (const float *)(uintptr_t)mu, (unsigned char *)(uintptr_t)flags,
            (uintptr_t)stream));
#else
    return mp_raise_no_cuda("ce_dw_finish");
#endif
  } else {
    ce_dw_finish_args a = {(void *)(uintptr_t)dw, dtype, ldw, v0, nv, (const void *)(uintptr_t)x, ldx, h,
                           (const int64_t *)(uintptr_t)sy, (const int64_t *)(uintptr_t)perm,
                           (const float *)(uintptr_t)tc, t, (const float *)(uintptr_t)cs,
                           (const float *)(uintptr_t)mu};
    return mp_py_parallel_for(nv, 16, mp_ce_dw_finish_range, &a);
  }
}

/* ce_sub_row(out, ldo, x, ldx, mu, n, h, dtype, cuda, stream): out: [n, ldo], x: [n, ldx], mu: [h],
 * all dtype (0 fp32, 1 bf16, 2 fp16). out[i, :h] = x[i, :h] - mu (fp32, one rounding). On CUDA h,
 * ldx, ldo are multiples of a 16-byte vector's elements and the pointers 16-byte aligned. */
static PyObject *py_ce_sub_row(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long out, x, mu, stream;
  long long ldo, ldx, n, h;
  int dtype, cuda;
  if (!PyArg_ParseTuple(args, "KLKLKLLipK:ce_sub_row", &out, &ldo, &x, &ldx, &mu, &n, &h, &dtype, &cuda, &stream))
    return NULL;
  if (!mp_dtype_valid(dtype) || n < 0 || h < 0 || ldo < h || ldx < h) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.ce_sub_row: need dtype 0..2, n, h >= 0, ldo >= h, ldx >= h (got "
                 "dtype=%d n=%lld h=%lld ldo=%lld ldx=%lld)", dtype, n, h, ldo, ldx);
    return NULL;
  }
  const char *fn = "ce_sub_row";
  const long long esz = dtype == MP_DTYPE_F32 ? 4 : 2;
  if (mp_check_extent(fn, "out's bytes (n x ldo x size)", n, ldo, esz, NULL) ||
      mp_check_extent(fn, "x's bytes (n x ldx x size)", n, ldx, esz, NULL) ||
      mp_check_ptr(fn, "out", out, h ? n : 0) || mp_check_ptr(fn, "x", x, h ? n : 0) ||
      mp_check_ptr(fn, "mu", mu, n ? h : 0))
    return NULL;
  if (n == 0 || h == 0) Py_RETURN_NONE;
  if (cuda) {
#if MP_WITH_CUDA
    return mp_return_none(
        mp_ce_sub_row_cuda((void *)(uintptr_t)out, ldo, (const void *)(uintptr_t)x, ldx,
            (const void *)(uintptr_t)mu, n, h, dtype, (uintptr_t)stream));
#else
    return mp_raise_no_cuda("ce_sub_row");
#endif
  } else {
    ce_sub_row_args a = {(void *)(uintptr_t)out, ldo, (const void *)(uintptr_t)x, ldx, (const void *)(uintptr_t)mu,
                         h, dtype};
    return mp_py_parallel_for(n, 16, mp_ce_sub_row_range, &a);
  }
}

/* ce_dx_finish(dx, dtype, ldx, w, ldw, v0, nv, h, labels, tc, t, cuda, stream): dx: [t, ldx] and
 * w: [nv, ldw] x dtype (0 fp32, 1 bf16, 2 fp16), w's rows the labels v0 .. v0 + nv - 1; labels: [t]
 * int64; tc: [t] x fp32. dx[t, :h] += tc[t] * w[labels[t] - v0, :h] (fmaf, one rounding) where that
 * row exists. */
static PyObject *py_ce_dx_finish(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long dx, w, labels, tc, stream;
  long long ldx, ldw, v0, nv, h, t;
  int dtype, cuda;
  if (!PyArg_ParseTuple(args, "KiLKLLLLKKLpK:ce_dx_finish", &dx, &dtype, &ldx, &w, &ldw, &v0, &nv, &h, &labels,
                        &tc, &t, &cuda, &stream))
    return NULL;
  if (!mp_dtype_valid(dtype) || t < 0 || nv < 0 || h < 0 || ldx < h || ldw < h) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.ce_dx_finish: need dtype 0..2, t, nv, h >= 0, ldx >= h, ldw >= h "
                 "(got dtype=%d t=%lld nv=%lld h=%lld ldx=%lld ldw=%lld)", dtype, t, nv, h, ldx, ldw);
    return NULL;
  }
  const char *fn = "ce_dx_finish";
  const long long esz = dtype == MP_DTYPE_F32 ? 4 : 2;
  if (mp_check_min(fn, "v0", v0, 0) || mp_check_sum(fn, "v0 + nv", v0, nv) ||
      mp_check_extent(fn, "dx's bytes (t x ldx x size)", t, ldx, esz, NULL) ||
      mp_check_extent(fn, "w's bytes (nv x ldw x size)", nv, ldw, esz, NULL) ||
      mp_check_ptr(fn, "dx", dx, h ? t : 0) || mp_check_ptr(fn, "w", w, h ? nv : 0) ||
      mp_check_ptr(fn, "labels", labels, t) || mp_check_ptr(fn, "tc", tc, t))
    return NULL;
  /* CPU labels: any value (ignore_index, other shards' rows), but labels[t] - v0 must not overflow */
  if (!cuda)
    for (long long i = 0; i < t; i++) {
      long long r;
      const long long y = ((const int64_t *)(uintptr_t)labels)[i];
      if (__builtin_sub_overflow(y, v0, &r)) {
        PyErr_Format(PyExc_ValueError, "moepeak._C.%s: labels[%lld] = %lld minus v0 = %lld overflows int64", fn, i,
                     y, v0);
        return NULL;
      }
    }
  if (nv == 0 || h == 0 || t == 0) Py_RETURN_NONE;
  if (cuda) {
#if MP_WITH_CUDA
    return mp_return_none(
        mp_ce_dx_finish_cuda((void *)(uintptr_t)dx, dtype, ldx, (const void *)(uintptr_t)w, ldw, v0, nv, h,
            (const int64_t *)(uintptr_t)labels, (const float *)(uintptr_t)tc, t, (uintptr_t)stream));
#else
    return mp_raise_no_cuda("ce_dx_finish");
#endif
  } else {
    ce_dx_finish_args a = {(void *)(uintptr_t)dx, dtype, ldx, (const void *)(uintptr_t)w, ldw, v0, nv, h,
                           (const int64_t *)(uintptr_t)labels, (const float *)(uintptr_t)tc};
    return mp_py_parallel_for(t, 16, mp_ce_dx_finish_range, &a);
  }
}

PyMethodDef mp_ce_methods[] = {
    {"ce_fold", py_ce_fold, METH_VARARGS,
     "ce_fold(z, z_dtype, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, m, s, zy, zsum, sx, cuda, stream): "
     "fold a fp32 logits block into per-row (m, s, zy, zsum, sx)."},
    {"ce_grad", py_ce_grad, METH_VARARGS,
     "ce_grad(z, z_dtype, ldz, t, v, v0, v_valid, labels, ignore_index, softcap, m, ls, q, g, g_stride, eps, n_classes, "
     "zloss, out, ldo, out_dtype, cuda, stream[, part, ldp, gmax, cs, first, tc]): turn a logits block into dZ "
     "(and, on CUDA with part, sum its columns without the target elements into cs; with tc also take the "
     "label column out of dZ into tc)."},
    {"ce_dw_finish", py_ce_dw_finish, METH_VARARGS,
     "ce_dw_finish(dw, dtype, ldw, v0, nv, x, ldx, h, sy, perm, tcs, t, cs, mu, flags, cuda, stream): dw[r] += "
     "[cs[r] * mu +] sum over tokens labelled v0 + r of tc[t] * x[t] (fp32 sum, one rounding; tcs = tc[perm], "
     "the terms in sy's order); flags: "
     "[nv] zeroed bytes of scratch, needed on CUDA with the rank-1 term, else 0."},
    {"ce_dx_finish", py_ce_dx_finish, METH_VARARGS,
     "ce_dx_finish(dx, dtype, ldx, w, ldw, v0, nv, h, labels, tc, t, cuda, stream): dx[t] += "
     "tc[t] * w[labels[t] - v0] where that row exists (fmaf, one rounding)."},
    {"ce_sub_row", py_ce_sub_row, METH_VARARGS,
     "ce_sub_row(out, ldo, x, ldx, mu, n, h, dtype, cuda, stream): out[i, :h] = x[i, :h] - mu (fp32, one "
     "rounding)"},
    {"ce_scale", py_ce_scale, METH_VARARGS,
     "ce_scale(t, dtype, n, g, cuda, stream): t[0:n] *= g[0] in fp32 with one rounding (nothing when g == 1)."},
    {NULL, NULL, 0, NULL},
};
