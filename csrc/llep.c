/* llep.c: PipelinedLLEP's CPU kernels and the Python bindings of the planner,
 * the chunk layout and the kernels (CPU here, CUDA in cuda/llep.cu).
 *
 * Kernels (the arithmetic torch lacks; GEMMs stay in torch):
 *   count   cnt[E + 1] (int64): tokens per expert, slot E counts bad ids;
 *   route   the stable counting sort that turns topk_ids [T, K] into rank r's
 *           dst-major send list of flat (t, k) indices (llep.h);
 *   gather  out[i, :] = src[idx[i] / div, :] (row copy). With div = K it
 *           gathers a chunk's send rows straight from x [T, H], so the
 *           T*K*H expanded copy never exists; with div = 1 it permutes rows;
 *   combine acc[idx[i] / div, :] += w[idx[i]] * y[i, :] in fp32 (w optional).
 *           The CPU version gives each thread a column range over all rows,
 *           so there are no races and the sum order is the row order.
 * The binding layer takes tensors as (data_ptr, sizes) ints; moepeak/llep.py
 * validates every tensor before a pointer gets here. */
#include <stdlib.h>
#include <string.h>

#include "llep.h"
#include "mp_half.h"
#include "mp_python.h"

/* ---- CPU kernels --------------------------------------------------------- */
void mp_llep_count_cpu(const int64_t *ids, int64_t n, int E, int64_t *cnt) {
  memset(cnt, 0, sizeof(int64_t) * ((size_t)E + 1));
  for (int64_t i = 0; i < n; i++) {
    const int64_t e = ids[i];
    cnt[(e >= 0 && e < E) ? e : E]++;
  }
}

mp_status mp_llep_route_cpu(const int64_t *ids, int64_t n, int E, int P, const int64_t *Ar, const int64_t *cum,
                            const int64_t *blk, int64_t *out) {
  mp_status st = MP_OK;
  int64_t *fill = (int64_t *)calloc((size_t)E, sizeof *fill);
  if (!fill) MP_FAIL(st, MP_ERR_NOMEM, "llep route: out of host memory");
  for (int64_t i = 0; i < n; i++) {
    const int64_t e = ids[i];
    if (e < 0 || e >= E) MP_FAIL(st, MP_ERR_INVALID, "llep route: id %lld at %lld outside [0, %d)", (long long)e,
                                 (long long)i, E);
    const int64_t p = fill[e]++;
    int d = 0;
    while (d < P - 1 && p >= cum[e * P + d] + Ar[e * P + d]) d++;
    out[blk[e * P + d] + p - cum[e * P + d]] = i;
  }
fail:
  free(fill);
  return st;
}

typedef struct {
  const char *src;
  const int64_t *idx;
  int64_t div, row_bytes;
  char *out;
} gather_ctx;

static void gather_range(void *c, int64_t b, int64_t e, int w) {
  (void)w;
  const gather_ctx *g = (const gather_ctx *)c;
  for (int64_t i = b; i < e; i++)
    memcpy(g->out + i * g->row_bytes, g->src + (g->idx[i] / g->div) * g->row_bytes, (size_t)g->row_bytes);
}

typedef struct {
  float *acc;
  const void *y;
  int dtype;
  const int64_t *idx;
  const float *w;
  int64_t rows, div, H;
} combine_ctx;

/* [b, e) is a column range; every row is visited in order. */
static void combine_range(void *c, int64_t b, int64_t e, int wk) {
  (void)wk;
  const combine_ctx *k = (const combine_ctx *)c;
  for (int64_t i = 0; i < k->rows; i++) {
    const int64_t id = k->idx[i];
    const float wt = k->w ? k->w[id] : 1.0f;
    float *dst = k->acc + (id / k->div) * k->H;
    if (k->dtype == MP_LLEP_F32) {
      const float *y = (const float *)k->y + i * k->H;
      for (int64_t h = b; h < e; h++) dst[h] += wt * y[h];
    } else if (k->dtype == MP_LLEP_BF16) {
      const uint16_t *y = (const uint16_t *)k->y + i * k->H;
      for (int64_t h = b; h < e; h++) dst[h] += wt * bf16_to_f32(y[h]);
    } else {
      const uint16_t *y = (const uint16_t *)k->y + i * k->H;
      for (int64_t h = b; h < e; h++) dst[h] += wt * f16_to_f32(y[h]);
    }
  }
}

