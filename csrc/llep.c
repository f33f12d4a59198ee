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
 *   gather_scaled  out[i, :] = src[idx[i] / div, :] * scale[i] (fp32 scale;
 *           one fp32 product rounded once to the rows' dtype, as torch's
 *           bf16 x fp32 broadcast multiply rounds it): backward's w*dy rows
 *           gathered and scaled in one pass;
 *   combine acc[idx[i] / div, :] += w[idx[i]] * y[i, :] in fp32 (w optional).
 *           The CPU version gives each thread a column range over all rows,
 *           so there are no races and the sum order is the row order.
 * The binding layer takes tensors as (data_ptr, sizes) ints; moepeak/llep/ops.py
 * validates every tensor before a pointer gets here. */
#include <stdlib.h>
#include <string.h>

#include "llep.h"
#include "mp_checks.h"
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
  const void *src;
  const int64_t *idx;
  const float *scale;
  int64_t div, N;
  int dtype;
  void *out;
} gather_scaled_ctx;

/* Rows [b, e): each element one fp32 product, rounded once (mp_half.h: RNE). */
static void gather_scaled_range(void *c, int64_t b, int64_t e, int w) {
  (void)w;
  const gather_scaled_ctx *g = (const gather_scaled_ctx *)c;
  const int64_t N = g->N;
  for (int64_t i = b; i < e; i++) {
    const int64_t r = (g->idx[i] / g->div) * N, o = i * N;
    const float wt = g->scale[i];
    if (g->dtype == MP_DTYPE_F32) {
      const float *s = (const float *)g->src + r;
      float *d = (float *)g->out + o;
      for (int64_t h = 0; h < N; h++) d[h] = s[h] * wt;
    } else if (g->dtype == MP_DTYPE_BF16) {
      const uint16_t *s = (const uint16_t *)g->src + r;
      uint16_t *d = (uint16_t *)g->out + o;
      for (int64_t h = 0; h < N; h++) d[h] = f32_to_bf16(bf16_to_f32(s[h]) * wt);
    } else {
      const uint16_t *s = (const uint16_t *)g->src + r;
      uint16_t *d = (uint16_t *)g->out + o;
      for (int64_t h = 0; h < N; h++) d[h] = f32_to_f16(f16_to_f32(s[h]) * wt);
    }
  }
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
    if (k->dtype == MP_DTYPE_F32) {
      const float *y = (const float *)k->y + i * k->H;
      for (int64_t h = b; h < e; h++) dst[h] += wt * y[h];
    } else if (k->dtype == MP_DTYPE_BF16) {
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

/* The planner tables' extents for P ranks and E experts: load [P, E], Q [E, P],
 * A [E, P, P], S [P, P] x int64, in bytes; ValueError when any overflows. */
static int llep_check_tables(const char *fn, int P, int E) {
  if (mp_check_min(fn, "P (ranks)", P, 1) || mp_check_min(fn, "E (experts)", E, 1)) return -1;
  return mp_check_extent(fn, "the A table's bytes (E x P x P x 8)", (long long)E * P, P, 8, NULL) ||
         mp_check_extent(fn, "the S table's bytes (P x P x 8)", P, P, 8, NULL);
}

/* The row-index table idx [rows] (CPU): every idx[i] >= 0 and
 * (idx[i] / div) * row_elems fits in int64, so the kernels' row offsets are
 * well-defined (rows past the source's end are the caller's contract). */
static int llep_check_row_index(const char *fn, const int64_t *idx, long long rows, long long div,
                                long long row_elems) {
  for (long long i = 0; i < rows; i++) {
    long long off;
    if (idx[i] < 0 || __builtin_mul_overflow((long long)(idx[i] / div), row_elems, &off)) {
      PyErr_Format(PyExc_ValueError, "moepeak._C.%s: idx[%lld] = %lld must be >= 0 and (idx / div) x row size "
                   "must fit in int64 (div %lld, row size %lld)", fn, i, (long long)idx[i], div, row_elems);
      return -1;
    }
  }
  return 0;
}

static PyObject *py_llep_plan(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long load, Q, A, S;
  int P, E, spilled = 0;
  double alpha, lam;
  long long m;
  if (!PyArg_ParseTuple(args, "KiidLdKKK", &load, &P, &E, &alpha, &m, &lam, &Q, &A, &S)) return NULL;
  const char *fn = "llep_plan";
  if (llep_check_tables(fn, P, E)) return NULL;
  if (E % P != 0) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.%s: E (experts, %d) must be a multiple of P (ranks, %d)", fn, E, P);
    return NULL;
  }
  /* alpha = +inf (unbounded capacity) and lam = +inf (never spill) are meaningful; NaN is not */
  if (mp_check_positive(fn, "alpha", alpha) || mp_check_not_nan(fn, "lam", lam) ||
      mp_check_min(fn, "min_tokens", m, 0))
    return NULL;
  const long long nload = (long long)P * E;
  if (mp_check_ptr(fn, "load", load, nload) || mp_check_ptr(fn, "Q", Q, nload) ||
      mp_check_ptr(fn, "A", A, nload * P) || mp_check_ptr(fn, "S", S, (long long)P * P))
    return NULL;
  /* every load >= 0 and their total fits in int64: the planner's sums (per
   * expert, per rank, in all) and the slices' prefix sums never overflow */
  long long total = 0;
  for (long long i = 0; i < nload; i++) {
    const long long l = ((const int64_t *)P_(load))[i];
    if (l < 0 || __builtin_add_overflow(total, l, &total)) {
      PyErr_Format(PyExc_ValueError, "moepeak._C.%s: load entries must be >= 0 with a total that fits in int64 "
                   "(load[%lld] = %lld)", fn, i, l);
      return NULL;
    }
  }
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
  const char *fn = "llep_num_chunks";
  if (mp_check_min(fn, "P (ranks)", P, 1)) return NULL;
  if (C < P) {
    PyErr_Format(PyExc_ValueError, "moepeak: chunk_rows (%lld) must be >= the number of ranks (%d)", C, P);
    return NULL;
  }
  if (mp_check_extent(fn, "the S table's bytes (P x P x 8)", P, P, 8, NULL) ||
      mp_check_ptr(fn, "S", S, (long long)P * P))
    return NULL;
  /* the kernel's ceil(S / q) is (S + q - 1) / q: S + q - 1 must fit */
  const long long q = C / P;
  for (long long i = 0; i < (long long)P * P; i++) {
    const long long v = ((const int64_t *)P_(S))[i];
    if (v < 0 || v > INT64_MAX - (q - 1)) {
      PyErr_Format(PyExc_ValueError, "moepeak._C.%s: S[%lld] = %lld must be in [0, %lld] (rows per rank pair)", fn,
                   i, v, (long long)(INT64_MAX - (q - 1)));
      return NULL;
    }
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
  const char *fn = "llep_chunk_layout";
  if (llep_check_tables(fn, P, E) || mp_check_range(fn, "r (rank)", r, 0, P) || mp_check_min(fn, "n", n, 1) ||
      mp_check_range(fn, "j (chunk)", j, 0, n) || mp_check_min(fn, "perm_cap", cap, 0))
    return NULL;
  if (mp_check_ptr(fn, "A", A, (long long)E * P * P) || mp_check_ptr(fn, "S", S, (long long)P * P) ||
      mp_check_ptr(fn, "send_start", ss, P) || mp_check_ptr(fn, "send_len", sl, P) ||
      mp_check_ptr(fn, "recv_len", rl, P) || mp_check_ptr(fn, "perm", perm, 0) /* 0: no permutation */ || mp_check_ptr(fn, "ecount", ec, E))
    return NULL;
  /* S [P, P]: every S >= 0 with S * n in int64 (the slice bounds S * j / n)
   * and each row's sum in int64 (the send list's offsets); A [E, P, P]: every
   * A >= 0 and sum_e A[e, s, d] == S[s, d] (the receive offsets stay inside
   * the slices the send side cuts). */
  const int64_t *St = (const int64_t *)P_(S), *At = (const int64_t *)P_(A);
  for (long long s = 0; s < P; s++) {
    long long row = 0, scaled;
    for (long long d = 0; d < P; d++) {
      const long long v = St[s * P + d];
      if (v < 0 || __builtin_mul_overflow(v, n, &scaled) || __builtin_add_overflow(row, v, &row)) {
        PyErr_Format(PyExc_ValueError, "moepeak._C.%s: S[%lld, %lld] = %lld must be >= 0, with S x n (n = %lld) "
                     "and each row's sum in int64", fn, s, d, v, n);
        return NULL;
      }
    }
  }
  for (long long s = 0; s < P; s++)
    for (long long d = 0; d < P; d++) {
      long long sum = 0;
      for (long long e = 0; e < E; e++) {
        const long long a = At[(e * P + s) * P + d];
        if (a < 0 || __builtin_add_overflow(sum, a, &sum)) {
          PyErr_Format(PyExc_ValueError, "moepeak._C.%s: A[%lld, %lld, %lld] = %lld must be >= 0", fn, e, s, d, a);
          return NULL;
        }
      }
      if (sum != St[s * P + d]) {
        PyErr_Format(PyExc_ValueError, "moepeak._C.%s: A[:, %lld, %lld] sums to %lld but S[%lld, %lld] = %lld "
                     "(A and S must come from one plan)", fn, s, d, sum, s, d, (long long)St[s * P + d]);
        return NULL;
      }
    }
  int64_t rows = 0;
  mp_status st = mp_llep_chunk_layout((const int64_t *)P_(A), (const int64_t *)P_(S), P, E, r, n, j,
                                      (int64_t *)P_(ss), (int64_t *)P_(sl), (int64_t *)P_(rl), (int64_t *)P_(perm),
                                      cap, (int64_t *)P_(ec), &rows);
  if (st != MP_OK) return mp_raise_status(st);
  return PyLong_FromLongLong(rows);
}

/* The sizes of an id list: n >= 0 ids of 8 bytes, E >= 1 experts, P >= 1 ranks. */
static int llep_check_ids(const char *fn, long long n, int E, int P) {
  return mp_check_min(fn, "n", n, 0) || mp_check_min(fn, "E", E, 1) || mp_check_min(fn, "P", P, 1) ||
         mp_check_extent(fn, "n ids' bytes (n x 8)", n, 8, 1, NULL);
}

static PyObject *py_llep_count(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long ids, cnt, stream;
  long long n;
  int E, cuda;
  if (!PyArg_ParseTuple(args, "KLiKpK", &ids, &n, &E, &cnt, &cuda, &stream)) return NULL;
  const char *fn = "llep_count";
  if (llep_check_ids(fn, n, E, 1) || mp_check_ptr(fn, "ids", ids, n) ||
      mp_check_ptr(fn, "cnt", cnt, (long long)E + 1))
    return NULL;
  if (cuda) {
#if MP_WITH_CUDA
    return mp_return_none(mp_llep_count_cuda((const int64_t *)P_(ids), n, E, (int64_t *)P_(cnt), (uintptr_t)stream));
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
  const char *fn = "llep_route_cpu";
  if (llep_check_ids(fn, n, E, P) || mp_check_ptr(fn, "ids", ids, n) ||
      mp_check_ptr(fn, "out", out, n) || mp_check_ptr(fn, "Ar", Ar, (long long)E * P) ||
      mp_check_ptr(fn, "cum", cum, (long long)E * P) || mp_check_ptr(fn, "blk", blk, (long long)E * P))
    return NULL;
  /* The tables must place every id inside out [n]: per expert e, Ar[e, :] >= 0
   * sums to the number of ids == e, cum[e, d] = sum_{d' < d} Ar[e, d'], and
   * each segment [blk, blk + Ar) lies inside [0, n). Ids outside [0, E) are
   * the kernel's error to report. */
  {
    const int64_t *idv = (const int64_t *)P_(ids), *Arv = (const int64_t *)P_(Ar), *cumv = (const int64_t *)P_(cum),
                  *blkv = (const int64_t *)P_(blk);
    int64_t *count = (int64_t *)calloc((size_t)E, sizeof *count);
    if (!count) return PyErr_NoMemory();
    for (long long i = 0; i < n; i++)
      if (idv[i] >= 0 && idv[i] < E) count[idv[i]]++;
    const char *bad = NULL;
    long long be = 0, bd = 0;
    for (long long e = 0; e < E && !bad; e++) {
      long long run = 0;
      for (long long d = 0; d < P && !bad; d++) {
        const long long a = Arv[e * P + d], c = cumv[e * P + d], b = blkv[e * P + d];
        be = e, bd = d;
        if (a < 0 || a > n) bad = "Ar";
        else if (c != run) bad = "cum";
        else if (b < 0 || b > n - a) bad = "blk";
        run += a; /* run <= n before, a <= n: no overflow */
        if (!bad && run > n) bad = "Ar";
      }
      if (!bad && run != count[e]) be = e, bd = -1, bad = "Ar";
    }
    free(count);
    if (bad) {
      PyErr_Format(PyExc_ValueError, "moepeak._C.%s: the route tables do not place expert %lld's ids inside "
                   "out [n = %lld]: %s is wrong at (%lld, %lld) (need Ar >= 0 summing to the expert's id count, "
                   "cum its exclusive prefix sum, 0 <= blk <= n - Ar)", fn, be, n, bad, be, bd);
      return NULL;
    }
  }
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
  const char *fn = "llep_route_cuda";
  if (llep_check_ids(fn, n, E, P) ||
      mp_check_extent(fn, "the tables' bytes (4 x E x P x 8)", (long long)E * P, 4, 8, NULL) ||
      mp_check_ptr(fn, "sorted_pos", pos, n) || mp_check_ptr(fn, "sorted_ids", sid, n) ||
      mp_check_ptr(fn, "out", out, n) || mp_check_ptr(fn, "tables", tables, 4LL * E * P))
    return NULL;
#if MP_WITH_CUDA
  return mp_return_none(mp_llep_route_cuda((const int64_t *)P_(pos), (const int64_t *)P_(sid), n, E, P,
                                    (const int64_t *)P_(tables), (int64_t *)P_(out), (uintptr_t)stream));
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
  const char *fn = "llep_gather";
  if (mp_check_extent(fn, "out's bytes (rows x row_bytes)", rows, row_bytes, 1, NULL) ||
      mp_check_ptr(fn, "idx", idx, rows) || mp_check_ptr(fn, "src", src, row_bytes ? rows : 0) ||
      mp_check_ptr(fn, "out", out, row_bytes ? rows : 0))
    return NULL;
  if (!cuda && llep_check_row_index(fn, (const int64_t *)P_(idx), rows, div, row_bytes)) return NULL;
  if (cuda) {
#if MP_WITH_CUDA
    return mp_return_none(mp_llep_gather_cuda(P_(src), (const int64_t *)P_(idx), rows, div, row_bytes, P_(out),
                                       (uintptr_t)stream));
#else
    return mp_raise_no_cuda("llep gather");
#endif
  }
  gather_ctx g = {(const char *)P_(src), (const int64_t *)P_(idx), div, row_bytes, (char *)P_(out)};
  return mp_py_parallel_for(rows, 64, gather_range, &g);
}

static PyObject *py_llep_gather_scaled(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long src, idx, scale, out, stream;
  long long rows, div, N;
  int dtype, cuda;
  if (!PyArg_ParseTuple(args, "KKKLLLiKpK", &src, &idx, &scale, &rows, &div, &N, &dtype, &out, &cuda, &stream))
    return NULL;
  if (!mp_dtype_valid(dtype) || div < 1 || N < 0 || rows < 0) {
    PyErr_SetString(PyExc_ValueError, "moepeak: llep gather_scaled needs dtype code 0..2, div >= 1, rows, N >= 0");
    return NULL;
  }
  const char *fn = "llep_gather_scaled";
  if (mp_check_extent(fn, "out's bytes (rows x N x 4)", rows, N, 4, NULL) || mp_check_ptr(fn, "idx", idx, rows) ||
      mp_check_ptr(fn, "scale", scale, rows) || mp_check_ptr(fn, "src", src, N ? rows : 0) ||
      mp_check_ptr(fn, "out", out, N ? rows : 0))
    return NULL;
  if (!cuda && llep_check_row_index(fn, (const int64_t *)P_(idx), rows, div, N)) return NULL;
  if (cuda) {
#if MP_WITH_CUDA
    return mp_return_none(mp_llep_gather_scaled_cuda(P_(src), (const int64_t *)P_(idx), (const float *)P_(scale),
                                                     rows, div, N, dtype, P_(out), (uintptr_t)stream));
#else
    return mp_raise_no_cuda("llep gather_scaled");
#endif
  }
  gather_scaled_ctx g = {P_(src), (const int64_t *)P_(idx), (const float *)P_(scale), div, N, dtype, P_(out)};
  return mp_py_parallel_for(rows, 16, gather_scaled_range, &g);
}

/* llep_swiglu_fwd / llep_swiglu_bwd: their bindings are in llep_swiglu.c. */
PyObject *mp_llep_py_swiglu_fwd(PyObject *self, PyObject *args);
PyObject *mp_llep_py_swiglu_bwd(PyObject *self, PyObject *args);

static PyObject *py_llep_combine(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long acc, y, idx, w, stream;
  int dtype, cuda;
  long long rows, div, H;
  if (!PyArg_ParseTuple(args, "KKiKKLLLpK", &acc, &y, &dtype, &idx, &w, &rows, &div, &H, &cuda, &stream))
    return NULL;
  if (!mp_dtype_valid(dtype) || div < 1 || H < 0 || rows < 0) {
    PyErr_SetString(PyExc_ValueError, "moepeak: llep combine needs dtype code 0..2, div >= 1, rows, H >= 0");
    return NULL;
  }
  const char *fn = "llep_combine";
  if (mp_check_extent(fn, "y's bytes (rows x H x 4)", rows, H, 4, NULL) || mp_check_ptr(fn, "idx", idx, rows) ||
      mp_check_ptr(fn, "y", y, H ? rows : 0) || mp_check_ptr(fn, "acc", acc, H ? rows : 0))
    return NULL;
  if (!cuda && llep_check_row_index(fn, (const int64_t *)P_(idx), rows, div, H)) return NULL;
  if (cuda) {
#if MP_WITH_CUDA
    return mp_return_none(mp_llep_combine_cuda((float *)P_(acc), P_(y), dtype, (const int64_t *)P_(idx),
                                        (const float *)P_(w), rows, div, H, (uintptr_t)stream));
#else
    return mp_raise_no_cuda("llep combine");
#endif
  }
  combine_ctx k = {(float *)P_(acc), P_(y), dtype, (const int64_t *)P_(idx), (const float *)P_(w), rows, div, H};
  return mp_py_parallel_for(H, 64, combine_range, &k);
}

static PyObject *py_llep_down_bwd(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long D, a, w, wp, dwr, stream;
  int dtype, cuda;
  long long rows, I;
  if (!PyArg_ParseTuple(args, "KKiKKKLLpK", &D, &a, &dtype, &w, &wp, &dwr, &rows, &I, &cuda, &stream)) return NULL;
  if (!mp_dtype_valid(dtype) || rows < 0 || I < 0) {
    PyErr_SetString(PyExc_ValueError, "moepeak: llep down_bwd needs dtype code 0..2, rows >= 0, I >= 0");
    return NULL;
  }
  const char *fn = "llep_down_bwd";
  if (mp_check_extent(fn, "D's bytes (rows x I x 4)", rows, I, 4, NULL) || mp_check_ptr(fn, "D", D, rows * I) ||
      mp_check_ptr(fn, "a", a, rows * I) || mp_check_ptr(fn, "w", w, rows) || mp_check_ptr(fn, "wp", wp, rows) ||
      mp_check_ptr(fn, "dwr", dwr, rows))
    return NULL;
  if (cuda) {
#if MP_WITH_CUDA
    return mp_return_none(mp_llep_down_bwd_cuda(P_(D), P_(a), dtype, (const float *)P_(w), (const float *)P_(wp),
                                         (float *)P_(dwr), rows, I, (uintptr_t)stream));
#else
    return mp_raise_no_cuda("llep down_bwd");
#endif
  }
  down_bwd_ctx k = {P_(D), P_(a), dtype, (const float *)P_(w), (const float *)P_(wp), (float *)P_(dwr), I};
  return mp_py_parallel_for(rows, 16, down_bwd_range, &k);
}

PyMethodDef mp_llep_methods[] = {
    {"llep_plan", py_llep_plan, METH_VARARGS,
     "llep_plan(load, P, E, alpha, min_tokens, lam, Q, A, S) -> spilled (int64 pointers; see csrc/llep.h)"},
    {"llep_num_chunks", py_llep_num_chunks, METH_VARARGS, "llep_num_chunks(S, P, C) -> n"},
    {"llep_chunk_layout", py_llep_chunk_layout, METH_VARARGS,
     "llep_chunk_layout(A, S, P, E, r, n, j, send_start, send_len, recv_len, perm_or_0, perm_cap, ecount) -> rows"},
    {"llep_count", py_llep_count, METH_VARARGS, "llep_count(ids, n, E, cnt, is_cuda, stream)"},
    {"llep_route_cpu", py_llep_route_cpu, METH_VARARGS, "llep_route_cpu(ids, n, E, P, Ar, cum, blk, out)"},
    {"llep_route_cuda", py_llep_route_cuda, METH_VARARGS,
     "llep_route_cuda(sorted_pos, sorted_ids, n, E, P, tables, out, stream)"},
    {"llep_gather", py_llep_gather, METH_VARARGS, "llep_gather(src, idx, rows, div, row_bytes, out, is_cuda, stream)"},
    {"llep_gather_scaled", py_llep_gather_scaled, METH_VARARGS,
     "llep_gather_scaled(src, idx, scale, rows, div, N, dtype, out, is_cuda, stream): see csrc/llep.h"},
    {"llep_swiglu_fwd", mp_llep_py_swiglu_fwd, METH_VARARGS,
     "llep_swiglu_fwd(h, ldh, a, s_or_0, rows, I, dtype, is_cuda, stream): see csrc/llep.h"},
    {"llep_swiglu_bwd", mp_llep_py_swiglu_bwd, METH_VARARGS,
     "llep_swiglu_bwd(h, ldh, da, s, dh, ldd, rows, I, dtype, is_cuda, stream): see csrc/llep.h"},
    {"llep_combine", py_llep_combine, METH_VARARGS,
     "llep_combine(acc, y, dtype, idx, w_or_0, rows, div, H, is_cuda, stream)"},
    {"llep_down_bwd", py_llep_down_bwd, METH_VARARGS,
     "llep_down_bwd(D, a, dtype, w, wp, dwr, rows, I, is_cuda, stream): see csrc/llep.h"},
    {NULL, NULL, 0, NULL},
};