/* ---- down projection's backward epilogue (see llep.h) ---- */
typedef struct {
  void *D, *a;
  int dtype;
  const float *w, *wp;
  float *dwr;
  int64_t I;
} down_bwd_ctx;

static void down_bwd_range(void *c, int64_t b, int64_t e, int wk) {
  (void)wk;
  const down_bwd_ctx *k = (const down_bwd_ctx *)c;
  for (int64_t r = b; r < e; r++) {
    const int64_t o = r * k->I;
    float dot = 0.f;
    for (int64_t i = 0; i < k->I; i++) dot += mp_ld_el(k->D, k->dtype, o + i) * mp_ld_el(k->a, k->dtype, o + i);
    k->dwr[r] = dot / k->wp[r];
    const float sc = k->w[r] / k->wp[r];
    if (sc != 1.0f) /* only rows whose weight was replaced by 1 (|w| tiny or 0) */
      for (int64_t i = 0; i < k->I; i++) {
        mp_st_el(k->D, k->dtype, o + i, sc * mp_ld_el(k->D, k->dtype, o + i));
        mp_st_el(k->a, k->dtype, o + i, sc * mp_ld_el(k->a, k->dtype, o + i));
      }
  }
}

/* ---- bindings ------------------------------------------------------------ */
#define P_(x) ((void *)(uintptr_t)(x))

static PyObject *py_llep_plan(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long load, Q, A, S;
  int P, E, spilled = 0;
  double alpha, lam;
  long long m;
  if (!PyArg_ParseTuple(args, "KiidLdKKK", &load, &P, &E, &alpha, &m, &lam, &Q, &A, &S)) return NULL;
  mp_status st = mp_llep_plan((const int64_t *)P_(load), P, E, alpha, (int64_t)m, lam, (int64_t *)P_(Q),
                              (int64_t *)P_(A), (int64_t *)P_(S), &spilled);
  if (st != MP_OK) return mp_raise_status(st);
  return PyBool_FromLong(spilled);
}

static PyObject *py_llep_num_chunks(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long S;
  int P;
  long long C;
  if (!PyArg_ParseTuple(args, "KiL", &S, &P, &C)) return NULL;
  if (P < 1 || C < P) {
    PyErr_Format(PyExc_ValueError, "moepeak: chunk_rows (%lld) must be >= the number of ranks (%d)", C, P);
    return NULL;
  }
  return PyLong_FromLongLong(mp_llep_num_chunks((const int64_t *)P_(S), P, (int64_t)C));
}

static PyObject *py_llep_chunk_layout(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long A, S, ss, sl, rl, perm, ec;
  int P, E, r;
  long long n, j, cap;
  if (!PyArg_ParseTuple(args, "KKiiiLLKKKKLK", &A, &S, &P, &E, &r, &n, &j, &ss, &sl, &rl, &perm, &cap, &ec))
    return NULL;
  int64_t rows = 0;
  mp_status st = mp_llep_chunk_layout((const int64_t *)P_(A), (const int64_t *)P_(S), P, E, r, n, j,
                                      (int64_t *)P_(ss), (int64_t *)P_(sl), (int64_t *)P_(rl), (int64_t *)P_(perm),
                                      cap, (int64_t *)P_(ec), &rows);
  if (st != MP_OK) return mp_raise_status(st);
  return PyLong_FromLongLong(rows);
}

static PyObject *py_llep_count(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long ids, cnt, stream;
  long long n;
  int E, cuda;
  if (!PyArg_ParseTuple(args, "KLiKpK", &ids, &n, &E, &cnt, &cuda, &stream)) return NULL;
  if (cuda) {
#if MP_WITH_CUDA
    mp_status st = mp_llep_count_cuda((const int64_t *)P_(ids), n, E, (int64_t *)P_(cnt), (uintptr_t)stream);
    if (st != MP_OK) return mp_raise_status(st);
    Py_RETURN_NONE;
#else
    return mp_raise_no_cuda("llep count");
#endif
  }
  mp_status st;
  MP_CALL_NOGIL(st, (mp_llep_count_cpu((const int64_t *)P_(ids), n, E, (int64_t *)P_(cnt)), MP_OK));
  Py_RETURN_NONE;
fail:
  return NULL;
}

static PyObject *py_llep_route_cpu(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long ids, Ar, cum, blk, out;
  long long n;
  int E, P;
  if (!PyArg_ParseTuple(args, "KLiiKKKK", &ids, &n, &E, &P, &Ar, &cum, &blk, &out)) return NULL;
  mp_status st;
  MP_CALL_NOGIL(st, mp_llep_route_cpu((const int64_t *)P_(ids), n, E, P, (const int64_t *)P_(Ar),
                                   (const int64_t *)P_(cum), (const int64_t *)P_(blk),
                                   (int64_t *)P_(out)));
  Py_RETURN_NONE;
fail:
  return NULL;
}

static PyObject *py_llep_route_cuda(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long pos, sid, tables, out, stream;
  long long n;
  int E, P;
  if (!PyArg_ParseTuple(args, "KKLiiKKK", &pos, &sid, &n, &E, &P, &tables, &out, &stream)) return NULL;
#if MP_WITH_CUDA
  mp_status st = mp_llep_route_cuda((const int64_t *)P_(pos), (const int64_t *)P_(sid), n, E, P,
                                    (const int64_t *)P_(tables), (int64_t *)P_(out), (uintptr_t)stream);
  if (st != MP_OK) return mp_raise_status(st);
  Py_RETURN_NONE;
#else
  (void)pos; (void)sid; (void)tables; (void)out; (void)stream; (void)n; (void)E; (void)P;
  return mp_raise_no_cuda("llep route");
#endif
}

static PyObject *py_llep_gather(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long src, idx, out, stream;
  long long rows, div, row_bytes;
  int cuda;
  if (!PyArg_ParseTuple(args, "KKLLLKpK", &src, &idx, &rows, &div, &row_bytes, &out, &cuda, &stream)) return NULL;
  if (div < 1 || row_bytes < 0 || rows < 0) {
    PyErr_SetString(PyExc_ValueError, "moepeak: llep gather needs div >= 1, rows >= 0, row_bytes >= 0");
    return NULL;
  }
  if (cuda) {
#if MP_WITH_CUDA
    mp_status st = mp_llep_gather_cuda(P_(src), (const int64_t *)P_(idx), rows, div, row_bytes, P_(out),
                                       (uintptr_t)stream);
    if (st != MP_OK) return mp_raise_status(st);
    Py_RETURN_NONE;
#else
    return mp_raise_no_cuda("llep gather");
#endif
  }
  gather_ctx g = {(const char *)P_(src), (const int64_t *)P_(idx), div, row_bytes, (char *)P_(out)};
  mp_status st;
  MP_CALL_NOGIL(st, mp_parallel_for(rows, 64, 0, gather_range, &g));
  Py_RETURN_NONE;
fail:
  return NULL;
}

static PyObject *py_llep_combine(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long acc, y, idx, w, stream;
  int dtype, cuda;
  long long rows, div, H;
  if (!PyArg_ParseTuple(args, "KKiKKLLLpK", &acc, &y, &dtype, &idx, &w, &rows, &div, &H, &cuda, &stream))
    return NULL;
  if (dtype < MP_LLEP_F32 || dtype > MP_LLEP_F16 || div < 1 || H < 0 || rows < 0) {
    PyErr_SetString(PyExc_ValueError, "moepeak: llep combine needs dtype code 0..2, div >= 1, rows, H >= 0");
    return NULL;
  }
  if (cuda) {
#if MP_WITH_CUDA
    mp_status st = mp_llep_combine_cuda((float *)P_(acc), P_(y), dtype, (const int64_t *)P_(idx),
                                        (const float *)P_(w), rows, div, H, (uintptr_t)stream);
    if (st != MP_OK) return mp_raise_status(st);
    Py_RETURN_NONE;
#else
    return mp_raise_no_cuda("llep combine");
#endif
  }
  combine_ctx k = {(float *)P_(acc), P_(y), dtype, (const int64_t *)P_(idx), (const float *)P_(w), rows, div, H};
  mp_status st;
  MP_CALL_NOGIL(st, mp_parallel_for(H, 64, 0, combine_range, &k));
  Py_RETURN_NONE;
fail:
  return NULL;
}

static PyObject *py_llep_down_bwd(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long D, a, w, wp, dwr, stream;
  int dtype, cuda;
  long long rows, I;
  if (!PyArg_ParseTuple(args, "KKiKKKLLpK", &D, &a, &dtype, &w, &wp, &dwr, &rows, &I, &cuda, &stream)) return NULL;
  if (dtype < MP_LLEP_F32 || dtype > MP_LLEP_F16 || rows < 0 || I < 0) {
    PyErr_SetString(PyExc_ValueError, "moepeak: llep down_bwd needs dtype code 0..2, rows >= 0, I >= 0");
    return NULL;
  }
  if (cuda) {
#if MP_WITH_CUDA
    mp_status st = mp_llep_down_bwd_cuda(P_(D), P_(a), dtype, (const float *)P_(w), (const float *)P_(wp),
                                         (float *)P_(dwr), rows, I, (uintptr_t)stream);
    if (st != MP_OK) return mp_raise_status(st);
    Py_RETURN_NONE;
#else
    return mp_raise_no_cuda("llep down_bwd");
#endif
  }
  down_bwd_ctx k = {P_(D), P_(a), dtype, (const float *)P_(w), (const float *)P_(wp), (float *)P_(dwr), I};
  mp_status st;
  MP_CALL_NOGIL(st, mp_parallel_for(rows, 16, 0, down_bwd_range, &k));
  Py_RETURN_NONE;
fail:
  return NULL;
}

PyMethodDef mp_llep_methods[] = {
    {"llep_plan", py_llep_plan, METH_VARARGS,
     "llep_plan(load, P, E, alpha, min_tokens, lam, Q, A, S) -> spilled (int64 pointers; see csrc/llep.h)"},
    {"llep_num_chunks", py_llep_num_chunks, METH_VARARGS, "llep_num_chunks(S, P, C) -> n"},
    {"llep_chunk_layout", py_llep_chunk_layout, METH_VARARGS,
     "llep_chunk_layout(A, S, P, E, r, n, j, send_start, send_len, recv_len, perm, perm_cap, ecount) -> rows"},
    {"llep_count", py_llep_count, METH_VARARGS, "llep_count(ids, n, E, cnt, is_cuda, stream)"},
    {"llep_route_cpu", py_llep_route_cpu, METH_VARARGS, "llep_route_cpu(ids, n, E, P, Ar, cum, blk, out)"},
    {"llep_route_cuda", py_llep_route_cuda, METH_VARARGS,
     "llep_route_cuda(sorted_pos, sorted_ids, n, E, P, tables, out, stream)"},
    {"llep_gather", py_llep_gather, METH_VARARGS, "llep_gather(src, idx, rows, div, row_bytes, out, is_cuda, stream)"},
    {"llep_combine", py_llep_combine, METH_VARARGS,
     "llep_combine(acc, y, dtype, idx, w_or_0, rows, div, H, is_cuda, stream)"},
    {"llep_down_bwd", py_llep_down_bwd, METH_VARARGS,
     "llep_down_bwd(D, a, dtype, w, wp, dwr, rows, I, is_cuda, stream): see csrc/llep.h"},
    {NULL, NULL, 0, NULL},
};
